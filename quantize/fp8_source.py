"""FP8 sources: which FP8 layouts mxforge reads, and how a stored FP8 weight becomes the bf16 it stands for.

Supported: DeepSeek-style block-scaled FP8, the layout of every official FP8 release of the families mxforge
knows (deepseek-ai/DeepSeek-V3, R1, V3.1, V3.2; zai-org/GLM-5-FP8 .. GLM-5.2-FP8): config.json's
`quantization_config` = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}; each
quantized 2-D `X.weight` is F8_E4M3 (float8_e4m3fn) with a float32 `X.weight_scale_inv` holding one scale per
block of the weight ([ceil(rows/bm), ceil(cols/bn)]).

Dequantization is the reference's: DeepSeek-V3's `inference/kernel.py` `weight_dequant` (and transformers'
fine-grained FP8 dequantization, sglang's and vLLM's block dequant, which agree): the e4m3 value and its block
scale multiplied in float32, the product rounded to bf16 (round to nearest even). tests/test_fp8_source.py
checks it bit for bit against transformers' code and the engines' wheels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from mxforge.errors import ConfigError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16")
SUPPORTED = (
    '{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [m, n]} with F8_E4M3 weights and '
    "F32 `weight_scale_inv` (DeepSeek-V3/R1/V3.1/V3.2, GLM-5/5.1/5.2 FP8 releases), or no quantization_config (bf16)"
)


@dataclass(frozen=True)
class SourcePrecision:
    """What the source's weights are stored as: "bf16", or block-scaled FP8 with its block shape."""

    name: str  # "bf16" or "fp8"
    block: tuple[int, int] | None = None  # fp8: (rows, cols) of one scale block

    @property
    def is_fp8(self) -> bool:
        return self.block is not None

    def describe(self) -> str:
        if self.block is None:
            return self.name
        return f"fp8 (e4m3, {self.block[0]}x{self.block[1]} block scales, weight_scale_inv)"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The `weight_scale_inv` shape of a weight of `shape`: one scale per block, the last ones partial."""
        assert self.block is not None
        return -(-shape[0] // self.block[0]), -(-shape[1] // self.block[1])


BF16 = SourcePrecision("bf16")


def source_precision(config: Mapping[str, Any], where: str = "config.json") -> SourcePrecision:
    """The source precision config.json declares (its `quantization_config`; none: bf16).

    Raises:
        ConfigError: a quantization_config mxforge cannot read (names what it supports).
    """
    qc = config.get("quantization_config")
    if qc is None:
        return BF16
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        block = qc.get("weight_block_size")
        if (
            fmt == "e4m3"
            and isinstance(block, list)
            and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            return SourcePrecision("fp8", (block[0], block[1]))
        what = f"fmt {fmt!r}, weight_block_size {block!r}"
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
    """A stored scale tensor as float32 [block rows, block cols]."""
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4").reshape(shape)
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(shape)


def dequantize_rows(codes, scales: np.ndarray, first_row: int, cols: int, block: tuple[int, int]) -> np.ndarray:
    """Rows [first_row, first_row + n) of an FP8 weight (raw e4m3 bytes, n x cols) as bf16 bit patterns (int16):
    float32(e4m3) * float32(block scale), rounded to nearest even bf16 (NaN stays NaN).

    Each block row's 256 possible products per block column are tabulated once (exactly that formula), so a weight
    costs one table lookup per element."""
    c = np.frombuffer(codes, dtype=np.uint8).reshape(-1, cols)
    n, (bm, bn) = c.shape[0], block
    out = np.empty((n, cols), dtype=np.int16)
    column_table = (np.arange(cols, dtype=np.intp) // bn) * 256  # where each column's block's table starts
    r = 0
    while r < n:
        block_row = (first_row + r) // bm
        end = min(n, (block_row + 1) * bm - first_row)
        table = f32_to_bf16_bits(scales[block_row][:, None] * E4M3_TO_F32[None, :]).ravel()
        np.take(table, c[r:end] + column_table, out=out[r:end], mode="clip")
        r = end
    return out


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (int16), round to nearest even, as torch's `.to(torch.bfloat16)`."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, (u >> 16) | 0x40, rounded)
    return rounded.astype(np.uint16).view(np.int16)
