"""Per engine release range: would every module it builds find tensors of the dtype and shape it allocates?"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from mxforge.errors import ConfigError
from mxforge.formats import FORMATS, MXFP4, ElementFormat, format_named, format_of_spec
from mxforge.models import MoeLayout
from mxforge.validation.loaded import LoadedCheckpoint
from mxforge.validation.matching import (
    DRAFT,
    TARGET,
    RoleView,
    SchemeError,
    ShardsDisagree,
    engine_excludes,
    fuses_shared_experts,
    module_config,
    role_views,
    scheme_format,
)
from mxforge.validation.modules import EngineModule, LayerLinears, engine_modules
from mxforge.validation.profiles import EngineProfile
from mxforge.validation.report import Problem
from mxforge.validation.tensor_forms import BF16, Stored, braced, describe_stored, form_title

RUN_FIXUP = "run mxforge fixup"
OTHER = "another scheme"
WRITTEN = " and ".join(["bf16", *(f.title for f in FORMATS)])  # what mxforge writes and checks


@dataclass(frozen=True)
class Verdict:
    """The engine's decision for one module: an element format (its name) or bf16, or an error it raises while
    deciding."""

    module: EngineModule
    form: str | None  # a format's name / BF16 / OTHER (a scheme mxforge never writes); None when the engine raises
    reason: str  # why: the matching entry, "never quantized", "not excluded", the error ...
    disagree: ShardsDisagree | None = None
    requantized: bool = False  # loaded as `form` (bf16), then re-quantized to MXFP4 by the engine
    emulated: bool = False  # loaded as `form`, computed by emulation (profile schemes.formats_emulated): slow
    remedy: str | None = None  # for an error the usual remedies do not fit


@dataclass
class EngineView:
    """One profile's reading of one `exclude` list: what each model sees, whether it fuses shared experts,
    and every module it builds."""

    profile: EngineProfile
    roles: dict[str, RoleView]
    fused: frozenset[str]  # roles that append the shared expert to the routed-expert bank
    modules: list[EngineModule] = field(default_factory=list)


def engine_view(
    profile: EngineProfile,
    layout: MoeLayout,
    linears: dict[int | None, LayerLinears],
    exclude: list[str],
    qc: dict | None = None,
) -> EngineView:
    """`profile`'s release reading `exclude` (and the per-layer configs of `qc`, the quantization_config)."""
    roles = role_views(profile, exclude, layout, qc)
    fused = frozenset(r for r in (TARGET, DRAFT) if fuses_shared_experts(profile, r, layout, roles[r]))
    if TARGET not in fused and profile.fusion.target_refusal_reaches_draft:
        fused -= {DRAFT}  # the target's refusal, written into the server's setting, is what the draft's gate reads
    return EngineView(profile, roles, fused, engine_modules(profile, layout, linears, fused))


def without_fusion(view: EngineView, layout: MoeLayout, linears: dict[int | None, LayerLinears]) -> EngineView:
    """The same release served with its shared-expert fusion switched off (the server flag)."""
    return EngineView(view.profile, view.roles, frozenset(), engine_modules(view.profile, layout, linears))


def decide(view: EngineView, module: EngineModule, quantized_checkpoint: bool = True) -> Verdict:
    """What the release allocates for `module`."""
    profile = view.profile
    if not quantized_checkpoint:
        return Verdict(module, BF16, "the checkpoint has no quantization_config")
    if not module.quantizable:
        return Verdict(module, BF16, f"{profile.name} never quantizes {module.local}")
    role = view.roles[module.role]
    if role.unquantized:
        finds = (
            "an exclude entry under its block's prefix"
            if profile.draft.block_entry_switch != "none" and not profile.draft.whole_draft_switch
            else "its layer excluded"
        )
        return Verdict(module, BF16, f"the whole draft is built unquantized ({profile.draft.class_name} finds {finds})")
    try:
        excluded = engine_excludes(profile, module.runtime, module.is_experts, role.entries, module.is_mtp)
    except ShardsDisagree as e:
        return Verdict(module, None, "shards disagree", e)
    if excluded:
        entry = role.entries.matching_entry(module.runtime)
        why = f"exclude entry {entry!r} matches it" if entry else "its exclude entries match it"
        if not profile.requantizes(module.runtime, role.global_config):
            return Verdict(module, BF16, why)
        try:  # re-quantized with the scheme its layer config names, which must be MXFP4
            requant = scheme_format(profile, module_config(profile, role, module.runtime, module.is_experts))
        except SchemeError as e:
            return Verdict(module, None, f"the engine raises: {e}")
        if requant != MXFP4:
            return Verdict(
                module,
                None,
                why + f", but {profile.name} re-quantizes it with its layer config, which is not "
                'an MXFP4 scheme: the engine raises "No quark compatible scheme"',
            )
        return Verdict(
            module, BF16, why + f"; {profile.name} loads it bf16 and re-quantizes it to MXFP4", requantized=True
        )
    try:
        config = module_config(profile, role, module.runtime, module.is_experts)
    except SchemeError as e:
        return Verdict(module, None, f"the engine raises: {e}")
    fmt = scheme_format(profile, config)
    if fmt is not None and fmt.name in profile.formats_tiled_merges and not module.is_experts:
        ragged = next((s for s in module.shards[:-1] if s.out_features % fmt.block_rows), None)
        if ragged is not None:
            return Verdict(
                module,
                None,
                f"its shards are merged into one {fmt.title} weight, whose scales cover {fmt.block_rows}-row tiles, "
                f"and {ragged.name} (not the last shard) has {ragged.out_features} rows: the engine raises "
                f'"Weight output_partition_size = {ragged.out_features} is not divisible by weight quantization '
                f'block_n = {fmt.block_rows}" (schemes.formats_tiled_merges)',
                remedy=f"a real model's shapes are whole tiles; give a replica {fmt.block_rows}-multiple dimensions, "
                f"or store this module in a format these releases merge freely (bf16: a recipe without "
                '`format = "source"` for it)',
            )
    if fmt is not None:
        emulated = fmt.name in profile.formats_emulated or (
            not module.is_experts
            and fmt.name in profile.linear_formats_emulated_without_inputs
            and (config or {}).get("input_tensors") is None
        )
        proj = module.runtime.rpartition(".")[2]
        if proj in profile.packed_as_itself:
            return Verdict(
                module,
                fmt.name,
                f"no exclude entry matches it, and {profile.name}'s model packs {proj} from itself, which it builds "
                "in the global config whatever layer_quant_config says (exclude.packed_as_itself)",
                emulated=emulated,
                remedy=f"store it as the global config does ({fmt.title}) or bf16 (excluded), or serve it with a "
                "release that reads its layer config",
            )
        return Verdict(module, fmt.name, "no exclude entry matches it", emulated=emulated)
    weight = (config or {}).get("weight")
    if not isinstance(weight, dict):
        return Verdict(
            module,
            None,
            "no exclude entry matches it and its layer config quantizes nothing: the engine raises "
            '"No quark compatible scheme"',
        )
    asked = format_of_spec(weight)
    if asked is not None and asked.name in profile.formats_raising:
        return Verdict(
            module,
            None,
            f"its layer config asks for {asked.title} weights, which {profile.name} takes with no scheme: the engine "
            'raises "No quark compatible scheme" (measured, schemes.formats_raising)',
            remedy=_load_elsewhere(profile, asked),
        )
    if asked is not None and asked.name in profile.formats_own_method:
        return Verdict(
            module,
            OTHER,
            f"its layer config asks for {asked.title} weights, which {profile.name} builds with "
            f"{profile.formats_own_method[asked.name]}",
            remedy=_load_elsewhere(profile, asked),
        )
    if asked is not None and asked.name not in profile.formats:
        loaded = _loaded_titles(profile)
        return Verdict(
            module,
            None,
            f"its layer config asks for {asked.title} weights, and {profile.name}'s profile lists {loaded} as the "
            "formats these releases load (schemes.formats): mxforge has not measured that they load "
            f"{asked.title}",
            remedy=f"serve it with a release whose profile lists {asked.name}, or re-quantize it to {loaded}",
        )
    if asked is not None or weight.get("dtype") in {f.quark.dtype for f in FORMATS}:
        title = (asked or next(f for f in FORMATS if f.quark.dtype == weight.get("dtype"))).title
        return Verdict(
            module,
            None,
            f"its layer config is not an {title} scheme the engine takes ({title} weights need dynamic "
            f'{title} activations declared): the engine raises "No quark compatible scheme"',
        )
    return Verdict(module, OTHER, f"its layer config asks for {weight.get('dtype')!r} weights")


def _loaded_titles(profile: EngineProfile) -> str:
    """The formats `profile`'s releases load, for people: "FP8 PTPC, MXFP4"."""
    return ", ".join(format_named(f).title for f in sorted(profile.formats))


def _load_elsewhere(profile: EngineProfile, fmt: ElementFormat) -> str:
    """What to do with a module stored in a format `profile`'s releases do not load."""
    return (
        f"serve it with a release that loads {fmt.title} (mxforge validate lists them), or store it as "
        f"{_loaded_titles(profile)}"
    )


def check_engine(
    view: EngineView, stored: Mapping[str, Stored], quantized_checkpoint: bool, skip: frozenset[str] = frozenset()
) -> list[Problem]:
    """Every disagreement between what the profile's engine allocates and what the checkpoint stores.

    Modules with a missing tensor are left to the layout check; names in `skip` (tensors in unreadable
    shards) are left to the integrity check.
    """
    problems = []
    for module in view.modules:
        items = [stored[lin.name] for lin in module.shards]
        if any(s.form is None for s in items) or any(s.linear.name + ".weight" in skip for s in items):
            continue
        problem = _compare(view, decide(view, module, quantized_checkpoint), items)
        if problem:
            problems.append(problem)
    return problems


def expected_text(module: EngineModule, form: str) -> str:
    """What the engine allocates, in its own terms: fused shapes, or the experts' w13/w2."""
    shards = module.shards
    if module.is_experts:
        gate = next(s for s in shards if s.name.endswith("gate_proj"))
        down = next(s for s in shards if s.name.endswith("down_proj"))
        n = sum(s.name.endswith("gate_proj") for s in shards)
        hidden, inter = gate.in_features, gate.out_features
        if form != BF16:
            fmt = format_named(form)
            try:
                w13, w2 = fmt.packed_inner(hidden), fmt.packed_inner(inter)
            except ConfigError as e:
                return f"{fmt.title} ({e}: it cannot be packed)"
            return (
                f"{fmt.title} ({fmt.codes_label} w13_weight [{n}, {2 * inter}, {w13}], "
                f"w2_weight [{n}, {down.out_features}, {w2}])"
            )
        return f"bf16 (w13_weight [{n}, {2 * inter}, {hidden}], w2_weight [{n}, {down.out_features}, {inter}])"
    out = sum(s.out_features for s in shards)
    if form != BF16:
        fmt = format_named(form)
        reason = fmt.unpackable(shards[0].in_features)
        if reason:
            return f"{fmt.title} ({reason}: it cannot be packed)"
        return f"{fmt.title} ({fmt.codes_label} {list(fmt.packed_shapes((out, shards[0].in_features))[0])})"
    return f"bf16 [{out}, {shards[0].in_features}]"


def fusion_remedy(profile: EngineProfile) -> str:
    """How to stop the release fusing a shared expert stored unlike the routed experts."""
    flag = f"serve with {profile.fusion.server_flag}"
    if profile.fusion.veto == "none":
        return f"{flag} (no exclude entry can stop this release fusing it)"
    return f"{RUN_FIXUP} (a model.decoder shared-expert entry vetoes the fusion), or {flag}"


def _compare(view: EngineView, verdict: Verdict, stored: list[Stored]) -> Problem | None:
    profile, module = view.profile, verdict.module
    forms = {s.form for s in stored}
    defects = [s.defect for s in stored if s.defect]
    if verdict.disagree is None and not defects and forms == {verdict.form}:
        return None
    names = [s.linear.name for s in stored]
    shared_names = [n for n in names if ".shared_experts." in n] if module.fused_shared else []
    where = braced([n for n in names if n not in shared_names]) + (
        f" and {braced(shared_names)}" if shared_names else ""
    )
    found = describe_stored(stored)

    def problem(message: str, remedy: str, flag: str | None = None) -> Problem:
        return Problem("engine", module.runtime, message, remedy, profile.name, flag)

    if verdict.form is None and verdict.disagree is None:
        return problem(
            f"{verdict.reason} (the checkpoint holds {found} under {where})",
            verdict.remedy
            or (RUN_FIXUP if forms == {BF16} else "write the quantizer's quantization_config, or exclude it"),
        )
    if verdict.form == OTHER:
        return problem(
            f"{verdict.reason}; the checkpoint holds {found} under {where}",
            verdict.remedy or f"exclude it or give it a layer config of a format mxforge writes ({WRITTEN} only)",
        )
    if verdict.disagree is not None:
        d = verdict.disagree
        remedy = (
            f"{RUN_FIXUP} (writes the shard entries this release needs)"
            if forms == {BF16}
            else "re-quantize so that every shard is stored alike, and exclude all of them or none"
        )
        return problem(
            f"exclude entries match {', '.join(d.matched)} but not {', '.join(d.unmatched)}: the engine raises "
            f'"Found different quantization schemes" and stops loading (the checkpoint holds {found} under {where})',
            remedy,
        )
    if defects:
        more = f" (and {len(defects) - 1} more)" if len(defects) > 1 else ""
        return problem(f"malformed tensors: {defects[0]}{more}", "re-quantize or re-download these tensors")
    assert verdict.form is not None, "a verdict without a form is a disagreement or an engine error, reported above"
    message = f"would be {expected_text(module, verdict.form)} but the checkpoint holds {found} under {where}"
    if module.fused_shared and len(forms) > 1:
        shared = [s for s in stored if ".shared_experts." in s.linear.name]
        return problem(
            f"{profile.draft.class_name if module.is_mtp else 'the target model'} appends the shared expert "
            f"({describe_stored(shared)} under {braced([s.linear.name for s in shared])}) to the routed-expert "
            f"bank, which it builds {expected_text(module, verdict.form)} (its routed-expert count opens "
            "the shared-expert fusion gate)",
            fusion_remedy(profile),
            profile.fusion.server_flag,
        )
    if len(forms) > 1:
        return problem(
            message + "; its shards are stored in different formats and the engine loads them into one parameter",
            "re-quantize so that every shard of this module is stored alike",
        )
    if verdict.form != BF16:
        return problem(message + (f" ({verdict.reason})" if verdict.remedy else ""), verdict.remedy or RUN_FIXUP)
    if not module.quantizable:
        return problem(message + f" ({verdict.reason})", f"re-quantize with {module.checkpoint} excluded (kept bf16)")
    stored_as = next((form_title(f) for f in forms if f is not None), "quantized")
    return problem(
        message + f" ({verdict.reason})",
        f"remove that exclude entry (the tensors are {stored_as} on disk), or re-quantize the module in bf16",
    )


def engine_problems(
    loaded: LoadedCheckpoint, profiles: list[EngineProfile], exclude: list[str], qc: dict | None
) -> tuple[list, dict]:
    """Per-profile disagreements between what each release allocates under `exclude` (and the rest of `qc`,
    the quantization_config) and what is stored (no `qc`: engines build everything bf16)."""
    quantized = qc is not None
    problems, checked = [], {}
    for profile in profiles:
        view = engine_view(profile, loaded.layout, loaded.linears, exclude, qc)
        found = check_engine(view, loaded.stored, quantized, loaded.unreadable)
        if any(p.server_flag for p in found):
            # Served with the flag, the shared expert is a module of its own: that setup must load too.
            unfused = without_fusion(view, loaded.layout, loaded.linears)
            found = [p for p in found if p.server_flag] + check_engine(
                unfused, loaded.stored, quantized, loaded.unreadable
            )
        problems += found
        verdicts = [decide(view, m, quantized) for m in view.modules]
        emulated: dict[str, int] = {}
        for v in verdicts:
            if v.emulated and v.form is not None:
                emulated[v.form] = emulated.get(v.form, 0) + 1
        checked[profile.name] = {
            "modules": len(view.modules),
            "problems": len(found),
            "fused_shared_experts": sorted(view.fused),
            "requantized_at_load": sum(v.requantized for v in verdicts),
            "emulated": emulated,  # per format: modules the release computes by emulation
        }
    return problems, checked
