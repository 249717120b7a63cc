"""DeepSeek-V3 / R1 / V3.1: `DeepseekV3ForCausalLM` (model_type deepseek_v3).

MLA attention (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj), no indexer; layers below
`first_k_dense_replace` (3) dense; one MTP layer stored as `model.layers.61` (num_hidden_layers), which
also carries its own copies of the embedding (`embed_tokens`) and output head (`shared_head.head`).

Where the numbers come from: the config is deepseek-ai/DeepSeek-V3's published config.json (R1 and V3.1
publish the same shapes); the tensor names and the MTP layer's contents are those of transformers'
deepseek_v3 modeling code and of the published FP8 release, whose inventory (91,991 tensors,
684,531,386,000 elements, 163 shards, of which 45,808 are `weight_scale_inv`) was read from its
model.safetensors shard headers (a public dump of deepseek-ai/DeepSeek-R1); README_WEIGHTS.md of
deepseek-ai/DeepSeek-V3 documents the MTP module and the 128x128 FP8 block scales.
"""

from __future__ import annotations

from dataclasses import dataclass

from mxforge.models.family import load_family
from mxforge.models.layout import LINEAGE_FIELDS, MLA_FIELDS, MoeLayout, Spec, mla_tensors
from mxforge.models.tensor_kinds import LINEAGE_KIND_RULES, compile_rules


@dataclass(frozen=True)
class DeepseekV3Layout(MoeLayout):
    REQUIRED_FIELDS = LINEAGE_FIELDS + MLA_FIELDS
    MTP_OWN_HEAD = True  # the MTP module's shared_head holds its own output head; it has its own embedding

    def attention_tensors(self, layer: int) -> list[Spec]:
        return mla_tensors(self.config)


# The MTP layer's embedding and output head are embeddings, as the model's own are.
KIND_RULES = compile_rules((("embeddings", r"^(embed_tokens|shared_head\.head)\."),)) + LINEAGE_KIND_RULES

FAMILY = load_family("deepseek-v3", layout=DeepseekV3Layout, kind_rules=KIND_RULES)
DeepseekV3Layout.family = FAMILY
