"""`--executor ray` against the loopback Hub, as an attacker would look at it: the Hub token must reach no file
under Ray's temporary directory (its logs record every runtime environment it creates) nor OUT, and a node stages
bf16 shards only in a private directory it made, never through a link or a folder another user planted."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from helpers import TOKEN, hub_env, run_cli

pytestmark = pytest.mark.slow  # Ray runs end to end


@pytest.fixture
def ray_tmp():
    """A short temporary directory for Ray (its socket paths must fit in 107 bytes), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="mxr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _files_holding(token: str, *roots: Path) -> list[str]:
    needle = token.encode()
    found = []
    for root in roots:
        for p in root.rglob("*"):
            try:
                if p.is_file() and not p.is_symlink() and needle in p.read_bytes():
                    found.append(str(p))
            except OSError:  # sockets, files Ray removes as we read
                continue
    return found


def test_a_ray_run_writes_the_token_to_no_file(hub, tmp_path, ray_tmp):
    """A gated source and a push: every task needs alice's token, and none may find it in Ray's runtime
    environment (which Ray logs in clear to session_*/logs/runtime_env_agent.log), its arguments or results."""
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    env = hub_env(hub, tmp_path, RAY_TMPDIR=str(ray_tmp))
    proc = run_cli(
        "run",
        "zai/glm-gated",
        str(out),
        "--push",
        "alice/ray",
        "--executor",
        "ray",
        "--workers",
        "2",
        "--quiet",
        "--json",
        "-",
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)["stages"]["stream"]["report"]
    assert report["stages"]["download"]["shards"] == 3 and report["stages"]["upload"]["shards"] == 3
    assert list(ray_tmp.rglob("runtime_env_agent*.log")), "Ray wrote no runtime env log where the test looks"
    assert _files_holding(TOKEN, ray_tmp, out) == []
    assert TOKEN not in proc.stdout + proc.stderr
