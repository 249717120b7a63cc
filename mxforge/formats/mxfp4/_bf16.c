/* The bf16 MXFP4 kernel: the rules are documented in mxfp4.py (codes and Quark's scale) and scale_rules.py
   (other scale rules, quantize/), and mirrored in _mxfp4_kernel.py (numba, the fallback where no C compiler is found)
   and mxfp4.py (torch). This C version is what makes the CPU path fast: the compiler vectorizes the 16-bit
   compares. Built with -ffp-contract=off (no fused multiply-add), so the float32 block errors that choose a
   scale are rounded exactly as the numba and torch kernels round them. Built and cached by _native.py. */

#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "../_float_bits.h"

/* BLOCK (elements per scale) and LANES (the scale rules' error lanes) come from mxfp4.py, as -D flags (_native.py). */
#if !defined(BLOCK) || !defined(LANES)
#error "build with -DBLOCK=... -DLANES=... (mxforge/formats/_native.py does)"
#endif

/* float32 bits of (1 + mantissa/2^23) * 2^exponent; subnormal below 2^-126, +inf above the range. */
static inline int32_t boundary_bits(int32_t mantissa, int32_t exponent) {
    int32_t biased = exponent + 127;
    if (biased >= 255) return 0x7F800000;
    if (biased > 0) return (biased << 23) | mantissa;
    return ((1 << 23) | mantissa) >> (1 - biased);
}

/* The E2M1 rounding boundaries for scale 2^e as bf16 patterns of |x|: code = how many of them |x| is above.
   "> t" boundaries (ties round down to even) and ">= t" ones written as "> t - 1". */
static inline void boundaries(int32_t e, int16_t t[7]) {
    t[0] = boundary_bits(0, -2 + e) >> 16;
    t[1] = (boundary_bits(1 << 22, -1 + e) >> 16) - 1;
    t[2] = boundary_bits(1 << 21, 0 + e) >> 16;
    t[3] = (boundary_bits(3 << 21, 0 + e) >> 16) - 1;
    t[4] = boundary_bits(1 << 21, 1 + e) >> 16;
    t[5] = (boundary_bits(3 << 21, 1 + e) >> 16) - 1;
    t[6] = boundary_bits(1 << 21, 2 + e) >> 16;
}

/* Twice the E2M1 magnitude |x| rounds to (0 1 2 3 4 6 8 12), from the same compares as the code. */
static inline int32_t twice_grid(int16_t m, const int16_t t[7]) {
    return (m > t[0]) + (m > t[1]) + (m > t[2]) + (m > t[3]) + 2 * ((m > t[4]) + (m > t[5])) + 4 * (m > t[6]);
}

static inline float lane_sum(const float l[LANES]) {
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* Squared error of a block (|x| as bf16 bits m, xs = |x| / 2^eq, both padded to 32 with zeros) quantized
   with scale 2^(eq + d), in units of 2^(2 eq), summed in scale_rules.py's lane order. Fixed trip counts,
   so the compiler vectorizes every loop without reordering a float sum. */
static float block_error(const int16_t *m, const float *xs, int32_t eq, int32_t d) {
    int16_t t[7];
    if (eq > -118 && eq < 118) {  /* every boundary a normal bf16: one exponent step is 0x80 */
        boundaries(eq, t);
        for (int k = 0; k < 7; k++) t[k] += (int16_t)(d * 0x80);
    } else {
        boundaries(eq + d, t);
    }
    float half = pow2f(d - 1), e2[BLOCK], lane[LANES];
    for (int i = 0; i < BLOCK; i++) {
        float r = xs[i] - (float)twice_grid(m[i], t) * half;
        e2[i] = r * r;
    }
    for (int l = 0; l < LANES; l++) lane[l] = e2[l];
    for (int j = 1; j < BLOCK / LANES; j++)
        for (int l = 0; l < LANES; l++) lane[l] += e2[j * LANES + l];
    return lane_sum(lane);
}

/* Codes of one block with boundaries t, and (stats) its errors added to per-row float32 accumulators of 32
   lanes (absolute units, so no per-block reduction): acc[0..32) squared errors, [32..64) squares, [64..96)
   max |error|; clipped: |x| > top = 6 * 2^e, the block's largest representable magnitude. */
static inline void encode_block(const int16_t *x, int64_t n, const int16_t t[7], uint8_t *c, int with_stats,
                                float half, float top, float *acc, int64_t *clipped) {
    if (!with_stats) {
        for (int64_t i = 0; i < n; i++) {
            int16_t v = x[i], m = v & 0x7FFF;
            uint8_t k = (uint8_t)((m > t[0]) + (m > t[1]) + (m > t[2]) + (m > t[3]) + (m > t[4]) + (m > t[5]) + (m > t[6]));
            c[i] = k | (uint8_t)(((v < 0) & (k != 0)) << 3);
        }
        return;
    }
    int32_t clip = 0;
    int16_t v[BLOCK] = {0};
    const int16_t *xv = x;
    if (n < BLOCK) {  /* a short last block: padded with zeros, which add nothing */
        for (int64_t i = 0; i < n; i++) v[i] = x[i];
        xv = v;
    }
    for (int i = 0; i < BLOCK; i++) {
        int16_t m = xv[i] & 0x7FFF;
        int16_t k = (m > t[0]) + (m > t[1]) + (m > t[2]) + (m > t[3]) + (m > t[4]) + (m > t[5]) + (m > t[6]);
        int16_t g2 = k + (m > t[4]) + (m > t[5]) + 3 * (m > t[6]);
        c[i] = (uint8_t)(k | (((xv[i] < 0) & (k != 0)) << 3));
        float a = float_of_bits((uint32_t)(uint16_t)m << 16), r = a - (float)g2 * half;
        acc[i] += r * r;
        acc[BLOCK + i] += a * a;
        r = r < 0 ? -r : r;
        acc[2 * BLOCK + i] = r > acc[2 * BLOCK + i] ? r : acc[2 * BLOCK + i];
        clip += a > top;
    }
    *clipped += clip;
}

/* rows: bf16 bits [n_rows, inner]; codes [n_rows, inner/2]; scales [n_rows, ceil(inner/BLOCK)].
   offsets[0..n_offsets): the scale rule's exponent offsets from Quark's (scale_rules.py); {0} is Quark's.
   stats: NULL, or 4 doubles the error statistics of the finite blocks are added to: sum of squared errors,
   sum of squares, max |error|, count of clipped values (encode_block); summed per row in float32 lanes.
   Returns the count of non-finite inputs (their blocks are then invalid). */
int64_t mxfp4_quantize_bf16(const int16_t *rows, uint8_t *codes, uint8_t *scales, int64_t n_rows, int64_t inner,
                            const int32_t *offsets, int32_t n_offsets, double *stats) {
    int64_t nonfinite = 0;
    int64_t nblocks = (inner + BLOCK - 1) / BLOCK, clipped = 0;
    float acc[3 * BLOCK] = {0};
    for (int64_t r = 0; r < n_rows; r++) {
        const int16_t *row = rows + r * inner;
        uint8_t *crow = codes + r * (inner / 2);
        uint8_t *srow = scales + r * nblocks;
        for (int64_t b = 0; b < nblocks; b++) {
            int64_t start = b * BLOCK, n = inner - start < BLOCK ? inner - start : BLOCK;
            const int16_t *x = row + start;
            int16_t amax = 0;
            for (int64_t i = 0; i < n; i++) {
                int16_t m = x[i] & 0x7FFF;
                amax = m > amax ? m : amax;
            }
            if (amax >= 0x7F80)
                for (int64_t i = 0; i < n; i++) nonfinite += (x[i] & 0x7FFF) >= 0x7F80;
            int32_t exponent = ((((int32_t)amax << 16) + (1 << 21)) >> 23) & 0xFF;
            int32_t byte = exponent == 255 ? 254 : (exponent - 2 < 1 ? 1 : (exponent - 2 > 254 ? 254 : exponent - 2));
            if (n_offsets > 1 && amax < 0x7F80) {
                int32_t eq = byte - 127, best = 0;
                int16_t m[BLOCK] = {0};
                float xs[BLOCK], inv = pow2f(-eq), best_error = 0;
                for (int64_t i = 0; i < n; i++) m[i] = x[i] & 0x7FFF;
                for (int i = 0; i < BLOCK; i++) xs[i] = float_of_bits((uint32_t)m[i] << 16) * inv;
                for (int32_t c = 0; c < n_offsets; c++) {
                    int32_t d = offsets[c];
                    if (byte + d < 1 || byte + d > 254) continue;
                    float error = block_error(m, xs, eq, d);
                    if (c == 0 || error < best_error) best = d, best_error = error;
                }
                byte += best;
            }
            srow[b] = (uint8_t)byte;
            int16_t t[7];
            boundaries(byte - 127, t);
            uint8_t c[BLOCK];
            int finite_stats = stats && amax < 0x7F80;
            encode_block(x, n, t, c, finite_stats, finite_stats ? pow2f(byte - 128) : 0, finite_stats ? 6.0f * pow2f(byte - 127) : 0,
                         acc, &clipped);
            uint8_t *out = crow + start / 2;
            for (int64_t j = 0; j < n / 2; j++) out[j] = c[2 * j] | (uint8_t)(c[2 * j + 1] << 4);
        }
        if (stats) {
            double err = 0, ref = 0;
            for (int i = 0; i < BLOCK; i++) {
                err += acc[i], ref += acc[BLOCK + i];
                stats[2] = acc[2 * BLOCK + i] > stats[2] ? acc[2 * BLOCK + i] : stats[2];
                acc[i] = acc[BLOCK + i] = acc[2 * BLOCK + i] = 0;
            }
            stats[0] += err, stats[1] += ref;
        }
    }
    if (stats) stats[3] += (double)clipped;
    return nonfinite;
}
