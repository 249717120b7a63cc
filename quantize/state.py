"""Resume state: OUT/mxforge_quantize.state.json, one entry per finished output shard.

An entry records the identity of the shard's input (size, mtime, sha256), the recipe's sha256, the scale
rule, the tool versions, the planned output header's sha256 (every decision about the shard) and the
output's size and mtime. A rerun skips a shard only when all of these still hold; anything else is redone.
It also keeps the error sums measured while the shard was quantized, so a resumed run reports them too. The file is
rewritten atomically after each shard, so a SIGKILL at any moment leaves either the old or the new state.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from mxforge.file_hashes import file_hash
from mxforge.provenance import QUANTIZE_STATE_NAME
from mxforge.safetensors_io import write_json_atomic

if TYPE_CHECKING:  # the state file's name is imported by hub I/O, which must not pull in the shard workers
    from mxforge.quantize.shard_job import ShardResult

STATE_FORMAT = 1
VERSIONED_PACKAGES = ("mxforge", "amd-quark", "torch", "numba", "numpy")


def tool_versions() -> dict[str, str]:
    out = {}
    for pkg in VERSIONED_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


class ResumeState:
    """The state file of one OUT directory for one (recipe, tool versions) pair."""

    def __init__(self, out: Path, recipe_sha256: str, versions: dict[str, str], scale_rule: str = "quark"):
        self.path = out / QUANTIZE_STATE_NAME
        self.recipe_sha256 = recipe_sha256
        self.scale_rule = scale_rule
        self.versions = versions
        self.shards: dict[str, dict] = {}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                if isinstance(data, dict) and data.get("format") == STATE_FORMAT:
                    self.shards = dict(data.get("shards") or {})
            except (OSError, ValueError):
                self.shards = {}  # unreadable state: everything is redone

    def _current_entry(self, name: str, header_sha256: str) -> dict | None:
        """The recorded entry of shard `name` if it was made under this recipe, scale rule, tools and plan."""
        entry = self.shards.get(name)
        if not entry or (
            entry.get("recipe_sha256"),
            entry.get("scale_rule", "quark"),
            entry.get("versions"),
            entry.get("header_sha256"),
        ) != (self.recipe_sha256, self.scale_rule, self.versions, header_sha256):
            return None
        return entry

    @staticmethod
    def _output_intact(entry: dict, out_dir: Path, name: str) -> bool:
        try:
            out = (out_dir / name).stat()
        except FileNotFoundError:
            return False
        return (out.st_size, out.st_mtime_ns) == (entry["output_size"], entry["output_mtime_ns"])

    def is_done(self, name: str, src_dir: Path, out_dir: Path, header_sha256: str) -> bool:
        """Whether OUT/<name> is complete and still matches its source, recipe, tools and plan."""
        entry = self._current_entry(name, header_sha256)
        if entry is None or not self._output_intact(entry, out_dir, name):
            return False
        try:
            src = (src_dir / name).stat()
        except FileNotFoundError:
            return False
        if src.st_size != entry["source_size"]:
            return False
        if src.st_mtime_ns != entry["source_mtime_ns"]:  # touched: same only if the bytes are the same
            return file_hash(src_dir / name, name).sha256 == entry["source_sha256"]
        return True

    def output_done(self, name: str, out_dir: Path, header_sha256: str, source_sha256: str) -> bool:
        """Whether OUT/<name> is complete and was made from a source with `source_sha256` under this recipe,
        tools and plan: is_done for a source that is gone (a streamed run deletes each bf16 shard once
        quantized) but whose sha256 is known."""
        entry = self._current_entry(name, header_sha256)
        return (
            entry is not None
            and entry.get("source_sha256") == source_sha256
            and self._output_intact(entry, out_dir, name)
        )

    def record(self, result: ShardResult) -> None:
        self.shards[result.name] = {
            **asdict(result),
            "recipe_sha256": self.recipe_sha256,
            "versions": self.versions,
            "scale_rule": self.scale_rule,
        }
        self.save()

    def errors(self, names) -> dict[str, dict]:
        """The per-tensor error sums recorded for shards `names` (those of a state written before mxforge
        measured errors have none)."""
        out: dict[str, dict] = {}
        for name in names:
            errors = (self.shards.get(name) or {}).get("errors")
            if isinstance(errors, dict):
                out.update(errors)
        return out

    def forget(self, name: str) -> None:
        """Drop a shard's entry in memory; the caller saves once after forgetting all it must."""
        self.shards.pop(name, None)

    def save(self) -> None:
        write_json_atomic(self.path, {"format": STATE_FORMAT, "shards": dict(sorted(self.shards.items()))})
