/*
 * step.c - one (sequence, head) of a decode step (kda.h, kda_step) on the
 * CPU: the recurrent form of KDA.md, token by token, in fp32.
 *
 * The state is loaded V-major (as the pool holds it) into the worker's
 * scratch, advanced token by token with one pass over its rows per token
 * (decay, S k^, correction, S q^), and stored once at the end; with
 * step->states set, every token's state is stored there too.
 */
#include "step.h"

#include <string.h>

#include "bf16.h"
#include "vec.h"

enum { D = CPU_D, NV = CPU_D / 16 };

HOT void load_row_bf16(const uint16_t *src, v16f *x)
{
    for (int c = 0; c < NV; c++)
        x[c] = vload_bf16(src + 16 * c);
}

/* x * scale / sqrt(sum(x^2) + eps) */
HOT void normalise(v16f *x, float scale)
{
    v16f ss = vsplat(0.0f);
    for (int c = 0; c < NV; c++)
        ss += x[c] * x[c];
    const float f = scale / __builtin_sqrtf(vsum(ss) + KDA_NORM_EPS);
    for (int c = 0; c < NV; c++)
        x[c] *= f;
}

static void store_rows(const float (*S)[D], void *dst, kda_dtype dtype)
{
    if (dtype == KDA_DTYPE_F32) {
        memcpy(dst, S, sizeof(float) * D * D);
        return;
    }
    uint16_t *d = dst;
    for (int v = 0; v < D; v++)
        for (int c = 0; c < NV; c++)
            vstore_bf16(d + v * D + 16 * c, vload(&S[v][16 * c]));
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void cpu_step_run(cpu_scratch *ws, const kda_pool *pool, const kda_step *step, int32_t seq,
                  int32_t head)
{
    const kda_step_seq *s = &step->seqs[seq];
    const kda_layer *layer = step->layer;
    const int32_t heads = pool->heads;
    const size_t esize = kda_dtype_size(pool->dtype);
    const int64_t head_elems = (int64_t)D * D;
    char *slot = (char *)pool->state + (size_t)((s->slot * heads + head) * head_elems) * esize;
    float (*S)[D] = ws->S;   /* V-major here: S[v][k] */

    if (s->flags & KDA_SEQ_ZERO_STATE)
        memset(S, 0, sizeof ws->S);
    else if (pool->dtype == KDA_DTYPE_F32)
        memcpy(S, slot, sizeof ws->S);
    else
        for (int v = 0; v < D; v++)
            for (int c = 0; c < NV; c++)
                vstore(&S[v][16 * c], vload_bf16((const uint16_t *)slot + v * D + 16 * c));

    const float expA = __builtin_expf(layer->A_log[head]), lb = layer->lower_bound;
    v16f dtb[NV];
    for (int c = 0; c < NV; c++)
        dtb[c] = vload(layer->dt_bias + (int64_t)head * D + 16 * c);

    for (int t = 0; t < s->len; t++) {
        const int64_t tok = (int64_t)s->start + t, row = (tok * heads + head) * D;
        v16f q[NV], k[NV], a[NV];
        load_row_bf16(step->q + row, q);
        load_row_bf16(step->k + row, k);
        normalise(q, layer->scale);   /* o = scale S q^ */
        normalise(k, 1.0f);
        for (int c = 0; c < NV; c++)
            a[c] = vexp(lb * vsigmoid(expA * (vload_bf16(step->g + row + 16 * c) + dtb[c])));
        const float b = 1.0f / (1.0f + __builtin_expf(-kda_bf16_to_f32(step->beta[tok * heads + head])));

        uint16_t *out = step->out + row;
        for (int v = 0; v < D; v++) {
            v16f x[NV], sk = vsplat(0.0f), o = vsplat(0.0f);
            for (int c = 0; c < NV; c++) {
                x[c] = vload(&S[v][16 * c]) * a[c];
                sk += x[c] * k[c];
            }
            const float u = b * (kda_bf16_to_f32(step->v[row + v]) - vsum(sk));
            for (int c = 0; c < NV; c++) {
                x[c] += u * k[c];
                o += x[c] * q[c];
                vstore(&S[v][16 * c], x[c]);
            }
            out[v] = kda_f32_to_bf16(vsum(o));
        }
        if (step->states)
            store_rows((const float (*)[D])S,
                       (char *)step->states + (size_t)((tok * heads + head) * head_elems) * esize,
                       pool->dtype);
    }
    store_rows((const float (*)[D])S, slot, pool->dtype);
}
