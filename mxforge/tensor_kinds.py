"""Classify checkpoint tensor names into the kinds users reason about (experts, attention, MTP, ...)."""

from __future__ import annotations

import re

LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

# First match wins; patterns apply to the name after `model.layers.N.` (or the whole name for globals).
KIND_RULES: tuple[tuple[str, re.Pattern], ...] = tuple((kind, re.compile(p)) for kind, p in (
    ("experts", r"^mlp\.experts\."),
    ("shared_experts", r"^mlp\.shared_experts\."),
    ("router", r"^mlp\.gate\.(weight|e_score_correction_bias)$"),
    ("dense_mlp", r"^mlp\.(gate|up|down)_proj\."),
    ("indexer", r"^self_attn\.indexer\.(wq_b|wk|weights_proj)\."),
    ("norms", r"(^|\.)([a-z_]*norm)\.(weight|bias)$"),
    ("attention", r"^self_attn\."),
    ("mtp_proj", r"^eh_proj\."),
    ("embeddings", r"^(model\.embed_tokens|lm_head)\."),
))
KINDS = tuple(k for k, _ in KIND_RULES) + ("other",)


def layer_of(name: str) -> int | None:
    m = LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def kind_of(name: str) -> str:
    """The kind of a tensor (scales such as `X.weight_scale` take their weight's kind)."""
    m = LAYER_RE.match(name)
    local = name[m.end():] if m else name
    local = re.sub(r"\.weight_scale$", ".weight", local)
    for kind, pattern in KIND_RULES:
        if pattern.search(local):
            return kind
    return "other"


def module_class(name: str, mtp_layers) -> str:
    """The class reports group a tensor under: its kind, or "mtp" for every tensor of an MTP layer."""
    return "mtp" if layer_of(name) in set(mtp_layers) else kind_of(name)
