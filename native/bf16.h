/* bfloat16 <-> float32 (shared by the native routines): widening is exact; narrowing rounds to
 * nearest even, as torch does (a NaN stays a NaN, its payload aside). */
#ifndef VMEMKV_BF16_H
#define VMEMKV_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &wide, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded); /* a select: vectorizes */
}

/* f as a bfloat16 tensor op leaves it: rounded to bfloat16, widened back */
static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#endif
