"""The quantization error report: how far each quantized tensor is from its source, measured by the kernels
in the same pass that quantizes it (no second read of the source).

Per tensor, over its finite values x and their reconstructions q (an element's value times its scale: the block's
2^e for MXFP4, the row's float32 scale for FP8 PTPC):
- rel_rmse: sqrt(sum (x - q)^2 / sum x^2), the relative RMS error (0 for an all-zero tensor);
- snr_db: 10 log10(sum x^2 / sum (x - q)^2) (None when the error is exactly zero);
- max_abs_err: max |x - q|;
- clipped_fraction: the fraction of values above the largest magnitude their scale can represent (MXFP4:
  6 * 2^e), which are therefore stored as that magnitude. Quark's MXFP4 exponent clips the values of a block
  whose amax lies in [1.5, 1.75) * 2^k; a scale rule can trade clipping for resolution.
The kernels add four float64 running sums per tensor (mxforge.formats.ERROR_STATS); this module turns them into
those figures and aggregates them per module class (tensor_kinds, the MTP layer as its own class), per element
format (where a recipe mixes formats) and per layer, with the worst tensors named. Aggregates pool the sums (an
element-weighted RMSE), not the ratios.
"""

from __future__ import annotations

import math
from collections import defaultdict

from mxforge.formats import formats_title
from mxforge.models.layout import MoeLayout

WORST_SHOWN = 5
SUM_KEYS = ("sum_sq_err", "sum_sq", "max_abs_err", "clipped", "elements")


def tensor_record(stats, elements: int) -> dict:
    """The running sums of one tensor as stored in quantize's per-shard state (what resume keeps)."""
    return {
        "sum_sq_err": float(stats[0]),
        "sum_sq": float(stats[1]),
        "max_abs_err": float(stats[2]),
        "clipped": int(stats[3]),
        "elements": int(elements),
    }


def figures(sums: dict) -> dict:
    """rel_rmse, snr_db, max_abs_err, clipped_fraction (and elements) of pooled sums."""
    err, ref, n = sums["sum_sq_err"], sums["sum_sq"], sums["elements"]
    return {
        "rel_rmse": math.sqrt(err / ref) if ref > 0 else 0.0,
        "snr_db": round(10 * math.log10(ref / err), 3) if err > 0 and ref > 0 else None,
        "max_abs_err": sums["max_abs_err"],
        "clipped_fraction": sums["clipped"] / n if n else 0.0,
        "elements": n,
    }


def _pool(records: list[dict]) -> dict:
    out = {"sum_sq_err": 0.0, "sum_sq": 0.0, "max_abs_err": 0.0, "clipped": 0, "elements": 0}
    for r in records:
        for k in ("sum_sq_err", "sum_sq", "clipped", "elements"):
            out[k] += r[k]
        out["max_abs_err"] = max(out["max_abs_err"], r["max_abs_err"])
    return out


def error_report(
    per_tensor: dict[str, dict], layout: MoeLayout, scale_rule: str, formats: dict[str, str] | None = None
) -> dict:
    """The report of quantize's JSON from per-tensor records (tensor_record), all shards pooled; `formats`: each
    tensor's element format (its registry name), for the per-format figures."""
    # Not measured: NaN/Inf encoded as Quark does, --no-error-report, or weights so large (> 1e19) that their
    # squares overflow the kernels' float32 sums.
    measured = {
        n: r
        for n, r in per_tensor.items()
        if r.get("elements") and all(math.isfinite(r[k]) for k in ("sum_sq_err", "sum_sq", "max_abs_err"))
    }
    not_measured = sorted(set(per_tensor) - set(measured))
    per_tensor = measured
    by_class, by_layer, by_format = defaultdict(list), defaultdict(list), defaultdict(list)
    for name, rec in per_tensor.items():
        by_class[layout.module_class(name)].append(rec)
        if formats and name in formats:
            by_format[formats[name]].append(rec)
        layer = layout.layer_of(name)
        by_layer["global" if layer is None else str(layer)].append(rec)
    tensors = {name: _rounded(figures(rec)) for name, rec in sorted(per_tensor.items())}
    worst = sorted(tensors.items(), key=lambda kv: -kv[1]["rel_rmse"])[:WORST_SHOWN]
    return {
        "scale_rule": scale_rule,
        "definitions": {
            "rel_rmse": "sqrt(sum (x-q)^2 / sum x^2)",
            "snr_db": "10 log10(sum x^2 / sum (x-q)^2)",
            "max_abs_err": "max |x-q|",
            "clipped_fraction": "fraction of values above the largest magnitude their scale can represent",
        },
        "tensors_measured": len(per_tensor),
        "tensors_not_measured": not_measured,
        "overall": _rounded(figures(_pool(list(per_tensor.values())))) if per_tensor else None,
        "by_class": {c: _rounded(figures(_pool(rs))) | {"tensors": len(rs)} for c, rs in sorted(by_class.items())},
        "by_format": {f: _rounded(figures(_pool(rs))) | {"tensors": len(rs)} for f, rs in by_format.items()},
        "by_layer": {
            k: _rounded(figures(_pool(rs))) | {"tensors": len(rs)}
            for k, rs in sorted(
                by_layer.items(), key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0)
            )
        },
        "worst": [{"name": n, **f} for n, f in worst],
        "tensors": tensors,
    }


def _rounded(f: dict) -> dict:
    return {
        "rel_rmse": round(f["rel_rmse"], 6),
        "snr_db": f["snr_db"],
        "max_abs_err": float(f"{f['max_abs_err']:.6g}"),
        "clipped_fraction": round(f["clipped_fraction"], 8),
        "elements": f["elements"],
    }


def summary_line(report: dict | None) -> str:
    """One line for quantize's and run's summaries."""
    if not report or not report.get("overall"):
        return "error: not measured"
    o, worst = report["overall"], (report.get("worst") or [{}])[0]
    return (
        f"error ({report['scale_rule']} scale rule, {report['tensors_measured']:,} tensors): relative RMSE "
        f"{o['rel_rmse']:.4f}, SNR {o['snr_db']} dB, max |err| {o['max_abs_err']:.4g}, clipped "
        f"{100 * o['clipped_fraction']:.3f}%; worst {worst.get('name')} (relative RMSE {worst.get('rel_rmse', 0):.4f})"
    )


def markdown_table(report: dict | None) -> list[str]:
    """The model card's table: overall and per module class, then the worst tensors."""
    if not report or not report.get("overall"):
        return ["not recorded"]
    lines = [
        f"Measured by `mxforge quantize` in the same pass that quantized (scale rule `{report['scale_rule']}`); "
        "relative RMSE = sqrt(Σ(x−q)²/Σx²), clipped = |x| above the largest magnitude its block's scale can "
        "represent (the largest element value times the scale).",
        "",
        "| module class | tensors | relative RMSE | SNR (dB) | max abs error | clipped |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    by_format = report.get("by_format") or {}
    rows = [("**all**", {**report["overall"], "tensors": report["tensors_measured"]})]
    if len(by_format) > 1:  # a mixed recipe: each format's own figures
        rows += [(f"**{formats_title(f)}**", figures_) for f, figures_ in by_format.items()]
    rows += list(report["by_class"].items())
    for cls, f in rows:
        lines.append(
            f"| {cls} | {f['tensors']:,} | {f['rel_rmse']:.4f} | {f['snr_db']} | {f['max_abs_err']:.4g} | "
            f"{100 * f['clipped_fraction']:.3f}% |"
        )
    if report.get("worst"):
        lines += [
            "",
            "Worst tensors: " + ", ".join(f"`{w['name']}` ({w['rel_rmse']:.4f})" for w in report["worst"]) + ".",
        ]
    return lines
