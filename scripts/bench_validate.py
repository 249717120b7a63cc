#!/usr/bin/env python
"""Benchmark `mxforge validate` on the full GLM-5.2 layout (59,585 tensors, 282 shards), headers only.

Two checkpoints, built as sparse files (real headers, data holes) under --workdir:
  bf16   the `full-layout` fixture;
  quark  the same written in Quark's MXFP4 format (AMD's exclusions + the MTP layer), then `fixup`-ed,
         so that every engine check runs against a realistic 1,000+ entry exclude list.
For each: the median wall time of validate_checkpoint (every engine release range) over --repeat runs, and,
measured side by side in the same run, the median time to parse the 282 headers alone (the floor any
header-only check pays). Target: validate under 2 s. Also timed: `fixup` on the same Quark-format
checkpoint with its exclusions written as globs (7 globs -> some 1,300 exact names and aliases), config
restored between runs.

    .venv/bin/python scripts/bench_validate.py [--workdir DIR] [--repeat N] [--json REPORT] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_markdown import add_markdown_option, emit_report, table

from mxforge.checkpoint import Checkpoint
from mxforge.fixups.fixup import fixup_checkpoint
from mxforge.models.fixture import write_fixture
from mxforge.provenance import CONFIG_BACKUP_NAME, FIXUPS_NAME
from mxforge.safetensors_io import read_header
from mxforge.validation.validate import validate_checkpoint

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "support")]  # helpers' constants and quark_like: test code

from helpers import BASE  # noqa: E402
from quark_like import write_quark_like  # noqa: E402

TARGET_S = 2.0
AMD_WITH_MTP = BASE + ["*layers.78.*"]  # AMD's published exclusions, GLM-5.2's MTP layer (78) whole


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def parse_headers(root: Path) -> None:
    ckpt = Checkpoint.open(root)
    for shard in ckpt.shard_names:
        read_header(root / shard)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where to build the checkpoints (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    add_markdown_option(ap)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-validate-"))
    bf16, quark = work / "full-bf16", work / "full-quark"
    if not bf16.exists():
        write_fixture(bf16, "full-layout", quiet=True)
    if not quark.exists():
        write_quark_like(bf16, quark, AMD_WITH_MTP, sparse=True)
        fixup_checkpoint(quark, command="bench_validate.py")
    rows = {}
    for label, path in (("bf16", bf16), ("quark", quark)):
        report = validate_checkpoint(path)
        if not report.ok:
            print(report.format()[:2000], file=sys.stderr)
            return 1
        headers = median_time(lambda: parse_headers(path), args.repeat)
        validate = median_time(lambda: validate_checkpoint(path), args.repeat)
        rows[label] = {
            "tensors": report.checked["integrity"]["tensors"],
            "shards": report.checked["integrity"]["shards"],
            "exclude_entries": len((Checkpoint.open(path).quantization_config or {}).get("exclude", [])),
            "validate_s": round(validate, 3),
            "headers_only_s": round(headers, 3),
            "ratio_to_headers": round(validate / headers, 2),
            "under_target": validate < TARGET_S,
        }
    globbed = work / "full-quark-globs"
    if not globbed.exists():
        write_quark_like(bf16, globbed, AMD_WITH_MTP, sparse=True, glob_exclude=True)
    backup = globbed / "config.json.orig"  # present when an earlier run fixed it up
    original = (backup if backup.exists() else globbed / "config.json").read_text()

    def fixup_fresh() -> None:
        (globbed / "config.json").write_text(original)
        for leftover in (CONFIG_BACKUP_NAME, FIXUPS_NAME):
            (globbed / leftover).unlink(missing_ok=True)
        result = fixup_checkpoint(globbed, command="bench_validate.py")
        assert result.changed and not result.remaining

    fixup_s = median_time(fixup_fresh, args.repeat)
    rows["fixup_globs"] = {
        "fixup_s": round(fixup_s, 3),
        "exclude_entries_after": len(Checkpoint.open(globbed).quantization_config["exclude"]),
    }
    described = {"bf16": "full GLM-5.2 layout, bf16", "quark": "the same in Quark's MXFP4 format, fixed up"}
    lines = [
        f"median of {args.repeat} runs; {len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.2f}",
        *table(
            [
                "checkpoint",
                "tensors",
                "shards",
                "exclude entries",
                "validate (s, every release range)",
                "header parse alone (s)",
                "validate / parse",
                f"under {TARGET_S:g} s",
            ],
            [
                [
                    described[label],
                    f"{r['tensors']:,}",
                    r["shards"],
                    f"{r['exclude_entries']:,}",
                    f"{r['validate_s']:.3f}",
                    f"{r['headers_only_s']:.3f}",
                    f"{r['ratio_to_headers']:.2f}x",
                    "yes" if r["under_target"] else "**no**",
                ]
                for label, r in rows.items()
                if label in described
            ],
            align="lrrrrrrl",
        ),
        f"fixup of the Quark export with its 7 glob exclusions -> "
        f"{rows['fixup_globs']['exclude_entries_after']:,} exact entries (names + aliases): {fixup_s:.3f} s "
        "(every engine release range)",
    ]
    emit_report(args, lines, {"benchmark": "validate", "repeat": args.repeat, "results": rows})
    return 0 if all(r.get("under_target", True) for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
