"""`mxforge fixup --mtp-from BF16_SRC --recipe R`: put back an MTP layer an export shipped without.

The MTP layer(s) are read from the bf16 source, quantized per the recipe with the quantizer's own
numerics (bit-identical to Quark), and written as one new shard; then the index and config.json are
updated (exclude gains the MTP modules kept bf16) and the usual fixup runs on the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from mxforge.checkpoint import INDEX_NAME, Checkpoint, write_index
from mxforge.errors import CheckpointError, ConfigError
from mxforge.formats import ElementFormat
from mxforge.models import MoeLayout, family_of, layout_of
from mxforge.progress import byte_progress
from mxforge.provenance import keep_original
from mxforge.safetensors_io import PlannedTensor, ShardWriter, write_json_atomic

if TYPE_CHECKING:
    import torch

MTP_SHARD = "model-mtp.safetensors"


# config.json fields that must agree between the export and the bf16 source for its MTP layer to fit.
SHAPE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "moe_intermediate_size",
    "n_routed_experts",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_attention_heads",
    "index_n_heads",
    "index_head_dim",
    "n_shared_experts",
)


@dataclass
class MtpPlan:
    layers: list[int]
    tensors: list[PlannedTensor]  # as written (quantized weights: codes + scales)
    quantize: dict[str, ElementFormat]  # source weight names that are quantized, and the format each goes to
    kept_modules: list[str]  # 2-D weights kept bf16: they join `exclude`
    source_bytes: int
    kept_tensors: int = 0  # source tensors written as they are (everything not quantized)


def plan_mtp_injection(ckpt: Checkpoint, src: Checkpoint, recipe) -> MtpPlan:
    """What to copy from `src`: every tensor of the MTP layer(s) `ckpt` lacks, with the recipe's decisions.

    Raises:
        ConfigError: the source's config does not match the export's, or neither declares MTP layers.
        CheckpointError: the export already holds MTP tensors, or the source lacks them.
    """
    from mxforge.quantize.fp8_source import source_precision
    from mxforge.quantize.plan import plan_tensor

    if source_precision(src.config, str(src.root / "config.json")).is_fp8:
        raise ConfigError(
            f"{src.root}: is an FP8 checkpoint; --mtp-from reads a bf16 source. Re-run `mxforge quantize` "
            "(or `mxforge run`) from the FP8 checkpoint instead: it keeps the MTP layer",
            path=src.root,
        )
    family = family_of(ckpt.config)
    ours, theirs = family.config.view(ckpt.config), family.config.view(src.config)
    mismatched = [family.config.where(f) for f in SHAPE_FIELDS if ours.get(f) != theirs.get(f)]
    if mismatched:
        raise ConfigError(
            f"{src.root}: config.json differs from {ckpt.root}'s in {mismatched}; "
            "--mtp-from needs the bf16 source this export was made from",
            path=src.root,
        )
    declared = _nextn(ckpt.config) or _nextn(src.config)
    layout = family.layout_of(family.config.updated(ckpt.config, {"num_nextn_predict_layers": declared}))
    if not layout.mtp_layers:
        raise ConfigError(
            f"{src.root}: {family.config.where('num_nextn_predict_layers')} is 0 in both configs: there is no MTP "
            "layer to inject",
            path=src.root,
        )
    present = mtp_tensors(ckpt.weight_map, layout)
    if present:
        raise CheckpointError(
            f"{ckpt.root}: already holds MTP tensors (e.g. {present[0]}); --mtp-from only re-injects "
            "a missing MTP layer",
            path=ckpt.root,
        )
    infos = {n: i for n, i in src.tensor_infos().items() if layout.in_mtp_layer(n)}
    if not infos:
        raise CheckpointError(
            f"{src.root}: holds no {layout.layer_prefix(layout.mtp_layers[0])}* tensors either; "
            "use the original bf16 checkpoint",
            path=src.root,
        )
    plans = [plan_tensor(infos[n], recipe, layout) for n in sorted(infos)]
    return MtpPlan(
        list(layout.mtp_layers),
        [o for p in plans for o in p.outputs()],
        {p.source.name: p.format for p in plans if p.format is not None},
        [p.source.name.removesuffix(".weight") for p in plans if p.fate == "kept"],
        sum(i.nbytes for i in infos.values()),
        sum(p.format is None for p in plans),
    )


def mtp_tensors(names: Iterable[str], layout: MoeLayout) -> list[str]:
    """Those of `names` that belong to an MTP layer (per config.json), in order."""
    return [n for n in names if layout.in_mtp_layer(n)]


def held_mtp_layers(names: Iterable[str], layout: MoeLayout) -> list[int]:
    """MTP layers (per config.json) of which `names` hold any tensor."""
    return sorted({layer for n in mtp_tensors(names, layout) if (layer := layout.layer_of(n)) is not None})


def inject_mtp(
    root: str | Path | Checkpoint, src_root: str | Path, recipe_name: str | None, quiet: bool = False
) -> dict:
    """Write the MTP layer(s) from `src_root` into checkpoint `root` (a path, or one already open); returns
    the record of what was done.

    The new shard is written under a temporary name and renamed; then the index, then config.json
    (originals kept as *.orig on the first change).

    Raises:
        ConfigError / CheckpointError: see plan_mtp_injection; NonFiniteWeightError from the quantizer.
    """
    from safetensors import safe_open

    from mxforge.quantize.recipe import load_recipe

    ckpt = root if isinstance(root, Checkpoint) else Checkpoint.open(root)
    recipe = load_recipe(recipe_name, ckpt.config)
    src = Checkpoint.open(src_root)
    plan = plan_mtp_injection(ckpt, src, recipe)
    if (ckpt.root / MTP_SHARD).exists() and MTP_SHARD in ckpt.shard_names:
        raise CheckpointError(
            f"{ckpt.root / MTP_SHARD}: already in the index; nothing to inject", path=ckpt.root / MTP_SHARD
        )
    pending_scales: dict[str, torch.Tensor] = {}
    with (
        byte_progress(plan.source_bytes, "fixup: MTP layer", disable=quiet) as bar,
        ShardWriter(ckpt.root / MTP_SHARD, plan.tensors) as writer,
    ):
        handles = {}
        try:
            for t in writer.order:  # a quantized weight's codes come before its scales (name order)
                if t.name in pending_scales:
                    writer.write(t.name, pending_scales.pop(t.name))
                    continue
                shard = src.weight_map[t.name]
                if shard not in handles:
                    handles[shard] = safe_open(str(src.root / shard), framework="pt")
                tensor = handles[shard].get_tensor(t.name)
                bar.update(tensor.numel() * tensor.element_size())
                fmt = plan.quantize.get(t.name)
                if fmt is not None:
                    codes, scales = fmt.quantize(tensor, name=t.name)
                    pending_scales[fmt.scale_name(t.name)] = scales
                    writer.write(t.name, codes)
                else:
                    writer.write(t.name, tensor)
        finally:
            handles.clear()
    _update_index(ckpt, plan)
    _update_config(ckpt, src, plan)
    return {
        "fixup": "mtp_inject",
        "layers": plan.layers,
        "source": str(src.root),
        "recipe": recipe.name,
        "recipe_sha256": recipe.sha256,
        "shard": MTP_SHARD,
        "quantized": len(plan.quantize),
        "kept_bf16": plan.kept_tensors,
        "excluded_modules_added": len(plan.kept_modules),
        "why": "the export shipped without its MTP layer",
    }


def _update_index(ckpt: Checkpoint, plan: MtpPlan) -> None:
    keep_original(ckpt.root, INDEX_NAME)
    weight_map = dict(ckpt.weight_map)
    weight_map.update({t.name: MTP_SHARD for t in plan.tensors})
    total = int(ckpt.index_metadata.get("total_size", 0)) + sum(t.nbytes for t in plan.tensors)
    write_index(ckpt.root, weight_map, total, ckpt.index_metadata)


def _update_config(ckpt: Checkpoint, src: Checkpoint, plan: MtpPlan) -> None:
    keep_original(ckpt.root, "config.json")
    config = dict(ckpt.config)
    if not _nextn(config):
        config = family_of(config).config.updated(config, {"num_nextn_predict_layers": _nextn(src.config)})
    qc = config.get("quantization_config")
    if qc is not None:
        exclude = list(qc.get("exclude") or [])
        config["quantization_config"] = {**qc, "exclude": exclude + [m for m in plan.kept_modules if m not in exclude]}
    write_json_atomic(ckpt.root / "config.json", config)


def _nextn(config: dict) -> int:
    """How many MTP layers config.json declares."""
    return len(layout_of(config).mtp_layers)
