"""A family's layer names (mxforge.models.layer_names): where each global layer is stored, and the reverse, for
the lineage's `model.layers.N` and for a family that stores its decoder and MTP layers under other prefixes."""

from __future__ import annotations

import pytest

from mxforge.models import FAMILIES
from mxforge.models.layer_names import INDEX_DIGITS, LINEAGE, LayerNames

QWEN_LIKE = LayerNames(
    decoder="model.language_model.layers.{layer}",
    mtp="mtp.layers.{k}",
    mtp_block="mtp",
    mtp_block_modules=("fc", "norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"),
)


@pytest.mark.parametrize(
    ("names", "name", "where"),
    [
        (LINEAGE, "model.layers.0.mlp.experts.3.up_proj.weight", (0, "mlp.experts.3.up_proj.weight")),
        (LINEAGE, "model.layers.78.eh_proj.weight", (78, "eh_proj.weight")),
        (LINEAGE, "model.layers.95.enorm.weight", (95, "enorm.weight")),  # past config.json's layers: as stored
        (LINEAGE, "model.embed_tokens.weight", (None, "model.embed_tokens.weight")),
        (LINEAGE, "model.layers.x.weight", (None, "model.layers.x.weight")),
        (LINEAGE, "model.layers." + "9" * (INDEX_DIGITS + 1) + ".a", (None, "model.layers." + "9" * 7 + ".a")),
        (QWEN_LIKE, "model.language_model.layers.39.linear_attn.out_proj.weight", (39, "linear_attn.out_proj.weight")),
        (QWEN_LIKE, "mtp.layers.0.mlp.experts.gate_up_proj", (40, "mlp.experts.gate_up_proj")),
        (QWEN_LIKE, "mtp.fc.weight", (40, "fc.weight")),
        (QWEN_LIKE, "mtp.pre_fc_norm_hidden.weight", (40, "pre_fc_norm_hidden.weight")),
        (QWEN_LIKE, "mtp.unknown.weight", (None, "mtp.unknown.weight")),
        (
            QWEN_LIKE,
            "model.language_model.layers.40.mlp.gate.weight",
            (None, "model.language_model.layers.40.mlp.gate.weight"),
        ),
        (QWEN_LIKE, "model.visual.blocks.0.attn.qkv.weight", (None, "model.visual.blocks.0.attn.qkv.weight")),
        (QWEN_LIKE, "model.layers.0.mlp.gate.weight", (None, "model.layers.0.mlp.gate.weight")),
    ],
)
def test_a_name_is_placed_in_its_layer(names, name, where):
    assert names.locate(name, 40) == where


@pytest.mark.parametrize("names", [LINEAGE, QWEN_LIKE], ids=["lineage", "qwen-like"])
def test_placing_and_naming_are_inverse(names):
    hidden = 40
    for layer in (0, 17, 39, 40, 41):
        for local in ("mlp.experts.0.down_proj.weight", "self_attn.o_proj.weight", "fc.weight", "norm.weight"):
            stored = names.name(layer, local, hidden)
            assert names.locate(stored, hidden) == (layer, local), stored
    assert QWEN_LIKE.name(40, "fc.weight", hidden) == "mtp.fc.weight"
    assert QWEN_LIKE.name(41, "fc.weight", hidden) == "mtp.layers.1.fc.weight"  # the block is the first MTP layer's
    assert QWEN_LIKE.prefix(41, hidden) == "mtp.layers.1." and LINEAGE.prefix(41, hidden) == "model.layers.41."


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_tensor_a_family_plans_is_placed_in_the_layer_that_planned_it(family):
    from mxforge.models import layout_of
    from mxforge.models.fixture import preset_config

    layout = layout_of(preset_config("tiny", family=family)[0])
    placed = set()
    for layer in layout.all_layers:
        for t in layout.layer_tensors(layer):
            assert layout.layer_of(t.name) == layer, t.name
            placed.add(t.name)
    # the rest (embeddings, the final norm, lm_head, a vision tower) is in no layer; an MTP block's own modules
    # outside its layers (Qwen's mtp.fc) were placed in the MTP layer above
    rest = [t.name for t in layout.tensors() if t.name not in placed]
    assert rest and all(layout.layer_of(name) is None for name in rest)
