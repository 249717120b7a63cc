"""GLM-5.3-Flash: `Glm5NextForConditionalGeneration` (model_type glm5_next).

A hybrid text model under `model.language_model.*` (its family.toml's `[layers]`; its fields in `text_config`): per
`layer_types` (else every fourth layer) either Kimi delta attention (KDA, `self_attn`: q/k/v projections each with a
depthwise short conv `q_conv1d`..., the decay `b_proj`, the low-rank forget and output gates `f_a_proj`/`f_b_proj`,
`g_a_proj`/`g_b_proj`, `dt_bias`, `A_log`, a gated output norm `o_norm`, `o_proj`) or NoPE MLA (`qk_rope_head_dim`
0, which transformers requires) with DeepSeek's sparse-attention indexer on "full" IndexShare layers, whose indexer
adds a key pool (`index_kpool_compress_ape`, `index_kpool_compress_gate`); dense MLP layers per `mlp_layer_types`
(else the first three), the rest MoE as the lineage stores it (router and its score-correction bias, both float32;
routed experts one by one; `shared_experts`). Every decoder layer carries mHC (manifold-constrained hyper-connection)
parameters for its attention and its MLP (`hc_attn_fn` / `_base` / `_scale`, `hc_ffn_*`: no `.weight`, never a
linear). A vision tower (`model.visual.*`: a Conv3d patch embedding, `depth` blocks with SwiGLU MLPs, a Conv2d
downsample, a SwiGLU patch merger) that mxforge leaves bf16. The MTP layer is stored after the decoder's, under the
same prefix (`model.language_model.layers.{num_hidden_layers}`), as the lineage stores it: `enorm`, `hnorm`,
`eh_proj`, an indexed MLA MoE layer without mHC, `shared_head.norm` (no head of its own).

Where the numbers come from: names, shapes and dtypes are those of transformers' glm5_next modeling code (the tiny
fixture's tensors outside the MTP layer, which transformers does not build, equal what
`Glm5NextForConditionalGeneration.save_pretrained` writes: tested) and of the engines' draft classes (sglang
glm5_next_nextn.py, vLLM's Glm5NextMTP: the MTP layer's names, no mHC, no `shared_head.head`). The reference config
is transformers' `Glm5NextConfig` defaults (its docstring's checkpoint, zai-org/GLM-5.3-Flash) with the fields the
engines' config classes read as the checkpoint's (`num_nextn_predict_layers` 1, `mhc`, `topk_method`,
`scoring_func`, `mla_use_nope`, `indexer_rope_interleave`) and the vision merger's `out_hidden_size` set to the text
model's hidden size (it feeds the text embedding; the class's default, 1536, is another model's). No published
config.json, index or header could be read here: the inventory is derived only. Not checked: tensor and shard counts,
storage order, whether the release stores `hc_*_fn` bf16 (transformers does) and the router float32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mxforge.errors import ConfigError
from mxforge.models.family import load_family
from mxforge.models.glm_moe_dsa import GlmMoeDsaLayout
from mxforge.models.layout import (
    DSA_FIELDS,
    LINEAGE_FIELDS,
    MLA_FIELDS,
    Spec,
    dsa_indexer_tensors,
    mla_tensors,
)
from mxforge.models.tensor_kinds import compile_rules
from mxforge.safetensors_io import PlannedTensor

LAYER_TYPES = ("linear_attention", "indexed_attention", "full_attention")  # transformers reads "full" as indexed
VISUAL = "model.visual."  # the vision tower's prefix (global: no layer)
NORM_WEIGHT = re.compile(r"norm[a-z0-9_]*\.weight$")
# Stored float32 (transformers' _keep_in_fp32_modules_strict; layer-relative names)
F32 = re.compile(
    r"^(mlp\.gate\.weight|self_attn\.[qkv]_conv1d\.weight|self_attn\.(dt_bias|A_log)|hc_\w+_(base|scale))$"
)
# First match wins, on the layer-relative name (the whole name for a global tensor: the vision tower, embeddings)
KIND_RULES = compile_rules(
    (
        ("vision", r"^model\.visual\."),
        ("experts", r"^mlp\.experts\."),
        ("shared_experts", r"^mlp\.shared_experts\."),
        ("router", r"^mlp\.gate\.(weight|e_score_correction_bias)$"),
        ("dense_mlp", r"^mlp\.(gate|up|down)_proj\."),
        ("indexer", r"^self_attn\.indexer\.(wq_b|wk|weights_proj|index_kpool_compress_\w+)(\.|$)"),
        ("norms", r"(^|\.)([a-z_]*norm)\.(weight|bias)$"),
        ("attention", r"^self_attn\."),
        ("mtp_proj", r"^eh_proj\."),
        ("embeddings", r"^(model\.language_model\.embed_tokens|lm_head)\."),
    )
)


@dataclass(frozen=True)
class Glm5NextLayout(GlmMoeDsaLayout):
    """GLM-5.3-Flash's checkpoint: KDA and indexed NoPE MLA layers with mHC, a vision tower, the lineage's MTP layer."""

    REQUIRED_FIELDS = (
        *(f for f in LINEAGE_FIELDS if f != "first_k_dense_replace"),
        *(f for f in MLA_FIELDS if f != "qk_rope_head_dim"),
        *DSA_FIELDS,
        "linear_num_heads",
        "linear_head_dim",
        "linear_conv_kernel_dim",
    )
    OPTIONAL_INT_FIELDS = (
        *GlmMoeDsaLayout.OPTIONAL_INT_FIELDS,
        "first_k_dense_replace",
        "qk_rope_head_dim",
        "hc_mult",
        "index_kpool",
    )
    OWN_FIELD_LIMITS = {"qk_rope_head_dim": (0, 0), "hc_mult": (1, 64), "index_kpool": (1, 1_024)}  # NoPE only
    LAYER_LISTS = {**GlmMoeDsaLayout.LAYER_LISTS, "layer_types": LAYER_TYPES}
    TEXT_PREFIX = "model.language_model."
    VISION_FIELDS = (
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "in_channels",
        "patch_size",
        "projection_intermediate_size",
    )
    VISION_DEFAULTS = {"spatial_merge_size": 2, "temporal_patch_size": 2}

    @property
    def hc_mult(self) -> int:
        return int(self.config.get("hc_mult") or 4)

    def attention_type(self, layer: int) -> str:
        """ "linear_attention" (KDA) or "indexed_attention" (MLA) (transformers' rule: `layer_types`, else every
        fourth layer MLA); the MTP layer is MLA."""
        if self.is_mtp(layer):
            return "indexed_attention"
        types = self.config.get("layer_types")
        if types is not None:
            return "linear_attention" if types[layer] == "linear_attention" else "indexed_attention"
        return "linear_attention" if layer % 4 != 3 else "indexed_attention"

    def is_moe(self, layer: int) -> bool:
        """`mlp_layer_types`, else transformers' rule (the first min(3, layers) dense); the MTP layer is MoE."""
        if self.is_mtp(layer):
            return True
        types = self.config.get("mlp_layer_types")
        if types is not None:
            return types[layer] == "sparse"
        return layer >= min(3, self.num_hidden_layers)

    def has_indexer(self, layer: int) -> bool:
        """MLA layers on a "full" IndexShare layer, and the MTP layer; KDA layers have none."""
        return self.attention_type(layer) == "indexed_attention" and super().has_indexer(layer)

    def attention_tensors(self, layer: int) -> list[Spec]:
        c = self.config
        h = int(c["hidden_size"])
        if self.attention_type(layer) == "indexed_attention":
            mla = mla_tensors({**c, "qk_rope_head_dim": int(c.get("qk_rope_head_dim") or 0)})
            if not self.has_indexer(layer):
                return mla
            kpool, ihd = int(c.get("index_kpool") or 16), int(c["index_head_dim"])
            return (
                mla
                + dsa_indexer_tensors(c)
                + [
                    ("self_attn.indexer.index_kpool_compress_ape", (kpool, ihd), "BF16"),
                    ("self_attn.indexer.index_kpool_compress_gate", (ihd, h), "BF16"),
                ]
            )
        heads, hd, kernel = int(c["linear_num_heads"]), int(c["linear_head_dim"]), int(c["linear_conv_kernel_dim"])
        p = heads * hd
        out: list[Spec] = []
        for x in "qkv":
            out += [
                (f"self_attn.{x}_proj.weight", (p, h), "BF16"),
                (f"self_attn.{x}_conv1d.weight", (p, 1, kernel), "BF16"),
            ]
        return out + [
            ("self_attn.b_proj.weight", (heads, h), "BF16"),
            ("self_attn.f_a_proj.weight", (hd, h), "BF16"),
            ("self_attn.f_b_proj.weight", (p, hd), "BF16"),
            ("self_attn.g_a_proj.weight", (hd, h), "BF16"),
            ("self_attn.g_b_proj.weight", (p, hd), "BF16"),
            ("self_attn.dt_bias", (p,), "BF16"),
            ("self_attn.A_log", (heads,), "BF16"),
            ("self_attn.o_norm.weight", (hd,), "BF16"),
            ("self_attn.o_proj.weight", (h, p), "BF16"),
        ]

    def layer_tensors(self, layer: int) -> list[PlannedTensor]:
        """The lineage's layer, and on a decoder layer the mHC parameters of its attention and its MLP."""
        out = super().layer_tensors(layer)
        if self.is_mtp(layer):
            return out
        m, h = self.hc_mult, int(self.config["hidden_size"])
        mixes = (2 + m) * m  # pre, post and the m x m residual mix, per stream
        for site in ("attn", "ffn"):
            for name, shape, dtype in (
                (f"hc_{site}_fn", (mixes, m * h), "BF16"),
                (f"hc_{site}_base", (mixes,), "F32"),
                (f"hc_{site}_scale", (3,), "F32"),
            ):
                out.append(PlannedTensor(self.module_name(layer, name), dtype, shape))
        return out

    def _dtype(self, name: str, dtype: str) -> str:
        return "F32" if F32.match(name) else super()._dtype(name, dtype)

    def norm_center(self, name: str) -> float | None:
        """Every RMSNorm and LayerNorm here scales by w, from one (transformers' Glm5NextTextRMSNorm, the vision
        tower's)."""
        return 1.0 if NORM_WEIGHT.search(name) else None

    def vision_config(self) -> dict[str, Any] | None:
        """The vision tower's config (MoeLayout.vision_config), its heads dividing its width.

        Raises:
            ConfigError: as MoeLayout.vision_config, or vision_config.num_heads not dividing hidden_size.
        """
        merged = super().vision_config()
        if merged is not None and merged["hidden_size"] % merged["num_heads"]:
            raise ConfigError(
                f"config.json: vision_config.hidden_size {merged['hidden_size']} is not a multiple of num_heads "
                f"{merged['num_heads']}; fix it",
                filename="config.json",
                entry="vision_config.num_heads",
            )
        return merged

    def vision_tensors(self) -> list[PlannedTensor]:
        """The vision tower, as transformers' GLM-5.3-Flash vision model stores it (bf16, left alone by every
        recipe)."""
        v = self.vision_config()
        if v is None:
            return []
        hv, iv, out_h, pi = (
            v["hidden_size"],
            v["intermediate_size"],
            v["out_hidden_size"],
            v["projection_intermediate_size"],
        )
        head, merge, bias = hv // v["num_heads"], v["spatial_merge_size"], bool(v.get("attention_bias", True))
        out: list[Spec] = [
            (
                "patch_embed.proj.weight",
                (hv, v["in_channels"], v["temporal_patch_size"], *(v["patch_size"],) * 2),
                "BF16",
            ),
            ("patch_embed.proj.bias", (hv,), "BF16"),
        ]
        for b in range(v["depth"]):
            block = f"blocks.{b}."
            out += [(block + "norm1.weight", (hv,), "BF16"), (block + "norm2.weight", (hv,), "BF16")]
            for name, shape in (
                ("attn.qkv", (3 * hv, hv)),
                ("attn.proj", (hv, hv)),
                ("mlp.gate_proj", (iv, hv)),
                ("mlp.up_proj", (iv, hv)),
                ("mlp.down_proj", (hv, iv)),
            ):
                out.append((f"{block}{name}.weight", shape, "BF16"))
                if bias:
                    out.append((f"{block}{name}.bias", shape[:1], "BF16"))
            out += [(block + "attn.q_norm.weight", (head,), "BF16"), (block + "attn.k_norm.weight", (head,), "BF16")]
        out += [
            ("post_layernorm.weight", (hv,), "BF16"),
            ("downsample.weight", (out_h, hv, merge, merge), "BF16"),
            ("downsample.bias", (out_h,), "BF16"),
            ("merger.proj.weight", (out_h, out_h), "BF16"),
            ("merger.post_projection_norm.weight", (out_h,), "BF16"),
            ("merger.post_projection_norm.bias", (out_h,), "BF16"),
            ("merger.gate_proj.weight", (pi, out_h), "BF16"),
            ("merger.up_proj.weight", (pi, out_h), "BF16"),
            ("merger.down_proj.weight", (out_h, pi), "BF16"),
        ]
        return [PlannedTensor(VISUAL + name, dtype, shape) for name, shape, dtype in out]

    def stores_mtp_layer(self, layer: int, names) -> bool:
        """Whether `names` hold, under layer `layer`'s prefix, the MTP layer's own projection or input norms (the
        per-layer lists of config.json cannot describe a layer past them, so the lineage's test cannot build one)."""
        own = {self.MTP_PROJ, *self.MTP_NORMS}
        return any(self.locate(n)[0] == layer and self.locate(n)[1].split(".", 1)[0] in own for n in names)


FAMILY = load_family("glm-5.3-flash", layout=Glm5NextLayout, kind_rules=KIND_RULES)
Glm5NextLayout.family = FAMILY
