"""The engine core, table-driven, per engine profile: matching (exclude entries), modules (what each release
builds and under which names) and decide (MXFP4, bf16, or the engine raises). Built from config.json alone:
no checkpoint file, no wheel; milliseconds per row.

Each row's expectation rests on the release behaviours in helpers.py, which the `engines` suite proves against
the releases' own code; a new profile falls under the newest behaviour unless it joins one of those sets.
"""

from __future__ import annotations

import pytest
from helpers import BEFORE_GLM_DRAFT, EH_PROJ_LINEAR, GLM5, MTP, NO_EXPERT_CHILD_RULE

from mxforge.formats import MXFP4 as MXFP4_FORMAT
from mxforge.formats.quark import cached_quantization_config
from mxforge.models import layout_of
from mxforge.models.fixture import preset_config
from mxforge.validation.engine_check import decide, engine_view
from mxforge.validation.matching import ExcludeList, engine_excludes, is_glob
from mxforge.validation.modules import checkpoint_linears
from mxforge.validation.profiles import all_profiles
from mxforge.validation.tensor_forms import BF16

PROFILES = all_profiles(GLM5)
RAISES = None  # decide's form when the engine raises while deciding
CONFIG, _ = preset_config("tiny", family=GLM5)
LAYOUT = layout_of(CONFIG)
LINEARS = checkpoint_linears(LAYOUT)
# Quark's MXFP4 quantization_config: what an unexcluded module is built with
QC = cached_quantization_config(MXFP4_FORMAT, [])
MXFP4 = MXFP4_FORMAT.name  # the form validate gives a module stored (or built) in MXFP4
EXPERT_LAYER = 3
EXPERT_CHILDREN = [lin.name for lin in LINEARS[EXPERT_LAYER].experts]


def _vllm(p) -> bool:
    return p.engine == "vllm"


# (row, exclude, checkpoint module, expected form for a profile)
DECISIONS = [
    ("nothing excluded: attention is MXFP4", [], "model.layers.0.self_attn.o_proj", lambda p: MXFP4),
    ("lm_head is never quantized", [], "lm_head", lambda p: BF16),
    ("the router is never quantized", [], f"model.layers.{EXPERT_LAYER}.mlp.gate", lambda p: BF16),
    (
        "eh_proj is a plain nn.Linear in some drafts",
        [],
        f"model.layers.{MTP}.eh_proj",
        lambda p: BF16 if p.name in EH_PROJ_LINEAR else MXFP4,
    ),
    ("globs match nothing", ["*self_attn*"], "model.layers.0.self_attn.o_proj", lambda p: MXFP4),
    ("re: entries match by regex", ["re:.*self_attn.*"], "model.layers.0.self_attn.o_proj", lambda p: BF16),
    (
        "an exact entry excludes its module",
        ["model.layers.0.self_attn.o_proj"],
        "model.layers.0.self_attn.o_proj",
        lambda p: BF16,
    ),
    (
        "an MTP entry by its checkpoint name reaches the draft from sglang 0.5.16 on, and in vLLM",
        [f"model.layers.{MTP}.self_attn.o_proj"],
        f"model.layers.{MTP}.self_attn.o_proj",
        lambda p: MXFP4 if p.name in BEFORE_GLM_DRAFT else BF16,
    ),
    (
        "sglang builds the draft as model.decoder; vLLM under the checkpoint's name",
        ["model.decoder.self_attn.o_proj"],
        f"model.layers.{MTP}.self_attn.o_proj",
        lambda p: MXFP4 if _vllm(p) else BF16,
    ),
    (
        "entries naming every expert exclude the experts where the child rule exists",
        EXPERT_CHILDREN,
        f"model.layers.{EXPERT_LAYER}.mlp.experts",
        lambda p: MXFP4 if p.name in NO_EXPERT_CHILD_RULE else BF16,
    ),
    (
        "one shard of the fused qkv_a excluded: the engine raises",
        ["model.layers.0.self_attn.q_a_proj"],
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        lambda p: RAISES,
    ),
    (
        "both shards of the fused qkv_a excluded: bf16",
        ["model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"],
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        lambda p: BF16,
    ),
]


def _module(view, name: str):
    """The module the release builds as checkpoint module `name`, or that loads linear `name` (a fused one:
    the releases name it differently)."""
    found = [m for m in view.modules if m.checkpoint == name or name in {lin.name for lin in m.shards}]
    assert len(found) == 1, f"{view.profile.name} builds {len(found)} modules from {name}"
    return found[0]


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
@pytest.mark.parametrize("row, exclude, module, expected", DECISIONS, ids=[r[0] for r in DECISIONS])
def test_decide(profile, row, exclude, module, expected):
    view = engine_view(profile, LAYOUT, LINEARS, exclude, QC)
    assert decide(view, _module(view, module)).form == expected(profile), row


# (checkpoint module, its runtime name in sglang, in vLLM): where each engine builds the MTP layer.
RUNTIME_NAMES = [
    (f"model.layers.{MTP}.self_attn.o_proj", "model.decoder.self_attn.o_proj", f"model.layers.{MTP}.self_attn.o_proj"),
    (f"model.layers.{MTP}.mlp.experts", "model.decoder.mlp.experts", f"model.layers.{MTP}.mlp.experts"),
    (f"model.layers.{MTP}.eh_proj", "model.eh_proj", f"model.layers.{MTP}.eh_proj"),
    ("model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.o_proj"),
]


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
@pytest.mark.parametrize("checkpoint, sglang, vllm", RUNTIME_NAMES, ids=[r[0] for r in RUNTIME_NAMES])
def test_modules_runtime_names(profile, checkpoint, sglang, vllm):
    module = _module(engine_view(profile, LAYOUT, LINEARS, [], QC), checkpoint)
    assert module.runtime == (vllm if _vllm(profile) else sglang)
    assert module.is_mtp == checkpoint.startswith(f"model.layers.{MTP}.")


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_modules_cover_every_linear_once(profile):
    """Every checkpoint linear weight is loaded by exactly one module the engine builds (fused or not)."""
    view = engine_view(profile, LAYOUT, LINEARS, [], QC)
    loaded = [lin.name for m in view.modules for lin in m.shards]
    expected = [t.name[: -len(".weight")] for t in LAYOUT.tensors() if t.name.endswith(".weight") and len(t.shape) == 2]
    assert sorted(loaded) == sorted(expected)
    assert any(m.runtime.endswith(".mlp.gate_up_proj") and len(m.shards) == 2 for m in view.modules)


# (entry, is a glob): Quark's shell patterns vs the engines' exact names and re: regexes.
GLOBS = [
    ("*self_attn*", True),
    ("model.layers.[0-3].mlp", True),
    ("model.layers.?.eh_proj", True),
    ("model.layers.0.self_attn.o_proj", False),
    ("re:.*self_attn.*", False),
    ("re:model\\.layers\\.[0-3]", False),
]


@pytest.mark.parametrize("entry, glob", GLOBS)
def test_is_glob(entry, glob):
    assert is_glob(entry) is glob


# (entries, prefix, matching entry): exact names and re: regexes (re.match: anchored at the start only).
MATCHES = [
    (["model.layers.0.self_attn.o_proj"], "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.o_proj"),
    (["model.layers.0.self_attn"], "model.layers.0.self_attn.o_proj", None),  # a parent is not a match
    (["*self_attn*"], "model.layers.0.self_attn.o_proj", None),
    (["re:.*o_proj"], "model.layers.0.self_attn.o_proj", "re:.*o_proj"),
    (["re:o_proj"], "model.layers.0.self_attn.o_proj", None),  # re.match, not re.search
    (["re:[unclosed"], "model.layers.0.self_attn.o_proj", None),  # a bad regex matches nothing (reported elsewhere)
]


@pytest.mark.parametrize("entries, prefix, entry", MATCHES)
def test_matching_entry(entries, prefix, entry):
    assert ExcludeList(tuple(entries)).matching_entry(prefix) == entry


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_expert_child_rule(profile):
    """`engine_excludes` on the experts module: a child entry counts only where the release has the rule."""
    children = ExcludeList((f"model.layers.{EXPERT_LAYER}.mlp.experts.0.gate_proj",))
    assert engine_excludes(profile, f"model.layers.{EXPERT_LAYER}.mlp.experts", True, children) == (
        profile.name not in NO_EXPERT_CHILD_RULE
    )


@pytest.mark.parametrize(
    ("profile", "like"),
    [
        ("sglang-0.5.9", "glm5_next_typo"),  # no such table
        ("sglang-0.5.9", "glm4_moe_lite"),  # unsupported there
        ("vllm-0.30.0", "qwen3_5_moe_text"),  # itself like another
        ("vllm-0.30.0", 7),
    ],
    ids=["unknown", "unsupported", "like", "int"],
)
def test_a_like_naming_no_table_of_its_own_is_one_error_naming_file_and_entry(profile, like):
    """`like` must name a family whose table in the same profile is its own and supported."""
    from mxforge.errors import ConfigError
    from mxforge.validation.profiles import _family_table, _raw

    raw = {**_raw(profile), "family": {**_raw(profile)["family"], "toy": {"like": like}}}
    with pytest.raises(ConfigError) as e:
        _family_table(raw, profile, "toy")
    assert e.value.filename == f"manifests/engines/{profile}.toml" and e.value.entry == "family.toy.like"
    assert "\n" not in str(e.value) and repr(like) in str(e.value)
