"""A checkpoint: config.json, the safetensors index and its shards, read from headers only.

Where those come from is a `CheckpointSource`: a local directory (`LocalDir`) or a Hub repo at one commit
(`mxforge.hub.source.HubSource`, ranged reads of the headers). validate, fixup and inspect read through
`Checkpoint`, so a local and a remote checkpoint go through the same code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from mxforge.errors import CheckpointError, ConfigError, MxforgeError
from mxforge.json_input import MAX_JSON_BYTES, loads
from mxforge.safe_paths import name_problem, refuse_links_leaving
from mxforge.safetensors_io import MAX_TENSORS, HeaderBudget, ShardHeader, TensorInfo, read_header, write_json_atomic

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# fixup's backups of the files it rewrites: kept on the machine that made them, never published


def write_index(root: Path, weight_map: dict[str, str], total_size: int, metadata: dict | None = None) -> None:
    """ROOT/model.safetensors.index.json, atomically: `metadata` with `total_size`, the weight_map sorted by name.

    Raises:
        CheckpointError: it cannot be written.
    """
    write_json_atomic(
        Path(root) / INDEX_NAME,
        {"metadata": {**(metadata or {}), "total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
    )


class _KeyedObject(dict):
    """A JSON object that remembers the keys it held more than once (json keeps only the last value)."""

    duplicates: tuple[str, ...] = ()


def _keep_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    obj = _KeyedObject(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        repeated = []
        for k, _ in pairs:
            if k in seen:
                repeated.append(k)
            seen.add(k)
        obj.duplicates = tuple(repeated)
    return obj


def load_json(path: Path, what: str, object_pairs_hook=None) -> Any:
    """Read a JSON file of at most MAX_JSON_BYTES (json_input.loads: its nesting bounded before it is parsed),
    naming it in the error if it is missing, too large or malformed.

    Raises:
        CheckpointError: the file does not exist, is too large or deep, or is not valid JSON.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} not found", path=path) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what}: {e.strerror or e}", path=path) from None
    return loads(raw, str(path), what, object_pairs_hook)


def check_config_shape(config: Any, where: str) -> dict:
    """config.json as read: a JSON object whose `quantization_config`, if given, is an object too (the fields
    a family reads are checked by its layout, mxforge.models.layout.MoeLayout).

    Raises:
        ConfigError: naming the file and the field.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: is a JSON {type(config).__name__}, not an object; this is not a model config")
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError(
            f"{where}: quantization_config is a JSON {type(qc).__name__}, not an object; write it as "
            '{"quant_method": ...} or remove it'
        )
    return config


def _check_shard_names(source: "CheckpointSource", weight_map: dict) -> None:
    """Every shard the index names is a plain relative path inside the checkpoint (an index is input too).

    Raises:
        CheckpointError: a shard name that is absolute, has '..', is not a string..., or (local) a symlink
            leaving the directory.
    """
    shards = set()
    for tensor, shard in weight_map.items():
        if isinstance(shard, str) and shard in shards:
            continue  # checked already (GLM-5.2's index names 282 shards for 59,585 tensors)
        why = name_problem(shard)
        if why is not None:
            raise CheckpointError(
                f"{source.where(INDEX_NAME)}: tensor {tensor!r} maps to shard {shard!r}, refused "
                f"because {why}; the index is corrupt or hostile: fix or re-download it",
                filename=INDEX_NAME,
                tensor=tensor,
                shard=str(shard),
            )
        shards.add(shard)
    source.check_readable(sorted(shards))


class CheckpointSource:
    """Where a checkpoint's files come from. Names passed in are relative names inside the checkpoint, checked
    by name_problem first where they came from outside (the index)."""

    label: str  # how reports name the checkpoint: a directory, or owner/name[@revision]
    model_path: str  # what a serving engine is given to load it: the directory, or the repo id
    local_root: Path | None = None  # the directory, for a local checkpoint

    @cached_property
    def header_budget(self) -> HeaderBudget:
        """What the headers read from this source may declare in all (bytes, tensors)."""
        return HeaderBudget()

    def stats(self) -> dict | None:
        """What reading it cost over the network (None: a local directory)."""
        return None

    def where(self, name: str) -> str:
        """How errors name one file of the checkpoint."""
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def read_json(self, name: str, what: str, object_pairs_hook=None) -> Any:
        """Raises: CheckpointError: missing, or not valid JSON."""
        raise NotImplementedError

    def read_header(self, name: str) -> ShardHeader:
        """Raises: CheckpointError: missing, truncated or corrupt (named by `where`)."""
        raise NotImplementedError

    def file_names(self) -> list[str]:
        """Every file name at the checkpoint's top level."""
        raise NotImplementedError

    def check_readable(self, names: list[str]) -> None:
        """Refuse files that must not be read (a local symlink leaving the directory). Raises CheckpointError."""

    def check_opened(self) -> None:
        """Refuse a source that is not a checkpoint at all, before anything is parsed. Raises CheckpointError."""

    def prefetch_headers(self, names: list[str]) -> None:
        """Get ready to answer read_header for these shards (a Hub repo reads them in parallel)."""


class LocalDir(CheckpointSource):
    """A checkpoint directory on disk."""

    local_root: Path

    def __init__(self, root: str | Path, follow_symlinks: bool = False):
        self.local_root = Path(root)
        self.label = self.model_path = str(self.local_root)
        self.follow_symlinks = follow_symlinks

    def where(self, name: str) -> str:
        return str(self.local_root / name)

    def exists(self, name: str) -> bool:
        return (self.local_root / name).exists()

    def read_json(self, name: str, what: str, object_pairs_hook=None) -> Any:
        return load_json(self.local_root / name, what, object_pairs_hook)

    def read_header(self, name: str) -> ShardHeader:
        return read_header(self.local_root / name, self.header_budget)

    def file_names(self) -> list[str]:
        return sorted(p.name for p in self.local_root.iterdir() if p.is_file())

    def check_readable(self, names: list[str]) -> None:
        refuse_links_leaving(self.local_root, names, follow=self.follow_symlinks, action="read")

    def check_opened(self) -> None:
        root = self.local_root
        if not root.is_dir():
            raise CheckpointError(
                f"{root}: not a directory; pass a checkpoint directory holding config.json and *.safetensors", path=root
            )
        if not (root / "config.json").exists():
            raise CheckpointError(
                f"{root}: no config.json, so this is not a Hugging Face checkpoint directory", path=root
            )
        self.check_readable(["config.json", INDEX_NAME, SINGLE_NAME])


REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MAX_REPO_ID = 96  # the Hub's limit (huggingface_hub.utils.validate_repo_id)


def repo_id_problem(repo_id: str) -> str | None:
    """Why `repo_id` is not a Hub model repo id (owner/name), or None."""
    if len(repo_id) > MAX_REPO_ID:
        return f"it has {len(repo_id)} characters, the Hub allows {MAX_REPO_ID}"
    if not REPO_ID_RE.match(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return "a repo id is owner/name of letters, digits, '-', '_' and '.' (no '--', '..' or trailing .git)"
    return None


def is_local_source(source: str) -> bool:
    """A local checkpoint directory, or else a Hub repo id.

    Raises:
        MxforgeError: SOURCE is neither an existing directory nor a valid repo id.
    """
    try:
        if Path(source).is_dir():
            return True
        exists = Path(source).exists()
    except OSError:  # e.g. a name too long to be a path: it can only be meant as a repo id
        exists = False
    why = repo_id_problem(source)
    if why is None and not exists:
        return False
    shown = source if len(source) <= 60 else f"{source[:60]}..."
    raise MxforgeError(
        f"{shown}: not a directory, and not a Hub repo id either "
        f"({why or 'a file of that name exists here'}); pass a checkpoint directory or owner/name"
    )


@dataclass
class Checkpoint:
    """A Hugging Face safetensors checkpoint, in a local directory or a Hub repo (`source`).

    `weight_map` maps tensor name to shard file name, from the index or from a single
    `model.safetensors`. Headers are parsed on first use.
    """

    source: CheckpointSource
    config: dict
    weight_map: dict[str, str]
    index_metadata: dict = field(default_factory=dict)
    has_index: bool = True
    duplicate_index_keys: tuple[str, ...] = ()  # weight_map keys the index lists more than once (last one wins)

    @classmethod
    def open(cls, root: "str | Path | CheckpointSource", follow_symlinks: bool = False) -> "Checkpoint":
        """Open a checkpoint directory (or any CheckpointSource).

        config.json, the index and the shards it names must not be symlinks that leave the directory,
        unless `follow_symlinks` (the user's explicit --follow-symlinks).

        Raises:
            CheckpointError: not a directory, no config.json, neither an index nor model.safetensors, an
                index that names a shard outside the directory, or a symlink leaving it.
        """
        source = root if isinstance(root, CheckpointSource) else LocalDir(root, follow_symlinks)
        source.check_opened()
        config = check_config_shape(source.read_json("config.json", "config.json"), source.where("config.json"))
        if source.exists(INDEX_NAME):
            index = source.read_json(INDEX_NAME, "safetensors index", object_pairs_hook=_keep_duplicates)
            where = source.where(INDEX_NAME)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{where}: has no weight_map; the index is corrupt", filename=INDEX_NAME)
            if len(weight_map) > MAX_TENSORS:
                raise CheckpointError(
                    f"{where}: names {len(weight_map):,} tensors, over the {MAX_TENSORS:,} mxforge reads (about 10x "
                    "the largest real checkpoint's): the index is corrupt or hostile"
                )
            metadata = index.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise CheckpointError(f"{where}: metadata is a JSON {type(metadata).__name__}, not an object")
            _check_shard_names(source, weight_map)
            source.prefetch_headers(sorted(set(weight_map.values())))
            return cls(source, config, dict(weight_map), dict(metadata), True, getattr(weight_map, "duplicates", ()))
        if source.exists(SINGLE_NAME):
            header = source.read_header(SINGLE_NAME)
            return cls(source, config, {name: SINGLE_NAME for name in header.tensors}, {}, False)
        raise CheckpointError(f"{source.label}: no {INDEX_NAME} and no {SINGLE_NAME}: no safetensors weights to read")

    @property
    def root(self) -> Path:
        """The checkpoint's directory.

        Raises:
            CheckpointError: the checkpoint is a Hub repo (what needs a directory must download it first).
        """
        if self.source.local_root is None:
            raise CheckpointError(
                f"{self.source.label}: a Hub repo, read through its headers only; this needs the "
                "files on disk: mxforge download it first"
            )
        return self.source.local_root

    @property
    def label(self) -> str:
        """How reports name the checkpoint: its directory, or owner/name@commit."""
        return self.source.label

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
            if not self.source.exists(name):
                first = next(t for t, s in self.weight_map.items() if s == name)
                raise CheckpointError(
                    f"{self.source.where(name)}: shard named by the index (e.g. for {first!r}) does not exist",
                    shard=name,
                )
            out[name] = self.source.read_header(name)
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
                raise CheckpointError(
                    f"{self.source.where(shard)}: index says it holds tensor {name!r}, but its header does not",
                    shard=shard,
                    tensor=name,
                )
            out[name] = info
        return out

    @property
    def quantization_config(self) -> dict | None:
        return self.config.get("quantization_config")
