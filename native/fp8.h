/* fp8 e4m3 -> float32 (shared by the native routines): exact. */
#ifndef VMEMKV_FP8_H
#define VMEMKV_FP8_H

#include <stdint.h>
#include <string.h>

/* An fp8 e4m3 byte's value: its exponent and mantissa bits placed in a float32's (exponent bias
 * 127 instead of 7, subnormals to subnormals) and scaled by 2^120. */
static inline float fp8_to_float(uint8_t x) {
    const uint32_t bits = ((uint32_t)(x & 0x80) << 24) | ((uint32_t)(x & 0x7f) << 20);
    float f;
    memcpy(&f, &bits, 4);
    return f * 0x1p120f;
}

#endif
