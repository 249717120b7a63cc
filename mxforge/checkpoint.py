"""A checkpoint directory: config.json, the safetensors index and its shards, read from headers only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .safe_paths import name_problem, refuse_links_leaving
from .safetensors_io import ShardHeader, TensorInfo, read_header, write_json_atomic

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# fixup's backups of the files it rewrites: kept on the machine that made them, never published
CONFIG_BACKUP_NAME = "config.json.orig"
INDEX_BACKUP_NAME = INDEX_NAME + ".orig"


def write_index(root: Path, weight_map: dict[str, str], total_size: int, metadata: dict | None = None) -> None:
    """ROOT/model.safetensors.index.json, atomically: `metadata` with `total_size`, the weight_map sorted by name.

    Raises:
        CheckpointError: it cannot be written.
    """
    write_json_atomic(Path(root) / INDEX_NAME, {"metadata": {**(metadata or {}), "total_size": total_size},
                                                "weight_map": dict(sorted(weight_map.items()))})


class _KeyedObject(dict):
    """A JSON object that remembers the keys it held more than once (json keeps only the last value)."""

    duplicates: tuple[str, ...] = ()


def _keep_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    obj = _KeyedObject(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        obj.duplicates = tuple(k for k, _ in pairs if k in seen or seen.add(k))
    return obj


def load_json(path: Path, what: str, object_pairs_hook=None) -> Any:
    """Read a JSON file, naming it in the error if it is missing or malformed.

    Raises:
        CheckpointError: the file does not exist or is not valid JSON.
    """
    try:
        with open(path) as f:
            return json.load(f, object_pairs_hook=object_pairs_hook)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} not found") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e})") from None


def _check_shard_names(root: Path, weight_map: dict, follow_symlinks: bool) -> None:
    """Every shard the index names is a plain relative path inside ROOT (an index is input too), not a link out.

    Raises:
        CheckpointError: a shard name that is absolute, has '..', is not a string..., or a symlink leaving ROOT.
    """
    shards = set()
    for tensor, shard in weight_map.items():
        why = name_problem(shard)
        if why is not None:
            raise CheckpointError(f"{root / INDEX_NAME}: tensor {tensor!r} maps to shard {shard!r}, refused because "
                                  f"{why}; the index is corrupt or hostile: fix or re-download it")
        shards.add(shard)
    refuse_links_leaving(root, sorted(shards), follow=follow_symlinks, action="read")


@dataclass
class Checkpoint:
    """A Hugging Face safetensors checkpoint on disk.

    `weight_map` maps tensor name to shard file name, from the index or from a single
    `model.safetensors`. Headers are parsed on first use.
    """

    root: Path
    config: dict
    weight_map: dict[str, str]
    index_metadata: dict = field(default_factory=dict)
    has_index: bool = True
    duplicate_index_keys: tuple[str, ...] = ()  # weight_map keys the index lists more than once (last one wins)

    @classmethod
    def open(cls, root: str | Path, follow_symlinks: bool = False) -> "Checkpoint":
        """Open a checkpoint directory.

        config.json, the index and the shards it names must not be symlinks that leave the directory,
        unless `follow_symlinks` (the user's explicit --follow-symlinks).

        Raises:
            CheckpointError: not a directory, no config.json, neither an index nor model.safetensors, an
                index that names a shard outside the directory, or a symlink leaving it.
        """
        root = Path(root)
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a directory; pass a checkpoint directory holding config.json and *.safetensors")
        if not (root / "config.json").exists():
            raise CheckpointError(f"{root}: no config.json, so this is not a Hugging Face checkpoint directory")
        refuse_links_leaving(root, ["config.json", INDEX_NAME, SINGLE_NAME], follow=follow_symlinks, action="read")
        config = load_json(root / "config.json", "config.json")
        if (root / INDEX_NAME).exists():
            index = load_json(root / INDEX_NAME, "safetensors index", object_pairs_hook=_keep_duplicates)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{root / INDEX_NAME}: has no weight_map; the index is corrupt")
            _check_shard_names(root, weight_map, follow_symlinks)
            return cls(root, config, dict(weight_map), dict(index.get("metadata") or {}), True,
                       getattr(weight_map, "duplicates", ()))
        if (root / SINGLE_NAME).exists():
            header = read_header(root / SINGLE_NAME)
            return cls(root, config, {name: SINGLE_NAME for name in header.tensors}, {}, False)
        raise CheckpointError(f"{root}: no {INDEX_NAME} and no {SINGLE_NAME}: no safetensors weights to read")

    @property
    def shard_names(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    @cached_property
    def headers(self) -> dict[str, ShardHeader]:
        """Every shard's header, by file name.

        Raises:
            CheckpointError: a shard named by the index is missing or its header is corrupt.
        """
        out = {}
        for name in self.shard_names:
            path = self.root / name
            if not path.exists():
                first = next(t for t, s in self.weight_map.items() if s == name)
                raise CheckpointError(f"{path}: shard named by the index (e.g. for {first!r}) does not exist")
            out[name] = read_header(path)
        return out

    def tensor_infos(self) -> dict[str, TensorInfo]:
        """Header entry of every tensor named by the index, from the shard the index names.

        Raises:
            CheckpointError: the index names a tensor its shard does not hold.
        """
        out = {}
        for name, shard in self.weight_map.items():
            info = self.headers[shard].tensors.get(name)
            if info is None:
                raise CheckpointError(f"{self.root / shard}: index says it holds tensor {name!r}, but its header does not")
            out[name] = info
        return out

    @property
    def quantization_config(self) -> dict | None:
        return self.config.get("quantization_config")
