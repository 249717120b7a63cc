"""MXFP6 E2M3 and E3M2 (OCP MX FP6) against Quark 0.13: every byte of codes and scales equal to Quark's file-to-file
routine on bf16, fp16 and float32 weights (zeros, subnormals, outliers, a short last block), on the CPU kernel (C for
bf16) and the torch one; the C kernel equal to the torch one on every rounding tie and edge, with and without a scale
rule, its error sums too; decoding equal to Quark's own dequantization; the code tables OCP's; the mse scale rule
never worse than Quark's exponent, block by block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxforge.formats import ERROR_STATS, format_named
from mxforge.formats.ocp_mx import c_kernel

FORMATS = [format_named("mxfp6_e2m3"), format_named("mxfp6_e3m2")]
IDS = [f.name for f in FORMATS]


def test_code_tables_are_ocps():
    """OCP MX v1.0, table 4: E2M3 (bias 1) spans 0.125 .. 7.5, E3M2 (bias 3) 0.0625 .. 28; 32 magnitudes each, the
    sign in bit 5; four codes in three bytes."""
    e2m3, e3m2 = FORMATS
    assert e2m3.values[1] == 0.125 and e2m3.values[8] == 1.0 and e2m3.max_value == 7.5
    assert e3m2.values[1] == 0.0625 and e3m2.values[4] == 0.25 and e3m2.max_value == 28.0
    for fmt in FORMATS:
        mags = fmt.values[:32]
        assert list(mags) == sorted(mags) and fmt.values[32:] == tuple(-v for v in mags)
        assert fmt.packed_shapes((4, 200)) == ((4, 150), (4, 7))
        assert "4 per 3 bytes" in fmt.describe() and fmt.unpackable(6) is not None


def _weights(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 200, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(1)  # a short last block (200)
    w[0] = 0
    w[1, :40] = 0
    w[2, 3] = 1e4 * w[2].abs().max()  # an outlier that widens its block's scale
    w[3, :] = 2.0**-133  # float32 subnormals (0 in fp16 and bf16's range ends)
    return [w.to(dtype), (torch.randn(8, 4096, generator=g) * 0.02).to(dtype)]


@pytest.mark.quark
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_byte_is_quarks_file_to_file_on_both_kernels(fmt, dtype):
    from mxforge.formats.quark import quark_dequantize_weight, quark_quantize_weight

    for w in _weights(dtype):
        if not torch.isfinite(w).all():
            continue  # float16 overflows the widest rows: non-finite weights are refused, tested elsewhere
        ref_codes, ref_scales = quark_quantize_weight(fmt, w)
        codes, scales = fmt.quantize(w)  # the CPU kernel
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
        t_codes, t_scales = torch.empty_like(codes), torch.empty_like(scales)
        fmt.kernels.encode_torch(w, t_codes, t_scales, torch.device("cpu"), (0,), None)
        assert torch.equal(t_codes, ref_codes) and torch.equal(t_scales, ref_scales)
        ours = fmt.dequantize(codes, scales, w.shape[1])
        theirs = quark_dequantize_weight(fmt, codes, scales, torch.float32)
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_mse_rule_never_loses_to_quarks_exponent_and_the_sums_are_what_was_stored(fmt):
    """Per block, the mse rule's exponent reconstructs no worse than Quark's; the error sums are those of the
    stored values."""
    w = _weights(torch.float32)[1]
    outs = {}
    for offsets in ((0,), (0, 1, -1)):
        stats = np.zeros(ERROR_STATS)
        codes, scales = fmt.quantize(w, offsets=offsets, stats=stats)
        err = w.double() - fmt.dequantize(codes, scales, w.shape[1]).double()
        assert stats[0] == pytest.approx(float((err**2).sum()), rel=1e-9)
        outs[offsets] = (err**2).reshape(w.shape[0], -1, 32).sum(-1), scales
    (quark_err, quark_scales), (mse_err, mse_scales) = outs[(0,)], outs[(0, 1, -1)]
    assert (mse_err <= quark_err * (1 + 1e-6)).all()
    if fmt.name == "mxfp6_e2m3":  # on these Gaussian rows E3M2's 5 binades leave Quark's exponent best everywhere
        assert not torch.equal(mse_scales, quark_scales) and mse_err.sum() < quark_err.sum()


def _edges(fmt) -> torch.Tensor:
    """bf16 rows holding, at a block scale of 1 (each block's amax the largest value), every grid value, every
    midpoint between neighbours (a tie: half to even), the bf16 values either side of each, both signs, zeros,
    values past the largest (saturating), values far below the smallest (+0), and a short last block."""
    mags = torch.tensor(fmt.values[: len(fmt.values) // 2], dtype=torch.float32)
    mids = (mags[1:] + mags[:-1]) / 2
    points = torch.cat([mags, mids, mids.bfloat16().float().nextafter(torch.tensor(0.0)), mids * 1.004])
    points = torch.cat([points, -points, torch.tensor([fmt.max_value * 1.3, -fmt.max_value * 2, 2.0**-40, -0.0])])
    blocks = points[: points.numel() // 31 * 31].reshape(-1, 31)
    rows = torch.cat([blocks, torch.full((blocks.shape[0], 1), fmt.max_value)], 1).reshape(1, -1)  # amax: scale 1
    rows = torch.cat([rows, rows * 2.0**-100, rows * 2.0**100])  # far from 1: the scale's whole range
    return torch.cat([rows, rows[:, :24]], 1).bfloat16()  # a short last block of 24


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("offsets", [(0,), (0, 1, -1)], ids=["quark", "mse"])
def test_c_kernel_is_the_torch_kernel_on_every_tie_and_edge(fmt, offsets):
    """The bf16 C kernel (`_mx_bf16.c`) rounds on float32 bits where the torch kernel compares with the grid's
    boundaries: the same bytes on ties, saturation, subnormals and both ends of the scale range, the same scale
    rule choices, and the same error sums (both in float64)."""
    element = fmt.kernels.encode_cpu.args[0]
    if c_kernel(element) is None:
        pytest.skip("no working C compiler: the torch kernel serves bf16 here")
    for w in (_edges(fmt), _weights(torch.bfloat16)[0], _weights(torch.bfloat16)[1]):
        packed, scale_shape = fmt.packed_shapes(tuple(w.shape))
        codes, scales, stats = np.empty(packed, np.uint8), np.empty(scale_shape, np.uint8), np.zeros(ERROR_STATS)
        assert fmt.kernels.encode_cpu(w.view(torch.int16).numpy(), codes, scales, offsets, stats) == 0
        t_codes, t_scales = torch.empty(packed, dtype=torch.uint8), torch.empty(scale_shape, dtype=torch.uint8)
        t_stats = np.zeros(ERROR_STATS)
        fmt.kernels.encode_torch(w, t_codes, t_scales, torch.device("cpu"), offsets, t_stats)
        assert np.array_equal(scales, t_scales.numpy()), f"{(scales != t_scales.numpy()).sum()} scale bytes differ"
        assert np.array_equal(codes, t_codes.numpy()), f"{(codes != t_codes.numpy()).sum()} code bytes differ"
        assert np.allclose(stats, t_stats, rtol=1e-9, atol=0), (stats, t_stats)
    nonfinite = _edges(fmt)
    nonfinite[0, 5], nonfinite[2, 40] = float("nan"), float("-inf")
    packed, scale_shape = fmt.packed_shapes(tuple(nonfinite.shape))
    got = fmt.kernels.encode_cpu(
        nonfinite.view(torch.int16).numpy(), np.empty(packed, np.uint8), np.empty(scale_shape, np.uint8)
    )
    assert got == 2
