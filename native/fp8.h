/* fp8 e4m3 -> float32 (shared by the native routines): exact. */
#ifndef VMEMKV_FP8_H
#define VMEMKV_FP8_H

#include <stdint.h>
#include <string.h>

/* An fp8 e4m3 byte's value: its exponent and mantissa bits placed in a float32's (exponent bias
 * 127 instead of 7, subnormals to subnormals) and scaled by 2^120. */
static inline float fp8_bits_to_float(uint8_t x) {
    const uint32_t bits = ((uint32_t)(x & 0x80) << 24) | ((uint32_t)(x & 0x7f) << 20);
    float f;
    memcpy(&f, &bits, 4);
    return f * 0x1p120f;
}

/* The 256 values, filled when the module loads: a byte widens with one load where the bit
 * arithmetic above costs five operations and a multiply (the scalar loops read a value a time). */
static float fp8_values[256];

__attribute__((constructor)) static void fp8_values_fill(void) {
    for (int x = 0; x < 256; x++) fp8_values[x] = fp8_bits_to_float((uint8_t)x);
}

static inline float fp8_to_float(uint8_t x) { return fp8_values[x]; }

#endif
