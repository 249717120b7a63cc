"""Qwen3.5 / 3.6 / 3.8 MoE: `Qwen3_5MoeForConditionalGeneration` (model_type qwen3_5_moe). The text-only
`Qwen3_5MoeForCausalLM` (qwen3_5_moe_text: a flat config, the text model under `model.*`, no vision tower) is the same
layout under other names: its own family, mxforge/models/qwen3_5_moe_text.py.

A hybrid text model under `model.language_model.*` (its family.toml's `[layers]`; its fields nested in
`text_config` under Qwen's names: `[config]`): per `layer_types` (else every `full_attention_interval`-th layer)
either a gated delta net (`linear_attn`: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, a depthwise conv1d, dt_bias,
A_log, a head norm, out_proj) or gated full attention (`self_attn`: q_proj twice the heads' width, the second half
the output gate; k_proj, v_proj, o_proj, q_norm, k_norm); every layer MoE: a router (`mlp.gate`), routed experts
stored one by one (`mlp.experts.{j}.gate_proj/up_proj/down_proj`), one shared expert (`mlp.shared_expert.*`, singular)
and its sigmoid gate (`mlp.shared_expert_gate`, one row). A vision tower (`model.visual.*`, Qwen3-VL's: a Conv3d
patch embedding, learned position embedding, `depth` blocks, a patch merger) that mxforge leaves bf16. The MTP layer
lies outside the text model: `mtp.fc` (the [embedding, hidden] projection), `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, one full-attention MoE layer `mtp.layers.0.*` and `mtp.norm` (no head of its own).

Where the numbers come from: the names and shapes are those of transformers' qwen3_5_moe modeling code (the tiny
fixture's tensors outside `mtp.*`, which transformers does not build, equal what
`Qwen3_5MoeForConditionalGeneration.save_pretrained` writes: routed experts one by one, as the engines' loaders read
them; tested) and of the engines' draft classes (sglang qwen3_5_mtp.py, vLLM qwen3_5_mtp.py: the `mtp.*` names). The
reference config is Qwen/Qwen3.5-35B-A3B's as transformers' `Qwen3_5MoeConfig` reproduces it by default (its
docstring's checkpoint), with the published `mtp_num_hidden_layers` 1 and the vision merger's `out_hidden_size` set
to the text model's hidden size (the merger feeds the text embedding; the class's default, 3584, is another model's).
No model.safetensors.index.json could be read here: the inventory is derived and checked only against the Hub's
rounded parameter count (35 B; tests/models/test_families.py). Not checked: tensor and shard counts, storage order,
the dtypes of A_log / dt_bias (bf16 here). Checkpoints storing the routed experts fused as 3-D tensors
(`mlp.experts.gate_up_proj`) are another layout, not read: quantize refuses them with one error naming the tensor
(quantize/plan.py `refuse_fused_experts`; before, their experts, not 2-D linear weights, were copied bf16).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from mxforge.models.family import load_family
from mxforge.models.layout import MoeLayout, Spec, mlp_tensors
from mxforge.models.tensor_kinds import compile_rules
from mxforge.safetensors_io import PlannedTensor

LAYER_TYPES = ("linear_attention", "full_attention")
VISUAL = "model.visual."  # the vision tower's prefix (global: no layer)
NORM_WEIGHT = re.compile(r"norm[a-z0-9_]*\.weight$")
# First match wins, on the layer-relative name (the whole name for a global tensor: the vision tower, embeddings)
KIND_RULES = compile_rules(
    (
        ("vision", r"^model\.visual\."),
        ("experts", r"^mlp\.experts\."),
        ("shared_experts", r"^mlp\.shared_expert\."),
        ("router", r"^mlp\.(gate|shared_expert_gate)\.weight$"),
        ("norms", r"(^|\.)([a-z_]*norm[a-z_]*)\.(weight|bias)$"),
        ("attention", r"^(self_attn|linear_attn)\."),
        ("mtp_proj", r"^fc\."),
        ("embeddings", r"^(model\.(language_model\.)?embed_tokens|lm_head)\."),  # the text-only model's too
    )
)


@dataclass(frozen=True)
class Qwen3_5MoeLayout(MoeLayout):
    """Qwen3.5 MoE's checkpoint: hybrid attention, every layer MoE, a vision tower, the MTP block under `mtp`."""

    REQUIRED_FIELDS = (
        "hidden_size",
        "num_hidden_layers",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "n_routed_experts",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "vocab_size",
    )
    OPTIONAL_INT_FIELDS = ("num_nextn_predict_layers", "full_attention_interval")
    LAYER_LISTS = {"layer_types": LAYER_TYPES}
    MTP_PROJ = "fc"
    MTP_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden")
    TEXT_PREFIX = "model.language_model."
    VISION_FIELDS: ClassVar[tuple[str, ...]] = (
        "depth",
        "hidden_size",
        "intermediate_size",
        "in_channels",
        "patch_size",
        "temporal_patch_size",
    )
    VISION_DEFAULTS = {"spatial_merge_size": 2, "num_position_embeddings": 2304}

    def norm_center(self, name: str) -> float | None:
        """Qwen3.5's RMSNorms scale by (1 + w) and are trained from zero (transformers' Qwen3_5MoeRMSNorm); the gated
        delta net's output norm scales by w (RMSNormGated, from one), as do the vision tower's LayerNorms."""
        if not NORM_WEIGHT.search(name):
            return None
        return 1.0 if name.endswith("linear_attn.norm.weight") or name.startswith(VISUAL) else 0.0

    def attention_type(self, layer: int) -> str:
        """ "linear_attention" or "full_attention" (transformers' rule: `layer_types`, else every
        `full_attention_interval`-th layer full); the MTP layer is full attention."""
        if self.is_mtp(layer):
            return "full_attention"
        types = self.config.get("layer_types")
        if types is not None:
            return types[layer]
        interval = int(self.config.get("full_attention_interval") or 4)
        return "full_attention" if (layer + 1) % interval == 0 else "linear_attention"

    def is_moe(self, layer: int) -> bool:
        return True

    def attention_tensors(self, layer: int) -> list[Spec]:
        c = self.config
        h = int(c["hidden_size"])
        if self.attention_type(layer) == "full_attention":
            heads, kv, hd = int(c["num_attention_heads"]), int(c["num_key_value_heads"]), int(c["head_dim"])
            return [
                ("self_attn.q_proj.weight", (2 * heads * hd, h), "BF16"),  # queries and their output gate
                ("self_attn.k_proj.weight", (kv * hd, h), "BF16"),
                ("self_attn.v_proj.weight", (kv * hd, h), "BF16"),
                ("self_attn.o_proj.weight", (h, heads * hd), "BF16"),
                ("self_attn.q_norm.weight", (hd,), "BF16"),
                ("self_attn.k_norm.weight", (hd,), "BF16"),
            ]
        nk, nv = int(c["linear_num_key_heads"]), int(c["linear_num_value_heads"])
        dk, dv = int(c["linear_key_head_dim"]), int(c["linear_value_head_dim"])
        conv = 2 * nk * dk + nv * dv
        return [
            ("linear_attn.in_proj_qkv.weight", (conv, h), "BF16"),
            ("linear_attn.in_proj_z.weight", (nv * dv, h), "BF16"),
            ("linear_attn.in_proj_b.weight", (nv, h), "BF16"),
            ("linear_attn.in_proj_a.weight", (nv, h), "BF16"),
            ("linear_attn.conv1d.weight", (conv, 1, int(c["linear_conv_kernel_dim"])), "BF16"),
            ("linear_attn.dt_bias", (nv,), "BF16"),
            ("linear_attn.A_log", (nv,), "BF16"),
            ("linear_attn.norm.weight", (dv,), "BF16"),
            ("linear_attn.out_proj.weight", (h, nv * dv), "BF16"),
        ]

    def moe_tensors(self) -> list[Spec]:
        """Every layer's MLP: the router (no score-correction bias), the routed experts one by one, one shared expert
        of its own width and its one-row sigmoid gate."""
        c = self.config
        h, e = int(c["hidden_size"]), int(c["n_routed_experts"])
        out: list[Spec] = [("mlp.gate.weight", (e, h), "BF16")]
        for j in range(e):
            out += mlp_tensors(f"mlp.experts.{j}.", h, int(c["moe_intermediate_size"]))
        out += mlp_tensors("mlp.shared_expert.", h, int(c["shared_expert_intermediate_size"]))
        return out + [("mlp.shared_expert_gate.weight", (1, h), "BF16")]

    def mtp_head_tensors(self) -> list[Spec]:
        """The MTP block's final norm (`mtp.norm`, outside its layer: the family's `mtp_block_modules`)."""
        return [("norm.weight", (int(self.config["hidden_size"]),), "BF16")]

    def vision_tensors(self) -> list[PlannedTensor]:
        """The vision tower, as transformers' Qwen3.5 vision model stores it (bf16, left alone by every recipe)."""
        v = self.vision_config()
        if v is None:
            return []
        hv, iv, merge = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
        out: list[Spec] = [
            (
                "patch_embed.proj.weight",
                (hv, v["in_channels"], v["temporal_patch_size"], *(v["patch_size"],) * 2),
                "BF16",
            ),
            ("patch_embed.proj.bias", (hv,), "BF16"),
            ("pos_embed.weight", (v["num_position_embeddings"], hv), "BF16"),
        ]
        for b in range(v["depth"]):
            for name, shape in (
                ("norm1", (hv,)),
                ("norm2", (hv,)),
                ("attn.qkv", (3 * hv, hv)),
                ("attn.proj", (hv, hv)),
                ("mlp.linear_fc1", (iv, hv)),
                ("mlp.linear_fc2", (hv, iv)),
            ):
                out += [(f"blocks.{b}.{name}.weight", shape, "BF16"), (f"blocks.{b}.{name}.bias", shape[:1], "BF16")]
        out += [
            ("merger.norm.weight", (hv,), "BF16"),
            ("merger.norm.bias", (hv,), "BF16"),
            ("merger.linear_fc1.weight", (merge, merge), "BF16"),
            ("merger.linear_fc1.bias", (merge,), "BF16"),
            ("merger.linear_fc2.weight", (v["out_hidden_size"], merge), "BF16"),
            ("merger.linear_fc2.bias", (v["out_hidden_size"],), "BF16"),
        ]
        return [PlannedTensor(VISUAL + name, dtype, shape) for name, shape, dtype in out]

    def stores_mtp_layer(self, layer: int, names) -> bool:
        """Whether `names` hold the MTP block's own tensors (`mtp.fc`...): the MTP layer has its own prefix."""
        return any(self.locate(n)[0] == layer and self.locate(n)[1].startswith(self.MTP_PROJ + ".") for n in names)


FAMILY = load_family("qwen3.5-moe", layout=Qwen3_5MoeLayout, kind_rules=KIND_RULES)
Qwen3_5MoeLayout.family = FAMILY
