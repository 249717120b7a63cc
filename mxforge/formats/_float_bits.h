/* float32 bit helpers the C kernels share (mxfp4/_bf16.c, fp8_ptpc/_ptpc.c, _mx_bf16.c). formats/native.py hashes
   this header into every kernel's build key, so a change here rebuilds them all. */

#ifndef MXFORGE_FLOAT_BITS_H
#define MXFORGE_FLOAT_BITS_H

#include <stdint.h>
#include <string.h>

static inline float float_of_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t bits_of(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

/* 2^k as a float for k in [-149, 127] (exact; subnormal below -126). */
static inline float pow2f(int32_t k) {
    return k >= -126 ? float_of_bits((uint32_t)(k + 127) << 23) : float_of_bits(1u << (k + 149));
}

#endif
