"""The compiled CPU kernel behind `mxforge.formats.mxfp4` (numba, compiled once and cached on disk).

The rules are documented in `mxfp4.py`; this file only makes them fast. It works on float32 bit
patterns: for non-negative floats, integer order is float order, so the block amax is an integer max,
and "|x| * 2^k rounds to code c" becomes "bits(|x|) is above the bits of the E2M1 rounding boundaries
times the scale", which are exact powers-of-two multiples. Everything is branch-free integer work the
compiler vectorizes. Both kernels return the count of non-finite inputs (their blocks are then invalid).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from mxforge.formats.mxfp4.spec import BLOCK, UP_ABOVE, UP_AT_OR_ABOVE
from mxforge.formats.mxfp4.spec import ERROR_LANES as LANES

EXP_MASK = 0x7F800000
ABS_MASK = 0x7FFFFFFF


def _mantissa_exponent(value: float) -> tuple[int, int]:
    """A positive float as (float32 mantissa bits, exponent): value = (1 + bits / 2^23) * 2^exponent."""
    m, e = math.frexp(value)
    return int((2 * m - 1) * (1 << 23)), e - 1


# The E2M1 rounding boundaries (from the code table, mxfp4.py) in float32 bits: 0.25 1.25 2.5 5.0 ("above" rounds
# up: ties to even below) and 0.75 1.75 3.5 ("at or above" rounds up: ties to even above), as (mantissa bits,
# exponent) pairs.
_ABOVE = np.array([_mantissa_exponent(b) for b in UP_ABOVE], dtype=np.int32)
_AT_OR_ABOVE = np.array([_mantissa_exponent(b) for b in UP_AT_OR_ABOVE], dtype=np.int32)


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
def _boundaries(e):
    # The seven E2M1 rounding boundaries for scale 2^e as float32 bits, in code order ("above" ones at even
    # positions, "at or above" ones at odd positions).
    return (
        _boundary_bits(_ABOVE[0, 0], _ABOVE[0, 1] + e),
        _boundary_bits(_AT_OR_ABOVE[0, 0], _AT_OR_ABOVE[0, 1] + e),
        _boundary_bits(_ABOVE[1, 0], _ABOVE[1, 1] + e),
        _boundary_bits(_AT_OR_ABOVE[1, 0], _AT_OR_ABOVE[1, 1] + e),
        _boundary_bits(_ABOVE[2, 0], _ABOVE[2, 1] + e),
        _boundary_bits(_AT_OR_ABOVE[2, 0], _AT_OR_ABOVE[2, 1] + e),
        _boundary_bits(_ABOVE[3, 0], _ABOVE[3, 1] + e),
    )


@nb.njit(inline="always")
def _quark_byte(a, start, stop):
    # a: float32 bits (int32) of one row: (Quark's scale byte of elements start..stop, count of non-finite ones).
    amax = np.int32(0)
    nonfinite = 0
    for i in range(start, stop):
        m = a[i] & ABS_MASK
        amax = max(amax, m)
        nonfinite += (m & EXP_MASK) == EXP_MASK
    exponent = ((amax + (1 << 21)) >> 23) & 0xFF
    # Rounding up past the largest float32 exponent (amax >= 1.75 * 2^127) saturates at byte 254, as Quark does.
    return (254 if exponent == 255 else min(max(exponent - 2, 1), 254)), nonfinite


@nb.njit(inline="always")
def _encode_block(a, start, stop, byte, codes_row, tmp):
    t0, t1, t2, t3, t4, t5, t6 = _boundaries(byte - 127)  # the scale is 2^e; boundary t becomes t * 2^e
    n = stop - start
    for i in range(n):
        v = a[start + i]
        m = v & ABS_MASK
        c = (m > t0) + (m >= t1) + (m > t2) + (m >= t3) + (m > t4) + (m >= t5) + (m > t6)
        neg = (v < 0) & (c != 0)
        tmp[i] = np.uint8(c | (neg << 3))
    base = start >> 1
    for j in range(n >> 1):
        codes_row[base + j] = tmp[2 * j] | (tmp[2 * j + 1] << 4)


@nb.njit(inline="always")
def _quantize_block(a, start, stop, codes_row, scales_row, b, tmp):
    # a: float32 bits (int32) of one row; fills scale b and the codes of elements start..stop.
    byte, nonfinite = _quark_byte(a, start, stop)
    scales_row[b] = byte
    _encode_block(a, start, stop, byte, codes_row, tmp)
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


# --- scale rules and error statistics (scale_rules.py; the C kernel does the same, in the same float order) ---
@nb.njit(inline="always")
def _pow2f(k):
    return np.float32(math.ldexp(1.0, k))  # exact for k in [-149, 127]


@nb.njit(inline="always")
def _twice_grid(m, t):
    # Twice the E2M1 magnitude that |x| (float32 bits m) rounds to with boundaries t: 0 1 2 3 4 6 8 12.
    return (m > t[0]) + (m >= t[1]) + (m > t[2]) + (m >= t[3]) + 2 * ((m > t[4]) + (m >= t[5])) + 4 * (m > t[6])


@nb.njit(inline="always")
def _lane_sum(lane):
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))


@nb.njit(inline="always")
def _block_error(a, xs, start, n, eq, d, lane):
    # Squared error with scale 2^(eq + d), in units of 2^(2 eq), summed in scale_rules.py's lane order.
    half, t = _pow2f(d - 1), _boundaries(eq + d)
    lane[:] = 0
    for i in range(n):
        r = xs[i] - np.float32(_twice_grid(a[start + i] & ABS_MASK, t)) * half
        lane[i % LANES] += r * r
    return _lane_sum(lane)


@nb.njit(inline="always")
def _block_stats(a, xs, start, n, eq, d, lane, ref, stats):
    half, top, t = _pow2f(d - 1), np.float32(6.0) * _pow2f(d), _boundaries(eq + d)
    lane[:] = 0
    ref[:] = 0
    worst = np.float32(0)
    clipped = 0
    for i in range(n):
        r = xs[i] - np.float32(_twice_grid(a[start + i] & ABS_MASK, t)) * half
        lane[i % LANES] += r * r
        ref[i % LANES] += xs[i] * xs[i]
        worst = max(worst, abs(r))
        clipped += xs[i] > top
    unit = math.ldexp(1.0, eq)
    stats[0] += np.float64(_lane_sum(lane)) * unit * unit
    stats[1] += np.float64(_lane_sum(ref)) * unit * unit
    stats[2] = max(stats[2], np.float64(worst) * unit)
    stats[3] += clipped


@nb.njit(cache=True, nogil=True)
def quantize_rows_rule(bits, values, codes, scales, offsets, stats, with_stats):
    """`bits`: float32 bit patterns (int32) `[out, in]`, `values` the same memory as float32. Picks each block's
    exponent among Quark's + `offsets` (scale_rules.py) and, `with_stats`, adds the error statistics of the
    finite blocks to `stats` (float64: sum of squared errors, sum of squares, max |error|, clipped count)."""
    tmp = np.empty(BLOCK, dtype=np.uint8)
    xs = np.empty(BLOCK, dtype=np.float32)
    lane = np.zeros(LANES, dtype=np.float32)
    ref = np.zeros(LANES, dtype=np.float32)
    inner = bits.shape[1]
    nonfinite = 0
    for r in range(bits.shape[0]):
        row, vrow, crow, srow = bits[r], values[r], codes[r], scales[r]
        for b in range(srow.shape[0]):
            start = b * BLOCK
            stop = min(start + BLOCK, inner)
            byte, bad = _quark_byte(row, start, stop)
            nonfinite += bad
            if bad == 0 and (offsets.shape[0] > 1 or with_stats):
                eq = byte - 127
                inv = _pow2f(-eq)
                n = stop - start
                for i in range(n):
                    xs[i] = abs(vrow[start + i]) * inv
                best = 0
                best_error = np.float32(0)
                if offsets.shape[0] > 1:
                    for c in range(offsets.shape[0]):
                        d = offsets[c]
                        if byte + d < 1 or byte + d > 254:
                            continue
                        error = _block_error(row, xs, start, n, eq, d, lane)
                        if c == 0 or error < best_error:
                            best, best_error = d, error
                if with_stats:
                    _block_stats(row, xs, start, n, eq, best, lane, ref, stats)
                byte += best
            srow[b] = byte
            _encode_block(row, start, stop, byte, crow, tmp)
    return nonfinite
