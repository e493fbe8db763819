/*
 * test_pool.c - daemon/pool.c (handles and generations, ownership and
 * quotas, positions and status) and the slot operations of the cpu backend
 * that fork, snapshot and restore are made of (daemon/backend_cpu.c).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "bf16.h"
#include "pool.h"

#define OWNER_A 1
#define OWNER_B 2

static void expect_code(int rc, const kp_error *e, int code, const char *substr)
{
    assert_int_equal(rc, code);
    if (substr && !strstr(e->message, substr))
        fail_msg("\"%s\" not in \"%s\"", substr, e->message);
}

/* kd_pool_alloc for an owner that is its own uid, without a per-uid bound. */
static int alloc(kd_pool *p, uint64_t owner, uint32_t quota, uint32_t count, bool zero,
                 uint64_t *handles, kp_error *e)
{
    kp_limits lim = {.max_slots_per_client = quota};
    return kd_pool_alloc(p, owner, (uint32_t)owner, &lim, count, zero, handles, e);
}

static void test_handles_and_generations(void **unused)
{
    kd_pool p;
    kp_error e;
    uint64_t h[4];
    uint32_t index;
    assert_int_equal(kd_pool_init(&p, 4, UINT32_MAX), KP_OK);
    assert_int_equal(alloc(&p, OWNER_A, 8, 3, true, h, &e), KP_OK);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kp_slot_index(h[i]), i); /* handed out from index 0 up */
        assert_int_equal(kp_slot_generation(h[i]), UINT32_MAX);
        assert_int_equal(kd_pool_resolve(&p, h[i], OWNER_A, "slot", &index, &e), KP_OK);
        assert_int_equal(index, i);
        const kd_slot *s = kd_pool_slot(&p, index);
        assert_int_equal(s->state, KD_SLOT_READY);
        assert_true(s->zero);
        assert_int_equal(s->pos, 0);
    }
    assert_int_equal(kd_pool_used(&p), 3);

    expect_code(kd_pool_resolve(&p, kp_slot_handle(UINT32_MAX, 4), OWNER_A, "seqs[1].slot",
                                &index, &e),
                &e, KP_E_UNKNOWN_SLOT, "seqs[1].slot: slot index 4");
    expect_code(kd_pool_resolve(&p, kp_slot_handle(7, 1), OWNER_A, "slot", &index, &e), &e,
                KP_E_STALE_SLOT, "stale");
    expect_code(kd_pool_resolve(&p, 0, OWNER_A, "slot", &index, &e), &e, KP_E_STALE_SLOT, NULL);
    expect_code(kd_pool_resolve(&p, kp_slot_handle(UINT32_MAX, 3), OWNER_A, "slot", &index, &e),
                &e, KP_E_STALE_SLOT, NULL); /* free slot */
    expect_code(kd_pool_resolve(&p, h[0], OWNER_B, "src", &index, &e), &e,
                KP_E_PERMISSION_DENIED, "src: slot");

    /* freeing: the handle is stale at once, the slot returns on release,
     * and the generation moves on (skipping 0) */
    kd_pool_retire(&p, 1);
    expect_code(kd_pool_resolve(&p, h[1], OWNER_A, "slot", &index, &e), &e, KP_E_STALE_SLOT,
                NULL);
    assert_int_equal(kd_pool_owned(&p, OWNER_A), 2);
    assert_int_equal(p.nfree, 1); /* retiring, not free yet */
    kd_pool_release(&p, 1);
    assert_int_equal(p.nfree, 2);
    uint64_t again;
    assert_int_equal(alloc(&p, OWNER_B, 8, 1, false, &again, &e), KP_OK);
    assert_int_equal(kp_slot_index(again), 1);
    assert_int_equal(kp_slot_generation(again), 1);
    assert_int_equal(kd_pool_slot(&p, 1)->state, KD_SLOT_EMPTY);
    expect_code(kd_pool_resolve(&p, h[1], OWNER_B, "slot", &index, &e), &e, KP_E_STALE_SLOT,
                NULL);
    kd_pool_destroy(&p);
}

static void test_quotas_and_full_pool(void **unused)
{
    kd_pool p;
    kp_error e;
    uint64_t h[8];
    assert_int_equal(kd_pool_init(&p, 6, 5), KP_OK);
    assert_int_equal(alloc(&p, OWNER_A, 4, 3, true, h, &e), KP_OK);
    expect_code(alloc(&p, OWNER_A, 4, 2, true, h, &e), &e, KP_E_QUOTA_EXCEEDED,
                "max_slots_per_client 4 (3 held)");
    assert_int_equal(alloc(&p, OWNER_A, 4, 1, true, h, &e), KP_OK);
    /* all or nothing: 3 asked, 2 free */
    expect_code(alloc(&p, OWNER_B, 8, 3, true, h, &e), &e, KP_E_POOL_FULL,
                "3 slots asked, 2 of 6 free");
    assert_int_equal(kd_pool_owned(&p, OWNER_B), 0);
    assert_int_equal(p.nfree, 2);
    assert_false(kp_code_retryable(KP_E_QUOTA_EXCEEDED));
    assert_true(kp_code_retryable(KP_E_POOL_FULL));
    /* quota comes back at retire, before the slot is released */
    kd_pool_retire(&p, 0);
    assert_int_equal(kd_pool_owned(&p, OWNER_A), 3);
    assert_int_equal(alloc(&p, OWNER_A, 4, 1, true, h, &e), KP_OK);
    kd_pool_destroy(&p);
}

/* limits.max_slots_per_uid: a uid's owners (connections, or the uid itself
 * with slots_persist) share one bound, which other uids do not touch. */
static void test_uid_quota(void **unused)
{
    enum { UID_X = 1000, UID_Y = 1001 };
    kd_pool p;
    kp_error e;
    uint64_t h[12];
    kp_limits lim = {.max_slots_per_client = 4, .max_slots_per_uid = 5};
    assert_int_equal(kd_pool_init(&p, 12, 3), KP_OK);
    /* two connections of uid X: 3 + 2 slots, then nothing more for either */
    assert_int_equal(kd_pool_alloc(&p, 11, UID_X, &lim, 3, true, h, &e), KP_OK);
    assert_int_equal(kd_pool_alloc(&p, 12, UID_X, &lim, 2, true, h + 3, &e), KP_OK);
    expect_code(kd_pool_alloc(&p, 12, UID_X, &lim, 1, true, h, &e), &e, KP_E_QUOTA_EXCEEDED,
                "max_slots_per_uid 5 (uid 1000 holds 5)");
    expect_code(kd_pool_alloc(&p, 13, UID_X, &lim, 1, true, h, &e), &e, KP_E_QUOTA_EXCEEDED,
                "max_slots_per_uid 5");
    assert_int_equal(kd_pool_uid_holds(&p, UID_X), 5);
    assert_int_equal(kd_pool_quota_left(&p, 13, UID_X, &lim), 0);
    /* uid Y has its own bound */
    assert_int_equal(kd_pool_quota_left(&p, 14, UID_Y, &lim), 4);
    assert_int_equal(kd_pool_alloc(&p, 14, UID_Y, &lim, 4, true, h + 5, &e), KP_OK);
    assert_int_equal(kd_pool_uid_holds(&p, UID_Y), 4);
    /* freeing one of X's gives X one back */
    kd_pool_retire(&p, kp_slot_index(h[0]));
    assert_int_equal(kd_pool_uid_holds(&p, UID_X), 4);
    assert_int_equal(kd_pool_quota_left(&p, 13, UID_X, &lim), 1);
    assert_int_equal(kd_pool_alloc(&p, 13, UID_X, &lim, 1, true, h, &e), KP_OK);
    /* a full pool is POOL_FULL (retryable) before the uid's bound */
    kp_limits whole = {.max_slots_per_client = 16, .max_slots_per_uid = 12};
    uint64_t last[2];
    assert_int_equal(kd_pool_alloc(&p, 16, 1002, &whole, 2, true, last, &e), KP_OK);
    assert_int_equal(p.nfree, 0);
    expect_code(kd_pool_alloc(&p, 16, 1002, &whole, 11, true, h, &e), &e, KP_E_POOL_FULL,
                "11 slots asked, 0 of 12 free");
    for (int i = 0; i < 2; i++) {
        kd_pool_retire(&p, kp_slot_index(last[i]));
        kd_pool_release(&p, kp_slot_index(last[i]));
    }
    /* 0: no per-uid bound */
    lim.max_slots_per_uid = 0;
    assert_int_equal(kd_pool_alloc(&p, 15, UID_X, &lim, 2, true, h, &e), KP_OK);
    assert_int_equal(kd_pool_uid_holds(&p, UID_X), 7);
    kd_pool_destroy(&p);
}

/* Positions never wrap past 2^64 - 1. */
static void test_position_limit(void **unused)
{
    kd_pool p;
    kp_error e;
    uint64_t h, pos = 7;
    assert_int_equal(kd_pool_init(&p, 2, 1), KP_OK);
    assert_int_equal(alloc(&p, OWNER_A, 8, 1, true, &h, &e), KP_OK);
    kd_pool_set_ready(&p, 0, UINT64_MAX - 2, false);
    assert_int_equal(kd_pool_next_pos(&p, 0, false, 2, "seqs[0].slot", &pos, &e), KP_OK);
    assert_true(pos == UINT64_MAX);
    assert_int_equal(kd_pool_next_pos(&p, 0, false, 0, "seqs[0].slot", &pos, &e), KP_OK);
    assert_true(pos == UINT64_MAX - 2);
    pos = 7;
    expect_code(kd_pool_next_pos(&p, 0, false, 3, "seqs[0].slot", &pos, &e), &e,
                KP_E_LIMIT_EXCEEDED, "seqs[0].slot: slot 0x100000000 is at position "
                "18446744073709551613: 3 more tokens");
    assert_true(pos == 7);
    /* a fresh sequence starts from 0 */
    assert_int_equal(kd_pool_next_pos(&p, 0, true, 5, "slot", &pos, &e), KP_OK);
    assert_true(pos == 5);
    kd_pool_destroy(&p);
}

static void test_positions_and_status(void **unused)
{
    kd_pool p;
    kp_error e;
    uint64_t h[2];
    assert_int_equal(kd_pool_init(&p, 4, 9), KP_OK);
    assert_int_equal(alloc(&p, OWNER_A, 8, 1, false, h, &e), KP_OK);
    assert_int_equal(kd_pool_status(&p, 0), KP_SLOT_EMPTY);
    expect_code(kd_pool_check_ready(&p, 0, "seqs[0].slot", &e), &e, KP_E_STATE_LOST,
                "seqs[0].slot: slot 0x900000000 is empty");

    /* a prefill of 300 tokens, then one of 200 */
    kd_pool_set_ready(&p, 0, 300, false);
    assert_int_equal(kd_pool_check_ready(&p, 0, "slot", &e), KP_OK);
    assert_int_equal(kd_pool_slot(&p, 0)->pos, 300);
    kd_pool_set_ready(&p, 0, 500, false);
    assert_int_equal(kd_pool_slot(&p, 0)->pos, 500);

    /* fork: the destination takes the source's position and status */
    assert_int_equal(alloc(&p, OWNER_A, 8, 1, true, h + 1, &e), KP_OK);
    const kd_slot *src = kd_pool_slot(&p, 0);
    kd_pool_set_ready(&p, 1, src->pos, src->zero);
    assert_int_equal(kd_pool_slot(&p, 1)->pos, 500);
    assert_false(kd_pool_slot(&p, 1)->zero);

    /* a device failure: lost, counted, unreadable; a restore repairs it */
    kd_pool_set_lost(&p, 0);
    kd_pool_set_lost(&p, 0);
    assert_int_equal(p.nlost, 1);
    assert_int_equal(kd_pool_status(&p, 0), KP_SLOT_LOST);
    expect_code(kd_pool_check_ready(&p, 0, "src", &e), &e, KP_E_STATE_LOST, "lost");
    kd_pool_set_ready(&p, 0, 42, false); /* slot.write of a snapshot at position 42 */
    assert_int_equal(p.nlost, 0);
    assert_int_equal(kd_pool_slot(&p, 0)->pos, 42);

    /* a lost slot that is freed stays counted until it is released */
    kd_pool_set_lost(&p, 1);
    kd_pool_retire(&p, 1);
    assert_int_equal(p.nlost, 1);
    kd_pool_release(&p, 1);
    assert_int_equal(p.nlost, 0);
    kd_pool_destroy(&p);
}

/* ---------------------------------------------------------------------- */
/* Slot operations on the cpu backend                                     */
/* ---------------------------------------------------------------------- */

#define OP_HEADS 2
#define OP_ELEMS ((size_t)OP_HEADS * 128 * 128)

static int done_count;
static void on_done(void *ctx, kd_batch *b)
{
    done_count++;
}

static kd_backend *cpu_backend(uv_loop_t *loop, kda_dtype dtype)
{
    kd_backend_config bc = {.kind = KD_BACKEND_CPU, .cpu_threads = 2, .heads = OP_HEADS,
                            .slots = 4, .dtype = dtype};
    kd_backend *b;
    char err[256];
    if (kd_backend_create(loop, &bc, on_done, NULL, NULL, &b, err, sizeof(err)) != KP_OK)
        fail_msg("%s", err);
    assert_string_equal(b->info.name, "cpu");
    return b;
}

static void run(uv_loop_t *loop, kd_backend *b, kd_slot_op *ops, uint32_t n)
{
    kd_batch batch;
    memset(&batch, 0, sizeof(batch));
    batch.ops = ops;
    batch.nops = n;
    int before = done_count;
    assert_int_equal(kd_backend_submit(b, &batch, NULL), KP_OK);
    assert_int_equal(b->inflight, 1);
    assert_int_equal(b->on_device, 1); /* the worker is the cpu backend's device */
    while (done_count == before)
        uv_run(loop, UV_RUN_ONCE);
    assert_int_equal(batch.status, KD_BATCH_OK);
    assert_int_equal(b->inflight, 0);
    assert_int_equal(b->on_device, 0);
}

static void test_cpu_slot_operations(void **unused)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    kd_backend *b = cpu_backend(&loop, KDA_DTYPE_F32);
    float *in = malloc(OP_ELEMS * 4), *f = malloc(OP_ELEMS * 4);
    uint16_t *h = malloc(OP_ELEMS * 2);
    for (size_t i = 0; i < OP_ELEMS; i++)
        in[i] = (float)i / 7.0f - 100.0f;

    /* restore into 0, fork 0 -> 2, snapshot 2 as bf16 and as f32, clear 0 */
    kd_slot_op ops[] = {
        {.kind = KD_OP_WRITE, .slot = 0, .dtype = KDA_DTYPE_F32, .buf = {in, NULL}},
        {.kind = KD_OP_COPY, .slot = 2, .src = 0},
        {.kind = KD_OP_READ, .slot = 2, .dtype = KDA_DTYPE_BF16, .buf = {h, NULL}},
        {.kind = KD_OP_ZERO, .slot = 0},
    };
    run(&loop, b, ops, 4);
    for (size_t i = 0; i < OP_ELEMS; i++)
        assert_int_equal(h[i], kda_f32_to_bf16(in[i])); /* f32 -> bf16 rounds to nearest even */
    kd_slot_op read2[] = {{.kind = KD_OP_READ, .slot = 2, .dtype = KDA_DTYPE_F32, .buf = {f, NULL}}};
    run(&loop, b, read2, 1);
    assert_memory_equal(f, in, OP_ELEMS * 4);
    kd_slot_op read0[] = {{.kind = KD_OP_READ, .slot = 0, .dtype = KDA_DTYPE_F32, .buf = {f, NULL}}};
    run(&loop, b, read0, 1);
    for (size_t i = 0; i < OP_ELEMS; i++)
        assert_true(f[i] == 0.0f);
    kd_backend_destroy(b);

    /* a bf16 pool: an f32 restore rounds once, a bf16 snapshot is exact */
    b = cpu_backend(&loop, KDA_DTYPE_BF16);
    kd_slot_op ops16[] = {
        {.kind = KD_OP_WRITE, .slot = 1, .dtype = KDA_DTYPE_F32, .buf = {in, NULL}},
        {.kind = KD_OP_READ, .slot = 1, .dtype = KDA_DTYPE_F32, .buf = {f, NULL}},
    };
    run(&loop, b, ops16, 2);
    for (size_t i = 0; i < OP_ELEMS; i++)
        assert_true(f[i] == kda_bf16_to_f32(kda_f32_to_bf16(in[i])));
    kd_backend_destroy(b);

    assert_int_equal(uv_loop_close(&loop), 0);
    free(in);
    free(f);
    free(h);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_handles_and_generations),
        cmocka_unit_test(test_quotas_and_full_pool),
        cmocka_unit_test(test_uid_quota),
        cmocka_unit_test(test_position_limit),
        cmocka_unit_test(test_positions_and_status),
        cmocka_unit_test(test_cpu_slot_operations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
