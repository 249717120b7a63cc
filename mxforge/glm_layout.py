"""The GlmMoeDsaForCausalLM checkpoint layout, derived from config.json alone.

Nothing here assumes GLM-5.2's 78 layers or 256 experts: every count comes from the config, and the
MTP ("next-n") layers are always stored as `model.layers.{num_hidden_layers + k}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConfigError
from .safetensors_io import PlannedTensor

REQUIRED_FIELDS = (
    "hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "num_attention_heads", "index_n_heads", "index_head_dim", "vocab_size", "first_k_dense_replace",
)
OPTIONAL_INT_FIELDS = ("num_nextn_predict_layers", "n_shared_experts", "index_topk_freq", "index_skip_topk_offset")


@dataclass(frozen=True)
class GlmLayout:
    """Per-layer structure of a GLM-MoE-DSA checkpoint."""

    config: Mapping[str, Any]

    def __post_init__(self):
        missing = [k for k in REQUIRED_FIELDS if k not in self.config]
        if missing:
            raise ConfigError(f"config.json lacks GLM-MoE-DSA fields {missing}; is this a GlmMoeDsaForCausalLM checkpoint?")
        for key in REQUIRED_FIELDS + OPTIONAL_INT_FIELDS:
            value = self.config.get(key)
            if (key in REQUIRED_FIELDS or value is not None) and (isinstance(value, bool) or not isinstance(value, int)):
                digits = value.strip() if isinstance(value, str) and value.strip().isdigit() else "<integer>"
                raise ConfigError(f"config.json: {key} is {value!r} ({type(value).__name__}), not a whole number; "
                                  f"write it as a JSON integer (\"{key}\": {digits}, no quotes)")

    def __getitem__(self, key: str) -> Any:
        return self.config[key]

    @property
    def num_hidden_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def mtp_layers(self) -> range:
        """Layer indices of the MTP layers: num_hidden_layers .. + num_nextn_predict_layers - 1."""
        n = int(self.config.get("num_nextn_predict_layers", 0) or 0)
        return range(self.num_hidden_layers, self.num_hidden_layers + n)

    @property
    def all_layers(self) -> range:
        return range(self.num_hidden_layers + len(self.mtp_layers))

    def is_mtp(self, layer: int) -> bool:
        return layer in self.mtp_layers

    def is_moe(self, layer: int) -> bool:
        """MoE unless listed dense (`mlp_layer_types`) or before `first_k_dense_replace`; MTP layers are MoE."""
        if self.is_mtp(layer):
            return True
        types = self.config.get("mlp_layer_types")
        if types:
            return types[layer] == "sparse"
        return layer >= int(self.config["first_k_dense_replace"])

    def indexer_types(self) -> list[str]:
        """"full" or "shared" per decoder layer, as transformers derives it (explicit list, pattern, or schedule)."""
        explicit = self.config.get("indexer_types")
        if explicit:
            return list(explicit)
        pattern = self.config.get("index_topk_pattern")
        if pattern is not None:
            return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        freq = max(int(self.config.get("index_topk_freq", 1) or 1), 1)
        offset = int(self.config.get("index_skip_topk_offset", 2))
        return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(self.num_hidden_layers)]

    def has_indexer(self, layer: int) -> bool:
        """Full IndexShare layers store indexer tensors; shared ones do not; MTP layers always do."""
        return self.is_mtp(layer) or self.indexer_types()[layer] == "full"

    def layer_tensors(self, layer: int) -> list[PlannedTensor]:
        c = self.config
        h = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        q_head = int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])
        p = f"model.layers.{layer}."
        out: list[tuple[str, tuple[int, ...], str]] = []
        if self.is_mtp(layer):
            out += [("enorm.weight", (h,), "BF16"), ("hnorm.weight", (h,), "BF16"), ("eh_proj.weight", (h, 2 * h), "BF16")]
        out += [
            ("input_layernorm.weight", (h,), "BF16"),
            ("self_attn.q_a_proj.weight", (int(c["q_lora_rank"]), h), "BF16"),
            ("self_attn.q_a_layernorm.weight", (int(c["q_lora_rank"]),), "BF16"),
            ("self_attn.q_b_proj.weight", (heads * q_head, int(c["q_lora_rank"])), "BF16"),
            ("self_attn.kv_a_proj_with_mqa.weight", (int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"]), h), "BF16"),
            ("self_attn.kv_a_layernorm.weight", (int(c["kv_lora_rank"]),), "BF16"),
            ("self_attn.kv_b_proj.weight",
             (heads * (int(c["qk_nope_head_dim"]) + int(c["v_head_dim"])), int(c["kv_lora_rank"])), "BF16"),
            ("self_attn.o_proj.weight", (h, heads * int(c["v_head_dim"])), "BF16"),
        ]
        if self.has_indexer(layer):
            ih, ihd = int(c["index_n_heads"]), int(c["index_head_dim"])
            out += [
                ("self_attn.indexer.wq_b.weight", (ih * ihd, int(c["q_lora_rank"])), "BF16"),
                ("self_attn.indexer.wk.weight", (ihd, h), "BF16"),
                ("self_attn.indexer.k_norm.weight", (ihd,), "BF16"),
                ("self_attn.indexer.k_norm.bias", (ihd,), "BF16"),
                ("self_attn.indexer.weights_proj.weight", (ih, h), "BF16"),
            ]
        out.append(("post_attention_layernorm.weight", (h,), "BF16"))
        if self.is_moe(layer):
            e, inter = int(c["n_routed_experts"]), int(c["moe_intermediate_size"])
            out += [("mlp.gate.weight", (e, h), "BF16"), ("mlp.gate.e_score_correction_bias", (e,), "F32")]
            for j in range(e):
                out += _mlp(f"mlp.experts.{j}.", h, inter)
            n_shared = int(c.get("n_shared_experts", 1) or 0)
            if n_shared:
                out += _mlp("mlp.shared_experts.", h, inter * n_shared)
        else:
            out += _mlp("mlp.", h, int(c["intermediate_size"]))
        if self.is_mtp(layer):
            out.append(("shared_head.norm.weight", (h,), "BF16"))
        return [PlannedTensor(p + name, dtype, shape) for name, shape, dtype in out]

    def tensors(self) -> list[PlannedTensor]:
        """Every tensor of the bf16 checkpoint in storage order: embeddings, decoder layers, head, MTP layers last."""
        h, v = int(self.config["hidden_size"]), int(self.config["vocab_size"])
        out = [PlannedTensor("model.embed_tokens.weight", "BF16", (v, h))]
        for layer in range(self.num_hidden_layers):
            out += self.layer_tensors(layer)
        out.append(PlannedTensor("model.norm.weight", "BF16", (h,)))
        if not self.config.get("tie_word_embeddings", False):
            out.append(PlannedTensor("lm_head.weight", "BF16", (v, h)))
        for layer in self.mtp_layers:
            out += self.layer_tensors(layer)
        return out


def _mlp(prefix: str, hidden: int, inter: int) -> list[tuple[str, tuple[int, ...], str]]:
    return [
        (prefix + "gate_proj.weight", (inter, hidden), "BF16"),
        (prefix + "up_proj.weight", (inter, hidden), "BF16"),
        (prefix + "down_proj.weight", (hidden, inter), "BF16"),
    ]
