"""Counts and per-layer lists read from config.json are checked, with ceilings, before anything is planned from
them: a hostile config is one ConfigError naming the field, never a hang, a MemoryError or a traceback."""

from __future__ import annotations

import json

import pytest
from helpers import deadline

from mxforge.errors import ConfigError
from mxforge.manifest_io import manifest_text
from mxforge.models import FAMILIES, layout_of


def _glm52() -> dict:
    return json.loads(manifest_text("models/glm-5.2.config.json"))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_hidden_layers", 10**12, "num_hidden_layers is 1,000,000,000,000, outside 1..1,024 (about 10x"),
        ("n_routed_experts", 10**9, "n_routed_experts is 1,000,000,000, outside 1..4,096"),
        ("num_hidden_layers", -5, "num_hidden_layers is -5, outside 1..1,024;"),
        ("num_hidden_layers", 0, "num_hidden_layers is 0, outside 1..1,024;"),
        ("num_nextn_predict_layers", 10**6, "num_nextn_predict_layers is 1,000,000, outside 0..16"),
        ("vocab_size", 10**10, "vocab_size is 10,000,000,000, outside 1..2,097,152"),
        ("first_k_dense_replace", -1, "first_k_dense_replace is -1, outside 0..1,024"),
        ("mlp_layer_types", ["sparse"] * 5, "mlp_layer_types must list one of ['dense', 'sparse'] for each of the 78"),
        ("mlp_layer_types", "sparse", "mlp_layer_types must list one of"),
        ("mlp_layer_types", ["sparse"] * 77 + ["moe"], "mlp_layer_types must list one of"),
        ("indexer_types", ["full"] * 3, "indexer_types must list one of ['full', 'shared'] for each of the 78"),
        ("index_topk_pattern", "FSX", "index_topk_pattern must list one of ['full', 'shared']"),
    ],
)
def test_a_hostile_config_field_is_one_error_naming_it(field, value, message):
    config = {**_glm52(), field: value}
    with deadline(10, f"reading a config with {field} = {str(value)[:20]}"):
        with pytest.raises(ConfigError, match="^config.json: " + message.replace("(", r"\(").replace("[", r"\[")):
            layout_of(config).tensors()


def test_counts_within_their_ceilings_but_too_many_tensors_together_are_refused():
    config = {**_glm52(), "num_hidden_layers": 1_000, "n_routed_experts": 4_000}
    with pytest.raises(ConfigError, match=r"1000 layers \(\+1 MTP\) of 4000 experts imply about 12,076,064 tensors"):
        layout_of(config)


def test_every_reference_config_is_well_inside_the_ceilings():
    """The ceilings are about 10x the families' real models: each reference config passes, and 10x each of its
    counts stays within the ceiling (the ceilings do not refuse a model a few times larger than today's)."""
    from mxforge.models.layout import FIELD_LIMITS

    for family in FAMILIES:
        config = json.loads(manifest_text(family.reference_config))
        layout_of(config)
        for field, (_, high) in FIELD_LIMITS.items():
            value = config.get(field)
            if isinstance(value, int) and value > 1:
                assert 4 * value <= high, f"{family.name}: {field} = {value}, ceiling {high}"


def test_a_layer_list_that_fits_is_used():
    config = {**_glm52(), "mlp_layer_types": ["dense"] * 78}
    layout = layout_of(config)
    assert not any(layout.is_moe(i) for i in range(78)) and layout.is_moe(78)
