"""Benchmark: `mxforge run` sequential vs `--stream` vs `--executor ray`, Hub to Hub, on a bench fixture served
by the loopback Hub with a bandwidth limit per direction (a rented node's link, scaled down).

    .venv/bin/python scripts/bench_stream.py --gib 2 --down-mbps 150 --up-mbps 100 --workers 2

First each stage alone (download, quantize, push of the quantized checkpoint), then each mode end to end
(`mxforge run SOURCE OUT --push`, one fresh subprocess each, the Hub forgetting every pushed object before
each mode so each one uploads everything). Per mode: wall time, peak disk of OUT (allocated blocks, sampled
every 50 ms), bytes moved over the link each way; every mode's pushed checkpoint is compared with the
sequential one, file by file. Prints a markdown table; --json writes the figures.
Targets (issue 13): streamed wall within 1.3x of the slowest single stage; streamed peak disk under 30% of
the sequential run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mxforge.provenance import PUBLISHED_RECORDS

# The loopback Hub and the Quark-style writer are test code (tests/support/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from bench_markdown import add_markdown_option, emit_report  # noqa: E402

TOKEN = "hf_benchStreamToken"
PROVENANCE = {"README.md", *PUBLISHED_RECORDS}


def disk_bytes(root: Path) -> int:
    """Bytes allocated under root (what the filesystem has given the files, holes excluded)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class PeakDisk:
    """Samples disk_bytes(root) in a thread until stopped; `peak` is the largest sample."""

    def __init__(self, root: Path, every: float = 0.05):
        self.root, self.every, self.peak = root, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, disk_bytes(self.root))
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, disk_bytes(self.root))


def mx(*args: str, env: dict) -> tuple[float, dict | None]:
    """Run `mxforge ARGS --quiet --json -`; (seconds, report)."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mxforge.cli", *args, "--quiet", "--json", "-"],
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"mxforge {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return seconds, json.loads(proc.stdout)


def forget_pushed_objects(hub, source_dir: Path) -> None:
    """The Hub drops every object a push sent (the source repo's files live elsewhere)."""
    for blob in hub.blob_dir.iterdir():
        blob.unlink()


def pushed(hub, repo: str) -> dict[str, str]:
    return {name: f.sha256 for name, f in hub.repos[repo].resolve("main").files.items() if name not in PROVENANCE}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="bench fixture size in GiB (default 2)")
    p.add_argument("--down-mbps", type=float, default=150.0, help="download bandwidth of the loopback link, MB/s")
    p.add_argument("--up-mbps", type=float, default=100.0, help="upload bandwidth of the loopback link, MB/s")
    p.add_argument("--workers", type=int, default=2, help="quantize workers (stream, sequential); Ray CPUs")
    p.add_argument(
        "--in-flight", type=int, default=None, help="stream: bf16 shards on disk at once (default: mxforge's)"
    )
    p.add_argument("--modes", default="sequential,stream,ray", help="comma-separated: sequential, stream, ray")
    p.add_argument("--workdir", default=None, help="working directory (default: a new temporary one, removed after)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    add_markdown_option(p)
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mxforge-bench-stream-"))
    work.mkdir(parents=True, exist_ok=True)
    from loopback_hub import LoopbackHub

    from mxforge.models.fixture import write_fixture

    src = work / "src"
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        write_fixture(src, "bench", seed=0, gib=args.gib, quiet=True)
    hub = LoopbackHub(work / "hub", tokens={TOKEN: "bench"})
    hub.add_repo_from_dir("zai/bench", src)
    hub.start()
    env = {**os.environ, **hub.client_env(work / "hf_home", TOKEN)}
    source_bytes = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
    w = str(args.workers)
    try:
        # Each stage alone, on the same link: download; quantize (local disk); push of the quantized output.
        stages = {}
        hub.pace["down"].rate, hub.pace["up"].rate = args.down_mbps * 1e6, args.up_mbps * 1e6
        alone = work / "alone"
        shutil.rmtree(alone, ignore_errors=True)
        stages["download"], _ = mx("download", "zai/bench", str(alone / "bf16"), env=env)
        stages["quantize"], q = mx("quantize", str(alone / "bf16"), str(alone / "mxfp4"), "--workers", w, env=env)
        mx("fixup", str(alone / "mxfp4"), env=env)
        forget_pushed_objects(hub, src)
        stages["upload"], _ = mx("push", str(alone / "mxfp4"), "bench/alone", env=env)
        output_bytes = q["bytes_out"]
        shutil.rmtree(alone)
        rows, repos = [], {}
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            out = work / f"run-{mode}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            forget_pushed_objects(hub, src)
            sent, received = hub.bytes_sent, hub.bytes_received
            flags = {
                "sequential": ["--no-stream"],
                "ray": ["--executor", "ray"],
                "stream": ["--stream"] + (["--in-flight", str(args.in_flight)] if args.in_flight else []),
            }[mode]
            with PeakDisk(out) as disk:
                seconds, report = mx(
                    "run", "zai/bench", str(out), "--push", f"bench/{mode}", "--workers", w, *flags, env=env
                )
            repos[mode] = f"bench/{mode}"
            rows.append(
                {
                    "mode": mode,
                    "seconds": round(seconds, 2),
                    "peak_disk_bytes": disk.peak,
                    "downloaded_bytes": hub.bytes_sent - sent,
                    "uploaded_bytes": hub.bytes_received - received,
                    "stage_seconds": {k: v.get("seconds") for k, v in report["stages"].items()},
                    "streamed": (report["stages"].get("stream") or {}).get("report", {}).get("stages"),
                }
            )
            shutil.rmtree(out)
        reference = pushed(hub, repos["sequential"]) if "sequential" in repos else None
        for row in rows:
            row["same_checkpoint_as_sequential"] = (
                None if reference is None else pushed(hub, repos[row["mode"]]) == reference
            )
    finally:
        hub.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    slowest = max(stages.values())
    seq = next((r for r in rows if r["mode"] == "sequential"), None)
    lines: list[str] = []
    lines.append(
        f"bench fixture {source_bytes / 1e9:.2f} GB bf16 -> {output_bytes / 1e9:.2f} GB MXFP4; "
        f"link {args.down_mbps:g} MB/s down, {args.up_mbps:g} MB/s up; {args.workers} workers; {os.cpu_count()} cores"
    )
    lines.append(
        "stages alone: "
        + ", ".join(
            f"{k} {v:.1f} s ({(source_bytes if k != 'upload' else output_bytes) / v / 1e6:.0f} MB/s)"
            for k, v in stages.items()
        )
        + f"; slowest {slowest:.1f} s"
    )
    lines.append("")
    lines.append(
        "| mode | wall (s) | wall / slowest stage | peak disk (GB) | peak disk / sequential | "
        "downloaded (GB) | uploaded (GB) | same checkpoint |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rel = f"{r['peak_disk_bytes'] / seq['peak_disk_bytes']:.0%}" if seq else "-"
        lines.append(
            f"| {r['mode']} | {r['seconds']:.1f} | {r['seconds'] / slowest:.2f}x | "
            f"{r['peak_disk_bytes'] / 1e9:.2f} | {rel} | "
            f"{r['downloaded_bytes'] / 1e9:.2f} | {r['uploaded_bytes'] / 1e9:.2f} | "
            f"{r['same_checkpoint_as_sequential']} |"
        )
    figures = {
        "source_bytes": source_bytes,
        "output_bytes": output_bytes,
        "link": {"down_mbps": args.down_mbps, "up_mbps": args.up_mbps},
        "workers": args.workers,
        "stages_alone_s": stages,
        "modes": rows,
    }
    emit_report(args, lines, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
