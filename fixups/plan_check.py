"""Before quantizing: would the checkpoint a plan writes load, after `mxforge fixup`, in every selected release?

`mxforge run` asks this of its plan before the hours of quantization: the plan fixes every output tensor's name,
dtype and shape and the recipe the quantization_config, which is all that validate's engine check reads. A recipe
whose output some selected release cannot load (a format its schemes do not take where it builds the module, a fused
module whose shards the recipe stores in different formats, a module the release never quantizes) is refused then,
naming the releases and the modules, rather than after quantizing.
"""

from __future__ import annotations

from mxforge.errors import ConfigError
from mxforge.fixups.fixup import fixed_quantization_config
from mxforge.formats import declared_formats
from mxforge.quantize.plan import QuantizePlan
from mxforge.quantize.recipe import Recipe
from mxforge.safetensors_io import TensorInfo
from mxforge.validation.loaded import LoadedCheckpoint
from mxforge.validation.modules import all_linears, checkpoint_linears, engine_modules
from mxforge.validation.profiles import EngineProfile
from mxforge.validation.report import Problem
from mxforge.validation.tensor_forms import braced, form_title, stored_form
from mxforge.validation.validate import loadability_problems

LISTED = 1  # problems quoted in the refusal (the rest: counted; validate on the output would name them all)


def planned_checkpoint(plan: QuantizePlan, ckpt, quantization_config: dict) -> LoadedCheckpoint:
    """The checkpoint `plan` writes, as validate reads it: every output tensor's header (from the plan's shard
    layouts), nothing read from disk. `ckpt`: the source (its config is the output's, but quantization_config: the
    one the plan writes)."""
    infos: dict[str, TensorInfo] = {}
    for shard in plan.shards:
        for t in shard.tensors:
            for out in t.outputs():
                start = shard.offsets[out.name]
                infos[out.name] = TensorInfo(out.name, out.dtype, tuple(out.shape), start, start + out.nbytes)
    layout = plan.layout
    planned = layout.tensors()
    linears = checkpoint_linears(layout, planned)
    declared = declared_formats(quantization_config)
    stored = {lin.name: stored_form(lin, infos, declared) for lin in all_linears(linears)}
    return LoadedCheckpoint(ckpt, layout, planned, linears, infos, stored, frozenset())


def planned_output(plan: QuantizePlan, recipe: Recipe, ckpt) -> tuple[dict, LoadedCheckpoint]:
    """(the quantization_config `plan` writes with `recipe`, its output as validate reads it: `planned_checkpoint`)."""
    qc = plan.quantization_config(recipe, ckpt.config.get("quantization_config"))
    return qc, planned_checkpoint(plan, ckpt, qc)


def unloadable(loaded: LoadedCheckpoint, qc: dict, recipe: Recipe, profiles: list[EngineProfile]) -> list[Problem]:
    """The engine problems validate would report on a plan's output (`planned_output`) after fixup, per release of
    `profiles` (those a serving flag avoids left out: validate names the flag)."""
    fixed, *_ = fixed_quantization_config(loaded, profiles, qc, where=f"recipe {recipe.name!r}")
    found, _ = loadability_problems(loaded, profiles, fixed)
    return [p for p in found if p.check == "engine" and not p.server_flag]


def refuse_unloadable(loaded: LoadedCheckpoint, qc: dict, recipe: Recipe, profiles: list[EngineProfile]) -> None:
    """Refuse a plan whose output (`planned_output`) would not load in a selected release.

    Raises:
        ConfigError: names the releases, the first problems and what to do.
    """
    problems = unloadable(loaded, qc, recipe, profiles)
    if not problems:
        return
    releases = list(dict.fromkeys(str(p.engine) for p in problems))
    quoted = "; ".join(p.format() for p in problems[:LISTED])
    more = f" (and {len(problems) - LISTED} more)" if len(problems) > LISTED else ""
    raise ConfigError(
        f"recipe {recipe.name!r}: its output would not load in {', '.join(releases)} even after mxforge fixup: "
        f"{quoted}{more}. Nothing was quantized: change the recipe's rules for these modules, or select the releases "
        "you serve with --engines",
        entry=recipe.name,
    )


def mixed_fused_modules(
    loaded: LoadedCheckpoint, profiles: list[EngineProfile]
) -> dict[tuple[str, ...], tuple[list[str], list[str]]]:
    """The modules an engine release loads into one parameter (fused q/k/v or gate/up shards, an expert bank) whose
    shards a plan's output (`planned_output`) stores in different forms: their shard names -> (the forms, each
    shard's in order; the releases of `profiles` that fuse them)."""
    found: dict[tuple[str, ...], tuple[list[str], list[str]]] = {}
    for profile in profiles:
        for module in engine_modules(profile, loaded.layout, loaded.linears):
            forms = [loaded.stored[lin.name].form or "nothing" for lin in module.shards]
            if len(set(forms)) > 1:
                names = tuple(lin.name for lin in module.shards)
                found.setdefault(names, (forms, []))[1].append(profile.name)
    return found


def refuse_mixed_fused(loaded: LoadedCheckpoint, recipe: Recipe, profiles: list[EngineProfile]) -> None:
    """Refuse a plan whose output (`planned_output`) stores the shards of a module some release fuses
    (`mixed_fused_modules`) in different forms: no release of `profiles` that fuses it could load it.

    Raises:
        ConfigError: names the shards, their forms, the releases and what to do.
    """
    mixed = mixed_fused_modules(loaded, profiles)
    if not mixed:
        return
    (names, (forms, releases)), *rest = mixed.items()
    by_form: dict[str, list[str]] = {}
    for name, form in zip(names, forms):
        by_form.setdefault(form, []).append(name)
    shards = ", ".join(
        f"{braced(group)} {form_title(form) if form != 'nothing' else 'absent'}" for form, group in by_form.items()
    )
    more = f" (and {len(rest)} more such module(s))" if rest else ""
    raise ConfigError(
        f"recipe {recipe.name!r} stores the shards of one fused module in different formats: {shards}; "
        f"{', '.join(releases)} load them into one parameter, so no such release could load the output{more}. "
        "Nothing was quantized: give every shard of a fused module (q/k/v, gate/up, a layer's experts) the same rule",
        entry=recipe.name,
    )


def plan_checker(engines: str | list[str] | None):
    """The check `quantize_checkpoint(check_plan=...)` runs on its plan: `refuse_unloadable` for the releases
    `engines` selects (as --engines; None: every supported release) of the plan's model family."""
    from mxforge.validation.profiles import select

    def check(plan: QuantizePlan, recipe: Recipe, ckpt) -> None:
        profiles = [s.profile for s in select(engines, plan.layout.family)]
        qc, loaded = planned_output(plan, recipe, ckpt)  # built once for both checks
        refuse_mixed_fused(loaded, recipe, profiles)
        refuse_unloadable(loaded, qc, recipe, profiles)

    return check


def check_fused_shards(plan: QuantizePlan, recipe: Recipe, ckpt) -> None:
    """What `mxforge quantize` checks on its plan (`quantize_checkpoint(check_plan=...)`): `refuse_mixed_fused` for
    every supported release of the plan's model family (quantize serves no release in particular; `mxforge run`
    checks the releases selected, and everything else validate reports)."""
    from mxforge.validation.profiles import all_profiles

    refuse_mixed_fused(planned_output(plan, recipe, ckpt)[1], recipe, all_profiles(plan.layout.family))
