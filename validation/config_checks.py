"""Engine-independent checks: `quantization_config` is well-formed, and every tensor config.json implies is there."""

from __future__ import annotations

import re
from typing import Mapping

from mxforge.bounded_re import compile_bounded
from mxforge.formats import FORMATS, format_named, format_of_spec
from mxforge.models import MoeLayout
from mxforge.safetensors_io import PlannedTensor, TensorInfo
from mxforge.validation.matching import is_glob
from mxforge.validation.report import Problem
from mxforge.validation.tensor_forms import BF16, Stored

QC = "config.json:quantization_config"


def exclude_entries(qc: Mapping | None) -> list[str]:
    """The `exclude` list, or [] when absent or unusable (reported by check_quant_config)."""
    entries = (qc or {}).get("exclude") or []
    return [e for e in entries if isinstance(e, str)] if isinstance(entries, list) else []


def check_quant_config(qc: Mapping | None, quantized: frozenset[str]) -> list[Problem]:
    """Problems with `quantization_config` that stop every engine (or make `exclude` entries dead letters).
    `quantized`: the element formats the checkpoint's weights are stored in (their names)."""
    if qc is None:
        if quantized:
            held = ", ".join(f"{f.codes_label} ({f.title})" for f in map(format_named, sorted(quantized)))
            return [
                Problem(
                    "quant_config",
                    QC,
                    f"missing, but the checkpoint holds {held} weights: engines would load the packed bytes as bf16",
                    "restore the quantization_config written by the quantizer",
                )
            ]
        return []
    problems = []

    def bad(subject: str, message: str, remedy: str) -> None:
        problems.append(Problem("quant_config", f"{QC}.{subject}", message, remedy))

    if qc.get("quant_method") != "quark":
        bad(
            "quant_method",
            f"is {qc.get('quant_method')!r}, expected 'quark'",
            "write the quantizer's quantization_config",
        )
    export = qc.get("export")
    if not isinstance(export, dict):
        bad("export", 'missing: both engines raise "The export key should be included"', "write Quark's export block")
    elif export.get("pack_method") not in ("reorder", "order"):
        bad("export.pack_method", f"is {export.get('pack_method')!r}, expected 'reorder'", "write Quark's export block")
    weight = (
        (qc.get("global_quant_config") or {}).get("weight") if isinstance(qc.get("global_quant_config"), dict) else None
    )
    if not isinstance(weight, dict):
        bad("global_quant_config.weight", "missing", "write the quantizer's quantization_config")
    else:
        # the weight spec a Quark export of one of the formats carries (its spec class: mxforge/formats/): the
        # format it names, else the one it is closest to (most spec fields alike; the first such)
        fmt = format_of_spec(weight) or max(
            FORMATS, key=lambda f: sum(weight.get(k) == v for k, v in f.spec_fields.items())
        )
        for key, want in fmt.spec_fields.items():
            if weight.get(key) != want:
                bad(
                    f"global_quant_config.weight.{key}",
                    f"is {weight.get(key)!r}, expected {want!r} for {fmt.title}",
                    "write the quantizer's quantization_config",
                )
    entries = qc.get("exclude", [])
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        bad("exclude", "must be a list of module names", "write exclude as a JSON list of strings")
        return problems
    for i, entry in enumerate(entries):
        if is_glob(entry):
            bad(
                f"exclude[{i}]",
                f"{entry!r} is a glob; engines match exact names or 're:' regexes only, so it matches nothing",
                "run mxforge fixup (rewrites it into the exact module names it covers)",
            )
        elif entry.startswith("re:"):
            try:
                compile_bounded(entry[3:], where=f"{QC}.exclude[{i}]")  # raises ConfigError past the bounds
            except re.error as e:
                bad(
                    f"exclude[{i}]",
                    f"{entry!r} is not a valid regex ({e}); engines raise on it",
                    "fix or remove the entry",
                )
    return problems


def check_layout(
    layout: MoeLayout,
    planned: list[PlannedTensor],
    stored: Mapping[str, Stored],
    infos: Mapping[str, TensorInfo],
    skip: frozenset[str],
) -> tuple[list[Problem], dict]:
    """Every tensor config.json implies is stored (a linear as bf16 or an element format); the MTP layer is complete.

    Returns the problems and the count of stored linears per form.
    """
    problems: list[Problem] = []
    counts = {**{f.name: 0 for f in FORMATS}, BF16: 0}
    missing_by_layer: dict[int | None, list[str]] = {}
    for s in stored.values():
        if s.form:
            counts[s.form] += 1
    mtp_present = {layer: any(t.name in infos for t in layout.layer_tensors(layer)) for layer in layout.mtp_layers}
    omittable = layout.omittable()
    for t in planned:
        if t.name in infos or t.name in skip or t.name in omittable:
            continue
        layer = layout.layer_of(t.name)
        missing_by_layer.setdefault(layer, []).append(t.name)
    for layer, names in missing_by_layer.items():
        if layer is not None and layout.is_mtp(layer) and not mtp_present[layer]:
            problems.append(
                Problem(
                    "mtp",
                    layout.layer_prefix(layer)[:-1],
                    "the checkpoint ships no MTP layer tensors "
                    f"({layout.field_name('num_nextn_predict_layers')} = {len(layout.mtp_layers)}, so "
                    f"{layout.layer_prefix(layer)}* is expected): "
                    "engines cannot build the draft model for speculative decoding",
                    "re-inject it from the bf16 source: mxforge fixup CKPT --mtp-from BF16_SRC --recipe RECIPE "
                    f"(or set {layout.field_name('num_nextn_predict_layers')} to 0 to ship without MTP)",
                )
            )
            continue
        check = "mtp" if layer is not None and layout.is_mtp(layer) else "layout"
        for name in names:
            what = "linear weight (bf16 or quantized)" if name.removesuffix(".weight") in stored else "tensor"
            problems.append(
                Problem(
                    check,
                    name,
                    f"config.json implies this {what} but no shard holds it",
                    "re-create the checkpoint from its source (or restore the tensor)",
                )
            )
    return problems, counts
