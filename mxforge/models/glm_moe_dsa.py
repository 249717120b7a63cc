"""GLM-5 / 5.1 / 5.2: `GlmMoeDsaForCausalLM` (model_type glm_moe_dsa).

MLA attention with DeepSeek's sparse-attention indexer on "full" IndexShare layers only (transformers'
`indexer_types`); MTP layer(s) at `num_hidden_layers` (GLM-5.2: layer 78). Inventory figures:
/work/shared/reference/glm-5.2.md (zai-org/GLM-5.2 config.json and model.safetensors.index.json).

The FP8 release (zai-org/GLM-5.2-FP8: 118,629 tensors, 755,617,140,416 bytes, same reference) is DeepSeek-style
128x128 block FP8 (`weight_scale_inv`, as GLM-5-FP8 loaders read it): the layout reproduces both figures exactly
when every 2-D weight is F8_E4M3 with its F32 scales except the router (`mlp.gate`), `eh_proj`, the embedding,
`lm_head` and the indexer's `weights_proj` (bf16), and no other choice of bf16 weights does
(tests/quantize/test_fp8_source.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mxforge.models.family import load_family
from mxforge.models.layout import (
    DSA_FIELDS,
    LAYER_LISTS,
    LINEAGE_FIELDS,
    LINEAGE_OPTIONAL_INT_FIELDS,
    MLA_FIELDS,
    MoeLayout,
    Spec,
    dsa_indexer_tensors,
    mla_tensors,
)
from mxforge.models.tensor_kinds import LINEAGE_KIND_RULES

INDEXER_TYPES = ("full", "shared")
PATTERN_CODES = {"F": "full", "S": "shared"}  # index_topk_pattern's letters


@dataclass(frozen=True)
class GlmMoeDsaLayout(MoeLayout):
    REQUIRED_FIELDS = LINEAGE_FIELDS + MLA_FIELDS + DSA_FIELDS
    OPTIONAL_INT_FIELDS: ClassVar[tuple[str, ...]] = LINEAGE_OPTIONAL_INT_FIELDS + (
        "index_topk_freq",
        "index_skip_topk_offset",
    )
    LAYER_LISTS = {**LAYER_LISTS, "indexer_types": INDEXER_TYPES}

    def __post_init__(self):
        super().__post_init__()
        pattern = self.config.get("index_topk_pattern")
        if self.config.get("indexer_types") is None and pattern is not None:
            self._check_layer_list(
                "index_topk_pattern",
                [PATTERN_CODES.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern,
                INDEXER_TYPES,
            )

    def indexer_types(self) -> list[str]:
        """ "full" or "shared" per decoder layer, as transformers derives it (explicit list, pattern, or schedule)."""
        explicit = self.config.get("indexer_types")
        if explicit is not None:
            return list(explicit)
        pattern = self.config.get("index_topk_pattern")
        if pattern is not None:
            return [PATTERN_CODES[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        freq = max(int(self.config.get("index_topk_freq", 1) or 1), 1)
        offset = int(self.config.get("index_skip_topk_offset", 2))
        return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(self.num_hidden_layers)]

    def has_indexer(self, layer: int) -> bool:
        """Full IndexShare layers store indexer tensors; shared ones do not; MTP layers always do."""
        return self.is_mtp(layer) or self.indexer_types()[layer] == "full"

    def attention_tensors(self, layer: int) -> list[Spec]:
        return mla_tensors(self.config) + (dsa_indexer_tensors(self.config) if self.has_indexer(layer) else [])


FAMILY = load_family("glm-5.2", layout=GlmMoeDsaLayout, kind_rules=LINEAGE_KIND_RULES)
GlmMoeDsaLayout.family = FAMILY
