/* Shared by the native attention routines (decode_attention.c, prefill_attention.c). */
#ifndef VMEMKV_EXP_NONPOSITIVE_H
#define VMEMKV_EXP_NONPOSITIVE_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0: Cody-Waite range reduction and a degree-6 polynomial (relative error ~2e-7),
 * written so the compiler vectorizes it (libm's expf is a call per score). Below -87 it clamps
 * (exp(-87) ~ 1.6e-38: "nothing" next to the row's maximum, exp(0) = 1); the clamp compares bit
 * patterns, since for x <= 0 a larger pattern is a more negative float: a float compare-select
 * does not vectorize in GCC 12's AVX2 clone. */
static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits = bits > 0xC2AE0000u ? 0xC2AE0000u : bits; /* -87.0f */
    memcpy(&x, &bits, 4);
    float k = (float)(int32_t)(x * 1.44269504089f - 0.5f); /* round to nearest, for x <= 0 */
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (0.166666672f + r * (0.0416666418f + r * (0.00833336264f
              + r * 0.00138925365f)))));
    int32_t exponent = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &exponent, 4);
    return p * two_k;
}


/* Sixteen float lanes (one AVX-512 register; two AVX ones elsewhere) and exp_nonpositive on them. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* a where mask (a vector comparison's all-ones lanes), else b */
static inline __attribute__((always_inline)) v16f select16(v16i mask, v16f a, v16f b) {
    return (v16f)((mask & (v16i)a) | (~mask & (v16i)b));
}

/* exp_nonpositive on 16 lanes; below -87 (and -inf) it clamps to exp(-87) */
static inline __attribute__((always_inline)) v16f exp16(v16f x) {
    const v16f floor = (v16f){0} - 87.f;
    x = select16(x < floor, floor, x);
    const v16i ki = __builtin_convertvector(x * 1.44269504089f - 0.5f, v16i); /* round to nearest, x <= 0 */
    const v16f k = __builtin_convertvector(ki, v16f);
    const v16f r = x - k * 0.693359375f + k * 2.12194440e-4f;
    const v16f p = 1.f + r * (1.f + r * (0.5f + r * (0.166666672f + r * (0.0416666418f + r * (0.00833336264f
                   + r * 0.00138925365f)))));
    return p * (v16f)((ki + 127) << 23);
}

#endif
