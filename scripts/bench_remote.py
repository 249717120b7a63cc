#!/usr/bin/env python
"""Benchmark `mxforge validate OWNER/NAME` on the full GLM-5.2 layout served by the loopback Hub: bytes fetched
against the repo's bytes, requests, wall time cold and from the cache, and the local validate of the same
checkpoint side by side.

The checkpoint is the `full-layout` fixture written in Quark's MXFP4 format with AMD's exclusions as globs
(282 shards, 438 GB apparent, sparse files: real headers, data holes), served as `amd-like/glm-5.2-mxfp4` by
tests/support/loopback_hub.py on 127.0.0.1 (so the wall time is a floor: a real Hub adds one round trip per
request). The real `mxforge` command runs in a subprocess with its own cache directory.

    .venv/bin/python scripts/bench_remote.py [--workdir DIR] [--json REPORT] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The loopback Hub and the Quark-style writer are test code (tests/support/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from bench_markdown import add_markdown_option, emit_report, table  # noqa: E402
from bench_validate import AMD_WITH_MTP  # noqa: E402
from loopback_hub import LoopbackHub  # noqa: E402
from quark_like import write_quark_like  # noqa: E402

from mxforge.models.fixture import write_fixture  # noqa: E402
from mxforge.progress import format_bytes  # noqa: E402
from mxforge.validation.validate import validate_checkpoint  # noqa: E402

REPO_ID = "amd-like/glm-5.2-mxfp4"


def timed_validate(env: dict) -> tuple[float, dict]:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mxforge.cli", "validate", REPO_ID, "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode not in (0, 1):
        raise SystemExit(f"mxforge validate failed:\n{proc.stderr}")
    return time.perf_counter() - t, json.loads(proc.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where to build the checkpoint (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    add_markdown_option(ap)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-remote-"))
    bf16, quark = work / "full-bf16", work / "hub" / REPO_ID
    if not bf16.exists():
        write_fixture(bf16, "full-layout", quiet=True)
    if not quark.exists():
        write_quark_like(bf16, quark, AMD_WITH_MTP, sparse=True, glob_exclude=True)
    repo_bytes = sum(p.stat().st_size for p in quark.iterdir() if p.is_file())
    hub = LoopbackHub(work / "hub")
    hub.add_repo_from_dir(REPO_ID, quark)
    hub.start()
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_DISABLE_XET": "1",
        "HF_TOKEN": "",
        "MXFORGE_CACHE": str(cache),
    }
    try:
        cold_s, report = timed_validate(env)
        warm_s, cached = timed_validate(env)
    finally:
        hub.stop()
    t = time.perf_counter()
    local = validate_checkpoint(quark)
    local_s = time.perf_counter() - t
    fetched = report["checked"]["fetched"]
    rows = {
        "repo_bytes": repo_bytes,
        "bytes_fetched": fetched["bytes_fetched"],
        "requests": fetched["requests"],
        "fraction": fetched["bytes_fetched"] / repo_bytes,
        "cold_s": round(cold_s, 2),
        "cached_s": round(warm_s, 2),
        "cached_bytes_fetched": cached["checked"]["fetched"]["bytes_fetched"],
        "local_validate_s": round(local_s, 2),
        "same_verdict_as_local": report["verdict"] == local.verdict()
        and report["problems"] == local.as_dict()["problems"],
    }
    lines = [
        f"{REPO_ID} on the loopback Hub: {format_bytes(repo_bytes)} in {report['checked']['integrity']['shards']} "
        f"shards; {len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.2f}",
        *table(
            [
                "bytes fetched",
                "ranged requests",
                "share of the repo",
                "cold (s)",
                "from the cache (s)",
                "fetched from the cache",
                "local validate, in process (s)",
                "same verdict and problems as local",
            ],
            [
                [
                    format_bytes(rows["bytes_fetched"]),
                    rows["requests"],
                    f"{100 * rows['fraction']:.4f}%",
                    f"{cold_s:.1f}",
                    f"{warm_s:.1f}",
                    f"{rows['cached_bytes_fetched']} bytes",
                    f"{local_s:.1f}",
                    rows["same_verdict_as_local"],
                ]
            ],
            align="rrrrrrrl",
        ),
    ]
    emit_report(args, lines, {"benchmark": "remote validate", "results": rows})
    return 0 if rows["same_verdict_as_local"] and rows["fraction"] < 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
