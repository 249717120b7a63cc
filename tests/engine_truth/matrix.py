"""The conformance matrix: checkpoints of every export style, and the comparison of mxforge's decisions with
each engine release's own.

A case is a checkpoint on disk (headers are all that matter). For every module the release builds, target
and MTP draft, mxforge's decision (validation/engine_check.py) must equal the one the release's own code takes
(the probes), and so must the structure around it: the draft class, the draft's names, eh_proj, the whole-
draft switch, the packed-module mapping and shared-expert fusion.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from helpers import BASE, MXFP6_RECIPE  # AMD's published exclusions; the MTP layer's are added per case
from quark_like import write_quark_like

from mxforge.fixups.fixup import fixup_checkpoint
from mxforge.models import Family
from mxforge.models.fixture import preset_config
from mxforge.models.layout import MoeLayout
from mxforge.quantize.recipe import load_recipe
from mxforge.validation.engine_check import OTHER, EngineView, decide, engine_view, without_fusion
from mxforge.validation.loaded import load_checkpoint
from mxforge.validation.matching import DRAFT, TARGET
from mxforge.validation.profiles import EngineProfile
from mxforge.validation.tensor_forms import BF16

from . import probe_io

# A layer config that quantizes nothing (Quark's QLayerConfig() as exported).
NULL_LAYER_CONFIG = {"weight": None, "input_tensors": None, "output_tensors": None, "bias": None, "target_device": None}
# The bf16 checkpoints of a family the exports are made from, by size: a 6-expert replica, and the family's real
# layout (conftest.py's `family_cases` builds them with `mxforge fixture`; `fixture_args` gives the arguments).
SIZES = ("e6", "e256")


def sizes(family: Family) -> tuple[str, ...]:
    """The sizes of the matrix a family is judged at: both, unless every layer of the family is MoE (Qwen3.5), so
    that its real layout has no dense layers to stand in for the MoE ones (40 layers of 256 experts); no release
    fuses its shared expert, the one gate that reads the expert count."""
    layout = family.layout_of(preset_config("tiny", family=family)[0])
    return SIZES if any(not layout.is_moe(n) for n in range(layout.num_hidden_layers)) else SIZES[:1]


# What a family's probe cases must say beyond config.json (probe_io): the MTP block's projection where it is not
# the lineage's eh_proj, and the class that ends sglang's draft block's name where the draft builds a whole
# one-layer text model (Qwen3.5's Qwen3_5ForCausalLMMTP builds Qwen3_5ForCausalLM under `mtp`, its layer at
# `mtp.layers.0`).
DRAFT_BLOCK_CLASSES = {"qwen3_5_moe": "ForCausalLM", "qwen3_5_moe_text": "ForCausalLM"}


def probe_hints(family: Family, layout: MoeLayout) -> dict:
    hints: dict = {}
    if layout.MTP_PROJ != "eh_proj":
        hints[probe_io.MTP_PROJ] = layout.MTP_PROJ
    if family.name in DRAFT_BLOCK_CLASSES:
        hints[probe_io.DRAFT_BLOCK_CLASS] = DRAFT_BLOCK_CLASSES[family.name]
    return hints


def fixture_args(size: str, family: Family) -> tuple[str, dict]:
    """(`mxforge fixture` preset, keyword arguments: config overrides and shard count) of a size of the matrix.

    e256 is the family's real layout: real shapes, routed-expert count (sglang's shared-expert fusion gate reads
    it), decoder layer count and so MTP layer index (sglang's DeepSeek draft maps `model.layers.61` by that literal
    name; `layers.78` has the real layer `layers.7` as its prefix), with all but the last two decoder layers dense
    (`first_k_dense_replace`, or for a family that reads none an `mlp_layer_types` list: GLM-5.3-Flash), in 16
    shards: glm_moe_dsa's 48 exports and fixups take 16 s instead of 245 s with every layer MoE in 282 shards.
    Validate, fixup and quantize's plan are tested on every family's whole layout (`full_layout_ckpt`)."""
    if size == "e6":
        return "tiny", {"n_routed_experts": 6, "num_experts_per_tok": 2}
    config = family.config.view(preset_config("full-layout", family=family)[0])
    layers = int(config["num_hidden_layers"])
    if "first_k_dense_replace" in family.layout.REQUIRED_FIELDS:
        return "full-layout", {"first_k_dense_replace": layers - 2, "shard_count": 16}
    return "full-layout", {"mlp_layer_types": ["dense"] * (layers - 2) + ["sparse"] * 2, "shard_count": 16}


def _layout(src: Path) -> MoeLayout:
    from mxforge.models import layout_of

    return layout_of(json.loads((src / "config.json").read_text()))


def first_moe_layer(src: Path) -> int:
    """The first MoE decoder layer of a checkpoint (the styles that keep one layer's experts bf16 use it)."""
    layout = _layout(src)
    return next(n for n in range(layout.num_hidden_layers) if layout.is_moe(n))


def mtp_names(src: Path) -> tuple[str, str, str]:
    """(a glob of the whole MTP block, the MTP layer's prefix with its dot, its projection's name) as the checkpoint
    stores them: `*layers.78.*`, `model.layers.78.`, `model.layers.78.eh_proj`; Qwen3.5's `mtp.*`, `mtp.layers.0.`,
    `mtp.fc`."""
    layout = _layout(src)
    n = layout.mtp_layers[0]
    block = layout.layer_names.mtp_block
    return (f"{block}.*" if block else f"*layers.{n}.*"), layout.layer_prefix(n), layout.module_name(n, layout.MTP_PROJ)


def shared_expert(src: Path) -> str:
    """The MTP layer's shared expert module as the checkpoint names it (`mlp.shared_experts`, Qwen3.5's singular)."""
    layout = _layout(src)
    n = layout.mtp_layers[0]
    local = next(
        layout.locate(t.name)[1] for t in layout.layer_tensors(n) if layout.kind_of(t.name) == "shared_experts"
    )
    return local.split(".")[0] + "." + local.split(".")[1]


@dataclass
class Case:
    name: str
    path: Path
    engines: str | None = None  # a pipeline output made for these releases only (its `--engines`); None: all

    def load(self):
        loaded, _, _, _ = load_checkpoint(self.path)
        return loaded


def recipe_export(src: Path, out: Path, recipe: str) -> None:
    """What `mxforge quantize --recipe R` writes, as headers: the same names, dtypes, shapes and quantization_config
    (exclude list, and for a recipe that mixes formats its layer_quant_config)."""
    from mxforge.checkpoint import Checkpoint
    from mxforge.quantize.plan import plan_checkpoint
    from mxforge.quantize.recipe import load_recipe

    loaded = load_recipe(recipe)
    plan = plan_checkpoint(Checkpoint.open(src), loaded)
    kept, formats = plan.excluded_modules(), plan.module_formats()
    write_quark_like(src, out, kept, formats=formats, quantization_config=loaded.quantization_config(kept, formats))


def export_cases(root: Path, srcs: dict[str, Path], family: Family) -> list[Case]:
    """Every export style of the issue, at both sizes, before and after `mxforge fixup`."""
    cases = []
    default, mtp_bf16 = family.recipes[0], family.recipes[1]
    for size, src in srcs.items():
        whole_mtp, prefix, proj = mtp_names(src)
        mtp, shared = "*" + prefix, shared_expert(src)
        styles = {
            "recipe-default": lambda out: recipe_export(src, out, default),
            "recipe-mtp-bf16": lambda out: recipe_export(src, out, mtp_bf16),
            # Quark resolves its globs into exact names on export; here the whole MTP layer stays bf16.
            "amd-whole-mtp": lambda out: write_quark_like(src, out, BASE + [whole_mtp]),
            # The same exclusions written as globs, as hand-edited exports carry them.
            "amd-globs": lambda out: write_quark_like(src, out, BASE + [whole_mtp], glob_exclude=True),
            # The write-up's recipe: MTP shared expert and eh_proj kept, as globs.
            "wafer-globs": lambda out: write_quark_like(
                src, out, BASE + [mtp + shared + "*", "*" + proj], glob_exclude=True
            ),
            # Exact names, but the MTP layer's bf16 modules as one `re:` entry.
            "re-mtp": lambda out: _regex_mtp(src, out, prefix, shared, proj),
            # The MTP layer's bf16 modules given a layer config that quantizes nothing, not an exclude entry.
            "lqc-mtp": lambda out: _layer_config_mtp(src, out, prefix, shared, proj),
            # The recipe's output declaring MXFP4 weights without MXFP4 activations (scheme w_mxfp4).
            "weights-only": lambda out: _weights_only(src, out, default),
            # Hand-written exports: fused modules named by their fused names (each engine's), not their shards.
            "fused-names": lambda out: _fused_names(src, out, family),
            # One decoder layer's routed experts kept bf16, excluded expert by expert (Quark's exact names).
            "experts-bf16": lambda out: write_quark_like(
                src, out, BASE + [whole_mtp, "*" + _layout(src).layer_prefix(first_moe_layer(src)) + "mlp.experts.*"]
            ),
            # Layer 3's experts pinned to MXFP4 expert by expert in layer_quant_config; the global config weights-only.
            "lqc-experts": lambda out: _pinned_experts(src, out, default),
            # The MTP layer excluded by its bare layer name as well.
            "layer-entry": lambda out: _layer_entry(src, out, whole_mtp, prefix),
        }
        for recipe in bf16_recipes(family)[2:]:  # the mixed-precision recipes (attention, MTP layer in FP8 PTPC)
            styles[f"recipe-{recipe}"] = lambda out, recipe=recipe: recipe_export(src, out, recipe)
        if len(family.recipes) > 2:
            # The first mixed recipe's output with its FP8 layer configs declaring no activations (weights only).
            styles["weights-only-layers"] = lambda out: _weights_only_layers(src, out, family.recipes[2])
        # The default recipe's modules in OCP MXFP6, experts E2M3 and attention E3M2 (two MX formats mixed).
        styles["mxfp6"] = lambda out: _mxfp6(src, out)
        for style, make in styles.items():
            before = root / f"{size}-{style}"
            make(before)
            after = root / f"{size}-{style}-fixed"
            shutil.copytree(before, after, copy_function=os.link)  # fixup replaces files by rename, never in place
            fixup_checkpoint(after, command="mxforge fixup (conformance)")
            cases += [Case(f"{size}/{style}", before), Case(f"{size}/{style}/fixed", after)]
    return cases


def keep_source_recipes(family: Family) -> list[str]:
    """The family's recipes that keep FP8 weights as the source stores them: their output differs from the default's
    only on an FP8 source (conftest's family_cases runs them on the FP8 release's replica)."""
    return [r for r in family.recipes if load_recipe(r).keeps_source_weights]


def bf16_recipes(family: Family) -> list[str]:
    """The family's recipes whose output on a bf16 source is their own (every recipe but keep_source_recipes)."""
    return [r for r in family.recipes if r not in keep_source_recipes(family)]


def _regex_mtp(src: Path, out: Path, prefix: str, shared: str, proj: str) -> None:
    write_quark_like(src, out, BASE + [f"*{prefix}{shared}*", f"*{proj}"])
    _edit_qc(
        out,
        lambda qc: qc.update(
            exclude=[e for e in qc["exclude"] if not (e.startswith(prefix) or e == proj)]
            + ["re:" + re.escape(prefix) + rf"(self_attn\..*|{re.escape(shared)}\..*)$", "re:" + re.escape(proj) + "$"]
        ),
    )


def _edit_qc(out: Path, edit) -> None:
    config = json.loads((out / "config.json").read_text())
    edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _layer_config_mtp(src: Path, out: Path, prefix: str, shared: str, proj: str) -> None:
    groups = [f"*{prefix}self_attn*", f"*{prefix}{shared}*", f"*{proj}"]
    write_quark_like(src, out, BASE + groups[1:])

    def edit(qc: dict) -> None:
        qc["exclude"] = [e for e in qc["exclude"] if not (e.startswith(prefix) or e == proj)]
        qc["layer_quant_config"] = {g: dict(NULL_LAYER_CONFIG) for g in groups}

    _edit_qc(out, edit)


def _fused_names(src: Path, out: Path, family: Family) -> None:
    """Every excluded shard group replaced by the fused module's names (every release's of the family: sglang's
    `fused_qkv_a_proj_with_mqa`, vLLM's `fused_qkv_a_proj`)."""
    from mxforge.validation.profiles import all_profiles

    write_quark_like(src, out, BASE + ["*linear_attn.in_proj*"])
    fused: dict[str, list[str]] = {}
    for profile in all_profiles(family):
        for name, shards in profile.fused.items():
            fused.setdefault(shards[0], [])
            fused[shards[0]] += [] if name in fused[shards[0]] else [name]
            for shard in shards[1:]:
                fused.setdefault(shard, [])

    def edit(qc: dict) -> None:
        entries = []
        for e in qc["exclude"]:
            head, _, proj = e.rpartition(".")
            entries += [f"{head}.{f}" for f in fused[proj]] if proj in fused else [e]
        qc["exclude"] = entries

    _edit_qc(out, edit)


def _layer_entry(src: Path, out: Path, whole_mtp: str, prefix: str) -> None:
    write_quark_like(src, out, BASE + [whole_mtp])
    _edit_qc(out, lambda qc: qc["exclude"].append(prefix[:-1]))


def _pinned_experts(src: Path, out: Path, recipe: str) -> None:
    recipe_export(src, out, recipe)
    layout = _layout(src)
    experts = int(layout["n_routed_experts"])
    prefix = layout.layer_prefix(first_moe_layer(src))

    def edit(qc: dict) -> None:
        spec = json.loads(json.dumps(qc["global_quant_config"]))
        qc["layer_quant_config"] = {
            f"{prefix}mlp.experts.{k}.{p}": spec for k in range(experts) for p in ("gate_proj", "up_proj", "down_proj")
        }
        qc["global_quant_config"]["input_tensors"] = None

    _edit_qc(out, edit)


def _weights_only(src: Path, out: Path, recipe: str) -> None:
    recipe_export(src, out, recipe)
    _edit_qc(out, lambda qc: qc["global_quant_config"].update(input_tensors=None))


def _mxfp6(src: Path, out: Path) -> None:
    recipe = out.with_name(out.name + ".toml")
    recipe.write_text(MXFP6_RECIPE)
    recipe_export(src, out, str(recipe))


def _weights_only_layers(src: Path, out: Path, recipe: str) -> None:
    recipe_export(src, out, recipe)

    def edit(qc: dict) -> None:
        for config in qc["layer_quant_config"].values():
            config["input_tensors"] = None

    _edit_qc(out, edit)


def views(profile: EngineProfile, loaded) -> list[EngineView]:
    """The release as served by default, and, where it fuses shared experts, with fusion switched off."""
    qc = loaded.ckpt.quantization_config or {}
    view = engine_view(profile, loaded.layout, loaded.linears, qc.get("exclude", []), qc)
    return [view, without_fusion(view, loaded.layout, loaded.linears)] if view.fused else [view]


def stand_ins(layout: MoeLayout) -> frozenset[int]:
    """The dense layers that stand in for the real layout's MoE layers (fixture_args): those between the first
    dense layer and the last, except any whose index leads an MTP layer's (`layers.7` of `layers.78`: an engine
    that matches by prefix confuses the two). Their modules are the first dense layer's under other indices, and
    the release builds them all the same; only their decisions go unasked. Asking them was most of a probe's
    work: of the target modules asked per release in the four families' real-layout cases, 41,760 before, 3,120
    after (glm_moe_dsa: 12,288 -> 816). The sglang 0.5.23 probe spent 17 of its 36 s under cProfile deciding them;
    it now runs in 9.5 s (unprofiled)."""
    dense = [n for n in layout.all_layers if not layout.is_mtp(n) and not layout.is_moe(n)]
    return frozenset(n for n in dense[1:-1] if not any(str(m).startswith(str(n)) for m in layout.mtp_layers))


def compared(module, stand_in: frozenset[int], proj: str = "eh_proj") -> bool:
    """Whether the probe is asked for a module's decision and mxforge's is compared with it (eh_proj is
    answered on its own)."""
    if not module.quantizable or (module.is_mtp and module.local == proj):
        return False
    return module.layer not in stand_in


def asked(profile: EngineProfile, loaded) -> dict[str, list[list[str]]]:
    """The modules whose decision the probe is asked for, per role."""
    out: dict[str, dict[str, str]] = {TARGET: {}, DRAFT: {}}
    stand_in = stand_ins(loaded.layout)
    for view in views(profile, loaded):
        for m in view.modules:
            if compared(m, stand_in, loaded.layout.MTP_PROJ):
                out[m.role][m.runtime] = probe_io.EXPERTS if m.is_experts else probe_io.LINEAR
    return {role: [[p, k] for p, k in sorted(mods.items())] for role, mods in out.items()}


def request(profile: EngineProfile, case: Case, loaded) -> dict:
    hints = probe_hints(loaded.layout.family, loaded.layout)
    return {"name": case.name, "config": loaded.ckpt.config, **asked(profile, loaded), **hints}


def _form(decision: str) -> str:
    found = probe_io.form(decision)
    return found if found in (probe_io.MXFP4, probe_io.BF16, probe_io.REQUANTIZED, "error") else found.split(":")[0]


def _mine(view: EngineView, module, emulation: bool | None = False) -> str:
    """mxforge's decision in `_form`'s terms, marked ":emulated" where the release computes it by emulation (unless
    `emulation` is None: the release's own answer did not measure it)."""
    verdict = decide(view, module)
    if verdict.requantized:
        return probe_io.REQUANTIZED
    mine = {BF16: probe_io.BF16, None: "error", OTHER: "other"}.get(verdict.form, verdict.form)
    return mine + probe_io.EMULATED if verdict.emulated and emulation is not None else mine


def _theirs(decision: str) -> str:
    """The release's decision in `_form`'s terms, marked ":emulated" where it measured emulation."""
    return _form(decision) + (probe_io.EMULATED if probe_io.emulation(decision) else "")


def mismatches(profile: EngineProfile, loaded, answer: dict) -> list[str]:
    """Every way mxforge's reading of `profile` differs from the release's own answer for one checkpoint."""
    if "error" in answer:
        return [f"the probe failed: {answer['error'].strip().splitlines()[-1]}"]
    out = []
    every_view = views(profile, loaded)
    view = every_view[0]
    t, d = answer[TARGET], answer[DRAFT]
    layer = loaded.layout.mtp_layers[0] if loaded.layout.mtp_layers else None
    stand_in = stand_ins(loaded.layout)

    def expect(what: str, ours, theirs) -> None:
        if ours != theirs:
            out.append(f"{what}: mxforge {ours!r}, engine {theirs!r}")

    expect("draft class", profile.draft.class_name, d["class"])
    for role, a in ((TARGET, t), (DRAFT, d)):
        if a.get("unbuilt"):  # probes that build the model say which asked-for modules it never builds
            out.append(f"{role} modules the release never builds: {', '.join(a['unbuilt'][:4])}")
    for role, a in ((TARGET, t), (DRAFT, d)):
        expect(
            f"{role} packed-module mapping",
            sorted(profile.packed_mapping(role == DRAFT)),
            sorted(a["packed_modules_mapping"]),
        )
        expect(f"{role} shared-expert fusion", int(role in view.fused), a["fused_shared_experts"])
    if layer is not None:
        # where sglang's draft block is a whole one-layer text model (probe_hints), our block is its layer 0
        block = d["block_prefix"] + (
            ".layers.0" if loaded.layout.family.name in DRAFT_BLOCK_CLASSES and profile.engine == "sglang" else ""
        )
        expect("draft block prefix", profile.draft.block_prefix.format(layer=layer), block)
        expect("whole draft quantized", not view.roles[DRAFT].unquantized, d["block_quantized"])
        eh = next((m for m in view.modules if m.is_mtp and m.local == loaded.layout.MTP_PROJ), None)
        if eh is not None:
            expect("eh_proj prefix", eh.runtime, d["eh_proj"]["prefix"] or eh.runtime)
            expect("eh_proj decision", _mine(view, eh), _form(d["eh_proj"]["decision"]))
    for v in every_view:
        for m in v.modules:
            if not compared(m, stand_in, loaded.layout.MTP_PROJ):
                continue
            theirs = (t if m.role == TARGET else d)["decisions"].get(m.runtime)
            emulation = probe_io.emulation(theirs) if theirs else False
            expect(f"{m.role} {m.runtime}", _mine(v, m, emulation), _theirs(theirs) if theirs else None)
    return out
