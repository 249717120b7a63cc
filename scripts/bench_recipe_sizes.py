#!/usr/bin/env python
"""Output size per shipped recipe, on each family's complete real layout: what `mxforge quantize --recipe R` would
write, planned from the headers of the family's `full-layout` fixture (sparse: real headers, no data read), against
the same tensors in bf16.

For every family and every recipe it ships (mxforge/models/: `Family.recipes`; a recipe that keeps FP8 weights as
stored is planned on the family's FP8 release's full layout, `--precision fp8`), the plan's output headers (the
tensors, dtypes and shapes the shards would hold) give the checkpoint's tensor bytes; the bf16 figure counts each
weight stored in an element format at 2 bytes an element and its scales not at all (mxforge.hub.card.size_summary,
the figure the model card states). Also the tensors per format. Nothing is quantized.

    .venv/bin/python scripts/bench_recipe_sizes.py [--family NAME ...] [--workdir DIR] [--json OUT] [--markdown]
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

from bench_markdown import add_markdown_option, emit_report

from mxforge.checkpoint import Checkpoint
from mxforge.fixups.plan_check import planned_output
from mxforge.formats import declared_formats, stored_pairs
from mxforge.hub.card import size_summary
from mxforge.models import FAMILIES, family_named
from mxforge.models.fixture import write_fixture
from mxforge.quantize.plan import plan_checkpoint
from mxforge.quantize.recipe import load_recipe


def recipe_sizes(src: Path, recipes: tuple[str, ...]) -> dict[str, dict]:
    """Per recipe: the planned output's tensor bytes, their bf16 equivalent, and its weights per stored format."""
    ckpt = Checkpoint.open(src)
    out = {}
    for name in recipes:
        recipe = load_recipe(name, ckpt.config)
        plan = plan_checkpoint(ckpt, recipe)
        qc, planned = planned_output(plan, recipe, ckpt)
        size = size_summary(planned.infos, qc)
        formats = Counter(p.format.title for p in stored_pairs(planned.infos, declared_formats(qc)).values())
        out[name] = {
            "bytes": size.stored,
            "bf16_bytes": size.bf16,
            "saved_bytes": size.saved,
            "saved_fraction": size.saved / size.bf16,
            "weights_per_format": dict(formats),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", action="append", help="a family name (default: every family)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the full-layout fixtures go (kept for reruns)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    add_markdown_option(ap)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mxforge-sizes-"))
    families = [family_named(n) for n in args.family] if args.family else list(FAMILIES)
    report: dict[str, dict] = {}
    lines = [
        "| family | recipe | checkpoint | bf16 | saved | weights per format |",
        "|---|---|---:|---:|---:|---|",
    ]
    for family in families:
        keep = [r for r in family.recipes if load_recipe(r).keeps_source_weights]
        report[family.name] = {}
        for precision, recipes in (("bf16", [r for r in family.recipes if r not in keep]), ("fp8", keep)):
            if not recipes:
                continue
            src = work / f"{family.name}-full-layout" / precision
            if not (src / "config.json").exists():
                write_fixture(src, "full-layout", family=family, precision=precision, quiet=True)
            report[family.name].update(recipe_sizes(src, tuple(recipes)))
        for name, r in report[family.name].items():
            formats = ", ".join(f"{k} {v:,}" for k, v in sorted(r["weights_per_format"].items()))
            lines.append(
                f"| {family.title} | `{name}` | {r['bytes'] / 1e9:,.1f} GB | {r['bf16_bytes'] / 1e9:,.1f} GB "
                f"| {r['saved_bytes'] / 1e9:,.1f} GB ({r['saved_fraction']:.1%}) | {formats} |"
            )
    emit_report(args, lines, report)


if __name__ == "__main__":
    main()
