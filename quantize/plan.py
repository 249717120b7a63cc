"""What quantize will write: per source shard, each tensor's fate and the output shard's exact byte layout.

An output shard keeps its source shard's name and holds, in safetensors order, every tensor of that
shard: kept ones unchanged, each quantized `X.weight` as U8 codes `X.weight` plus U8 `X.weight_scale`.
Headers carry no `__metadata__`, as Quark's file-to-file writes them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mxforge.checkpoint import INDEX_NAME, Checkpoint
from mxforge.errors import CheckpointError, ConfigError
from mxforge.models import MoeLayout, layout_of
from mxforge.safetensors_io import PlannedTensor, TensorInfo, encode_header, read_header, safetensors_order

from .mxfp4 import packed_shapes
from .recipe import Recipe, is_linear_weight_name

Fate = Literal["quantized", "kept", "copied"]
QUANTIZABLE_DTYPES = ("BF16", "F16", "F32")
SHARD_METADATA: dict[str, str] = {}


@dataclass(frozen=True)
class TensorPlan:
    """One source tensor: `quantized` (MXFP4), `kept` (a 2-D linear weight left as is, listed in `exclude`)
    or `copied` (anything else, byte for byte)."""

    source: TensorInfo
    fate: Fate

    def outputs(self) -> list[PlannedTensor]:
        s = self.source
        if self.fate != "quantized":
            return [PlannedTensor(s.name, s.dtype, s.shape)]
        codes, scales = packed_shapes(s.shape)
        return [PlannedTensor(s.name, "U8", codes), PlannedTensor(s.name + "_scale", "U8", scales)]


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

    def tensors(self) -> list[TensorPlan]:
        return [t for s in self.shards for t in s.tensors]

    def names(self, fate: Fate) -> list[str]:
        return sorted(t.source.name for t in self.tensors() if t.fate == fate)

    def excluded_modules(self) -> list[str]:
        """Kept 2-D linear weights as module names: Quark's resolved `exclude` list."""
        return sorted(n.removesuffix(".weight") for n in self.names("kept"))


def plan_checkpoint(ckpt: Checkpoint, recipe: Recipe) -> QuantizePlan:
    """Decide every tensor's fate and lay out every output shard.

    Raises:
        CheckpointError: a shard is missing/corrupt, the index lists a tensor twice, the index and the
            shard headers disagree.
        ConfigError: not a supported model family's config, a recipe rule matches nothing, or a weight the recipe
            selects cannot be packed (odd in-dimension).
    """
    if ckpt.duplicate_index_keys:
        first = ckpt.duplicate_index_keys[0]
        raise CheckpointError(f"{ckpt.root / INDEX_NAME}: weight_map lists tensor {first!r} more than once "
                              f"({len(ckpt.duplicate_index_keys)} such key(s)); keep one entry per tensor (the shard "
                              "that holds it) or re-download the index")
    layout = layout_of(ckpt.config)
    infos = ckpt.tensor_infos()
    for shard, header in ckpt.headers.items():
        orphans = [n for n in header.tensors if ckpt.weight_map.get(n) != shard]
        if orphans:
            raise CheckpointError(f"{ckpt.root / shard}: holds tensor {orphans[0]!r} that the index does not map to it "
                                  f"({len(orphans)} such); the index is stale: rebuild or re-download it")
    recipe.check_matches([n for n, i in infos.items() if is_quantizable(i)], layout, str(ckpt.root))
    shards = []
    for shard in ckpt.shard_names:
        header = ckpt.headers[shard]
        plans = [TensorPlan(info, tensor_fate(info, recipe, layout)) for info in header.tensors.values()]
        shards.append(ShardPlan(shard, plans, header.file_size))
    return QuantizePlan(layout, shards)


def is_quantizable(info: TensorInfo) -> bool:
    """A 2-D float linear weight: the only tensors a recipe decides on."""
    return len(info.shape) == 2 and info.dtype in QUANTIZABLE_DTYPES and is_linear_weight_name(info.name)


def tensor_fate(info: TensorInfo, recipe: Recipe, layout: MoeLayout) -> Fate:
    """What the recipe does with one source tensor.

    Raises:
        ConfigError: the recipe selects a weight whose odd in-dimension cannot be packed (says how to keep it).
    """
    if not is_quantizable(info):
        return "copied"
    if recipe.decide(info.name, layout) == "keep":
        return "kept"
    if info.shape[1] % 2:
        raise ConfigError(f"tensor {info.name!r} {list(info.shape)}: the recipe selects it, but MXFP4 packs two "
                          "codes per byte and its in-dimension is odd; keep it with a [[keep]] rule")
    return "quantized"


def check_planned_header(path: Path, plan: "ShardPlan") -> None:
    """The downloaded shard's own header must be the one its plan was made from (read from the Hub by byte
    range before the download): a Hub that serves other bytes for a range than for the file is refused.

    Raises:
        CheckpointError: the headers differ (the shard is deleted, so a rerun fetches it again).
    """
    planned = {t.source.name: t.source for t in plan.tensors}
    if read_header(path).tensors != planned:
        path.unlink(missing_ok=True)
        raise CheckpointError(f"{path}: its header differs from the one the Hub served by byte range when the run was "
                              "planned; the shard was deleted. Rerun; if it happens again, the Hub or a proxy serves "
                              "inconsistent bytes")
