"""DeepSeek-V3.2: `DeepseekV32ForCausalLM` (model_type deepseek_v32).

DeepSeek-V3's layout (MLA, layers 0-2 dense, MTP layer 61 with its own embed_tokens and shared_head.head)
plus DeepSeek sparse attention's lightning indexer (wq_b, wk, k_norm, weights_proj) on every layer, MTP
included; the published checkpoint stores every norm (and k_norm's bias) in float32.

Where the numbers come from: deepseek-ai/DeepSeek-V3.2's published config.json and its FP8 release's shard
headers (92,425 tensors, 685,396,921,376 elements, 163 shards; a public header dump), which this layout
reproduces exactly once each 128x128 block-scaled weight is given its weight_scale_inv (the indexer's
weights_proj, the routers, eh_proj, embeddings and heads are bf16 there).
"""

from __future__ import annotations

from dataclasses import dataclass

from mxforge.models.deepseek_v3 import KIND_RULES, DeepseekV3Layout
from mxforge.models.family import load_family
from mxforge.models.layout import DSA_FIELDS, LINEAGE_FIELDS, MLA_FIELDS, Spec, dsa_indexer_tensors, mla_tensors


@dataclass(frozen=True)
class DeepseekV32Layout(DeepseekV3Layout):
    REQUIRED_FIELDS = LINEAGE_FIELDS + MLA_FIELDS + DSA_FIELDS
    NORM_DTYPE = "F32"

    def has_indexer(self, layer: int) -> bool:
        return True

    def attention_tensors(self, layer: int) -> list[Spec]:
        return mla_tensors(self.config) + dsa_indexer_tensors(self.config)


FAMILY = load_family("deepseek-v3.2", layout=DeepseekV32Layout, kind_rules=KIND_RULES)
DeepseekV32Layout.family = FAMILY
