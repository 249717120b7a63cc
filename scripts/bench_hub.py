"""Benchmark: `mxforge download` (transfer + sha256 verification of every file) against huggingface_hub's own
snapshot_download (transfer only), side by side from the same loopback Hub, on a bench fixture.

    .venv/bin/python scripts/bench_hub.py --gib 1 [--workers 8] [--markdown FILE]

Prints both times, GB/s and the ratio as a Markdown table; the ratio is the price of verifying every byte.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# The loopback Hub and the Quark-style writer are test code (tests/support/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from bench_markdown import add_markdown_option, emit_report, table  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="bench fixture size in GiB (default 1)")
    p.add_argument("--workers", type=int, default=8)
    add_markdown_option(p)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mxforge-bench-hub-"))
    os.environ.update(HF_HOME=str(work / "hf_home"), HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    from loopback_hub import LoopbackHub

    from mxforge.models.fixture import write_fixture

    try:
        src = work / "src"
        write_fixture(src, "bench", gib=args.gib, quiet=True)
        hub = LoopbackHub(work / "hub")
        hub.add_repo_from_dir("bench/glm", src)
        os.environ["HF_ENDPOINT"] = hub.start()
        from huggingface_hub import snapshot_download

        from mxforge.hub.download import download

        size = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
        t0 = time.perf_counter()
        snapshot_download("bench/glm", local_dir=work / "hf", max_workers=args.workers)
        t_hf = time.perf_counter() - t0
        shutil.rmtree(work / "hf")
        t0 = time.perf_counter()
        download("bench/glm", work / "mx", workers=args.workers, quiet=True, command="bench")
        t_mx = time.perf_counter() - t0
        hub.stop()
        lines = [
            f"bench fixture {size / 1e9:.2f} GB, {args.workers} workers, loopback HTTP, "
            f"{len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.2f}",
            *table(
                ["contender", "seconds", "GB/s"],
                [
                    [
                        "huggingface_hub `snapshot_download` (no verification)",
                        f"{t_hf:.2f}",
                        f"{size / t_hf / 1e9:.2f}",
                    ],
                    ["`mxforge download` (+ sha256 of every file)", f"{t_mx:.2f}", f"{size / t_mx / 1e9:.2f}"],
                ],
                align="lrr",
            ),
            f"time mxforge / huggingface_hub: {t_mx / t_hf:.2f}x",
        ]
        emit_report(args, lines)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
