"""Every module an engine builds from config.json, with the checkpoint tensors it loads.

The checkpoint's linear weights come from `GlmLayout` (config.json alone); the engine profile says how
they are grouped (fused modules, routed experts as one module) and named (the MTP layer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mxforge.glm_layout import GlmLayout

from .profiles import EngineProfile

EXPERT_RE = re.compile(r"^mlp\.experts\.\d+\.")


@dataclass(frozen=True)
class Linear:
    """One checkpoint linear weight: module name (tensor name minus `.weight`) and its bf16 [out, in]."""

    name: str
    out_features: int
    in_features: int


@dataclass(frozen=True)
class EngineModule:
    """A module as one engine builds it."""

    runtime: str                 # the prefix the engine asks its quantization config about
    checkpoint: str              # the checkpoint-side module name (fused: the common parent + fused name)
    local: str                   # layer-relative name (global modules: the full name)
    shards: tuple[Linear, ...]   # checkpoint linears loaded into it (one, a fused group, or every expert projection)
    is_experts: bool
    is_mtp: bool
    quantizable: bool            # False: the engine builds it unquantized whatever `exclude` says


def checkpoint_linears(layout: GlmLayout) -> dict[int | None, list[Linear]]:
    """The checkpoint's linear weights by layer (None: global), from config.json."""
    out: dict[int | None, list[Linear]] = {None: []}
    for layer in layout.all_layers:
        out[layer] = [_linear(t) for t in layout.layer_tensors(layer) if _is_linear(t)]
    for t in layout.tensors():
        if not t.name.startswith("model.layers.") and _is_linear(t):
            out[None].append(_linear(t))
    return out


def engine_modules(profile: EngineProfile, layout: GlmLayout,
                   linears: dict[int | None, list[Linear]] | None = None) -> list[EngineModule]:
    """Every module `profile`'s engine builds, with the checkpoint linears each one loads."""
    linears = linears if linears is not None else checkpoint_linears(layout)
    modules = [EngineModule(lin.name, lin.name, lin.name, (lin,), False, False, profile.quantizable(lin.name, False))
               for lin in linears[None]]
    for layer in layout.all_layers:
        modules += _layer_modules(profile, layout, layer, linears[layer])
    return modules


def _layer_modules(profile: EngineProfile, layout: GlmLayout, layer: int, linears: list[Linear]) -> list[EngineModule]:
    prefix = f"model.layers.{layer}."
    is_mtp = layout.is_mtp(layer)
    by_local = {lin.name[len(prefix):]: lin for lin in linears}
    groups: dict[str, list[Linear]] = {}
    taken: set[str] = set()
    experts = [lin for local, lin in by_local.items() if EXPERT_RE.match(local)]
    if experts:
        groups["mlp.experts"] = experts
        taken.update(lin.name for lin in experts)
    for fused, shard_names in profile.fused.items():
        for local in by_local:
            parent, _, proj = local.rpartition(".")
            if proj != shard_names[0]:
                continue
            members = [by_local.get(f"{parent}.{s}" if parent else s) for s in shard_names]
            if all(members) and not any(m.name in taken for m in members):
                groups[f"{parent}.{fused}" if parent else fused] = members
                taken.update(m.name for m in members)
    for local, lin in by_local.items():
        if lin.name not in taken:
            groups[local] = [lin]
    out = []
    for local, members in groups.items():
        runtime = profile.mtp_runtime_name(layer, local) if is_mtp else prefix + local
        out.append(EngineModule(runtime, prefix + local, local, tuple(members), local == "mlp.experts", is_mtp,
                                profile.quantizable(local, is_mtp)))
    return out


def _is_linear(t) -> bool:
    return t.name.endswith(".weight") and len(t.shape) == 2


def _linear(t) -> Linear:
    return Linear(t.name[: -len(".weight")], t.shape[0], t.shape[1])
