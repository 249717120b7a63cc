#!/usr/bin/env python
"""Scale rules side by side on the bench fixture: weight error and throughput of Quark's rule, mxforge's mse
rule, and auto-round's "optimized RTN" for MXFP4 (per 32-group, the best of 0.5x / 1x / 2x its scale).

In one run, on the weights the default recipe quantizes (the bench fixture's expert tensors):
- relative RMSE, sqrt(sum (x-q)^2 / sum x^2) over all of them, computed here in float64 from each
  contender's dequantized output (not from mxforge's own error report);
- kernel GB per CPU-second: bf16 bytes / CPU seconds of the calling thread quantizing the tensors in
  memory, one thread (mxforge's C kernel is single-threaded; auto-round's torch code gets one thread too),
  best of `--repeat`; CPU time, not wall time, so that other jobs on a shared machine do not count;
- end-to-end `mxforge quantize --scale-rule RULE` (a subprocess, all cores, page cache warm): GB/s of wall
  time and GB per CPU-second of all its processes.
auto-round is optional: `pip install -c <(echo torch==2.13.0) auto-round==0.16.1` into the venv (the
constraint keeps the CPU torch); without it, its row says why.

    .venv/bin/python scripts/bench_scale_rules.py [--gib 1] [--workdir DIR] [--threads 1] [--repeat 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_markdown import add_markdown_option, emit_report
from safetensors import safe_open

from mxforge.checkpoint import Checkpoint
from mxforge.formats import MXFP4
from mxforge.quantize.plan import plan_checkpoint
from mxforge.quantize.recipe import load_recipe
from mxforge.quantize.scale_rules import get_scale_rule


def quantized_weights(src: Path) -> dict[str, torch.Tensor]:
    """The bf16 weights the default recipe quantizes, read into memory."""
    plan = plan_checkpoint(Checkpoint.open(src), load_recipe(None))
    out = {}
    for shard in plan.shards:
        names = [t.source.name for t in shard.tensors if t.fate == "quantized"]
        with safe_open(str(src / shard.name), "pt") as f:
            out.update({n: f.get_tensor(n) for n in names})
    return out


def mxforge_rule(rule: str):
    def run(w: torch.Tensor) -> torch.Tensor:
        codes, scales = MXFP4.quantize(w, offsets=get_scale_rule(rule).offsets)
        return codes, scales

    return run, lambda out, w: MXFP4.dequantize(out[0], out[1], w.shape[1])


def auto_round_opt_rtn():
    """auto-round's own optimized RTN for MXFP4 (auto_round.data_type.mxfp.quant_mx_opt_rtn), or why not."""
    try:
        import auto_round
        from auto_round.data_type.mxfp import quant_mx_opt_rtn
    except Exception as e:  # not installed, or its import fails here: say exactly what
        return None, f"{type(e).__name__}: {e}"

    def run(w: torch.Tensor) -> torch.Tensor:
        return quant_mx_opt_rtn(w, bits=MXFP4.element_bits, group_size=MXFP4.block, data_type="mx_fp4")[0]

    return (run, lambda out, w: out.float()), auto_round.__version__


def measure(name: str, contender, weights: dict[str, torch.Tensor], repeat: int) -> dict:
    run, decode = contender
    best = float("inf")
    err = ref = 0.0
    for attempt in range(repeat):
        seconds = 0.0
        for n, w in weights.items():
            t = time.thread_time()
            out = run(w)
            seconds += time.thread_time() - t
            if attempt == 0:
                x, q = w.double(), decode(out, w).double()
                err += ((x - q) ** 2).sum().item()
                ref += (x**2).sum().item()
        best = min(best, seconds)
    size = sum(w.numel() * 2 for w in weights.values())
    print(f"  {name}: {best:.2f} s", file=sys.stderr, flush=True)
    return {"rel_rmse": (err / ref) ** 0.5, "kernel_cpu_seconds": best, "kernel_gb_per_cpu_s": size / best / 1e9}


def end_to_end(src: Path, work: Path, rule: str) -> tuple[float, float]:
    """(GB/s of wall time, GB per CPU-second) of one `mxforge quantize --scale-rule RULE`."""
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    out = work / f"out-{rule}"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "mxforge.cli", "quantize", str(src), str(out), "--quiet", "--scale-rule", rule],
        check=True,
    )
    wall = time.monotonic() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return size / wall / 1e9, size / cpu / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the in-memory contenders (default 1)")
    ap.add_argument("--repeat", type=int, default=2, help="best of N for the timings (auto-round: once)")
    ap.add_argument("--json", type=Path, default=None)
    add_markdown_option(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mxforge-rules-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"bench-{args.gib:g}gib"
    if not (src / "config.json").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mxforge.cli",
                "fixture",
                str(src),
                "--preset",
                "bench",
                "--gib",
                str(args.gib),
                "--quiet",
            ],
            check=True,
        )
    weights = quantized_weights(src)
    size = sum(w.numel() * 2 for w in weights.values())
    MXFP4.quantize(next(iter(weights.values()))[:1])  # build/load the C kernel outside the timings
    results = {
        "quark": measure("quark", mxforge_rule("quark"), weights, args.repeat),
        "mse": measure("mse", mxforge_rule("mse"), weights, args.repeat),
    }
    auto_round, version = auto_round_opt_rtn()
    if auto_round is not None:
        results[f"auto-round {version} optimized RTN"] = measure("auto-round", auto_round, weights, 1)
    else:
        results["auto-round optimized RTN"] = {"unavailable": version}
    for attempt in range(args.repeat):  # alternating, best of each
        for rule in ("quark", "mse"):
            wall, cpu = end_to_end(src, work, rule)
            r = results[rule]
            r["end_to_end_gb_per_s"] = max(wall, r.get("end_to_end_gb_per_s", 0))
            r["end_to_end_gb_per_cpu_s"] = max(cpu, r.get("end_to_end_gb_per_cpu_s", 0))
    base = results["quark"]
    lines: list[str] = []
    lines.append(
        f"{len(weights)} tensors ({size / 1e9:.2f} GB of bf16, the default recipe's MXFP4 weights of {src}); "
        f"{args.threads} thread(s) in memory; {len(os.sched_getaffinity(0))} cores; load {os.getloadavg()[0]:.2f}"
    )
    lines.append(
        "| scale rule | relative RMSE | vs quark | kernel GB/CPU-s | vs quark | `mxforge quantize` GB/s (wall) | "
        "vs quark | GB/CPU-s | vs quark |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        if "unavailable" in r:
            lines.append(f"| {name} | unavailable: {r['unavailable']} | | | | | | | |")
            continue
        line = (
            f"| {name} | {r['rel_rmse']:.6f} | {100 * (r['rel_rmse'] / base['rel_rmse'] - 1):+.3f}% | "
            f"{r['kernel_gb_per_cpu_s']:.3f} | {100 * r['kernel_gb_per_cpu_s'] / base['kernel_gb_per_cpu_s']:.1f}% | "
        )
        if "end_to_end_gb_per_s" in r:
            line += (
                f"{r['end_to_end_gb_per_s']:.3f} | "
                f"{100 * r['end_to_end_gb_per_s'] / base['end_to_end_gb_per_s']:.1f}% | "
                f"{r['end_to_end_gb_per_cpu_s']:.3f} | "
                f"{100 * r['end_to_end_gb_per_cpu_s'] / base['end_to_end_gb_per_cpu_s']:.1f}% |"
            )
        else:
            line += "- | - | - | - |"
        lines.append(line)
    emit_report(args, lines, {"tensors": len(weights), "bytes": size, "threads": args.threads, "results": results})


if __name__ == "__main__":
    main()
