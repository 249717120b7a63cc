/* The bf16 CPU kernel of any OCP MX element (MXFP6 E2M3 and E3M2; MXFP4 has its own, _bf16.c in mxfp4/, which
   rounds by compares). The rules are ocp_mx.py's, whose torch kernel is the reference the bytes are tested against
   (and through it Quark 0.13's file-to-file output). One build per element: BITS (code width, the sign the top bit),
   MBITS (mantissa bits) and BIAS, with BLOCK and LANES, are -D flags from ocp_mx.py. Built with -ffp-contract=off
   (no fused multiply-add), so a scale rule's float32 block errors round exactly as the torch kernel's do.

   An element is rounded on the float32 bits of q = |x| * 2^(127 - byte) (exact: a power of two): in the element's
   normal range, rounding the float32 mantissa to MBITS bits half to even (a carry moves to the exponent) gives
   the code plus (127 - BIAS) << MBITS; below it, q in units of the subnormal step rounded half to even (adding
   2^23 in float32 rounds so). Both are computed and one kept, so the loops vectorize; codes past the largest
   saturate. */

#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "_float_bits.h"

#if !defined(BLOCK) || !defined(LANES) || !defined(BITS) || !defined(MBITS) || !defined(BIAS)
#error "build with -DBLOCK= -DLANES= -DBITS= -DMBITS= -DBIAS= (mxforge/formats/ocp_mx.py does)"
#endif

#define MAXMAG ((1 << (BITS - 1)) - 1)              /* the largest magnitude code */
#define EMAX ((1 << (BITS - 1 - MBITS)) - 1 - BIAS) /* the largest exponent of a value */
#define SHIFT (23 - MBITS)                          /* float32 mantissa bits dropped */
#define MIN_NORMAL_BITS ((uint32_t)(127 + 1 - BIAS) << 23)
#define PER (8 / (BITS % 8 == 0 ? 8 : (BITS % 4 == 0 ? 4 : (BITS % 2 == 0 ? 2 : 1)))) /* codes per byte group */
#define GROUP_BYTES (PER * BITS / 8)

/* The magnitude code q (float32, >= 0) rounds to: half to even onto the element's grid, saturating. */
static inline int32_t magnitude(float q) {
    uint32_t b = bits_of(q);
    int32_t normal = (int32_t)((b + ((1u << (SHIFT - 1)) - 1) + ((b >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MBITS);
    float steps = q * pow2f(BIAS + MBITS - 1) + 8388608.0f; /* q / 2^(1 - BIAS - MBITS), rounded to an integer */
    int32_t sub = (int32_t)(bits_of(steps) - 0x4B000000u);
    int32_t code = b >= MIN_NORMAL_BITS ? normal : sub;
    return code > MAXMAG ? MAXMAG : code;
}

/* The value of every magnitude code. */
static void magnitudes(float grid[MAXMAG + 1]) {
    for (int32_t c = 0; c <= MAXMAG; c++) {
        int32_t e = c >> MBITS, f = c & ((1 << MBITS) - 1);
        grid[c] = e == 0 ? (float)f * pow2f(1 - BIAS - MBITS) : pow2f(e - BIAS) * (1.0f + (float)f * pow2f(-MBITS));
    }
}

static inline float lane_sum(const float l[LANES]) {
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* Squared error of a block (xs = |x| / 2^eq, padded to BLOCK with zeros) quantized with scale 2^(eq + d), in units
   of 2^(2 eq), summed in the scale rules' lane order (ocp_mx.rule_offsets). */
static float block_error(const float *xs, int32_t d, const float grid[MAXMAG + 1]) {
    float down = pow2f(-d), up = pow2f(d), e2[BLOCK], lane[LANES];
    for (int i = 0; i < BLOCK; i++) {
        float r = xs[i] - grid[magnitude(xs[i] * down)] * up;
        e2[i] = r * r;
    }
    for (int l = 0; l < LANES; l++) lane[l] = e2[l];
    for (int j = 1; j < BLOCK / LANES; j++)
        for (int l = 0; l < LANES; l++) lane[l] += e2[j * LANES + l];
    return lane_sum(lane);
}

/* rows: bf16 bits [n_rows, inner]; codes [n_rows, inner * BITS / 8]; scales [n_rows, ceil(inner/BLOCK)].
   offsets[0..n_offsets): the scale rule's exponent offsets from Quark's ({0} is Quark's). stats: NULL, or 4 doubles
   the error statistics of the finite blocks are added to (sum of squared errors, sum of squares, max |error|, count
   of values above their block's largest), in float64 (the torch kernel's sums, in another order). Returns the count of non-finite inputs
   (their blocks are then meaningless). inner must be a whole number of byte groups (ElementFormat.unpackable). */
int64_t mx_quantize_bf16(const int16_t *rows, uint8_t *codes, uint8_t *scales, int64_t n_rows, int64_t inner,
                         const int32_t *offsets, int32_t n_offsets, double *stats) {
    int64_t nonfinite = 0, clipped = 0;
    int64_t nblocks = (inner + BLOCK - 1) / BLOCK, row_bytes = inner * BITS / 8;
    float grid[MAXMAG + 1];
    double acc[3 * BLOCK] = {0}; /* per row: squared errors, squares, max |error|, by position in the block */
    magnitudes(grid);
    for (int64_t r = 0; r < n_rows; r++) {
        const int16_t *row = rows + r * inner;
        uint8_t *crow = codes + r * row_bytes, *srow = scales + r * nblocks;
        for (int64_t b = 0; b < nblocks; b++) {
            int64_t start = b * BLOCK, n = inner - start < BLOCK ? inner - start : BLOCK;
            int16_t v[BLOCK] = {0}; /* a short last block padded with zeros, which change nothing */
            memcpy(v, row + start, (size_t)n * sizeof *v);
            float a[BLOCK];
            int16_t amax = 0;
            for (int i = 0; i < BLOCK; i++) {
                int16_t m = v[i] & 0x7FFF;
                amax = m > amax ? m : amax;
                a[i] = float_of_bits((uint32_t)(uint16_t)m << 16);
            }
            int finite = amax < 0x7F80;
            if (!finite)
                for (int i = 0; i < BLOCK; i++) nonfinite += (v[i] & 0x7FFF) >= 0x7F80;
            int32_t exponent = ((((int32_t)amax << 16) + (1 << (22 - MBITS))) >> 23) & 0xFF;
            int32_t byte = exponent == 255 ? 254 : (exponent - EMAX < 1 ? 1 : (exponent - EMAX > 254 ? 254 : exponent - EMAX));
            if (n_offsets > 1 && finite) {
                int32_t best = 0;
                float xs[BLOCK], inv = pow2f(127 - byte), best_error = 0;
                for (int i = 0; i < BLOCK; i++) xs[i] = a[i] * inv;
                for (int32_t c = 0; c < n_offsets; c++) {
                    int32_t d = offsets[c];
                    if (byte + d < 1 || byte + d > 254) continue;
                    float error = block_error(xs, d, grid);
                    if (c == 0 || error < best_error) best = d, best_error = error;
                }
                byte += best;
            }
            srow[b] = (uint8_t)byte;
            float inv = pow2f(127 - byte), q[BLOCK];
            uint8_t c[BLOCK];
            int32_t k[BLOCK];
            for (int i = 0; i < BLOCK; i++) {
                q[i] = a[i] * inv;
                k[i] = magnitude(q[i]);
                c[i] = (uint8_t)(k[i] | (((v[i] < 0) & (k[i] != 0)) << (BITS - 1)));
            }
            if (stats && finite) { /* in float64, as the torch kernel: no square overflows or underflows */
                double scale = (double)pow2f(byte - 127);
                int32_t clip = 0;
                for (int i = 0; i < BLOCK; i++) {
                    double e = ((double)q[i] - (double)grid[k[i]]) * scale, ae = e < 0 ? -e : e;
                    acc[i] += e * e;
                    acc[BLOCK + i] += (double)a[i] * (double)a[i];
                    acc[2 * BLOCK + i] = ae > acc[2 * BLOCK + i] ? ae : acc[2 * BLOCK + i];
                    clip += q[i] > grid[MAXMAG];
                }
                clipped += clip;
            }
            uint8_t *out = crow + start * BITS / 8;
            for (int64_t g = 0; g < n / PER; g++) {
                uint64_t w = 0;
                for (int i = 0; i < PER; i++) w |= (uint64_t)c[g * PER + i] << (i * BITS);
                for (int j = 0; j < GROUP_BYTES; j++) out[g * GROUP_BYTES + j] = (uint8_t)(w >> (8 * j));
            }
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
