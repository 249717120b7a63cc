"""FP8 sources: which FP8 layouts mxforge reads, and how a stored FP8 weight becomes the bf16 it stands for.

Supported (FP8_SCHEMES, one entry per layout; config.json's `quantization_config` picks it, READERS per quant_method;
a new layout is an entry and, for a new quant_method, a reader: tests/test_extension_points.py adds one):
- "block": DeepSeek-style block-scaled FP8, the layout of the official FP8 releases of deepseek-ai/DeepSeek-V3, R1,
  V3.1, V3.2 and zai-org/GLM-5-FP8 .. GLM-5.2-FP8: {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128,
  128], ...}; each quantized 2-D `X.weight` is F8_E4M3 with a float32 `X.weight_scale_inv` holding one scale per
  block ([ceil(rows/bm), ceil(cols/bn)]).
- "channel" / "tensor": compressed-tensors FP8 ({"quant_method": "compressed-tensors", "format": "float-quantized",
  config_groups whose weights are {num_bits 8, type float, symmetric, strategy channel | tensor}}), the layout of
  zai-org/GLM-4.5-FP8 (and 4.6 / 4.7-FP8, channel): each quantized `X.weight` is F8_E4M3 with `X.weight_scale` (F32 or
  BF16) of shape [out, 1] (channel) or one value (tensor), and a static `X.input_scale` (activations; consumed, not
  written: the output's activations are dynamic). A weight a recipe keeps as stored becomes FP8 PTPC: the same codes,
  one float32 scale per output row (the channel's own, or the tensor's repeated), activations dynamic per token.

Dequantization is the reference's: DeepSeek-V3's `inference/kernel.py` `weight_dequant` for block FP8 (transformers'
fine-grained FP8 dequantization, sglang's and vLLM's block dequant agree), compressed-tensors' `_dequantize` (what its
FP8 decompressor runs; vLLM's `scaled_dequantize` agrees) for the others: the e4m3 value and its scale multiplied in
float32, the product rounded to bf16 (round to nearest even). tests/quantize/test_fp8_source.py checks both bit for bit
against that code, executed from transformers and from the wheels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from mxforge.errors import ConfigError
from mxforge.formats.element import f32_to_bf16_bits

FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16")


GRANULARITIES = ("block", "channel", "tensor")  # what one scale covers: a config-given block, an output row, all


@dataclass(frozen=True)
class Fp8Scheme:
    """One FP8 layout: what one scale covers, how the scales are named and shaped, which other per-weight
    tensors it stores, and how people and errors name it."""

    name: str
    granularity: str  # one of GRANULARITIES ("block": SourcePrecision.block, from config.json)
    scale_suffix: str  # appended to the weight's name: "X.weight" -> "X.weight_scale_inv"
    siblings: tuple[str, ...]  # other tensors of the module consumed with the weight ("input_scale": X.input_scale)
    label: str  # for people (inspect, the card): "{rows}x{cols} block scales, weight_scale_inv"
    rule: str  # how config.json states the layout, for errors: "weight_block_size [{rows}, {cols}]"
    supported: str  # the quantization_config that selects it and the releases that store it (for errors)
    # what a weight the recipe quantizes is quantized from: "F32", the exact float32 product (Quark 0.13's
    # file-to-file for `quant_method: "fp8"` sources quantizes its FP8 dequantization kernel's float32 output), or
    # "BF16", that product rounded to the bf16 it stands for (compressed-tensors' decompression; Quark reads no
    # compressed-tensors source). A kept weight is always that bf16.
    quantized_from: str = "BF16"
    # the registry format (mxforge/formats/) a weight a recipe keeps as the source stores it is written in: its codes
    # byte for byte, its scales as that format stores them (quantize/plan.py checks they fit exactly)
    kept_as: str = "fp8_ptpc"

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"FP8 scheme {self.name!r}: granularity {self.granularity!r} is not one of {GRANULARITIES}"
            )


_BLOCK_FP8 = (
    '{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [m, n]} with F8_E4M3 weights and '
    "F32 `weight_scale_inv` (DeepSeek-V3/R1/V3.1/V3.2, GLM-5/5.1/5.2 FP8 releases)"
)
_CT_FP8 = (
    'compressed-tensors "float-quantized" with 8-bit float symmetric weights, strategy "channel" or "tensor", and '
    "`weight_scale` (GLM-4.5/4.6/4.7 FP8 releases)"
)
FP8_SCHEMES = {
    s.name: s
    for s in (
        Fp8Scheme(
            "block",
            "block",
            "_scale_inv",
            (),
            "{rows}x{cols} block scales, weight_scale_inv",
            "weight_block_size [{rows}, {cols}]",
            _BLOCK_FP8,
            quantized_from="F32",
            kept_as="fp8_block",  # as Quark's file-to-file keeps it
        ),
        Fp8Scheme(
            "channel",
            "channel",
            "_scale",
            ("input_scale",),
            "compressed-tensors, per-channel weight_scale",
            "compressed-tensors strategy 'channel'",
            _CT_FP8,
        ),
        Fp8Scheme(
            "tensor",
            "tensor",
            "_scale",
            ("input_scale",),
            "compressed-tensors, per-tensor weight_scale",
            "compressed-tensors strategy 'tensor'",
            _CT_FP8,
        ),
    )
}
SUPPORTED = "; ".join(dict.fromkeys(s.supported for s in FP8_SCHEMES.values())) + "; or no quantization_config (bf16)"


@dataclass(frozen=True)
class SourcePrecision:
    """What the source's weights are stored as: "bf16", or FP8 under one of FP8_SCHEMES (block FP8: its block)."""

    name: str  # "bf16" or "fp8"
    block: tuple[int, int] | None = None  # block FP8: (rows, cols) of one scale block
    scheme: str = ""  # FP8: a key of FP8_SCHEMES

    @property
    def is_fp8(self) -> bool:
        return bool(self.scheme)

    @property
    def fp8(self) -> Fp8Scheme:
        return FP8_SCHEMES[self.scheme]

    def describe(self) -> str:
        if not self.is_fp8:
            return self.name
        rows, cols = self.block or (0, 0)
        return f"fp8 (e4m3, {self.fp8.label.format(rows=rows, cols=cols)})"

    def scale_rule(self) -> str:
        """How config.json says the scales are laid out (for error messages)."""
        rows, cols = self.block or (0, 0)
        return self.fp8.rule.format(rows=rows, cols=cols)

    def block_of(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The rows x cols one scale covers in a weight of `shape` (per channel: one row; per tensor: all of it)."""
        granularity = self.fp8.granularity
        if granularity == "block" and self.block is not None:
            return self.block
        if granularity == "channel":
            return 1, shape[1]
        if granularity == "tensor":
            return shape[0], shape[1]
        raise ValueError(f"FP8 scheme {self.scheme!r}: granularity {granularity!r} without its block")

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scales of a weight of `shape` as a 2-D grid: one per block, the last ones partial."""
        bm, bn = self.block_of(shape)
        return -(-shape[0] // bm), -(-shape[1] // bn)

    def stored_scale_shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The shapes a weight's scale tensor may have on disk (compressed-tensors: [out, 1] or [out]; [] or [1])."""
        grid = self.scale_shape(shape)
        if self.fp8.granularity == "channel":
            return grid, grid[:1]
        if self.fp8.granularity == "tensor":
            return grid, (1,), ()
        return (grid,)

    def sibling_names(self, weight: str) -> list[str]:
        """The other tensors of `weight`'s module this layout stores with it (consumed, not written)."""
        module = weight.removesuffix("weight")
        return [module + s for s in self.fp8.siblings] if self.is_fp8 else []


BF16 = SourcePrecision("bf16")


def _block_fp8(qc: Mapping[str, Any]) -> SourcePrecision | str:
    fmt = qc.get("fmt", "e4m3")
    block = qc.get("weight_block_size")
    if (
        fmt == "e4m3"
        and isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        return SourcePrecision("fp8", (block[0], block[1]), "block")
    return f"fmt {fmt!r}, weight_block_size {block!r}"


def _compressed_tensors(qc: Mapping[str, Any]) -> SourcePrecision | str:
    """compressed-tensors FP8: every config group's weights 8-bit float (e4m3), symmetric, per channel or tensor."""
    groups = qc.get("config_groups")
    what = f"quant_method 'compressed-tensors', format {qc.get('format')!r}"
    if not isinstance(groups, dict) or not groups:
        return what + ", no config_groups"
    if qc.get("kv_cache_scheme"):
        return what + f", kv_cache_scheme {qc.get('kv_cache_scheme')!r}"
    strategies = set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        fmt = (group.get("format") if isinstance(group, dict) else None) or qc.get("format")
        if (
            not isinstance(weights, dict)
            or fmt != "float-quantized"
            or weights.get("type") != "float"
            or weights.get("num_bits") != 8
            or weights.get("symmetric", True) is not True
            or weights.get("dynamic", False) is not False
            or weights.get("strategy") not in ("channel", "tensor")
            or weights.get("group_size") is not None
            or weights.get("block_structure") is not None
        ):
            keys = ("type", "num_bits", "strategy", "symmetric", "group_size", "block_structure")
            described = {k: weights.get(k) for k in keys} if isinstance(weights, dict) else weights
            return f"{what}, config group {name!r}: format {fmt!r}, weights {described!r}"
        strategies.add(weights["strategy"])
    if len(strategies) > 1:
        return f"{what}, weight strategies {sorted(strategies)} mixed across config groups"
    return SourcePrecision("fp8", None, strategies.pop())


READERS: dict[str, Callable[[Mapping[str, Any]], SourcePrecision | str]] = {
    "fp8": _block_fp8,
    "compressed-tensors": _compressed_tensors,
}


def source_precision(config: Mapping[str, Any], where: str = "config.json") -> SourcePrecision:
    """The source precision config.json declares (its `quantization_config`; none: bf16).

    Raises:
        ConfigError: a quantization_config mxforge cannot read (names what it supports).
    """
    qc = config.get("quantization_config")
    if qc is None:
        return BF16
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    reader = READERS.get(method) if isinstance(method, str) else None
    if reader is not None:
        found = reader(qc)
        if isinstance(found, SourcePrecision):
            return found
        what = found
    else:
        what = f"quant_method {method!r}" + (
            f", format {qc.get('format')!r}" if isinstance(qc, dict) and qc.get("format") else ""
        )
    raise ConfigError(
        f"{where}: quantization_config ({what}) is a source precision mxforge does not read; supported: "
        f"{SUPPORTED}. Dequantize the checkpoint to bf16 first, or use the model's bf16 or FP8 release"
    )


def _e4m3fn_table() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn codes (bias 7, no infinities, S.1111.111 = NaN)."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
    value = np.where((exp == 15) & (man == 7), np.nan, value)
    return (sign * value).astype(np.float32)


E4M3_TO_F32 = _e4m3fn_table()


def scales_as_f32(raw, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A stored scale tensor (F32 or BF16) as float32 of `shape` (SourcePrecision.scale_shape: its 2-D grid)."""
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4").reshape(shape)
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(shape)


TABLE_ROWS = 128  # weight rows whose lookup tables are built at once (one 128-row block, or 128 per-channel scales)


def dequantize_rows(
    codes, scales: np.ndarray, first_row: int, cols: int, block: tuple[int, int], dtype: str = "BF16"
) -> np.ndarray:
    """Rows [first_row, first_row + n) of an FP8 weight (raw e4m3 bytes, n x cols) as bf16 bit patterns (int16):
    float32(e4m3) * float32(scale of its block), rounded to nearest even bf16 (NaN stays NaN); with `dtype` "F32"
    the float32 products themselves. `scales` is the 2-D grid of one scale per `block` (per channel: block
    (1, cols); per tensor: the whole weight).

    The 256 possible products of each scale are tabulated once (exactly that formula), so a weight costs one table
    lookup per element."""
    c = np.frombuffer(codes, dtype=np.uint8).reshape(-1, cols)
    n, (bm, bn) = c.shape[0], block
    out = np.empty((n, cols), dtype=np.float32 if dtype == "F32" else np.int16)
    column_table = (np.arange(cols, dtype=np.intp) // bn) * 256  # where each column's block's table starts
    per_block_row = scales.shape[1] * 256
    block_rows_per_step = max(1, TABLE_ROWS // bm)
    r = 0
    while r < n:
        first = (first_row + r) // bm
        end = min(n, (first + block_rows_per_step) * bm - first_row)
        last = (first_row + end - 1) // bm
        products = scales[first : last + 1][:, :, None] * E4M3_TO_F32
        table = (products if dtype == "F32" else f32_to_bf16_bits(products)).ravel()
        index = c[r:end] + column_table
        if last > first:
            index += (((first_row + np.arange(r, end)) // bm - first) * per_block_row)[:, None]
        np.take(table, index, out=out[r:end], mode="clip")
        r = end
    return out
