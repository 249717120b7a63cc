"""C kernels of the format entries: a C source compiled with the system C compiler on first use, cached per
(source, the shared headers beside this module, compiler, flags, CPU flags) in the user cache, loaded with ctypes.
Returns None where no compiler works; each entry then falls back to its portable kernel (same bytes, slower).
`MXFORGE_KERNEL=portable` (or `numba`, its older name) skips every C kernel."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

BASE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # what the kernels include (_float_bits.h)


@functools.lru_cache(maxsize=None)
def compiled(source: Path, symbol: str, argtypes: tuple, restype, defines: tuple[str, ...] = ()):
    """The C function `symbol` of `source` built with BASE_FLAGS and `defines` (`-DNAME=VALUE` flags), or None."""
    if os.environ.get("MXFORGE_KERNEL") in ("portable", "numba"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    from mxforge.cache_dir import cache_root

    flags = (*BASE_FLAGS, *defines)
    lib = cache_root() / f"{source.stem.lstrip('_')}-{_build_key(source, compiler, flags)}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_name(f"{lib.name}.{os.getpid()}.partial")
        try:
            subprocess.run(
                [compiler, *flags, "-o", str(tmp), str(source)], check=True, capture_output=True, timeout=120
            )
            os.replace(tmp, lib)
        except (OSError, subprocess.SubprocessError):
            tmp.unlink(missing_ok=True)
            return None
    try:
        fn = getattr(ctypes.CDLL(str(lib)), symbol)
    except (OSError, AttributeError):
        return None
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


def _build_key(source: Path, compiler: str, flags: tuple[str, ...]) -> str:
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        cpu = ""
    parts = [
        source.read_bytes(),
        *(h.read_bytes() for h in HEADERS),
        compiler.encode(),
        " ".join(flags).encode(),
        platform.machine().encode(),
        cpu.encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def call_rows_kernel(native, rows, codes, scales, offsets: tuple[int, ...], stats) -> int:
    """Run a row kernel `f(rows, codes, scales, n_rows, inner, offsets, n_offsets, stats) -> nonfinite` (the MX
    kernels' signature) on C-contiguous numpy arrays; `stats` None or a float64 array of running sums."""
    import numpy as np

    rows = np.ascontiguousarray(rows)
    offs = np.asarray(offsets, dtype=np.int32)
    pointer = None if stats is None else stats.ctypes.data
    n_rows, inner = rows.shape
    return int(
        native(
            rows.ctypes.data, codes.ctypes.data, scales.ctypes.data, n_rows, inner, offs.ctypes.data, len(offs), pointer
        )
    )
