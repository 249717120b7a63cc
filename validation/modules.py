"""Every module an engine builds from config.json, with the checkpoint tensors it loads.

The checkpoint's linear weights come from `MoeLayout` (config.json alone); the engine profile says how
they are grouped (fused modules, routed experts as one module) and named (the MTP layer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mxforge.models import MoeLayout
from mxforge.safetensors_io import PlannedTensor
from mxforge.validation.matching import DRAFT, TARGET
from mxforge.validation.profiles import EngineProfile

EXPERT_RE = re.compile(r"^mlp\.experts\.\d+\.")


@dataclass(slots=True)
class Linear:
    """One checkpoint linear weight: module name (tensor name minus `.weight`) and its bf16 [out, in]."""

    name: str
    out_features: int
    in_features: int


@dataclass(frozen=True)
class EngineModule:
    """A module as one engine builds it."""

    runtime: str  # the prefix the engine asks its quantization config about
    checkpoint: str  # the checkpoint-side module name (fused: the common parent + fused name)
    local: str  # layer-relative name (global modules: the full name)
    shards: tuple[Linear, ...]  # checkpoint linears loaded into it (one, a fused group, or every expert projection)
    is_experts: bool
    is_mtp: bool
    quantizable: bool  # False: the engine builds it unquantized whatever `exclude` says
    fused_shared: bool = False  # routed experts with the shared expert appended to the bank
    layer: int | None = None  # its global layer (None: a global module)

    @property
    def role(self) -> str:
        """The model that builds it: the target, or the MTP draft."""
        return DRAFT if self.is_mtp else TARGET


@dataclass
class LayerLinears:
    """One layer's linear weights: its routed experts' projections, and the rest by layer-relative name."""

    experts: list[Linear]
    others: dict[str, Linear]


def checkpoint_linears(layout: MoeLayout, planned: list[PlannedTensor] | None = None) -> dict[int | None, LayerLinears]:
    """The checkpoint's linear weights by layer (None: global modules, by full name), from config.json."""
    out: dict[int | None, LayerLinears] = {None: LayerLinears([], {})}
    for layer in layout.all_layers:
        out[layer] = LayerLinears([], {})
    for t in planned if planned is not None else layout.tensors():
        if not (t.name.endswith(".weight") and len(t.shape) == 2):
            continue
        lin = Linear(t.name[: -len(".weight")], t.shape[0], t.shape[1])
        at, local = layout.locate(lin.name)
        if at is None:
            out[None].others[lin.name] = lin
            continue
        group = out[at]
        if EXPERT_RE.match(local):
            group.experts.append(lin)
        else:
            group.others[local] = lin
    return out


def all_linears(linears: dict[int | None, LayerLinears]) -> list[Linear]:
    return [lin for group in linears.values() for lin in (*group.experts, *group.others.values())]


def engine_modules(
    profile: EngineProfile,
    layout: MoeLayout,
    linears: dict[int | None, LayerLinears] | None = None,
    fused_roles: frozenset[str] = frozenset(),
) -> list[EngineModule]:
    """Every module `profile`'s engine builds, with the checkpoint linears each one loads; in the roles
    (target / draft) listed in `fused_roles` the shared expert is loaded into the routed-expert bank."""
    linears = linears if linears is not None else checkpoint_linears(layout)
    modules = [
        EngineModule(profile.runtime_name(name), name, name, (lin,), False, False, profile.quantizable(name, False))
        for name, lin in linears[None].others.items()
    ]
    for layer in layout.all_layers:
        role = DRAFT if layout.is_mtp(layer) else TARGET
        modules += _layer_modules(profile, layout, layer, linears[layer], role in fused_roles)
    return modules


def _layer_modules(
    profile: EngineProfile, layout: MoeLayout, layer: int, linears: LayerLinears, fuse_shared: bool
) -> list[EngineModule]:
    is_mtp = layout.is_mtp(layer)
    groups: dict[str, list[Linear]] = {}
    shared = [lin for local, lin in linears.others.items() if local.startswith("mlp.shared_experts.")]
    fuse_shared = fuse_shared and bool(linears.experts) and bool(shared)
    if linears.experts:
        groups["mlp.experts"] = linears.experts + (shared if fuse_shared else [])
    others = {k: v for k, v in linears.others.items() if not (fuse_shared and v in shared)}
    taken: set[str] = set()
    for local in others:
        parent, _, proj = local.rpartition(".")
        for fused, shard_names in profile.fused.items():
            if proj != shard_names[0]:
                continue
            locals_ = [f"{parent}.{s}" if parent else s for s in shard_names]
            if all(n in others and n not in taken for n in locals_):
                groups[f"{parent}.{fused}" if parent else fused] = [others[n] for n in locals_]
                taken.update(locals_)
    for local, lin in others.items():
        if local not in taken:
            groups[local] = [lin]
    out = []
    for local, members in groups.items():
        checkpoint = layout.module_name(layer, local)
        runtime = profile.mtp_runtime_name(layer, local) if is_mtp else profile.runtime_name(checkpoint)
        experts = local == "mlp.experts"
        out.append(
            EngineModule(
                runtime,
                checkpoint,
                local,
                tuple(members),
                experts,
                is_mtp,
                profile.quantizable(local, is_mtp and local == layout.MTP_PROJ),
                fused_shared=experts and fuse_shared,
                layer=layer,
            )
        )
    return out
