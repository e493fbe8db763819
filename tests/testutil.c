/*
 * testutil.c - random KDA batches and oracle comparisons for the tests.
 */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kda_ref.h"

void rng_seed(test_rng *r, uint64_t seed) { r->s = seed * 0x9e3779b97f4a7c15ull + 1; }

uint64_t rng_next(test_rng *r)   /* splitmix64 */
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double rng_uniform(test_rng *r) { return (double)(rng_next(r) >> 11) * 0x1.0p-53; }

double rng_normal(test_rng *r)   /* Box-Muller */
{
    double u1 = rng_uniform(r), u2 = rng_uniform(r);
    return sqrt(-2.0 * log(u1 + 1e-300)) * cos(2.0 * M_PI * u2);
}

void fill_normal_bf16(test_rng *r, uint16_t *x, size_t n, double mean, double stddev)
{
    for (size_t i = 0; i < n; i++)
        x[i] = kda_f32_to_bf16((float)(mean + stddev * rng_normal(r)));
}

void test_batch_make(test_batch *b, test_rng *r, int32_t heads, const int64_t *lengths,
                     int64_t nseqs, int64_t first_slot, int64_t slot_step)
{
    memset(b, 0, sizeof *b);
    b->heads = heads;
    b->nseqs = nseqs;
    b->cu_seqlens = calloc((size_t)nseqs + 1, sizeof(int64_t));
    b->slots = calloc((size_t)nseqs + 1, sizeof(int64_t));
    for (int64_t i = 0; i < nseqs; i++) {
        b->cu_seqlens[i + 1] = b->cu_seqlens[i] + lengths[i];
        b->slots[i] = first_slot + i * slot_step;
    }
    const int64_t T = b->total_tokens = b->cu_seqlens[nseqs];
    const size_t tok = (size_t)(T * heads * KDA_HEAD_DIM) + 1;   /* +1: never malloc(0) */
    b->q = malloc(tok * 2);
    b->k = malloc(tok * 2);
    b->v = malloc(tok * 2);
    b->g = malloc(tok * 2);
    b->out = malloc(tok * 2);
    b->beta = malloc((size_t)(T * heads + 1) * 2);
    fill_normal_bf16(r, b->q, tok, 0, 1);
    fill_normal_bf16(r, b->k, tok, 0, 1);
    fill_normal_bf16(r, b->v, tok, 0, 1);
    fill_normal_bf16(r, b->g, tok, 0, 1);
    fill_normal_bf16(r, b->beta, (size_t)(T * heads + 1), 0, 1);
    memset(b->out, 0xff, tok * 2);       /* poison: NaN until written */
    b->A_log = malloc(sizeof(float) * (size_t)heads);
    b->dt_bias = malloc(sizeof(float) * (size_t)heads * KDA_HEAD_DIM);
    for (int32_t h = 0; h < heads; h++)
        b->A_log[h] = (float)rng_uniform(r);
    for (int64_t i = 0; i < (int64_t)heads * KDA_HEAD_DIM; i++)
        b->dt_bias[i] = (float)rng_uniform(r);
    b->layer = (kda_layer){b->A_log, b->dt_bias, -5.0f, 0.08838834764831845f};
    b->seqs = calloc((size_t)nseqs + 1, sizeof(kda_seq));
    kda_seqs_from_packed(b->seqs, nseqs, heads, b->cu_seqlens, T, b->slots, b->q, b->k, b->v,
                         b->g, b->beta, b->out, &b->layer, NULL);
}

void test_batch_free(test_batch *b)
{
    free(b->cu_seqlens);
    free(b->slots);
    free(b->q);
    free(b->k);
    free(b->v);
    free(b->g);
    free(b->beta);
    free(b->out);
    free(b->A_log);
    free(b->dt_bias);
    free(b->seqs);
    memset(b, 0, sizeof *b);
}

size_t test_pool_bytes(const kda_pool *p)
{
    return (size_t)p->slots * (size_t)kda_slot_elems(p->heads) * kda_dtype_size(p->dtype);
}

kda_pool test_pool_make(test_rng *r, int32_t heads, int64_t slots, kda_dtype dtype)
{
    kda_pool p = {NULL, dtype, heads, slots};
    size_t n = (size_t)slots * (size_t)kda_slot_elems(heads);
    p.state = malloc(test_pool_bytes(&p));
    for (size_t i = 0; i < n; i++) {
        float x = (float)(0.25 * rng_normal(r));
        if (dtype == KDA_DTYPE_F32)
            ((float *)p.state)[i] = x;
        else
            ((uint16_t *)p.state)[i] = kda_f32_to_bf16(x);
    }
    return p;
}

void test_pool_free(kda_pool *p)
{
    free(p->state);
    p->state = NULL;
}

kda_pool test_pool_clone(const kda_pool *p)
{
    kda_pool c = *p;
    c.state = malloc(test_pool_bytes(p));
    memcpy(c.state, p->state, test_pool_bytes(p));
    return c;
}

double test_pool_get(const kda_pool *p, int64_t slot, int64_t elem)
{
    size_t i = (size_t)(slot * kda_slot_elems(p->heads) + elem);
    return p->dtype == KDA_DTYPE_F32 ? ((const float *)p->state)[i]
                                     : kda_bf16_to_f32(((const uint16_t *)p->state)[i]);
}

void test_compare_oracle(const test_batch *b, const kda_pool *before, const kda_pool *after,
                         double *out_err, double *state_err)
{
    const int64_t slot_elems = kda_slot_elems(b->heads);
    const int64_t row = (int64_t)b->heads * KDA_HEAD_DIM;
    double *state = malloc(sizeof(double) * (size_t)slot_elems);
    double out_num = 0, out_den = 0, st_num = 0, st_den = 0;
    for (int64_t n = 0; n < b->nseqs; n++) {
        const kda_seq *s = &b->seqs[n];
        for (int64_t e = 0; e < slot_elems; e++)
            state[e] = (s->flags & KDA_SEQ_ZERO_STATE) ? 0.0 : test_pool_get(before, s->slot, e);
        double *out = malloc(sizeof(double) * (size_t)(s->len * row + 1));
        kda_ref_sequence(b->heads, &b->layer, s->q, s->k, s->v, s->g, s->beta, s->len, state, out);
        for (int64_t i = 0; i < s->len * row; i++) {
            double d = kda_bf16_to_f32(s->out[i]) - out[i];
            out_num += d * d;
            out_den += out[i] * out[i];
        }
        for (int64_t e = 0; e < slot_elems; e++) {
            double d = test_pool_get(after, s->slot, e) - state[e];
            st_num += d * d;
            st_den += state[e] * state[e];
        }
        free(out);
    }
    free(state);
    *out_err = out_den > 0 ? sqrt(out_num / out_den) : sqrt(out_num);
    *state_err = st_den > 0 ? sqrt(st_num / st_den) : sqrt(st_num);
}
