"""bf16 or FP8 checkpoints of a model family built on the spot: the test and benchmark inputs.

Layout (names, shapes, dtypes, shard order, index) follows the family's real checkpoint (mxforge/models/);
dimensions shrink per preset (the family's fixture presets in manifests/models/). Weights are deterministic
for a seed and drawn like trained weights: a small Gaussian with rare large outliers, so quantization error
measured on them means something.

`precision="fp8"` writes the layout of the family's official FP8 release (`Family.fp8_format`,
mxforge.models.layout.fp8_inventory): the same bf16 weights quantized to F8_E4M3 with scale amax/448, per 128x128
block with a float32 `weight_scale_inv` (DeepSeek's block FP8), or per output channel with a bf16 `weight_scale`
[out, 1] and a static `input_scale` (compressed-tensors, GLM-4.5-FP8), and the release's `quantization_config`; a
weight and its scales share a shard.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from mxforge.checkpoint import write_index
from mxforge.errors import ConfigError, MxforgeError
from mxforge.models import DEFAULT_FAMILY, Family, family_named
from mxforge.models.layout import FP8_BLOCK, FP8_LAYOUTS, fp8_inventory
from mxforge.progress import byte_progress
from mxforge.records import fields_of
from mxforge.safetensors_io import PlannedTensor, ShardWriter, write_json_atomic

PRESETS = ("tiny", "bench", "full-layout")
PRECISIONS = ("bf16", "fp8")
# The FP8 releases' quantization_config (deepseek-ai/DeepSeek-V3's config.json; GLM-5.x FP8 read the same way)
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}
# compressed-tensors FP8, per-channel weights and static per-tensor activations, as zai-org/GLM-4.5-FP8's config.json
# describes it (the `ignore` list is filled in per checkpoint: the modules kept bf16)
_CT_FP8_ARGS: dict[str, object] = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": None,
    "num_bits": 8,
    "observer": "minmax",
    "observer_kwargs": {},
    "symmetric": True,
    "type": "float",
}
CT_FP8_CHANNEL_QUANTIZATION_CONFIG: dict[str, object] = {
    "config_groups": {
        "group_0": {
            "input_activations": {**_CT_FP8_ARGS, "strategy": "tensor"},
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {**_CT_FP8_ARGS, "strategy": "channel"},
        }
    },
    "format": "float-quantized",
    "global_compression_ratio": None,
    "ignore": [],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
E4M3_MAX = 448.0
FP8_COMPANIONS = ("_scale_inv", ".weight_scale", ".input_scale")  # stored after their FP8 weight (FP8_LAYOUTS)
OUTLIER_RATE = 1e-3


@dataclass
class FixtureResult:
    out: Path
    preset: str
    family: str
    tensors: int
    shards: int
    total_size: int
    seed: int
    precision: str = "bf16"

    def as_dict(self) -> dict:
        return {
            "stage": "fixture",
            **fields_of(self, "out", "preset", "family", "precision", "tensors", "shards", "total_size", "seed"),
        }


def preset_config(preset: str, gib: float | None = None, family: Family | str | None = None) -> tuple[dict, dict]:
    """(config.json dict, preset settings) for a preset of `family` (default: DEFAULT_FAMILY); `gib` sizes
    the bench preset.

    Raises:
        ConfigError: unknown family or preset, or --gib given for a preset other than bench.
    """
    family = _family(family)
    presets = family.fixture_presets()
    if preset not in presets:
        raise ConfigError(f"unknown fixture preset {preset!r}; choose one of {', '.join(presets)}")
    settings = presets[preset]
    config = family.reference()
    config.pop("quantization_config", None)  # fixtures are bf16, whatever precision the family publishes in
    # A preset's config entries are the language model's fields, under mxforge's names (Family.config)
    config = family.config.updated(config, settings.get("config", {}))
    if settings.get("vision"):  # a preset's `vision` entries: the vision tower's config (a multimodal family's)
        config["vision_config"] = {**config.get("vision_config", {}), **settings["vision"]}
    if gib is not None and "default_gib" not in settings:
        raise ConfigError(f"--gib applies to the bench preset only, not {preset!r}")
    if "default_gib" in settings:
        experts = _experts_for_size(family, config, (gib or settings["default_gib"]) * 2**30)
        top_k = min(int(family.config.view(config)["num_experts_per_tok"]), experts)
        config = family.config.updated(config, {"n_routed_experts": experts, "num_experts_per_tok": top_k})
    return config, settings


def _family(family: Family | str | None) -> Family:
    if family is None:
        return DEFAULT_FAMILY
    return family if isinstance(family, Family) else family_named(family)


def _experts_for_size(family: Family, config: dict, target_bytes: float) -> int:
    """Routed-expert count that brings the checkpoint closest to target_bytes (at least 1)."""

    def size(n: int) -> int:
        sized = family.config.updated(config, {"n_routed_experts": n})
        return sum(t.nbytes for t in family.layout_of(sized).tensors())

    base, per_expert = size(1), size(2) - size(1)
    return max(1, round((target_bytes - base) / per_expert) + 1)


def plan_shards(
    tensors: list[PlannedTensor], shards: int | None = None, shard_bytes: int | None = None
) -> list[list[PlannedTensor]]:
    """Split tensors, in order, into shards greedily under a byte cap, as save_pretrained does.

    With `shards`, the smallest cap giving exactly that many shards is searched for.
    """

    def split(cap: int) -> list[list[PlannedTensor]]:
        out: list[list[PlannedTensor]] = [[]]
        size = 0
        for t in tensors:
            if (
                out[-1] and size + t.nbytes > cap and not t.name.endswith(FP8_COMPANIONS)
            ):  # scales stay with their weight
                out.append([])
                size = 0
            out[-1].append(t)
            size += t.nbytes
        return out

    if shards is None:
        if shard_bytes is None:
            raise ValueError("plan_shards: give shards or shard_bytes")
        return split(int(shard_bytes))
    lo, hi = max(t.nbytes for t in tensors), sum(t.nbytes for t in tensors)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(split(mid)) <= shards:
            hi = mid
        else:
            lo = mid + 1
    result = split(lo)
    if len(result) != shards:
        raise ConfigError(f"cannot split {len(tensors)} tensors into exactly {shards} shards")
    return result


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def synth_weight(t: PlannedTensor, seed: int, norm_center: float | None = None):
    """A deterministic tensor shaped like trained weights (imports torch lazily); a norm's weight (`norm_center`: its
    family's MoeLayout.norm_center) near that value."""
    import torch

    gen = torch.Generator().manual_seed(tensor_seed(seed, t.name))
    numel = max(1, t.nbytes // (4 if t.dtype == "F32" else 2))
    if norm_center is not None:
        x = norm_center + 0.05 * torch.randn(numel, generator=gen)
    elif t.name.endswith("e_score_correction_bias"):
        x = 1e-3 * torch.randn(numel, generator=gen)
    elif t.name.endswith(".bias"):
        x = 0.01 * torch.randn(numel, generator=gen)
    else:
        x = torch.randn(numel, generator=gen).mul_(0.02)
        n_out = int(numel * OUTLIER_RATE)
        if n_out:
            idx = torch.randint(0, numel, (n_out,), generator=gen)
            x[idx] *= torch.empty(n_out).uniform_(8.0, 40.0, generator=gen)
    dtype = torch.float32 if t.dtype == "F32" else torch.bfloat16
    return x.to(dtype).reshape(t.shape)


def fp8_block_quantize(w):
    """(F8_E4M3 weight, float32 scale_inv per 128x128 block) of a 2-D bf16 weight: scale = block amax / 448 (1 for an
    all-zero block), weight = (w / scale) cast to float8_e4m3fn, so that w ~ weight * scale_inv."""
    import torch

    rows, cols = w.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    x = torch.nn.functional.pad(w.float(), (0, bc * FP8_BLOCK - cols, 0, br * FP8_BLOCK - rows))
    blocks = x.reshape(br, FP8_BLOCK, bc, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(br * FP8_BLOCK, bc * FP8_BLOCK)[:rows, :cols].contiguous(), scale.contiguous()


def fp8_channel_quantize(w):
    """(F8_E4M3 weight, bf16 weight_scale [out, 1]) of a 2-D bf16 weight, as llm-compressor's FP8 per-channel scheme:
    scale = row amax / 448 in the weight's dtype (1 for an all-zero row), weight = (w / scale) cast to e4m3."""
    import torch

    scale = (w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def _block_parts(weight: str, w, seed: int) -> dict:
    q, scale = fp8_block_quantize(w)
    return {weight: q, weight + "_scale_inv": scale}


def _channel_parts(weight: str, w, seed: int) -> dict:
    import torch

    q, scale = fp8_channel_quantize(w)
    input_scale = 0.01 * (1 + tensor_seed(seed, weight) % 100 / 100)  # a calibrated activation amax / 448
    return {
        weight: q,
        weight + "_scale": scale,
        weight.removesuffix("weight") + "input_scale": torch.tensor([input_scale], dtype=torch.bfloat16),
    }


def _block_config(ignore: list[str]) -> dict:
    return dict(FP8_QUANTIZATION_CONFIG)


def _channel_config(ignore: list[str]) -> dict:
    return {**CT_FP8_CHANNEL_QUANTIZATION_CONFIG, "ignore": ignore}


# Per FP8 release layout (FP8_LAYOUTS): a weight's stored tensors from its bf16, and the release's quantization_config
# given the modules it keeps bf16.
FP8_WRITERS = {
    "block": (_block_parts, _block_config),
    "compressed-tensors-channel": (_channel_parts, _channel_config),
}
assert set(FP8_WRITERS) == set(FP8_LAYOUTS)


def fp8_ignore(tensors: list[PlannedTensor]) -> list[str]:
    """The Linear modules an FP8 inventory keeps bf16 (2-D weights other than embeddings): compressed-tensors'
    `ignore`."""
    return sorted(
        t.name.removesuffix(".weight")
        for t in tensors
        if len(t.shape) == 2 and t.name.endswith(".weight") and t.dtype != "F8_E4M3" and "embed_tokens" not in t.name
    )


def _fp8_data(
    seed: int, bf16_shapes: dict[str, tuple[int, ...]], fp8_format: str, tensors: list[PlannedTensor], layout
):
    """Each tensor's data for an FP8 fixture: a weight and its scales come from one quantization of the bf16
    fixture's weight (whichever is written first computes all; safetensors order may put the scales first)."""
    import torch

    parts_of = FP8_WRITERS[fp8_format][0]
    owner = {c.name: t.name for t in tensors if t.dtype == "F8_E4M3" for c in FP8_LAYOUTS[fp8_format](t.name, t.shape)}
    owner.update({t.name: t.name for t in tensors if t.dtype == "F8_E4M3"})
    pending: dict[str, object] = {}

    def data(t: PlannedTensor):
        if t.name in pending:
            return pending.pop(t.name)
        weight = owner.get(t.name)
        if weight is None:
            return synth_weight(t, seed, layout.norm_center(t.name))
        parts = parts_of(weight, synth_weight(PlannedTensor(weight, "BF16", bf16_shapes[weight]), seed), seed)
        parts[weight] = parts[weight].view(torch.uint8)
        pending.update(parts)
        return pending.pop(t.name)

    return data


SIDE_FILES = {
    "generation_config.json": lambda c: {
        "_from_model_config": True,
        "eos_token_id": c.get("eos_token_id"),
        "pad_token_id": c.get("pad_token_id"),
        "transformers_version": "5.6.0",
    },
    "tokenizer_config.json": lambda c: {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": c["max_position_embeddings"],
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    },
    "tokenizer.json": lambda c: {
        "version": "1.0",
        "model": {
            "type": "WordLevel",
            "unk_token": "<unk>",
            "vocab": {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3},
        },
        "pre_tokenizer": {"type": "Whitespace"},
        "added_tokens": [],
    },
}


def write_fixture(
    out: str | os.PathLike,
    preset: str,
    *,
    seed: int = 0,
    gib: float | None = None,
    quiet: bool = False,
    overrides: dict | None = None,
    family: Family | str | None = None,
    precision: str = "bf16",
    shard_count: int | None = None,
) -> FixtureResult:
    """Write a bf16 (or `precision="fp8"`: FP8, in the layout of the family's FP8 release) checkpoint of `family`
    (default: DEFAULT_FAMILY) to `out` (created; must be empty or absent); `overrides` change the language model's
    fields after the preset's, under mxforge's names (e.g. `n_routed_experts`; Family.config writes them where the
    family keeps them). `shard_count` splits it into that many shards instead of the preset's count (a
    replica with fewer layers than the release cannot fill the release's exact shard count).

    Raises:
        ConfigError: unknown family, preset or precision, or bad size.
        MxforgeError: `out` exists and is not empty.
        CheckpointError: a shard could not be written (nothing half-written is left under a final name).
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MxforgeError(f"{out}: exists and is not an empty directory; choose a new output directory", path=out)
    family = _family(family)
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "fp8" and not family.has_fp8_release:
        raise ConfigError(
            f"--precision fp8: the FP8 release layout of {family.title} ({family.name}) is not known; "
            "use --precision bf16"
        )
    config, settings = preset_config(preset, gib, family)
    config = family.config.updated(config, overrides or {})
    layout = family.layout_of(config)
    tensors = layout.tensors()
    data = lambda t: synth_weight(t, seed, layout.norm_center(t.name))  # noqa: E731
    if precision == "fp8":
        bf16_shapes = {t.name: t.shape for t in tensors}
        tensors = fp8_inventory(tensors, family.fp8_format, family.fp8_bf16_weights)
        data = _fp8_data(seed, bf16_shapes, family.fp8_format, tensors, layout)
        ignore = fp8_ignore(tensors)
        config["quantization_config"] = FP8_WRITERS[family.fp8_format][1](ignore)
        if family.fp8_ignore_key:
            config["quantization_config"][family.fp8_ignore_key] = ignore
    shards = plan_shards(tensors, shard_count or settings.get("shards"), settings.get("shard_bytes"))
    sparse = bool(settings.get("sparse", False))
    out.mkdir(parents=True, exist_ok=True)
    total = sum(t.nbytes for t in tensors)
    weight_map: dict[str, str] = {}
    with byte_progress(0 if sparse else total, f"fixture {preset}", disable=quiet or sparse) as bar:
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            with ShardWriter(out / name, shard) as writer:
                if sparse:
                    writer.skip_to_end()
                else:
                    for t in writer.order:
                        writer.write(t.name, data(t))
                        bar.update(t.nbytes)
            weight_map.update({t.name: name for t in shard})
    write_index(out, weight_map, total)
    for fname, make in SIDE_FILES.items():
        write_json_atomic(out / fname, make(family.config.view(config)))  # the language model's fields
    write_json_atomic(out / "config.json", config)
    return FixtureResult(out, preset, family.name, len(tensors), len(shards), total, seed, precision)
