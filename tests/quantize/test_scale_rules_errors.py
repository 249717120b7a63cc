"""The error statistics the kernels measure while quantizing, and the mse scale rule, in every kernel.

Statistics are checked against an independent float64 computation from the dequantized output; the mse
rule against a brute-force search over the three exponents; Quark's bytes must not move when statistics
are measured.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mxforge.formats import ERROR_STATS, MXFP4
from mxforge.formats.mxfp4 import numerics
from mxforge.formats.mxfp4._kernel import quantize_rows_rule
from mxforge.formats.mxfp4._native import bf16_kernel
from mxforge.formats.mxfp4.numerics import quantize_rows_cpu
from mxforge.models import layout_of
from mxforge.models.fixture import preset_config
from mxforge.quantize.error_report import error_report, figures, tensor_record
from mxforge.quantize.scale_rules import SCALE_RULES, get_scale_rule


def quantize_mxfp4(weight, scale_rule=None):
    return MXFP4.quantize(weight, offsets=get_scale_rule(scale_rule).offsets)


def dequantize_mxfp4(codes, scales, inner):
    return MXFP4.dequantize(codes, scales, inner)


MSE = SCALE_RULES["mse"].offsets
GRID = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    heavy = torch.randn(64, 512, generator=g) * torch.rand(64, 1, generator=g) * 0.05
    heavy[::7, ::13] *= 9  # outliers: blocks where clipping and the exponent choice matter
    short = torch.randn(8, 40, generator=g)  # a short last block (40 = 32 + 8)
    zeros = torch.cat([torch.zeros(4, 32), torch.randn(4, 32, generator=g)], dim=1)
    return {
        "heavy_bf16": heavy.to(torch.bfloat16),
        "heavy_f32": heavy,
        "short_bf16": short.to(torch.bfloat16),
        "zeros_bf16": zeros.to(torch.bfloat16),
        "gaussian_bf16": (0.02 * torch.randn(128, 1024, generator=g)).to(torch.bfloat16),
    }


def _kernels(weight: torch.Tensor) -> list[str]:
    kernels = ["numba", "torch"]
    if weight.dtype == torch.bfloat16 and bf16_kernel() is not None:
        kernels.append("c")
    return kernels


def _run(kernel: str, weight: torch.Tensor, offsets, stats):
    out, inner = weight.shape
    codes = np.empty((out, inner // 2), np.uint8)
    scales = np.empty((out, -(-inner // 32)), np.uint8)
    if kernel == "torch":
        numerics.quantize_torch(
            weight, torch.from_numpy(codes), torch.from_numpy(scales), torch.device("cpu"), offsets, stats
        )
        return codes, scales
    rows = weight.view(torch.int16).numpy() if weight.dtype == torch.bfloat16 else weight.numpy()
    if kernel == "c":
        quantize_rows_cpu(rows, codes, scales, offsets, stats)  # bf16 with a compiler: the C kernel
    else:
        bits = (rows.astype(np.int32) << 16) if rows.dtype == np.int16 else rows.view(np.int32)
        sink = stats if stats is not None else np.zeros(ERROR_STATS)
        quantize_rows_rule(
            bits, bits.view(np.float32), codes, scales, np.asarray(offsets, np.int64), sink, stats is not None
        )
    return codes, scales


def _reference_stats(weight: torch.Tensor, codes, scales) -> list[float]:
    """Sum of squared errors, sum of squares, max |error|, clipped count, computed from the output in float64."""
    inner = weight.shape[1]
    x = weight.double()
    q = dequantize_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), inner).double()
    top = 6 * torch.ldexp(torch.ones(scales.shape, dtype=torch.float64), torch.from_numpy(scales).double() - 127)
    top = top.repeat_interleave(32, dim=1)[:, :inner]
    return [((x - q) ** 2).sum().item(), (x**2).sum().item(), (x - q).abs().max().item(), int((x.abs() > top).sum())]


@pytest.mark.parametrize("rule", sorted(SCALE_RULES))
@pytest.mark.parametrize("name", list(_weights()))
def test_every_kernel_measures_the_same_errors_as_the_output_shows(name, rule):
    weight = _weights()[name]
    offsets = SCALE_RULES[rule].offsets
    for kernel in _kernels(weight):
        stats = np.zeros(ERROR_STATS)
        codes, scales = _run(kernel, weight, offsets, stats)
        want = _reference_stats(weight, codes, scales)
        assert stats[0] == pytest.approx(want[0], rel=2e-5), kernel
        assert stats[1] == pytest.approx(want[1], rel=2e-5), kernel
        assert stats[2] == pytest.approx(want[2], rel=1e-6), kernel
        assert stats[3] == want[3], kernel
    if name == "heavy_bf16":
        assert want[3] > 0  # the case exercises clipping


@pytest.mark.parametrize("name", list(_weights()))
def test_measuring_errors_leaves_quarks_bytes_alone(name):
    weight = _weights()[name]
    want_codes, want_scales = (
        t.numpy() for t in quantize_mxfp4(weight)
    )  # the Quark-exact path (tests/quantize/test_mxfp4.py)
    for kernel in _kernels(weight):
        codes, scales = _run(kernel, weight, (0,), np.zeros(ERROR_STATS))
        assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales), kernel


def _brute_force_mse(weight: torch.Tensor, quark_scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block: the float64 squared error of Quark's exponent and of the best of the three candidates."""
    out, inner = weight.shape
    nb = quark_scales.shape[1]
    x = torch.nn.functional.pad(weight.double().abs(), (0, nb * 32 - inner)).reshape(out, nb, 32)
    errors = []
    for d in (0, 1, -1):
        byte = torch.from_numpy(quark_scales).double() + d
        scale = torch.ldexp(torch.ones_like(byte), byte - 127).unsqueeze(-1)
        q = x / scale
        code = (
            (q >= 0.75).long()
            + (q >= 1.75).long()
            + (q >= 3.5).long()
            + (q > 0.25).long()
            + (q > 1.25).long()
            + (q > 2.5).long()
            + (q > 5.0).long()
        )
        err = ((x - GRID[code] * scale) ** 2).sum(-1)
        errors.append(torch.where((byte >= 1) & (byte <= 254), err, torch.full_like(err, float("inf"))))
    stacked = torch.stack(errors)
    return stacked[0].numpy(), stacked.min(0).values.numpy()


@pytest.mark.parametrize("name", list(_weights()))
def test_mse_rule_picks_the_least_error_exponent_identically_in_every_kernel(name):
    weight = _weights()[name]
    _, quark_scales = (t.numpy() for t in quantize_mxfp4(weight))
    results = {k: _run(k, weight, MSE, None) for k in _kernels(weight)}
    first = next(iter(results.values()))
    for kernel, (codes, scales) in results.items():  # the same bytes from every kernel (one float order)
        assert np.array_equal(codes, first[0]) and np.array_equal(scales, first[1]), kernel
    codes, scales = first
    assert set(np.unique(scales.astype(int) - quark_scales.astype(int))) <= {-1, 0, 1}
    quark_err, best_err = _brute_force_mse(weight, quark_scales)
    chosen_err, _ = _brute_force_mse(weight, scales)  # error of the exponent the kernel chose
    assert np.all(chosen_err <= best_err * (1 + 1e-5) + 1e-300)  # the optimum, up to float32 rounding
    assert np.all(chosen_err <= quark_err * (1 + 1e-5) + 1e-300)  # never worse than Quark's exponent per block
    if name in ("heavy_bf16", "gaussian_bf16"):
        assert (scales != quark_scales).any() and chosen_err.sum() < quark_err.sum()


def test_mse_rule_keeps_quarks_exponent_on_a_tie():
    w = torch.zeros(2, 64)
    w[0, :32] = 6.0  # exact on Quark's scale: any other exponent is worse
    codes, scales = quantize_mxfp4(w, scale_rule="mse")
    assert scales.tolist() == quantize_mxfp4(w)[1].tolist()  # all-zero blocks tie at 0 error: Quark's byte 1
    assert get_scale_rule(None).is_quark and not get_scale_rule("mse").is_quark


def test_report_aggregates_pooled_sums_and_names_the_worst():
    records = {
        "model.layers.0.mlp.experts.0.up_proj.weight": tensor_record([1.0, 100.0, 0.5, 10], 1000),
        "model.layers.0.self_attn.o_proj.weight": tensor_record([4.0, 100.0, 0.25, 0], 1000),
        "model.layers.3.mlp.experts.1.up_proj.weight": tensor_record([9.0, 100.0, 1.0, 30], 1000),
        "model.layers.3.mlp.experts.2.up_proj.weight": tensor_record([0.0, 0.0, 0.0, 0], 0),
    }
    layout = layout_of({**preset_config("tiny")[0], "num_hidden_layers": 3, "num_nextn_predict_layers": 1})
    report = error_report(records, layout, scale_rule="quark")
    assert report["tensors_measured"] == 3 and report["tensors_not_measured"] == [
        "model.layers.3.mlp.experts.2.up_proj.weight"
    ]
    assert report["overall"]["rel_rmse"] == pytest.approx((14 / 300) ** 0.5, rel=1e-5)
    assert report["overall"]["clipped_fraction"] == pytest.approx(40 / 3000)
    assert set(report["by_class"]) == {"experts", "attention", "mtp"}  # layer 3 is the MTP layer here
    assert report["by_layer"]["0"]["tensors"] == 2 and report["by_layer"]["0"]["max_abs_err"] == 0.5
    assert report["worst"][0]["name"] == "model.layers.3.mlp.experts.1.up_proj.weight"
    assert report["worst"][0]["snr_db"] == pytest.approx(10 * np.log10(100 / 9), abs=1e-3)
    assert figures(tensor_record([0.0, 5.0, 0.0, 0], 10))["snr_db"] is None  # no error: no finite SNR


def test_resume_keeps_the_error_report_and_a_new_scale_rule_redoes_every_shard(tiny_ckpt, tmp_path):
    from helpers import cli

    out = tmp_path / "out"

    def quantize(*extra: str) -> dict:
        cli("quantize", str(tiny_ckpt), str(out), "--quiet", "--json", str(tmp_path / "r.json"), *extra, check=True)
        return json.loads((tmp_path / "r.json").read_text())

    first = quantize()
    assert first["error"]["tensors_measured"] == first["counts"]["quantized"] > 0
    again = quantize()  # every shard skipped: the figures come from the resume state
    assert again["shards"]["skipped_complete"] == again["shards"]["total"] and again["error"] == first["error"]
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.unlink()
    partly = quantize()
    assert partly["shards"]["quantized_now"] == 1 and partly["error"] == first["error"]
    mse = quantize("--scale-rule", "mse")
    assert mse["shards"]["quantized_now"] == mse["shards"]["total"] and mse["error"]["scale_rule"] == "mse"
    assert mse["error"]["overall"]["rel_rmse"] < first["error"]["overall"]["rel_rmse"]
    unmeasured = quantize("--scale-rule", "quark", "--no-error-report")
    assert unmeasured["error"] is None and unmeasured["shards"]["quantized_now"] == unmeasured["shards"]["total"]
