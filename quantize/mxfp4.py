"""MXFP4 (OCP MX: E2M1 elements, E8M0 scale per 32-element block) with AMD Quark 0.13's exact numerics.

What Quark's file-to-file mode writes for a weight `[out, in]` (checked byte for byte in tests):
- scale byte per block of 32 along `in`: take the block's amax as float32 bits, add `1 << 21` (rounds
  the mantissa up from 1.75), keep the exponent field, subtract 2, clamp to [1, 254] (an amax that rounds
  up past the largest exponent, >= 1.75 * 2^127, gets 254). An all-zero block gets byte 1. When `in` is not a multiple of 32 the last block is shorter (Quark pads it with zeros,
  which do not change its amax): scales are `[out, ceil(in/32)]`. An odd `in` cannot be packed two
  codes per byte; Quark crashes on it, we raise `ConfigError`.
- element: |x| * 2^(127 - byte) in float32 (exact: a power of two), rounded half-to-even onto the E2M1
  grid 0, .5, 1, 1.5, 2, 3, 4, 6 (saturating at 6); sign in bit 3, except a value that rounds to zero
  is stored as +0. Two codes per byte, the first element in the low nibble: codes `[out, in/2]`.
- Non-finite input: Quark silently writes NaN blocks as +6.0. We refuse by default
  (`NonFiniteWeightError`); with `refuse_nonfinite=False` such tensors go through Quark's own kernel.

Three implementations share these rules, all tested byte for byte against Quark: for bf16 on the CPU a C
kernel built on first use (`_mxfp4_bf16.c`, the fast path), a numba kernel (float32 input, and bf16
where no C compiler is found), and a torch one that runs on any device (`--device cuda`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mxforge.errors import ConfigError, MxforgeError

BLOCK = 32
ZERO_BLOCK_SCALE = 1
# E2M1 rounding boundaries (in units of the block scale): a value above/at each one moves up one code.
# Ties (0.25, 1.25, 2.5, 5) go to the even code below; (0.75, 1.75, 3.5) go to the even code above.
_UP_AT_OR_ABOVE = (0.75, 1.75, 3.5)
_UP_ABOVE = (0.25, 1.25, 2.5, 5.0)
ROW_CHUNK_ELEMENTS = 1 << 20  # rows per chunk of the torch path: about 4 MB of float32 at a time

if TYPE_CHECKING:  # torch is imported where used: worker processes on the CPU path never load it
    import torch


class NonFiniteWeightError(MxforgeError):
    """A weight to be quantized holds NaN or Inf (Quark would silently encode such blocks as +6.0)."""


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


def quantize_mxfp4(weight: torch.Tensor, name: str | None = None, refuse_nonfinite: bool = True,
                   device: str | torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float weight `[out, in]` to (codes uint8 `[out, in/2]`, scale bytes uint8 `[out, ceil(in/32)]`).

    Bit-identical to Quark 0.13's file-to-file output. `device` (default: the weight's) selects where the
    numerics run: CPU uses the compiled kernel, any other device the torch implementation; results are
    returned on CPU.

    Raises:
        ConfigError: not 2-D, not floating point, or an odd in-dimension.
        NonFiniteWeightError: NaN/Inf present and `refuse_nonfinite` (the message names `name` and the count).
    """
    import torch

    if not weight.is_floating_point():
        raise ConfigError(f"{name or 'weight'}: MXFP4 needs a floating-point weight, got {weight.dtype}")
    codes_shape, scales_shape = packed_shapes(tuple(weight.shape))
    device = torch.device(device) if device is not None else weight.device
    codes = torch.empty(codes_shape, dtype=torch.uint8)
    scales = torch.empty(scales_shape, dtype=torch.uint8)
    if weight.numel() == 0:
        return codes, scales
    if device.type == "cpu":
        src = weight.detach().cpu().contiguous()
        arr = src.view(torch.int16).numpy() if src.dtype == torch.bfloat16 else src.to(torch.float32).numpy()
        nonfinite = quantize_rows_cpu(arr, codes.numpy(), scales.numpy())
    else:
        nonfinite = _quantize_torch(weight, codes, scales, device)
    if nonfinite:
        if refuse_nonfinite:
            raise NonFiniteWeightError(
                f"tensor {name or '(unnamed)'!r} holds {nonfinite} NaN/Inf value(s); quantizing would silently "
                "encode their blocks as +6.0. Fix or re-download the source checkpoint")
        return _quark_reference(weight)
    return codes, scales


def quantize_rows_cpu(rows: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> int:
    """Quantize rows (bf16 bits as int16, or float32) into preallocated `codes`/`scales`, on the CPU kernel.

    Returns the number of non-finite values seen (their blocks' outputs are then meaningless).
    """
    if rows.dtype == np.int16:
        from ._native import bf16_kernel

        native = bf16_kernel()
        if native is not None and codes.flags.c_contiguous and scales.flags.c_contiguous:
            rows = np.ascontiguousarray(rows)
            return int(native(rows.ctypes.data, codes.ctypes.data, scales.ctypes.data, rows.shape[0], rows.shape[1]))
    from ._mxfp4_kernel import quantize_bf16_rows, quantize_f32_rows

    kernel = quantize_bf16_rows if rows.dtype == np.int16 else quantize_f32_rows
    return int(kernel(rows, codes, scales))


def warm_cpu_kernel(dtypes: set[str]) -> None:
    """Load (or compile, the first time) the CPU kernels for these safetensors dtypes now, e.g. before
    forking workers. numba is imported only where it serves (float inputs, or bf16 without a C compiler)."""
    for dtype in dtypes:
        arr = np.zeros((1, 32), dtype=np.int16 if dtype == "BF16" else np.float32)
        quantize_rows_cpu(arr, np.empty((1, 16), dtype=np.uint8), np.empty((1, 1), dtype=np.uint8))


def _quantize_torch(weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, device: torch.device) -> int:
    """The same numerics as torch ops on `device`, in row chunks; fills CPU `codes`/`scales`."""
    import torch

    out, inner = weight.shape
    nblocks = scales.shape[1]
    padded = nblocks * BLOCK
    rows_per_chunk = max(1, ROW_CHUNK_ELEMENTS // padded)
    nonfinite = 0
    for r0 in range(0, out, rows_per_chunk):
        x = weight[r0:r0 + rows_per_chunk].to(device=device, dtype=torch.float32)
        nonfinite += int((~torch.isfinite(x)).sum())
        if padded != inner:
            x = torch.nn.functional.pad(x, (0, padded - inner))
        blocks = x.reshape(x.shape[0], nblocks, BLOCK)
        amax = blocks.abs().amax(dim=-1)
        exponent = ((amax.view(torch.int32) + (1 << 21)) >> 23) & 0xFF
        scale_byte = torch.where(exponent == 255, 254, (exponent - 2).clamp(1, 254))
        inv_scale = power_of_two_bits(127 - scale_byte).view(torch.float32)
        q = blocks.abs() * inv_scale.unsqueeze(-1)
        code = sum((q >= t).to(torch.uint8) for t in _UP_AT_OR_ABOVE) + sum((q > t).to(torch.uint8) for t in _UP_ABOVE)
        negative = (blocks < 0) & (code > 0)
        code = (code | (negative.to(torch.uint8) << 3)).reshape(x.shape[0], padded)[:, :inner]
        packed = code[:, 0::2] | (code[:, 1::2] << 4)
        codes[r0:r0 + rows_per_chunk] = packed.cpu()
        scales[r0:r0 + rows_per_chunk] = scale_byte.to(torch.uint8).cpu()
    return nonfinite


def power_of_two_bits(exponent: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns (int32) of 2**exponent for exponent in [-127, 126], built exactly (2**-127 is subnormal)."""
    import torch

    biased = exponent + 127
    return torch.where(biased > 0, biased << 23, torch.full_like(biased, 1 << 22))


def _quark_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quark's own file-to-file routine (slow; imports Quark): the reference, and the path for non-finite input."""
    from .quark_ref import quark_quantize_weight

    return quark_quantize_weight(weight.detach().cpu())


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, inner: int) -> torch.Tensor:
    """Float32 `[out, inner]` values that `codes`/`scales` encode (for error measurements and checks)."""
    import torch

    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)
    nib = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(codes.shape[0], -1)[:, :inner].long()
    values = grid[nib]
    scale = torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.to(torch.float32) - 127)
    return values * scale.repeat_interleave(BLOCK, dim=1)[:, :inner]
