"""The C build of the bf16 kernel (`_bf16.c`): compiled with the system C compiler on first use,
cached per (source, compiler, CPU flags), loaded with ctypes. Returns None where no compiler works, and
callers fall back to the numba kernel (same bytes, about a third of the speed).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from mxforge.formats.mxfp4.spec import BLOCK, ERROR_LANES

SOURCE = Path(__file__).with_name("_bf16.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", f"-DBLOCK={BLOCK}", f"-DLANES={ERROR_LANES}")


@functools.lru_cache(maxsize=None)
def bf16_kernel():
    """The C function `mxfp4_quantize_bf16(rows, codes, scales, n_rows, inner, offsets, n_offsets, stats)
    -> nonfinite`, or None."""
    if os.environ.get("MXFORGE_KERNEL") == "numba":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    from mxforge.cache_dir import cache_root

    lib = cache_root() / f"mxfp4_bf16-{_build_key(compiler)}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_name(f"{lib.name}.{os.getpid()}.partial")
        try:
            subprocess.run(
                [compiler, *FLAGS, "-o", str(tmp), str(SOURCE)], check=True, capture_output=True, timeout=120
            )
            os.replace(tmp, lib)
        except (OSError, subprocess.SubprocessError):
            tmp.unlink(missing_ok=True)
            return None
    try:
        fn = ctypes.CDLL(str(lib)).mxfp4_quantize_bf16
    except OSError:
        return None
    fn.restype = ctypes.c_int64
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_void_p,
    ]
    return fn


def _build_key(compiler: str) -> str:
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        cpu = ""
    parts = [
        SOURCE.read_bytes(),
        compiler.encode(),
        " ".join(FLAGS).encode(),
        platform.machine().encode(),
        cpu.encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
