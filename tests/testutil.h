/*
 * testutil.h - random KDA batches and oracle comparisons for the tests.
 *
 * Inputs are drawn as PERF-ANCHORS.md draws them: q, k, v, g, beta ~ N(0,1)
 * rounded to bf16, A_log ~ U(0,1), dt_bias ~ U(0,1), states 0.25 N(0,1).
 */
#ifndef KDA_TESTUTIL_H
#define KDA_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "kda.h"

typedef struct test_rng { uint64_t s; } test_rng;

void rng_seed(test_rng *r, uint64_t seed);
uint64_t rng_next(test_rng *r);
double rng_uniform(test_rng *r);   /* [0, 1) */
double rng_normal(test_rng *r);
void fill_normal_bf16(test_rng *r, uint16_t *x, size_t n, double mean, double stddev);

/* A packed random batch: tensors for total_tokens, one layer, and its packed descriptors. */
typedef struct test_batch {
    int32_t heads;
    int64_t nseqs, total_tokens;
    int64_t *cu_seqlens;      /* [N+1] */
    int64_t *slots;           /* [N] */
    uint16_t *q, *k, *v, *g, *beta, *out;
    float *A_log, *dt_bias;
    kda_layer layer;
    kda_seq *seqs;            /* [N], from kda_seqs_from_packed */
} test_batch;

/* lengths[nseqs]; slots[i] = first_slot + i * slot_step. */
void test_batch_make(test_batch *b, test_rng *r, int32_t heads, const int64_t *lengths,
                     int64_t nseqs, int64_t first_slot, int64_t slot_step);
void test_batch_free(test_batch *b);

/* A pool of `slots` slots filled with 0.25 N(0,1) (rounded to the dtype). */
kda_pool test_pool_make(test_rng *r, int32_t heads, int64_t slots, kda_dtype dtype);
void test_pool_free(kda_pool *p);
kda_pool test_pool_clone(const kda_pool *p);
size_t test_pool_bytes(const kda_pool *p);
double test_pool_get(const kda_pool *p, int64_t slot, int64_t elem);

/*
 * Runs the float64 oracle for every sequence of b against the initial states
 * in `before` (the pool before the backend ran) and returns the relative RMS
 * errors of b->out and of the slots in `after`, over the whole batch.
 */
void test_compare_oracle(const test_batch *b, const kda_pool *before, const kda_pool *after,
                         double *out_err, double *state_err);

#endif /* KDA_TESTUTIL_H */
