/*
 * chunk.c - the chunked KDA algorithm for one (sequence, head) chain, fp32.
 *
 * Per chunk of C = 16 tokens (docs/kda.md, "Chunks"), with the state S0 in
 * K-major layout S[k][v]:
 *
 *   prepare   q^, k^ (L2 norm), G = prefix sum of log a, b = sigmoid(beta),
 *             kd = k^ Gam, qd = scale q^ Gam, ki = k^ / Gam, kr = k^ GamC / Gam,
 *             L = strictly_lower(diag(b) kd ki^T), M = lower_incl(qd ki^T)
 *   read      [P; O1] = [kd; qd] . S0                       (2C x 128) . (128 x 128)
 *   solve     U = (I + L)^-1 diag(b) (V - P)                (forward substitution)
 *   output    O = O1 + M U
 *   update    S1 = diag(GamC) S0 + kr^T U                   (128 x C) . (C x 128)
 *
 * A short last chunk is padded with tokens whose k, b and gate increment are
 * zero: they leave U, S and G unchanged and their outputs are not stored.
 *
 * The arithmetic uses GCC vector extensions (vec.h); cpu_chain_run is
 * cloned for AVX-512, AVX2+FMA and baseline x86-64 and picked at load time, so one binary runs on any x86-64 host.
 */
#include "chunk.h"

#include <string.h>

#include "bf16.h"
#include "vec.h"

enum { D = CPU_D, C = CPU_CHUNK, NV = CPU_D / 16 /* vectors per row */ };

/* Loads a bf16 row of D and L2-normalises it (eps inside the sqrt). */
HOT void load_normalised(const uint16_t *src, float *dst)
{
    v16f x[NV], ss = vsplat(0.0f);
    for (int c = 0; c < NV; c++) {
        x[c] = vload_bf16(src + 16 * c);
        ss += x[c] * x[c];
    }
    float inv = 1.0f / __builtin_sqrtf(vsum(ss) + KDA_NORM_EPS);
    for (int c = 0; c < NV; c++)
        vstore(dst + 16 * c, x[c] * inv);
}

HOT float dot(const float *a, const float *b)
{
    v16f acc = vsplat(0.0f);
    for (int c = 0; c < NV; c++)
        acc += vload(a + 16 * c) * vload(b + 16 * c);
    return vsum(acc);
}

/* Chunk-local preparation: everything that does not depend on the state. */
HOT void prepare_chunk(cpu_scratch *ws, const kda_seq *seq, int32_t heads, int32_t head,
                       int64_t t0, int r, float expA, float lower_bound, float scale)
{
    const int64_t stride = (int64_t)heads * D;
    v16f G[NV];
    for (int c = 0; c < NV; c++)
        G[c] = vsplat(0.0f);

    for (int t = 0; t < C; t++) {
        if (t < r) {
            const int64_t row = (t0 + t) * stride + (int64_t)head * D;
            load_normalised(seq->q + row, ws->qn[t]);
            load_normalised(seq->k + row, ws->kn[t]);
            for (int c = 0; c < NV; c++) {
                v16f x = (vload_bf16(seq->g + row + 16 * c) + vload(ws->dt_bias + 16 * c)) * expA;
                G[c] += lower_bound * vsigmoid(x);
                vstore(ws->Vv[t] + 16 * c, vload_bf16(seq->v + row + 16 * c));
            }
            float beta = kda_bf16_to_f32(seq->beta[(t0 + t) * heads + head]);
            ws->b[t] = 1.0f / (1.0f + __builtin_expf(-beta));
        } else {                       /* padding: k = 0, b = 0, G unchanged */
            memset(ws->qn[t], 0, sizeof ws->qn[t]);
            memset(ws->kn[t], 0, sizeof ws->kn[t]);
            memset(ws->Vv[t], 0, sizeof ws->Vv[t]);
            ws->b[t] = 0.0f;
        }
        for (int c = 0; c < NV; c++)
            vstore(ws->G[t] + 16 * c, G[c]);
    }

    for (int c = 0; c < NV; c++)
        vstore(ws->gamC + 16 * c, vexp(G[c]));
    for (int t = 0; t < C; t++) {
        for (int c = 0; c < NV; c++) {
            v16f g = vload(ws->G[t] + 16 * c);
            v16f kn = vload(ws->kn[t] + 16 * c);
            v16f gam = vexp(g);
            vstore(ws->A[t] + 16 * c, kn * gam);
            vstore(ws->A[C + t] + 16 * c, vload(ws->qn[t] + 16 * c) * gam * scale);
            vstore(ws->ki[t] + 16 * c, kn * vexp(-g));
            vstore(ws->kr[t] + 16 * c, kn * vexp(G[c] - g));
        }
    }
    for (int i = 0; i < C; i++) {
        for (int j = 0; j < C; j++) {
            ws->M[i][j] = j <= i ? dot(ws->A[C + i], ws->ki[j]) : 0.0f;
            ws->L[i][j] = j < i ? ws->b[i] * dot(ws->A[i], ws->ki[j]) : 0.0f;
        }
    }
}

/* [P; O1] = A . S: rows of A against the K-major state, 4 rows x 64 columns per block. */
HOT void read_state(cpu_scratch *ws)
{
    for (int v0 = 0; v0 < D; v0 += 64) {          /* S[:, v0:v0+64] is 32 KB: stays in L1 */
        for (int i0 = 0; i0 < 2 * C; i0 += 4) {
            v16f acc[4][4];
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++)
                    acc[r][c] = vsplat(0.0f);
            for (int k = 0; k < D; k++) {
                v16f s[4];
                for (int c = 0; c < 4; c++)
                    s[c] = vload(&ws->S[k][v0 + 16 * c]);
                for (int r = 0; r < 4; r++) {
                    float a = ws->A[i0 + r][k];
                    for (int c = 0; c < 4; c++)
                        acc[r][c] += a * s[c];
                }
            }
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++)
                    vstore(&ws->P[i0 + r][v0 + 16 * c], acc[r][c]);
        }
    }
}

/* U = (I + L)^-1 diag(b) (V - P) row by row; O = O1 + M U, stored as bf16 for real tokens. */
HOT void solve_and_output(cpu_scratch *ws, uint16_t *out, int64_t out_stride, int r)
{
    for (int i = 0; i < C; i++) {
        v16f u[NV];
        for (int c = 0; c < NV; c++)
            u[c] = ws->b[i] * (vload(ws->Vv[i] + 16 * c) - vload(ws->P[i] + 16 * c));
        for (int j = 0; j < i; j++) {
            float l = ws->L[i][j];
            for (int c = 0; c < NV; c++)
                u[c] -= l * vload(ws->U[j] + 16 * c);
        }
        for (int c = 0; c < NV; c++)
            vstore(ws->U[i] + 16 * c, u[c]);
        if (i >= r)
            continue;
        for (int c = 0; c < NV; c++) {
            v16f o = vload(ws->P[C + i] + 16 * c);
            for (int j = 0; j <= i; j++)
                o += ws->M[i][j] * vload(ws->U[j] + 16 * c);
            vstore_bf16(out + (int64_t)i * out_stride + 16 * c, o);
        }
    }
}

/* S = diag(GamC) S + kr^T U, 4 state rows x 64 columns per block. */
HOT void update_state(cpu_scratch *ws)
{
    for (int k0 = 0; k0 < D; k0 += 4) {
        for (int v0 = 0; v0 < D; v0 += 64) {
            v16f acc[4][4];
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++)
                    acc[r][c] = ws->gamC[k0 + r] * vload(&ws->S[k0 + r][v0 + 16 * c]);
            for (int i = 0; i < C; i++) {
                v16f u[4];
                for (int c = 0; c < 4; c++)
                    u[c] = vload(&ws->U[i][v0 + 16 * c]);
                for (int r = 0; r < 4; r++) {
                    float kr = ws->kr[i][k0 + r];
                    for (int c = 0; c < 4; c++)
                        acc[r][c] += kr * u[c];
                }
            }
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++)
                    vstore(&ws->S[k0 + r][v0 + 16 * c], acc[r][c]);
        }
    }
}

/* Pool (V-major, bf16 or fp32) <-> working state (K-major fp32). */
static void load_state(cpu_scratch *ws, const kda_pool *pool, const kda_seq *seq, int32_t head)
{
    if (seq->flags & KDA_SEQ_ZERO_STATE) {
        memset(ws->S, 0, sizeof ws->S);
        return;
    }
    const int64_t base = (seq->slot * pool->heads + head) * (int64_t)D * D;
    if (pool->dtype == KDA_DTYPE_F32) {
        const float *src = (const float *)pool->state + base;
        for (int v = 0; v < D; v++)
            for (int k = 0; k < D; k++)
                ws->S[k][v] = src[v * D + k];
    } else {
        const uint16_t *src = (const uint16_t *)pool->state + base;
        for (int v = 0; v < D; v++)
            for (int k = 0; k < D; k++)
                ws->S[k][v] = kda_bf16_to_f32(src[v * D + k]);
    }
}

static void store_state(const cpu_scratch *ws, const kda_pool *pool, const kda_seq *seq,
                        int32_t head)
{
    const int64_t base = (seq->slot * pool->heads + head) * (int64_t)D * D;
    if (pool->dtype == KDA_DTYPE_F32) {
        float *dst = (float *)pool->state + base;
        for (int v = 0; v < D; v++)
            for (int k = 0; k < D; k++)
                dst[v * D + k] = ws->S[k][v];
    } else {
        uint16_t *dst = (uint16_t *)pool->state + base;
        for (int v = 0; v < D; v++)
            for (int k = 0; k < D; k++)
                dst[v * D + k] = kda_f32_to_bf16(ws->S[k][v]);
    }
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void cpu_chain_run(cpu_scratch *ws, const kda_pool *pool, const kda_seq *seq, int32_t head)
{
    const kda_layer *layer = seq->layer;
    const int32_t heads = pool->heads;
    const float expA = __builtin_expf(layer->A_log[head]);
    memcpy(ws->dt_bias, layer->dt_bias + (int64_t)head * D, sizeof ws->dt_bias);

    load_state(ws, pool, seq, head);
    for (int64_t t0 = 0; t0 < seq->len; t0 += C) {
        int r = seq->len - t0 < C ? (int)(seq->len - t0) : C;
        prepare_chunk(ws, seq, heads, head, t0, r, expA, layer->lower_bound, layer->scale);
        read_state(ws);
        solve_and_output(ws, seq->out + t0 * heads * D + (int64_t)head * D, (int64_t)heads * D, r);
        update_state(ws);
    }
    store_state(ws, pool, seq, head);
}

void cpu_slot_zero(const kda_pool *pool, int64_t slot)
{
    const size_t bytes = (size_t)kda_slot_elems(pool->heads) * kda_dtype_size(pool->dtype);
    memset((char *)pool->state + (size_t)slot * bytes, 0, bytes);
}
