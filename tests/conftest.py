"""Shared fixtures: GLM-5.2-shaped checkpoints built once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxforge.fixture import write_fixture
from mxforge.models import family_named

GLM5 = family_named("glm_moe_dsa")  # the family the shared fixtures below belong to

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


def serve_tiny(tmp_path: Path, tiny_ckpt: Path, token: str):
    """A loopback Hub (scripts/loopback_hub.py) serving the tiny fixture as zai/glm-tiny, `token` for user alice;
    a generator for fixtures: `yield from serve_tiny(...)` stops it afterwards."""
    sys.path.insert(0, str(REPO / "scripts"))
    from loopback_hub import LoopbackHub

    hub = LoopbackHub(tmp_path / "hub", tokens={token: "alice"})
    hub.add_repo_from_dir("zai/glm-tiny", tiny_ckpt)
    hub.start()
    yield hub
    hub.stop()


def hub_env(hub, tmp_path: Path, token: str) -> dict:
    """The environment that points the mxforge command (huggingface_hub) at a loopback Hub."""
    return {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_XET": "1",
            "HF_TOKEN": token, "HF_HUB_DISABLE_TELEMETRY": "1"}


def _without_root_overrides() -> None:
    """As root, give up the capabilities that ignore file permissions, so that a read-only directory is
    read-only to this process as it is to a user (a no-op for a normal user)."""
    if os.geteuid() == 0:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone for the program exec'd next
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_cli(*args: str, check: bool = False, env: dict | None = None, timeout: float = 600,
            as_user: bool = False) -> subprocess.CompletedProcess:
    """Run the installed `mxforge` entry point (via this interpreter) as a user would.

    `as_user`: file permissions apply even when the tests run as root."""
    proc = subprocess.run([sys.executable, "-m", "mxforge.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout,
                          preexec_fn=_without_root_overrides if as_user else None)
    if check and proc.returncode != 0:
        raise AssertionError(f"mxforge {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def start_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    """Start `mxforge` in the background (for signals and concurrent runs); read it with communicate()."""
    return subprocess.Popen([sys.executable, "-m", "mxforge.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def one_error_line(proc, code: int = 2) -> str:
    """The single `mxforge ...` line of a run that failed with `code` and no traceback."""
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("mxforge ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="session")
def family_cases(tmp_path_factory):
    """The engine-conformance matrix of one model family, built on first use and once per session for every
    suite that judges it (engine truth, local-vs-remote): tests/engine_truth/matrix.py's export styles at 6
    routed experts and at the family's real layout, before and after fixup, plus the real pipeline's output
    per recipe (and the mse scale rule, whose record in quantization_config every release must accept), and the
    real pipeline's output from the same replica as the family's FP8 release stores it (--precision fp8).
    Returns get(family_name) -> {case name: Case}."""
    from engine_truth import matrix

    from mxforge.models import family_named

    built: dict[str, dict] = {}

    def get(family_name: str) -> dict:
        if family_name not in built:
            family = family_named(family_name)
            root = tmp_path_factory.mktemp(f"conformance-{family_name}")
            srcs = matrix.sources(root, family)
            out = {c.name: c for c in matrix.export_cases(root, srcs, family)}
            runs = [(recipe, "quark") for recipe in family.recipes] + [(family.recipes[0], "mse")]
            for recipe, rule in runs:
                name = f"run-{recipe}" + ("" if rule == "quark" else f"-{rule}")
                run_cli("run", str(srcs["e6"]), str(root / name), "--recipe", recipe, "--scale-rule", rule, "--quiet",
                        check=True)
                out[f"e6/{name}"] = matrix.Case(f"e6/{name}", root / name / "mxfp4")
            fp8, name = root / "fp8-e6", f"run-fp8-{family.recipes[0]}"
            write_fixture(fp8, matrix.SIZES["e6"][0], quiet=True, overrides=matrix.SIZES["e6"][1], family=family,
                          precision="fp8")
            run_cli("run", str(fp8), str(root / name), "--quiet", check=True)
            out[f"e6/{name}"] = matrix.Case(f"e6/{name}", root / name / "mxfp4")
            built[family_name] = out
        return built[family_name]
    return get
