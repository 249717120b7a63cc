"""MXFP4 (OCP MX: E2M1 elements, E8M0 scale per 32-element block) with AMD Quark 0.13's exact numerics.

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

That is the default scale rule ("quark"); scale_rules.py defines the others (same format, another
exponent per block where it reconstructs the block better). While encoding, the kernels can also add the
error statistics of what they wrote (error_report.py), so the error report costs no second pass.

Three implementations share these rules, all tested byte for byte against Quark: for bf16 on the CPU a C
kernel built on first use (`_mxfp4_bf16.c`, the fast path), a numba kernel (float32 input, and bf16
where no C compiler is found), and a torch one that runs on any device (`--device cuda`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from mxforge.errors import ConfigError, NonFiniteWeightError
from mxforge.quantize.error_report import ERROR_STATS
from mxforge.quantize.scale_rules import ERROR_LANES, get_scale_rule

BLOCK = 32
ZERO_BLOCK_SCALE = 1
# E2M1 rounding boundaries (in units of the block scale): a value above/at each one moves up one code.
# Ties (0.25, 1.25, 2.5, 5) go to the even code below; (0.75, 1.75, 3.5) go to the even code above.
_UP_AT_OR_ABOVE = (0.75, 1.75, 3.5)
_UP_ABOVE = (0.25, 1.25, 2.5, 5.0)
TWICE_GRID = (0, 1, 2, 3, 4, 6, 8, 12)  # twice the E2M1 magnitude of codes 0..7
ROW_CHUNK_ELEMENTS = 1 << 20  # rows per chunk of the torch path: about 4 MB of float32 at a time

if TYPE_CHECKING:  # torch is imported where used: worker processes on the CPU path never load it
    import torch


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(codes shape, scales shape) for a 2-D weight shape.

    Raises:
        ConfigError: not 2-D, or an odd in-dimension (two codes per byte).
    """
    if len(shape) != 2:
        raise ConfigError(f"MXFP4 needs a 2-D weight, got shape {list(shape)}")
    out, inner = shape
    if inner % 2:
        raise ConfigError(f"MXFP4 packs two codes per byte; in-dimension {inner} is odd (shape {list(shape)})")
    return (out, inner // 2), (out, -(-inner // BLOCK))


def quantize_mxfp4(
    weight: torch.Tensor,
    name: str | None = None,
    refuse_nonfinite: bool = True,
    device: str | torch.device | None = None,
    scale_rule: str | None = None,
    stats: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float weight `[out, in]` to (codes uint8 `[out, in/2]`, scale bytes uint8 `[out, ceil(in/32)]`).

    Bit-identical to Quark 0.13's file-to-file output with the default `scale_rule` ("quark"; see
    scale_rules.py). `device` (default: the weight's) selects where the numerics run: CPU uses the compiled
    kernel, any other device the torch implementation; results are returned on CPU. `stats`: see
    `quantize_rows_cpu`.

    Raises:
        ConfigError: not 2-D, not floating point, or an odd in-dimension.
        NonFiniteWeightError: NaN/Inf present and `refuse_nonfinite` (the message names `name` and the count).
    """
    import torch

    if not weight.is_floating_point():
        raise ConfigError(f"{name or 'weight'}: MXFP4 needs a floating-point weight, got {weight.dtype}")
    codes_shape, scales_shape = packed_shapes(tuple(weight.shape))
    device = torch.device(device) if device is not None else weight.device
    offsets = get_scale_rule(scale_rule).offsets
    codes = torch.empty(codes_shape, dtype=torch.uint8)
    scales = torch.empty(scales_shape, dtype=torch.uint8)
    if weight.numel() == 0:
        return codes, scales
    if device.type == "cpu":
        src = weight.detach().cpu().contiguous()
        arr = src.view(torch.int16).numpy() if src.dtype == torch.bfloat16 else src.to(torch.float32).numpy()
        nonfinite = quantize_rows_cpu(arr, codes.numpy(), scales.numpy(), offsets, stats)
    else:
        nonfinite = _quantize_torch(weight, codes, scales, device, offsets, stats)
    if nonfinite:
        if refuse_nonfinite:
            raise NonFiniteWeightError(
                f"tensor {name or '(unnamed)'!r} holds {nonfinite} NaN/Inf value(s); quantizing would silently "
                "encode their blocks as +6.0. Fix or re-download the source checkpoint",
                tensor=name,
            )
        if offsets != (0,):
            raise ConfigError(
                f"tensor {name or '(unnamed)'!r} holds {nonfinite} NaN/Inf value(s): only the quark scale "
                "rule can encode them (as Quark does)",
                tensor=name,
            )
        return _quark_reference(weight)
    return codes, scales


def quantize_rows_cpu(
    rows: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    offsets: tuple[int, ...] = (0,),
    stats: np.ndarray | None = None,
) -> int:
    """Quantize rows (bf16 bits as int16, or float32) into preallocated `codes`/`scales`, on the CPU kernel.

    `offsets`: the scale rule's exponent offsets (`scale_rules.ScaleRule.offsets`; (0,) is Quark's).
    `stats`: None, or a float64 array of ERROR_STATS zeros or running sums the rows' error statistics are
    added to (`error_report.py` defines them). Returns the number of non-finite values seen (their blocks'
    outputs are then meaningless).
    """
    if rows.dtype == np.int16:
        from mxforge.quantize._native import bf16_kernel

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
    from mxforge.quantize._mxfp4_kernel import quantize_bf16_rows, quantize_f32_rows, quantize_rows_rule

    if tuple(offsets) == (0,) and stats is None:
        kernel = quantize_bf16_rows if rows.dtype == np.int16 else quantize_f32_rows
        return int(kernel(rows, codes, scales))
    bits = (
        (rows.astype(np.int32) << 16)
        if rows.dtype == np.int16
        else np.ascontiguousarray(rows, np.float32).view(np.int32)
    )
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
    for dtype in dtypes:
        arr = np.zeros((1, 32), dtype=np.int16 if dtype == "BF16" else np.float32)
        quantize_rows_cpu(arr, np.empty((1, 16), dtype=np.uint8), np.empty((1, 1), dtype=np.uint8))


def _quantize_torch(
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
        exponent = ((amax.view(torch.int32) + (1 << 21)) >> 23) & 0xFF
        scale_byte = torch.where(exponent == 255, 254, (exponent - 2).clamp(1, 254))
        finite = torch.isfinite(amax)
        if len(offsets) > 1:
            scale_byte = scale_byte + _rule_offsets(blocks, scale_byte, finite, offsets)
        inv_scale = power_of_two_bits(127 - scale_byte).view(torch.float32)
        q = blocks.abs() * inv_scale.unsqueeze(-1)
        code = _e2m1_magnitude_codes(q)
        if stats is not None:
            _add_torch_stats(blocks, q, code, scale_byte, finite, stats)
        negative = (blocks < 0) & (code > 0)
        code = (code | (negative.to(torch.uint8) << 3)).reshape(x.shape[0], padded)[:, :inner]
        packed = code[:, 0::2] | (code[:, 1::2] << 4)
        codes[r0 : r0 + rows_per_chunk] = packed.cpu()
        scales[r0 : r0 + rows_per_chunk] = scale_byte.to(torch.uint8).cpu()
    return nonfinite


def _e2m1_magnitude_codes(q: torch.Tensor) -> torch.Tensor:
    """E2M1 codes 0..7 of magnitudes already divided by the block scale (Quark's half-to-even rounding)."""
    import torch

    # sum() starts from the int 0, so typeshed types it Tensor | int; the thresholds are never empty: a Tensor.
    return cast(
        "torch.Tensor",
        sum((q >= t).to(torch.uint8) for t in _UP_AT_OR_ABOVE) + sum((q > t).to(torch.uint8) for t in _UP_ABOVE),
    )


def _rule_offsets(
    blocks: torch.Tensor, quark_byte: torch.Tensor, finite: torch.Tensor, offsets: tuple[int, ...]
) -> torch.Tensor:
    """Per block, the offset from Quark's exponent that a scale rule picks (scale_rules.py), with the block
    errors rounded and summed in float32 exactly as the C and numba kernels do."""
    import torch

    xs = blocks.abs() * power_of_two_bits(127 - quark_byte).view(torch.float32).unsqueeze(-1)  # |x| / 2^eq
    twice_grid = torch.tensor(TWICE_GRID, dtype=torch.float32, device=blocks.device)
    best = torch.zeros_like(quark_byte)
    best_error = None
    for c, d in enumerate(offsets):
        code = _e2m1_magnitude_codes(xs * 2.0**-d)
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


def _add_torch_stats(
    blocks: torch.Tensor,
    q: torch.Tensor,
    code: torch.Tensor,
    scale_byte: torch.Tensor,
    finite: torch.Tensor,
    stats: np.ndarray,
) -> None:
    """Add the error statistics of the finite blocks (error_report.py) in float64."""
    import torch

    twice_grid = torch.tensor(TWICE_GRID, dtype=torch.float64, device=blocks.device)
    scale = torch.ldexp(
        torch.ones_like(scale_byte, dtype=torch.float64), (scale_byte - 127).to(torch.float64)
    ).unsqueeze(-1)
    x = blocks.abs().to(torch.float64)
    err = (x - twice_grid[code.long()] * 0.5 * scale)[finite]
    stats[0] += float((err * err).sum())
    stats[1] += float((x[finite] ** 2).sum())
    stats[2] = max(stats[2], float(err.abs().max()) if err.numel() else 0.0)
    stats[3] += int((q[finite] > 6.0).sum())


def power_of_two_bits(exponent: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns (int32) of 2**exponent for exponent in [-127, 126], built exactly (2**-127 is subnormal)."""
    import torch

    biased = exponent + 127
    return torch.where(biased > 0, biased << 23, torch.full_like(biased, 1 << 22))


def _quark_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quark's own file-to-file routine (slow; imports Quark): the reference, and the path for non-finite input."""
    from mxforge.quantize.quark_ref import quark_quantize_weight

    return quark_quantize_weight(weight.detach().cpu())


E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def dequantize_rows(codes: np.ndarray, scales: np.ndarray, inner: int) -> np.ndarray:
    """Float32 `[rows, inner]` values that uint8 `codes` `[rows, inner/2]` and E8M0 `scales` encode: each
    E2M1 value times 2^(byte - 127), exact (bf16 holds every such value but the overflow 6 * 2^127 -> inf)."""
    rows = codes.shape[0]
    nib = np.empty((rows, codes.shape[1] * 2), dtype=np.uint8)
    nib[:, 0::2] = codes & 0xF
    nib[:, 1::2] = codes >> 4
    scale = np.ldexp(np.float32(1), scales.astype(np.int32) - 127).astype(np.float32)
    with np.errstate(over="ignore"):
        return E2M1_VALUES[nib[:, :inner]] * np.repeat(scale, BLOCK, axis=1)[:, :inner]


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, inner: int) -> torch.Tensor:
    """Float32 `[out, inner]` values that `codes`/`scales` encode (for error measurements and checks)."""
    import torch

    return torch.from_numpy(dequantize_rows(codes.numpy(), scales.numpy(), inner))
