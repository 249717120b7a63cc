/* The bf16 MXFP4 kernel: the rules are documented in mxfp4.py and mirrored in _mxfp4_kernel.py (numba,
   the fallback where no C compiler is found); this C version is what makes the CPU path fast: the
   compiler vectorizes the 16-bit compares. Built and cached on first use by _native.py. */

#include <stdint.h>
#include <stddef.h>

/* float32 bits of (1 + mantissa/2^23) * 2^exponent; subnormal below 2^-126, +inf above the range. */
static inline int32_t boundary_bits(int32_t mantissa, int32_t exponent) {
    int32_t biased = exponent + 127;
    if (biased >= 255) return 0x7F800000;
    if (biased > 0) return (biased << 23) | mantissa;
    return ((1 << 23) | mantissa) >> (1 - biased);
}

/* rows: bf16 bits [n_rows, inner]; codes [n_rows, inner/2]; scales [n_rows, ceil(inner/32)]. */
int64_t mxfp4_quantize_bf16(const int16_t *rows, uint8_t *codes, uint8_t *scales, int64_t n_rows, int64_t inner) {
    int64_t nonfinite = 0;
    int64_t nblocks = (inner + 31) / 32;
    for (int64_t r = 0; r < n_rows; r++) {
        const int16_t *row = rows + r * inner;
        uint8_t *crow = codes + r * (inner / 2);
        uint8_t *srow = scales + r * nblocks;
        for (int64_t b = 0; b < nblocks; b++) {
            int64_t start = b * 32, n = inner - start < 32 ? inner - start : 32;
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
            srow[b] = (uint8_t)byte;
            int32_t e = byte - 127;
            /* "> t" boundaries (ties round down to even) and ">= t" ones written as "> t - 1". */
            int16_t t0 = boundary_bits(0, -2 + e) >> 16;
            int16_t t1 = (boundary_bits(1 << 22, -1 + e) >> 16) - 1;
            int16_t t2 = boundary_bits(1 << 21, 0 + e) >> 16;
            int16_t t3 = (boundary_bits(3 << 21, 0 + e) >> 16) - 1;
            int16_t t4 = boundary_bits(1 << 21, 1 + e) >> 16;
            int16_t t5 = (boundary_bits(3 << 21, 1 + e) >> 16) - 1;
            int16_t t6 = boundary_bits(1 << 21, 2 + e) >> 16;
            uint8_t c[32];
            for (int64_t i = 0; i < n; i++) {
                int16_t v = x[i], m = v & 0x7FFF;
                uint8_t k = (uint8_t)((m > t0) + (m > t1) + (m > t2) + (m > t3) + (m > t4) + (m > t5) + (m > t6));
                c[i] = k | (uint8_t)(((v < 0) & (k != 0)) << 3);
            }
            uint8_t *out = crow + start / 2;
            for (int64_t j = 0; j < n / 2; j++) out[j] = c[2 * j] | (uint8_t)(c[2 * j + 1] << 4);
        }
    }
    return nonfinite;
}
