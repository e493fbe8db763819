/*
 * test_golden.c - every golden case through the float64 oracle and the CPU
 * backend (fp32 and bf16 pools).
 *
 * Contract (docs/kda.md): the oracle must match expected_* to
 * 1e-6 relative; a backend's output and final-state relative RMS errors must
 * each be at most max(0.005, the fla error recorded in the case).  Each case
 * prints its errors next to fla's and FlashKDA's.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "golden.h"
#include "kda_cpu.h"
#include "kda_ref.h"

static kda_cpu *cpu;

static double bound(double fla_err) { return fla_err > 0.005 ? fla_err : 0.005; }

/* Float64 oracle of a whole case from the given fp32 initial states (NULL = zeros). */
static void oracle_case(const golden_case *c, const kda_layer *layer, const float *init,
                        double *out, double *state)
{
    const int64_t slot_elems = kda_slot_elems(c->heads), row = (int64_t)c->heads * KDA_HEAD_DIM;
    for (int64_t n = 0; n < c->nseqs; n++) {
        int64_t t0 = c->cu_seqlens[n], len = c->cu_seqlens[n + 1] - t0;
        double *s = state + n * slot_elems;
        for (int64_t e = 0; e < slot_elems; e++)
            s[e] = init ? init[n * slot_elems + e] : 0.0;
        kda_ref_sequence(c->heads, layer, c->q + t0 * row, c->k + t0 * row, c->v + t0 * row,
                         c->g + t0 * row, c->beta + t0 * c->heads, len, s, out + t0 * row);
    }
}

/* Runs the CPU backend on the case with a pool of the given dtype; returns the final states as fp32. */
static void cpu_case(const golden_case *c, const kda_layer *layer, kda_dtype dtype, uint16_t *out,
                     float *final_state)
{
    const int64_t slot_elems = kda_slot_elems(c->heads), N = c->nseqs;
    kda_pool pool = {NULL, dtype, c->heads, N};
    pool.state = malloc((size_t)(N * slot_elems) * kda_dtype_size(dtype));
    int64_t *slots = calloc((size_t)N, sizeof(int64_t));
    kda_seq *seqs = calloc((size_t)N, sizeof *seqs);
    for (int64_t n = 0; n < N; n++)
        slots[n] = N - 1 - n;                        /* slot order differs from sequence order */
    for (int64_t n = 0; n < N; n++)
        for (int64_t e = 0; e < slot_elems; e++) {
            float x = c->initial_state ? c->initial_state[n * slot_elems + e] : NAN;
            size_t i = (size_t)(slots[n] * slot_elems + e);
            if (dtype == KDA_DTYPE_F32)
                ((float *)pool.state)[i] = x;
            else
                ((uint16_t *)pool.state)[i] = kda_f32_to_bf16(x);
        }
    kda_error err = {0};
    assert_int_equal(kda_seqs_from_packed(seqs, N, c->heads, c->cu_seqlens, c->total_tokens, slots,
                                          c->q, c->k, c->v, c->g, c->beta, out, layer, &err),
                     KDA_OK);
    if (!c->initial_state)                           /* the pool holds NaN: it must not be read */
        for (int64_t n = 0; n < N; n++)
            seqs[n].flags = KDA_SEQ_ZERO_STATE;
    memset(out, 0xff, (size_t)(c->total_tokens * c->heads * KDA_HEAD_DIM) * 2);   /* NaN poison */
    int rc = kda_cpu_prefill(cpu, &pool, seqs, N, &err);
    if (rc != KDA_OK)
        fail_msg("%s: kda_cpu_prefill failed: %s", c->name, err.msg);
    for (int64_t n = 0; n < N; n++)
        for (int64_t e = 0; e < slot_elems; e++) {
            size_t i = (size_t)(slots[n] * slot_elems + e);
            final_state[n * slot_elems + e] = dtype == KDA_DTYPE_F32
                                                  ? ((float *)pool.state)[i]
                                                  : kda_bf16_to_f32(((uint16_t *)pool.state)[i]);
        }
    free(seqs);
    free(slots);
    free(pool.state);
}

static double rel_rms_f32_f64(const float *x, const double *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = x[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return sqrt(num / den);
}

static double rel_rms_bf16_f64(const uint16_t *x, const double *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = kda_bf16_to_f32(x[i]) - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return sqrt(num / den);
}

static void golden_one(void **state)
{
    const char *path = *state;
    golden_case c;
    char err[512];
    if (golden_load(path, &c, err, sizeof err) != 0)
        fail_msg("%s", err);

    kda_layer layer = {c.A_log, c.dt_bias, (float)c.lower_bound, (float)c.scale};
    const size_t out_n = (size_t)(c.total_tokens * c.heads * KDA_HEAD_DIM);
    const size_t st_n = (size_t)(c.nseqs * kda_slot_elems(c.heads));
    double *ref_out = malloc(sizeof(double) * out_n), *ref_st = malloc(sizeof(double) * st_n);
    uint16_t *out = malloc(2 * out_n);
    float *fin = malloc(sizeof(float) * st_n);

    /* 1. the oracle reproduces the stored float64 results */
    oracle_case(&c, &layer, c.initial_state, ref_out, ref_st);
    double oracle_out = rel_rms_f64(ref_out, c.expected_out, out_n);
    double oracle_st = rel_rms_f64(ref_st, c.expected_state, st_n);

    /* 2. the CPU backend, fp32 pool, against the stored expected values */
    cpu_case(&c, &layer, KDA_DTYPE_F32, out, fin);
    double f32_out = rel_rms_bf16(out, c.expected_out, out_n);
    double f32_st = rel_rms_f32(fin, c.expected_state, st_n);

    /* 3. bf16 pool: the initial state is rounded to bf16 on the way in, so the
     *    reference is the oracle run from the rounded state */
    float *rounded = NULL;
    if (c.initial_state) {
        rounded = malloc(sizeof(float) * st_n);
        for (size_t i = 0; i < st_n; i++)
            rounded[i] = kda_bf16_to_f32(kda_f32_to_bf16(c.initial_state[i]));
    }
    oracle_case(&c, &layer, rounded, ref_out, ref_st);
    cpu_case(&c, &layer, KDA_DTYPE_BF16, out, fin);
    double b16_out = rel_rms_bf16_f64(out, ref_out, out_n);
    double b16_st = rel_rms_f32_f64(fin, ref_st, st_n);

    print_message("%-22s oracle %.1e/%.1e | cpu fp32 pool out %.5f state %.1e | bf16 pool out %.5f"
                  " state %.5f | fla %.5f/%.5f flashkda %.5f/%.5f\n",
                  c.name, oracle_out, oracle_st, f32_out, f32_st, b16_out, b16_st, c.fla_out_err,
                  c.fla_state_err, c.flashkda_out_err, c.flashkda_state_err);

    const double bo = bound(c.fla_out_err), bs = bound(c.fla_state_err);
    int ok = oracle_out <= 1e-6 && oracle_st <= 1e-6 && f32_out <= bo && f32_st <= bs &&
             b16_out <= bo && b16_st <= bs;
    free(rounded);
    free(ref_out);
    free(ref_st);
    free(out);
    free(fin);
    golden_free(&c);
    if (!ok)
        fail_msg("%s: errors above the contract (oracle <= 1e-6; backend out <= %.4f, state <= %.4f)",
                 path, bo, bs);
}

int main(void)
{
    char err[512];
    char **paths = NULL;
    int n = golden_list(golden_dir(), &paths, err, sizeof err);
    if (n <= 0) {
        fprintf(stderr, "test_golden: FAILED: %s\n", err);
        return 1;
    }
    kda_error kerr;
    if (kda_cpu_create(0, &cpu, &kerr) != KDA_OK) {
        fprintf(stderr, "test_golden: %s\n", kerr.msg);
        return 1;
    }
    struct CMUnitTest *tests = calloc((size_t)n, sizeof *tests);
    for (int i = 0; i < n; i++) {
        const char *base = strrchr(paths[i], '/');
        tests[i] = (struct CMUnitTest){.name = base ? base + 1 : paths[i],
                                       .test_func = golden_one,
                                       .initial_state = paths[i]};
    }
    int failed = _cmocka_run_group_tests("golden_cpu", tests, (size_t)n, NULL, NULL);
    free(tests);
    golden_list_free(paths, n);
    kda_cpu_destroy(cpu);
    return failed;
}
