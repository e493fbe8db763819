/*
 * bf16.h - bfloat16 <-> float conversions on the host.
 *
 * bf16 is the upper half of an IEEE float32.  Conversion to bf16 rounds to
 * nearest, ties to even, and keeps NaN a (quiet) NaN.
 */
#ifndef KDA_BF16_H
#define KDA_BF16_H

#include <stdint.h>
#include <string.h>

static inline float kda_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t kda_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)        /* NaN: keep it quiet, keep the sign */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);            /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#endif /* KDA_BF16_H */
