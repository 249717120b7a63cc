/* FP8 PTPC's CPU kernel: the rules are documented in numerics.py (Quark 0.13's per-channel FP8 E4M3 weights) and
   mirrored there in numpy (the fallback where no C compiler is found, and for float16 rows) and torch. One row at a
   time: its amax, its float32 scale amax / 448 (2^-23 for an all-zero row), each quotient computed in the weight's
   own dtype (bf16 rows: the scale and the float32 quotient rounded to bf16, half to even; float32 rows: float32),
   then converted to E4M3 "fn" as torch converts: round half to even, subnormals below 2^-6, saturating at 448, NaN
   0x7F with its sign. Built with -ffp-contract=off by formats/native.py. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../_float_bits.h"

/* float32 -> the float32 value of its bf16 rounding (half to even; finite inputs). */
static inline float round_bf16(float x) {
    uint32_t u = bits_of(x);
    return float_of_bits(((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16);
}

/* The float8_e4m3fn code of q, as torch converts; branch-free, so the row loops vectorize. */
static inline uint32_t e4m3(float q) {
    uint32_t u = bits_of(q);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t mag = u & 0x7FFFFFFFu;
    float a = float_of_bits(mag);
    uint32_t normal = ((mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20) - ((127u - 7u) << 3);
    /* below 2^-6: a multiple of 2^-9, rounded half to even by adding 1.5 * 2^23 (a * 512 is exact) */
    uint32_t sub = bits_of(a * 512.0f + 12582912.0f) - 0x4B400000u;
    /* integer compares of the magnitude's bits: 2^-6 is 0x3C800000, 448 is 0x43E00000, NaN is above infinity */
    uint32_t code = mag < 0x3C800000u ? sub : normal;
    code = mag > 0x43E00000u ? 0x7Eu : code;  /* saturate, infinities included */
    code = mag > 0x7F800000u ? 0x7Fu : code;  /* NaN */
    return sign | code;
}

/* The value of each E4M3 code, exact in float32 (NaN codes: 0; rows holding NaN are not measured). */
static float VALUES[256];

static void fill_values(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 0xF, m = c & 7;
        float v = (e == 0xF && m == 7) ? 0.0f : e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
        VALUES[c] = (c & 0x80) ? -v : v;
    }
}

/* The largest |x| of a row, as float32 bits (non-negative floats order as their bits: an integer max, which
   vectorizes). A row holding NaN is not finite and its outputs are not used. */
static inline uint32_t amax_bits_bf16(const uint16_t *b, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)(b[i] & 0x7FFFu) << 16;
        m = v > m ? v : m;
    }
    return m;
}

static inline uint32_t amax_bits_f32(const float *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = bits_of(x[i]) & 0x7FFFFFFFu;
        m = v > m ? v : m;
    }
    return m;
}

static inline float row_scale(uint32_t amax_bits) {
    float scale = float_of_bits(amax_bits) / 448.0f;
    return scale == 0.0f ? 1.1920929e-07f : scale; /* 2^-23, float32's epsilon, for an all-zero row */
}

/* bf16 rows: the quotient computed in bf16 (the scale and the float32 quotient rounded to bf16). */
static void encode_bf16(const uint16_t *b, float divisor, uint8_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = (uint8_t)e4m3(round_bf16(float_of_bits((uint32_t)b[i] << 16) / divisor));
}

static void encode_f32(const float *x, float divisor, uint8_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = (uint8_t)e4m3(x[i] / divisor);
}

/* A finite row's error sums (sse, ssq, max |err|, clipped: |x / scale| above 448) added to `sums`, the codes
   reconstructed in float32 (as the numpy and torch kernels do). */
static void measure_row(const uint16_t *b, const float *x, const uint8_t *codes, float scale, float divisor,
                        int64_t n, double sums[4]) {
    double sse = 0.0, ssq = 0.0, worst = 0.0, clipped = 0.0;
    for (int64_t i = 0; i < n; i++) {
        float v = b ? float_of_bits((uint32_t)b[i] << 16) : x[i];
        float q = b ? round_bf16(v / divisor) : v / divisor;
        double err = (double)v - (double)(VALUES[codes[i]] * scale);
        sse += err * err;
        ssq += (double)v * (double)v;
        worst = fabs(err) > worst ? fabs(err) : worst;
        clipped += fabsf(q) > 448.0f;
    }
    sums[0] += sse;
    sums[1] += ssq;
    sums[2] = worst > sums[2] ? worst : sums[2];
    sums[3] += clipped;
}

static int64_t count_nonfinite(const uint16_t *b, const float *x, int64_t n) {
    int64_t bad = 0;
    if (b)
        for (int64_t i = 0; i < n; i++) bad += (b[i] & 0x7F80u) == 0x7F80u;
    else
        for (int64_t i = 0; i < n; i++) bad += (bits_of(x[i]) & 0x7F800000u) == 0x7F800000u;
    return bad;
}

/* rows: n_rows x inner, bf16 bits (is_bf16) or float32. codes: n_rows x inner bytes; scales: n_rows float32.
   stats (or NULL): sum of squared errors, sum of squares, max |error|, clipped count, over the finite rows.
   Returns the count of non-finite inputs (their rows' outputs are then meaningless). */
int64_t fp8_ptpc_quantize(const void *rows, int32_t is_bf16, uint8_t *codes, float *scales, int64_t n_rows,
                          int64_t inner, double *stats) {
    static int filled = 0;
    if (!filled) {
        fill_values();
        filled = 1;
    }
    int64_t nonfinite = 0;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint16_t *b = is_bf16 ? (const uint16_t *)rows + r * inner : NULL;
        const float *x = is_bf16 ? NULL : (const float *)rows + r * inner;
        uint8_t *out = codes + r * inner;
        int64_t bad = count_nonfinite(b, x, inner);
        nonfinite += bad;
        float scale = row_scale(b ? amax_bits_bf16(b, inner) : amax_bits_f32(x, inner));
        float divisor = b ? round_bf16(scale) : scale;
        scales[r] = scale;
        if (b)
            encode_bf16(b, divisor, out, inner);
        else
            encode_f32(x, divisor, out, inner);
        if (stats && !bad) measure_row(b, x, out, scale, divisor, inner, stats);
    }
    return nonfinite;
}
