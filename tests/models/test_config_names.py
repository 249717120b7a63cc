"""Where a family's config.json keeps its language model's fields (mxforge.models.config_names): the lineage's top
level under mxforge's names, and a family that nests them in `text_config` under names of its own (Qwen3.5 MoE's
`num_experts`, `mtp_num_hidden_layers`)."""

from __future__ import annotations

import pytest

from mxforge.errors import ConfigError
from mxforge.models import FAMILIES
from mxforge.models.config_names import TOP_LEVEL, ConfigNames

QWEN_LIKE = ConfigNames(
    text="text_config",
    fields=(("n_routed_experts", "num_experts"), ("num_nextn_predict_layers", "mtp_num_hidden_layers")),
)
NESTED = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": True,
    "quantization_config": {"quant_method": "quark"},
    "vision_config": {"depth": 27, "hidden_size": 1152},
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_experts": 256,
        "n_routed_experts": 7,  # not this family's name: never read
        "mtp_num_hidden_layers": 1,
        "tie_word_embeddings": False,
    },
}


def test_a_nested_text_config_is_read_under_mxforges_names():
    view = QWEN_LIKE.view(NESTED)
    assert view["hidden_size"] == 2048 and view["n_routed_experts"] == 256 and view["num_nextn_predict_layers"] == 1
    assert "num_experts" not in view and "mtp_num_hidden_layers" not in view and "text_config" not in view
    assert view["tie_word_embeddings"] is False and view["model_type"] == "qwen3_5_moe_text"  # the text config's
    assert view["architectures"] == NESTED["architectures"] and view["vision_config"] == NESTED["vision_config"]
    assert QWEN_LIKE.where("num_nextn_predict_layers") == "text_config.mtp_num_hidden_layers"
    assert QWEN_LIKE.where("hidden_size") == "text_config.hidden_size"
    assert TOP_LEVEL.where("num_nextn_predict_layers") == "num_nextn_predict_layers"


def test_fields_are_written_back_where_the_family_keeps_them_and_nothing_else_moves():
    before = {**NESTED, "text_config": dict(NESTED["text_config"])}
    out = QWEN_LIKE.updated(NESTED, {"n_routed_experts": 8, "num_nextn_predict_layers": 0, "hidden_size": 64})
    assert NESTED == before  # a copy: the input is untouched
    assert out["text_config"]["num_experts"] == 8 and out["text_config"]["mtp_num_hidden_layers"] == 0
    assert out["text_config"]["hidden_size"] == 64 and out["text_config"]["n_routed_experts"] == 7
    assert {k: v for k, v in out.items() if k != "text_config"} == {
        k: v for k, v in NESTED.items() if k != "text_config"
    }
    assert QWEN_LIKE.view(out)["n_routed_experts"] == 8
    flat = {"hidden_size": 1, "n_routed_experts": 2}
    assert TOP_LEVEL.view(flat) == flat and TOP_LEVEL.updated(flat, {"n_routed_experts": 3}) == {
        **flat,
        "n_routed_experts": 3,
    }


@pytest.mark.parametrize(
    ("text", "what"), [(..., "missing"), (None, "null"), ([1, 2], "a list"), ("x", "a str")], ids=str
)
def test_a_text_config_that_is_not_an_object_is_one_clear_error(text, what):
    config = {k: v for k, v in NESTED.items() if k != "text_config"}
    if text is not ...:
        config["text_config"] = text
    with pytest.raises(ConfigError, match=f"config.json: text_config is {what}; this family keeps") as e:
        QWEN_LIKE.view(config)
    assert e.value.entry == "text_config"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_reads_its_reference_config_and_its_fixtures_through_its_names(family):
    """A family's layout is built from the view (Family.layout_of); its reference config and every fixture preset
    have the fields its layout requires where the family keeps them."""
    from mxforge.models.fixture import preset_config

    view = family.config.view(family.reference())
    assert all(field in view for field in family.layout.REQUIRED_FIELDS)
    for preset in family.fixture_presets():
        config = preset_config(preset, family=family)[0]
        assert family.layout_of(config).config == family.config.view(config)
