"""What quantize will write: per source shard, each tensor's fate and the output shard's exact byte layout.

An output shard keeps its source shard's name and holds, in safetensors order, every tensor of that
shard: kept ones unchanged, each quantized `X.weight` as the tensors its element format stores (mxforge/formats/:
codes under `X.weight` and their block scales beside it).
Headers carry no `__metadata__`, as Quark's file-to-file writes them.

FP8 sources (fp8_source.py): an F8_E4M3 weight is read as the bf16 its scales make of it, so it is quantized from
that bf16, or kept as that bf16; its scales (`weight_scale_inv`, or compressed-tensors' `weight_scale` and the
module's static `input_scale`) are consumed (fate "scale"), not written. An FP8 weight a recipe keeps as the source
stores it (fate "kept_source") keeps its codes byte for byte, its scales written as its layout's `kept_as` format
stores them: block FP8 as Quark keeps it (`X.weight_scale_inv` -> `X.weight_scale`, the same bytes,
mxforge/formats/fp8_block.py), compressed-tensors' per-channel or per-tensor scales as FP8 PTPC (one float32 scale
per output row, the same values; its input_scale is not written: PTPC's activations are dynamic).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from mxforge.checkpoint import INDEX_NAME, Checkpoint
from mxforge.errors import CheckpointError, ConfigError
from mxforge.formats import ElementFormat, format_named
from mxforge.models import MoeLayout, layout_of
from mxforge.quantize.fp8_source import BF16, FP8_DTYPE, SCALE_DTYPES, SourcePrecision, source_precision
from mxforge.quantize.recipe import Recipe, is_linear_weight_name
from mxforge.safetensors_io import PlannedTensor, TensorInfo, encode_header, read_header, safetensors_order

Fate = Literal["quantized", "kept", "kept_source", "copied", "scale"]
QUANTIZABLE_DTYPES = ("BF16", "F16", "F32")
SHARD_METADATA: dict[str, str] = {}


@dataclass(frozen=True)
class Fp8Scale:
    """Where an FP8 weight's scales are: the shard holding them (maybe another one), their header entry, the rows x
    cols one scale covers and the 2-D grid they are read as (SourcePrecision.block_of, scale_shape)."""

    shard: str
    info: TensorInfo
    block: tuple[int, int]
    grid: tuple[int, int]
    quantized_from: str = "BF16"  # what the weight is quantized from: the dequantized F32 or BF16 (Fp8Scheme's)
    kept_as: str = "fp8_block"  # the registry format a weight kept as stored is written in (Fp8Scheme's)

    def kept_scales(self, grid: np.ndarray, fmt: ElementFormat, shape: tuple[int, ...]) -> np.ndarray:
        """The source's scales `grid` (float32, one per source block) as `fmt` stores them for a weight of `shape`:
        each of the format's scales is the scale of the source block it lies in (exact where the blocks nest, as
        _kept_source_format checks: a per-tensor scale repeated per row, per-channel or block scales as they are)."""
        (fr, fc), (sr, sc) = fmt.scale_cell(shape), self.block
        rows = np.arange(-(-shape[0] // fr)) * fr // sr
        cols = np.arange(-(-shape[1] // fc)) * fc // sc
        return np.ascontiguousarray(grid[rows][:, cols]).reshape(fmt.packed_shapes(shape)[1])


@dataclass(frozen=True)
class TensorPlan:
    """One source tensor: `quantized` (to `format`), `kept` (a 2-D linear weight left as is, listed in `exclude`;
    an FP8 one as its dequantized bf16), `kept_source` (an FP8 weight kept as the source stores it, in `format`, its
    scales with it), `copied` (anything else, byte for byte) or `scale` (an FP8 weight's scales, or its module's
    input scale: consumed, and written only with a `kept_source` weight)."""

    source: TensorInfo
    fate: Fate
    fp8_scale: Fp8Scale | None = None  # set for an F8_E4M3 weight: read as bf16 through these scales
    format: ElementFormat | None = None  # a quantized or `kept_source` weight's: the element format it is stored in

    @property
    def read_dtype(self) -> str:
        """The dtype the weight is quantized or kept from: an FP8 weight's dequantization (kept: its bf16; quantized:
        as its layout says, Fp8Scheme.quantized_from), else as stored."""
        if self.fp8_scale is None:
            return self.source.dtype
        return self.fp8_scale.quantized_from if self.fate == "quantized" else "BF16"

    def outputs(self) -> list[PlannedTensor]:
        s = self.source
        if self.fate == "scale":
            return []
        if self.fate not in ("quantized", "kept_source"):
            return [PlannedTensor(s.name, self.read_dtype, s.shape)]
        assert self.format is not None, f"{s.name}: planned as {self.fate} without its element format"
        return self.format.stored(s.name, s.shape)


@dataclass
class ShardPlan:
    name: str
    tensors: list[TensorPlan]
    source_size: int
    header: bytes = b""
    offsets: dict[str, int] = field(default_factory=dict)  # output tensor name -> absolute byte offset
    output_size: int = 0

    def __post_init__(self):
        order = safetensors_order([o for t in self.tensors for o in t.outputs()])
        self.header = encode_header(order, SHARD_METADATA)
        cursor = len(self.header)
        for t in order:
            self.offsets[t.name] = cursor
            cursor += t.nbytes
        self.output_size = cursor

    @property
    def header_sha256(self) -> str:
        """Fingerprint of everything decided about this shard (names, dtypes, shapes of every output)."""
        return hashlib.sha256(self.header).hexdigest()


@dataclass
class QuantizePlan:
    layout: MoeLayout
    shards: list[ShardPlan]
    precision: SourcePrecision = BF16  # the source's (fp8_source.py)

    def tensors(self) -> list[TensorPlan]:
        return [t for s in self.shards for t in s.tensors]

    def names(self, fate: Fate) -> list[str]:
        return sorted(t.source.name for t in self.tensors() if t.fate == fate)

    def refuse_cross_shard_scales(self, why: str) -> None:
        """Refuse an FP8 source whose block scales lie in another shard than their weight, for a run that cannot
        read both shards at once (`why`).

        Raises:
            ConfigError: names the first such weight.
        """
        split = [
            (s.name, t.source.name, t.fp8_scale.shard)
            for s in self.shards
            for t in s.tensors
            if t.fp8_scale and t.fp8_scale.shard != s.name
        ]
        if split:
            shard, weight, scale_shard = split[0]
            raise ConfigError(
                f"{shard}: FP8 weight {weight!r} has its block scales in {scale_shard} "
                f"({len(split)} such weight(s)); {why}: download the checkpoint, then quantize it"
            )

    def excluded_modules(self) -> list[str]:
        """Kept 2-D linear weights as module names: Quark's resolved `exclude` list."""
        return sorted(n.removesuffix(".weight") for n in self.names("kept"))

    def source_modules(self) -> list[str]:
        """Weights kept as the source stores them in a format mxforge only keeps (block FP8, fate "kept_source"),
        as module names: their layer configs are the ones Quark's keep writes."""
        return sorted(
            t.source.name.removesuffix(".weight")
            for t in self.tensors()
            if t.fate == "kept_source" and t.format is not None and t.format.kept_only
        )

    def quantization_config(self, recipe: Recipe, source_quantization_config: dict | None) -> dict:
        """The output's quantization_config (what quantize writes and the plan check judges): the recipe's scheme,
        the kept modules excluded, and layer configs for the modules stored in another format than the global one
        and for each module kept as the source stores it (block FP8: Quark's own, derived from the source's
        `source_quantization_config`, formats/quark.kept_layer_config; another format: that format's)."""
        kept = self.source_modules()
        layer: dict = {}
        if kept:
            from mxforge.formats.quark import kept_layer_config

            layer = kept_layer_config(source_quantization_config or {})
        return recipe.quantization_config(self.excluded_modules(), self.module_formats(), {m: layer for m in kept})

    def module_formats(self) -> dict[str, ElementFormat]:
        """Every weight stored in a format mxforge quantizes to (quantized, or kept from the source as such: a
        compressed-tensors weight kept as FP8 PTPC), module name -> that format."""
        return {
            t.source.name.removesuffix(".weight"): t.format
            for t in self.tensors()
            if t.fate in ("quantized", "kept_source") and t.format is not None and not t.format.kept_only
        }


def plan_checkpoint(ckpt: Checkpoint, recipe: Recipe) -> QuantizePlan:
    """Decide every tensor's fate and lay out every output shard.

    Raises:
        CheckpointError: a shard is missing/corrupt, the index lists a tensor twice, the index and the
            shard headers disagree, routed experts stored fused in 3-D tensors.
        ConfigError: not a supported model family's config, a recipe rule matches nothing, or a weight the recipe
            selects cannot be packed (odd in-dimension).
    """
    if ckpt.duplicate_index_keys:
        first = ckpt.duplicate_index_keys[0]
        raise CheckpointError(
            f"{ckpt.root / INDEX_NAME}: weight_map lists tensor {first!r} more than once "
            f"({len(ckpt.duplicate_index_keys)} such key(s)); keep one entry per tensor (the shard "
            "that holds it) or re-download the index",
            path=ckpt.root / INDEX_NAME,
            tensor=first,
        )
    layout = layout_of(ckpt.config)
    precision = source_precision(ckpt.config, str(ckpt.root / "config.json"))
    infos = ckpt.tensor_infos()
    for shard, header in ckpt.headers.items():
        orphans = [n for n in header.tensors if ckpt.weight_map.get(n) != shard]
        if orphans:
            raise CheckpointError(
                f"{ckpt.root / shard}: holds tensor {orphans[0]!r} that the index does not map to it "
                f"({len(orphans)} such); the index is stale: rebuild or re-download it",
                path=ckpt.root / shard,
                tensor=orphans[0],
            )
    refuse_fused_experts(ckpt, infos, layout)
    scales = fp8_scales(ckpt, infos, precision)
    recipe.check_matches([n for n, i in infos.items() if is_quantizable(i) or n in scales], layout, str(ckpt.root))
    consumed = {s.info.name for s in scales.values()} | {
        n for weight in scales for n in precision.sibling_names(weight) if n in infos
    }
    if not scales:  # e.g. fp8_cast_bf16.py's output, which keeps the release's FP8 quantization_config
        precision = BF16
    shards = []
    for shard in ckpt.shard_names:
        header = ckpt.headers[shard]
        plans = [
            TensorPlan(info, "scale")
            if info.name in consumed
            else plan_tensor(info, recipe, layout, scales.get(info.name))
            for info in header.tensors.values()
        ]
        shards.append(ShardPlan(shard, plans, header.file_size))
    return QuantizePlan(layout, shards, precision)


def refuse_fused_experts(ckpt: Checkpoint, infos: dict[str, TensorInfo], layout: MoeLayout) -> None:
    """Routed experts must be stored one by one (`mlp.experts.{j}.gate_proj.weight`...): a layer's experts fused in
    one 3-D tensor (transformers' in-memory `mlp.experts.gate_up_proj` [experts, 2 x width, hidden], as some Qwen3.5
    exports store them) are not 2-D linear weights, so no recipe rule would select them and they would be copied bf16
    beside MXFP4 everywhere else.

    Raises:
        CheckpointError: a tensor of the routed experts that is not 2-D.
    """
    name = next((n for n, i in infos.items() if len(i.shape) == 3 and layout.kind_of(n) == "experts"), None)
    if name is None:
        return
    where = ckpt.root / ckpt.weight_map[name]
    parent = name.rpartition(".")[0]
    raise CheckpointError(
        f"{where}: tensor {name!r} {list(infos[name].shape)} holds every routed expert of {parent} in one 3-D tensor; "
        f"mxforge quantizes routed experts stored one by one ({parent}.0.gate_proj.weight, ...), as transformers' "
        "save_pretrained writes them and the engines' MXFP4 loaders read them: re-save the checkpoint with "
        "save_pretrained, or start from a release that stores its experts one by one",
        path=where,
        tensor=name,
    )


def fp8_scales(ckpt: Checkpoint, infos: dict[str, TensorInfo], precision: SourcePrecision) -> dict[str, Fp8Scale]:
    """Each FP8 weight's scales (empty for a bf16 source), checked against the weight they scale.

    Raises:
        CheckpointError: an F8_E4M3 tensor in a bf16 source, an FP8 weight without its scales, or scales whose
            dtype or shape do not fit the weight and the config's layout (weight_block_size, strategy).
    """
    fp8 = {n: i for n, i in infos.items() if i.dtype == FP8_DTYPE}

    def where(name: str):
        return ckpt.root / ckpt.weight_map[name]

    if fp8 and not precision.is_fp8:
        name = next(iter(fp8))
        raise CheckpointError(
            f"{where(name)}: tensor {name!r} is {FP8_DTYPE} but config.json has no FP8 "
            "quantization_config; restore the release's config.json (it says how to scale the weights)",
            path=where(name),
            tensor=name,
        )
    out: dict[str, Fp8Scale] = {}
    if not precision.is_fp8:  # a bf16 source (an FP8 tensor under it was refused above)
        return out
    suffix = precision.fp8.scale_suffix
    for name, info in fp8.items():
        scale = infos.get(name + suffix)
        if len(info.shape) != 2 or not is_linear_weight_name(name) or scale is None:
            raise CheckpointError(
                f"{where(name)}: FP8 tensor {name!r} {list(info.shape)} has no {name + suffix!r} "
                f"scales (or is not a 2-D linear weight); the checkpoint is incomplete or not a "
                f"{precision.describe()} checkpoint as its config.json says: re-download it",
                path=where(name),
                tensor=name,
            )
        expected = precision.stored_scale_shapes(info.shape)
        if scale.dtype not in SCALE_DTYPES or scale.shape not in expected:
            raise CheckpointError(
                f"{where(scale.name)}: {scale.name!r} is {scale.dtype}{list(scale.shape)}, expected "
                f"F32{list(expected[0])} for {name!r} {list(info.shape)} with {precision.scale_rule()}; the shard "
                "or config.json is not from the same release",
                path=where(scale.name),
                tensor=scale.name,
            )
        out[name] = Fp8Scale(
            ckpt.weight_map[scale.name],
            scale,
            precision.block_of(info.shape),
            precision.scale_shape(info.shape),
            precision.fp8.quantized_from,
            precision.fp8.kept_as,
        )
    return out


def is_quantizable(info: TensorInfo) -> bool:
    """A 2-D float linear weight: the only tensors a recipe decides on (FP8 weights: see fp8_scales)."""
    return len(info.shape) == 2 and info.dtype in QUANTIZABLE_DTYPES and is_linear_weight_name(info.name)


def plan_tensor(info: TensorInfo, recipe: Recipe, layout: MoeLayout, fp8_scale: Fp8Scale | None = None) -> TensorPlan:
    """What the recipe does with one source tensor (`fp8_scale`: an F8_E4M3 weight's block scales), and to which
    element format a quantized one goes.

    Raises:
        ConfigError: the recipe selects a weight its format cannot store (e.g. an odd in-dimension for MXFP4's two
            codes per byte; says how to keep it).
    """
    if not (fp8_scale is not None or is_quantizable(info)):
        return TensorPlan(info, "copied", fp8_scale)
    fmt = recipe.format_of(info.name, layout)
    if fmt is None and fp8_scale is not None and recipe.keeps_source(info.name, layout):
        return TensorPlan(info, "kept_source", fp8_scale, _kept_source_format(info, fp8_scale))
    if fmt is None:
        return TensorPlan(info, "kept", fp8_scale)
    reason = fmt.unpackable(info.shape[1])
    if reason:
        raise ConfigError(
            f"tensor {info.name!r} {list(info.shape)}: the recipe selects it, but {reason}; "
            "keep it with a [[keep]] rule",
            tensor=info.name,
        )
    return TensorPlan(info, "quantized", fp8_scale, fmt)


def _kept_source_format(info: TensorInfo, fp8_scale: Fp8Scale) -> ElementFormat:
    """The format an FP8 weight kept as the source stores it is written in (its layout's `kept_as`): block FP8 as
    Quark keeps it (the same tiles, float32 scales: Quark restates the source's block in the config), or FP8 PTPC
    for compressed-tensors' per-channel and per-tensor scales (each row's scale the one covering it).

    Raises:
        ConfigError: the scales cannot be written in that format exactly (other tiles, bf16 block scales), naming
            the tensor and what to do.
    """
    fmt = format_named(fp8_scale.kept_as)
    scale, shape = fp8_scale.info, info.shape
    cell, block = fmt.scale_cell(shape), fp8_scale.block
    if fmt.kept_only:  # Quark's keep: the source's bytes, its block restated
        fits = block == cell and scale.dtype == fmt.scale.dtype
    else:  # each of the format's scales inside one source block: repeated, exact in float32
        fits = block[0] % cell[0] == 0 and block[1] % cell[1] == 0
    if not fits:
        raise ConfigError(
            f"tensor {info.name!r} {list(info.shape)}: the recipe keeps it as the source stores it "
            f'(format = "source"), but its scales {scale.name!r} are {scale.dtype}{list(scale.shape)} for '
            f"{block[0]}x{block[1]} weights: mxforge keeps such weights only as {fmt.title} ({fmt.describe()}; "
            f"{fmt.scale.dtype}{list(fmt.packed_shapes(shape)[1])} here), as Quark does. Keep it bf16 (drop "
            'format = "source") or quantize it',
            tensor=info.name,
        )
    return fmt


def check_planned_header(path: Path, plan: "ShardPlan") -> None:
    """The downloaded shard's own header must be the one its plan was made from (read from the Hub by byte
    range before the download): a Hub that serves other bytes for a range than for the file is refused.

    Raises:
        CheckpointError: the headers differ (the shard is deleted, so a rerun fetches it again).
    """
    planned = {t.source.name: t.source for t in plan.tensors}
    if read_header(path).tensors != planned:
        path.unlink(missing_ok=True)
        raise CheckpointError(
            f"{path}: its header differs from the one the Hub served by byte range when the run was "
            "planned; the shard was deleted. Rerun; if it happens again, the Hub or a proxy serves "
            "inconsistent bytes",
            path=path,
        )
