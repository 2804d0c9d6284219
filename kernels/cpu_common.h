/* What the CPU C kernels share: bf16 <-> fp32 as torch rounds, and a vectorizable exp.
 * Header-only (static inline); kernels/cpu_native.py hashes it into every library's cache
 * key, so a change here rebuilds them all. */
#ifndef PAGEMESH_CPU_COMMON_H
#define PAGEMESH_CPU_COMMON_H

#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* fp32 -> the nearest bf16, back as fp32: what a torch bf16 op stores. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f   /* ln 2 = EXP_LN2_HI - EXP_LN2_LO, the high part exact */
#define EXP_LN2_LO 2.12194440e-4f
/* e^r - 1 - r, over r^2, for |r| <= ln 2 / 2: Cephes' degree-5 polynomial, on a float or on a
 * vector of them (kernels/cpu_extend.h's exp_vec). */
#define EXP_POLY(r) (((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) \
                      * (r) + 4.1665795894e-2f) * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f)

/* exp(x) to within 2 ulp of expf for x in [-87, 88] (x is clamped there, so -inf gives
 * ~1e-38 where every use multiplies it by 0), written without branches or calls so the
 * compiler vectorizes loops over it: Cody-Waite reduction by ln 2 and Cephes' degree-5
 * polynomial. Scalar expf was half of the decode kernel's time. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(x * EXP_LOG2E + 0.5f);
    const float r = x - n * EXP_LN2_HI + n * EXP_LN2_LO;
    const float e = EXP_POLY(r) * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return e * two_n;
}

/* Elementwise kernels split rows across threads only above this many elements: a decode
 * step's 64 x 576 is cheaper on one thread than the fork-join. */
#define PARALLEL_MIN_ELEMENTS 32768L

#endif
