"""The model card's precision table and format tags for every element format, mixed: each module class's tensors
counted in the format its recipe rule wrote (MXFP6 E2M3 and E3M2 are stored alike, uint8 codes and E8M0 scales: the
card tells them apart by each module's layer config, as dequantize and validate do), FP8 PTPC, and block FP8 kept
from an FP8 source."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from helpers import MXFP6_RECIPE, cli

from mxforge.checkpoint import Checkpoint
from mxforge.hub.card import precision_table, render_model_card
from mxforge.models import layout_of

# recipe -> (the format each quantized or kept attention weight is in, the experts'), by the recipe's own rules
CASES = {
    "mxfp6": ("MXFP6 E3M2", "MXFP6 E2M3"),
    "glm-5.2-mxfp4-attn-fp8": ("FP8 PTPC", "MXFP4"),
    "glm-5.2-mxfp4-keep-fp8": ("FP8 block", "MXFP4"),  # from the block-FP8 release: attention kept as stored
}


@pytest.fixture(scope="module", params=sorted(CASES))
def card_case(request, fixture_ckpt, tmp_path_factory) -> tuple[str, Path]:
    work = tmp_path_factory.mktemp(f"card-{request.param}")
    recipe = request.param
    src = fixture_ckpt("tiny", precision="fp8")[0] if recipe.endswith("keep-fp8") else fixture_ckpt("tiny")[0]
    if recipe == "mxfp6":
        (work / "mxfp6.toml").write_text(MXFP6_RECIPE)
        recipe = str(work / "mxfp6.toml")
    cli("quantize", str(src), str(work / "out"), "--recipe", recipe, "--quiet", check=True)
    return request.param, work / "out"


def test_each_module_class_is_counted_in_the_format_its_rule_wrote(card_case):
    name, out = card_case
    attention, experts = CASES[name]
    ckpt = Checkpoint.open(out)
    layout, infos = layout_of(ckpt.config), ckpt.tensor_infos()
    table = precision_table(ckpt)
    weights = Counter(
        layout.kind_of(n)
        for n in infos
        if n.endswith(".weight") and not layout.in_mtp_layer(n) and n + "_scale" in infos
    )
    # every decoder attention weight with scales beside it is in the attention rule's format, the experts in theirs
    assert table["attention"][attention] == weights["attention"] > 0, table["attention"]
    assert table["experts"] == Counter({experts: weights["experts"]}), table["experts"]
    assert not any(fmt.startswith(attention) for fmt in table["experts"])
    card = render_model_card(ckpt, repo_id="alice/card", files=[], validation={}, forced=False, push_command=None)
    assert f"| attention | {sum(table['attention'].values())} | " in card
    assert f"{attention} ×{weights['attention']}" in card.split("| attention |")[1].splitlines()[0]
    tags = card.split("---")[1]
    for title in {attention, experts}:
        tag = {"MXFP6 E3M2": "mxfp6_e3m2", "MXFP6 E2M3": "mxfp6_e2m3", "FP8 PTPC": "fp8_ptpc", "FP8 block": "fp8_block"}
        assert f"- {tag.get(title, 'mxfp4')}\n" in tags, tags
