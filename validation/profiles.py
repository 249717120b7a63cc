"""Engine profiles: how each range of engine releases names, fuses, excludes and fuses shared experts.

One TOML file per release range in `manifests/engines/` (a profile may `extend` an older one and state
only what changed). What the release decides for every model sits at the top level; what its model classes
decide for one model family (packed and fused modules, the MTP draft, shared-expert fusion) sits under
`[family.<name>]` and is overlaid on it: a profile is always read for one family (mxforge/models/), and a
release without that family's table does not build that family. Every value was measured by executing
that range's releases' own code from their wheels (tests/engine_truth/); this module only gives the data
types and answers which releases a `--engines` selection means.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Callable, TypeVar

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from mxforge.errors import ConfigError
from mxforge.formats import MXFP4, format_named
from mxforge.manifest_io import load_manifest
from mxforge.models import Family, family_named

ENGINES = ("sglang", "vllm")
VETOES = ("none", "shared-expert-entry", "shared-expert-entry-outside-draft")
# When an exclude entry under the MTP block's own prefix (a family's `[layers] mtp_block`, Qwen3.5's `mtp.`) makes
# the draft build itself unquantized: never, any such entry, or one naming the routed experts (`mlp.experts`)
BLOCK_ENTRY_SWITCHES = ("none", "any", "experts")
SOURCES = ("raw", "mapped")
LAYER_CONFIG_MATCHES = ("fnmatch", "substring-or-fnmatch")


@dataclass(frozen=True)
class DraftRule:
    """How the engine builds the MTP draft and which exclude entries reach it."""

    class_name: str
    block_prefix: str  # runtime prefix of the draft's decoder block ("{layer}" filled in)
    outer_prefix: str  # runtime prefix of eh_proj / enorm / hnorm / shared_head
    outer_modules: tuple[str, ...]
    eh_proj_quantizable: bool
    name_mapper: tuple[tuple[str, str], ...]  # substring replacements applied to every entry (replacing it)
    remap_mtp_entries: bool  # model.layers.N.X entries also added under the draft's names
    whole_draft_switch: bool  # `model.layers.N` excluded -> the whole draft unquantized
    # An entry starting with the MTP block's prefix (`mtp.`) -> the whole draft unquantized: BLOCK_ENTRY_SWITCHES
    block_entry_switch: str = "none"
    # The draft's own packed modules where its class declares others than the target's (sglang's Qwen3.5 draft: only
    # what the loader adds); None: the target's
    packed: frozenset[str] | None = None


@dataclass(frozen=True)
class FusionRule:
    """When the engine appends the shared expert to the routed-expert bank (loaded with the bank's method)."""

    target: bool
    draft: bool
    n_routed_experts: tuple[int, ...]
    veto: str
    server_flag: str
    # The target model, built first in the same process, refusing fusion switches it off for the draft too (the
    # refusal is written where the draft's gate reads the server's setting, not kept to the target's own build).
    target_refusal_reaches_draft: bool = False
    # With a layer_quant_config, fusion is refused unless the config matched for `<base>.mlp.experts` equals the one
    # matched for each `<base>.mlp.<shared>.{gate,up,gate_up,down}_proj`, for every base (empty: not compared).
    layer_config_bases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Anchor:
    rule: str
    file: str
    contains: str


@dataclass(frozen=True)
class EngineProfile:
    name: str  # e.g. "sglang-0.5.16": engine and first release of the range
    family: str  # the model family it was read for (mxforge/models/)
    engine: str
    releases: SpecifierSet
    read: tuple[str, ...]  # the releases whose wheels were read and are tested
    summary: str
    exclude_source: str  # "raw" quantization_config exclude, or "mapped" by the draft's mapper
    fused_name_first: bool  # an entry naming a fused module excludes it
    expert_child_entries: bool  # any `<layer>.mlp.experts.*` entry excludes the experts
    packed: frozenset[str]  # fused modules decided by their shards' entries
    formats: frozenset[str]  # the element formats (mxforge/formats/) whose OCP MX scheme these releases take
    formats_needing_inputs: frozenset[str]  # ... whose weights load only with dynamic same-format inputs declared
    expert_layer_configs: bool  # per-expert layer_quant_config entries configure the experts
    layer_config_match: str  # how layer_quant_config keys match: "fnmatch", "substring-or-fnmatch"
    # The release's name mappers (the target's runtime_prefixes / runtime_suffixes, the draft's name_mapper) rewrite
    # layer_quant_config keys too, as they rewrite the exclude list
    layer_configs_mapped: bool
    # Formats these releases load but compute by emulation on the profile's platform (weights dequantized on the fly,
    # matmuls in high precision: slow), every module; and those emulated in linear layers whose config declares no
    # activations (weights-only). Measured where the probe can tell (vLLM's QuarkOCP_MX schemes); sglang's are not
    # modelled.
    formats_emulated: frozenset[str]
    linear_formats_emulated_without_inputs: frozenset[str]
    # Formats whose layer config these releases were measured to answer with an error ("No quark compatible scheme")
    formats_raising: frozenset[str]
    # Formats whose layer config these releases build with a method of their own that the stored form does not fit,
    # format -> that method, for people (sglang 0.5.21+: block FP8 through its Fp8LinearMethod)
    formats_own_method: dict[str, str]
    # Formats whose fused linear these releases build only when every shard but the last is a whole number of the
    # format's scale tiles in rows (block FP8: vLLM's fp8_utils.py::validate_fp8_block_shape raises otherwise)
    formats_tiled_merges: frozenset[str]
    fused: dict[str, tuple[str, ...]]  # fused module -> the checkpoint linears it is built from
    # Layer-relative or global module names built unquantized; an entry ending in "." names every global module under
    # that prefix (a vision tower the release builds without the quantization config)
    never_quantized: frozenset[str]
    # Excluded linears whose name contains one of these are loaded bf16, then re-quantized to MXFP4 after
    # loading when the checkpoint's global weight dtype is fp4 (vLLM 0.30.0's dynamic_mxfp4_quant for DeepSeek).
    requantized_when_excluded: tuple[str, ...]
    draft: DraftRule
    fusion: FusionRule
    serve_base: str  # the serving command, `{model}` and `{tp}` to fill
    serve_speculative: str  # the options that add MTP speculative decoding to it
    serve_source: tuple[str, ...]
    anchors: tuple[Anchor, ...]
    # Where the target's modules are built, as (checkpoint prefix, runtime prefix) pairs the release's own name mapper
    # applies to module names and `exclude` entries alike (vLLM's hf_to_vllm_mapper: Qwen3.5's
    # `model.language_model.` -> `language_model.model.`); empty: the checkpoint's names
    runtime_prefixes: tuple[tuple[str, str], ...] = ()
    # Module-name endings the same mapper renames after the prefixes (sglang's GLM-5.3-Flash: the vision tower's
    # `.attn.qkv` -> `.attn.qkv_proj`)
    runtime_suffixes: tuple[tuple[str, str], ...] = ()
    # Names the model's packed_modules_mapping lists as packed from themselves alone (vLLM 0.30's GLM-5.3-Flash,
    # inheriting Glm4v's "gate_up_proj": ["gate_up_proj"]): excluded by that name, as an unpacked module is, and built
    # in the global config whatever layer_quant_config says (_find_matched_config takes the fallback for a shard
    # named as the module)
    packed_as_itself: frozenset[str] = frozenset()

    @property
    def serve_command(self) -> str:
        """The command that serves a checkpoint with MTP speculative decoding."""
        return f"{self.serve_base} {self.serve_speculative}"

    def mtp_runtime_name(self, layer: int, local: str) -> str:
        """Where this engine builds module `local` of MTP layer `layer` (checkpoint `model.layers.{layer}.{local}`)."""
        outer = any(m in local for m in self.draft.outer_modules)  # the engines' own substring test
        prefix = self.draft.outer_prefix if outer else self.draft.block_prefix
        return f"{prefix.format(layer=layer)}.{local}"

    def requantizes(self, runtime: str, global_config: dict | None) -> bool:
        """Whether this release re-quantizes excluded module `runtime` to MXFP4 after loading it in bf16 (it tests
        the global weight dtype alone: MXFP4's Quark dtype)."""
        weight = (global_config or {}).get("weight")
        return (
            isinstance(weight, dict)
            and weight.get("dtype") == MXFP4.quark.dtype
            and any(s in runtime for s in self.requantized_when_excluded)
        )

    def quantizable(self, local: str, mtp_proj: bool) -> bool:
        """Whether this engine builds module `local` with the checkpoint's quantization method at all (`mtp_proj`: it
        is an MTP layer's projection of [embedding, hidden], eh_proj or Qwen3.5's fc)."""
        if local in self.never_quantized or any(p.endswith(".") and local.startswith(p) for p in self.never_quantized):
            return False
        return self.draft.eh_proj_quantizable if mtp_proj else True

    def runtime_name(self, name: str) -> str:
        """A target module's or `exclude` entry's name as the release maps it (`runtime_prefixes`, then
        `runtime_suffixes`)."""
        for old, new in self.runtime_prefixes:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        for old, new in self.runtime_suffixes:
            if name.endswith(old):
                return name[: -len(old)] + new
        return name

    def packed_mapping(self, is_draft: bool) -> frozenset[str]:
        """The names the target's or the draft's packed_modules_mapping lists (what the probes read)."""
        return self.packed_in(is_draft) | self.packed_as_itself

    def packed_in(self, is_draft: bool) -> frozenset[str]:
        """The fused modules decided by their shards' entries in the target's or the draft's model."""
        return self.draft.packed if is_draft and self.draft.packed is not None else self.packed

    @property
    def label(self) -> str:
        """The releases covered, for people: "sglang 0.5.16-0.5.17"."""
        return release_label(self.engine, self.read[0], self.read[-1])


def release_label(engine: str, first: str, last: str) -> str:
    return f"{engine} {first}" + (f"-{last}" if last != first else "")


@lru_cache(maxsize=None)
def profile_names() -> tuple[str, ...]:
    """Every profile, oldest release first within each engine."""
    files = resources.files("mxforge.manifests").joinpath("engines")
    names = [p.name[:-5] for p in files.iterdir() if p.name.endswith(".toml")]
    return tuple(
        sorted(
            names,
            key=lambda n: (
                ENGINES.index(n.split("-", 1)[0]) if n.split("-", 1)[0] in ENGINES else len(ENGINES),
                Version(n.split("-", 1)[1]),
            ),
        )
    )


def _family_name(family: Family | str) -> str:
    return family.name if isinstance(family, Family) else family_named(family).name


def unsupported_reason(name: str, family: Family | str) -> str | None:
    """Why profile `name`'s releases do not build `family` (None: they do).

    Raises:
        ConfigError: unknown profile or family.
    """
    if name not in profile_names():
        raise ConfigError(f"unknown engine profile {name!r}; choose from {', '.join(profile_names())}")
    key = _family_name(family)
    table = _raw(name).get("family", {}).get(key)
    if table is None:
        return f"manifests/engines/{name}.toml has no [family.{key}] table: these releases were not read for it"
    return table.get("unsupported")


def load_profile(name: str, family: Family | str) -> EngineProfile:
    """The profile manifests/engines/<name>.toml as read for model family `family`.

    Raises:
        ConfigError: unknown profile or family, a release range that does not build the family, or a manifest
            with a missing or bad field.
    """
    reason = unsupported_reason(name, family)
    if reason:
        raise ConfigError(f"engine profile {name}: does not build {_family_name(family)} ({reason})")
    return _load(name, _family_name(family))


def all_profiles(family: Family | str) -> list[EngineProfile]:
    """Every profile whose releases build `family`, oldest release first within each engine."""
    return [load_profile(n, family) for n in profile_names() if not unsupported_reason(n, family)]


@lru_cache(maxsize=None)
def _raw(name: str, seen: tuple[str, ...] = ()) -> dict:
    data = load_manifest(f"engines/{name}.toml")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if parent in seen or parent not in profile_names():
        raise ConfigError(f"manifests/engines/{name}.toml: extends {parent!r}, which is unknown or circular")
    base = _raw(parent, seen + (name,))
    merged = _merge(base, data)
    for key, table in data.get("family", {}).items():
        if "unsupported" in table or "unsupported" in base.get("family", {}).get(key, {}):
            merged["family"][key] = table  # a family (un)supported from this range on: stated whole, not merged
    merged["anchor"] = base.get("anchor", []) + data.get("anchor", [])  # anchors accumulate
    return merged


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def _family_table(raw: dict, name: str, family: str) -> dict:
    """Profile `name`'s table for `family`; one with `like = "<family>"` (a family whose checkpoints are another's under
    other names: Qwen3.5 MoE's text-only model) is that family's table as this release reads it, overlaid with its own.

    Raises:
        ConfigError: `like` names a family the profile has no supported table for, or one itself `like` another.
    """
    table = raw["family"][family]
    like = table.get("like")
    if like is None:
        return table
    base = raw["family"].get(like) if isinstance(like, str) else None
    if base is None or "unsupported" in base or "like" in base:
        raise ConfigError(
            f"manifests/engines/{name}.toml [family.{family}]: like = {like!r} must name a family this profile builds "
            "with a table of its own",
            filename=f"manifests/engines/{name}.toml",
            entry=f"family.{family}.like",
        )
    return _merge(base, {k: v for k, v in table.items() if k != "like"})


@lru_cache(maxsize=None)
def _load(name: str, family: str) -> EngineProfile:
    where = f"manifests/engines/{name}.toml [family.{family}]"
    raw = _raw(name)
    data = _merge({k: v for k, v in raw.items() if k != "family"}, _family_table(raw, name, family))
    first = data.pop("first_release", None)  # the range's releases before it do not build this family
    if first is not None:
        data["read"] = [r for r in data["read"] if Version(r) >= Version(first)]
    try:
        ex, mod, dr, fu, sv = data["exclude"], data["modules"], data["draft"], data["fusion"], data["serve"]
        sc = data["schemes"]
        profile = EngineProfile(
            name=name,
            family=family,
            engine=data["engine"],
            releases=SpecifierSet(data["releases"]),
            read=tuple(data["read"]),
            summary=data["summary"],
            exclude_source=ex["source"],
            fused_name_first=bool(ex["fused_name_first"]),
            expert_child_entries=bool(ex["expert_child_entries"]),
            packed=frozenset(ex["packed"]),
            formats=frozenset(sc["formats"]),
            formats_needing_inputs=frozenset(sc["formats_needing_inputs"]),
            expert_layer_configs=bool(sc["expert_layer_configs"]),
            layer_config_match=sc.get("layer_config_match", "fnmatch"),
            layer_configs_mapped=bool(sc.get("layer_configs_mapped", False)),
            formats_emulated=frozenset(sc.get("formats_emulated", ())),
            linear_formats_emulated_without_inputs=frozenset(sc.get("linear_formats_emulated_without_inputs", ())),
            formats_raising=frozenset(sc.get("formats_raising", ())),
            formats_own_method=dict(sc.get("formats_own_method", {})),
            formats_tiled_merges=frozenset(sc.get("formats_tiled_merges", ())),
            fused={k: tuple(v) for k, v in mod["fused"].items()},
            never_quantized=frozenset(mod["never_quantized"]),
            requantized_when_excluded=tuple(mod.get("requantized_when_excluded", ())),
            draft=DraftRule(
                dr["class"],
                dr["block_prefix"],
                dr["outer_prefix"],
                tuple(dr["outer_modules"]),
                bool(dr["eh_proj_quantizable"]),
                tuple(tuple(p) for p in dr["name_mapper"]),
                bool(dr["remap_mtp_entries"]),
                bool(dr["whole_draft_switch"]),
                dr.get("block_entry_switch", "none"),
                frozenset(dr["packed"]) if "packed" in dr else None,
            ),
            fusion=FusionRule(
                bool(fu["target"]),
                bool(fu["draft"]),
                tuple(fu["n_routed_experts"]),
                fu["veto"],
                fu["server_flag"],
                bool(fu.get("target_refusal_reaches_draft", False)),
                tuple(fu.get("layer_config_bases", ())),
            ),
            runtime_prefixes=tuple(tuple(p) for p in mod.get("runtime_prefixes", ())),
            runtime_suffixes=tuple(tuple(p) for p in mod.get("runtime_suffixes", ())),
            packed_as_itself=frozenset(ex.get("packed_as_itself", ())),
            serve_base=sv["command"],
            serve_speculative=sv["speculative"],
            serve_source=tuple(sv["source"]),
            anchors=tuple(Anchor(a["rule"], a["file"], a["contains"]) for a in data.get("anchor", [])),
        )
    except KeyError as e:
        raise ConfigError(f"{where}: missing field {e}") from None
    except (InvalidSpecifier, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    _check(profile, where, first is not None)
    return profile


def _check(p: EngineProfile, where: str, family_from_later_release: bool = False) -> None:
    if p.engine not in ENGINES or not p.name.startswith(p.engine + "-"):
        raise ConfigError(f"{where}: engine {p.engine!r} must be one of {ENGINES} and prefix the file name")
    if (
        p.exclude_source not in SOURCES
        or p.fusion.veto not in VETOES
        or p.layer_config_match not in LAYER_CONFIG_MATCHES
        or p.draft.block_entry_switch not in BLOCK_ENTRY_SWITCHES
        or any(
            len(pair) != 2 or not all(isinstance(x, str) and x for x in pair)
            for pair in p.runtime_prefixes + p.runtime_suffixes
        )
    ):
        raise ConfigError(
            f"{where}: exclude.source must be one of {SOURCES}, fusion.veto one of {VETOES}, "
            f"schemes.layer_config_match one of {LAYER_CONFIG_MATCHES}, draft.block_entry_switch one of "
            f"{BLOCK_ENTRY_SWITCHES}, modules.runtime_prefixes / runtime_suffixes [checkpoint, runtime] pairs"
        )
    outside = [v for v in p.read if Version(v) not in p.releases]
    if not p.read or outside or (p.read[0] != p.name.split("-", 1)[1] and not family_from_later_release):
        raise ConfigError(
            f"{where}: `read` must list the releases read, all inside {p.releases}, starting with the "
            f"release the file is named after (outside the range: {outside})"
        )
    unknown = (p.packed | (p.draft.packed or frozenset())) - set(p.fused)
    if unknown:
        raise ConfigError(f"{where}: exclude.packed names {sorted(unknown)}, which modules.fused does not define")
    if p.packed & p.packed_as_itself:
        raise ConfigError(f"{where}: {sorted(p.packed & p.packed_as_itself)} both packed and packed as itself")
    for key, names in (
        ("formats", p.formats),
        ("formats_raising", p.formats_raising),
        ("formats_own_method", p.formats_own_method),
    ):
        for name in names:
            try:
                format_named(name)
            except ConfigError as e:
                raise ConfigError(f"{where}: schemes.{key}: {e}") from None
    if p.formats & (p.formats_raising | set(p.formats_own_method)) or p.formats_raising & set(p.formats_own_method):
        raise ConfigError(
            f"{where}: a format is in at most one of schemes.formats, formats_raising and formats_own_method"
        )
    if not p.formats_needing_inputs <= p.formats:
        raise ConfigError(f"{where}: schemes.formats_needing_inputs must be drawn from schemes.formats")
    if not (p.formats_emulated | p.linear_formats_emulated_without_inputs) <= p.formats:
        raise ConfigError(f"{where}: schemes.formats_emulated (and its linear twin) must be drawn from schemes.formats")


@dataclass(frozen=True)
class Selection:
    """The releases a `--engines` value asked for, grouped by the profile that covers them."""

    profile: EngineProfile
    releases: tuple[str, ...]

    @property
    def label(self) -> str:
        return release_label(self.profile.engine, self.releases[0], self.releases[-1])


_Key = TypeVar("_Key")


def release_runs(
    selections: list[Selection], key: Callable[[Selection], _Key]
) -> list[tuple[str, _Key, list[Selection]]]:
    """Consecutive selections of one engine for which `key(selection)` is equal, merged: (label, key, selections),
    e.g. ("sglang 0.5.16-0.5.23", ..., [...]); releases left out between two selections (not selected, or not
    building the family) break the run, so a label never spans a release it does not cover."""
    order = {(r.engine, v): i for i, (r, v) in enumerate((r, v) for r in release_ranges() for v in r.read)}
    runs: list[tuple[_Key, list[Selection]]] = []
    for s in selections:
        k = key(s)
        last = runs[-1][1][-1] if runs else None
        adjacent = (
            last is not None
            and last.profile.engine == s.profile.engine
            and order[s.profile.engine, s.releases[0]] == order[last.profile.engine, last.releases[-1]] + 1
        )
        if runs and runs[-1][0] == k and adjacent:
            runs[-1][1].append(s)
        else:
            runs.append((k, [s]))
    return [
        (release_label(group[0].profile.engine, group[0].releases[0], group[-1].releases[-1]), k, group)
        for k, group in runs
    ]


@dataclass(frozen=True)
class ReleaseRange:
    """A profile's name, engine and releases read: what `--engines` items are resolved against, for any family."""

    name: str
    engine: str
    read: tuple[str, ...]


def release_ranges() -> list[ReleaseRange]:
    out = []
    for name in profile_names():
        data = _raw(name)
        out.append(ReleaseRange(name, data.get("engine", name.split("-", 1)[0]), tuple(data.get("read", ()))))
    return out


def select(text: str | list[str] | None, family: Family | str) -> list[Selection]:
    """Profiles (read for `family`) and releases for `--engines`: None / "all" (every supported release), engine
    names ("vllm"), profile names ("sglang-0.5.16"), or an engine with version specifiers ("sglang==0.5.15.post1",
    "vllm>=0.32", "sglang>=0.5.16,<0.5.21"); several, separated by spaces or ";" or commas between items.
    Releases that do not build `family` are left out; an item that names only such releases is an error.

    Raises:
        ConfigError: an item names no known engine, profile or supported release, or only releases that do not
            build `family`; or no selected release builds it.
    """
    items = _split(text) if isinstance(text, str) else list(text or [])
    ranges = release_ranges()
    builds = {p.name: set(p.read) for p in all_profiles(family)}
    chosen: dict[str, set[str]] = {}
    for item in items or ["all"]:
        hits = _releases_for(item, ranges)
        usable = [(r, v) for r, v in hits if v in builds.get(r.name, ())]
        if not usable and item not in ("all",) + ENGINES:
            r = hits[0][0]
            why = unsupported_reason(r.name, family) or "a later release of its range is the first to build it"
            raise ConfigError(
                f"--engines: {item!r}: {r.engine} {', '.join(v for _, v in hits)} do(es) not build "
                f"{_family_name(family)} models ({why})",
                entry=item,
            )
        for r, release in usable:
            chosen.setdefault(r.name, set()).add(release)
    if not chosen:
        raise ConfigError(
            f"--engines: no selected engine release builds {_family_name(family)} models; "
            f"releases that do: {', '.join(p.name for p in all_profiles(family)) or 'none read yet'}"
        )
    return [
        Selection(p, tuple(r for r in p.read if r in chosen[p.name])) for p in all_profiles(family) if p.name in chosen
    ]


ENGINES_HELP = (
    "engine releases to fix up and validate for: engine names (sglang, vllm), profiles (sglang-0.5.16) or "
    "versions (sglang==0.5.15.post1, 'vllm>=0.32', 'sglang>=0.5.16,<0.5.21'), separated by spaces or ';' "
    "(default: every supported release; profiles in manifests/engines/)"
)


def parse_engines_arg(text: str | None) -> list[str] | None:
    """`--engines` as a list of items (None: every supported release), each checked now.

    Raises:
        ConfigError: an item names no known engine, profile or supported release.
    """
    if not text or not text.strip():
        return None
    items = _split(text)
    check_engine_items(items)
    return items


def check_engine_items(text: str | list[str] | None) -> None:
    """Check `--engines` items against the releases read, before any checkpoint (and its family) is known.

    Raises:
        ConfigError: an item names no known engine, profile or supported release.
    """
    ranges = release_ranges()
    for item in _split(text) if isinstance(text, str) else list(text or []):
        _releases_for(item, ranges)


def _split(text: str) -> list[str]:
    """Items separated by whitespace, ';', or a comma before a name (not one between version specifiers)."""
    parts = re.split(r"[\s;]+|,(?=\s*[A-Za-z])", text.strip())
    return [p.strip().rstrip(",") for p in parts if p and p.strip().rstrip(",")]


def _releases_for(item: str, profiles: list[ReleaseRange]) -> list[tuple[ReleaseRange, str]]:
    everything = [(p, r) for p in profiles for r in p.read]
    if item == "all":
        return everything
    if item in ENGINES:
        return [(p, r) for p, r in everything if p.engine == item]
    named = [(p, r) for p, r in everything if p.name == item]
    if named:
        return named
    m = re.fullmatch(r"(sglang|vllm)\s*([=<>!~].*)", item)
    if m is None:
        raise ConfigError(
            f"--engines: {item!r} is not an engine ({', '.join(ENGINES)}), a profile "
            f"({', '.join(p.name for p in profiles)}) or an engine with versions (e.g. 'sglang==0.5.15.post1', "
            "'vllm>=0.32')",
            entry=item,
        )
    engine, spec_text = m.groups()
    try:
        spec = SpecifierSet(spec_text.replace(" ", ""))
    except InvalidSpecifier:
        raise ConfigError(f"--engines: {item!r}: {spec_text!r} is not a version specifier", entry=item) from None
    hits = [(p, r) for p, r in everything if p.engine == engine and _contains(spec, r)]
    if not hits:
        known = [r for p, r in everything if p.engine == engine]
        raise ConfigError(
            f"--engines: {item!r} matches no supported {engine} release (supported: {', '.join(known)}); "
            "a release mxforge has not read cannot be vouched for",
            entry=item,
        )
    return hits


def _contains(spec: SpecifierSet, release: str) -> bool:
    try:
        return spec.contains(Version(release), prereleases=True)
    except InvalidVersion:
        return False
