"""Mixed precision: recipes whose rules name different element formats (MXFP4 experts, FP8 PTPC attention or an FP8
MTP layer), checked against Quark 0.13's own mixed file-to-file output: every shard and config.json byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import cli
from safetensors import safe_open

from mxforge.checkpoint import INDEX_NAME
from mxforge.formats import MXFP4, format_named
from mxforge.provenance import QUANTIZE_NAME, QUANTIZE_STATE_NAME

PTPC = format_named("fp8_ptpc")
# The shipped mixed recipes of GLM-5.2: AMD's GLM-5.2-Quark-MXFP4-AttnFP8 layout (attention and the indexer's wq_b in
# FP8 PTPC) and the MTP layer's attention, indexer wq_b and shared expert in FP8 PTPC (as AMD's GLM-5.3-Flash keeps
# its MTP layer in FP8).
RECIPES = ("glm-5.2-mxfp4-attn-fp8", "glm-5.2-mxfp4-mtp-fp8")


def _files(d: Path) -> dict[str, bytes]:
    skip = {QUANTIZE_NAME, QUANTIZE_STATE_NAME}
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name not in skip}


@pytest.fixture(scope="module", params=RECIPES)
def mixed(request, tiny_ckpt, tmp_path_factory) -> tuple[str, Path]:
    """`mxforge quantize` of the tiny fixture with a shipped mixed recipe."""
    out = tmp_path_factory.mktemp(f"mixed-{request.param}") / "out"
    cli("quantize", str(tiny_ckpt), str(out), "--recipe", request.param, "--quiet", check=True)
    return request.param, out


def test_each_rule_writes_its_format_and_the_config_names_it_per_layer(mixed):
    """The global scheme is the first rule's format; every module stored in another format has a layer_quant_config
    pattern that matches it and no module of another format."""
    import fnmatch

    name, out = mixed
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["global_quant_config"]["weight"]["dtype"] == MXFP4.quark.dtype
    layers = qc["layer_quant_config"]
    assert layers and all(
        c["weight"]["dtype"] == "fp8_e4m3" and c["weight"]["qscheme"] == "per_channel" for c in layers.values()
    )
    index = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    dtypes = {}
    for shard in sorted(set(index.values())):
        with safe_open(out / shard, "pt") as f:
            for t in f.keys():
                dtypes[t] = str(f.get_slice(t).get_dtype())
    fp8 = {t.removesuffix(".weight") for t, d in dtypes.items() if d == "F8_E4M3"}
    mx = {t.removesuffix(".weight") for t, d in dtypes.items() if d == "U8" and t.endswith(".weight")}
    assert fp8 and mx
    for module in fp8 | mx:
        configured = next((p for p in layers if fnmatch.fnmatch(module, p)), None)
        assert (configured is not None) == (module in fp8), module
    mtp = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    assert not any(m.endswith((".eh_proj", ".indexer.wk", ".indexer.weights_proj")) for m in fp8)  # vLLM: bf16 only
    if name.endswith("attn-fp8"):
        assert any(".self_attn.q_a_proj" in m for m in fp8) and not any(".mlp." in m for m in fp8)
        assert "*.self_attn.q_a_proj" in layers  # every layer's, one pattern, under any prefix (the MTP draft's)
    else:
        assert all(m.startswith(f"model.layers.{mtp}.") for m in fp8)
        assert f"model.layers.{mtp}.mlp.shared_experts.down_proj" in fp8


@pytest.mark.quark
def test_mixed_output_is_byte_identical_to_quarks_mixed_file_to_file(mixed, tiny_ckpt, tmp_path):
    """Quark's file-to-file with its own schemes (MXFP4Scheme global, PTPCFP8Scheme per pattern) and the same
    patterns and exclusions writes the same shards and the same config.json."""
    from quark.torch import ModelQuantizer
    from quark.torch.quantization.config.config import QConfig
    from quark.torch.quantization.config.template import MXFP4Scheme, PTPCFP8Scheme

    _, out = mixed
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    config = QConfig(
        global_quant_config=MXFP4Scheme().config,
        layer_quant_config={pattern: PTPCFP8Scheme().config for pattern in qc["layer_quant_config"]},
        exclude=list(qc["exclude"]),
    )
    dst = tmp_path / "quark"
    ModelQuantizer(config).direct_quantize_checkpoint(str(tiny_ckpt), str(dst), device="cpu")
    ours, theirs = _files(out), _files(dst)
    assert set(theirs) <= set(ours)
    # the index differs by design (test_quantize_e2e): Quark's total_size counts whole files; the maps agree
    assert [n for n in theirs if ours[n] != theirs[n]] == [INDEX_NAME]
    assert json.loads(ours[INDEX_NAME])["weight_map"] == json.loads(theirs[INDEX_NAME])["weight_map"]


@pytest.mark.quark
def test_mxfp6_mixed_output_is_byte_identical_to_quarks_file_to_file(tiny_ckpt, tmp_path):
    """MXFP6_RECIPE (routed and decoder shared experts MXFP6 E2M3, attention E3M2, the rest bf16) against Quark's
    file-to-file with its own MXFP6E2M3Scheme globally and MXFP6E3M2Scheme per attention pattern: each pattern's
    scheme chosen here from the module it names, not from our config; every shard and config.json equal."""
    from helpers import MXFP6_RECIPE
    from quark.torch import ModelQuantizer
    from quark.torch.quantization.config.config import QConfig
    from quark.torch.quantization.config.template import MXFP6E2M3Scheme, MXFP6E3M2Scheme

    recipe, out = tmp_path / "mxfp6.toml", tmp_path / "ours"
    recipe.write_text(MXFP6_RECIPE)
    cli("quantize", str(tiny_ckpt), str(out), "--recipe", str(recipe), "--quiet", check=True)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]

    def scheme(pattern: str):
        return MXFP6E3M2Scheme() if ".self_attn." in pattern and ".indexer." not in pattern else MXFP6E2M3Scheme()

    assert {type(scheme(p)).__name__ for p in qc["layer_quant_config"]} == {"MXFP6E3M2Scheme"}  # attention's
    config = QConfig(
        global_quant_config=MXFP6E2M3Scheme().config,  # the first rule's format is the global scheme
        layer_quant_config={p: scheme(p).config for p in qc["layer_quant_config"]},
        exclude=list(qc["exclude"]),
    )
    dst = tmp_path / "quark"
    ModelQuantizer(config).direct_quantize_checkpoint(str(tiny_ckpt), str(dst), device="cpu")
    ours, theirs = _files(out), _files(dst)
    assert set(theirs) <= set(ours)
    assert [n for n in theirs if ours[n] != theirs[n]] == [INDEX_NAME]  # total_size differs by design (as above)
    assert json.loads(ours[INDEX_NAME])["weight_map"] == json.loads(theirs[INDEX_NAME])["weight_map"]
