"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air: `Glm4MoeForCausalLM` (model_type glm4_moe).

Grouped-query attention (q_proj, k_proj, v_proj with biases when `attention_bias`, o_proj without; per-head
q_norm / k_norm when `use_qk_norm`; partial rotary, which stores nothing); layers below
`first_k_dense_replace` dense; one MTP layer stored as `model.layers.{num_hidden_layers}` (GLM-4.5 / 4.6 /
4.7: 92, Air: 46) with enorm, hnorm, eh_proj, shared_head.norm, and its own copies of the embedding
(`embed_tokens`) and output head (`shared_head.head`), as DeepSeek-V3's MTP layer; GLM-4.6 ships the MTP layer
without those two (vLLM's and sglang's own code then use the model's; both layouts validate).

Where the numbers come from: the config is zai-org/GLM-4.5's published config.json (92 layers, 160 routed
experts, hidden 5120, 96 heads / 8 KV heads of 128, GQA; GLM-4.6 and 4.7 publish the same shapes with
max_position_embeddings 202752; GLM-4.5-Air: 46 layers, first_k_dense_replace 1, 128 experts, hidden 4096,
intermediate 10944, moe_intermediate 1408, use_qk_norm false). The names and shapes are those of
transformers' glm4_moe modeling code (the tiny fixture's non-MTP tensors equal what
`Glm4MoeForCausalLM.save_pretrained` writes, tested; transformers ignores `model.layers.92.*` / `.46.*` on
load: the MTP layer) and of sglang's Glm4MoeForCausalLMNextN, which loads the MTP layer's embed_tokens,
shared_head.head and shared_head.norm. No published model.safetensors.index.json could be read here: the
inventory is derived, and checked against what the Hub publishes of zai-org/GLM-4.5 (358.34 B parameters,
93 shards: both reproduced, the parameter count only with the MTP layer's own embedding and head).

GLM-4.7-Flash is not this family: it is `Glm4MoeLiteForCausalLM` (model_type glm4_moe_lite:
mxforge/models/glm4_moe_lite.py), MLA attention as DeepSeek-V3 (q_lora_rank 768, kv_lora_rank 512), 64 experts,
with engine classes of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from mxforge.models.deepseek_v3 import KIND_RULES
from mxforge.models.family import load_family
from mxforge.models.layout import LINEAGE_FIELDS, LINEAGE_OPTIONAL_INT_FIELDS, MoeLayout, Spec


@dataclass(frozen=True)
class Glm4MoeLayout(MoeLayout):
    REQUIRED_FIELDS = LINEAGE_FIELDS + ("num_key_value_heads",)
    OPTIONAL_INT_FIELDS = LINEAGE_OPTIONAL_INT_FIELDS + ("head_dim",)
    # GLM-4.6 (unlike GLM-4.5) ships its MTP layer without its own embedding and head; vLLM's Glm4MoeMTP loads
    # lm_head.weight / model.embed_tokens.weight into them, sglang's NextN worker gives the draft the target's
    # (tests/validation/test_mtp_own_head.py runs and reads that code of every release).
    OMITTABLE_MTP_TENSORS = ("embed_tokens.weight", "shared_head.head.weight")
    MTP_OWN_HEAD = True  # GLM-4.5's MTP layer stores its own shared_head.head and embed_tokens

    @property
    def head_dim(self) -> int:
        return int(
            self.config.get("head_dim") or int(self.config["hidden_size"]) // int(self.config["num_attention_heads"])
        )

    def attention_tensors(self, layer: int) -> list[Spec]:
        """GQA projections (q/k/v with biases when attention_bias), o_proj, and qk-norm when use_qk_norm."""
        c = self.config
        h, d = int(c["hidden_size"]), self.head_dim
        q, kv = int(c["num_attention_heads"]) * d, int(c["num_key_value_heads"]) * d
        out: list[Spec] = []
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append((f"self_attn.{proj}.weight", (rows, h), "BF16"))
            if c.get("attention_bias", False):
                out.append((f"self_attn.{proj}.bias", (rows,), "BF16"))
        out.append(("self_attn.o_proj.weight", (h, q), "BF16"))
        if c.get("use_qk_norm", False):
            out += [("self_attn.q_norm.weight", (d,), "BF16"), ("self_attn.k_norm.weight", (d,), "BF16")]
        return out


FAMILY = load_family("glm-4.5", layout=Glm4MoeLayout, kind_rules=KIND_RULES)
Glm4MoeLayout.family = FAMILY
