"""How an engine decides that a module is excluded from quantization, given the `exclude` entries.

Mirrors `should_ignore_layer` of sglang and vLLM (see manifests/engines/*.toml for the source files):
an entry matches a module prefix when it equals it, or when it starts with "re:" and the rest
`re.match`es it. Globs are not understood by any engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

from .profiles import EngineProfile

GLOB_CHARS = re.compile(r"[*?\[]")


def is_glob(entry: str) -> bool:
    """A shell-style pattern (Quark's exclude syntax) rather than an exact name or a `re:` regex."""
    return not entry.startswith("re:") and bool(GLOB_CHARS.search(entry))


class ShardsDisagree(Exception):
    """The engine raises "Found different quantization schemes": some shards of a fused module are excluded, others not."""

    def __init__(self, matched: list[str], unmatched: list[str]):
        super().__init__(f"excluded: {matched}; not excluded: {unmatched}")
        self.matched, self.unmatched = matched, unmatched


@dataclass
class ExcludeList:
    """An `exclude` list, indexed for the engine's three kinds of test."""

    entries: tuple[str, ...]

    @cached_property
    def exact(self) -> frozenset[str]:
        return frozenset(e for e in self.entries if not e.startswith("re:"))

    @cached_property
    def regexes(self) -> list[tuple[str, re.Pattern]]:
        out = []
        for e in self.entries:
            if e.startswith("re:"):
                try:
                    out.append((e, re.compile(e[3:])))
                except re.error:
                    pass  # reported by the quantization_config check; engines would raise on it
        return out

    @cached_property
    def parents(self) -> frozenset[str]:
        """Every proper dotted prefix of the exact entries (for the "any child entry" expert rule)."""
        out = set()
        for e in self.exact:
            parts = e.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts)))
        return frozenset(out)

    def matching_entry(self, prefix: str) -> str | None:
        """The first entry that matches `prefix` exactly or by `re:` regex, if any."""
        if prefix in self.exact:
            return prefix
        for entry, pattern in self.regexes:
            if pattern.match(prefix):
                return entry
        return None


def with_mtp_remap(entries: ExcludeList, profile: EngineProfile, mtp_layer: int) -> ExcludeList:
    """The list an engine that remaps MTP exclusions at load time uses for the draft model.

    sglang 0.5.23 (models/glm4_moe.py::_resolve_nextn_quant_config) adds the runtime name of every entry
    starting with `model.layers.N.`, and `model.decoder.mlp.experts` when one of them names an expert.
    """
    if not profile.remap_mtp_exclusions:
        return entries
    layer_prefix = f"model.layers.{mtp_layer}."
    mapped = [profile.mtp_runtime_name(mtp_layer, e[len(layer_prefix):]) for e in entries.entries if e.startswith(layer_prefix)]
    if any(".mlp.experts." in e for e in entries.entries if e.startswith(layer_prefix)):
        mapped.append(profile.mtp_runtime_name(mtp_layer, "mlp.experts"))
    if not mapped:
        return entries
    return ExcludeList(entries.entries + tuple(m for m in mapped if m not in entries.exact))


def draft_excludes(main: ExcludeList, profile: EngineProfile, mtp_layers: Iterable[int]) -> ExcludeList:
    """The exclude list `profile`'s engine applies to the draft (MTP) model: `main` with every MTP layer remapped."""
    draft = main
    for layer in mtp_layers:
        draft = with_mtp_remap(draft, profile, layer)
    return draft


def engine_excludes(profile: EngineProfile, prefix: str, is_experts: bool, entries: ExcludeList) -> bool:
    """Whether `profile`'s engine builds module `prefix` unquantized because of `entries`.

    Raises:
        ShardsDisagree: `prefix` is a fused module, no entry names it, and its shards disagree.
    """
    if entries.matching_entry(prefix):
        return True
    if is_experts and profile.experts_excluded_by_child_entry and prefix in entries.parents:
        return True
    head, _, proj = prefix.rpartition(".")
    shards = profile.fused.get(proj)
    if not shards:
        return False
    names = [f"{head}.{s}" for s in shards]
    hits = [bool(entries.matching_entry(n)) for n in names]
    if any(hits) and not all(hits):
        raise ShardsDisagree([n for n, h in zip(names, hits) if h], [n for n, h in zip(names, hits) if not h])
    return all(hits)
