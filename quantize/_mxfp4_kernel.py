"""The compiled CPU kernel behind `mxforge.quantize.mxfp4` (numba, compiled once and cached on disk).

The rules are documented in `mxfp4.py`; this file only makes them fast. It works on float32 bit
patterns: for non-negative floats, integer order is float order, so the block amax is an integer max,
and "|x| * 2^k rounds to code c" becomes "bits(|x|) is above the bits of the E2M1 rounding boundaries
times the scale", which are exact powers-of-two multiples. Everything is branch-free integer work the
compiler vectorizes. Both kernels return the count of non-finite inputs (their blocks are then invalid).
"""

from __future__ import annotations

import numba as nb
import numpy as np

BLOCK = 32
EXP_MASK = 0x7F800000
ABS_MASK = 0x7FFFFFFF
# E2M1 boundaries in float32 bits: 0.25 1.25 2.5 5.0 ("above" rounds up: ties to even below) and
# 0.75 1.75 3.5 ("at or above" rounds up: ties to even above), as (mantissa bits, exponent) pairs.
_ABOVE = np.array([(0, -2), (1 << 21, 0), (1 << 21, 1), (1 << 21, 2)], dtype=np.int32)
_AT_OR_ABOVE = np.array([(1 << 22, -1), (3 << 21, 0), (3 << 21, 1)], dtype=np.int32)


@nb.njit(inline="always")
def _boundary_bits(mantissa, exponent):
    # float32 bits of (1 + mantissa/2^23) * 2^exponent: subnormal below 2^-126, +inf above the range.
    biased = exponent + 127
    if biased >= 255:  # beyond float32: no finite value reaches it
        return np.int32(EXP_MASK)
    if biased > 0:
        return np.int32((biased << 23) | mantissa)
    return np.int32(((1 << 23) | mantissa) >> (1 - biased))


@nb.njit(inline="always")
def _quantize_block(a, start, stop, codes_row, scales_row, b, tmp):
    # a: float32 bits (int32) of one row; fills scale b and the codes of elements start..stop.
    amax = np.int32(0)
    nonfinite = 0
    for i in range(start, stop):
        m = a[i] & ABS_MASK
        amax = max(amax, m)
        nonfinite += (m & EXP_MASK) == EXP_MASK
    exponent = ((amax + (1 << 21)) >> 23) & 0xFF
    # Rounding up past the largest float32 exponent (amax >= 1.75 * 2^127) saturates at byte 254, as Quark does.
    byte = 254 if exponent == 255 else min(max(exponent - 2, 1), 254)
    scales_row[b] = byte
    e = byte - 127  # the scale is 2^e; boundary t becomes t * 2^e
    t0 = _boundary_bits(_ABOVE[0, 0], _ABOVE[0, 1] + e)
    t1 = _boundary_bits(_AT_OR_ABOVE[0, 0], _AT_OR_ABOVE[0, 1] + e)
    t2 = _boundary_bits(_ABOVE[1, 0], _ABOVE[1, 1] + e)
    t3 = _boundary_bits(_AT_OR_ABOVE[1, 0], _AT_OR_ABOVE[1, 1] + e)
    t4 = _boundary_bits(_ABOVE[2, 0], _ABOVE[2, 1] + e)
    t5 = _boundary_bits(_AT_OR_ABOVE[2, 0], _AT_OR_ABOVE[2, 1] + e)
    t6 = _boundary_bits(_ABOVE[3, 0], _ABOVE[3, 1] + e)
    n = stop - start
    for i in range(n):
        v = a[start + i]
        m = v & ABS_MASK
        c = ((m > t0) + (m >= t1) + (m > t2) + (m >= t3) + (m > t4) + (m >= t5) + (m > t6))
        neg = (v < 0) & (c != 0)
        tmp[i] = np.uint8(c | (neg << 3))
    base = start >> 1
    for j in range(n >> 1):
        codes_row[base + j] = tmp[2 * j] | (tmp[2 * j + 1] << 4)
    return nonfinite


@nb.njit(inline="always")
def _quantize_row_bits(a, codes_row, scales_row, tmp):
    inner = a.shape[0]
    nonfinite = 0
    for b in range(scales_row.shape[0]):
        start = b * BLOCK
        nonfinite += _quantize_block(a, start, min(start + BLOCK, inner), codes_row, scales_row, b, tmp)
    return nonfinite


@nb.njit(cache=True, nogil=True)
def quantize_f32_rows(rows, codes, scales):
    """`rows` float32 `[out, in]`."""
    tmp = np.empty(BLOCK, dtype=np.uint8)
    bits = rows.view(np.int32)
    nonfinite = 0
    for r in range(rows.shape[0]):
        nonfinite += _quantize_row_bits(bits[r], codes[r], scales[r], tmp)
    return nonfinite


@nb.njit(inline="always")
def _bf16_code(v, t0, t1, t2, t3, t4, t5, t6):
    # v: bf16 bits widened to int32; t*: boundary bits >> 16 (exact: every boundary has 16 low zero bits).
    m = v & 0x7FFF
    c = (m > t0) + (m >= t1) + (m > t2) + (m >= t3) + (m > t4) + (m >= t5) + (m > t6)
    return c | (((v < 0) & (c != 0)) << 3)


@nb.njit(cache=True, nogil=True)
def quantize_bf16_rows(rows, codes, scales):
    """`rows` holds bf16 bit patterns as int16 `[out, in]`, compared as 16-bit patterns (no widening pass)."""
    nonfinite = 0
    inner = rows.shape[1]
    for r in range(rows.shape[0]):
        row, crow, srow = rows[r], codes[r], scales[r]
        for b in range(srow.shape[0]):
            start = b * BLOCK
            stop = min(start + BLOCK, inner)
            amax = 0
            for i in range(start, stop):
                m = np.int32(row[i]) & 0x7FFF
                amax = max(amax, m)
                nonfinite += m >= 0x7F80
            exponent = (((np.int32(amax) << 16) + (1 << 21)) >> 23) & 0xFF
            byte = 254 if exponent == 255 else min(max(exponent - 2, 1), 254)
            srow[b] = byte
            e = byte - 127
            t0 = _boundary_bits(_ABOVE[0, 0], _ABOVE[0, 1] + e) >> 16
            t1 = _boundary_bits(_AT_OR_ABOVE[0, 0], _AT_OR_ABOVE[0, 1] + e) >> 16
            t2 = _boundary_bits(_ABOVE[1, 0], _ABOVE[1, 1] + e) >> 16
            t3 = _boundary_bits(_AT_OR_ABOVE[1, 0], _AT_OR_ABOVE[1, 1] + e) >> 16
            t4 = _boundary_bits(_ABOVE[2, 0], _ABOVE[2, 1] + e) >> 16
            t5 = _boundary_bits(_AT_OR_ABOVE[2, 0], _AT_OR_ABOVE[2, 1] + e) >> 16
            t6 = _boundary_bits(_ABOVE[3, 0], _ABOVE[3, 1] + e) >> 16
            base = start >> 1
            for j in range((stop - start) >> 1):
                lo = _bf16_code(np.int32(row[start + 2 * j]), t0, t1, t2, t3, t4, t5, t6)
                hi = _bf16_code(np.int32(row[start + 2 * j + 1]), t0, t1, t2, t3, t4, t5, t6)
                crow[base + j] = np.uint8(lo | (hi << 4))
    return nonfinite
