"""What one entry of the format registry (`mxforge/formats/__init__.py`) holds: an element format, completely.

Three kinds of formats fit one entry. OCP MX formats (below) share a scale per block of consecutive elements;
per-channel formats (FP8 E4M3 with one float32 scale per output row, Quark's `FP8E4M3PerChannelSpec`: the
weight half of PTPC FP8) have `block` None, store one code per byte and their scales `[out]`; 2-D block formats
(block FP8: one float32 scale per `block_rows` x `block` tile, as DeepSeek's and GLM's FP8 releases store weights
and Quark's `per_block` spec names them) store their scales as the tile grid `[ceil(out / block_rows),
ceil(in / block)]`. A format mxforge only keeps from a source that stores it, never quantizes to (no Quark spec
class quantizes to it), says why in `kept_only`.

An OCP MX format (OCP Microscaling Formats v1.0; in Quark, `OCP_MXSpec` and a subclass per element type) stores a
2-D weight `[out, in]` as blocks of `block` consecutive elements along `in` that share one power-of-two scale:
- `X.weight`: each element's code (`element_bits` wide, its value in the code table `values`), packed along `in`
  into whole bytes and stored as `codes_dtype`;
- `X.weight` + `scale_suffix` (`X.weight_scale`): one scale code per block (`ScaleFormat`: E8M0, a biased
  exponent byte, one code meaning NaN), stored `[out, ceil(in / block)]`, the last block shorter when `in` is not
  a multiple of `block`;
- in config.json, Quark's QuantizationSpec for it (`QuarkSpec`: its spec class and the fields that name the
  format: `dtype`, `qscheme`, `group_size`, `scale_format`), which is also how an engine's scheme recognizes it.
How a block's scale is chosen and how elements round are the entry's kernels (`Kernels`), bit for bit Quark's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

from mxforge.errors import ConfigError, NonFiniteWeightError
from mxforge.safetensors_io import DTYPE_SIZE, PlannedTensor, TensorInfo

if TYPE_CHECKING:  # numpy and torch are imported where used: the CLI starts without them, CPU workers without torch
    import numpy as np
    import torch

# The error statistics every kernel adds up while encoding (quantize/error_report.py turns them into figures):
# sum of squared errors, sum of squares, max |error|, count of clipped values (|x| above its block's largest value).
ERROR_STATS = 4
DTYPE_LABELS = {"U8": "uint8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F32": "float32"}  # -> torch
_COUNT_WORDS = {1: "one", 2: "two", 4: "four", 8: "eight"}  # codes per byte, for people


@dataclass(frozen=True)
class ScaleFormat:
    """The block scale: a biased power-of-two exponent, one code per block (E8M0); or a plain float32 (FP32)."""

    name: str | None  # Quark's `scale_format`: "e8m0"; None for a float scale (Quark writes null)
    title: str  # for people: "E8M0"
    dtype: str  # safetensors dtype of the stored codes: "U8"
    bias: int = 0  # a code's value is 2 ** (code - bias) (exponent scales)
    nan_code: int | None = None  # the code that means NaN: every element of its block decodes to NaN

    @property
    def itemsize(self) -> int:
        """Bytes per stored scale."""
        return DTYPE_SIZE[self.dtype]

    def values(self, codes: np.ndarray) -> np.ndarray:
        """float32 scale values `[rows, scales]` of the stored scales: integer exponent `codes` (2^-127 is a float32
        subnormal: exact; the NaN code is NaN), or a float scale's bytes (uint8 `[rows, scales * 4]`) as float32."""
        import numpy as np

        if self.dtype == "F32":
            return np.ascontiguousarray(codes).view("<f4").astype(np.float32)
        exponent = codes.astype(np.int32) - self.bias
        with np.errstate(over="ignore"):
            out = np.ldexp(np.float32(1), exponent).astype(np.float32)
        out[codes == self.nan_code] = np.nan
        return out


# OCP MX's shared scale, every MX format's: value 2^(byte - 127); byte 0xFF is NaN. Quark writes bytes 1..254.
E8M0 = ScaleFormat("e8m0", "E8M0", "U8", bias=127, nan_code=0xFF)
# A float32 scale (Quark's per-channel and per-tensor FP8 weights: `scale_format` null, `scale_type` float32).
FP32 = ScaleFormat(None, "FP32", "F32")


@dataclass(frozen=True)
class QuarkSpec:
    """How Quark describes the format in `quantization_config` (quark.torch.quantization.config.config): the spec
    class and constructor arguments of its static weights and of its dynamic activations (formats/quark.py)."""

    spec_class: str | None  # the DataTypeSpec subclass that builds its QuantizationSpec: "OCP_MXFP4Spec" (None: a
    # kept-only format, whose layer config Quark derives from the source's quantization_config: formats/quark.py)
    dtype: str  # the spec's `dtype`: "fp4"
    qscheme: str = "per_group"  # the spec's `qscheme` (OCP_MXSpec's, for every MX format)
    ch_axis: int = -1  # the weight spec's `ch_axis` (-1: along `in`, MX blocks; 0: one scale per output channel)
    input_ch_axis: int = -1  # the dynamic activations' `ch_axis` (PTPC: 1, one scale per token)
    input_qscheme: str | None = None  # the dynamic activations' `qscheme` where it is not the weights' (block FP8:
    # "per_group", one scale per `input_group_size` activations of a token)
    input_group_size: int | None = None


@dataclass(frozen=True)
class Kernels:
    """A format's numerics. The row kernels fill preallocated uint8 arrays: `codes` `[rows, packed_inner(inner)]`
    (the bytes stored, whatever `codes_dtype` calls them) and `scales` `[rows, ceil(inner / block)]`, and return
    the count of non-finite inputs (their blocks' outputs are then meaningless). `offsets` are a scale rule's
    exponent offsets from Quark's (quantize/scale_rules.py; (0,) is Quark's own); `stats` is None or a float64
    array of ERROR_STATS running sums the rows' error statistics are added to."""

    # (rows: bf16 bits as int16, or float32, [n, inner], codes, scales, offsets, stats) -> non-finite count
    encode_cpu: Callable[..., int]
    # (weight: a torch float tensor [n, inner], codes, scales (uint8 torch, CPU), device, offsets, stats) -> count
    encode_torch: Callable[..., int]
    # (codes uint8 [n, packed], scales uint8 [n, blocks], inner) -> float32 [n, inner]: the values they encode
    decode: Callable[..., np.ndarray]
    # load (or build) the CPU kernels for these safetensors input dtypes now, before workers fork; returns whether
    # they run without torch ops (workers are forked only then: torch's thread pool does not survive a fork once
    # the parent used it). None: the CPU kernel is torch code for every dtype.
    warm: Callable[[set[str]], bool] | None = None


@dataclass(frozen=True)
class ElementFormat:
    """One element format: one entry of the registry, everything mxforge knows about it."""

    name: str  # the registry key and a recipe rule's `format`: "mxfp4"
    title: str  # for people and messages: "MXFP4"
    element: str  # the element type: "E2M1"
    element_bits: int  # bits per element code
    values: tuple[float, ...]  # the code table: the value of code 0 .. 2**element_bits - 1 (sign in the top bit)
    block: int | None  # elements per scale, consecutive along the in-dimension (None: a scale per output row)
    scale: ScaleFormat
    codes_dtype: str  # safetensors dtype the packed codes are stored as
    quark: QuarkSpec
    kernels: Kernels
    scale_suffix: str = "_scale"  # X.weight -> X.weight_scale: Quark's file-to-file writes the tensor name + "_scale"
    scale_rules: bool = False  # the kernels take scale rule offsets other than Quark's (0,)
    block_rows: int = 1  # output rows one scale covers (>1: 2-D tiles of block_rows x block, Quark's `per_block`)
    kept_only: str | None = None  # why mxforge never quantizes to it, only keeps a source's weights so (None: it does)

    def __post_init__(self):
        if len(self.values) != 1 << self.element_bits:
            raise ValueError(f"{self.name}: {len(self.values)} code values for {self.element_bits}-bit elements")

    # --- the stored form ---------------------------------------------------------------------------------
    @property
    def codes_label(self) -> str:
        """The codes' dtype as people (and torch) call it: "uint8"."""
        return DTYPE_LABELS.get(self.codes_dtype, self.codes_dtype)

    @property
    def max_value(self) -> float:
        """The largest magnitude an element can hold, in units of its block's scale (E2M1: 6)."""
        return max(abs(v) for v in self.values if math.isfinite(v))

    def unpackable(self, inner: int) -> str | None:
        """Why a weight with this in-dimension cannot be stored (None: it can)."""
        if inner * self.element_bits % 8 == 0:
            return None
        multiple = 8 // math.gcd(8, self.element_bits)
        if multiple == 2:
            return f"{self.title} packs two codes per byte and in-dimension {inner} is odd"
        return (
            f"{self.title} packs {self.element_bits}-bit codes into whole bytes and in-dimension {inner} is not a "
            f"multiple of {multiple}"
        )

    def packed_inner(self, inner: int) -> int:
        """Bytes of codes per row for `inner` elements.

        Raises:
            ConfigError: an in-dimension that does not pack into whole bytes.
        """
        reason = self.unpackable(inner)
        if reason:
            raise ConfigError(reason)
        return inner * self.element_bits // 8

    def blocks(self, inner: int) -> int:
        """Scales per row for `inner` elements (the last block shorter when `inner` is not a multiple; one for a
        per-channel format)."""
        return 1 if self.block is None else -(-inner // self.block)

    def scale_cell(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The rows x columns of a 2-D weight of `shape` that one scale covers (a per-channel format's: one row)."""
        return self.block_rows, shape[1] if self.block is None else self.block

    def scale_grid_rows(self, rows: int) -> int:
        """Rows of the stored scale tensor for `rows` output rows (a 2-D block format's tile rows)."""
        return -(-rows // self.block_rows)

    def scale_grid_span(self, r0: int, n: int) -> tuple[int, int]:
        """The stored scale rows [g0, g1) that output rows [r0, r0 + n) use."""
        return r0 // self.block_rows, -(-(r0 + n) // self.block_rows)

    def row_scales(self, grid: np.ndarray, r0: int, n: int) -> np.ndarray:
        """Each of output rows [r0, r0 + n)'s scale bytes `[n, scale_row_bytes]` from the stored scale rows
        `scale_grid_span(r0, n)` read as uint8 `grid` (a 2-D block format repeats a tile row's scales over its
        rows; for any other format `grid` is already per row)."""
        if self.block_rows == 1:
            return grid
        import numpy as np

        first = r0 % self.block_rows
        return np.repeat(grid, self.block_rows, axis=0)[first : first + n]

    def scale_row_bytes(self, inner: int) -> int:
        """Bytes of scales per row for `inner` elements (what a kernel's `scales` buffer holds per row)."""
        return self.blocks(inner) * self.scale.itemsize

    @property
    def granularity(self) -> str:
        """What one scale covers, for people: "32 weights", "128x128 weights" or "output channel"."""
        if self.block is None:
            return "output channel"
        return f"{self.block_rows}x{self.block} weights" if self.block_rows > 1 else f"{self.block} weights"

    def unpacked_inner(self, packed: int) -> int:
        """Elements per row that `packed` bytes of codes hold."""
        return packed * 8 // self.element_bits

    def packed_shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, ...]]:
        """(codes shape, scales shape) for a 2-D weight shape `[out, in]` (a per-channel format's scales: `[out]`,
        as Quark writes them; a 2-D block format's: its tile grid).

        Raises:
            ConfigError: not 2-D, or an in-dimension that does not pack into whole bytes.
        """
        if len(shape) != 2:
            raise ConfigError(f"{self.title} needs a 2-D weight, got shape {list(shape)}")
        out, inner = shape
        reason = self.unpackable(inner)
        if reason:
            raise ConfigError(f"{reason} (shape {list(shape)})")
        scales = (out,) if self.block is None else (self.scale_grid_rows(out), self.blocks(inner))
        return (out, self.packed_inner(inner)), scales

    def scale_name(self, weight_name: str) -> str:
        """The name of a quantized weight's scale tensor: `X.weight` -> `X.weight_scale`."""
        return weight_name + self.scale_suffix

    def stored(self, weight_name: str, shape: tuple[int, ...]) -> list[PlannedTensor]:
        """The tensors a quantized 2-D weight is stored as: its codes (under its own name), then its scales.

        Raises:
            ConfigError: see packed_shapes.
        """
        codes, scales = self.packed_shapes(shape)
        return [
            PlannedTensor(weight_name, self.codes_dtype, codes),
            PlannedTensor(self.scale_name(weight_name), self.scale.dtype, scales),
        ]

    def pair_defect(
        self, weight: TensorInfo, scale: TensorInfo | None, shape: tuple[int, int] | None = None
    ) -> str | None:
        """What is wrong with `weight` (stored as this format's codes) and its `scale` tensor as a pair for a weight
        of `shape` `[out, in]` (None: the shape the codes imply); None when they fit."""
        if shape is None:
            if len(weight.shape) != 2:
                return f"{weight.name} is {self.codes_label} {list(weight.shape)}, not 2-D"
            shape = (weight.shape[0], self.unpacked_inner(weight.shape[1]))
        try:
            codes_shape, scales_shape = self.packed_shapes(shape)
        except ConfigError as e:
            return f"{weight.name} is {self.codes_label}, but {e}"
        if weight.shape != codes_shape:
            return f"{weight.name} is {self.codes_label} {list(weight.shape)}, expected {list(codes_shape)}"
        name = self.scale_name(weight.name)
        if scale is None:
            label = DTYPE_LABELS.get(self.scale.dtype, self.scale.dtype)
            return f"{name} is missing (the {self.title} weight needs its {label} {list(scales_shape)} scales)"
        if scale.dtype != self.scale.dtype or scale.shape != scales_shape:
            return f"{name} is {scale.dtype} {list(scale.shape)}, expected {self.scale.dtype} {list(scales_shape)}"
        return None

    def describe(self) -> str:
        """The stored form in one line, for people (the model card's legend)."""
        per = 8 / self.element_bits
        if per == int(per):
            packing = f"{_COUNT_WORDS.get(int(per), str(int(per)))} per byte"
        else:
            g = math.gcd(8, self.element_bits)
            packing = f"{8 // g} per {self.element_bits // g} bytes"
        unit = "byte" if self.scale.itemsize == 1 else "value"
        return (
            f"{self.codes_label} {self.element} codes, {packing}, with one {self.scale.title} "
            f"`weight{self.scale_suffix}` {unit} per {self.granularity}"
        )

    # --- quantization_config -----------------------------------------------------------------------------
    @property
    def spec_fields(self) -> dict:
        """The QuantizationSpec fields that name this format's weights (what Quark writes and engines' schemes
        test): a 2-D block format's tile is `block_size` [rows, cols], any other's block `group_size`."""
        fields: dict = {"dtype": self.quark.dtype, "qscheme": self.quark.qscheme, "scale_format": self.scale.name}
        if self.block_rows > 1:
            fields["block_size"] = [self.block_rows, self.block]
        else:
            fields["group_size"] = self.block
        return fields

    @property
    def input_spec_fields(self) -> dict:
        """The fields of the dynamic activations' QuantizationSpec declared with this format's weights (the weights'
        own, unless the entry gives the activations another qscheme and group)."""
        if self.quark.input_qscheme is None:
            return self.spec_fields
        return {
            "dtype": self.quark.dtype,
            "qscheme": self.quark.input_qscheme,
            "group_size": self.quark.input_group_size,
        }

    def matches_spec(self, spec: Mapping | None) -> bool:
        """Whether a QuantizationSpec dict (a layer config's `weight` or `input_tensors`) is this format."""
        return isinstance(spec, Mapping) and all(spec.get(k) == v for k, v in self.spec_fields.items())

    def matches_input_spec(self, spec: Mapping | None) -> bool:
        """Whether a layer config's `input_tensors` spec is the activations this format's weights are declared with."""
        return isinstance(spec, Mapping) and all(spec.get(k) == v for k, v in self.input_spec_fields.items())

    # --- numerics ----------------------------------------------------------------------------------------
    def quantize(
        self,
        weight: torch.Tensor,
        *,
        name: str | None = None,
        refuse_nonfinite: bool = True,
        device: str | torch.device | None = None,
        offsets: tuple[int, ...] = (0,),
        stats: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A 2-D float weight `[out, in]` as (codes, scales): uint8 tensors of the stored bytes, on the CPU (scales
        `[out, scale_row_bytes(in)]`: for MX formats the stored shape, for a float scale its bytes per row).

        Bit-identical to Quark 0.13's file-to-file output with Quark's `offsets` (0,). `device` (default: the
        weight's) selects where the numerics run: the CPU kernel, or the torch one on any other device.

        Raises:
            ConfigError: not 2-D, not floating point, an in-dimension that does not pack, or a non-finite weight
                with a scale rule other than Quark's.
            NonFiniteWeightError: NaN/Inf present and `refuse_nonfinite` (the message names `name` and the count).
        """
        import torch

        if self.kept_only:
            raise ConfigError(f"{name or 'weight'}: mxforge does not quantize to {self.title}: {self.kept_only}")
        if not weight.is_floating_point():
            raise ConfigError(f"{name or 'weight'}: {self.title} needs a floating-point weight, got {weight.dtype}")
        if offsets != (0,) and not self.scale_rules:
            raise ConfigError(f"{self.title} has no kernel for scale rules other than Quark's")
        codes_shape, _ = self.packed_shapes(tuple(weight.shape))
        device = torch.device(device) if device is not None else weight.device
        codes = torch.empty(codes_shape, dtype=torch.uint8)
        scales = torch.empty((codes_shape[0], self.scale_row_bytes(weight.shape[1])), dtype=torch.uint8)
        if weight.numel() == 0:
            return codes, scales
        if device.type == "cpu":
            src = weight.detach().cpu().contiguous()
            arr = (
                src.view(torch.int16).numpy()
                if src.dtype == torch.bfloat16
                else src.numpy()
                if src.dtype == torch.float16
                else src.to(torch.float32).numpy()
            )
            nonfinite = self.kernels.encode_cpu(arr, codes.numpy(), scales.numpy(), offsets, stats)
        else:
            nonfinite = self.kernels.encode_torch(weight, codes, scales, device, offsets, stats)
        if nonfinite:
            if refuse_nonfinite:
                raise NonFiniteWeightError(
                    f"tensor {name or '(unnamed)'!r} holds {nonfinite} NaN/Inf value(s); quantizing would silently "
                    "encode their blocks as finite values (Quark does). Fix or re-download the source checkpoint",
                    tensor=name,
                )
            if offsets != (0,):
                raise ConfigError(
                    f"tensor {name or '(unnamed)'!r} holds {nonfinite} NaN/Inf value(s): only the quark scale "
                    "rule can encode them (as Quark does)",
                    tensor=name,
                )
            from mxforge.formats.quark import quark_quantize_weight

            return quark_quantize_weight(self, weight.detach().cpu())
        return codes, scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, inner: int) -> torch.Tensor:
        """float32 `[out, inner]`: the values that uint8 `codes` / `scales` (the stored bytes) encode."""
        import torch

        rows = codes.shape[0]
        grid = scales.contiguous().view(torch.uint8).reshape(self.scale_grid_rows(rows), -1).numpy()
        return torch.from_numpy(
            self.kernels.decode(codes.contiguous().view(torch.uint8).numpy(), self.row_scales(grid, 0, rows), inner)
        )


def decode_table(
    values: tuple[float, ...], scale: ScaleFormat, block: int, codes: np.ndarray, scales: np.ndarray, inner: int
) -> np.ndarray:
    """float32 `[rows, inner]` from integer element `codes` (one per element, already unpacked) and scale codes:
    each code's value in the table `values` times its block's scale (a NaN scale code makes its block NaN)."""
    import numpy as np

    table = np.asarray(values, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return table[codes[:, :inner]] * np.repeat(scale.values(scales), block, axis=1)[:, :inner]


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bit patterns (int16 or uint16), exactly."""
    import numpy as np

    return (bits.astype(np.int32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (int16), round to nearest even, as torch's `.to(torch.bfloat16)` (a NaN stays a
    quiet NaN)."""
    import numpy as np

    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, (u >> 16) | 0x40, rounded)
    return rounded.astype(np.uint16).view(np.int16)


def rounding_boundaries(values: tuple[float, ...]) -> tuple[tuple[float, bool], ...]:
    """Where rounding to the nearest magnitude of a code table moves up a code, in units of the block scale: per
    step between consecutive non-negative magnitudes, (midpoint, ties go up). A tie goes to the even code (round
    half to even, Quark's `half_even`): up when the code below it is odd."""
    half = len(values) // 2
    mags = list(values[:half])
    return tuple(((mags[c] + mags[c + 1]) / 2, c % 2 == 1) for c in range(half - 1))


# --- building blocks for a format's kernels (Quark's rules, shared by the entries) ---------------------------
def even_scale_codes(amax: torch.Tensor, mantissa_bits: int, emax: int) -> torch.Tensor:
    """Quark's "even" E8M0 scale code (int32) of blocks whose largest magnitude is float32 `amax`: the exponent of
    amax after rounding its mantissa at the element's precision (adding 1 << (22 - mantissa_bits) to its bits),
    minus the element's largest exponent `emax`, biased by 127 and clamped to [1, 254] (254 where the rounding
    carries past float32's largest exponent). An all-zero block gets code 1."""
    import torch

    exponent = ((amax.to(torch.float32).view(torch.int32) + (1 << (22 - mantissa_bits))) >> 23) & 0xFF
    return torch.where(exponent == 255, 254, (exponent - emax).clamp(1, 254))


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """float32 2**exponent for integer exponents in [-127, 126], built exactly from its bits (2**-127 is
    subnormal)."""
    import torch

    biased = exponent.to(torch.int32) + 127
    return torch.where(biased > 0, biased << 23, torch.full_like(biased, 1 << 22)).view(torch.float32)


def magnitude_codes(q: torch.Tensor, values: tuple[float, ...]) -> torch.Tensor:
    """The magnitude code (uint8, 0 .. half the table) of each |x| / scale in `q`: rounded half to even onto the
    table's non-negative values, saturating at the largest."""
    import torch

    layout = float_layout(values)
    if layout is None or q.dtype != torch.float32:  # not a floating-point table: one comparison per boundary
        code = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
        for boundary, ties_up in rounding_boundaries(values):
            code += (q >= boundary if ties_up else q > boundary).to(torch.uint8)
        return code
    # A floating-point table (E2M1, E2M3, E3M2...): the same half-to-even rounding done on q's float32 bits at the
    # table's mantissa width, and in the subnormal range on q in units of the smallest subnormal (both scalings
    # exact: powers of two), instead of one pass over q per boundary (31 for FP6).
    m, min_exponent = layout  # mantissa bits; float32 exponent field of the smallest normal magnitude
    shift = 23 - m
    bits = q.view(torch.int32)
    rounded = bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)
    normal = (((rounded >> 23) - min_exponent + 1) << m) | ((rounded >> shift) & ((1 << m) - 1))
    subnormal = torch.round(q * 2.0 ** (127 - min_exponent + m)).to(torch.int32)
    code = torch.where(q < 2.0 ** (min_exponent - 127), subnormal, normal).clamp(0, len(values) // 2 - 1)
    return torch.where(torch.isnan(q), 0, code).to(torch.uint8)  # NaN passes no boundary, as the comparisons had it


@functools.lru_cache(maxsize=None)  # asked for every row chunk (and every scale-rule offset) of every tensor
def float_layout(values: tuple[float, ...]) -> tuple[int, int] | None:
    """(mantissa bits, float32 exponent field of the smallest normal) when the table's non-negative magnitudes are a
    floating-point format's with subnormals (code c = exponent field e, mantissa f: f * 2^-m * smallest normal when e
    is 0, else smallest normal * 2^(e-1) * (1 + f * 2^-m)), else None."""
    mags = values[: len(values) // 2]
    for m in range(1, 8):
        if len(mags) <= 1 << m or mags[1] <= 0:
            return None
        smallest = mags[1 << m]
        exponent = math.frexp(smallest)[1] - 1 + 127  # float32 exponent field of a power of two
        if smallest != 2.0 ** (exponent - 127):
            continue
        if all(
            v
            == (
                (c & ((1 << m) - 1)) * 2.0**-m * smallest
                if c >> m == 0
                else smallest * 2.0 ** ((c >> m) - 1) * (1 + (c & ((1 << m) - 1)) * 2.0**-m)
            )
            for c, v in enumerate(mags)
        ):
            return m, exponent
    return None


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes `[rows, inner * bits / 8]` of `bits`-wide codes `[rows, inner]`, packed little-endian along the
    row: code i takes bits i * bits .. (i + 1) * bits - 1 of the row's bit stream (E2M1: the first in the low
    nibble)."""
    import numpy as np

    rows, inner = codes.shape
    per = math.lcm(bits, 8) // bits  # codes per group of whole bytes
    nbytes = per * bits // 8
    groups = codes.reshape(rows, inner // per, per).astype(np.uint64)
    word = np.zeros(groups.shape[:2], dtype=np.uint64)
    for i in range(per):
        word |= groups[..., i] << np.uint64(i * bits)
    out = np.empty((rows, inner // per, nbytes), dtype=np.uint8)
    for j in range(nbytes):
        out[..., j] = (word >> np.uint64(8 * j)) & np.uint64(0xFF)
    return out.reshape(rows, -1)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """The codes (uint8 `[rows, packed * 8 / bits]`) that `pack_codes` packed."""
    import numpy as np

    rows = packed.shape[0]
    per = math.lcm(bits, 8) // bits
    nbytes = per * bits // 8
    groups = packed.reshape(rows, -1, nbytes).astype(np.uint64)
    word = np.zeros(groups.shape[:2], dtype=np.uint64)
    for j in range(nbytes):
        word |= groups[..., j] << np.uint64(8 * j)
    out = np.empty((rows, groups.shape[1], per), dtype=np.uint8)
    for i in range(per):
        out[..., i] = (word >> np.uint64(i * bits)) & np.uint64((1 << bits) - 1)
    return out.reshape(rows, -1)


def add_error_stats(
    x: torch.Tensor, reconstructed: torch.Tensor, clipped: torch.Tensor, finite: torch.Tensor, stats: np.ndarray
) -> None:
    """Add the ERROR_STATS of blocks `[..., block]` to `stats` in float64: magnitudes `x` and what the codes
    reconstruct of them, the mask of clipped elements (above their block's largest value), and which blocks are
    finite (the others are not measured)."""
    import torch

    x, reconstructed = x.to(torch.float64), reconstructed.to(torch.float64)
    err = (x - reconstructed)[finite]
    stats[0] += float((err * err).sum())
    stats[1] += float((x[finite] ** 2).sum())
    stats[2] = max(stats[2], float(err.abs().max()) if err.numel() else 0.0)
    stats[3] += int(clipped[finite].sum())
