"""`mxforge quantize SRC OUT`: argument parsing and the one-line summary (the work is in run.py)."""

from __future__ import annotations

import argparse
import sys

from mxforge.cli.support import Command, add_recipe_option, emit_exit, invocation
from mxforge.formats import DEFAULT_FORMAT, FORMATS, MXFP4, formats_title
from mxforge.quantize.scale_rules import SCALE_RULES


def _quantize_options(p: argparse.ArgumentParser) -> None:
    add_recipe_option(p)
    p.add_argument(
        "--workers", type=int, default=None, help="worker processes across shards (default: one per CPU core)"
    )
    p.add_argument("--device", default="cpu", help="where the numerics run: cpu (default) or cuda[:N]; same bytes")
    add_scale_rule_option(p)
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="encode NaN/Inf weights as Quark does (+6.0 blocks) instead of refusing",
    )
    p.add_argument(
        "--no-error-report",
        action="store_true",
        help="do not measure the quantization error while quantizing (its cost is measured in "
        "scripts/bench_quantize.py; the report, summary and model card then say 'not measured')",
    )


def add_scale_rule_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scale-rule",
        choices=sorted(SCALE_RULES),
        default=None,
        help=f"how each {MXFP4.block}-value block's {MXFP4.scale.title} scale is chosen (formats whose kernels take "
        "scale rules: " + ", ".join(f.title for f in FORMATS if f.scale_rules) + "; default: the recipe's scale_rule, "
        "else quark): " + "; ".join(f"{r.name}: {r.description}" for r in SCALE_RULES.values()),
    )


def run_quantize(args) -> int:

    from mxforge.fixups.plan_check import check_fused_shards
    from mxforge.quantize.error_report import summary_line
    from mxforge.quantize.run import quantize_checkpoint

    report = quantize_checkpoint(
        args.src,
        args.out,
        args.recipe,
        workers=args.workers,
        device=args.device,
        quiet=args.quiet,
        refuse_nonfinite=not args.allow_nonfinite,
        command=invocation(),
        follow_symlinks=args.follow_symlinks,
        scale_rule=args.scale_rule,
        measure_errors=not args.no_error_report,
        check_plan=check_fused_shards,  # a fused module's shards split across formats: refused before quantizing
    )
    c, s = report.counts, report.shards
    assert c is not None and s is not None, "a report quantize just wrote has every count"
    if report.fixups_dropped:
        print(
            f"mxforge quantize: warning: {report.out} had been fixed up: quantize wrote its config.json and index "
            f"anew, so the {report.fixups_dropped} fixup(s) mxforge fixup had applied are gone (their record "
            f"too); run `mxforge fixup {report.out}` again before validating or pushing (mxforge run does it "
            "itself)",
            file=sys.stderr,
        )
    return emit_exit(
        report.as_dict(),
        args.json,
        f"quantized {report.source} -> {report.out} with recipe {report.recipe.name}: "
        f"{c.quantized:,} tensors {formats_title(report.recipe.format or DEFAULT_FORMAT.name)}, "
        f"{c.kept:,} 2-D weights kept, {c.copied:,} copied "
        f"(MTP layer(s) {report.mtp_layers}: {report.mtp_tensors} tensors); shards {s.quantized_now} done, "
        f"{s.skipped_complete} already complete; this run: {(report.bytes_processed_now or 0) / 1e9:.2f} GB read in "
        f"{report.seconds or 0:.1f} s; the checkpoint: {(report.bytes_in or 0) / 1e9:.2f} GB in, "
        f"{(report.bytes_out or 0) / 1e9:.2f} GB out\n{summary_line(report.error)}",
    )


QUANTIZE = Command(
    "quantize",
    help="quantize a bf16 or FP8 checkpoint to MXFP4 in Quark's format (streaming, parallel, resumable)",
    description="Quantize SRC into OUT as AMD Quark 0.13's file-to-file mode would, bit for bit, "
    "with the weights a recipe selects. Rerun with the same OUT to resume after a crash: finished "
    "shards that still match their source, recipe and tool versions are skipped. An FP8 source (F8_E4M3 "
    "weights with block weight_scale_inv, as the DeepSeek-V3/R1/V3.2 and GLM-5.x FP8 releases, or compressed-"
    "tensors per-channel/per-tensor weight_scale, as GLM-4.5/4.6/4.7-FP8) is read as the bf16 it stands for "
    "(DeepSeek's weight_dequant, compressed-tensors' dequantize); its scales are not written. Unlike Quark, a "
    "recipe that would store the shards of a module an engine loads into one parameter (q/k/v, gate/up, a layer's "
    "experts) in different formats is refused before anything is written.",
    positionals=(
        ("src", "bf16 or FP8 checkpoint directory (config.json, index, shards)"),
        ("out", "output directory: new, empty, or a previous quantize output to resume"),
    ),
    options=_quantize_options,
    quiet="no progress bar",
    follow_symlinks="SRC",
    run=run_quantize,
)
