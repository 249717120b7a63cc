"""Per engine: would every module it builds find tensors of the dtype and shape it allocates?"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from mxforge.errors import ConfigError

from .loaded import LoadedCheckpoint
from .matching import ExcludeList, ShardsDisagree, draft_excludes, engine_excludes
from .modules import EngineModule, engine_modules
from .profiles import EngineProfile
from .report import Problem
from .tensor_forms import BF16, MXFP4, Stored, braced, describe_stored, mxfp4_shapes

RUN_FIXUP = "run mxforge fixup"


@dataclass(frozen=True)
class Verdict:
    """The engine's decision for one module: MXFP4 or bf16, or an error it raises while deciding."""

    module: EngineModule
    form: str | None                 # MXFP4 / BF16; None when the engine raises
    reason: str                      # why: the matching entry, "never quantized", "not excluded", ...
    disagree: ShardsDisagree | None = None


def decide(profile: EngineProfile, module: EngineModule, main: ExcludeList, draft: ExcludeList,
           quantized_checkpoint: bool) -> Verdict:
    """What `profile`'s engine allocates for `module` (draft modules use the `draft` exclude list)."""
    if not quantized_checkpoint:
        return Verdict(module, BF16, "the checkpoint has no quantization_config")
    if not module.quantizable:
        return Verdict(module, BF16, f"{profile.name} never quantizes {module.local}")
    entries = draft if module.is_mtp else main
    try:
        excluded = engine_excludes(profile, module.runtime, module.is_experts, entries)
    except ShardsDisagree as e:
        return Verdict(module, None, "shards disagree", e)
    if excluded:
        entry = entries.matching_entry(module.runtime)
        return Verdict(module, BF16, f"exclude entry {entry!r} matches it" if entry else "its exclude entries match it")
    return Verdict(module, MXFP4, "no exclude entry matches it")


def check_engine(profile: EngineProfile, modules: list[EngineModule], stored: Mapping[str, Stored],
                 main: ExcludeList, draft: ExcludeList, quantized_checkpoint: bool,
                 skip: frozenset[str] = frozenset()) -> list[Problem]:
    """Every disagreement between what `profile`'s engine allocates and what the checkpoint stores.

    Modules with a missing tensor are left to the layout check; names in `skip` (tensors in unreadable
    shards) are left to the integrity check.
    """
    problems = []
    for module in modules:
        items = [stored[lin.name] for lin in module.shards]
        if any(s.form is None for s in items) or any(s.linear.name + ".weight" in skip for s in items):
            continue
        verdict = decide(profile, module, main, draft, quantized_checkpoint)
        problem = _compare(profile, verdict, items)
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
        if form == MXFP4:
            return f"MXFP4 (uint8 w13_weight [{n}, {2 * inter}, {hidden // 2}], w2_weight [{n}, {down.out_features}, {inter // 2}])"
        return f"bf16 (w13_weight [{n}, {2 * inter}, {hidden}], w2_weight [{n}, {down.out_features}, {inter}])"
    out = sum(s.out_features for s in shards)
    if form == MXFP4:
        try:
            return f"MXFP4 (uint8 {list(mxfp4_shapes(out, shards[0].in_features)[0])})"
        except ConfigError:
            return f"MXFP4 (in-dimension {shards[0].in_features} is odd: it cannot be packed)"
    return f"bf16 [{out}, {shards[0].in_features}]"


def _compare(profile: EngineProfile, verdict: Verdict, stored: list[Stored]) -> Problem | None:
    module = verdict.module
    forms = {s.form for s in stored}
    defects = [s.defect for s in stored if s.defect]
    if verdict.disagree is None and not defects and forms == {verdict.form}:
        return None
    where = braced([s.linear.name for s in stored])
    found = describe_stored(stored)

    def problem(message: str, remedy: str) -> Problem:
        return Problem("engine", module.runtime, message, remedy, profile.name)

    if verdict.disagree is not None:
        d = verdict.disagree
        remedy = (f"{RUN_FIXUP} (adds {module.runtime!r}, which takes precedence over the shard entries)" if forms == {BF16}
                  else "re-quantize so that every shard is stored alike, and exclude all of them or none")
        return problem(f"exclude entries match {', '.join(d.matched)} but not {', '.join(d.unmatched)}: the engine raises "
                       f"\"Found different quantization schemes\" and stops loading (the checkpoint holds {found} under {where})",
                       remedy)
    if defects:
        more = f" (and {len(defects) - 1} more)" if len(defects) > 1 else ""
        return problem(f"malformed tensors: {defects[0]}{more}", "re-quantize or re-download these tensors")
    message = f"would be {expected_text(module, verdict.form)} but the checkpoint holds {found} under {where}"
    if len(forms) > 1:
        return problem(message + "; its shards are stored in different formats and the engine loads them into one parameter",
                       "re-quantize so that every shard of this module is stored alike")
    if verdict.form == MXFP4:
        return problem(message, RUN_FIXUP)
    if not module.quantizable:
        return problem(message + f" ({verdict.reason})",
                       f"re-quantize with {module.checkpoint} excluded (kept bf16)")
    return problem(message + f" ({verdict.reason})",
                   "remove that exclude entry (the tensors are MXFP4 on disk), or re-quantize the module in bf16")


def engine_problems(loaded: LoadedCheckpoint, profiles: list[EngineProfile], exclude: list[str],
                    quantized: bool = True) -> tuple[list, dict]:
    """Per-engine disagreements between what each engine allocates under `exclude` and what is stored
    (`quantized` False: the checkpoint has no quantization_config, so engines build everything bf16)."""
    main = ExcludeList(tuple(exclude))
    problems, checked = [], {}
    for profile in profiles:
        draft = draft_excludes(main, profile, loaded.layout.mtp_layers)
        modules = engine_modules(profile, loaded.layout, loaded.linears)
        found = check_engine(profile, modules, loaded.stored, main, draft, quantized, loaded.unreadable)
        problems += found
        checked[profile.name] = {"modules": len(modules), "problems": len(found)}
    return problems, checked
