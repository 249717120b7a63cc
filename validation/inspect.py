"""`mxforge inspect`: what a checkpoint holds, by tensor kind, dtype and layer, from headers only."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from mxforge.checkpoint import Checkpoint, CheckpointSource
from mxforge.errors import ConfigError
from mxforge.formats import format_of_spec, weight_of_scale
from mxforge.models import layout_of
from mxforge.models.layer_names import LINEAGE
from mxforge.models.tensor_kinds import kind_of

EXPERT_INDEX = re.compile(r"(?:^|\.)experts\.(\d{1,6})\.")  # a routed expert stored a projection per tensor


def inspect_checkpoint(root: "str | Path | CheckpointSource") -> dict:
    """Summarize a checkpoint (a directory, or a CheckpointSource such as a Hub repo): counts/bytes by kind
    and dtype, layer structure, MTP, quantization_config.

    Raises:
        CheckpointError: not a checkpoint, or index/shard headers are unreadable.
    """
    ckpt = Checkpoint.open(root)
    infos = ckpt.tensor_infos()
    try:
        layout = layout_of(ckpt.config)
        mtp_layers = set(layout.mtp_layers)
        num_hidden = layout.num_hidden_layers
    except ConfigError:
        layout, mtp_layers, num_hidden = None, set(), None
    # Without a family (config.json unreadable or of another architecture): the lineage's names and kinds.
    locate = layout.locate if layout is not None else (lambda n: LINEAGE.locate(n, 1 << 30))
    by_kind: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "dtypes": defaultdict(int)})
    by_dtype: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    layers: dict[int, dict] = defaultdict(
        lambda: {"experts": set(), "dense_mlp": False, "indexer": False, "tensors": 0}
    )
    for name, info in infos.items():
        layer, local = locate(name)
        local_kind = layout.kind_of(name) if layout is not None else kind_of(local)
        kind = "mtp" if layer in mtp_layers else local_kind
        for bucket in (by_kind[kind],):
            bucket["tensors"] += 1
            bucket["bytes"] += info.nbytes
            bucket["dtypes"][info.dtype] += 1
        by_dtype[info.dtype]["tensors"] += 1
        by_dtype[info.dtype]["bytes"] += info.nbytes
        if layer is not None:
            entry = layers[layer]
            entry["tensors"] += 1
            expert = EXPERT_INDEX.search(local)
            if local_kind == "experts" and expert:
                entry["experts"].add(int(expert.group(1)))
            entry["dense_mlp"] |= local_kind == "dense_mlp"
            entry["indexer"] |= local_kind == "indexer"
    # Decoder layers are those config.json declares: a stored layer past them (an MTP layer config.json no longer
    # declares) is listed as beyond the config, never counted as a decoder layer.
    decoder = sorted(i for i in layers if i not in mtp_layers and (num_hidden is None or i < num_hidden))
    structure = {
        "decoder_layers": len(decoder),
        "dense_layers": [i for i in decoder if layers[i]["dense_mlp"]],
        "moe_layers": [i for i in decoder if layers[i]["experts"]],
        "indexer_layers": [i for i in decoder if layers[i]["indexer"]],
        "experts_per_moe_layer": sorted({len(layers[i]["experts"]) for i in layers if layers[i]["experts"]}),
    }
    mtp = {
        "expected_layers": sorted(mtp_layers),
        "present_layers": sorted(i for i in layers if i in mtp_layers),
        "tensors": sum(layers[i]["tensors"] for i in layers if i in mtp_layers),
        "orphan_layers_beyond_config": sorted(
            i for i in layers if num_hidden is not None and i >= num_hidden and i not in mtp_layers
        ),
    }
    mtp["present"] = bool(mtp["present_layers"])
    # The config.json fields that declare the layers, as this family names them (Family.config)
    mtp["declared_by"] = [
        layout.field_name(f) if layout is not None else f for f in ("num_hidden_layers", "num_nextn_predict_layers")
    ]
    mtp["complete"] = layout is not None and all(
        {t.name for t in layout.layer_tensors(i)} - layout.omittable() <= {weight_of_scale(n) or n for n in infos}
        for i in mtp_layers
    )
    return {
        "stage": "inspect",
        "path": ckpt.label,
        "architecture": (ckpt.config.get("architectures") or [None])[0],
        "family": layout.family.title if layout is not None else None,
        "default_recipe": layout.family.default_recipe if layout is not None else None,
        "precision": checkpoint_precision(ckpt.quantization_config),
        "tensors": len(infos),
        "bytes": sum(i.nbytes for i in infos.values()),
        "shards": len(ckpt.shard_names),
        "index_total_size": ckpt.index_metadata.get("total_size"),
        "by_kind": {k: {**v, "dtypes": dict(v["dtypes"])} for k, v in sorted(by_kind.items())},
        "by_dtype": dict(sorted(by_dtype.items())),
        "layers": structure,
        "mtp": mtp,
        "quantization": summarize_quant_config(ckpt.quantization_config),
        **({"fetched": ckpt.source.stats()} if ckpt.source.stats() is not None else {}),
    }


def checkpoint_precision(qc: dict | None) -> str:
    """What the weights are stored as, from quantization_config: bf16 (none), fp8 (a source mxforge reads, with its
    block shape), an element format (Quark's spec of one: mxforge/formats/), or the quant_method as named."""
    if not qc:
        return "bf16"
    if qc.get("quant_method") == "quark":
        weight = (qc.get("global_quant_config") or {}).get("weight") or {}
        fmt = format_of_spec(weight)
        what = fmt.title if fmt is not None else "not an element format mxforge knows"
        layers = _layer_formats(qc)
        more = "".join(f" + {title} ({n} layer_quant_config pattern(s))" for title, n in layers.items())
        return f"Quark {weight.get('dtype')} group {weight.get('group_size')} ({what}){more}"
    from mxforge.errors import ConfigError
    from mxforge.quantize.fp8_source import source_precision

    try:
        return source_precision({"quantization_config": qc}).describe()
    except ConfigError:
        return f"{qc.get('quant_method')} (not a source mxforge reads)"


def _layer_formats(qc: dict) -> dict[str, int]:
    """Per format named by `layer_quant_config`'s layer configs (an element format's title, else the weight dtype as
    written, else "no weight quantization"), how many patterns name it, in the config's order."""
    out: dict[str, int] = {}
    layers = qc.get("layer_quant_config")
    for config in (layers if isinstance(layers, dict) else {}).values():
        weight = (config or {}).get("weight") if isinstance(config, dict) else None
        fmt = format_of_spec(weight) if isinstance(weight, dict) else None
        title = fmt.title if fmt else f"{weight.get('dtype')}" if isinstance(weight, dict) else "no weight quantization"
        out[title] = out.get(title, 0) + 1
    return out


def summarize_quant_config(qc: dict | None) -> dict | None:
    if not qc:
        return None
    weight = (qc.get("global_quant_config") or {}).get("weight") or {}
    exclude = list(qc.get("exclude") or [])
    return {
        "quant_method": qc.get("quant_method"),
        "weight_dtype": weight.get("dtype"),
        "group_size": weight.get("group_size"),
        "scale_format": weight.get("scale_format"),
        "layer_formats": _layer_formats(qc),
        "exclude_entries": len(exclude),
        "exclude_regex_entries": sum(1 for e in exclude if str(e).startswith("re:")),
        "exclude_glob_entries": sum(1 for e in exclude if any(ch in str(e) for ch in "*?[")),
        "exclude_sample": exclude[:5],
    }


def format_inspect(report: dict) -> str:
    def gb(n):
        return f"{n / 1e9:,.3f} GB"

    family = f" ({report['family']})" if report.get("family") else " (no supported model family)"
    lines = [
        f"{report['path']}: {report['architecture']}{family}, {report['tensors']:,} tensors, "
        f"{gb(report['bytes'])} in {report['shards']} shard(s)",
        f"  precision: {report['precision']}"
        + (f"; default recipe: {report['default_recipe']}" if report.get("default_recipe") else ""),
    ]
    lines.append(f"  {'kind':<16}{'tensors':>9}{'bytes':>16}  dtypes")
    for kind, v in report["by_kind"].items():
        dtypes = ", ".join(f"{d}:{n}" for d, n in sorted(v["dtypes"].items()))
        lines.append(f"  {kind:<16}{v['tensors']:>9,}{gb(v['bytes']):>16}  {dtypes}")
    s = report["layers"]
    indexer = f", indexer on {len(s['indexer_layers'])}" if s["indexer_layers"] else ""  # DSA families only
    lines.append(
        f"  layers: {s['decoder_layers']} decoder ({len(s['dense_layers'])} dense, {len(s['moe_layers'])} MoE "
        f"with {'/'.join(map(str, s['experts_per_moe_layer'])) or 0} experts){indexer}"
    )
    m = report["mtp"]
    if m["present"]:
        lines.append(
            f"  MTP: layer(s) {m['present_layers']} present, {m['tensors']} tensors, "
            f"{'complete' if m['complete'] else 'INCOMPLETE'}"
        )
    elif m["expected_layers"]:
        lines.append(
            f"  MTP: config declares layer(s) {m['expected_layers']} but the checkpoint has none of their tensors"
        )
    else:
        lines.append(f"  MTP: none declared ({m['declared_by'][1]} is 0 or absent)")
    if m["orphan_layers_beyond_config"]:
        lines.append(
            f"  beyond config.json: layer(s) {m['orphan_layers_beyond_config']} are stored but not declared "
            f"({' + '.join(m['declared_by'])}): no engine builds them"
        )
    q = report["quantization"]
    if q and q["weight_dtype"] is None:
        lines.append(f"  quantization_config: {report['precision']}")
    elif q:
        lines.append(
            f"  quantization_config: {q['quant_method']} {q['weight_dtype']} group {q['group_size']} "
            f"scales {q['scale_format']}, {q['exclude_entries']} exclude entries "
            f"({q['exclude_regex_entries']} re:, {q['exclude_glob_entries']} glob)"
            + "".join(f"; {n} layer_quant_config pattern(s) {title}" for title, n in q["layer_formats"].items())
        )
    else:
        lines.append("  quantization_config: none (unquantized)")
    if "fetched" in report:
        from mxforge.progress import fetched_line

        lines.append(f"  {fetched_line(report['fetched'])}")
    return "\n".join(lines)
