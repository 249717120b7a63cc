"""FP8 PTPC's numerics (FP8 E4M3 "fn" elements, one float32 scale per output row), AMD Quark 0.13's exactly.

What Quark's file-to-file mode writes for a weight `[out, in]` (`_single_stage_quantize_weight` with
`FP8E4M3PerChannelSpec(ch_axis=0)`; checked byte for byte in tests):
- scale per row, float32 `[out]`: the row's amax (a value of the weight's dtype) as float32, divided by 448 (E4M3's
  largest value) in float32; a row whose scale is 0 gets float32's epsilon 2^-23.
- element: the weight divided by its row's scale in the weight's own dtype (the scale rounded to bf16 / fp16 first
  and the quotient rounded back to it; float32 weights divide in float32), then converted to float8_e4m3fn as torch
  does: round half to even, subnormals below 2^-6, saturating at 448 (a quotient past it, from the scale's rounding
  or a float16 scale that underflowed to 0, is stored as 448). One code per byte: codes `[out, in]`.
- Non-finite input: refused by default, as for every format (`NonFiniteWeightError`); with `refuse_nonfinite=False`
  such tensors go through Quark's own routine.
The CPU kernel is C (`_ptpc.c`, built by formats/native.py; workers run without torch), with a numpy twin below
where no C compiler works and for float16 rows; the torch one runs on any device (`--device`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

from mxforge.formats.element import add_error_stats, bf16_to_float32, f32_to_bf16_bits
from mxforge.formats.native import compiled

if TYPE_CHECKING:
    import numpy as np
    import torch

EMAX_CODE = 0x7E  # the largest finite magnitude code: 448
NAN_CODE = 0x7F  # E4M3 "fn": exponent 15 with mantissa 7 is NaN (no infinities)
MAX_VALUE = 448.0
MIN_NORMAL_EXP = -6  # smallest normal 2^-6; subnormals are multiples of 2^-9
EPS = 2.0**-23  # float32's epsilon: Quark's scale for a row whose scale is 0


def _e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa * 2.0 ** (MIN_NORMAL_EXP - 3)
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3_VALUES = tuple(_e4m3_value(c) for c in range(256))  # code -> value (sign in bit 7; 0x7F, 0xFF NaN)


def _as_float32(rows: np.ndarray) -> np.ndarray:
    """float32 of rows given as bf16 bits (int16), float16 or float32."""
    import numpy as np

    if rows.dtype == np.int16:
        return bf16_to_float32(rows)
    return rows.astype(np.float32, copy=False)


def _round_to(values: np.ndarray, like) -> np.ndarray:
    """float32 `values` rounded (half to even) to the dtype of rows `like` (bf16 bits, float16 or float32), as
    float32: what torch's arithmetic in that dtype returns."""
    import numpy as np

    if like == np.int16:
        return bf16_to_float32(f32_to_bf16_bits(values))
    if like == np.float16:
        return values.astype(np.float16).astype(np.float32)
    return values


def e4m3_codes(q: np.ndarray) -> np.ndarray:
    """uint8 float8_e4m3fn codes of float32 `q`, as torch converts: round half to even, saturating at 448
    (infinities included); NaN is 0x7F with its sign."""
    import numpy as np

    bits = np.ascontiguousarray(q, dtype=np.float32).view(np.uint32)
    sign = ((bits >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)
    mag = bits & np.uint32(0x7FFFFFFF)
    a = mag.view(np.float32)
    normal = ((mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)).astype(np.int64)
    normal -= (127 - 7) << 3  # float32's exponent bias to E4M3's
    with np.errstate(invalid="ignore", over="ignore"):
        sub = np.rint(np.minimum(a, np.float32(1.0)) * np.float32(2.0 ** (3 - MIN_NORMAL_EXP))).astype(np.int64)
        code = np.where(a < np.float32(2.0**MIN_NORMAL_EXP), sub, normal)
        code = np.where(np.isnan(a), NAN_CODE, np.where(a > np.float32(MAX_VALUE), EMAX_CODE, code))
    return code.astype(np.uint8) | sign


SOURCE = Path(__file__).with_name("_ptpc.c")
_P = ctypes.c_void_p


def c_kernel():
    """The C kernel (`_ptpc.c`) for bf16 and float32 rows, or None where no C compiler works."""
    args = (_P, ctypes.c_int32, _P, _P, ctypes.c_int64, ctypes.c_int64, _P)
    return compiled(SOURCE, "fp8_ptpc_quantize", args, ctypes.c_int64)


def warm_cpu_kernel(read_dtypes: set[str]) -> bool:
    """Build (or load) the C kernel now, before workers fork; True: it, or the numpy twin, runs without torch."""
    c_kernel()
    return True


def quantize_rows_cpu(
    rows: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    offsets: tuple[int, ...] = (0,),
    stats: np.ndarray | None = None,
) -> int:
    """Quantize rows (bf16 bits as int16, float16 or float32) into preallocated uint8 `codes` `[n, in]` and
    `scales` `[n, 4]` (each row's float32 scale, its bytes); `stats`: None or ERROR_STATS running sums. Returns
    the number of non-finite values seen (their rows' outputs are then meaningless). The C kernel where it builds
    (bf16 and float32 rows), else numpy."""
    import numpy as np

    assert tuple(offsets) == (0,), "FP8 PTPC has no scale rules"
    native = c_kernel() if rows.dtype in (np.int16, np.float32) else None
    if native is not None:
        rows = np.ascontiguousarray(rows)
        assert codes.flags.c_contiguous and scales.flags.c_contiguous and codes.shape == rows.shape
        out = np.empty(rows.shape[0], np.float32)
        sums = np.zeros(4) if stats is not None else None
        nonfinite = native(
            rows.ctypes.data,
            int(rows.dtype == np.int16),
            codes.ctypes.data,
            out.ctypes.data,
            rows.shape[0],
            rows.shape[1],
            None if sums is None else sums.ctypes.data,
        )
        scales[...] = out.astype("<f4").view(np.uint8).reshape(-1, 4)
        if stats is not None and sums is not None:
            stats[:2] += sums[:2]
            stats[2] = max(stats[2], sums[2])
            stats[3] += sums[3]
        return int(nonfinite)
    return _quantize_rows_numpy(rows, codes, scales, stats)


def _quantize_rows_numpy(rows: np.ndarray, codes: np.ndarray, scales: np.ndarray, stats: np.ndarray | None) -> int:
    import numpy as np

    x = _as_float32(rows)
    nonfinite = int(x.size - np.count_nonzero(np.isfinite(x)))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
        scale = (amax / np.float32(MAX_VALUE)).astype(np.float32)
        scale[scale == 0] = np.float32(EPS)
        divisor = _round_to(scale, rows.dtype)
        q = _round_to((x / divisor[:, None]).astype(np.float32), rows.dtype)
        codes[...] = e4m3_codes(q)
    scales[...] = scale.astype("<f4").view(np.uint8).reshape(-1, 4)
    if stats is not None:
        finite = np.isfinite(x).all(axis=1)
        table = np.asarray(E4M3_VALUES, dtype=np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            reconstructed = table[codes] * scale[:, None]
        err = (x.astype(np.float64) - reconstructed)[finite]
        stats[0] += float((err * err).sum())
        stats[1] += float((x[finite].astype(np.float64) ** 2).sum())
        stats[2] = max(stats[2], float(np.abs(err).max()) if err.size else 0.0)
        stats[3] += int((np.abs(q[finite]) > MAX_VALUE).sum())
    return nonfinite


def quantize_torch(
    weight: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    device: torch.device,
    offsets: tuple[int, ...] = (0,),
    stats: np.ndarray | None = None,
) -> int:
    """The same numerics in torch on `device` (the weight's dtype is kept: Quark divides in it)."""
    import torch

    assert tuple(offsets) == (0,), "FP8 PTPC has no scale rules"
    w = weight.to(device)
    nonfinite = int((~torch.isfinite(w)).sum())
    amax = w.abs().amax(dim=1).to(torch.float32)
    scale = amax / MAX_VALUE
    scale = scale.masked_fill(scale == 0, EPS)
    q = w / scale.to(w.dtype)[:, None]
    fp8 = q.to(torch.float8_e4m3fn)
    codes.copy_(fp8.view(torch.uint8).cpu())
    scales.copy_(scale.cpu().contiguous().view(torch.uint8).reshape(-1, 4))
    if stats is not None:  # rows are the units measured (a non-finite row is left out)
        reconstructed = fp8.to(torch.float32) * scale[:, None]
        add_error_stats(w, reconstructed, q.abs() > MAX_VALUE, torch.isfinite(w).all(dim=1), stats)
    return nonfinite


def decode_rows(codes: np.ndarray, scales: np.ndarray, inner: int, block: int | None = None) -> np.ndarray:
    """float32 `[rows, inner]` values that uint8 `codes` `[rows, in]` and each row's float32 scales (uint8 bytes
    `[rows, 4 * scales]`) encode: the E4M3 value times its scale (codes 0x7F / 0xFF are NaN). One scale per row
    (`block` None, PTPC), or one per `block` consecutive elements (block FP8's tile width)."""
    import numpy as np

    table = np.asarray(E4M3_VALUES, dtype=np.float32)
    scale = np.ascontiguousarray(scales).view("<f4").reshape(codes.shape[0], -1)
    if block is not None:
        scale = np.repeat(scale, block, axis=1)[:, :inner]
    with np.errstate(invalid="ignore", over="ignore"):
        return table[codes[:, :inner]] * scale
