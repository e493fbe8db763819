/*
 * test_contract.c - the prefill contract (kda.h) on the CPU backend:
 * argument checks, edge cases and random batches against the float64 oracle.
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
#include "kda_cpu.h"
#include "testutil.h"

static kda_cpu *cpu;
static uint64_t seed;

static const double OUT_BOUND = 0.005, STATE_BOUND = 0.005;

/* Runs b on a fresh random pool of `slots` and checks against the oracle. */
static void run_and_check(test_batch *b, int64_t slots, kda_dtype dtype, const char *what)
{
    test_rng r;
    rng_seed(&r, seed ^ 0x5eed);
    kda_pool pool = test_pool_make(&r, b->heads, slots, dtype);
    kda_pool before = test_pool_clone(&pool);
    kda_error err = {0};
    int rc = kda_cpu_prefill(cpu, &pool, b->seqs, b->nseqs, &err);
    if (rc != KDA_OK)
        fail_msg("%s: %s", what, err.msg);
    double oe, se;
    test_compare_oracle(b, &before, &pool, &oe, &se);
    print_message("  %-40s out %.5f state %.5f\n", what, oe, se);
    if (!(oe <= OUT_BOUND && se <= STATE_BOUND))
        fail_msg("%s: out %.5f state %.5f above 0.005 (seed %llu)", what, oe, se,
                 (unsigned long long)seed);

    /* slots the batch does not name stay bit-identical */
    size_t slot_bytes = (size_t)kda_slot_elems(pool.heads) * kda_dtype_size(dtype);
    for (int64_t s = 0; s < slots; s++) {
        int named = 0;
        for (int64_t i = 0; i < b->nseqs; i++)
            named |= b->seqs[i].slot == s && (b->seqs[i].len > 0 || b->seqs[i].flags);
        if (!named)
            assert_memory_equal((char *)pool.state + s * slot_bytes,
                                (char *)before.state + s * slot_bytes, slot_bytes);
    }
    test_pool_free(&pool);
    test_pool_free(&before);
}

static void lengths_around_chunk_edges(void **unused)
{
    const int64_t lengths[] = {1, 15, 16, 17, 31, 32, 33, 0, 64, 100, 5};
    for (int dt = 0; dt < 2; dt++) {
        test_rng r;
        rng_seed(&r, seed + 1);
        test_batch b;
        test_batch_make(&b, &r, 3, lengths, 11, 12, -1);   /* slots 12, 11, ..., 2 */
        run_and_check(&b, 16, dt ? KDA_DTYPE_F32 : KDA_DTYPE_BF16,
                      dt ? "edges, fp32 pool" : "edges, bf16 pool");
        test_batch_free(&b);
    }
}

static void many_short_sequences(void **unused)
{
    enum { N = 300 };
    int64_t lengths[N];
    test_rng r;
    rng_seed(&r, seed + 2);
    for (int i = 0; i < N; i++)
        lengths[i] = (int64_t)(rng_next(&r) % 40);
    test_batch b;
    test_batch_make(&b, &r, 2, lengths, N, 0, 1);
    run_and_check(&b, N, KDA_DTYPE_F32, "300 short sequences");
    test_batch_free(&b);
}

static void zero_initial_state(void **unused)
{
    const int64_t lengths[] = {77, 0, 130};
    test_rng r;
    rng_seed(&r, seed + 3);
    test_batch b;
    test_batch_make(&b, &r, 4, lengths, 3, 0, 2);
    for (int i = 0; i < 3; i++)
        b.seqs[i].flags = KDA_SEQ_ZERO_STATE;
    run_and_check(&b, 6, KDA_DTYPE_F32, "zero initial state (incl. an empty seq)");

    /* the empty sequence with ZERO_STATE zeroes its slot */
    kda_pool pool = test_pool_make(&r, 4, 6, KDA_DTYPE_F32);
    assert_int_equal(kda_cpu_prefill(cpu, &pool, b.seqs, 3, NULL), KDA_OK);
    for (int64_t e = 0; e < kda_slot_elems(4); e++)
        assert_true(test_pool_get(&pool, 2, e) == 0.0);
    test_pool_free(&pool);
    test_batch_free(&b);
}

static void zero_length_leaves_state_unchanged(void **unused)
{
    const int64_t lengths[] = {0, 0};
    test_rng r;
    rng_seed(&r, seed + 4);
    test_batch b;
    test_batch_make(&b, &r, 2, lengths, 2, 1, 1);
    kda_pool pool = test_pool_make(&r, 2, 4, KDA_DTYPE_BF16);
    kda_pool before = test_pool_clone(&pool);
    assert_int_equal(kda_cpu_prefill(cpu, &pool, b.seqs, 2, NULL), KDA_OK);
    assert_memory_equal(pool.state, before.state, test_pool_bytes(&pool));
    test_pool_free(&pool);
    test_pool_free(&before);
    test_batch_free(&b);
}

/* One prefill of 1000 tokens equals 300 + 300 + 400 on the same slot (to rounding). */
static void chunked_continuation(void **unused)
{
    const int64_t whole[] = {1000};
    test_rng r;
    rng_seed(&r, seed + 5);
    test_batch b;
    test_batch_make(&b, &r, 2, whole, 1, 0, 1);
    kda_pool pool = test_pool_make(&r, 2, 1, KDA_DTYPE_F32);
    kda_pool split = test_pool_clone(&pool);
    assert_int_equal(kda_cpu_prefill(cpu, &pool, b.seqs, 1, NULL), KDA_OK);

    const int64_t parts[] = {300, 300, 400};
    const int64_t row = 2 * KDA_HEAD_DIM;
    uint16_t *out = malloc(1000 * row * 2);
    int64_t t0 = 0;
    for (int p = 0; p < 3; p++) {
        kda_seq s = b.seqs[0];
        s.q += t0 * row, s.k += t0 * row, s.v += t0 * row, s.g += t0 * row, s.beta += t0 * 2;
        s.out = out + t0 * row;
        s.len = parts[p];
        assert_int_equal(kda_cpu_prefill(cpu, &split, &s, 1, NULL), KDA_OK);
        t0 += parts[p];
    }
    double num = 0, den = 0;
    for (int64_t i = 0; i < 1000 * row; i++) {
        double a = kda_bf16_to_f32(out[i]), ref = kda_bf16_to_f32(b.out[i]);
        num += (a - ref) * (a - ref);
        den += ref * ref;
    }
    double out_diff = sqrt(num / den);
    num = den = 0;
    for (int64_t e = 0; e < kda_slot_elems(2); e++) {
        double a = test_pool_get(&split, 0, e), ref = test_pool_get(&pool, 0, e);
        num += (a - ref) * (a - ref);
        den += ref * ref;
    }
    print_message("  1000 vs 300+300+400: out diff %.2e, state diff %.2e\n", out_diff, sqrt(num / den));
    assert_true(out_diff < 2e-3);
    assert_true(sqrt(num / den) < 1e-4);
    free(out);
    test_pool_free(&pool);
    test_pool_free(&split);
    test_batch_free(&b);
}

/* Results do not depend on the number of threads: each item is computed alone. */
static void thread_count_is_invisible(void **unused)
{
    const int64_t lengths[] = {200, 33, 150, 7};
    test_rng r;
    rng_seed(&r, seed + 6);
    test_batch b;
    test_batch_make(&b, &r, 5, lengths, 4, 0, 1);
    kda_pool p1 = test_pool_make(&r, 5, 4, KDA_DTYPE_F32);
    kda_pool p3 = test_pool_clone(&p1);
    kda_cpu *one, *three;
    assert_int_equal(kda_cpu_create(1, &one, NULL), KDA_OK);
    assert_int_equal(kda_cpu_create(3, &three, NULL), KDA_OK);
    size_t out_bytes = (size_t)(b.total_tokens * 5 * KDA_HEAD_DIM) * 2;
    uint16_t *out1 = malloc(out_bytes);
    assert_int_equal(kda_cpu_prefill(one, &p1, b.seqs, 4, NULL), KDA_OK);
    memcpy(out1, b.out, out_bytes);
    assert_int_equal(kda_cpu_prefill(three, &p3, b.seqs, 4, NULL), KDA_OK);
    assert_memory_equal(out1, b.out, out_bytes);
    assert_memory_equal(p1.state, p3.state, test_pool_bytes(&p1));
    kda_cpu_destroy(one);
    kda_cpu_destroy(three);
    free(out1);
    test_pool_free(&p1);
    test_pool_free(&p3);
    test_batch_free(&b);
}

/* Each invalid argument is rejected with its message, and nothing is written. */
static void invalid_arguments_write_nothing(void **unused)
{
    const int64_t lengths[] = {20, 40};
    test_rng r;
    rng_seed(&r, seed + 7);
    test_batch b;
    test_batch_make(&b, &r, 2, lengths, 2, 0, 1);
    kda_pool pool = test_pool_make(&r, 2, 3, KDA_DTYPE_F32);
    kda_pool before = test_pool_clone(&pool);
    const size_t out_bytes = (size_t)(b.total_tokens * 2 * KDA_HEAD_DIM) * 2;
    memset(b.out, 0x7b, out_bytes);
    uint16_t *out_before = malloc(out_bytes);
    memcpy(out_before, b.out, out_bytes);

    struct {
        const char *what, *expect;   /* mutation i below, and the message it must produce */
    } cases[] = {
        {"lower_bound 0", "lower_bound"},
        {"lower_bound -5.5", "lower_bound"},
        {"NaN lower_bound", "lower_bound"},
        {"slot out of range", "outside the pool"},
        {"negative slot", "outside the pool"},
        {"duplicate slot", "named by"},
        {"negative length", "negative length"},
        {"NULL tensor", "NULL"},
        {"unknown flag", "flags"},
        {"bad heads", "heads"},
        {"infinite scale", "scale"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kda_seq seqs[2] = {b.seqs[0], b.seqs[1]};
        kda_layer layer = b.layer;
        kda_pool p = pool;
        seqs[0].layer = seqs[1].layer = &layer;
        switch (i) {
        case 0: layer.lower_bound = 0.0f; break;
        case 1: layer.lower_bound = -5.5f; break;
        case 2: layer.lower_bound = NAN; break;
        case 3: seqs[1].slot = 3; break;
        case 4: seqs[0].slot = -1; break;
        case 5: seqs[1].slot = seqs[0].slot; break;
        case 6: seqs[1].len = -4; break;
        case 7: seqs[1].v = NULL; break;
        case 8: seqs[0].flags = 0x80; break;
        case 9: p.heads = 0; break;
        case 10: layer.scale = INFINITY; break;
        }
        kda_error err = {0};
        int rc = kda_cpu_prefill(cpu, &p, seqs, 2, &err);
        if (rc != KDA_EINVAL || !strstr(err.msg, cases[i].expect))
            fail_msg("%s: rc %d, message '%s' (wanted '%s')", cases[i].what, rc, err.msg,
                     cases[i].expect);
        assert_memory_equal(pool.state, before.state, test_pool_bytes(&pool));
        assert_memory_equal(b.out, out_before, out_bytes);
    }
    free(out_before);
    test_pool_free(&pool);
    test_pool_free(&before);
    test_batch_free(&b);
}

static void packed_offsets_are_checked(void **unused)
{
    kda_seq seqs[3];
    int64_t slots[3] = {0, 1, 2};
    uint16_t dummy[8] = {0};
    kda_layer layer = {0};
    kda_error err;
    const int64_t not_monotonic[] = {0, 10, 5, 20};
    const int64_t bad_first[] = {1, 10, 15, 20};
    const int64_t bad_last[] = {0, 10, 15, 19};
    assert_int_equal(kda_seqs_from_packed(seqs, 3, 1, not_monotonic, 20, slots, dummy, dummy, dummy,
                                          dummy, dummy, dummy, &layer, &err), KDA_EINVAL);
    assert_non_null(strstr(err.msg, "not monotonic"));
    assert_int_equal(kda_seqs_from_packed(seqs, 3, 1, bad_first, 20, slots, dummy, dummy, dummy,
                                          dummy, dummy, dummy, &layer, &err), KDA_EINVAL);
    assert_non_null(strstr(err.msg, "cu_seqlens[0]"));
    assert_int_equal(kda_seqs_from_packed(seqs, 3, 1, bad_last, 20, slots, dummy, dummy, dummy,
                                          dummy, dummy, dummy, &layer, &err), KDA_EINVAL);
    assert_non_null(strstr(err.msg, "cu_seqlens[3]"));
}

static void duplicate_slots_in_a_large_batch(void **unused)
{
    enum { N = 100 };
    kda_seq seqs[N];
    memset(seqs, 0, sizeof seqs);
    for (int i = 0; i < N; i++)
        seqs[i].slot = i;
    seqs[77].slot = 13;
    char byte;
    kda_pool pool = {&byte, KDA_DTYPE_F32, 1, N};
    kda_error err;
    assert_int_equal(kda_batch_check(&pool, seqs, N, &err), KDA_EINVAL);
    assert_non_null(strstr(err.msg, "slot 13 is named twice"));
    seqs[77].slot = 77;
    assert_int_equal(kda_batch_check(&pool, seqs, N, &err), KDA_OK);
}

int main(void)
{
    const char *env = getenv("KDA_TEST_SEED");
    seed = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL);
    printf("test_contract: seed %llu (set KDA_TEST_SEED to repeat)\n", (unsigned long long)seed);
    kda_error err;
    if (kda_cpu_create(0, &cpu, &err) != KDA_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(lengths_around_chunk_edges),
        cmocka_unit_test(many_short_sequences),
        cmocka_unit_test(zero_initial_state),
        cmocka_unit_test(zero_length_leaves_state_unchanged),
        cmocka_unit_test(chunked_continuation),
        cmocka_unit_test(thread_count_is_invisible),
        cmocka_unit_test(invalid_arguments_write_nothing),
        cmocka_unit_test(packed_offsets_are_checked),
        cmocka_unit_test(duplicate_slots_in_a_large_batch),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    kda_cpu_destroy(cpu);
    return failed;
}
