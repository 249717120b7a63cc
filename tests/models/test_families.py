"""Model families beyond GLM-5.2: each family's fixtures reproduce its real published checkpoint, and its
output runs through the whole pipeline. (The engine conformance of each family: test_engine_conformance.py.)"""

from __future__ import annotations

import json
import math
import re

import pytest
from helpers import RECIPE_ENGINES, TOKEN, cli, engines_args, hub_env, run_cli
from safetensors import safe_open

from mxforge.checkpoint import Checkpoint
from mxforge.models import FAMILIES, family_named, layout_of
from mxforge.models.fixture import preset_config, write_fixture
from mxforge.models.layout import fp8_block_inventory
from mxforge.quantize.plan import plan_checkpoint
from mxforge.quantize.recipe import load_recipe

PUBLISHED = [f for f in FAMILIES if f.published]


@pytest.mark.parametrize("family", PUBLISHED, ids=lambda f: f.name)
def test_full_layout_reproduces_the_published_inventory(family, fixture_ckpt):
    """Tensor count, element count and shard count of the published release (FP8 releases: as published, each
    block-scaled weight with its weight_scale_inv; the bf16 fixture holds the same names and shapes less the scales)."""
    published = dict(family.published)
    path, result = fixture_ckpt("full-layout", family.name)  # the session's: the conformance matrix's too
    ckpt = Checkpoint.open(path)
    infos = ckpt.tensor_infos()
    layout = layout_of(ckpt.config)
    assert {n: (i.dtype, i.shape) for n, i in infos.items()} == {t.name: (t.dtype, t.shape) for t in layout.tensors()}
    assert result.shards == published.get("shards", result.shards) == len(ckpt.shard_names)
    assert ckpt.index_metadata["total_size"] == sum(i.nbytes for i in infos.values())
    stored = [t for t in layout.tensors()]
    if published["precision"] == "fp8-block":
        stored = fp8_block_inventory(stored, family.fp8_bf16_weights)
    parameters = sum(math.prod(t.shape) for t in stored)
    if "size_gb" in published:  # only the checkpoint's size is published (GLM-4.7-Flash)
        assert round(sum(t.nbytes for t in stored) / 1e9, 1) == published["size_gb"]
    elif "parameters_b" in published:  # only the Hub's rounded count is published (GLM-4.5)
        assert round(parameters / 1e9, 2) == published["parameters_b"]
    else:
        assert len(stored) == published["tensors"]
        assert parameters == published["parameters"]


def test_deepseek_v3_figures():
    """DeepSeek-V3's inventory, from its config: 46,183 bf16 tensors (1,368,979,721,216 bytes); published FP8 it is
    91,991 tensors of 688,574,839,360 bytes (641.29 GiB), 45,808 of them weight_scale_inv."""
    family = family_named("deepseek_v3")
    from mxforge.models.fixture import preset_config

    layout = layout_of(preset_config("full-layout", family=family)[0])
    bf16 = layout.tensors()
    fp8 = fp8_block_inventory(bf16, family.fp8_bf16_weights)
    assert (len(bf16), sum(t.nbytes for t in bf16)) == (46183, 1368979721216)
    assert (len(fp8), sum(t.nbytes for t in fp8)) == (91991, 688574839360)
    assert sum(t.name.endswith("_scale_inv") for t in fp8) == 45808
    names = {t.name for t in bf16}
    for mtp in ("embed_tokens", "shared_head.head", "shared_head.norm", "eh_proj", "enorm", "hnorm"):
        assert f"model.layers.61.{mtp}.weight" in names
    assert "model.layers.2.mlp.down_proj.weight" in names and "model.layers.3.mlp.experts.255.down_proj.weight" in names
    assert not any(".indexer." in n for n in names)


def test_deepseek_v32_figures():
    """DeepSeek-V3.2: DeepSeek-V3 plus an indexer on all 62 layers, norms float32: 46,493 bf16 tensors; published
    FP8 it is 92,425 tensors of 689,471,107,200 bytes (642.12 GiB), 45,932 of them weight_scale_inv."""
    family = family_named("deepseek_v32")
    from mxforge.models.fixture import preset_config

    layout = layout_of(preset_config("full-layout", family=family)[0])
    bf16 = layout.tensors()
    fp8 = fp8_block_inventory(bf16, family.fp8_bf16_weights)
    assert (len(bf16), len(fp8), sum(t.nbytes for t in fp8)) == (46493, 92425, 689471107200)
    by_name = {t.name: t for t in fp8}
    assert by_name["model.layers.61.self_attn.indexer.wq_b.weight"].shape == (8192, 1536)
    assert by_name["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == "BF16"
    assert by_name["model.layers.0.self_attn.indexer.wk.weight_scale_inv"].shape == (1, 56)
    assert {
        by_name[n].dtype
        for n in ("model.norm.weight", "model.layers.61.enorm.weight", "model.layers.5.self_attn.indexer.k_norm.bias")
    } == {"F32"}


def full_layout(family) -> tuple[list, dict]:
    """The family's full-layout bf16 tensors (as `mxforge fixture --preset full-layout` plans them), and by name."""
    from mxforge.models.fixture import preset_config

    tensors = layout_of(preset_config("full-layout", family=family)[0]).tensors()
    return tensors, {t.name: t for t in tensors}


def totals(tensors) -> tuple[int, int, int]:
    """(tensors, parameters, bytes)."""
    return len(tensors), sum(math.prod(t.shape) for t in tensors), sum(t.nbytes for t in tensors)


def test_glm4_moe_figures():
    """GLM-4.5's inventory, derived from its config: 44,691 bf16 tensors, 358,337,791,296 parameters (the Hub's 358.34 B
    for zai-org/GLM-4.5 and GLM-4.7), 716,675,611,392 bytes; without the MTP layer's own embed_tokens and
    shared_head.head it would be 356.79 B, so the published count confirms them. GLM-4.5-Air (its config's
    differences applied): 110,468,824,832 parameters, the Hub's 110.47 B."""
    family = family_named("glm4_moe")
    tensors, by_name = full_layout(family)
    assert totals(tensors) == (44691, 358337791296, 716675611392)
    assert by_name["model.layers.0.self_attn.q_proj.weight"].shape == (12288, 5120)
    assert by_name["model.layers.0.self_attn.k_proj.bias"].shape == (1024,)
    assert by_name["model.layers.91.self_attn.k_norm.weight"].shape == (128,)
    assert by_name["model.layers.92.eh_proj.weight"].shape == (5120, 10240)
    assert by_name["model.layers.92.shared_head.head.weight"].shape == (151552, 5120)
    assert (
        "model.layers.2.mlp.down_proj.weight" in by_name
        and "model.layers.3.mlp.experts.159.down_proj.weight" in by_name
    )
    assert by_name["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert not any("o_proj.bias" in n or "q_a_proj" in n or ".indexer." in n for n in by_name)
    air = dict(
        family.reference(),
        num_hidden_layers=46,
        first_k_dense_replace=1,
        n_routed_experts=128,
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        use_qk_norm=False,
    )
    air_tensors = layout_of(air).tensors()
    assert round(sum(math.prod(t.shape) for t in air_tensors) / 1e9, 2) == 110.47
    assert "model.layers.46.eh_proj.weight" in {t.name for t in air_tensors}
    assert not any("q_norm" in t.name for t in air_tensors)


def test_glm4_moe_lite_figures():
    """GLM-4.7-Flash's inventory, derived from its config: 9,703 bf16 tensors, 31,221,488,576 parameters (the Hub's
    "31B"), 62,442,983,168 bytes (the published 62.4 GB; e_score_correction_bias float32); without the MTP layer's
    own embed_tokens and shared_head.head it would be 30.59 B and 61.17 GB, so the published size confirms them. MLA
    as DeepSeek-V3's at GLM-4.7-Flash's ranks, layer 0 dense, the MTP layer 47."""
    tensors, by_name = full_layout(family_named("glm4_moe_lite"))
    assert totals(tensors) == (9703, 31221488576, 62442983168)
    own = [by_name[f"model.layers.47.{n}.weight"] for n in ("embed_tokens", "shared_head.head")]
    assert all(t.shape == (154880, 2048) for t in own)
    assert round((sum(t.nbytes for t in tensors) - sum(t.nbytes for t in own)) / 1e9, 2) == 61.17
    assert by_name["model.layers.0.self_attn.q_b_proj.weight"].shape == (20 * 256, 768)
    assert by_name["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 2048)
    assert by_name["model.layers.0.self_attn.kv_b_proj.weight"].shape == (20 * 448, 512)
    assert by_name["model.layers.0.self_attn.o_proj.weight"].shape == (2048, 5120)
    assert by_name["model.layers.0.mlp.down_proj.weight"].shape == (2048, 10240)
    assert by_name["model.layers.1.mlp.experts.63.gate_proj.weight"].shape == (1536, 2048)
    assert by_name["model.layers.46.mlp.shared_experts.down_proj.weight"].shape == (2048, 1536)
    assert by_name["model.layers.47.eh_proj.weight"].shape == (2048, 4096)
    assert not any(".indexer." in n or "q_proj" in n for n in by_name)


def test_qwen3_5_moe_figures():
    """Qwen3.5-35B-A3B's inventory, derived from its config: 40 layers, every fourth full attention (gated: q_proj
    twice the heads' width), the rest gated delta nets; 256 routed experts, one shared expert with its one-row gate in
    every layer; the 27-block vision tower; the MTP block under `mtp`. 35.95 B parameters: the model's "35B"."""
    tensors, by_name = full_layout(family_named("qwen3_5_moe"))
    count, parameters, size = totals(tensors)
    assert (count, parameters) == (32451, 35951822704) and 35e9 <= parameters < 36e9
    text = "model.language_model.layers."
    assert by_name[text + "0.linear_attn.in_proj_qkv.weight"].shape == (2 * 16 * 128 + 32 * 128, 2048)
    assert by_name[text + "0.linear_attn.conv1d.weight"].shape == (8192, 1, 4)
    assert by_name[text + "3.self_attn.q_proj.weight"].shape == (2 * 16 * 256, 2048)
    assert text + "3.linear_attn.out_proj.weight" not in by_name and text + "4.self_attn.o_proj.weight" not in by_name
    assert by_name[text + "39.mlp.experts.255.down_proj.weight"].shape == (2048, 512)
    assert by_name[text + "39.mlp.shared_expert_gate.weight"].shape == (1, 2048)
    assert by_name["mtp.fc.weight"].shape == (2048, 4096) and "mtp.layers.0.self_attn.q_proj.weight" in by_name
    assert by_name["model.visual.merger.linear_fc2.weight"].shape == (2048, 4608)
    assert sum(n.startswith("model.visual.blocks.") for n in by_name) == 27 * 12


def test_qwen3_5_moe_tiny_matches_what_transformers_saves(tmp_path):
    """Outside `mtp.*` (which transformers does not build), the tiny fixture's names and shapes equal what
    `Qwen3_5MoeForConditionalGeneration.save_pretrained` writes for its config: text model, head and vision tower,
    routed experts one by one."""
    import transformers

    write_fixture(tmp_path / "q", "tiny", family="qwen3_5_moe", quiet=True)
    ckpt = Checkpoint.open(tmp_path / "q")
    config = transformers.Qwen3_5MoeConfig(
        text_config=ckpt.config["text_config"], vision_config=ckpt.config["vision_config"]
    )
    transformers.Qwen3_5MoeForConditionalGeneration(config).save_pretrained(tmp_path / "hf")
    theirs = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            theirs.update({k: tuple(s.get_slice(k).get_shape()) for k in s.keys()})
    ours = {k: v.shape for k, v in ckpt.tensor_infos().items() if not k.startswith("mtp.")}
    assert ours == theirs
    layout = layout_of(ckpt.config)
    assert [layout.attention_type(n) for n in layout.all_layers] == ["linear_attention"] * 3 + ["full_attention"] * 2


def test_qwen3_5_moe_text_is_the_multimodal_language_model_under_its_own_names():
    """The text-only Qwen3_5MoeForCausalLM: Qwen3.5-35B-A3B's tensors less the vision tower, `model.language_model.`
    stored as `model.`, the MTP block as it is; 32,118 tensors, 35.51 B parameters."""
    tensors, by_name = full_layout(family_named("qwen3_5_moe_text"))
    multimodal = full_layout(family_named("qwen3_5_moe"))[0]
    renamed = {
        (t.name.replace("model.language_model.", "model.", 1), t.shape, t.dtype)
        for t in multimodal
        if not t.name.startswith("model.visual.")
    }
    assert {(t.name, t.shape, t.dtype) for t in tensors} == renamed
    assert totals(tensors)[:2] == (32118, 35505251456)
    assert by_name["model.layers.39.mlp.experts.255.down_proj.weight"].shape == (2048, 512)


def test_qwen3_5_moe_text_tiny_matches_what_transformers_saves(tmp_path):
    """Outside `mtp.*`, the text-only tiny fixture's names and shapes equal what transformers'
    `Qwen3_5MoeForCausalLM.save_pretrained` writes for its config (flat, as that class stores it)."""
    import transformers

    write_fixture(tmp_path / "q", "tiny", family="qwen3_5_moe_text", quiet=True)
    ckpt = Checkpoint.open(tmp_path / "q")
    assert "text_config" not in ckpt.config and ckpt.config["num_experts"] == 8
    transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**ckpt.config)).save_pretrained(
        tmp_path / "hf"
    )
    theirs = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            theirs.update({k: tuple(s.get_slice(k).get_shape()) for k in s.keys()})
    assert {k: v.shape for k, v in ckpt.tensor_infos().items() if not k.startswith("mtp.")} == theirs


def test_glm5_next_figures():
    """GLM-5.3-Flash's inventory, derived from transformers' default config: 45 layers, every fourth indexed NoPE MLA,
    the rest KDA; the first three dense, then 288 routed experts and one shared expert; mHC on every decoder layer;
    the 24-block vision tower; the MTP layer 45. 321.32 B parameters and 38,770 tensors: what transformers' own model
    on the meta device holds (313.79 B with its vision default out_hidden_size 1536, less the MTP layer)."""
    tensors, by_name = full_layout(family_named("glm5_next"))
    count, parameters, _ = totals(tensors)
    assert (count, parameters) == (38770, 321323049822)
    text = "model.language_model.layers."
    assert by_name[text + "0.self_attn.q_proj.weight"].shape == (64 * 128, 4096)
    assert by_name[text + "0.self_attn.q_conv1d.weight"].shape == (64 * 128, 1, 4)
    assert by_name[text + "0.hc_attn_fn"].shape == (24, 4 * 4096) and by_name[text + "0.hc_ffn_base"].dtype == "F32"
    assert by_name[text + "3.self_attn.q_b_proj.weight"].shape == (64 * 256, 1536)  # NoPE: no rope dims
    assert by_name[text + "3.self_attn.indexer.index_kpool_compress_gate"].shape == (128, 4096)
    assert (
        text + "4.self_attn.kv_b_proj.weight" not in by_name and text + "2.mlp.experts.0.up_proj.weight" not in by_name
    )
    assert by_name[text + "44.mlp.experts.287.down_proj.weight"].shape == (4096, 2048)
    assert by_name[text + "45.eh_proj.weight"].shape == (4096, 8192) and text + "45.hc_attn_fn" not in by_name
    assert by_name["model.visual.merger.down_proj.weight"].shape == (4096, 10240)
    assert sum(n.startswith("model.visual.blocks.") for n in by_name) == 24 * 14


def test_glm5_next_tiny_matches_what_transformers_saves(tmp_path):
    """Outside the MTP layer (which transformers does not build), the tiny fixture's names, shapes and dtypes equal
    what `Glm5NextForConditionalGeneration.save_pretrained` writes for its config loaded in bf16 (the modules
    transformers keeps float32: the router, KDA's convs, dt_bias and A_log, the mHC bases and scales): KDA and
    indexed MLA layers with mHC, routed experts one by one, the vision tower."""
    import torch
    import transformers

    write_fixture(tmp_path / "g", "tiny", family="glm5_next", quiet=True)
    ckpt = Checkpoint.open(tmp_path / "g")
    config = transformers.Glm5NextConfig(
        text_config=ckpt.config["text_config"], vision_config=ckpt.config["vision_config"]
    )
    transformers.Glm5NextForConditionalGeneration(config).save_pretrained(tmp_path / "f32")
    model = transformers.Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "f32", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    theirs = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            theirs.update({k: (tuple(s.get_slice(k).get_shape()), s.get_slice(k).get_dtype()) for k in s.keys()})
    layout = layout_of(ckpt.config)
    ours = {k: (v.shape, v.dtype) for k, v in ckpt.tensor_infos().items() if not layout.in_mtp_layer(k)}
    assert ours == theirs
    assert [layout.attention_type(n) for n in layout.all_layers] == ["linear_attention"] * 3 + ["indexed_attention"] * 2
    assert [layout.has_indexer(n) for n in layout.all_layers] == [False] * 3 + [True] * 2


def test_qwen3_5_moe_fixup_writes_mtp_entries_sglang_0_5_12_reads_without_dropping_the_draft(tmp_path):
    """The default recipe keeps `mtp.fc` (vLLM quantizes it unless excluded) and the MTP layer's attention and shared
    expert bf16, its routed experts MXFP4. sglang 0.5.12-0.5.20 build the whole draft unquantized as soon as an
    `exclude` entry starts with "mtp." (measured: test_qwen3_5_engine_truth.py), so those releases would allocate
    bf16 experts; fixup writes each such entry as a `re:` entry that excludes the same module in every release, and
    0.5.9's fused modules by their fused names (its loader gives the model no packed modules)."""
    from mxforge.validation.profiles import all_profiles
    from mxforge.validation.validate import validate_checkpoint

    write_fixture(tmp_path / "src", "tiny", family="qwen3_5_moe", quiet=True)
    assert cli("quantize", str(tmp_path / "src"), str(tmp_path / "q"), "--quiet").returncode == 0
    report = validate_checkpoint(tmp_path / "q")
    # sglang before 0.5.21: the draft decides the MTP layer's qkv_proj by that fused name alone (its class declares no
    # packed modules; 0.5.9's target none either), and 0.5.12-0.5.20 switch the draft's quantization off
    failing = {r["profile"] for r in report.releases() if not r["ok"]}
    assert failing == {
        p.name for p in all_profiles("qwen3_5_moe") if p.engine == "sglang" and p.draft.packed != p.packed
    }
    dropped = next(p for p in report.problems if p.engine == "sglang-0.5.12")
    assert dropped.subject == "mtp.layers.0.mlp.experts" and "exclude entry under its block's prefix" in dropped.message
    proc = cli("fixup", str(tmp_path / "q"), "--json", "-")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exclude = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["exclude"]
    assert not [e for e in exclude if e.startswith("mtp.")]
    assert "re:mtp\\.fc$" in exclude and "re:mtp\\.layers\\.0\\.self_attn\\.qkv_proj$" in exclude
    assert "model.language_model.layers.0.linear_attn.in_proj_qkvz" in exclude  # sglang 0.5.9's fused name
    assert "model.visual.blocks.0.attn.qkv" in exclude  # vLLM builds the vision tower with the quant config
    report = validate_checkpoint(tmp_path / "q")
    assert report.ok and report.verdict() == "loads: sglang 0.5.9-0.5.23, vllm 0.30.0-0.33.0", report.format()


@pytest.mark.parametrize(
    "family_name,model",
    [
        ("deepseek_v3", "DeepseekV3"),
        ("deepseek_v32", "DeepseekV32"),
        ("glm4_moe", "Glm4Moe"),
        ("glm4_moe_lite", "Glm4MoeLite"),
    ],
)
def test_tiny_matches_what_transformers_saves(family_name, model, tmp_path):
    """Non-MTP names and shapes equal what transformers' own model class writes for the same config."""
    import transformers

    write_fixture(tmp_path / "ds", "tiny", family=family_name, quiet=True)
    ckpt = Checkpoint.open(tmp_path / "ds")
    infos = ckpt.tensor_infos()
    config = getattr(transformers, f"{model}Config")(**ckpt.config)
    getattr(transformers, f"{model}ForCausalLM")(config).save_pretrained(tmp_path / "hf")
    theirs = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            theirs.update({k: tuple(s.get_slice(k).get_shape()) for k in s.keys()})
    layout = layout_of(ckpt.config)
    assert {k: v.shape for k, v in infos.items() if not layout.in_mtp_layer(k)} == theirs


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_default_recipe_keeps_what_the_policy_keeps(family, tmp_path):
    """Same policy for every family: routed experts (MTP included) and decoder shared experts MXFP4; the MTP
    shared expert, attention, routers, dense MLPs, embeddings and heads bf16."""
    write_fixture(tmp_path / "src", "tiny", family=family, quiet=True)
    ckpt = Checkpoint.open(tmp_path / "src")
    plan = plan_checkpoint(ckpt, load_recipe(None, ckpt.config))
    layout = plan.layout
    mtp = layout.mtp_layers[0]
    for t in plan.tensors():
        name, layer = t.source.name, layout.layer_of(t.source.name)
        if t.fate == "copied":
            continue
        kind = layout.kind_of(name)
        want = kind == "experts" or (kind == "shared_experts" and layer != mtp)
        assert (t.fate == "quantized") == want, (name, t.fate)


# The variants #23 ships beside every family's default recipe (`<default>-<suffix>`); keep-FP8 needs an FP8 release.
# A variant may serve in one engine only (helpers.RECIPE_ENGINES: GLM-5.3-Flash's FP8 attention, sglang).
VARIANTS = ("mtp-bf16", "attn-fp8", "mtp-fp8")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_ships_the_mixed_precision_variants(family):
    """Each family's recipes: its default, the MTP layer bf16, AMD's AttnFP8 layout (FP8 PTPC attention), an FP8 MTP
    layer, and a keep-FP8 variant exactly where the family has an FP8 release to keep weights from."""
    stem = family.default_recipe
    want = [stem] + [f"{stem}-{v}" for v in VARIANTS] + ([f"{stem}-keep-fp8"] if family.has_fp8_release else [])
    assert sorted(family.recipes) == sorted(want)
    assert [load_recipe(r).keeps_source_weights for r in want] == [r.endswith("keep-fp8") for r in want]


def _bf16_recipes() -> list:
    """(family, recipe) for every shipped recipe whose output from a bf16 source is its own (a keep-FP8 recipe's is
    its family's default: tests/run/test_fp8_run.py runs those from the FP8 release)."""
    from mxforge.quantize.recipe import load_recipe

    cases = [(f, r) for f in FAMILIES for r in f.recipes if not load_recipe(r).keeps_source_weights]
    return [pytest.param(f, r, id=r) for f, r in cases]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "recipe"), _bf16_recipes())
def test_run_end_to_end_per_family(family, recipe, tmp_path):
    """`mxforge run` from the family's tiny bf16 fixture on a loopback Hub to a push there, with each shipped recipe:
    download, quantize, fixup, validate for every release that builds the family, push; the card names the family
    and says every release it lists loads the checkpoint, and validate agrees."""
    from huggingface_hub import HfApi
    from loopback_hub import LoopbackHub

    write_fixture(tmp_path / "src", "tiny", family=family, quiet=True)
    hub = LoopbackHub(tmp_path / "hub", tokens={TOKEN: "alice"})
    hub.add_repo_from_dir(f"zai/{family.name}-tiny", tmp_path / "src")
    hub.start()
    try:
        proc = run_cli(
            "run",
            f"zai/{family.name}-tiny",
            str(tmp_path / "out"),
            "--recipe",
            recipe,
            *engines_args(recipe),
            "--push",
            f"alice/{family.name}-mxfp4",
            "--quiet",
            "--json",
            "-",
            env=hub_env(hub, tmp_path),
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        stages = json.loads(proc.stdout)["stages"]
        assert all(stages[s]["status"] == "done" for s in ("download", "quantize", "fixup", "validate", "push")), stages
        assert stages["push"]["report"]["remote_hashes_match"] is True
        card = HfApi(endpoint=hub.endpoint, token=TOKEN).hf_hub_download(
            f"alice/{family.name}-mxfp4", "README.md", cache_dir=tmp_path / "dl"
        )
        text = open(card).read()
        assert family.title in text
        rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line and "serve" in line]
        assert rows and not any("| **no** |" in line for line in rows), rows
    finally:
        hub.stop()
    quantized = json.loads((tmp_path / "out" / "mxfp4" / "mxforge_quantize.json").read_text())
    assert quantized["recipe"]["name"] == recipe
    validate = cli("validate", str(tmp_path / "out" / "mxfp4"), *engines_args(recipe), "--json")
    assert validate.returncode == 0, validate.stdout + validate.stderr


@pytest.mark.parametrize(("recipe", "engines"), sorted(RECIPE_ENGINES.items()))
def test_a_recipe_for_some_releases_is_refused_for_the_others_before_quantizing(recipe, engines, tmp_path):
    """A shipped recipe whose output loads in some releases of its family only (helpers.RECIPE_ENGINES): run for every
    release, from the family's tiny fixture (its FP8 release's for a keep-fp8 recipe), refuses it before writing
    anything, naming each profile whose releases it leaves out and none it keeps, and says to select releases with
    --engines (the runs with them: test_run_end_to_end_per_family, tests/run/test_fp8_run.py)."""
    from mxforge.validation.profiles import all_profiles, select

    family = next(f for f in FAMILIES if recipe in f.recipes)
    precision = "fp8" if load_recipe(recipe).keeps_source_weights else "bf16"
    write_fixture(tmp_path / "src", "tiny", family=family, precision=precision, quiet=True)
    proc = cli("run", str(tmp_path / "src"), str(tmp_path / "out"), "--recipe", recipe, "--quiet")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    refused = set(re.findall(r"(?:sglang|vllm)-[0-9.]+", line.split("even after")[0]))
    chosen = {s.profile.name: set(s.releases) for s in select(engines, family)}
    left_out = {p.name for p in all_profiles(family) if chosen.get(p.name) != set(p.read)}
    assert refused == left_out, line
    assert "select the releases you serve with --engines" in line
    assert not (tmp_path / "out" / "mxfp4" / "config.json").exists()


def test_vllm_0_30_requantizing_deepseek_attention_is_a_warning_not_a_failure(tmp_path):
    """vLLM 0.30.0 loads a DeepSeek-family MXFP4 checkpoint's excluded attention bf16 and re-quantizes it to MXFP4
    (measured by the conformance suite): validate passes, and warns for that release alone; GLM-5 is not affected."""
    from mxforge.quantize.run import quantize_checkpoint
    from mxforge.validation.validate import validate_checkpoint

    for family, expect in (("deepseek_v3", {"vllm-0.30.0"}), ("glm_moe_dsa", set())):
        write_fixture(tmp_path / family, "tiny", family=family, quiet=True)
        quantize_checkpoint(tmp_path / family, tmp_path / f"{family}-q", None, workers=1, quiet=True)
        report = validate_checkpoint(tmp_path / f"{family}-q")
        warned = {w.engine for w in report.warnings if "re-quantizes" in w.message}
        assert warned == expect, (family, [w.format() for w in report.warnings])
        assert all(report.engine_ok(s.profile.name) for s in report.selections if s.profile.engine == "vllm")
        if expect:
            layers = json.loads((tmp_path / family / "config.json").read_text())["num_hidden_layers"] + 1
            assert report.checked["engines"]["vllm-0.30.0"]["requantized_at_load"] == 4 * layers
            assert report.checked["engines"]["vllm-0.31.0"]["requantized_at_load"] == 0


def test_glm5_next_fp8_release_is_fp8_exactly_where_every_release_quantizes():
    """GLM-5.3-Flash's FP8 release layout is derived (glm-5.3-flash.family.toml): each of its FP8 modules is one that
    every release building the family builds with the quantization config (a fused module's shards all FP8 or all
    bf16), and each bf16 linear beyond the lineage's set (GLM-5.2-FP8's) is one some release builds unquantized."""
    from mxforge.validation.modules import checkpoint_linears, engine_modules
    from mxforge.validation.profiles import all_profiles

    family = family_named("glm5_next")
    lineage = re.compile(family_named("glm_moe_dsa").fp8_bf16_weights)
    layout = layout_of(preset_config("full-layout", family=family)[0])
    bf16 = layout.tensors()
    fp8 = fp8_block_inventory(bf16, family.fp8_bf16_weights)
    dtype = {t.name.removesuffix(".weight"): t.dtype for t in fp8 if t.name.endswith(".weight")}
    linears = checkpoint_linears(layout, fp8)
    unquantized_somewhere: set[str] = set()
    for profile in all_profiles(family):
        for module in engine_modules(profile, layout, linears):
            kinds = {dtype[s.name] for s in module.shards}
            assert len(kinds) == 1, f"{profile.label}: {module.checkpoint} mixes {kinds}"
            if kinds == {"F8_E4M3"}:
                assert module.quantizable, f"{profile.label} builds {module.runtime} unquantized, but it is FP8"
            if not module.quantizable:
                unquantized_somewhere.update(s.name for s in module.shards)
    linear = {t.name.removesuffix(".weight") for t in bf16 if t.name.endswith(".weight") and len(t.shape) == 2}
    extra = {n for n in linear if dtype[n] != "F8_E4M3" and not lineage.search(n + ".weight")}
    assert extra and extra <= unquantized_somewhere, sorted(extra - unquantized_somewhere)[:5]
    assert any(dtype[n] == "F8_E4M3" for n in linear)
