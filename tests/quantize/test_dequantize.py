"""`mxforge dequantize` on the tiny fixture, and the error report of quantize checked against its output.

Dequantized weights must equal Quark's own dequantization of the MXFP4 tensors; every other tensor must be
the MXFP4 checkpoint's bytes. The per-tensor errors quantize reported (measured in the kernels while
quantizing) must be what the dequantized checkpoint shows against the bf16 source.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import MXFP6_RECIPE, cli, one_error_line
from safetensors import safe_open

from mxforge.checkpoint import INDEX_NAME, Checkpoint
from mxforge.formats import FORMATS, MXFP4, format_named
from mxforge.formats.quark import quark_dequantize_weight
from mxforge.provenance import DEQUANTIZE_NAME


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    c = Checkpoint.open(ckpt)
    out = {}
    for shard in c.shard_names:
        with safe_open(str(ckpt / shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


MIXED = "glm-5.2-mxfp4-attn-fp8"  # MXFP4 experts and FP8 PTPC attention
MXFP6 = "mxfp6"  # helpers.MXFP6_RECIPE: MXFP6 E2M3 experts, E3M2 attention (stored alike: uint8 codes, E8M0 scales)
PTPC, E2M3, E3M2 = format_named("fp8_ptpc"), format_named("mxfp6_e2m3"), format_named("mxfp6_e3m2")
# (scale rule, recipe: None the default)
RUNS = [("quark", None), ("mse", None), ("quark", MIXED), ("mse", MIXED), ("quark", MXFP6)]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{r}-{recipe or 'default'}" for r, recipe in RUNS])
def runs(request, tiny_ckpt, tmp_path_factory) -> tuple[str, Path, Path, dict]:
    """(scale rule, quantized checkpoint, its dequantization, quantize's report)."""
    rule, recipe = request.param
    work = tmp_path_factory.mktemp(f"deq-{rule}")
    mxfp4, bf16 = work / "mxfp4", work / "bf16"
    if recipe == MXFP6:
        (work / "mxfp6.toml").write_text(MXFP6_RECIPE)
        recipe = str(work / "mxfp6.toml")
    cli(
        "quantize",
        str(tiny_ckpt),
        str(mxfp4),
        "--quiet",
        "--scale-rule",
        rule,
        "--json",
        str(work / "q.json"),
        *(("--recipe", recipe) if recipe else ()),
        check=True,
    )
    proc = cli("dequantize", str(mxfp4), str(bf16), "--json", str(work / "d.json"), check=True)
    assert "dequantized" in proc.stdout
    return rule, mxfp4, bf16, json.loads((work / "q.json").read_text())


def _format(name: str, codes: torch.Tensor, recipe: str):
    """The registry entry of a stored weight, from what the run's recipe asked for: FP8 PTPC has its own codes' dtype;
    the MXFP6 recipe writes attention (not the indexer) E3M2 and the rest E2M3, stored alike."""
    if codes.dtype == torch.float8_e4m3fn:
        return PTPC
    if recipe != MXFP6:
        return MXFP4
    return E3M2 if ".self_attn." in name and ".indexer." not in name else E2M3


@pytest.mark.quark
def test_dequantized_weights_equal_quarks_dequantization_and_the_rest_is_untouched(runs):
    rule, mxfp4, bf16, report = runs
    packed, unpacked = _tensors(mxfp4), _tensors(bf16)
    scales = {n for n in packed if n.endswith(".weight_scale")}
    assert scales and not any(n.endswith(".weight_scale") for n in unpacked)
    assert set(unpacked) == set(packed) - scales
    for name, t in unpacked.items():
        if f"{name}_scale" in scales:
            fmt = _format(name, packed[name], report["recipe"]["name"])
            rows, packed_inner = packed[name].shape
            assert t.dtype == torch.bfloat16 and t.shape == (rows, fmt.unpacked_inner(packed_inner))
            want = quark_dequantize_weight(fmt, packed[name], packed[f"{name}_scale"], torch.bfloat16)
            assert torch.equal(t, want.to(torch.bfloat16)), name
        else:
            assert t.dtype == packed[name].dtype and torch.equal(t.view(torch.uint8), packed[name].view(torch.uint8)), (
                name
            )
    config = json.loads((bf16 / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == json.loads((mxfp4 / "config.json").read_text())["architectures"]
    index = json.loads((bf16 / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(unpacked)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in unpacked.values())
    done = json.loads((bf16 / DEQUANTIZE_NAME).read_text())
    assert done["status"] == "done" and done["dequantized"] == len(scales)
    want = Counter(_format(n, packed[n], report["recipe"]["name"]).name for n in packed if f"{n}_scale" in scales)
    assert done["by_format"] == dict(want)
    assert (
        not list(bf16.glob("*.partial"))
        and (bf16 / "tokenizer.json").read_bytes() == (mxfp4 / "tokenizer.json").read_bytes()
    )


def test_quantize_error_report_is_what_the_dequantized_checkpoint_shows(runs, tiny_ckpt):
    """The error figures are those of the values the codes encode: the dequantized checkpoint's where they are exact
    in bf16 (MXFP4), else (an FP8 value times a float32 scale) Quark's own dequantization in float32."""
    rule, packed_dir, bf16, report = runs
    source, unpacked, packed = _tensors(tiny_ckpt), _tensors(bf16), _tensors(packed_dir)
    recipe = report["recipe"]["name"]
    for name, codes in packed.items():
        if _format(name, codes, recipe) == PTPC and name + "_scale" in packed:
            unpacked[name] = quark_dequantize_weight(PTPC, codes, packed[name + "_scale"], torch.float32)
    error = report["error"]
    assert error["scale_rule"] == rule and error["tensors_measured"] == report["counts"]["quantized"]
    total_err = total_ref = 0.0
    for name, measured in error["tensors"].items():
        x, q = source[name].double(), unpacked[name].double()
        err, ref = ((x - q) ** 2).sum().item(), (x**2).sum().item()
        total_err, total_ref = total_err + err, total_ref + ref
        assert measured["rel_rmse"] == pytest.approx((err / ref) ** 0.5, abs=2e-6), name
        assert measured["max_abs_err"] == pytest.approx((x - q).abs().max().item(), rel=1e-5), name
    assert error["overall"]["rel_rmse"] == pytest.approx((total_err / total_ref) ** 0.5, abs=2e-6)
    assert error["worst"][0]["rel_rmse"] == max(t["rel_rmse"] for t in error["tensors"].values())
    formats = {name: _format(name, t, recipe).name for name, t in packed.items() if name in error["tensors"]}
    if recipe == MIXED:
        assert set(error["by_class"]) == {"experts", "shared_experts", "mtp", "attention", "indexer"}
    elif recipe == MXFP6:
        assert set(error["by_class"]) == {"experts", "shared_experts", "mtp", "attention"}
    else:
        assert set(error["by_class"]) == {"experts", "shared_experts", "mtp"}  # the default recipe's MXFP4 classes
    assert set(error["by_format"]) == set(formats.values())
    for fmt, pooled in error["by_format"].items():  # each format's tensors pooled, from the dequantized weights
        names = [n for n, f in formats.items() if f == fmt]
        sums = [
            (((source[n].double() - unpacked[n].double()) ** 2).sum().item(), (source[n].double() ** 2).sum().item())
            for n in names
        ]
        assert pooled["tensors"] == len(names)
        assert pooled["rel_rmse"] == pytest.approx((sum(e for e, _ in sums) / sum(r for _, r in sums)) ** 0.5, abs=2e-6)
    if recipe == MXFP6:  # both decoded: E3M2 has 2 mantissa bits, E2M3 3 (in wider, Gaussian-like weights here)
        assert set(error["by_format"]) == {E2M3.name, E3M2.name}
    if recipe == MIXED:  # FP8 E4M3's 3 mantissa bits against E2M1's 1
        assert error["by_format"]["fp8_ptpc"]["rel_rmse"] < error["by_format"]["mxfp4"]["rel_rmse"] / 3


def test_scale_rule_is_recorded_in_quantization_config_only_when_not_quarks(runs):
    rule, mxfp4, _, report = runs
    qc = json.loads((mxfp4 / "config.json").read_text())["quantization_config"]
    assert report["recipe"]["scale_rule"] == rule
    if rule == "quark":
        assert "mxforge" not in qc  # Quark's config exactly (tests/quantize/test_quantize_e2e.py compares the bytes)
    else:
        assert qc["mxforge"]["scale_rule"] == rule and qc["mxforge"]["recipe"] == report["recipe"]["name"]


def test_refuses_a_foreign_out_and_a_checkpoint_without_mxfp4(runs, tiny_ckpt, tmp_path):
    _, mxfp4, _, _ = runs
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert "not a previous `mxforge dequantize` output" in one_error_line(cli("dequantize", str(mxfp4), str(foreign)))
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"] and (foreign / "notes.txt").read_text() == "mine"
    line = one_error_line(cli("dequantize", str(tiny_ckpt), str(tmp_path / "o")))
    assert f"holds no weight stored in an element format ({', '.join(f.title for f in FORMATS)}:" in line, line


@pytest.mark.quark
def test_nan_scales_make_their_whole_block_nan_with_one_warning_line(runs, tmp_path):
    """E8M0 0xFF is NaN (OCP MX v1.0, 5.3.1), and a block with a NaN scale is NaN in all 32 elements: the
    dequantized weight holds NaN there (not a mix of +-inf and NaN), numpy prints nothing, and the report and the
    command give one warning line naming the tensor and its block count. Quark's own dequantization (what its
    model loading runs) is what the other blocks equal; in the NaN blocks it writes the mix this replaces."""
    import shutil
    import warnings

    from mxforge.quantize.dequantize import dequantize_checkpoint

    rule, mxfp4, _, quantized = runs
    if rule != "quark" or quantized["recipe"]["name"] == MXFP6:
        pytest.skip("one scale rule is enough; MXFP4's codes (MXFP6's E8M0 scales are the same bytes)")
    tampered = shutil.copytree(mxfp4, tmp_path / "nan")
    ckpt = Checkpoint.open(tampered)
    infos = ckpt.tensor_infos()
    weight = sorted(n for n in infos if n + "_scale" in infos and infos[n].dtype == "U8")[0]  # MXFP4's NaN code
    scale = infos[weight + "_scale"]
    rows, blocks = scale.shape
    hit = [(0, 0), (1, blocks - 1), (rows - 1, 0)]
    path = tampered / ckpt.weight_map[weight + "_scale"]
    data = bytearray(path.read_bytes())
    for r, b in hit:
        data[scale.start + r * blocks + b] = 0xFF
    path.write_bytes(bytes(data))
    packed = _tensors(tampered)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy RuntimeWarning fails the test
        report = dequantize_checkpoint(tampered, tmp_path / "out", quiet=True)
    assert report["nan_scale_blocks"] == {weight: 3}
    assert report["warnings"] == [
        f"tensor {weight!r}: 3 block(s) of 32 with a NaN scale (E8M0 0xFF) written as NaN throughout (OCP MX); "
        "the MXFP4 checkpoint holds NaN there"
    ]
    out = _tensors(tmp_path / "out")[weight].float()
    nan_mask = torch.zeros_like(out, dtype=torch.bool)
    for r, b in hit:
        nan_mask[r, 32 * b : 32 * (b + 1)] = True
    assert torch.isnan(out[nan_mask]).all() and not torch.isnan(out[~nan_mask]).any()
    quark = quark_dequantize_weight(MXFP4, packed[weight], packed[weight + "_scale"], torch.bfloat16).float()
    assert torch.equal(out[~nan_mask], quark[~nan_mask])
    # Quark decodes 0xFF as 2^128 = inf: a zero code becomes NaN (0 * inf), every other code +-inf.
    zero_code = torch.stack([packed[weight] & 0xF, packed[weight] >> 4], dim=2).reshape(rows, -1)[:, : out.shape[1]]
    is_zero = (zero_code & 0x7) == 0
    assert torch.equal(torch.isnan(quark[nan_mask]), is_zero[nan_mask])
    assert torch.isinf(quark[nan_mask & ~is_zero]).all()

    proc = cli("dequantize", str(tampered), str(tmp_path / "cli"))
    assert proc.returncode == 0 and "RuntimeWarning" not in proc.stderr, proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if "warning" in ln.lower()] == [
        f"mxforge dequantize: warning: {report['warnings'][0]}"
    ]
