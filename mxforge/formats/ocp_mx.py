"""OCP MX numerics for any element type: what Quark 0.13's `OCP_MXSpec` subclasses share (an E8M0 scale per block of
32 along the input dimension, Quark's "even" scale, elements rounded half to even onto the element's grid and
saturating at its largest value, codes packed little-endian along the row), parametrized by the element's facts
(`MxElement`). An MX entry of the registry (MXFP6 E2M3 and E3M2: mxforge/formats/mxfp6.py) takes its kernels from
`mx_kernels`; MXFP4 has its own faster C and numba CPU kernels and takes its torch kernel from here.

What Quark writes for a weight `[out, in]`, per block of 32 (`_single_stage_quantize_weight` with the spec; checked
byte for byte in tests):
- scale byte: the block's amax as float32 bits plus `1 << (22 - mantissa_bits)` (rounds the amax's mantissa at the
  element's precision), its exponent field minus the element's largest exponent `emax`, clamped to [1, 254] (254
  where the rounding carries past float32's largest exponent); an all-zero block gets 1 (element.even_scale_codes);
- element: |x| * 2^(127 - byte) in float32 (exact), rounded half to even onto the element's grid (subnormals
  included) and saturating at its largest value; the sign in the top bit, except that a value rounding to zero is
  +0;
- codes packed `element_bits` wide, the first element in the lowest bits (element.pack_codes); scales `[out,
  ceil(in / 32)]`, the last block shorter.
A scale rule (quantize/scale_rules.py) tries exponent offsets from Quark's per block and keeps the one whose block
error, summed in float32 in the rules' lane order, is smallest (ties keep the earlier).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mxforge.formats.element import (
    E8M0,
    Kernels,
    add_error_stats,
    decode_table,
    even_scale_codes,
    magnitude_codes,
    pack_codes,
    power_of_two,
    unpack_codes,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

BLOCK = 32  # OCP MX's block: elements per E8M0 scale (Quark's OCP_MXSpec group_size)
ERROR_LANES = 8  # a scale rule's block error is summed in this many lanes (quantize/scale_rules.py)
ROW_CHUNK_ELEMENTS = 1 << 20  # elements per chunk of the kernels: about 4 MB of float32 at a time
C_SOURCE = Path(__file__).with_name("_mx_bf16.c")  # the bf16 CPU kernel of any element (c_kernel)


@dataclass(frozen=True)
class MxElement:
    """An OCP MX element type: `bits` wide (the sign in the top bit), `mantissa_bits` of mantissa, exponent bias
    `bias`, no infinity or NaN codes; its code table and largest exponent follow."""

    bits: int
    mantissa_bits: int
    bias: int

    @property
    def emax(self) -> int:
        """The largest exponent of a normal value (every exponent field is a value's: no Inf/NaN codes)."""
        return (1 << (self.bits - 1 - self.mantissa_bits)) - 1 - self.bias

    @property
    def values(self) -> tuple[float, ...]:
        """The value of every code: exponent field 0 is subnormal (mantissa * 2^(1 - bias - mantissa_bits))."""
        m = self.mantissa_bits
        mags = []
        for code in range(1 << (self.bits - 1)):
            e, f = code >> m, code & ((1 << m) - 1)
            mags.append(f * 2.0 ** (1 - self.bias - m) if e == 0 else 2.0 ** (e - self.bias) * (1 + f / 2**m))
        return tuple(mags) + tuple(-v for v in mags)

    @property
    def max_value(self) -> float:
        return self.values[(1 << (self.bits - 1)) - 1]


def _blocks(x, nblocks: int):
    """Rows `[n, inner]` padded with zeros to whole blocks, `[n, nblocks, BLOCK]` (torch)."""
    import torch

    padded = nblocks * BLOCK
    if padded != x.shape[1]:
        x = torch.nn.functional.pad(x, (0, padded - x.shape[1]))
    return x.reshape(x.shape[0], nblocks, BLOCK)


def rule_offsets(
    blocks: torch.Tensor,
    quark_byte: torch.Tensor,
    finite: torch.Tensor,
    offsets: tuple[int, ...],
    values: tuple[float, ...],
) -> torch.Tensor:
    """Per block, the offset from Quark's exponent that a scale rule picks (scale_rules.py): each candidate's
    squared block error, its elements rounded as Quark rounds them, summed in float32 in the rules' lane order
    (element i in lane i % 8, lanes combined ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))); ties keep the earlier."""
    import torch

    xs = blocks.abs() * power_of_two(E8M0.bias - quark_byte).unsqueeze(-1)  # |x| / 2^eq, exact
    grid = torch.tensor(values[: len(values) // 2], dtype=torch.float32, device=blocks.device)
    best = torch.zeros_like(quark_byte)
    best_error = None
    for d in offsets:
        code = magnitude_codes(xs * 2.0**-d, values)
        r = xs - grid[code.long()] * 2.0**d
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


def quantize_torch(
    element: MxElement,
    weight: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    device: torch.device,
    offsets: tuple[int, ...] = (0,),
    stats: np.ndarray | None = None,
) -> int:
    """Quantize a float weight `[out, in]` on `device` in row chunks into CPU uint8 `codes` / `scales` (and add the
    error sums to `stats`); returns the count of non-finite values (their blocks' outputs are meaningless)."""
    import torch

    values = element.values
    out, inner = weight.shape
    nblocks = scales.shape[1]
    rows_per_chunk = max(1, ROW_CHUNK_ELEMENTS // (nblocks * BLOCK))
    nonfinite = 0
    grid = torch.tensor(values[: len(values) // 2], dtype=torch.float64, device=device)
    for r0 in range(0, out, rows_per_chunk):
        x = weight[r0 : r0 + rows_per_chunk].to(device=device, dtype=torch.float32)
        nonfinite += int((~torch.isfinite(x)).sum())
        blocks = _blocks(x, nblocks)
        amax = blocks.abs().amax(dim=-1)
        byte = even_scale_codes(amax, element.mantissa_bits, element.emax)
        finite = torch.isfinite(amax)
        if len(offsets) > 1:
            byte = byte + rule_offsets(blocks, byte, finite, offsets, values)
        q = blocks.abs() * power_of_two(E8M0.bias - byte).unsqueeze(-1)
        mag = magnitude_codes(q, values)
        if stats is not None:
            scale = power_of_two(byte - E8M0.bias).to(torch.float64).unsqueeze(-1)
            add_error_stats(blocks.abs(), grid[mag.long()] * scale, q > element.max_value, finite, stats)
        code = mag | (((blocks < 0) & (mag > 0)).to(torch.uint8) << (element.bits - 1))
        code = code.reshape(x.shape[0], -1)[:, :inner]
        codes[r0 : r0 + rows_per_chunk] = torch.from_numpy(pack_codes(code.cpu().numpy(), element.bits))
        scales[r0 : r0 + rows_per_chunk] = byte.to(torch.uint8).cpu()
    return nonfinite


def c_kernel(element: MxElement):
    """The C function `mx_quantize_bf16(rows, codes, scales, n_rows, inner, offsets, n_offsets, stats) -> nonfinite`
    built for `element` (`_mx_bf16.c`, through formats/native.py), or None where no C compiler works."""
    import ctypes

    from mxforge.formats.native import compiled

    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    defines = (BLOCK, ERROR_LANES, element.bits, element.mantissa_bits, element.bias)
    names = ("BLOCK", "LANES", "BITS", "MBITS", "BIAS")
    return compiled(
        C_SOURCE,
        "mx_quantize_bf16",
        (p, p, p, i64, i64, p, i32, p),
        i64,
        tuple(f"-D{n}={v}" for n, v in zip(names, defines, strict=True)),
    )


def quantize_rows_cpu(
    element: MxElement,
    rows: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    offsets: tuple[int, ...] = (0,),
    stats: np.ndarray | None = None,
) -> int:
    """The CPU kernel: rows (bf16 bits as int16, float16 or float32) into preallocated `codes` / `scales` (uint8).
    bf16 rows go to the element's C kernel (`c_kernel`; a worker running it never imports torch); other dtypes, and
    every dtype where no C compiler works, through torch's CPU ops in row chunks (`quantize_torch` on the CPU)."""
    import warnings

    import numpy as np

    if rows.dtype == np.int16 and codes.flags.c_contiguous and scales.flags.c_contiguous:
        native = c_kernel(element)
        if native is not None:
            from mxforge.formats.native import call_rows_kernel

            return call_rows_kernel(native, rows, codes, scales, offsets, stats)
    import torch

    with warnings.catch_warnings():  # a read-only view of the shard's mapping: only read here, never written
        warnings.simplefilter("ignore", UserWarning)
        w = torch.from_numpy(rows)
    if rows.dtype.itemsize == 2 and rows.dtype.kind == "i":
        w = w.view(torch.bfloat16)  # bf16 bits, as the shard jobs pass them
    return quantize_torch(
        element, w, torch.from_numpy(codes), torch.from_numpy(scales), torch.device("cpu"), offsets, stats
    )


def decode_rows(element: MxElement, codes: np.ndarray, scales: np.ndarray, inner: int) -> np.ndarray:
    """float32 `[rows, inner]`: each element's value times its block's scale 2^(byte - 127) (NaN byte: NaN)."""
    return decode_table(element.values, E8M0, BLOCK, unpack_codes(codes, element.bits), scales, inner)


def warm_cpu_kernel(element: MxElement, dtypes: set[str]) -> bool:
    """Build (or load) the C kernel now; whether it serves every one of these safetensors dtypes (bf16 only: the
    others, and bf16 without a compiler, run torch ops, so their workers are spawned, not forked)."""
    return dtypes <= {"BF16"} and c_kernel(element) is not None


def mx_kernels(element: MxElement) -> Kernels:
    """The kernels of an OCP MX entry with this element type."""
    import functools

    return Kernels(
        encode_cpu=functools.partial(quantize_rows_cpu, element),
        encode_torch=functools.partial(quantize_torch, element),
        decode=functools.partial(decode_rows, element),
        warm=functools.partial(warm_cpu_kernel, element),
    )
