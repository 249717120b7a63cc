"""The quickstart's demo (scripts/demo.py, what scripts/quickstart.sh runs after setup) end to end: it ends by
saying that the loopback Hub whose URLs the run printed has stopped, and where the pushed checkpoint is."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO


@pytest.mark.slow  # the whole pipeline against a loopback Hub
def test_demo_ends_saying_its_hub_has_stopped(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--out", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    [pushed] = [line for line in lines if line.strip().startswith("pushed: http://127.0.0.1:")]
    endpoint = pushed.split()[1].rsplit("/", 2)[0]
    assert lines[-1] == (
        f"the loopback Hub at {endpoint} lived only for this demo and has stopped, so the URLs above no longer "
        f"answer; what was pushed is the checkpoint in {tmp_path / 'demo' / 'run' / 'mxfp4'}"
    )
    assert "mxforge-demo/glm-5.2-tiny-mxfp4 on the loopback Hub now holds 12 files: README.md," in proc.stdout
