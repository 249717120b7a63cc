"""The checkpoint layout shared by the DeepSeek-V3 lineage (DeepSeek-V3/R1/V3.1/V3.2, GLM-4.5-4.7, GLM-5.x),
derived from config.json alone.

Decoder layers 0 .. num_hidden_layers-1, then `num_nextn_predict_layers` MTP ("next-n") layers, stored under the
prefixes the family's `layers` names (mxforge.models.layer_names: the lineage's `model.layers.{layer}` for both,
so GLM-5.2's MTP layer is `model.layers.78`); each layer is dense (an MLP) or MoE (router, routed experts, shared
experts) per `first_k_dense_replace` / `moe_layer_freq` (or an explicit `mlp_layer_types`). A family's subclass
supplies its attention (and indexer) tensors and required fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping

from mxforge.errors import ConfigError
from mxforge.models.layer_names import LINEAGE, LayerNames
from mxforge.models.tensor_kinds import kind_of
from mxforge.safetensors_io import MAX_TENSORS, PlannedTensor

Spec = tuple[str, tuple[int, ...], str]  # layer-relative name, shape, dtype
NORM_RE = re.compile(r"norm\.(weight|bias)$")

# Fields every family of the lineage reads (a family's REQUIRED_FIELDS adds its attention's).
LINEAGE_FIELDS: tuple[str, ...] = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_attention_heads",
    "vocab_size",
    "first_k_dense_replace",
)
LINEAGE_OPTIONAL_INT_FIELDS = ("num_nextn_predict_layers", "n_shared_experts", "moe_layer_freq")

# The range each integer field of config.json may take, checked before anything is planned from it: from the
# smallest meaningful value to about 10x the largest in the families' reference configs (manifests/models/:
# GLM-4.5 92 layers, 160 experts; GLM-5.2 78 layers, 256 experts, vocabulary 154,880; DeepSeek-V3 hidden 7,168,
# intermediate 18,432). A family's own fields get theirs here too; a field with none gets FIELD_LIMIT_DEFAULT.
FIELD_LIMITS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 65_536),
    "num_hidden_layers": (1, 1_024),
    "intermediate_size": (1, 262_144),
    "moe_intermediate_size": (1, 32_768),
    "n_routed_experts": (1, 4_096),
    "num_attention_heads": (1, 2_048),
    "vocab_size": (1, 2_097_152),
    "first_k_dense_replace": (0, 1_024),
    "num_nextn_predict_layers": (0, 16),
    "n_shared_experts": (0, 64),
    "moe_layer_freq": (0, 1_024),
    "q_lora_rank": (1, 32_768),
    "kv_lora_rank": (1, 8_192),
    "qk_nope_head_dim": (1, 4_096),
    "qk_rope_head_dim": (1, 4_096),
    "v_head_dim": (1, 4_096),
    "index_n_heads": (1, 1_024),
    "index_head_dim": (1, 2_048),
    "index_topk_freq": (0, 1_024),
    "index_skip_topk_offset": (0, 1_024),
    "num_key_value_heads": (1, 2_048),
    "head_dim": (1, 4_096),
    "shared_expert_intermediate_size": (1, 131_072),  # Qwen3.5 MoE's
    "linear_num_key_heads": (1, 1_024),
    "linear_num_value_heads": (1, 1_024),
    "linear_key_head_dim": (1, 4_096),
    "linear_value_head_dim": (1, 4_096),
    "linear_conv_kernel_dim": (1, 64),
    "full_attention_interval": (1, 1_024),
}
FIELD_LIMIT_DEFAULT = (0, 1 << 20)
# Per-layer lists config.json may give (one entry per decoder layer): the values each entry may take.
LAYER_LISTS: dict[str, tuple[str, ...]] = {"mlp_layer_types": ("dense", "sparse")}


@dataclass(frozen=True)
class MoeLayout:
    """Per-layer structure of a checkpoint of the lineage; `family` is set by each subclass."""

    config: Mapping[str, Any]

    family: ClassVar[Any] = None
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = LINEAGE_FIELDS
    OPTIONAL_INT_FIELDS: ClassVar[tuple[str, ...]] = LINEAGE_OPTIONAL_INT_FIELDS
    LAYER_LISTS: ClassVar[dict[str, tuple[str, ...]]] = LAYER_LISTS
    # A family's own ranges for fields FIELD_LIMITS also bounds (GLM-5.3-Flash's NoPE MLA: qk_rope_head_dim 0 only)
    OWN_FIELD_LIMITS: ClassVar[dict[str, tuple[int, int]]] = {}
    NORM_DTYPE: ClassVar[str] = "BF16"  # how the published checkpoint stores its norms (DeepSeek-V3.2: F32)
    # Layer-relative names of MTP-layer tensors a release may leave out because every engine loads them from
    # elsewhere (GLM-4.6's MTP layer has no embed_tokens / shared_head.head: engines use the model's).
    OMITTABLE_MTP_TENSORS: ClassVar[tuple[str, ...]] = ()
    # Whether each MTP layer stores its own output head and embedding (shared_head.head, embed_tokens: DeepSeek-V3,
    # GLM-4.5) besides its shared_head.norm.
    MTP_OWN_HEAD: ClassVar[bool] = False
    # The MTP layer's projection of [embedding, hidden] (layer-relative module name; Qwen3.5: "fc")
    MTP_PROJ: ClassVar[str] = "eh_proj"
    # The MTP layer's norms of the embedding and of the hidden state, before that projection (Qwen3.5's
    # pre_fc_norm_embedding, pre_fc_norm_hidden)
    MTP_NORMS: ClassVar[tuple[str, str]] = ("enorm", "hnorm")
    # Where the language model's embedding and final norm are stored (a multimodal family's: model.language_model.)
    TEXT_PREFIX: ClassVar[str] = "model."
    # A vision tower's config.json fields that size its tensors (whole numbers; a family without one: none), and
    # those with a default (`out_hidden_size`, what the merger feeds the text model, defaults to its hidden size)
    VISION_FIELDS: ClassVar[tuple[str, ...]] = ()
    VISION_DEFAULTS: ClassVar[dict[str, int]] = {}

    def __post_init__(self):
        missing = [k for k in self.REQUIRED_FIELDS if k not in self.config]
        if missing:
            raise ConfigError(
                f"config.json lacks {self.family.title} fields {missing}; is this a "
                f"{'/'.join(self.family.architectures)} checkpoint?",
                filename="config.json",
                entry=missing[0],
            )
        for key in self.REQUIRED_FIELDS + self.OPTIONAL_INT_FIELDS:
            value = self.config.get(key)
            if (key in self.REQUIRED_FIELDS or value is not None) and (
                isinstance(value, bool) or not isinstance(value, int)
            ):
                digits = value.strip() if isinstance(value, str) and value.strip().isdigit() else "<integer>"
                raise ConfigError(
                    f"config.json: {key} is {value!r} ({type(value).__name__}), not a whole number; "
                    f'write it as a JSON integer ("{key}": {digits}, no quotes)',
                    filename="config.json",
                    entry=key,
                )
            if value is not None:
                low, high = self.OWN_FIELD_LIMITS.get(key) or FIELD_LIMITS.get(key, FIELD_LIMIT_DEFAULT)
                if not low <= value <= high:
                    raise ConfigError(
                        f"config.json: {key} is {value:,}, outside {low:,}..{high:,}"
                        + (" (about 10x the largest real model's)" if value > high else "")
                        + "; the config is corrupt or hostile: fix the value"
                    )
        for key, allowed in self.LAYER_LISTS.items():
            self._check_layer_list(key, self.config.get(key), allowed)
        self.vision_config()  # checked before anything is planned from it
        implied = (self.num_hidden_layers + len(self.mtp_layers)) * (3 * int(self.config["n_routed_experts"]) + 64)
        if implied > MAX_TENSORS:
            raise ConfigError(
                f"config.json: {self.num_hidden_layers} layers (+{len(self.mtp_layers)} MTP) of "
                f"{self.config['n_routed_experts']} experts imply about {implied:,} tensors, over the "
                f"{MAX_TENSORS:,} mxforge reads (about 10x the largest real checkpoint's); fix the config"
            )

    def _check_layer_list(self, key: str, value: Any, allowed: tuple[str, ...]) -> None:
        """A per-layer list is absent (null) or names one of `allowed` for each of the num_hidden_layers layers
        (transformers' `validate_layer_type` rule).

        Raises:
            ConfigError: naming the field.
        """
        if value is None:
            return
        n = self.num_hidden_layers
        if not isinstance(value, list) or len(value) != n or not all(v in allowed for v in value):
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise ConfigError(
                f"config.json: {key} must list one of {list(allowed)} for each of the {n} layers "
                f"(num_hidden_layers), got {shown}; fix it or remove it"
            )

    def __getitem__(self, key: str) -> Any:
        return self.config[key]

    def norm_center(self, name: str) -> float | None:
        """What a trained norm weight `name` lies near (fixtures draw it so): 1 for the lineage's RMSNorm (x * w);
        None: not a norm."""
        return 1.0 if name.endswith("norm.weight") else None

    def field_name(self, field: str) -> str:
        """Where config.json holds field `field` (mxforge's name), as messages name it: `num_nextn_predict_layers`,
        Qwen3.5's `text_config.mtp_num_hidden_layers` (Family.config)."""
        return self.family.config.where(field) if self.family is not None else field

    @property
    def layer_names(self) -> LayerNames:
        return self.family.layers if self.family is not None else LINEAGE

    def layer_prefix(self, layer: int) -> str:
        """Where global layer `layer` (a decoder layer, or an MTP layer past them) is stored, with the dot."""
        return self.layer_names.prefix(layer, self.num_hidden_layers)

    def module_name(self, layer: int, local: str) -> str:
        """The stored name of layer-relative `local` of global layer `layer` (`locate`'s inverse)."""
        return self.layer_names.name(layer, local, self.num_hidden_layers)

    def locate(self, name: str) -> tuple[int | None, str]:
        """(global layer, layer-relative name) of tensor or module `name`; (None, name) for a global one."""
        return self.layer_names.locate(name, self.num_hidden_layers)

    def layer_of(self, name: str) -> int | None:
        return self.locate(name)[0]

    def kind_of(self, name: str) -> str:
        """The kind of tensor `name` (mxforge.models.tensor_kinds.KINDS) under this family's rules."""
        return kind_of(self.locate(name)[1], self.family.kind_rules)

    def in_mtp_layer(self, name: str) -> bool:
        """Whether tensor or module `name` belongs to one of config.json's MTP layers."""
        layer = self.layer_of(name)
        return layer is not None and self.is_mtp(layer)

    def module_class(self, name: str) -> str:
        """The class reports group a tensor under: its kind, or "mtp" for every tensor of an MTP layer."""
        return "mtp" if self.in_mtp_layer(name) else self.kind_of(name)

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
        """MoE unless listed dense (`mlp_layer_types`), before `first_k_dense_replace` or off the `moe_layer_freq`
        stride (the engines' test); MTP layers are MoE."""
        if self.is_mtp(layer):
            return True
        types = self.config.get("mlp_layer_types")
        if types is not None:
            return types[layer] == "sparse"
        freq = int(self.config.get("moe_layer_freq", 1) or 1)
        return layer >= int(self.config["first_k_dense_replace"]) and layer % freq == 0

    def has_indexer(self, layer: int) -> bool:
        """Whether the layer stores DSA indexer tensors (families without an indexer: never)."""
        return False

    def attention_tensors(self, layer: int) -> list[Spec]:
        raise NotImplementedError

    def layer_tensors(self, layer: int) -> list[PlannedTensor]:
        c = self.config
        h = int(c["hidden_size"])
        out: list[Spec] = []
        if self.is_mtp(layer):
            out += [(f"{norm}.weight", (h,), "BF16") for norm in self.MTP_NORMS]
            out.append((f"{self.MTP_PROJ}.weight", (h, 2 * h), "BF16"))
        out.append(("input_layernorm.weight", (h,), "BF16"))
        out += self.attention_tensors(layer)
        out.append(("post_attention_layernorm.weight", (h,), "BF16"))
        out += self.moe_tensors() if self.is_moe(layer) else mlp_tensors("mlp.", h, int(c["intermediate_size"]))
        if self.is_mtp(layer):
            out += self.mtp_head_tensors()
        return [
            PlannedTensor(self.module_name(layer, name), self._dtype(name, dtype), shape) for name, shape, dtype in out
        ]

    def moe_tensors(self) -> list[Spec]:
        """A MoE layer's MLP: the router with its score-correction bias, the routed experts one by one, and
        `n_shared_experts` shared experts as one MLP."""
        c = self.config
        h, e, inter = int(c["hidden_size"]), int(c["n_routed_experts"]), int(c["moe_intermediate_size"])
        out: list[Spec] = [("mlp.gate.weight", (e, h), "BF16"), ("mlp.gate.e_score_correction_bias", (e,), "F32")]
        for j in range(e):
            out += mlp_tensors(f"mlp.experts.{j}.", h, inter)
        n_shared = int(c.get("n_shared_experts", 1) or 0)
        if n_shared:
            out += mlp_tensors("mlp.shared_experts.", h, inter * n_shared)
        return out

    def _dtype(self, name: str, dtype: str) -> str:
        return self.NORM_DTYPE if NORM_RE.search(name) else dtype

    def mtp_head_tensors(self) -> list[Spec]:
        """The MTP layer's own head after its block: shared_head.norm, and with MTP_OWN_HEAD shared_head.head and
        embed_tokens."""
        h = int(self.config["hidden_size"])
        norm: list[Spec] = [("shared_head.norm.weight", (h,), "BF16")]
        if not self.MTP_OWN_HEAD:
            return norm
        v = int(self.config["vocab_size"])
        return norm + [("shared_head.head.weight", (v, h), "BF16"), ("embed_tokens.weight", (v, h), "BF16")]

    def stores_mtp_layer(self, layer: int, names: Iterable[str]) -> bool:
        """Whether `names` hold, under layer `layer`'s prefix, a tensor that only an MTP layer has (eh_proj,
        enorm, hnorm...), as this family lays out an MTP layer at that index."""
        try:
            as_mtp = type(self)({**self.config, "num_hidden_layers": layer, "num_nextn_predict_layers": 1})
            mtp = as_mtp.layer_tensors(layer)
        except (ConfigError, IndexError, KeyError, ValueError):  # the config cannot describe one there
            return False
        decoder = {self.locate(t.name)[1] for i in range(self.num_hidden_layers) for t in self.layer_tensors(i)}
        only = {t.name for t in mtp if as_mtp.locate(t.name)[1] not in decoder}
        return not only.isdisjoint(names)

    def omittable(self) -> frozenset[str]:
        """Full names of the tensors config.json implies that a checkpoint may lack (OMITTABLE_MTP_TENSORS)."""
        return frozenset(self.module_name(i, n) for i in self.mtp_layers for n in self.OMITTABLE_MTP_TENSORS)

    def vision_config(self) -> dict[str, Any] | None:
        """The vision tower's config with its defaults (None: a family or checkpoint without one), its sizes checked.

        Raises:
            ConfigError: vision_config not an object, or a field missing, not a whole number or out of range.
        """
        vision = self.config.get("vision_config")
        if vision is None or not self.VISION_FIELDS:
            return None
        if not isinstance(vision, dict):
            raise ConfigError("config.json: vision_config must be an object", filename="config.json")
        merged = {**self.VISION_DEFAULTS, "out_hidden_size": self.config["hidden_size"], **vision}
        for key in (*self.VISION_FIELDS, *self.VISION_DEFAULTS, "out_hidden_size"):
            value = merged.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
                raise ConfigError(
                    f"config.json: vision_config.{key} is {value!r}, not a whole number in 1..{1 << 20:,}; "
                    "fix it (it sizes the vision tower's tensors)",
                    filename="config.json",
                    entry=f"vision_config.{key}",
                )
        return merged

    def vision_tensors(self) -> list[PlannedTensor]:
        """The vision tower's tensors (global, bf16; none for a family without one)."""
        return []

    def tensors(self) -> list[PlannedTensor]:
        """Every tensor of the bf16 checkpoint in storage order: embeddings, decoder layers, the final norm, head, a
        vision tower, MTP layers last."""
        h, v = int(self.config["hidden_size"]), int(self.config["vocab_size"])
        out = [PlannedTensor(self.TEXT_PREFIX + "embed_tokens.weight", "BF16", (v, h))]
        for layer in range(self.num_hidden_layers):
            out += self.layer_tensors(layer)
        out.append(PlannedTensor(self.TEXT_PREFIX + "norm.weight", self.NORM_DTYPE, (h,)))
        if not self.config.get("tie_word_embeddings", False):
            out.append(PlannedTensor("lm_head.weight", "BF16", (v, h)))
        out += self.vision_tensors()
        for layer in self.mtp_layers:
            out += self.layer_tensors(layer)
        return out


def mlp_tensors(prefix: str, hidden: int, inter: int) -> list[Spec]:
    return [
        (prefix + "gate_proj.weight", (inter, hidden), "BF16"),
        (prefix + "up_proj.weight", (inter, hidden), "BF16"),
        (prefix + "down_proj.weight", (hidden, inter), "BF16"),
    ]


def mla_tensors(c: Mapping[str, Any]) -> list[Spec]:
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-5): low-rank q and kv projections."""
    h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    q_rank, kv_rank = int(c["q_lora_rank"]), int(c["kv_lora_rank"])
    nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    return [
        ("self_attn.q_a_proj.weight", (q_rank, h), "BF16"),
        ("self_attn.q_a_layernorm.weight", (q_rank,), "BF16"),
        ("self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank), "BF16"),
        ("self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, h), "BF16"),
        ("self_attn.kv_a_layernorm.weight", (kv_rank,), "BF16"),
        ("self_attn.kv_b_proj.weight", (heads * (nope + v), kv_rank), "BF16"),
        ("self_attn.o_proj.weight", (h, heads * v), "BF16"),
    ]


MLA_FIELDS: tuple[str, ...] = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def dsa_indexer_tensors(c: Mapping[str, Any]) -> list[Spec]:
    """DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2, GLM-5)."""
    h, q_rank = int(c["hidden_size"]), int(c["q_lora_rank"])
    ih, ihd = int(c["index_n_heads"]), int(c["index_head_dim"])
    return [
        ("self_attn.indexer.wq_b.weight", (ih * ihd, q_rank), "BF16"),
        ("self_attn.indexer.wk.weight", (ihd, h), "BF16"),
        ("self_attn.indexer.k_norm.weight", (ihd,), "BF16"),
        ("self_attn.indexer.k_norm.bias", (ihd,), "BF16"),
        ("self_attn.indexer.weights_proj.weight", (ih, h), "BF16"),
    ]


DSA_FIELDS: tuple[str, ...] = ("index_n_heads", "index_head_dim")


FP8_BLOCK = 128


def _block_scales(weight: str, shape: tuple[int, ...]) -> list[PlannedTensor]:
    """DeepSeek-style: F32 `weight_scale_inv` of shape [ceil(out/128), ceil(in/128)] (README_WEIGHTS.md of
    deepseek-ai/DeepSeek-V3: 128x128 blocks, the last ones zero-padded)."""
    rows, cols = shape
    return [PlannedTensor(weight + "_scale_inv", "F32", (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)))]


def _channel_scales(weight: str, shape: tuple[int, ...]) -> list[PlannedTensor]:
    """compressed-tensors FP8 per channel with static activations: `weight_scale` [out, 1] and the module's
    `input_scale` [1], in the model's dtype (bf16), as llm-compressor writes them."""
    return [
        PlannedTensor(weight + "_scale", "BF16", (shape[0], 1)),
        PlannedTensor(weight.removesuffix("weight") + "input_scale", "BF16", (1,)),
    ]


# A family's FP8 release layout (Family.fp8_format): the tensors stored after each e4m3 weight.
FP8_LAYOUTS: dict[str, Callable[[str, tuple[int, ...]], list[PlannedTensor]]] = {
    "block": _block_scales,
    "compressed-tensors-channel": _channel_scales,
}


def fp8_inventory(tensors: list[PlannedTensor], fp8_format: str, bf16_weights: str) -> list[PlannedTensor]:
    """The same checkpoint as an FP8 release of `fp8_format` stores it: every 2-D `.weight` not matching
    `bf16_weights` is F8_E4M3, followed by its scales (FP8_LAYOUTS)."""
    keep, companions = re.compile(bf16_weights), FP8_LAYOUTS[fp8_format]
    out = []
    for t in tensors:
        if len(t.shape) == 2 and t.name.endswith(".weight") and not keep.search(t.name):
            out.append(PlannedTensor(t.name, "F8_E4M3", t.shape))
            out += companions(t.name, t.shape)
        else:
            out.append(t)
    return out


def fp8_block_inventory(tensors: list[PlannedTensor], bf16_weights: str) -> list[PlannedTensor]:
    """`fp8_inventory` of a DeepSeek-style block-FP8 release."""
    return fp8_inventory(tensors, "block", bf16_weights)
