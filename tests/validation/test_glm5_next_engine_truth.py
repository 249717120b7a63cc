"""What the sglang and vLLM releases that build GLM-5.3-Flash do with a Quark MXFP4 checkpoint of it, measured by
executing the first release of each profile range's own code (the engine-truth probes, tests/engine_truth/), target
and MTP draft: the map the `[family.glm5_next]` tables of manifests/engines/ were written from (the conformance suite
then judges every release against them on the whole matrix), pinned so a probe or release that answers otherwise
fails here.

The checkpoint config is transformers' own `Glm5NextConfig` at small sizes (three KDA linear-attention layers, one
indexed MLA layer, one dense and three sparse MLPs, a two-block vision tower, one MTP layer) with the fields the
engines' own config classes say the published checkpoint ships (`num_nextn_predict_layers`, `mla_use_nope`, mHC with
`topk_method` noaux_tc, `scoring_func` sigmoid, `indexer_rope_interleave`: derived, no published config.json can be
read here), and mxforge's Quark MXFP4 `quantization_config`. Each engine loads it through its own config class
(sglang's and vLLM 0.30-0.31's `Glm5NextConfig`, which the probes take from the release's config registry).
Exclude lists: `plain` (lm_head), `target` (plus a decoder o_proj under its checkpoint name), `mtp-stored` (plus
one routed expert and eh_proj of the MTP layer under their checkpoint names `model.language_model.layers.4.*`) and
`mtp-built` (the same under `model.layers.4.*`, where vLLM builds its draft). What they show, per release:

- vLLM's draft (Glm5NextMTP) builds the MTP layer as `model.layers.4` and reads exclude entries without remapping
  them: entries under the checkpoint's `model.language_model.layers.4.` name miss it (#24's bug, in vLLM), entries
  under `model.layers.4.` reach it; its eh_proj is a torch Linear (bf16 whatever the list says).
- sglang's draft (Glm5NextForConditionalGenerationNextN) builds it as `model.decoder`, with eh_proj a quantizable
  ReplicatedLinear at `model.eh_proj`.
- vLLM builds every attention linear (KDA and MLA, target and draft) and the vision tower without the quant config:
  bf16 whatever the list says (its loader dequantizes a source's FP8 there); sglang builds both with it: MXFP4
  unless excluded.
"""

from __future__ import annotations

import json

import pytest
from engine_truth import probe_io
from packaging.version import Version

from mxforge.validation.profiles import all_profiles

# One worker runs this module: its tests share `measured` (every release probed once, minutes), which each worker
# holding some of them would otherwise compute again.
pytestmark = [pytest.mark.engines, pytest.mark.xdist_group("test_glm5_next_engine_truth")]

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,  # layers 0-2 KDA linear attention, 3 indexed MLA (transformers' default layer_types)
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 32,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "vocab_size": 256,
    "pad_token_id": 250,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
}
PUBLISHED = {  # text_config fields the engines' config classes read as the checkpoint's (derived, see above)
    "num_nextn_predict_layers": 1,
    "mhc": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "mla_use_nope": True,
    "indexer_rope_interleave": True,
}
VISION = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "projection_intermediate_size": 64,
}
STORED = "model.language_model.layers."  # where the checkpoint keeps the text model's layers
MTP = 4
EXCLUDES = {
    "plain": ["lm_head"],
    "target": ["lm_head", f"{STORED}3.self_attn.o_proj"],
    "mtp-stored": ["lm_head", f"{STORED}{MTP}.mlp.experts.0.gate_proj", f"{STORED}{MTP}.eh_proj"],
    "mtp-built": ["lm_head", f"model.layers.{MTP}.mlp.experts.0.gate_proj", f"model.layers.{MTP}.eh_proj"],
}
# Runtime names: where each engine builds the text model's layers, the MTP block, and the fused modules
DECODER = {"sglang": "model.layers.", "vllm": "language_model.model.layers."}
DRAFT_BLOCK = {"sglang": "model.decoder", "vllm": f"model.layers.{MTP}"}
KDA_IN = {"sglang": "fused_qkvbfg_a_proj", "vllm": "in_proj_qkvbfg_a"}
MLA_A = {"sglang": "fused_qkv_a_proj_with_mqa", "vllm": "fused_qkv_a_proj"}


def _config() -> dict:
    from transformers import Glm5NextConfig

    from mxforge.quantize.recipe import load_recipe

    config = Glm5NextConfig(text_config={**TEXT, **PUBLISHED}, vision_config=VISION).to_dict()
    config["architectures"] = ["Glm5NextForConditionalGeneration"]
    # to_dict writes the text config's architectures as null; sglang's Glm5NextConfig copies that over the
    # top-level list, so a published file cannot carry it
    config["text_config"].pop("architectures", None)
    config["quantization_config"] = load_recipe("glm-5.2-mxfp4").quantization_config([])
    return config


def _cases(engine: str) -> list[dict]:
    d, b = DECODER[engine], DRAFT_BLOCK[engine]
    target = [
        [f"{d}0.self_attn.{KDA_IN[engine]}", probe_io.LINEAR],
        [f"{d}0.self_attn.o_proj", probe_io.LINEAR],
        [f"{d}3.self_attn.{MLA_A[engine]}", probe_io.LINEAR],
        [f"{d}3.self_attn.o_proj", probe_io.LINEAR],
        [f"{d}1.mlp.experts", probe_io.EXPERTS],
    ]
    if engine == "vllm":  # sglang records its vision stack (below); vLLM builds it
        target.append(["visual.blocks.0.attn.qkv", probe_io.LINEAR])
    draft = [
        [f"{b}.mlp.experts", probe_io.EXPERTS],
        [f"{b}.self_attn.{MLA_A[engine]}", probe_io.LINEAR],
        [f"{b}.self_attn.o_proj", probe_io.LINEAR],
    ]
    return probe_io.exclude_cases(_config(), EXCLUDES, target=target, draft=draft)


# The first release of each profile range (the conformance suite judges every release against its profile)
RELEASES = [(p.engine, p.read[0]) for p in all_profiles("glm5_next")]


@pytest.fixture(scope="module")
def measured() -> dict:
    """Every release's answers, one probe process per release."""
    return probe_io.run_releases(RELEASES, _cases)


def _reaches_draft(engine: str, release: str, name: str) -> bool:
    """Whether the MTP exclude entries of case `name` (one routed expert and eh_proj) reach the release's draft."""
    if name == "mtp-built":
        return engine == "vllm" or Version(release) >= Version("0.5.21")
    if name == "mtp-stored":  # vLLM never remaps the stored name; sglang's NextN maps it from 0.5.21 on
        return engine == "sglang" and Version(release) >= Version("0.5.21")
    return False


@pytest.mark.parametrize(("engine", "release"), RELEASES, ids=[f"{e}-{r}" for e, r in RELEASES])
def test_each_release_builds_glm5_next_target_and_draft_as_pinned(measured, engine, release):
    answers = measured[engine, release]
    errors = {name: a["error"] for name, a in answers.items() if "error" in a}
    assert not errors, json.dumps(errors, indent=1)[:4000]
    d, b = DECODER[engine], DRAFT_BLOCK[engine]
    for name in EXCLUDES:
        target, draft = answers[name]["target"], answers[name]["draft"]
        t = probe_io.decisions(target)
        dd = probe_io.decisions(draft)
        assert target["class"] == "Glm5NextForConditionalGeneration" and target["fused_shared_experts"] == 0
        assert draft["block_prefix"] == b and draft["fused_shared_experts"] == 0, (name, draft)
        assert t[f"{d}1.mlp.experts"] == probe_io.MXFP4, (name, t)
        reached = _reaches_draft(engine, release, name)
        assert dd[f"{b}.mlp.experts"] == (probe_io.BF16 if reached else probe_io.MXFP4), (name, dd)
        attention = [f"{d}0.self_attn.{KDA_IN[engine]}", f"{d}0.self_attn.o_proj", f"{d}3.self_attn.{MLA_A[engine]}"]
        if engine == "sglang":
            # Attention, KDA and MLA, is built with the quant config: MXFP4 unless excluded, the excluded o_proj
            # found under its stored name (the target's mapper rewrites the entries)
            assert all(t[m] == probe_io.MXFP4 for m in attention), (name, t)
            o_proj = probe_io.BF16 if name == "target" else probe_io.MXFP4
            assert t[f"{d}3.self_attn.o_proj"] == o_proj, (name, t)
            assert target["recorded"] == {
                "model": {"prefix": "model", "quantized": True},
                "visual": {"prefix": "visual", "quantized": True},
            }
            assert {"fused_qkvbfg_a_proj", "fused_fg_b_proj", "fused_qkv_a_proj_with_mqa", "gate_up_proj"} <= set(
                target["packed_modules_mapping"]
            )
            assert draft["class"] == "Glm5NextForConditionalGenerationNextN"
            eh = probe_io.BF16 if reached else probe_io.MXFP4
            assert draft["eh_proj"] == {"type": "ReplicatedLinear", "prefix": "model.eh_proj", "decision": eh}, draft
            assert dd[f"{b}.self_attn.{MLA_A[engine]}"] == dd[f"{b}.self_attn.o_proj"] == probe_io.MXFP4, (name, dd)
        else:
            # Every attention linear, the draft's too, is built without the quant config: bf16 whatever the list
            assert all(t[m] == probe_io.BF16 for m in attention + [f"{d}3.self_attn.o_proj"]), (name, t)
            assert dd[f"{b}.self_attn.{MLA_A[engine]}"] == dd[f"{b}.self_attn.o_proj"] == probe_io.BF16, (name, dd)
            assert draft["class"] == "Glm5NextMTP" and draft["architecture"] == "Glm5NextMTPModel"
            assert draft["eh_proj"] == {"type": "Linear", "prefix": f"{b}.eh_proj", "decision": probe_io.BF16}, draft
            assert t["visual.blocks.0.attn.qkv"] == probe_io.BF16, t  # built without the quant config
            assert not target["unbuilt"] and not draft["unbuilt"]


def test_the_family_starts_with_the_releases_pinned():
    """sglang 0.5.19 and the releases before it register no GLM-5.3-Flash class (the registry's EntryClass names,
    read from the wheel); 0.5.20, the first release its profiles read, does."""
    from engine_truth.sglang_probe import entry_modules
    from engine_truth.wheels import Release

    assert "Glm5NextForConditionalGeneration" not in entry_modules(Release("sglang", "0.5.19"))
    assert "Glm5NextForConditionalGeneration" in entry_modules(Release("sglang", "0.5.20"))
    assert RELEASES[0] == ("sglang", "0.5.20") and ("sglang", "0.5.19") not in RELEASES
