"""What sglang and vLLM do with a Quark MXFP4 checkpoint of Qwen3.5 MoE, measured by executing the first release of
each profile range's own code (the engine-truth probes, tests/engine_truth/), target and MTP draft: the map the
`[family.qwen3_5_moe]` tables of manifests/engines/ were written from (the conformance suite then judges every
release against them on the whole matrix), pinned so a probe or release that answers otherwise fails here.

The checkpoint config is transformers' own `Qwen3_5MoeConfig` at small sizes (three gated-delta-net layers, one
full-attention layer, a two-block vision tower, one MTP layer) with the published config's `mtp_num_hidden_layers`
and empty `deepstack_visual_indexes`, and mxforge's Quark MXFP4 `quantization_config`. Three exclude lists:
`plain` (lm_head, one vision block's qkv, one decoder o_proj), `fc` (plus `mtp.fc`: the MTP projection kept bf16)
and `experts` (plus one routed expert of the MTP layer kept bf16). What they show, per release:

- sglang builds the vision tower without the quant config (its linears load bf16 whatever the list says); vLLM builds
  it with it (a vision linear is MXFP4 unless excluded).
- sglang's draft (Qwen3_5ForCausalLMMTP) builds `mtp.fc` as a torch Linear: bf16 always; vLLM's (Qwen3_5MoeMTP) as a
  quantizable ColumnParallelLinear: MXFP4 unless `mtp.fc` is excluded.
- sglang 0.5.12-0.5.20 drop quantization for the whole draft as soon as any exclude entry starts with `mtp.`, so a
  checkpoint with MXFP4 MTP experts and a bf16 `mtp.fc` (which vLLM needs excluded) cannot load there; 0.5.21 on
  drop it only when an `mtp.` entry names `mlp.experts`; 0.5.9-0.5.11 never.
- vLLM maps `model.language_model.` to `language_model.model.` in exclude entries (its hf_to_vllm_mapper); sglang
  reads them as stored. sglang 0.5.9's loader gives the target no packed modules (no in_proj_qkvz / qkv_proj
  fusion).
"""

from __future__ import annotations

import json

import pytest
from engine_truth import probe_io

from mxforge.validation.profiles import all_profiles

# One worker runs this module: its tests share `measured` (each release probed once, minutes), which each worker
# holding some of them would otherwise compute again.
pytestmark = [pytest.mark.engines, pytest.mark.xdist_group("test_qwen3_5_engine_truth")]

TEXT = {
    "hidden_size": 64,
    "num_hidden_layers": 4,  # layers 0-2 linear attention, 3 full attention (full_attention_interval 4)
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
}
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
DECODER_O_PROJ = "model.language_model.layers.3.self_attn.o_proj"
EXCLUDES = {
    "plain": ["lm_head", "model.visual.blocks.0.attn.qkv", DECODER_O_PROJ],
    "fc": ["lm_head", "model.visual.blocks.0.attn.qkv", DECODER_O_PROJ, "mtp.fc"],
    "experts": ["lm_head", "model.visual.blocks.0.attn.qkv", DECODER_O_PROJ, "mtp.layers.0.mlp.experts.0.gate_proj"],
}
# Runtime names: where each engine builds the decoder and the vision tower
DECODER = {"sglang": "model.language_model.layers.", "vllm": "language_model.model.layers."}
VISUAL = {"sglang": "model.visual.", "vllm": "visual."}
DRAFT = [
    ["mtp.fc", probe_io.LINEAR],
    ["mtp.layers.0.self_attn.qkv_proj", probe_io.LINEAR],
    ["mtp.layers.0.mlp.experts", probe_io.EXPERTS],
    ["mtp.layers.0.mlp.shared_expert.gate_up_proj", probe_io.LINEAR],
]


def _config() -> dict:
    from transformers import Qwen3_5MoeConfig

    from mxforge.quantize.recipe import load_recipe

    config = Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION).to_dict()
    config["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]  # as save_pretrained writes it
    config["text_config"]["mtp_num_hidden_layers"] = 1  # as published; transformers' class does not declare it
    config["vision_config"]["deepstack_visual_indexes"] = []  # as published; sglang's Qwen3-VL tower reads it
    config["quantization_config"] = load_recipe("glm-5.2-mxfp4").quantization_config([])
    return config


def _cases(engine: str) -> list[dict]:
    d, v = DECODER[engine], VISUAL[engine]
    target = [
        [d + "0.linear_attn.in_proj_qkvz", probe_io.LINEAR],
        [d + "0.linear_attn.in_proj_ba", probe_io.LINEAR],
        [d + "0.linear_attn.out_proj", probe_io.LINEAR],
        [d + "3.self_attn.qkv_proj", probe_io.LINEAR],
        [d + "3.self_attn.o_proj", probe_io.LINEAR],
        [d + "0.mlp.experts", probe_io.EXPERTS],
        [d + "0.mlp.shared_expert.gate_up_proj", probe_io.LINEAR],
        [v + "blocks.0.attn.qkv", probe_io.LINEAR],
        [v + "blocks.1.attn.qkv", probe_io.LINEAR],
    ]
    # sglang's draft builds a one-layer Qwen3_5ForCausalLM; its MTP projection is Qwen3.5's `fc`
    special = {probe_io.MTP_PROJ: "fc", probe_io.DRAFT_BLOCK_CLASS: "ForCausalLM"}
    return probe_io.exclude_cases(_config(), EXCLUDES, target=target, draft=DRAFT, **special)


# The first release of each profile range (the conformance suite judges every release against its profile)
RELEASES = [(p.engine, p.read[0]) for p in all_profiles("qwen3_5_moe")]


@pytest.fixture(scope="module")
def measured() -> dict:
    """Every release's answers, one probe process per release."""
    return probe_io.run_releases(RELEASES, _cases)


def _version(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.replace(".post", ".").split(".")[:3])


def _whole_draft_dropped(release: str, exclude: list[str]) -> bool:
    """sglang's Qwen3_5ForCausalLMMTP: when it builds the whole draft without the quant config."""
    mtp = [e for e in exclude if e.startswith("mtp.")]
    if _version(release) < (0, 5, 12):
        return False
    if _version(release) < (0, 5, 21):
        return bool(mtp)
    return any("mlp.experts" in e for e in mtp)


@pytest.mark.parametrize(("engine", "release"), RELEASES, ids=[f"{e}-{r}" for e, r in RELEASES])
def test_each_release_builds_qwen3_5_moe_target_and_draft_as_pinned(measured, engine, release):
    answers = measured[engine, release]
    errors = {name: a["error"] for name, a in answers.items() if "error" in a}
    assert not errors, json.dumps(errors, indent=1)[:4000]
    d, v = DECODER[engine], VISUAL[engine]
    for name, exclude in EXCLUDES.items():
        target, draft = answers[name]["target"], answers[name]["draft"]
        t = probe_io.decisions(target)
        dd = probe_io.decisions(draft)
        assert target["class"] == "Qwen3_5MoeForConditionalGeneration" and target["fused_shared_experts"] == 0
        # The linear attention, full attention and experts of the decoder: MXFP4; the excluded o_proj, found under
        # the engine's runtime name: bf16
        for module in ("0.linear_attn.in_proj_qkvz", "0.linear_attn.out_proj", "3.self_attn.qkv_proj", "0.mlp.experts"):
            assert t[d + module] == probe_io.MXFP4, (name, module, t)
        assert t[d + "3.self_attn.o_proj"] == probe_io.BF16, (name, t)
        assert t[v + "blocks.0.attn.qkv"] == probe_io.BF16
        if engine == "sglang":
            assert target["recorded"] == {"visual": {"prefix": "model.visual", "quantized": False}}
            assert draft["class"] == "Qwen3_5ForCausalLMMTP" and draft["block_prefix"] == "mtp"
            assert draft["eh_proj"] == {"type": "Linear", "prefix": None, "decision": probe_io.BF16}
            packed = {"in_proj_qkvz", "in_proj_ba", "qkv_proj", "gate_up_proj"}
            assert packed <= set(target["packed_modules_mapping"]) or (
                release == "0.5.9" and not target["packed_modules_mapping"]
            ), target["packed_modules_mapping"]
            dropped = _whole_draft_dropped(release, exclude)
            assert draft["block_quantized"] is not dropped, (name, draft)
            expected = probe_io.BF16 if dropped else probe_io.MXFP4
            assert dd["mtp.layers.0.mlp.experts"] == dd["mtp.layers.0.self_attn.qkv_proj"] == expected, (name, dd)
        else:
            assert t[v + "blocks.1.attn.qkv"] == probe_io.MXFP4  # the vision tower is built with the quant config
            assert draft["class"] == "Qwen3_5MoeMTP" and draft["block_prefix"] == "mtp.layers.0"
            fc = probe_io.BF16 if "mtp.fc" in exclude else probe_io.MXFP4
            assert draft["eh_proj"] == {"type": "ColumnParallelLinear", "prefix": "mtp.fc", "decision": fc}, draft
            experts = probe_io.BF16 if name == "experts" else probe_io.MXFP4  # one expert excluded: all of them
            assert dd["mtp.layers.0.mlp.experts"] == experts and dd["mtp.layers.0.self_attn.qkv_proj"] == probe_io.MXFP4
            assert {"in_proj_qkvz", "in_proj_ba", "qkv_proj", "gate_up_proj"} <= set(target["packed_modules_mapping"])
