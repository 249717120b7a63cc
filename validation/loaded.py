"""A checkpoint read once for every check: config, layout implied by config.json, tensor headers, stored forms."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mxforge.checkpoint import Checkpoint, CheckpointSource
from mxforge.formats import declared_formats
from mxforge.models import MoeLayout, layout_of
from mxforge.safetensors_io import PlannedTensor, TensorInfo
from mxforge.validation.integrity import check_index_and_shards
from mxforge.validation.modules import LayerLinears, all_linears, checkpoint_linears
from mxforge.validation.tensor_forms import Stored, stored_form


@dataclass
class LoadedCheckpoint:
    """A checkpoint's config, layout and tensor headers, read once for every check."""

    ckpt: Checkpoint
    layout: MoeLayout
    planned: list[PlannedTensor]  # every tensor config.json implies, bf16 shapes
    linears: dict[int | None, LayerLinears]
    infos: dict[str, TensorInfo]
    stored: dict[str, Stored]  # how each linear is stored, by module name
    unreadable: frozenset[str]  # tensors whose shard is missing or corrupt


def load_checkpoint(root: str | Path | CheckpointSource | Checkpoint) -> tuple[LoadedCheckpoint, list, list, dict]:
    """Open a checkpoint (or take one already open) and parse every header once. Returns it, integrity
    problems, integrity warnings (what no engine reads) and integrity counts.

    Raises:
        CheckpointError: not a checkpoint directory (no config.json, no index).
        ConfigError: config.json is not of a supported model family (mxforge.models).
    """
    ckpt = root if isinstance(root, Checkpoint) else Checkpoint.open(root)
    layout = layout_of(ckpt.config)
    problems, warnings, counts, headers = check_index_and_shards(ckpt)
    infos, unreadable = {}, set()
    for name, shard in ckpt.weight_map.items():
        header = headers.get(shard)
        info = header.tensors.get(name) if header else None
        if info is None:
            unreadable.add(name)
        else:
            infos[name] = info
    planned = layout.tensors()
    linears = checkpoint_linears(layout, planned)
    declared = declared_formats(ckpt.quantization_config)
    stored = {lin.name: stored_form(lin, infos, declared) for lin in all_linears(linears)}
    loaded = LoadedCheckpoint(ckpt, layout, planned, linears, infos, stored, frozenset(unreadable))
    return loaded, problems, warnings, counts
