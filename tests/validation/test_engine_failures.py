"""Each failure class of engines.md, rebuilt on Quark-format checkpoints: validate names it per engine release
range, and fixup cures it (or says plainly that only re-quantizing, or a serving flag, can).

The release behaviours these expectations rest on are proven against each release's own code in
test_engine_conformance.py; these tests run offline.
"""

import json

import pytest
from helpers import AMD, BASE, BEFORE_GLM_DRAFT, EH_PROJ_LINEAR, GLM5, MTP, NO_EXPERT_CHILD_RULE
from quark_like import write_quark_like

from mxforge.errors import ConfigError
from mxforge.fixups.fixup import fixup_checkpoint
from mxforge.validation.profiles import all_profiles, parse_engines_arg, select
from mxforge.validation.validate import validate_checkpoint

PROFILES = [p.name for p in all_profiles(GLM5)]


@pytest.fixture
def export(tiny_ckpt, tmp_path):
    def make(patterns, **kw):
        out = tmp_path / f"q{len(list(tmp_path.iterdir()))}"
        write_quark_like(tiny_ckpt, out, patterns, **kw)
        return out

    return make


def subjects(report, engine=None):
    return {p.subject for p in report.problems if engine is None or p.engine == engine}


def failing(path, engines=None):
    report = validate_checkpoint(path, engines)
    return {s.profile.name for s in report.selections if not report.engine_ok(s.profile.name)}


def set_exclude(path, edit):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["exclude"] = edit(config["quantization_config"]["exclude"])
    (path / "config.json").write_text(json.dumps(config, indent=2))


def test_mtp_exclusions_miss_the_draft_before_sglang_0_5_16_and_fixup_cures(export):
    ckpt = export(AMD)
    report = validate_checkpoint(ckpt)
    assert failing(ckpt) == BEFORE_GLM_DRAFT
    assert report.verdict().startswith(  # 0.5.9 and 0.5.10 fail alike: one range
        "loads: sglang 0.5.16-0.5.23, vllm 0.30.0-0.33.0; FAILS: sglang 0.5.9-0.5.10.post1 ("
    )
    old = {p.subject: p for p in report.problems if p.engine == "sglang-0.5.11"}
    for name in (
        "model.decoder.mlp.shared_experts.gate_up_proj",
        "model.decoder.self_attn.fused_qkv_a_proj_with_mqa",
        "model.decoder.mlp.experts",
        "model.eh_proj",
        "model.decoder.self_attn.o_proj",
    ):
        assert name in old, name
    assert old["model.decoder.mlp.shared_experts.gate_up_proj"].format() == (
        "sglang-0.5.11: model.decoder.mlp.shared_experts.gate_up_proj: would be MXFP4 (uint8 [256, 128]) "
        "but the checkpoint "
        f"holds bf16 [128, 256] x2 under model.layers.{MTP}.mlp.shared_experts.{{gate,up}}_proj: run mxforge fixup"
    )
    # 0.5.9 and 0.5.10 do not expand gate_up_proj into its shards: the dense MLPs need their fused name too.
    assert "model.layers.0.mlp.gate_up_proj" in subjects(report, "sglang-0.5.9")
    assert "model.layers.0.mlp.gate_up_proj" not in subjects(report, "sglang-0.5.11")

    result = fixup_checkpoint(ckpt)
    added = {a["entry"] for a in result.applied}
    # Shard names for releases that ignore fused names in exclude, fused names for those that read them.
    assert {
        "model.decoder.self_attn.q_a_proj",
        "model.decoder.self_attn.kv_a_proj_with_mqa",
        "model.decoder.mlp.shared_experts.gate_proj",
        "model.decoder.mlp.shared_experts.up_proj",
        "model.decoder.self_attn.fused_qkv_a_proj_with_mqa",
        "model.decoder.mlp.experts",
        "model.eh_proj",
        "model.layers.0.mlp.gate_up_proj",
        f"model.layers.{MTP}.self_attn.fused_qkv_a_proj",
        f"model.layers.{MTP}.mlp.experts",
    } <= added
    assert not result.remaining and not failing(ckpt)
    assert not fixup_checkpoint(ckpt).changed


@pytest.mark.parametrize("profile", PROFILES)
def test_fixup_for_one_release_range_touches_only_the_draft_or_what_it_needs(export, profile):
    ckpt = export(AMD)
    fixup_checkpoint(ckpt, profile)
    added = {a["entry"] for a in json.loads((ckpt / "mxforge_fixups.json").read_text())["fixups"]}
    draft = ("model.decoder.", "model.eh_proj") if profile.startswith("sglang") else (f"model.layers.{MTP}.",)
    dense_gate_up = {f"model.layers.{n}.mlp.gate_up_proj" for n in range(3)}  # 0.5.9-0.5.10 only
    assert all(e.startswith(draft) or e in dense_gate_up for e in added), added
    assert bool(added & dense_gate_up) is (profile in ("sglang-0.5.9", "sglang-0.5.10"))
    assert not failing(ckpt, profile)
    assert not fixup_checkpoint(ckpt, profile).changed


def test_quantized_eh_proj_cannot_load_where_eh_proj_is_a_plain_linear(export):
    # The write-up's export: MTP layer quantized except its shared expert; eh_proj quantized with it.
    ckpt = export(BASE + [f"model.layers.{MTP}.mlp.shared_experts.*"])
    report = validate_checkpoint(ckpt)
    assert failing(ckpt) == EH_PROJ_LINEAR | BEFORE_GLM_DRAFT
    problem = next(p for p in report.problems if p.engine == "vllm-0.31.0")
    assert problem.subject == f"model.layers.{MTP}.eh_proj" and "never quantizes eh_proj" in problem.message
    assert "re-quantize" in problem.remedy
    result = fixup_checkpoint(ckpt)
    assert {p.engine for p in result.remaining} == EH_PROJ_LINEAR
    assert failing(ckpt) == EH_PROJ_LINEAR


def test_bf16_eh_proj_needs_model_eh_proj_where_it_is_quantizable_and_not_remapped(export):
    ckpt = export(BASE + ["*eh_proj"])  # (*self_attn* keeps the MTP layer's attention bf16 too)
    report = validate_checkpoint(ckpt)
    assert "model.eh_proj" in subjects(report, "sglang-0.5.11")
    for profile in EH_PROJ_LINEAR | {"sglang-0.5.16", "sglang-0.5.22"}:  # never quantized, or remapped
        assert "model.eh_proj" not in subjects(report, profile) and f"model.layers.{MTP}.eh_proj" not in subjects(
            report, profile
        )
    fixup_checkpoint(ckpt)
    assert "model.eh_proj" in json.loads((ckpt / "config.json").read_text())["quantization_config"]["exclude"]
    assert not failing(ckpt)


def test_per_expert_excludes_need_the_fused_experts_name_where_children_do_not_count(export):
    ckpt = export(AMD + ["model.layers.3.mlp.experts.*"])
    report = validate_checkpoint(ckpt)
    assert failing(ckpt) == NO_EXPERT_CHILD_RULE | BEFORE_GLM_DRAFT
    old = {p.subject: p for p in report.problems if p.engine == "sglang-0.5.19"}
    assert "w13_weight [8, 256, 128]" in old["model.layers.3.mlp.experts"].message
    added = {a["entry"] for a in fixup_checkpoint(ckpt).applied}
    assert "model.layers.3.mlp.experts" in added and not any(e.startswith("model.layers.4") for e in added)
    assert not failing(ckpt)


def test_one_bf16_expert_among_mxfp4_ones_is_reported_not_fixed(export):
    ckpt = export(AMD + ["model.layers.3.mlp.experts.0.*"])
    report = validate_checkpoint(ckpt)
    for profile in PROFILES:
        assert "model.layers.3.mlp.experts" in subjects(report, profile), profile
    vllm = next(p for p in report.problems if p.engine == "vllm-0.31.0")
    assert "different formats" in vllm.message and "re-quantize" in vllm.remedy
    result = fixup_checkpoint(ckpt)
    assert {p.engine for p in result.remaining if p.subject == "model.layers.3.mlp.experts"} == set(PROFILES)


def test_fused_shards_that_disagree_in_exclude_are_cured_by_naming_every_shard(export):
    ckpt = export(AMD)
    set_exclude(ckpt, lambda ex: [e for e in ex if e != "model.layers.0.self_attn.kv_a_proj_with_mqa"])
    report = validate_checkpoint(ckpt)
    for profile in PROFILES:
        (p,) = [p for p in report.problems if p.engine == profile and ".layers.0.self_attn" in p.subject]
        assert p.subject.startswith("model.layers.0.self_attn.fused_qkv_a_proj")
        assert "Found different quantization schemes" in p.message and "mxforge fixup" in p.remedy
    added = {a["entry"] for a in fixup_checkpoint(ckpt).applied if ".layers.0.self_attn" in a["entry"]}
    # The missing shard cures every release (vLLM's fused name is then not needed).
    assert added == {
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa",
    }
    assert not failing(ckpt)


def test_fused_shards_stored_differently_are_reported_not_fixed(export):
    ckpt = export(["*q_a_proj", "*mlp.gate", "*lm_head", "*indexer*"])
    report = validate_checkpoint(ckpt)
    for profile in PROFILES:
        assert any(
            "re-quantize" in p.remedy and "fused_qkv_a_proj" in p.subject
            for p in report.problems
            if p.engine == profile
        ), profile
    assert fixup_checkpoint(ckpt).remaining


def test_glob_entries_match_nothing_until_rewritten(export):
    ckpt = export(AMD, glob_exclude=True)
    report = validate_checkpoint(ckpt)
    assert failing(ckpt) == set(PROFILES)
    globs = [p for p in report.problems if p.check == "quant_config"]
    assert len(globs) == 7 and "'*self_attn*' is a glob" in globs[0].message
    assert "model.layers.0.self_attn.q_b_proj" in subjects(report, "vllm-0.31.0")
    assert any("glob" in n for n in report.notes)
    result = fixup_checkpoint(ckpt)
    assert sum("is a glob" in w for w in result.warnings) == 7 and "'*self_attn*'" in result.warnings[0]
    exclude = json.loads((ckpt / "config.json").read_text())["quantization_config"]["exclude"]
    assert not any("*" in e for e in exclude) and "model.layers.0.self_attn.q_b_proj" in exclude
    assert validate_checkpoint(ckpt).ok


def test_export_without_the_mtp_layer(export):
    ckpt = export(AMD, drop_layers=(MTP,))
    report = validate_checkpoint(ckpt)
    (mtp,) = [p for p in report.problems if p.check == "mtp"]
    assert mtp.subject == f"model.layers.{MTP}" and "--mtp-from" in mtp.remedy
    assert failing(ckpt) == set(PROFILES)
    assert any("MTP layer 7 is missing" in n for n in report.notes)
    assert [p.check for p in fixup_checkpoint(ckpt).remaining] == ["mtp"]


def test_doctor_says_what_kind_of_export_it_is(export):
    notes = validate_checkpoint(export(AMD)).notes
    assert (
        any("exact module name" in n for n in notes)
        and f"MTP layer {MTP} is entirely bf16 (37 linear weights)" in notes
    )
    notes = validate_checkpoint(export(BASE)).notes
    assert any(n.startswith(f"MTP layer {MTP}:") and "MXFP4" in n for n in notes)


def test_quantized_router_and_indexer_weights_are_named(export):
    ckpt = export(["*lm_head", "*q_a_proj", "*kv_a_proj_with_mqa"])  # routers and the indexer quantized
    report = validate_checkpoint(ckpt)
    for profile in PROFILES:
        assert "model.layers.3.mlp.gate" in subjects(report, profile)
    for profile in ("sglang-0.5.11", "sglang-0.5.22"):  # sglang builds weights_proj unquantized, wk quantizable
        assert "model.layers.0.self_attn.indexer.weights_proj" in subjects(report, profile)
        assert "model.layers.0.self_attn.indexer.wk" not in subjects(report, profile)
    for profile in ("vllm-0.30.0", "vllm-0.31.0"):  # vLLM fuses them into one unquantized wk_weights_proj
        assert "model.layers.0.self_attn.indexer.wk_weights_proj" in subjects(report, profile)


def test_weights_only_mxfp4_loads_in_vllm_but_no_sglang(export):
    ckpt = export(AMD)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["global_quant_config"]["input_tensors"] = None  # recipe scheme w_mxfp4
    (ckpt / "config.json").write_text(json.dumps(config))
    fixup_checkpoint(ckpt)
    report = validate_checkpoint(ckpt)
    assert failing(ckpt) == {p for p in PROFILES if p.startswith("sglang")}
    problem = next(
        p for p in report.problems if p.engine == "sglang-0.5.22" and p.subject == "model.layers.3.mlp.experts"
    )
    assert "No quark compatible scheme" in problem.message


def test_layer_configs_that_quantize_nothing_need_exclusions(export):
    ckpt = export(BASE + [f"*layers.{MTP}.mlp.shared_experts*", f"*layers.{MTP}.eh_proj"])
    config = json.loads((ckpt / "config.json").read_text())
    qc = config["quantization_config"]
    qc["exclude"] = [e for e in qc["exclude"] if not e.startswith(f"model.layers.{MTP}.")]
    null = {"weight": None, "input_tensors": None, "output_tensors": None, "bias": None, "target_device": None}
    qc["layer_quant_config"] = {f"*layers.{MTP}.self_attn*": null, f"*layers.{MTP}.mlp.shared_experts*": null}
    (ckpt / "config.json").write_text(json.dumps(config))
    report = validate_checkpoint(ckpt)
    vllm = subjects(report, "vllm-0.31.0")  # vLLM keeps checkpoint names: the pattern matches, the scheme is empty
    assert f"model.layers.{MTP}.self_attn.o_proj" in vllm
    assert any("quantizes nothing" in p.message for p in report.problems if p.engine == "vllm-0.31.0")
    assert fixup_checkpoint(ckpt).remaining == [] and not failing(ckpt)


@pytest.mark.slow
def test_shared_expert_fusion_at_256_experts(full_layout_ckpt, tmp_path):
    """GLM-5.2's 256 experts open the fusion gate: the bf16 MTP shared expert cannot join an MXFP4 bank."""
    ckpt = tmp_path / "q"
    mtp = 78
    write_quark_like(full_layout_ckpt, ckpt, BASE + [f"*layers.{mtp}.mlp.shared_experts*", f"*layers.{mtp}.eh_proj"])
    report = validate_checkpoint(ckpt)
    fused = {p.engine for p in report.requirements if "shared-expert fusion" in p.message}
    assert fused == {
        "sglang-0.5.9",
        "sglang-0.5.10",
        "sglang-0.5.11",
        "sglang-0.5.12",
        "sglang-0.5.15",
        "sglang-0.5.22",
    }
    assert "serve with --disable-shared-experts-fusion (no exclude entry" in next(
        p.remedy for p in report.requirements if p.engine == "sglang-0.5.11"
    )
    fixup_checkpoint(ckpt)
    report = validate_checkpoint(ckpt)
    assert report.ok, report.format()
    # An exclusion now vetoes the fusion from 0.5.18 on; before that only the server flag avoids it.
    assert {p.engine for p in report.requirements} == {
        "sglang-0.5.9",
        "sglang-0.5.10",
        "sglang-0.5.11",
        "sglang-0.5.12",
        "sglang-0.5.15",
    }
    assert "sglang 0.5.9-0.5.15.post1 (with --disable-shared-experts-fusion)" in report.verdict()
    serve = {s["releases"]: s for s in report.serve}
    assert serve["sglang 0.5.9-0.5.15.post1"]["command"].endswith(" --disable-shared-experts-fusion")
    assert "--disable-shared-experts-fusion" not in serve["sglang 0.5.16-0.5.23"]["command"]


@pytest.mark.slow
def test_deepseek_v32_draft_decides_its_own_fusion_from_sglang_0_5_18(fixture_ckpt, tmp_path):
    """DeepSeek-V3.2's target never fuses its shared expert. Up to sglang 0.5.17 that refusal reaches its draft (built
    next, in the same process); from 0.5.18 the draft's own gate decides, and at 256 experts it appends the MTP shared
    expert to the routed-expert bank unless an exclude entry vetoes it. An export that keeps the MTP shared expert bf16
    through layer_quant_config (no exclude entry names it) needs the flag there; fixup's entries veto the fusion."""
    src, ckpt, mtp = fixture_ckpt("full-layout", "deepseek_v32")[0], tmp_path / "q", 61
    shared = f"*layers.{mtp}.mlp.shared_experts*"
    write_quark_like(src, ckpt, BASE + [shared, f"*layers.{mtp}.eh_proj", "*embed_tokens", "*shared_head.head"])
    config = json.loads((ckpt / "config.json").read_text())
    qc = config["quantization_config"]
    qc["exclude"] = [e for e in qc["exclude"] if ".shared_experts." not in e]
    qc["layer_quant_config"] = {shared: {"weight": None, "input_tensors": None, "output_tensors": None, "bias": None}}
    (ckpt / "config.json").write_text(json.dumps(config))
    report = validate_checkpoint(ckpt, "sglang")
    fused = {p.engine for p in report.requirements if "shared-expert fusion" in p.message}
    assert fused == {"sglang-0.5.18", "sglang-0.5.19", "sglang-0.5.21", "sglang-0.5.22"}, report.format()
    fixup_checkpoint(ckpt)
    report = validate_checkpoint(ckpt, "sglang")
    assert report.ok and not report.requirements, report.format()
    assert any(
        e.startswith("model.decoder.mlp.shared_experts.")
        for e in json.loads((ckpt / "config.json").read_text())["quantization_config"]["exclude"]
    )


def test_index_total_size_is_a_warning_that_fixup_repairs(export):
    ckpt = export(AMD)
    fixup_checkpoint(ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    right = index["metadata"]["total_size"]
    index["metadata"]["total_size"] = right + 12345  # Quark's file-to-file counts whole files
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    report = validate_checkpoint(ckpt)
    assert report.ok and [w.subject for w in report.warnings] == ["model.safetensors.index.json:metadata.total_size"]
    assert [a["fixup"] for a in fixup_checkpoint(ckpt).applied] == ["index_total_size"]
    assert json.loads((ckpt / "model.safetensors.index.json").read_text())["metadata"]["total_size"] == right
    assert not validate_checkpoint(ckpt).warnings


def test_engines_selection_by_name_range_and_version():
    def picked(text):
        return {(s.profile.name, r) for s in select(text, GLM5) for r in s.releases}

    assert picked("sglang==0.5.15.post1") == {("sglang-0.5.15", "0.5.15.post1")}
    assert {p for p, _ in picked("sglang>=0.5.16,<0.5.21")} == {"sglang-0.5.16", "sglang-0.5.18", "sglang-0.5.19"}
    assert picked("vllm>=0.32") == {("vllm-0.31.0", "0.32.0"), ("vllm-0.31.0", "0.33.0")}
    assert picked("sglang-0.5.22, vllm") == picked("sglang-0.5.22 vllm") == picked("sglang==0.5.22 sglang==0.5.23 vllm")
    assert len(picked(None)) == sum(len(p.read) for p in all_profiles(GLM5))
    assert parse_engines_arg("sglang,vllm") == ["sglang", "vllm"]
    for bad, says in (
        ("sglang==0.5.24", "matches no supported sglang release"),
        ("trt-llm", "is not an engine"),
        ("sglang>>1", "not a version specifier"),
    ):
        with pytest.raises(ConfigError, match=says):
            select(bad, GLM5)


def test_an_entry_that_would_harm_a_right_decision_is_detected(export):
    """fixup's guard: an entry that makes any release build an MXFP4-stored module bf16 is named."""
    from mxforge.fixups.fixup import harmed_modules
    from mxforge.validation.loaded import load_checkpoint

    loaded = load_checkpoint(export(AMD))[0]
    qc = loaded.ckpt.quantization_config
    before = qc["exclude"]
    harmed = harmed_modules(loaded, all_profiles(GLM5), before, before + ["model.layers.3.mlp.experts"], qc)
    assert {profile for profile, module in harmed if module == "model.layers.3.mlp.experts"} == set(PROFILES)
    assert not harmed_modules(loaded, all_profiles(GLM5), before, before + ["model.decoder.self_attn.o_proj"], qc)
