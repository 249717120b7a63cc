"""FP8 PTPC's kernels against Quark 0.13 and torch: the E4M3 conversion on every bf16 value, every weight byte
for byte Quark's file-to-file routine on bf16 / fp16 / float32 weights, the CPU (numpy) and torch kernels alike,
and the decode equal to Quark's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxforge.formats import format_named
from mxforge.formats.fp8_ptpc import numerics
from mxforge.formats.fp8_ptpc.numerics import E4M3_VALUES, e4m3_codes

PTPC = format_named("fp8_ptpc")


def test_e4m3_conversion_is_torchs_on_every_bf16_value_and_saturates():
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    ours, theirs = e4m3_codes(every.numpy()), every.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    finite = ~np.isnan(every.numpy())
    assert np.array_equal(ours[finite], theirs[finite])
    assert set(ours[~finite] & 0x7F) == {0x7F}  # NaN stays NaN
    wide = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0)) * torch.logspace(-14, 4, 1 << 18)
    assert np.array_equal(e4m3_codes(wide.numpy()), wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    assert list(e4m3_codes(np.array([448, 500, np.inf, -1e9], np.float32))) == [0x7E, 0x7E, 0x7E, 0xFE]
    table = np.asarray(E4M3_VALUES, np.float32)
    codes = np.arange(256, dtype=np.uint8)
    assert np.array_equal(table, torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy(), equal_nan=True)


def _rows(w: torch.Tensor) -> np.ndarray:
    """A weight's rows as the shard jobs hand them to a CPU kernel: bf16 bits as int16, else its own dtype."""
    return w.view(torch.int16).numpy() if w.dtype == torch.bfloat16 else w.numpy()


def test_the_c_kernel_is_its_numpy_twin_with_non_finite_rows_and_error_sums():
    """Both CPU kernels write the same bytes and the same error sums (float64, to rounding), and count the same
    non-finite values, on bf16 and float32 rows."""
    from mxforge.formats import ERROR_STATS

    if numerics.c_kernel() is None:
        pytest.skip("no C compiler: the numpy kernel is the only CPU kernel")
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        w = (torch.randn(64, 2000, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(1)).to(dtype)
        w[3, 5], w[4, 0], w[5, 9] = float("nan"), float("inf"), -float("inf")
        w[6] = 0
        outs = []
        for kernel in (numerics.quantize_rows_cpu, lambda r, c, s, o, st: numerics._quantize_rows_numpy(r, c, s, st)):
            codes, scales, stats = np.empty((64, 2000), np.uint8), np.empty((64, 4), np.uint8), np.zeros(ERROR_STATS)
            outs.append((kernel(_rows(w), codes, scales, (0,), stats), codes, scales, stats))
        (n_c, codes_c, scales_c, stats_c), (n_np, codes_np, scales_np, stats_np) = outs
        finite = torch.isfinite(w).all(dim=1).numpy()
        assert n_c == n_np == 3
        assert np.array_equal(codes_c[finite], codes_np[finite]) and np.array_equal(scales_c[finite], scales_np[finite])
        assert np.allclose(stats_c, stats_np, rtol=1e-9, atol=0)


def _weights(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 200, generator=g) * torch.logspace(-9, 3, 96).unsqueeze(1)
    w[0] = 0  # an all-zero row: float32's epsilon as its scale
    w[1, :] = 1e-30  # a row whose scale underflows (to 0 in float16 precision: every quotient saturates)
    w[9, ::2] = 0  # with row 9's tiny scale in float16: 0 / 0, NaN codes, as Quark writes them
    w[2, 7] = -5.0  # a lone large value
    return [w.to(dtype), torch.randn(3, 1, generator=g).to(dtype), torch.randn(1, 4096, generator=g).to(dtype)]


@pytest.mark.quark
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_byte_is_quarks_file_to_file_on_both_kernels(dtype):
    from mxforge.formats.quark import quark_dequantize_weight, quark_quantize_weight

    for w in _weights(dtype):
        ref_codes, ref_scales = quark_quantize_weight(PTPC, w)
        codes, scales = PTPC.quantize(w)
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
        t_codes, t_scales = torch.empty_like(codes), torch.empty_like(scales)
        PTPC.kernels.encode_torch(w, t_codes, t_scales, torch.device("cpu"), (0,), None)
        assert torch.equal(t_codes, ref_codes) and torch.equal(t_scales, ref_scales)
        # the numpy twin of the C kernel (where no C compiler works; float16 rows always take it)
        n_codes, n_scales = np.empty(tuple(codes.shape), np.uint8), np.empty(tuple(scales.shape), np.uint8)
        numerics._quantize_rows_numpy(_rows(w), n_codes, n_scales, None)
        assert np.array_equal(n_codes, ref_codes.numpy()) and np.array_equal(n_scales, ref_scales.numpy())
        ours = PTPC.dequantize(codes, scales, w.shape[1])
        theirs = quark_dequantize_weight(
            PTPC, codes.view(torch.float8_e4m3fn), scales.reshape(-1).view(torch.float32), torch.float32
        )
        # equal_nan: a float16 row whose scale underflows to 0 in float16 divides 0 by 0, and Quark stores NaN codes
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0, equal_nan=True)


def test_stored_form_and_error_sums():
    """Codes `[out, in]` float8_e4m3fn and scales float32 `[out]` (Quark's shapes); the error sums the kernel adds
    are those of what it stored."""
    from mxforge.formats import ERROR_STATS
    from mxforge.safetensors_io import PlannedTensor

    assert PTPC.stored("a.weight", (5, 7)) == [
        PlannedTensor("a.weight", "F8_E4M3", (5, 7)),
        PlannedTensor("a.weight_scale", "F32", (5,)),
    ]
    w = _weights(torch.bfloat16)[0]
    stats = np.zeros(ERROR_STATS)
    codes, scales = PTPC.quantize(w, stats=stats)
    x = w.double()
    err = x - PTPC.dequantize(codes, scales, w.shape[1]).double()
    assert stats[0] == pytest.approx(float((err**2).sum()), rel=1e-9)
    assert stats[1] == pytest.approx(float((x**2).sum()), rel=1e-9)
    on_torch = np.zeros(ERROR_STATS)
    PTPC.kernels.encode_torch(w, torch.empty_like(codes), torch.empty_like(scales), torch.device("cpu"), (0,), on_torch)
    assert np.allclose(on_torch, stats, rtol=1e-9)  # the torch kernel (--device) adds the same sums
    assert "one FP32 `weight_scale` value per output channel" in PTPC.describe()
