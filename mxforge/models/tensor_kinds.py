"""Classify checkpoint tensor names into the kinds users reason about (experts, attention, MTP, ...).

The kinds are one vocabulary (recipes select by them); which names fall into which kind is a model
family's data (`Family.kind_rules`, mxforge/models/); `LINEAGE_KIND_RULES` are those of the
DeepSeek-V3 lineage (DeepSeek, GLM), which names its modules alike.
"""

from __future__ import annotations

import re

from mxforge.formats import weight_of_scale

KINDS = (
    "experts",
    "shared_experts",
    "router",
    "dense_mlp",
    "indexer",
    "norms",
    "attention",
    "mtp_proj",
    "embeddings",
    "vision",
    "other",
)


def compile_rules(rules: tuple[tuple[str, str], ...]) -> tuple[tuple[str, re.Pattern], ...]:
    """(kind, regex) pairs, compiled; every kind must be in KINDS."""
    unknown = [k for k, _ in rules if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown tensor kinds {unknown}")
    return tuple((kind, re.compile(p)) for kind, p in rules)


# First match wins; patterns apply to the layer-relative name (after the layer's prefix: MoeLayout.locate), or the
# whole name for globals.
LINEAGE_KIND_RULES = compile_rules(
    (
        ("experts", r"^mlp\.experts\."),
        ("shared_experts", r"^mlp\.shared_experts\."),
        ("router", r"^mlp\.gate\.(weight|e_score_correction_bias)$"),
        ("dense_mlp", r"^mlp\.(gate|up|down)_proj\."),
        ("indexer", r"^self_attn\.indexer\.(wq_b|wk|weights_proj)\."),
        ("norms", r"(^|\.)([a-z_]*norm)\.(weight|bias)$"),
        ("attention", r"^self_attn\."),
        ("mtp_proj", r"^eh_proj\."),
        ("embeddings", r"^(model\.embed_tokens|lm_head)\."),
    )
)


def kind_of(local: str, rules: tuple[tuple[str, re.Pattern], ...] = LINEAGE_KIND_RULES) -> str:
    """The kind of a tensor under `rules`, from its layer-relative name (MoeLayout.kind_of finds it); an element
    format's scales, `X.weight_scale`, take their weight's kind."""
    local = weight_of_scale(local) or local
    for kind, pattern in rules:
        if pattern.search(local):
            return kind
    return "other"
