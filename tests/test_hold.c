/*
 * test_hold.c - holding the next batch while the device is busy: the policy
 * (daemon/hold.c) against the real scheduler and a made-up clock.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <string.h>

#include "hold.h"
#include "sched.h"

/* ---------------------------------------------------------------------- */
/* The policy                                                             */
/* ---------------------------------------------------------------------- */

#define US 1000ull /* nanoseconds */
#define T0 (1000 * 1000 * US)

typedef struct policy_fixture {
    kd_sched s;
    kd_sched_group group;
    kd_job job[32];
    uint32_t slot[32];
    int njobs;
    kd_hold h;
} policy_fixture;

static const kd_hold_policy on = {true, 50, 1000};
/* 1000 tokens, 16 sequences, 1000 bytes staged each way */
static const kd_sched_limits lim = {1000, 16, 1000, 1000};

static int policy_setup(void **state)
{
    static policy_fixture f;
    memset(&f, 0, sizeof(f));
    assert_int_equal(kd_sched_init(&f.s, 32), 0);
    *state = &f;
    return 0;
}

/* Runs everything queued. */
static void run_all(policy_fixture *f)
{
    kd_job *out[16];
    size_t n;
    while ((n = kd_sched_form(&f->s, &lim, out, 16)) > 0) {
        for (size_t i = 0; i < n; i++)
            kd_sched_done(&f->s, out[i]);
    }
}

static int policy_teardown(void **state)
{
    policy_fixture *f = *state;
    run_all(f);
    kd_sched_destroy(&f->s);
    return 0;
}

/* Queues a prefill-like job of `tokens` on a slot of its own. */
static kd_job *push(policy_fixture *f, uint32_t tokens, uint64_t stage_in)
{
    int n = f->njobs++;
    f->slot[n] = (uint32_t)n;
    f->job[n] = (kd_job){.group = &f->group, .slots = &f->slot[n], .nslots = 1,
                         .cost = {tokens, 1, stage_in, 0}};
    assert_int_equal(kd_sched_push(&f->s, &f->job[n]), 0);
    return &f->job[n];
}

static kd_hold_verdict next(policy_fixture *f, const kd_hold_policy *p, bool busy, uint64_t now)
{
    return kd_hold_next(&f->h, p, busy, &f->s.runnable, &lim, now);
}

static void test_idle_device_goes_at_once(void **state)
{
    policy_fixture *f = *state;
    push(f, 10, 0);
    assert_int_equal(next(f, &on, false, T0), KD_HOLD_GO);
    assert_false(f->h.holding);
}

/* Small jobs arriving while the device is busy wait, then form one batch. */
static void test_small_work_waits_for_the_device(void **state)
{
    policy_fixture *f = *state;
    kd_job *a = push(f, 10, 0);
    assert_int_equal(next(f, &on, true, T0), KD_HOLD_BEGIN);
    kd_job *b = push(f, 10, 0);
    assert_int_equal(next(f, &on, true, T0 + 100 * US), KD_HOLD_KEEP);
    kd_job *c = push(f, 10, 0);
    assert_int_equal(next(f, &on, true, T0 + 200 * US), KD_HOLD_KEEP);
    assert_int_equal(kd_hold_deadline(&f->h, &on), T0 + 1000 * US); /* from the first */
    assert_int_equal(next(f, &on, false, T0 + 300 * US), KD_HOLD_GO);
    assert_false(f->h.holding);
    kd_job *out[16];
    assert_int_equal(kd_sched_form(&f->s, &lim, out, 16), 3);
    assert_true(a->state == KD_JOB_RUNNING && b->state == KD_JOB_RUNNING &&
                c->state == KD_JOB_RUNNING);
    for (int i = 0; i < 3; i++)
        kd_sched_done(&f->s, out[i]);
}

/* Work filling hold_fill_percent of any batch limit goes while the device is busy. */
static void test_big_enough_goes(void **state)
{
    policy_fixture *f = *state;
    push(f, 400, 0);
    assert_int_equal(next(f, &on, true, T0), KD_HOLD_BEGIN);
    push(f, 100, 0); /* 500 of 1000 tokens */
    assert_int_equal(next(f, &on, true, T0 + US), KD_HOLD_GO);
    assert_false(f->h.holding);
    run_all(f);

    for (int i = 0; i < 7; i++)
        push(f, 1, 0);
    assert_int_equal(next(f, &on, true, T0), KD_HOLD_BEGIN);
    push(f, 1, 0); /* 8 of 16 sequences */
    assert_int_equal(next(f, &on, true, T0), KD_HOLD_GO);
    run_all(f);

    push(f, 1, 500); /* 500 of 1000 staging bytes */
    assert_int_equal(next(f, &on, true, T0), KD_HOLD_GO);
    run_all(f);

    push(f, 999, 0);
    const kd_hold_policy full = {true, 100, 1000};
    assert_int_equal(next(f, &full, true, T0), KD_HOLD_BEGIN); /* 100%: only a full batch goes */
    push(f, 1, 0);
    assert_int_equal(next(f, &full, true, T0), KD_HOLD_GO);
}

static void test_latency_bound(void **state)
{
    policy_fixture *f = *state;
    push(f, 10, 0);
    assert_int_equal(next(f, &on, true, T0), KD_HOLD_BEGIN);
    assert_int_equal(next(f, &on, true, T0 + 1000 * US - 1), KD_HOLD_KEEP);
    assert_int_equal(next(f, &on, true, T0 + 1000 * US), KD_HOLD_GO);
    kd_job *out[16];
    assert_int_equal(kd_sched_form(&f->s, &lim, out, 16), 1);
    kd_sched_done(&f->s, out[0]);
    /* the next hold has a deadline of its own */
    push(f, 10, 0);
    assert_int_equal(next(f, &on, true, T0 + 5000 * US), KD_HOLD_BEGIN);
    assert_int_equal(kd_hold_deadline(&f->h, &on), T0 + 6000 * US);
}

static void test_off_or_nothing_to_hold(void **state)
{
    policy_fixture *f = *state;
    const kd_hold_policy off = {false, 50, 1000};
    assert_int_equal(next(f, &on, true, T0), KD_HOLD_GO); /* nothing runnable */
    kd_job *a = push(f, 10, 0);
    assert_int_equal(next(f, &off, true, T0), KD_HOLD_GO);
    assert_int_equal(next(f, &on, true, T0), KD_HOLD_BEGIN);
    kd_sched_cancel(&f->s, a); /* its connection closed */
    assert_int_equal(next(f, &on, true, T0 + US), KD_HOLD_GO);
    assert_false(f->h.holding);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_idle_device_goes_at_once, policy_setup,
                                        policy_teardown),
        cmocka_unit_test_setup_teardown(test_small_work_waits_for_the_device, policy_setup,
                                        policy_teardown),
        cmocka_unit_test_setup_teardown(test_big_enough_goes, policy_setup, policy_teardown),
        cmocka_unit_test_setup_teardown(test_latency_bound, policy_setup, policy_teardown),
        cmocka_unit_test_setup_teardown(test_off_or_nothing_to_hold, policy_setup,
                                        policy_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
