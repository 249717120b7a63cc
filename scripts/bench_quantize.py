#!/usr/bin/env python
"""Benchmark `mxforge quantize` against AMD Quark 0.13's file-to-file mode and a plain copy, side by side.

On one bench fixture (`mxforge fixture --preset bench --gib N`), in one run: a plain copy of the same
files, `mxforge quantize` (a subprocess, end to end) with its error report (the default) and with
`--no-error-report` (the report's cost), and Quark's
`ModelQuantizer(cfg).direct_quantize_checkpoint(src, dst, device="cpu")` with the same schemes and exclusions
(its import time is not counted). Each `--recipe` (default: the family's default recipe) is one pair of mxforge
and Quark runs: a recipe that mixes formats gives Quark the same per-pattern schemes (`layer_quant_config`), so
each format's throughput and bytes are compared with Quark's. The source is read once beforehand so every
contender reads from the page cache, and `sync` runs between contenders. Prints GB/s (source bytes / wall
seconds), the ratios, each one's peak RSS (summed over its process group, sampled every 50 ms), each output's
size, and whether mxforge's files are byte-identical to Quark's.

    .venv/bin/python scripts/bench_quantize.py [--gib 2] [--workdir DIR] [--workers N] [--json OUT]
        [--skip-quark] [--repeat N] [--recipe R ...] [--family F]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_markdown import add_markdown_option, emit_report

from mxforge.file_hashes import file_hash

QUARK_SNIPPET = """
import json, sys, time
from quark.torch import ModelQuantizer
from mxforge.formats import declared_format, format_of_spec
from mxforge.formats.quark import qconfig
src, dst, qc = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
layers = {p: format_of_spec(c["weight"]) for p, c in (qc.get("layer_quant_config") or {}).items()}
quantizer = ModelQuantizer(qconfig(declared_format(qc), qc["exclude"], layer_formats=layers))
print("READY", flush=True)
t = time.monotonic()
quantizer.direct_quantize_checkpoint(src, dst, device="cpu")
print("SECONDS", time.monotonic() - t, flush=True)
"""


LAST_CPU_SECONDS = 0.0


class PeakRss:
    """Peak of the summed RSS of every process in a process group, sampled in a thread."""

    def __init__(self, pgid: int):
        self.pgid, self.peak, self._stop = pgid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                    fields = stat[stat.rindex(")") + 2 :].split()
                    if int(fields[2]) == self.pgid:
                        total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
                except (OSError, ValueError, IndexError):
                    continue
            self.peak = max(self.peak, total)
            time.sleep(0.05)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_measured(cmd: list[str], ready_marker: str | None = None) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of a command; with `ready_marker`, timing starts when it prints it.
    The CPU seconds of the command and all its processes go to LAST_CPU_SECONDS (robust on a shared machine)."""
    global LAST_CPU_SECONDS
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    rss = PeakRss(proc.pid)
    start = time.monotonic()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if ready_marker and line.startswith(ready_marker):
            start = time.monotonic()
    proc.wait()
    seconds = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    LAST_CPU_SECONDS = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    peak = rss.stop()
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:4])}... failed ({proc.returncode}):\n{proc.stderr.read()[-3000:]}")
    return seconds, peak, "".join(lines)


def weight_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def warm(d: Path) -> None:
    for p in sorted(d.iterdir()):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass


def plain_copy(src: Path, dst: Path, fsync: bool = False) -> None:
    dst.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        if p.is_file():
            shutil.copyfile(p, dst / p.name)
            if fsync:
                with open(dst / p.name, "rb+") as f:
                    os.fsync(f.fileno())


def identical(ours: Path, quark: Path) -> dict[str, bool]:
    skip = {"mxforge_quantize.json", "mxforge_quantize.state.json"}
    return {
        p.name: (ours / p.name).exists() and (ours / p.name).read_bytes() == p.read_bytes()
        for p in sorted(quark.iterdir())
        if p.is_file() and p.name not in skip
    }


def _best(results: dict, name: str, seconds: float, peak_rss: int, cpu_seconds: float | None = None) -> None:
    """Keep the fastest run of a contender (and the highest peak RSS seen over its runs, the least CPU time)."""
    previous = results.get(name)
    results[name] = {
        "seconds": min(seconds, previous["seconds"]) if previous else seconds,
        "peak_rss": max(peak_rss, previous["peak_rss"]) if previous else peak_rss,
    }
    if cpu_seconds is not None:
        results[name]["cpu_seconds"] = (
            min(cpu_seconds, previous.get("cpu_seconds", cpu_seconds)) if previous else cpu_seconds
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--family", default=None, help="the model family of the bench fixture (default: mxforge fixture's)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the fixture and outputs go (default: a temp dir)")
    ap.add_argument("--workers", type=int, default=None, help="mxforge --workers (default: its own default)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument(
        "--skip-quark",
        action="store_true",
        help="quick iterations: skip Quark (no Quark ratio, no byte-identity check)",
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="run copy and mxforge this many times, alternating; report the best"
    )
    ap.add_argument(
        "--recipe",
        action="append",
        default=None,
        help="a recipe to quantize with, mxforge and Quark each (repeatable; default: the family's default recipe)",
    )
    add_markdown_option(ap)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mxforge-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    family = ["--family", args.family] if args.family else []
    src = work / f"bench-{args.family or 'default'}-{args.gib:g}gib"
    mxforge = [sys.executable, "-m", "mxforge.cli"]
    if not (src / "config.json").exists():
        subprocess.run(
            [*mxforge, "fixture", str(src), "--preset", "bench", "--gib", str(args.gib), "--quiet", *family], check=True
        )
    size = weight_bytes(src)
    recipes: list[str | None] = list(args.recipe or [None])  # None: the family's default
    labels = {r: r or "default recipe" for r in recipes}
    outs = {"copy": work / "out-copy"}
    for r in recipes:
        tag = (r or "default").replace("/", "_")
        outs[f"mxforge:{r}"], outs[f"quark:{r}"] = work / f"out-mxforge-{tag}", work / f"out-quark-{tag}"
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)
    # Fill the numba and Quark-config caches so the timed run measures the work, not first-use compiles.
    warmup = work / "warmup"
    shutil.rmtree(warmup, ignore_errors=True)
    subprocess.run([*mxforge, "fixture", str(warmup / "src"), "--quiet", *family], check=True, capture_output=True)
    for i, r in enumerate(recipes):
        subprocess.run(
            [*mxforge, "quantize", str(warmup / "src"), str(warmup / f"out{i}"), "--quiet"]
            + (["--recipe", r] if r else []),
            check=True,
            capture_output=True,
        )
    warm(src)
    results = {}

    def mxforge_name(r: str | None, extra: str = "") -> str:
        return "mxforge" + extra + ("" if len(recipes) == 1 else f" [{labels[r]}]")

    for attempt in range(args.repeat):  # alternate contenders, keep each one's best (the machine is shared)
        subprocess.run(["sync"])
        shutil.rmtree(outs["copy"], ignore_errors=True)
        t = time.monotonic()
        plain_copy(src, outs["copy"])
        _best(results, "copy", time.monotonic() - t, 0)

        # Two references for what mxforge does beyond a copy: fsync of every output file, and sha256 of every
        # source byte (its resume identity and corruption check), on one core.
        subprocess.run(["sync"])
        shutil.rmtree(outs["copy"])
        t = time.monotonic()
        plain_copy(src, outs["copy"], fsync=True)
        _best(results, "copy+fsync", time.monotonic() - t, 0)
        shutil.rmtree(outs["copy"])
        t = time.monotonic()
        for p in sorted(src.glob("*.safetensors")):
            file_hash(p, p.name)
        _best(results, "sha256 + git sha1 (1 core)", time.monotonic() - t, 0)

        # Without the error report first (the first recipe only), so that the output compared with Quark's below is
        # the default one.
        runs = [(recipes[0], ", no error report", ["--no-error-report"])] + [(r, "", []) for r in recipes]
        for r, label, extra in runs:
            subprocess.run(["sync"])
            out = outs[f"mxforge:{r}"]
            shutil.rmtree(out, ignore_errors=True)
            cmd = [*mxforge, "quantize", str(src), str(out), "--quiet", *extra] + (["--recipe", r] if r else [])
            if args.workers:
                cmd += ["--workers", str(args.workers)]
            seconds, peak, _ = run_measured(cmd)
            _best(results, mxforge_name(r, label), seconds, peak, LAST_CPU_SECONDS)

    same: dict[str, dict[str, bool]] = {}
    for r in [] if args.skip_quark else recipes:
        qc = json.loads((outs[f"mxforge:{r}"] / "config.json").read_text())["quantization_config"]
        (work / "quantization_config.json").write_text(json.dumps(qc))
        subprocess.run(["sync"])
        seconds, peak, stdout = run_measured(
            [
                sys.executable,
                "-c",
                QUARK_SNIPPET,
                str(src),
                str(outs[f"quark:{r}"]),
                str(work / "quantization_config.json"),
            ],
            ready_marker="READY",
        )
        name = "quark" + ("" if len(recipes) == 1 else f" [{labels[r]}]")
        results[name] = {"seconds": seconds, "peak_rss": peak}
        same[labels[r]] = identical(outs[f"mxforge:{r}"], outs[f"quark:{r}"])
    for r in results.values():
        r["gb_per_s"] = size / r["seconds"] / 1e9
    first = recipes[0]
    report = {
        "family": args.family or "default",
        "source_bytes": size,
        "cores": len(os.sched_getaffinity(0)),
        "recipes": [labels[r] for r in recipes],
        "results": results,
        "output_bytes": {labels[r]: weight_bytes(outs[f"mxforge:{r}"]) for r in recipes},
        "mxforge_vs_quark": None
        if args.skip_quark
        else {
            labels[r]: results[mxforge_name(r)]["gb_per_s"]
            / results["quark" + ("" if len(recipes) == 1 else f" [{labels[r]}]")]["gb_per_s"]
            for r in recipes
        },
        "mxforge_vs_copy": {
            labels[r]: results[mxforge_name(r)]["gb_per_s"] / results["copy"]["gb_per_s"] for r in recipes
        },
        "error_report_throughput_ratio": results[mxforge_name(first)]["gb_per_s"]
        / results[mxforge_name(first, ", no error report")]["gb_per_s"],
        "error_report_cpu_ratio": results[mxforge_name(first)]["cpu_seconds"]
        / results[mxforge_name(first, ", no error report")]["cpu_seconds"],
        "identical_to_quark": same,
        "load_average": os.getloadavg(),
    }
    lines: list[str] = []
    lines.append(
        f"source: {size / 1e9:.2f} GB of bf16 shards ({src}, family {report['family']}), {report['cores']} cores, "
        f"load average {report['load_average'][0]:.2f}"
    )
    width = max(24, *(len(n) for n in results))
    lines.append(f"| {'contender':<{width}} | {'seconds':>8} | {'GB/s':>7} | {'CPU-s':>6} | {'peak RSS':>10} |")
    lines.append(f"|{'-' * (width + 2)}|{'-' * 9}:|{'-' * 8}:|{'-' * 7}:|{'-' * 11}:|")
    for name, r in results.items():
        rss = f"{r['peak_rss'] / 2**30:.2f} GiB" if r["peak_rss"] else "-"
        cpu = f"{r['cpu_seconds']:.2f}" if "cpu_seconds" in r else "-"
        lines.append(f"| {name:<{width}} | {r['seconds']:>8.2f} | {r['gb_per_s']:>7.3f} | {cpu:>6} | {rss:>10} |")
    for r in recipes:
        label = labels[r]
        versus_quark = "skipped" if args.skip_quark else f"{report['mxforge_vs_quark'][label]:.1f}x"
        lines.append(
            f"{label}: mxforge / quark throughput {versus_quark}, mxforge / copy "
            f"{100 * report['mxforge_vs_copy'][label]:.0f}%, output {report['output_bytes'][label] / 1e9:.3f} GB "
            f"({100 * report['output_bytes'][label] / size:.1f}% of the source)"
            + (f" (best of {args.repeat} alternating runs each)" if args.repeat > 1 else "")
        )
    lines.append(
        f"error report: mxforge with it reaches {100 * report['error_report_throughput_ratio']:.1f}% of the "
        f"throughput without it (--no-error-report) and takes {100 * report['error_report_cpu_ratio']:.1f}% of its "
        "CPU time (user+sys of all its processes)"
    )
    for label, files in same.items():
        shards = {k: v for k, v in files.items() if k.endswith(".safetensors")}
        lines.append(
            f"byte-identical to Quark ({label}): shards {sum(shards.values())}/{len(shards)}, "
            f"config.json {files.get('config.json')}, other files: "
            + ", ".join(f"{k} {v}" for k, v in files.items() if not k.endswith(".safetensors") and k != "config.json")
        )
    emit_report(args, lines, report)


if __name__ == "__main__":
    main()
