"""The C build of the bf16 MXFP4 kernel (`_bf16.c`), through the registry's C build (formats/native.py). None where
no compiler works, and callers fall back to the numba kernel (same bytes, about a third of the speed)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from mxforge.formats.mxfp4.spec import BLOCK, ERROR_LANES
from mxforge.formats.native import compiled

SOURCE = Path(__file__).with_name("_bf16.c")
P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


def bf16_kernel():
    """The C function `mxfp4_quantize_bf16(rows, codes, scales, n_rows, inner, offsets, n_offsets, stats)
    -> nonfinite`, or None."""
    return compiled(
        SOURCE,
        "mxfp4_quantize_bf16",
        (P, P, P, I64, I64, P, I32, P),
        I64,
        (f"-DBLOCK={BLOCK}", f"-DLANES={ERROR_LANES}"),
    )
