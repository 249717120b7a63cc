"""Each failure class of engines.md, rebuilt on a Quark-format checkpoint: validate names it per engine
profile, and fixup cures it (or says plainly that only re-quantizing can)."""

import json

import pytest

from mxforge.fixups.fixup import fixup_checkpoint
from mxforge.fixups.profiles import PROFILE_NAMES
from mxforge.fixups.quark_like import write_quark_like
from mxforge.fixups.validate import validate_checkpoint

MTP = 7  # the tiny fixture's num_hidden_layers
# AMD's published GLM-5.2 MXFP4 exclusions (glm-5.2.md): attention, routers, lm_head, dense MLPs ...
BASE = ["*self_attn*", "*mlp.gate", "*lm_head", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj"]
AMD = BASE + [f"*layers.{MTP}.*"]  # ... and the whole MTP layer


@pytest.fixture
def export(tiny_ckpt, tmp_path):
    def make(patterns, **kw):
        out = tmp_path / f"q{len(list(tmp_path.iterdir()))}"
        write_quark_like(tiny_ckpt, out, patterns, **kw)
        return out
    return make


def subjects(report, engine=None):
    return {p.subject for p in report.problems if engine is None or p.engine == engine}


def verdicts(path):
    return {e: validate_checkpoint(path, [e]).ok for e in PROFILE_NAMES}


def set_exclude(path, edit):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["exclude"] = edit(config["quantization_config"]["exclude"])
    (path / "config.json").write_text(json.dumps(config, indent=2))


def test_mtp_prefixes_break_legacy_sglang_only_and_fixup_cures(export):
    ckpt = export(AMD)
    report = validate_checkpoint(ckpt)
    assert report.engines == list(PROFILE_NAMES)
    assert report.as_dict()["engines"] == {"sglang-legacy": False, "sglang": True, "vllm": True}
    legacy = {p.subject: p for p in report.problems if p.engine == "sglang-legacy"}
    for name in ("model.decoder.mlp.shared_experts.gate_up_proj", "model.decoder.self_attn.fused_qkv_a_proj_with_mqa",
                 "model.decoder.mlp.experts", "model.eh_proj", "model.decoder.self_attn.o_proj"):
        assert name in legacy, name
    p = legacy["model.decoder.mlp.shared_experts.gate_up_proj"]
    assert p.format() == ("sglang-legacy: model.decoder.mlp.shared_experts.gate_up_proj: would be MXFP4 (uint8 [128, 128]) "
                          "but the checkpoint holds bf16 [64, 256] x2 under "
                          f"model.layers.{MTP}.mlp.shared_experts.{{gate,up}}_proj: run mxforge fixup")
    assert "bf16 [256, 512]" in legacy["model.eh_proj"].message
    result = fixup_checkpoint(ckpt)
    added = {a["entry"] for a in result.applied}
    assert {"model.decoder.mlp.experts", "model.eh_proj", "model.decoder.mlp.shared_experts.gate_up_proj",
            "model.decoder.self_attn.fused_qkv_a_proj_with_mqa", f"model.layers.{MTP}.self_attn.fused_qkv_a_proj",
            f"model.layers.{MTP}.mlp.experts"} <= added
    assert not any(e.startswith("model.decoder.") and "layers" in e for e in added)
    assert not result.remaining
    assert verdicts(ckpt) == {e: True for e in PROFILE_NAMES}


@pytest.mark.parametrize("engine", PROFILE_NAMES)
def test_fixup_for_one_profile_adds_only_what_it_needs(export, engine):
    ckpt = export(AMD)
    assert validate_checkpoint(ckpt, [engine]).ok is (engine != "sglang-legacy")
    result = fixup_checkpoint(ckpt, [engine])
    added = {a["entry"] for a in result.applied}
    if engine == "vllm":
        assert added and all(e.startswith(f"model.layers.{MTP}.") for e in added)
    elif engine == "sglang":  # 0.5.23 remaps model.layers.N.* itself; only the fused names are not in the list
        assert added == {"model.decoder.mlp.shared_experts.gate_up_proj", "model.decoder.self_attn.fused_qkv_a_proj_with_mqa"}
    else:
        assert "model.eh_proj" in added and all(e.startswith("model.") and "layers" not in e for e in added)
    assert validate_checkpoint(ckpt, [engine]).ok
    assert not fixup_checkpoint(ckpt, [engine]).changed


def test_quantized_eh_proj_cannot_load_in_vllm(export):
    # The Wafer-style export: MTP layer quantized except its shared expert; eh_proj quantized with it.
    ckpt = export(BASE + [f"model.layers.{MTP}.mlp.shared_experts.*"])
    report = validate_checkpoint(ckpt)
    assert report.as_dict()["engines"] == {"sglang-legacy": False, "sglang": True, "vllm": False}
    vllm = {p.subject: p for p in report.problems if p.engine == "vllm"}
    assert set(vllm) == {f"model.layers.{MTP}.eh_proj"}
    assert "vllm never quantizes eh_proj" in vllm[f"model.layers.{MTP}.eh_proj"].message
    assert "re-quantize" in vllm[f"model.layers.{MTP}.eh_proj"].remedy
    result = fixup_checkpoint(ckpt)
    assert [p.engine for p in result.remaining] == ["vllm"]
    assert verdicts(ckpt) == {"sglang-legacy": True, "sglang": True, "vllm": False}


def test_bf16_eh_proj_needs_model_eh_proj_for_sglang(export):
    ckpt = export(BASE + ["*eh_proj"])
    report = validate_checkpoint(ckpt)  # (*self_attn* keeps the MTP layer's attention bf16 too)
    assert "model.eh_proj" in subjects(report, "sglang-legacy")
    assert subjects(report, "sglang") == set() and subjects(report, "vllm") == set()  # 0.5.23 remaps it
    fixup_checkpoint(ckpt)
    assert "model.eh_proj" in json.loads((ckpt / "config.json").read_text())["quantization_config"]["exclude"]
    assert verdicts(ckpt) == {e: True for e in PROFILE_NAMES}


def test_per_expert_excludes_vs_fused_experts(export):
    ckpt = export(AMD + ["model.layers.3.mlp.experts.*"])
    report = validate_checkpoint(ckpt)
    legacy = {p.subject: p for p in report.problems if p.engine == "sglang-legacy"}
    assert "w13_weight [8, 128, 128]" in legacy["model.layers.3.mlp.experts"].message
    assert subjects(report, "sglang") == subjects(report, "vllm") == set()
    added = {a["entry"] for a in fixup_checkpoint(ckpt).applied}
    assert "model.layers.3.mlp.experts" in added and not any(e.startswith("model.layers.4") for e in added)
    assert verdicts(ckpt) == {e: True for e in PROFILE_NAMES}


def test_one_bf16_expert_among_mxfp4_ones_is_reported_not_fixed(export):
    ckpt = export(AMD + ["model.layers.3.mlp.experts.0.*"])
    report = validate_checkpoint(ckpt)
    for engine in PROFILE_NAMES:
        assert "model.layers.3.mlp.experts" in subjects(report, engine), engine
    vllm = next(p for p in report.problems if p.engine == "vllm")
    assert "different formats" in vllm.message and "re-quantize" in vllm.remedy
    result = fixup_checkpoint(ckpt)
    assert {p.engine for p in result.remaining if p.subject == "model.layers.3.mlp.experts"} == set(PROFILE_NAMES)


def test_fused_shards_that_disagree_in_exclude_are_cured_by_the_fused_name(export):
    ckpt = export(AMD)
    set_exclude(ckpt, lambda ex: [e for e in ex if e != "model.layers.0.self_attn.kv_a_proj_with_mqa"])
    report = validate_checkpoint(ckpt)
    for engine in PROFILE_NAMES:
        (p,) = [p for p in report.problems if p.engine == engine and ".layers.0." in p.subject]
        assert p.subject.startswith("model.layers.0.self_attn.fused_qkv_a_proj")
        assert "Found different quantization schemes" in p.message and "mxforge fixup" in p.remedy
    added = {a["entry"] for a in fixup_checkpoint(ckpt).applied if ".layers.0." in a["entry"]}
    assert added == {"model.layers.0.self_attn.fused_qkv_a_proj_with_mqa", "model.layers.0.self_attn.fused_qkv_a_proj"}
    assert verdicts(ckpt) == {e: True for e in PROFILE_NAMES}


def test_fused_shards_stored_differently_are_reported_not_fixed(export):
    ckpt = export(["*q_a_proj", "*mlp.gate", "*lm_head", "*indexer*"])
    report = validate_checkpoint(ckpt)
    for engine in PROFILE_NAMES:
        assert any("Found different quantization schemes" in p.message and "re-quantize" in p.remedy
                   for p in report.problems if p.engine == engine)
    assert fixup_checkpoint(ckpt).remaining


def test_glob_entries_match_nothing_until_rewritten(export):
    ckpt = export(AMD, glob_exclude=True)
    report = validate_checkpoint(ckpt)
    assert not any(report.engine_ok(e) for e in PROFILE_NAMES)
    globs = [p for p in report.problems if p.check == "quant_config"]
    assert len(globs) == 7 and "'*self_attn*' is a glob" in globs[0].message
    assert "model.layers.0.self_attn.q_b_proj" in subjects(report, "vllm")
    assert any("glob" in n for n in report.notes)
    result = fixup_checkpoint(ckpt)
    assert len(result.warnings) == 7 and "'*self_attn*'" in result.warnings[0]
    exclude = json.loads((ckpt / "config.json").read_text())["quantization_config"]["exclude"]
    assert not any("*" in e for e in exclude) and "model.layers.0.self_attn.q_b_proj" in exclude
    assert validate_checkpoint(ckpt).ok


def test_export_without_the_mtp_layer(export):
    ckpt = export(AMD, drop_layers=(MTP,))
    report = validate_checkpoint(ckpt)
    (mtp,) = [p for p in report.problems if p.check == "mtp"]
    assert mtp.subject == f"model.layers.{MTP}" and "--mtp-from" in mtp.remedy
    assert not any(report.engine_ok(e) for e in PROFILE_NAMES)
    assert any("MTP layer 7 is missing" in n for n in report.notes)
    assert [p.check for p in fixup_checkpoint(ckpt).remaining] == ["mtp"]


def test_doctor_says_what_kind_of_export_it_is(export):
    notes = validate_checkpoint(export(AMD)).notes
    assert any("exact module name" in n for n in notes) and f"MTP layer {MTP} is entirely bf16 (37 linear weights)" in notes
    notes = validate_checkpoint(export(BASE)).notes
    assert any(n.startswith(f"MTP layer {MTP}:") and "MXFP4" in n for n in notes)


def test_quantized_router_and_weights_proj_are_named(export):
    ckpt = export(["*lm_head", "*q_a_proj", "*kv_a_proj_with_mqa"])  # routers and the indexer quantized
    report = validate_checkpoint(ckpt)
    for engine in PROFILE_NAMES:
        assert "model.layers.3.mlp.gate" in subjects(report, engine)
        assert "model.layers.0.self_attn.indexer.weights_proj" in subjects(report, engine)
    assert "model.layers.0.self_attn.indexer.wk" in subjects(report, "vllm")
    assert "model.layers.0.self_attn.indexer.wk" not in subjects(report, "sglang")
