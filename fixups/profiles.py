"""Engine profiles: how each serving engine names, fuses and excludes modules (data in manifests/engines/).

The profiles are read from `manifests/engines/<name>.toml`; this module only gives them types and
answers the questions the data encodes. Which engine source file each rule comes from is cited in the
TOML files themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from mxforge.errors import ConfigError
from mxforge.manifest_io import load_manifest

PROFILE_NAMES = ("sglang-legacy", "sglang", "vllm")


@dataclass(frozen=True)
class EngineProfile:
    name: str
    description: str
    experts_excluded_by_child_entry: bool
    remap_mtp_exclusions: bool
    fused: dict[str, tuple[str, ...]]          # fused module name -> the checkpoint shard names it is built from
    never_quantized: frozenset[str]            # module names (layer-relative, or global) built without quantization
    mtp_block_prefix: str                      # runtime prefix of the MTP layer's decoder block ("{layer}" filled in)
    mtp_outer_prefix: str                      # runtime prefix of eh_proj / enorm / hnorm / shared_head
    mtp_outer_modules: tuple[str, ...]
    eh_proj_quantizable: bool

    def mtp_runtime_name(self, layer: int, local: str) -> str:
        """Where this engine builds module `local` of MTP layer `layer` (checkpoint `model.layers.{layer}.{local}`)."""
        outer = any(local == m or local.startswith(m + ".") for m in self.mtp_outer_modules)
        prefix = self.mtp_outer_prefix if outer else self.mtp_block_prefix
        return f"{prefix.format(layer=layer)}.{local}"

    def quantizable(self, local: str, is_mtp: bool) -> bool:
        """Whether this engine builds module `local` with the checkpoint's quantization method at all."""
        if local in self.never_quantized:
            return False
        return self.eh_proj_quantizable if (is_mtp and local == "eh_proj") else True


def load_profile(name: str) -> EngineProfile:
    """The profile manifests/engines/<name>.toml.

    Raises:
        ConfigError: unknown profile name, or the manifest lacks a field.
    """
    if name not in PROFILE_NAMES:
        raise ConfigError(f"unknown engine profile {name!r}; choose from {', '.join(PROFILE_NAMES)}")
    return _load(name)


@lru_cache(maxsize=None)
def _load(name: str) -> EngineProfile:
    data = load_manifest(f"engines/{name}.toml")
    try:
        matching, mtp = data["matching"], data["mtp"]
        if matching["entries"] != "exact-or-re":
            raise ConfigError(f"manifests/engines/{name}.toml: matching.entries {matching['entries']!r} is not supported")
        return EngineProfile(
            name=data["name"], description=data["description"],
            experts_excluded_by_child_entry=bool(matching["experts_excluded_by_child_entry"]),
            remap_mtp_exclusions=bool(matching["remap_mtp_exclusions"]),
            fused={k: tuple(v) for k, v in data["fused"].items()},
            never_quantized=frozenset(data["never_quantized"]["modules"]),
            mtp_block_prefix=mtp["block_prefix"], mtp_outer_prefix=mtp["outer_prefix"],
            mtp_outer_modules=tuple(mtp["outer_modules"]), eh_proj_quantizable=bool(mtp["eh_proj_quantizable"]),
        )
    except KeyError as e:
        raise ConfigError(f"manifests/engines/{name}.toml: missing field {e}") from None


def resolve_profiles(names: list[str] | None) -> list[EngineProfile]:
    """Profiles by name, in the order given; None or empty means every profile.

    Raises:
        ConfigError: an unknown name.
    """
    return [load_profile(n) for n in (names or PROFILE_NAMES)]


def parse_engines_arg(text: str) -> list[str]:
    """`--engines a,b` (commas or spaces) to a list of known profile names.

    Raises:
        ConfigError: an unknown name.
    """
    names = [n for n in re.split(r"[,\s]+", text.strip()) if n]
    for n in names:
        load_profile(n)
    return names
