"""MXFP4's numerics (OCP MX: E2M1 elements, an E8M0 scale per 32-element block), AMD Quark 0.13's exactly.

What Quark's file-to-file mode writes for a weight `[out, in]` (checked byte for byte in tests):
- scale byte per block of 32 along `in`: take the block's amax as float32 bits, add `1 << 21` (rounds
  the mantissa up from 1.75), keep the exponent field, subtract 2, clamp to [1, 254] (an amax that rounds
  up past the largest exponent, >= 1.75 * 2^127, gets 254). An all-zero block gets byte 1. When `in` is not a
  multiple of 32 the last block is shorter (Quark pads it with zeros, which do not change its amax): scales are
  `[out, ceil(in/32)]`. An odd `in` cannot be packed two codes per byte; Quark crashes on it, we raise `ConfigError`.
- element: |x| * 2^(127 - byte) in float32 (exact: a power of two), rounded half-to-even onto the E2M1
  grid 0, .5, 1, 1.5, 2, 3, 4, 6 (saturating at 6); sign in bit 3, except a value that rounds to zero
  is stored as +0. Two codes per byte, the first element in the low nibble: codes `[out, in/2]`.
- Non-finite input: Quark silently writes NaN blocks as +6.0. We refuse by default
  (`NonFiniteWeightError`); with `refuse_nonfinite=False` such tensors go through Quark's own kernel.

That is the default scale rule ("quark"); quantize/scale_rules.py defines the others (same format, another
exponent per block where it reconstructs the block better). While encoding, the kernels can also add the
error statistics of what they wrote (quantize/error_report.py), so the error report costs no second pass.

Three implementations share these rules, all tested byte for byte against Quark: for bf16 on the CPU a C
kernel built on first use (`_mxfp4_bf16.c`, the fast path), a numba kernel (float32 input, and bf16
where no C compiler is found), and a torch one that runs on any device (`--device cuda`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mxforge.formats.element import (
    E8M0,
    ERROR_STATS,
    bf16_to_float32,
    decode_table,
)
from mxforge.formats.mxfp4.spec import BLOCK, E2M1, E2M1_VALUES
from mxforge.formats.ocp_mx import quantize_torch as mx_quantize_torch

if TYPE_CHECKING:  # numpy and torch are imported where used: the CLI starts without them, CPU workers without torch
    import numpy as np
    import torch


def quantize_rows_cpu(
    rows: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    offsets: tuple[int, ...] = (0,),
    stats: np.ndarray | None = None,
) -> int:
    """Quantize rows (bf16 bits as int16, float16 or float32) into preallocated `codes`/`scales`, on the CPU kernel.

    `offsets`: the scale rule's exponent offsets (quantize/scale_rules.py; (0,) is Quark's). `stats`: None, or a
    float64 array of ERROR_STATS zeros or running sums the rows' error statistics are added to. Returns the number
    of non-finite values seen (their blocks' outputs are then meaningless).
    """
    import numpy as np

    if rows.dtype == np.float16:
        rows = rows.astype(np.float32)  # exact: MXFP4's numerics are float32's
    if rows.dtype == np.int16:
        from mxforge.formats.mxfp4._native import bf16_kernel

        native = bf16_kernel()
        if native is not None and codes.flags.c_contiguous and scales.flags.c_contiguous:
            from mxforge.formats.native import call_rows_kernel

            return call_rows_kernel(native, rows, codes, scales, offsets, stats)
    from mxforge.formats.mxfp4._kernel import quantize_bf16_rows, quantize_f32_rows, quantize_rows_rule

    if tuple(offsets) == (0,) and stats is None:
        kernel = quantize_bf16_rows if rows.dtype == np.int16 else quantize_f32_rows
        return int(kernel(rows, codes, scales))
    bits = (bf16_to_float32(rows) if rows.dtype == np.int16 else np.ascontiguousarray(rows, np.float32)).view(np.int32)
    with_stats = stats is not None
    stats = stats if with_stats else np.zeros(ERROR_STATS, dtype=np.float64)
    return int(
        quantize_rows_rule(
            bits, bits.view(np.float32), codes, scales, np.asarray(offsets, dtype=np.int64), stats, with_stats
        )
    )


def warm_cpu_kernel(dtypes: set[str]) -> bool:
    """Load (or compile, the first time) the CPU kernels for these safetensors dtypes now, before workers fork.
    numba is imported only where it serves (float inputs, or bf16 without a C compiler). True: neither runs torch."""
    import numpy as np

    for dtype in dtypes:
        arr = np.zeros((1, BLOCK), dtype=np.int16 if dtype == "BF16" else np.float32)
        quantize_rows_cpu(arr, np.empty((1, BLOCK // 2), dtype=np.uint8), np.empty((1, 1), dtype=np.uint8))
    return True


def quantize_torch(
    weight: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    device: torch.device,
    offsets: tuple[int, ...] = (0,),
    stats: np.ndarray | None = None,
) -> int:
    """The same numerics as torch ops on `device`, in row chunks: OCP MX's for E2M1 (formats/ocp_mx.py, which the
    other MX formats share); fills CPU `codes`/`scales` (and `stats`, as `quantize_rows_cpu` does)."""
    return mx_quantize_torch(E2M1, weight, codes, scales, device, offsets, stats)


def decode_rows(codes: np.ndarray, scales: np.ndarray, inner: int) -> np.ndarray:
    """Float32 `[rows, inner]` values that uint8 `codes` `[rows, inner/2]` and E8M0 `scales` encode: each
    E2M1 value times 2^(byte - 127), exact (bf16 holds every such value but the overflow 6 * 2^127 -> inf);
    a NaN scale byte makes its whole block NaN (OCP MX)."""
    import numpy as np

    rows = codes.shape[0]
    nib = np.empty((rows, codes.shape[1] * 2), dtype=np.uint8)
    nib[:, 0::2] = codes & 0xF
    nib[:, 1::2] = codes >> 4
    return decode_table(E2M1_VALUES, E8M0, BLOCK, nib, scales, inner)
