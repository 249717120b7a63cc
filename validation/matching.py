"""How an engine release decides, from `exclude`, what it builds unquantized (the rules of validation/profiles.py).

Entry matching is the engines' own: an entry matches a module prefix when equal to it, or when it starts
with "re:" and the rest `re.match`es the prefix (answered by mxforge.bounded_re: `re`'s answer, in bounded
time, for a pattern from a checkpoint may be hostile). Globs are understood by no engine. What differs per
release (fused names, expert entries, which entries reach the MTP draft, shared-expert fusion) is data in
the profile; conformance with each release's own code is tested in tests/validation/test_engine_conformance.py.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field
from functools import cached_property

from mxforge.bounded_re import BoundedPattern, check_pattern_count, compile_bounded
from mxforge.formats import ElementFormat, format_of_spec
from mxforge.models import MoeLayout
from mxforge.validation.profiles import EngineProfile

GLOB_CHARS = re.compile(r"[*?\[]")
TARGET, DRAFT = "target", "draft"


def is_glob(entry: str) -> bool:
    """A shell-style pattern (Quark's exclude syntax) rather than an exact name or a `re:` regex."""
    return not entry.startswith("re:") and bool(GLOB_CHARS.search(entry))


class ShardsDisagree(Exception):
    """The engine raises "Found different quantization schemes": some shards of a fused module are excluded, others
    not."""

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
    def regexes(self) -> list[tuple[str, BoundedPattern]]:
        """The `re:` entries, compiled.

        Raises:
            ConfigError: an entry that cannot be matched in bounded time (named).
        """
        out = []
        check_pattern_count(sum(e.startswith("re:") for e in self.entries), "config.json: quantization_config.exclude")
        for e in self.entries:
            if e.startswith("re:"):
                try:
                    out.append((e, compile_bounded(e[3:], where=f"config.json: quantization_config.exclude {e!r}")))
                except re.error:
                    pass  # reported by the quantization_config check; engines would raise on it
        return out

    @cached_property
    def parents(self) -> frozenset[str]:
        """Every proper dotted prefix of the exact entries (for the "any child entry" expert rule)."""
        out: set[str] = set()
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


def engine_excludes(
    profile: EngineProfile, prefix: str, is_experts: bool, entries: ExcludeList, is_draft: bool = False
) -> bool:
    """Whether `profile`'s engine builds module `prefix` (of the draft's model: `is_draft`) unquantized because of
    `entries` (should_ignore_layer).

    Raises:
        ShardsDisagree: `prefix` is a packed fused module decided by its shards, and they disagree.
    """
    head, _, proj = prefix.rpartition(".")
    packed = proj in profile.packed_in(is_draft)
    if (profile.fused_name_first or not packed) and entries.matching_entry(prefix):
        return True
    if is_experts and profile.expert_child_entries and prefix in entries.parents:
        return True
    if not packed:
        return False
    names = [f"{head}.{s}" if head else s for s in profile.fused[proj]]
    hits = [bool(entries.matching_entry(n)) for n in names]
    if any(hits) and not all(hits):
        raise ShardsDisagree([n for n, h in zip(names, hits) if h], [n for n, h in zip(names, hits) if not h])
    return all(hits)


def map_name(profile: EngineProfile, name: str, layer: int | None = None) -> str:
    """The draft's name mapper on one name: the longest matching substring replaced once (WeightsMapper). A pair
    naming `{layer}` is the MTP layer's (`layer`; the mapper a draft class builds from its config's layer count,
    sglang's GLM-5.3-Flash NextN) and maps nothing without one."""
    pairs = [
        (old.format(layer=layer), new) for old, new in profile.draft.name_mapper if layer is not None or "{" not in old
    ]
    for old, new in sorted(pairs, key=lambda pair: len(pair[0]), reverse=True):
        if old in name:
            return name.replace(old, new, 1)
    return name


class SchemeError(Exception):
    """The engine raises while choosing the module's quantization scheme (no compatible scheme, or fused
    shards / experts with different per-layer configs)."""


@dataclass(frozen=True)
class RoleView:
    """What one model (the target, or the MTP draft) of one engine release sees of `quantization_config`."""

    entries: ExcludeList  # the exclude list its modules are tested against
    gate_entries: ExcludeList  # the list its shared-expert fusion gate reads (before any draft remap)
    unquantized: bool = False  # the whole model is built without a quantization config
    layer_configs: dict = field(default_factory=dict)  # layer_quant_config: fnmatch pattern -> layer config
    global_config: dict | None = None
    gate_layer_configs: dict = field(default_factory=dict)  # those its fusion gate reads (before any draft remap)
    packed: frozenset[str] = frozenset()  # its fused modules decided by their shards (EngineProfile.packed_in)


def role_views(
    profile: EngineProfile, exclude: list[str], layout: MoeLayout, qc: dict | None = None
) -> dict[str, RoleView]:
    """The target's and the draft's view of `exclude` (and of the per-layer configs of `qc`) in `profile`'s release."""
    qc = qc or {}
    raw_layers, raw_global = qc.get("layer_quant_config"), qc.get("global_quant_config")
    layer_configs: dict = raw_layers if isinstance(raw_layers, dict) else {}
    global_config: dict | None = raw_global if isinstance(raw_global, dict) else None
    main = ExcludeList(tuple(exclude))
    target, target_configs = main, layer_configs
    if profile.runtime_prefixes or profile.runtime_suffixes:  # the release's mapper renames entries as modules
        target = ExcludeList(tuple(dict.fromkeys(profile.runtime_name(e) for e in main.entries)))
        if profile.layer_configs_mapped:
            target_configs = {profile.runtime_name(k): v for k, v in layer_configs.items()}
    views = {TARGET: RoleView(target, target, False, target_configs, global_config, target_configs, profile.packed)}
    draft_packed = profile.packed_in(True)
    mapped, mapped_configs = main, layer_configs
    mtp = layout.mtp_layers
    first = mtp[0] if mtp else None
    if profile.exclude_source == "mapped" and profile.draft.name_mapper:
        mapped = ExcludeList(tuple(dict.fromkeys(map_name(profile, e, first) for e in main.entries)))
    if profile.layer_configs_mapped and profile.draft.name_mapper:  # WeightsMapper.apply_dict: keys replaced
        mapped_configs = {map_name(profile, k, first): v for k, v in layer_configs.items()}
    if not mtp:
        views[DRAFT] = RoleView(mapped, mapped, False, mapped_configs, global_config, mapped_configs, draft_packed)
        return views
    layer = mtp[0]
    prefix = layout.layer_prefix(layer)
    whole = (
        profile.draft.whole_draft_switch and bool(mapped.matching_entry(map_name(profile, prefix[:-1], layer)))
    ) or (_block_entry_switches(profile, layout, main))
    entries, configs = mapped, mapped_configs
    if profile.draft.remap_mtp_entries:
        entries = _with_mtp_remap(profile, mapped, layer, prefix)
        configs = {_draft_name(profile, k, layer, prefix): v for k, v in mapped_configs.items()}
    views[DRAFT] = RoleView(entries, mapped, whole, configs, global_config, mapped_configs, draft_packed)
    return views


def _block_entry_switches(profile: EngineProfile, layout: MoeLayout, entries: ExcludeList) -> bool:
    """Whether an entry under the MTP block's prefix, as stored, makes the draft build itself unquantized
    (`DraftRule.block_entry_switch`: sglang's Qwen3.5 draft tests `entry.startswith("mtp.")`, from 0.5.21 only for
    entries that name `mlp.experts`)."""
    switch, block = profile.draft.block_entry_switch, layout.layer_names.mtp_block
    if switch == "none" or not block:
        return False
    under = [e for e in entries.entries if e.startswith(block + ".")]
    return any("mlp.experts" in e for e in under) if switch == "experts" else bool(under)


def module_config(profile: EngineProfile, view: RoleView, prefix: str, is_experts: bool) -> dict | None:
    """The layer config the release applies to module `prefix` (Quark's `_find_matched_config`): a fused
    module's shards must agree; the first `layer_quant_config` pattern that fnmatches, else the global one.

    Raises:
        SchemeError: shards (or pinned experts) with different configs.
    """
    head, _, proj = prefix.rpartition(".")
    if proj in profile.packed_as_itself:
        return view.global_config  # its one shard is itself: the fallback config, never a layer config
    if proj in view.packed and profile.fused[proj] != (proj,):  # not one packed as itself (vLLM's vision "qkv")
        configs = [module_config(profile, view, f"{head}.{s}" if head else s, False) for s in profile.fused[proj]]
        if any(c != configs[0] for c in configs):
            raise SchemeError(f"different layer configs for the shards of {prefix}")
        return configs[0]
    substring = profile.layer_config_match == "substring-or-fnmatch"
    for pattern, config in view.layer_configs.items():
        if (prefix in pattern) if (substring and "*" not in pattern) else fnmatch.fnmatch(prefix, pattern):
            return config
    if is_experts and profile.expert_layer_configs:
        pinned = {k[len(prefix) + 1 :]: v for k, v in view.layer_configs.items() if k.startswith(prefix + ".")}
        if pinned:
            return _pinned_experts_config(prefix, pinned)
    return view.global_config


def _pinned_experts_config(prefix: str, pinned: dict) -> dict:
    by_expert: dict[int, set[str]] = {}
    for suffix in pinned:
        index, _, proj = suffix.partition(".")
        if not index.isdigit() or not proj:
            raise SchemeError(f"per-expert entry {suffix!r} in {prefix} is not <expert>.<projection>")
        by_expert.setdefault(int(index), set()).add(proj)
    configs = list(pinned.values())
    if (
        set(by_expert) != set(range(max(by_expert) + 1))
        or any(p != next(iter(by_expert.values())) for p in by_expert.values())
        or any(c != configs[0] for c in configs)
    ):
        raise SchemeError(f"per-expert entries of {prefix} skip experts or differ")
    return configs[0]


def scheme_format(profile: EngineProfile, config: dict | None) -> ElementFormat | None:
    """The element format the release's OCP MX scheme builds a module in from its layer config, or None when no
    scheme of the release takes the config. Which configs name a format is the format's fact (its spec fields:
    dtype, qscheme, group size, scale format; static weights); which formats the release loads, and whether it
    requires dynamic activations of the same format declared, is the release's (its profile's `schemes`)."""
    weight = (config or {}).get("weight")
    inputs = (config or {}).get("input_tensors")
    if not isinstance(weight, dict) or weight.get("is_dynamic") is True:
        return None
    fmt = format_of_spec(weight)
    if fmt is None or fmt.name not in profile.formats:
        return None
    if inputs is None:
        return None if fmt.name in profile.formats_needing_inputs else fmt
    dynamic = isinstance(inputs, dict) and inputs.get("is_dynamic") is not False
    return fmt if dynamic and fmt.matches_input_spec(inputs) else None


def _with_mtp_remap(profile: EngineProfile, entries: ExcludeList, layer: int, prefix: str) -> ExcludeList:
    """GLM NextN `_resolve_nextn_quant_config`: each entry under the MTP layer's `prefix` (`model.layers.N.X`) is
    also added under the draft's runtime name (model.X for eh_proj/enorm/hnorm/shared_head.norm, model.decoder.X
    otherwise), and `model.decoder.mlp.experts` when one of them names an expert. `re:` entries are left alone."""
    mtp = [e for e in entries.entries if e.startswith(prefix)]
    if not mtp:
        return entries
    added = [_draft_name(profile, e, layer, prefix) for e in mtp]
    if any(".mlp.experts." in e for e in mtp):
        added.append(profile.mtp_runtime_name(layer, "mlp.experts"))
    return ExcludeList(tuple(dict.fromkeys(entries.entries + tuple(added))))


def _draft_name(profile: EngineProfile, name: str, layer: int, prefix: str) -> str:
    """A name under the MTP layer's `prefix` (`model.layers.N.X`) under the draft's runtime name; any other as it
    is."""
    return profile.mtp_runtime_name(layer, name[len(prefix) :]) if name.startswith(prefix) else name


def fuses_shared_experts(profile: EngineProfile, role: str, layout: MoeLayout, view: RoleView) -> bool:
    """Whether `profile`'s release appends the shared expert to the routed-expert bank in `role`'s model
    (AMD gfx950, default server flags), as its gate reads `view` (the exclude list and layer configs it sees before
    any draft remap)."""
    gate_entries = view.gate_entries
    rule = profile.fusion
    if not (rule.target if role == TARGET else rule.draft):
        return False
    experts = int(layout["n_routed_experts"])
    if (rule.n_routed_experts and experts not in rule.n_routed_experts) or int(
        layout.config.get("n_shared_experts", 1) or 0
    ) != 1:
        return False
    if not _same_layer_configs(profile, dataclasses.replace(view, layer_configs=view.gate_layer_configs)):
        return False
    if rule.veto == "none":
        return True

    def vetoes(entry: str) -> bool:
        if "shared_expert" not in entry or "shared_expert_gate" in entry or entry.startswith("mtp."):
            return False
        return not (rule.veto == "shared-expert-entry-outside-draft" and layout.in_mtp_layer(entry))

    return not any(vetoes(e) for e in gate_entries.entries)


SHARED_EXPERT_PROJS = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")


def _same_layer_configs(profile: EngineProfile, view: RoleView) -> bool:
    """sglang's `can_fuse_shared_expert` (0.5.22 on) for a checkpoint with a layer_quant_config: at each of the
    rule's bases the routed experts and every shared-expert projection must be given the same config (shards that
    disagree count as different). The shared expert is named `shared_experts` when a key holds ".shared_experts.",
    else `shared_expert`."""
    bases = profile.fusion.layer_config_bases
    if not bases or not view.layer_configs:
        return True
    shared = "shared_experts" if any(".shared_experts." in k for k in view.layer_configs) else "shared_expert"
    try:
        for base in bases:
            routed = module_config(profile, view, f"{base}.mlp.experts", False)
            for proj in SHARED_EXPERT_PROJS:
                if module_config(profile, view, f"{base}.mlp.{shared}.{proj}", False) != routed:
                    return False
    except SchemeError:
        return False
    return True
