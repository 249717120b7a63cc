"""GLM-4.7-Flash: `Glm4MoeLiteForCausalLM` (model_type glm4_moe_lite).

DeepSeek-V3's layout at a smaller size: MLA attention (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj;
q_lora_rank 768, kv_lora_rank 512, 20 heads), 64 routed experts (top-4) and one shared expert, layer 0 dense
(`first_k_dense_replace` 1), no indexer; one MTP layer stored as `model.layers.47` (num_hidden_layers) with enorm,
hnorm, eh_proj, shared_head.norm and its own copies of the embedding (`embed_tokens`) and output head
(`shared_head.head`), as DeepSeek-V3's. Its engine classes are its own (sglang glm4_moe_lite[_nextn].py, vLLM
glm4_moe_lite[_mtp].py): the engine profiles' `[family.glm4_moe_lite]` tables.

Where the numbers come from: the config is zai-org/GLM-4.7-Flash's published config.json as vLLM's own test of
the family reproduces it (tests/transformers_utils, `_glm4_moe_lite_min_config`), with num_nextn_predict_layers 1
(read by every MTP loader of the family); the names and shapes are those of transformers' glm4_moe_lite modeling
code (the tiny fixture's non-MTP tensors equal what `Glm4MoeLiteForCausalLM.save_pretrained` writes, tested) and of
the engines' draft classes. No model.safetensors.index.json or shard list could be read here: the inventory is
derived (9,703 tensors, 31,221,488,576 parameters, 62,442,983,168 bytes in bf16) and checked against what is
published of the checkpoint: the bf16 release's 62.4 GB (a quantizer's model card) and the Hub's "31B" parameters,
which the derived inventory meets only with the MTP layer's own embedding and head (without them: 30.59 B, 61.17
GB). Not checked: the tensor count, the shard count (the full-layout fixture splits at 5 GB) and which tensor sits
in which shard. zai-org publishes no FP8 release of it.
"""

from __future__ import annotations

from mxforge.models.deepseek_v3 import KIND_RULES, DeepseekV3Layout
from mxforge.models.family import load_family


class Glm4MoeLiteLayout(DeepseekV3Layout):
    """DeepSeek-V3's layout (MLA, an MTP layer with its own embedding and head), as GLM-4.7-Flash stores it."""


FAMILY = load_family("glm-4.7-flash", layout=Glm4MoeLiteLayout, kind_rules=KIND_RULES)
Glm4MoeLiteLayout.family = FAMILY
