/*
 * test_step.c - decode steps (kda.h, kda_step) on the CPU backend:
 *
 *   random steps       1..16 tokens per sequence, fp32 and bf16 pools, against
 *                      the float64 oracle; the kept per-token states too
 *   golden cuts        every golden case cut into 1-token and 4-token steps
 *                      equals the golden result and the prefill of the whole
 *   checks             bad steps are refused whole and write nothing
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
#include <time.h>

#include "bf16.h"
#include "golden.h"
#include "kda_cpu.h"
#include "kda_ref.h"
#include "testutil.h"

enum { D = KDA_HEAD_DIM };
static const double BOUND = 0.005;
static kda_cpu *cpu;
static uint64_t seed;

typedef struct rms {
    double num, den;
} rms;

static void rms_add(rms *r, double x, double ref)
{
    r->num += (x - ref) * (x - ref);
    r->den += ref * ref;
}

static double rms_rel(const rms *r) { return r->den > 0 ? sqrt(r->num / r->den) : sqrt(r->num); }

static double pool_value(const void *base, kda_dtype dtype, size_t i)
{
    return dtype == KDA_DTYPE_F32 ? ((const float *)base)[i] : kda_bf16_to_f32(((const uint16_t *)base)[i]);
}

/* A random step: a test_batch (packed tensors) and its kda_step. */
typedef struct step_case {
    test_batch b;
    kda_step_seq *seqs;
    kda_step step;
} step_case;

static void step_case_make(step_case *c, test_rng *r, int32_t heads, const int32_t *lens, int32_t n,
                           const int64_t *slots)
{
    int64_t *lengths = calloc((size_t)n, sizeof *lengths);
    for (int32_t i = 0; i < n; i++)
        lengths[i] = lens[i];
    test_batch_make(&c->b, r, heads, lengths, n, 0, 1);
    free(lengths);
    c->seqs = calloc((size_t)n, sizeof *c->seqs);
    int32_t tokens = 0;
    kda_error err;
    assert_int_equal(kda_step_seqs_fill(c->seqs, n, slots, lens, &tokens, &err), KDA_OK);
    assert_int_equal(tokens, c->b.total_tokens);
    c->step = (kda_step){.q = c->b.q, .k = c->b.k, .v = c->b.v, .g = c->b.g, .beta = c->b.beta,
                         .out = c->b.out, .layer = &c->b.layer, .seqs = c->seqs, .nseqs = n,
                         .tokens = tokens};
}

static void step_case_free(step_case *c)
{
    test_batch_free(&c->b);
    free(c->seqs);
    free(c->step.states);
}

/*
 * Runs c on pool and compares against the oracle run token by token from
 * `before`: outputs, final slots, and (when c keeps them) every token's state.
 */
static void run_and_check(step_case *c, kda_pool *pool, const char *what)
{
    const int32_t H = pool->heads;
    const int64_t slot_elems = kda_slot_elems(H), row = (int64_t)H * D;
    kda_pool before = test_pool_clone(pool);
    memset(c->b.out, 0xff, (size_t)(c->step.tokens * row) * 2);
    kda_error err = {0};
    if (kda_cpu_step(cpu, pool, &c->step, &err) != KDA_OK)
        fail_msg("%s: kda_cpu_step: %s", what, err.msg);

    rms out = {0}, fin = {0}, kept = {0};
    double *st = malloc(sizeof(double) * (size_t)slot_elems), *o = malloc(sizeof(double) * (size_t)row);
    for (int32_t n = 0; n < c->step.nseqs; n++) {
        const kda_step_seq *s = &c->seqs[n];
        for (int64_t e = 0; e < slot_elems; e++)
            st[e] = (s->flags & KDA_SEQ_ZERO_STATE) ? 0.0 : test_pool_get(&before, s->slot, e);
        for (int t = 0; t < s->len; t++) {
            const int64_t tok = s->start + t;
            kda_ref_sequence(H, &c->b.layer, c->b.q + tok * row, c->b.k + tok * row, c->b.v + tok * row,
                             c->b.g + tok * row, c->b.beta + tok * H, 1, st, o);
            for (int64_t i = 0; i < row; i++)
                rms_add(&out, kda_bf16_to_f32(c->b.out[tok * row + i]), o[i]);
            if (c->step.states)
                for (int64_t e = 0; e < slot_elems; e++)
                    rms_add(&kept, pool_value(c->step.states, pool->dtype, (size_t)(tok * slot_elems + e)), st[e]);
        }
        for (int64_t e = 0; e < slot_elems; e++)
            rms_add(&fin, test_pool_get(pool, s->slot, e), st[e]);
    }
    free(st);
    free(o);
    print_message("  %-44s out %.5f state %.2e kept %.2e\n", what, rms_rel(&out), rms_rel(&fin),
                  c->step.states ? rms_rel(&kept) : 0.0);
    if (!(rms_rel(&out) <= BOUND && rms_rel(&fin) <= BOUND && rms_rel(&kept) <= BOUND))
        fail_msg("%s: above %.3f (seed %llu)", what, BOUND, (unsigned long long)seed);

    /* slots the step does not name stay bit-identical */
    const size_t slot_bytes = (size_t)slot_elems * kda_dtype_size(pool->dtype);
    for (int64_t sl = 0; sl < pool->slots; sl++) {
        int named = 0;
        for (int32_t n = 0; n < c->step.nseqs; n++)
            named |= c->seqs[n].slot == sl;
        if (!named)
            assert_memory_equal((char *)pool->state + sl * slot_bytes, (char *)before.state + sl * slot_bytes,
                                slot_bytes);
    }
    test_pool_free(&before);
}

static void random_steps(void **unused)
{
    (void)unused;
    test_rng r;
    rng_seed(&r, seed);
    enum { N = 11 };
    const int32_t lens1[N] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    const int32_t lensm[N] = {1, 16, 4, 2, 7, 3, 15, 1, 8, 5, 16};
    const int64_t slots[N] = {12, 3, 0, 7, 9, 1, 14, 4, 2, 11, 6};
    for (int keep = 0; keep < 2; keep++)
        for (int dt = 0; dt < 2; dt++)
            for (int mixed = 0; mixed < 2; mixed++) {
                const kda_dtype dtype = dt ? KDA_DTYPE_BF16 : KDA_DTYPE_F32;
                step_case c;
                step_case_make(&c, &r, 3, mixed ? lensm : lens1, N, slots);
                if (keep)
                    c.step.states = malloc((size_t)(c.step.tokens * kda_slot_elems(3)) * kda_dtype_size(dtype));
                kda_pool pool = test_pool_make(&r, 3, 16, dtype);
                char what[96];
                snprintf(what, sizeof what, "%s steps, %s pool%s", mixed ? "1..16-token" : "1-token",
                         dt ? "bf16" : "fp32", keep ? ", states kept" : "");
                run_and_check(&c, &pool, what);
                test_pool_free(&pool);
                step_case_free(&c);
            }
}

static void zero_state_flag(void **unused)
{
    (void)unused;
    test_rng r;
    rng_seed(&r, seed + 1);
    const int32_t lens[3] = {2, 1, 5};
    const int64_t slots[3] = {0, 2, 1};
    step_case c;
    step_case_make(&c, &r, 2, lens, 3, slots);
    c.seqs[1].flags = KDA_SEQ_ZERO_STATE;
    kda_pool pool = test_pool_make(&r, 2, 4, KDA_DTYPE_F32);
    for (int64_t e = 0; e < kda_slot_elems(2); e++)   /* must never be read */
        ((float *)pool.state)[2 * kda_slot_elems(2) + e] = NAN;
    run_and_check(&c, &pool, "a zero-state sequence among others");
    test_pool_free(&pool);
    step_case_free(&c);
}

/* ---- golden cases cut into steps ------------------------------------------ */

/*
 * Runs golden case c as steps of at most `cut` tokens per sequence on a pool
 * of `dtype` (every sequence advances in each step until it ends), writing
 * the outputs to out and the final states (as fp32) to fin.  With ref_out,
 * also runs each step through the float64 oracle from the state the pool
 * held before it: ref_out gets the oracle's outputs, st_err the error of the
 * slots after each step against the oracle's.  (A bf16 pool rounds the state
 * at the end of every step, so over many steps its states drift from the
 * unrounded whole-sequence result; each step is held to the contract.)
 */
static void golden_steps(const golden_case *c, const kda_layer *layer, int cut, kda_dtype dtype, uint16_t *out,
                         float *fin, double *ref_out, rms *st_err)
{
    const int32_t H = c->heads, N = (int32_t)c->nseqs;
    const int64_t slot_elems = kda_slot_elems(H), row = (int64_t)H * D;
    kda_pool pool = {NULL, dtype, H, N};
    pool.state = malloc((size_t)(N * slot_elems) * kda_dtype_size(dtype));
    for (int64_t i = 0; i < N * slot_elems; i++) {
        const float x = c->initial_state ? c->initial_state[i] : NAN;   /* NaN: never read */
        if (dtype == KDA_DTYPE_F32)
            ((float *)pool.state)[i] = x;
        else
            ((uint16_t *)pool.state)[i] = kda_f32_to_bf16(x);
    }
    const size_t tok_bytes = (size_t)row * 2, most = (size_t)N * (size_t)cut;
    uint16_t *q = malloc(tok_bytes * most), *k = malloc(tok_bytes * most), *v = malloc(tok_bytes * most);
    uint16_t *g = malloc(tok_bytes * most), *o = malloc(tok_bytes * most), *beta = malloc((size_t)H * most * 2);
    kda_step_seq *seqs = calloc((size_t)N, sizeof *seqs);
    int64_t *src = calloc(most, sizeof *src);   /* packed token -> case token */
    int64_t *slots = calloc((size_t)N, sizeof *slots);
    int32_t *lens = calloc((size_t)N, sizeof *lens);
    double *ref_st = ref_out ? malloc(sizeof(double) * (size_t)(N * slot_elems)) : NULL;

    for (int64_t done = 0;; done += cut) {
        int32_t n = 0, total = 0;
        for (int32_t i = 0; i < N; i++) {
            const int64_t len = c->cu_seqlens[i + 1] - c->cu_seqlens[i];
            if (done >= len)
                continue;
            slots[n] = i;   /* sequence i lives in slot i */
            lens[n] = (int32_t)(len - done < cut ? len - done : cut);
            for (int32_t t = 0; t < lens[n]; t++)
                src[total + t] = c->cu_seqlens[i] + done + t;
            total += lens[n++];
        }
        if (n == 0)
            break;
        kda_error err = {0};
        assert_int_equal(kda_step_seqs_fill(seqs, n, slots, lens, &total, &err), KDA_OK);
        for (int32_t j = 0; j < n; j++)
            if (done == 0 && !c->initial_state)
                seqs[j].flags = KDA_SEQ_ZERO_STATE;
        for (int32_t t = 0; t < total; t++) {
            memcpy(q + t * row, c->q + src[t] * row, tok_bytes);
            memcpy(k + t * row, c->k + src[t] * row, tok_bytes);
            memcpy(v + t * row, c->v + src[t] * row, tok_bytes);
            memcpy(g + t * row, c->g + src[t] * row, tok_bytes);
            memcpy(beta + t * H, c->beta + src[t] * H, (size_t)H * 2);
        }
        if (ref_st)   /* the oracle of this step, from the state the pool holds now */
            for (int32_t j = 0; j < n; j++) {
                double *st = ref_st + slots[j] * slot_elems;
                const int64_t t0 = seqs[j].start;
                for (int64_t e = 0; e < slot_elems; e++)
                    st[e] = seqs[j].flags ? 0.0 : pool_value(pool.state, dtype, (size_t)(slots[j] * slot_elems + e));
                kda_ref_sequence(H, layer, q + t0 * row, k + t0 * row, v + t0 * row, g + t0 * row, beta + t0 * H,
                                 seqs[j].len, st, ref_out + src[t0] * row);
            }
        const kda_step step = {.q = q, .k = k, .v = v, .g = g, .beta = beta, .out = o, .layer = layer,
                               .seqs = seqs, .nseqs = n, .tokens = total};
        if (kda_cpu_step(cpu, &pool, &step, &err) != KDA_OK)
            fail_msg("%s: kda_cpu_step: %s", c->name, err.msg);
        for (int32_t t = 0; t < total; t++)
            memcpy(out + src[t] * row, o + t * row, tok_bytes);
        if (ref_st)
            for (int32_t j = 0; j < n; j++)
                for (int64_t e = 0; e < slot_elems; e++) {
                    const int64_t at = slots[j] * slot_elems + e;
                    rms_add(st_err, pool_value(pool.state, dtype, (size_t)at), ref_st[at]);
                }
    }
    for (int64_t i = 0; i < N * slot_elems; i++)
        fin[i] = (float)pool_value(pool.state, dtype, (size_t)i);
    free(q), free(k), free(v), free(g), free(o), free(beta);
    free(seqs), free(src), free(slots), free(lens), free(ref_st);
    free(pool.state);
}

/* The CPU prefill of the whole case (fp32 pool), for the comparison. */
static void golden_prefill(const golden_case *c, const kda_layer *layer, uint16_t *out, float *fin)
{
    const int64_t N = c->nseqs, slot_elems = kda_slot_elems(c->heads);
    kda_pool pool = {malloc(sizeof(float) * (size_t)(N * slot_elems)), KDA_DTYPE_F32, c->heads, N};
    int64_t *slots = calloc((size_t)N, sizeof *slots);
    kda_seq *seqs = calloc((size_t)N, sizeof *seqs);
    for (int64_t i = 0; i < N; i++)
        slots[i] = i;
    for (int64_t i = 0; i < N * slot_elems; i++)
        ((float *)pool.state)[i] = c->initial_state ? c->initial_state[i] : 0.0f;
    kda_error err = {0};
    assert_int_equal(kda_seqs_from_packed(seqs, N, c->heads, c->cu_seqlens, c->total_tokens, slots, c->q, c->k,
                                          c->v, c->g, c->beta, out, layer, &err),
                     KDA_OK);
    assert_int_equal(kda_cpu_prefill(cpu, &pool, seqs, N, &err), KDA_OK);
    memcpy(fin, pool.state, sizeof(float) * (size_t)(N * slot_elems));
    free(pool.state);
    free(slots);
    free(seqs);
}

static double rel_bf16_bf16(const uint16_t *x, const uint16_t *ref, size_t n)
{
    rms r = {0};
    for (size_t i = 0; i < n; i++)
        rms_add(&r, kda_bf16_to_f32(x[i]), kda_bf16_to_f32(ref[i]));
    return rms_rel(&r);
}

static void golden_cut(void **state)
{
    const char *path = *state;
    golden_case c;
    char msg[512];
    if (golden_load(path, &c, msg, sizeof msg) != 0)
        fail_msg("%s", msg);
    const kda_layer layer = {c.A_log, c.dt_bias, (float)c.lower_bound, (float)c.scale};
    const size_t out_n = (size_t)(c.total_tokens * c.heads * D), st_n = (size_t)(c.nseqs * kda_slot_elems(c.heads));
    uint16_t *out = malloc(out_n * 2), *pre_out = malloc(out_n * 2);
    float *fin = malloc(sizeof(float) * st_n), *pre_fin = malloc(sizeof(float) * st_n);
    double *ref_out = malloc(sizeof(double) * out_n);
    const double bo = c.fla_out_err > BOUND ? c.fla_out_err : BOUND;
    const double bs = c.fla_state_err > BOUND ? c.fla_state_err : BOUND;

    golden_prefill(&c, &layer, pre_out, pre_fin);
    int ok = 1;
    for (int cut = 1; cut <= 4; cut += 3) {
        /* fp32 pool: the golden results and the prefill of the whole */
        golden_steps(&c, &layer, cut, KDA_DTYPE_F32, out, fin, NULL, NULL);
        const double eo = rel_rms_bf16(out, c.expected_out, out_n), es = rel_rms_f32(fin, c.expected_state, st_n);
        const double po = rel_bf16_bf16(out, pre_out, out_n), ps = rel_rms_f32(fin, pre_fin, st_n);
        /* bf16 pool: each step against the oracle from the state before it */
        rms bo16 = {0}, bs16 = {0};
        golden_steps(&c, &layer, cut, KDA_DTYPE_BF16, out, fin, ref_out, &bs16);
        for (size_t i = 0; i < out_n; i++)
            rms_add(&bo16, kda_bf16_to_f32(out[i]), ref_out[i]);
        const int pass = eo <= bo && es <= bs && po <= BOUND && ps <= BOUND && rms_rel(&bo16) <= bo &&
                         rms_rel(&bs16) <= bs;
        print_message("  %-22s %d-token steps: fp32 pool out %.5f state %.1e (vs prefill %.1e / %.1e) | "
                      "bf16 pool, per step: out %.5f state %.5f %s\n",
                      c.name, cut, eo, es, po, ps, rms_rel(&bo16), rms_rel(&bs16), pass ? "" : "FAILED");
        ok &= pass;
    }
    free(out), free(pre_out), free(fin), free(pre_fin), free(ref_out);
    golden_free(&c);
    if (!ok)
        fail_msg("%s: steps above the contract (out <= %.4f, state <= %.4f)", path, bo, bs);
}

/* ---- checks ---------------------------------------------------------------- */

static void refused(kda_pool *pool, const kda_pool *before, const kda_step *step, const char *needle)
{
    kda_error err = {0};
    assert_int_equal(kda_cpu_step(cpu, pool, step, &err), KDA_EINVAL);
    if (!strstr(err.msg, needle))
        fail_msg("message \"%s\" does not say \"%s\"", err.msg, needle);
    assert_memory_equal(pool->state, before->state, test_pool_bytes(pool));
}

static void bad_steps_write_nothing(void **unused)
{
    (void)unused;
    test_rng r;
    rng_seed(&r, seed + 2);
    const int32_t lens[3] = {1, 4, 2};
    const int64_t slots[3] = {0, 1, 2};
    step_case c;
    step_case_make(&c, &r, 2, lens, 3, slots);
    kda_pool pool = test_pool_make(&r, 2, 3, KDA_DTYPE_F32), before = test_pool_clone(&pool);
    kda_step s = c.step;

    c.seqs[1].len = 0;
    refused(&pool, &before, &s, "outside [1, 16]");
    c.seqs[1].len = 17;
    refused(&pool, &before, &s, "outside [1, 16]");
    c.seqs[1].len = 4;
    c.seqs[2].start = 6;
    refused(&pool, &before, &s, "back to back");
    c.seqs[2].start = 5;
    c.seqs[2].slot = 0;
    refused(&pool, &before, &s, "slot 0 is named by seqs[0] and seqs[2]");
    c.seqs[2].slot = 3;
    refused(&pool, &before, &s, "outside the pool");
    c.seqs[2].slot = 2;
    c.seqs[0].flags = 0x8;
    refused(&pool, &before, &s, "unknown flags");
    c.seqs[0].flags = 0;
    s.tokens = 8;
    refused(&pool, &before, &s, "hold 7 tokens, not 8");
    s.tokens = 7;
    s.g = NULL;
    refused(&pool, &before, &s, "NULL");
    s.g = c.step.g;
    kda_layer bad = c.b.layer;
    bad.lower_bound = 0.5f;
    s.layer = &bad;
    refused(&pool, &before, &s, "lower_bound");
    s.layer = c.step.layer;

    kda_error err = {0};
    s.nseqs = 0;   /* an empty step is fine and does nothing */
    assert_int_equal(kda_cpu_step(cpu, &pool, &s, &err), KDA_OK);
    assert_memory_equal(pool.state, before.state, test_pool_bytes(&pool));
    s.nseqs = 3;
    assert_int_equal(kda_cpu_step(cpu, &pool, &s, &err), KDA_OK);

    kda_step_seq seqs[2];
    int32_t tokens;
    const int32_t bad_lens[2] = {3, 17};
    assert_int_equal(kda_step_seqs_fill(seqs, 2, slots, bad_lens, &tokens, &err), KDA_EINVAL);
    assert_non_null(strstr(err.msg, "seqs[1]: 17 tokens"));

    kda_seq batch[2] = {{.len = 1}, {.len = KDA_STEP_CHOICE_TOKENS}};
    assert_true(kda_batch_is_step(batch, 2));
    batch[1].len = KDA_STEP_CHOICE_TOKENS + 1;
    assert_false(kda_batch_is_step(batch, 2));
    batch[1].len = 0;
    assert_false(kda_batch_is_step(batch, 2));
    assert_false(kda_batch_is_step(batch, 0));

    test_pool_free(&pool);
    test_pool_free(&before);
    step_case_free(&c);
}

int main(void)
{
    const char *env = getenv("KDA_TEST_SEED");
    seed = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL);
    printf("test_step: seed %llu\n", (unsigned long long)seed);
    kda_error kerr;
    if (kda_cpu_create(0, &cpu, &kerr) != KDA_OK) {
        fprintf(stderr, "test_step: %s\n", kerr.msg);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(random_steps),
        cmocka_unit_test(zero_state_flag),
        cmocka_unit_test(bad_steps_write_nothing),
    };
    int failed = cmocka_run_group_tests_name("step", tests, NULL, NULL);

    char msg[512];
    char **paths = NULL;
    const int n = golden_list(golden_dir(), &paths, msg, sizeof msg);
    if (n <= 0) {
        fprintf(stderr, "test_step: %s\n", msg);
        return 1;
    }
    struct CMUnitTest *golden = calloc((size_t)n, sizeof *golden);
    for (int i = 0; i < n; i++) {
        const char *base = strrchr(paths[i], '/');
        golden[i] = (struct CMUnitTest){.name = base ? base + 1 : paths[i], .test_func = golden_cut,
                                        .initial_state = paths[i]};
    }
    failed += _cmocka_run_group_tests("golden_steps", golden, (size_t)n, NULL, NULL);
    free(golden);
    golden_list_free(paths, n);
    kda_cpu_destroy(cpu);
    return failed;
}
