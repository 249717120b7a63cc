"""Qwen3.5 / 3.6 / 3.8 MoE, text only: `Qwen3_5MoeForCausalLM` (model_type qwen3_5_moe_text), the form of the 2.4T
model and of text-only exports of the others.

The language model of `Qwen3_5MoeForConditionalGeneration` (mxforge/models/qwen3_5_moe.py: its layers, experts,
shared expert and MTP block, tensor for tensor), stored under other names: the text model under `model.*` (its
family.toml's `[layers]`), its fields at the top level of config.json under Qwen's names (`[config]`: `num_experts`,
`mtp_num_hidden_layers`), and no vision tower. The MTP block keeps its own prefix, `mtp.*`.

Where the numbers come from: transformers' `Qwen3_5MoeForCausalLM` (the tiny fixture's tensors outside `mtp.*` equal
what its save_pretrained writes: tested) and the engines' classes for this architecture (sglang models/qwen3_5_text.py
from 0.5.17, vLLM models/qwen3_5.py: the text model built under `model.`; their MTP drafts, the same as the
multimodal model's, under `mtp.`). The 2.4T model's config could not be read here: the reference config is
Qwen3.5-35B-A3B's language model (qwen3.5-moe.config.json's text_config) as transformers' `Qwen3_5MoeTextConfig`
reproduces it by default, so the inventory is derived only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mxforge.models.family import load_family
from mxforge.models.qwen3_5_moe import KIND_RULES, Qwen3_5MoeLayout


@dataclass(frozen=True)
class Qwen3_5MoeTextLayout(Qwen3_5MoeLayout):
    """Qwen3.5 MoE's language model stored on its own: under `model.*`, no vision tower, the MTP block under `mtp`."""

    TEXT_PREFIX = "model."
    VISION_FIELDS: ClassVar[tuple[str, ...]] = ()  # no vision tower: a `vision_config` in its config.json is not read


FAMILY = load_family("qwen3.5-moe-text", layout=Qwen3_5MoeTextLayout, kind_rules=KIND_RULES)
Qwen3_5MoeTextLayout.family = FAMILY
