"""Shared fixtures: GLM-5.2-shaped checkpoints built once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxforge.fixture import write_fixture

REPO = Path(__file__).resolve().parents[1]

MTP = 7  # the tiny fixture's num_hidden_layers: its MTP layer
# AMD's published GLM-5.2 MXFP4 exclusions (glm-5.2.md): attention, routers, lm_head, dense MLPs ...
BASE = ["*self_attn*", "*mlp.gate", "*lm_head", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj"]
AMD = BASE + [f"*layers.{MTP}.*"]  # ... and the whole MTP layer


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny bf16 fixture (seed 0). Treat as read-only; copy it before changing anything."""
    out = tmp_path_factory.mktemp("tiny") / "glm-tiny"
    write_fixture(out, "tiny", seed=0, quiet=True)
    return out


@pytest.fixture(scope="session")
def full_layout_ckpt(tmp_path_factory) -> Path:
    """The full GLM-5.2 layout as sparse files (headers real, data holes)."""
    out = tmp_path_factory.mktemp("full") / "glm-full"
    write_fixture(out, "full-layout", quiet=True)
    return out


def run_cli(*args: str, check: bool = False, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the installed `mxforge` entry point (via this interpreter) as a user would."""
    proc = subprocess.run([sys.executable, "-m", "mxforge.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"mxforge {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc
