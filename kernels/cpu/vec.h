/*
 * vec.h - 16-float vectors (GCC vector extensions: one AVX-512 register) and
 * the few functions on them the CPU backend's chunked and step forms share.
 * Internal to kernels/cpu; each user compiles them into its own clones.
 */
#ifndef KDA_CPU_VEC_H
#define KDA_CPU_VEC_H

#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

#define HOT static inline __attribute__((always_inline))

HOT v16f vload(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
HOT void vstore(float *p, v16f v) { memcpy(p, &v, sizeof v); }
HOT v16f vsplat(float x) { return (v16f){0} + x; }
HOT v16f vselect(v16i mask, v16f a, v16f b) { return (v16f)((mask & (v16i)a) | (~mask & (v16i)b)); }

HOT v16f vload_bf16(const uint16_t *p)
{
    v16h h;
    memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
}

/* Round to nearest even; NaN stays a quiet NaN (as kda_f32_to_bf16). */
HOT void vstore_bf16(uint16_t *p, v16f x)
{
    v16u u = (v16u)x;
    v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    v16i nan = (v16i)((u & 0x7fffffffu) > 0x7f800000u);
    v16u r = (rounded & ~(v16u)nan) | (((u >> 16) | 0x40u) & (v16u)nan);
    v16h h = __builtin_convertvector(r, v16h);
    memcpy(p, &h, sizeof h);
}

HOT float vsum(v16f x)
{
    float s = 0.0f;
    for (int i = 0; i < 16; i++)
        s += x[i];
    return s;
}

/*
 * exp(x) to ~1 ulp (Cephes expf): x = n ln2 + r, |r| <= ln2/2, degree-6
 * polynomial in r, times 2^n built in the exponent bits.  Inputs are clamped
 * to [-87.3, 88.3] so 2^n stays a normal number.
 */
HOT v16f vexp(v16f x)
{
    const v16f lo = vsplat(-87.3f), hi = vsplat(88.3f);
    x = vselect(x < lo, lo, x);
    x = vselect(x > hi, hi, x);
    const float round_magic = 12582912.0f;                 /* 1.5 * 2^23 */
    v16f n = (x * 1.44269504088896341f + round_magic) - round_magic;
    v16f r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16f p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v16f y = p * (r * r) + r + 1.0f;
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    return y * (v16f)e;
}

HOT v16f vsigmoid(v16f x) { return 1.0f / (1.0f + vexp(-x)); }

#endif /* KDA_CPU_VEC_H */
