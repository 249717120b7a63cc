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
    add_error_stats,
    bf16_to_float32,
    decode_table,
    even_scale_codes,
    magnitude_codes,
    power_of_two,
)
from mxforge.formats.mxfp4.spec import (
    BLOCK,
    E2M1_EMAX,
    E2M1_MANTISSA_BITS,
    E2M1_VALUES,
    ERROR_LANES,
    MAX_VALUE,
    SIGN_BIT,
    TWICE_GRID,
)

ROW_CHUNK_ELEMENTS = 1 << 20  # rows per chunk of the torch path: about 4 MB of float32 at a time

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
            rows = np.ascontiguousarray(rows)
            offs = np.asarray(offsets, dtype=np.int32)
            return int(
                native(
                    rows.ctypes.data,
                    codes.ctypes.data,
                    scales.ctypes.data,
                    rows.shape[0],
                    rows.shape[1],
                    offs.ctypes.data,
                    len(offs),
                    None if stats is None else stats.ctypes.data,
                )
            )
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


def warm_cpu_kernel(dtypes: set[str]) -> None:
    """Load (or compile, the first time) the CPU kernels for these safetensors dtypes now, e.g. before
    forking workers. numba is imported only where it serves (float inputs, or bf16 without a C compiler)."""
    import numpy as np

    for dtype in dtypes:
        arr = np.zeros((1, BLOCK), dtype=np.int16 if dtype == "BF16" else np.float32)
        quantize_rows_cpu(arr, np.empty((1, BLOCK // 2), dtype=np.uint8), np.empty((1, 1), dtype=np.uint8))


def quantize_torch(
    weight: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    device: torch.device,
    offsets: tuple[int, ...] = (0,),
    stats: np.ndarray | None = None,
) -> int:
    """The same numerics as torch ops on `device`, in row chunks; fills CPU `codes`/`scales` (and `stats`,
    as `quantize_rows_cpu` does)."""
    import torch

    out, inner = weight.shape
    nblocks = scales.shape[1]
    padded = nblocks * BLOCK
    rows_per_chunk = max(1, ROW_CHUNK_ELEMENTS // padded)
    nonfinite = 0
    for r0 in range(0, out, rows_per_chunk):
        x = weight[r0 : r0 + rows_per_chunk].to(device=device, dtype=torch.float32)
        nonfinite += int((~torch.isfinite(x)).sum())
        if padded != inner:
            x = torch.nn.functional.pad(x, (0, padded - inner))
        blocks = x.reshape(x.shape[0], nblocks, BLOCK)
        amax = blocks.abs().amax(dim=-1)
        scale_byte = even_scale_codes(amax, E2M1_MANTISSA_BITS, E2M1_EMAX)
        finite = torch.isfinite(amax)
        if len(offsets) > 1:
            scale_byte = scale_byte + _rule_offsets(blocks, scale_byte, finite, offsets)
        q = blocks.abs() * power_of_two(E8M0.bias - scale_byte).unsqueeze(-1)
        code = magnitude_codes(q, E2M1_VALUES)
        if stats is not None:
            twice_grid = torch.tensor(TWICE_GRID, dtype=torch.float64, device=blocks.device)
            half_scale = power_of_two(scale_byte - E8M0.bias - 1).to(torch.float64).unsqueeze(-1)
            add_error_stats(blocks.abs(), twice_grid[code.long()] * half_scale, q > MAX_VALUE, finite, stats)
        negative = (blocks < 0) & (code > 0)
        code = (code | (negative.to(torch.uint8) << SIGN_BIT)).reshape(x.shape[0], padded)[:, :inner]
        packed = code[:, 0::2] | (code[:, 1::2] << 4)
        codes[r0 : r0 + rows_per_chunk] = packed.cpu()
        scales[r0 : r0 + rows_per_chunk] = scale_byte.to(torch.uint8).cpu()
    return nonfinite


def _rule_offsets(
    blocks: torch.Tensor, quark_byte: torch.Tensor, finite: torch.Tensor, offsets: tuple[int, ...]
) -> torch.Tensor:
    """Per block, the offset from Quark's exponent that a scale rule picks (scale_rules.py), with the block
    errors rounded and summed in float32 exactly as the C and numba kernels do."""
    import torch

    xs = blocks.abs() * power_of_two(E8M0.bias - quark_byte).unsqueeze(-1)  # |x| / 2^eq
    twice_grid = torch.tensor(TWICE_GRID, dtype=torch.float32, device=blocks.device)
    best = torch.zeros_like(quark_byte)
    best_error = None
    for c, d in enumerate(offsets):
        code = magnitude_codes(xs * 2.0**-d, E2M1_VALUES)
        r = xs - twice_grid[code.long()] * 2.0 ** (d - 1)
        e2 = (r * r).reshape(*r.shape[:-1], BLOCK // ERROR_LANES, ERROR_LANES)
        lane = e2[..., 0, :]
        for j in range(1, e2.shape[-2]):
            lane = lane + e2[..., j, :]
        error = ((lane[..., 0] + lane[..., 1]) + (lane[..., 2] + lane[..., 3])) + (
            (lane[..., 4] + lane[..., 5]) + (lane[..., 6] + lane[..., 7])
        )
        if best_error is None:
            best_error = error
            continue
        better = finite & (quark_byte + d >= 1) & (quark_byte + d <= 254) & (error < best_error)
        best = torch.where(better, d, best)
        best_error = torch.where(better, error, best_error)
    return best


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
