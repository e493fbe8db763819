/*
 * test_sched.c - daemon/scheduler.c: batch formation, per-slot arrival order,
 * fairness across connections, batch limits, host jobs and cancellation,
 * the runnable totals, gated jobs and the list of those heading their FIFOs.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <string.h>

#include "scheduler.h"

#define NSLOTS 64
#define MAXJOBS 64

typedef struct fixture {
    kd_sched s;
    kd_sched_group group[4];
    kd_job job[MAXJOBS];
    uint32_t slots[MAXJOBS][2];
    int njobs;
} fixture;

static const kd_sched_limits roomy = {1u << 20, 1024, UINT64_MAX, UINT64_MAX};

static int setup(void **state)
{
    static fixture f;
    memset(&f, 0, sizeof(f));
    assert_int_equal(kd_sched_init(&f.s, NSLOTS), 0);
    *state = &f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    assert_int_equal(f->s.queued, 0);
    assert_int_equal(f->s.running, 0);
    const kd_cost_sum *r = &f->s.runnable;
    assert_int_equal(r->tokens + r->seqs + r->stage_in + r->stage_out, 0);
    kd_sched_destroy(&f->s);
    return 0;
}

/* Queues a job of group g on one or two slots (b < 0: one), staging stage_in bytes. */
static kd_job *push_staged(fixture *f, int g, int a, int b, uint32_t tokens, uint64_t stage_in,
                           bool host)
{
    int n = f->njobs++;
    kd_job *j = &f->job[n];
    f->slots[n][0] = (uint32_t)a;
    f->slots[n][1] = (uint32_t)b;
    *j = (kd_job){.group = &f->group[g], .slots = f->slots[n], .nslots = b < 0 ? 1 : 2,
                  .cost = {tokens, 1, stage_in, 0}, .host = host};
    assert_int_equal(kd_sched_push(&f->s, j), 0);
    return j;
}

static kd_job *push(fixture *f, int g, int a, int b, uint32_t tokens, bool host)
{
    return push_staged(f, g, a, b, tokens, 0, host);
}

/* Forms a batch and checks it holds exactly `want` (in any order). */
static size_t form_expect(fixture *f, const kd_sched_limits *lim, kd_job *const *want, size_t n)
{
    kd_job *out[MAXJOBS];
    size_t got = kd_sched_form(&f->s, lim, out, MAXJOBS);
    if (got != n)
        fail_msg("batch of %zu jobs, expected %zu", got, n);
    for (size_t i = 0; i < n; i++) {
        bool found = false;
        for (size_t k = 0; k < got && !found; k++)
            found = out[k] == want[i];
        if (!found)
            fail_msg("job %td is not in the batch", want[i] - f->job);
        assert_int_equal(want[i]->state, KD_JOB_RUNNING);
    }
    return got;
}

static void done_all(fixture *f, kd_job *const *jobs, size_t n)
{
    for (size_t i = 0; i < n; i++)
        kd_sched_done(&f->s, jobs[i]);
}

static void test_same_slot_runs_in_arrival_order(void **state)
{
    fixture *f = *state;
    kd_job *a = push(f, 0, 3, -1, 10, false);
    kd_job *b = push(f, 0, 3, -1, 10, false);
    kd_job *c = push(f, 1, 4, -1, 10, false);
    kd_job *c2 = push(f, 1, 3, -1, 10, false); /* another connection, same slot: after b */
    assert_int_equal(kd_sched_slot_jobs(&f->s, 3), 3);
    kd_job *first[] = {a, c};
    form_expect(f, &roomy, first, 2);
    assert_int_equal(b->state, KD_JOB_QUEUED);
    assert_int_equal(kd_sched_form(&f->s, &roomy, (kd_job *[MAXJOBS]){0}, MAXJOBS), 0);
    done_all(f, first, 2);
    kd_job *second[] = {b};
    form_expect(f, &roomy, second, 1);
    kd_sched_done(&f->s, b);
    kd_job *third[] = {c2};
    form_expect(f, &roomy, third, 1);
    kd_sched_done(&f->s, c2);
    assert_int_equal(kd_sched_slot_jobs(&f->s, 3), 0);
}

static void test_multi_slot_job_waits_for_every_slot(void **state)
{
    fixture *f = *state;
    kd_job *a = push(f, 0, 1, -1, 1, false);
    kd_job *fork = push(f, 0, 1, 2, 1, false); /* heads slot 2, not slot 1 */
    kd_job *c = push(f, 1, 2, -1, 1, false);
    kd_job *d = push(f, 1, 5, -1, 1, false);
    kd_job *b1[] = {a, d};
    form_expect(f, &roomy, b1, 2);
    assert_int_equal(fork->blocked, 1);
    done_all(f, b1, 2);
    kd_job *b2[] = {fork};
    form_expect(f, &roomy, b2, 1);
    kd_sched_done(&f->s, fork);
    kd_job *b3[] = {c};
    form_expect(f, &roomy, b3, 1);
    kd_sched_done(&f->s, c);
}

static void test_batch_limits(void **state)
{
    fixture *f = *state;
    kd_job *j[3];
    for (int i = 0; i < 3; i++)
        j[i] = push(f, 0, 10 + i, -1, 300, false);
    kd_sched_limits tokens = {700, 1024, UINT64_MAX, UINT64_MAX};
    kd_job *b1[] = {j[0], j[1]};
    form_expect(f, &tokens, b1, 2);
    done_all(f, b1, 2);
    kd_job *b2[] = {j[2]};
    form_expect(f, &tokens, b2, 1);
    kd_sched_done(&f->s, j[2]);

    /* sequences and staging bytes bound a batch the same way */
    kd_job *s3[3];
    for (int i = 0; i < 3; i++)
        s3[i] = push_staged(f, 0, 20 + i, -1, 1, 100, false);
    kd_sched_limits seqs = {1u << 20, 2, UINT64_MAX, UINT64_MAX};
    kd_job *two[] = {s3[0], s3[1]};
    form_expect(f, &seqs, two, 2);
    done_all(f, two, 2);
    kd_job *more = push_staged(f, 0, 30, -1, 1, 100, false);
    kd_sched_limits stage = {1u << 20, 1024, 150, UINT64_MAX};
    form_expect(f, &stage, &s3[2], 1);
    kd_sched_done(&f->s, s3[2]);
    form_expect(f, &stage, &more, 1);
    kd_sched_done(&f->s, more);

    /* a job larger than the limits (they were lowered) still runs, alone */
    kd_job *big = push(f, 0, 40, -1, 1000, false);
    kd_job *small = push(f, 1, 41, -1, 1, false);
    kd_sched_limits low = {500, 1024, UINT64_MAX, UINT64_MAX};
    kd_job *alone[] = {big};
    form_expect(f, &low, alone, 1);
    kd_sched_done(&f->s, big);
    form_expect(f, &low, &small, 1);
    kd_sched_done(&f->s, small);
}

static void test_fairness_across_connections(void **state)
{
    fixture *f = *state;
    for (int i = 0; i < 20; i++)
        push(f, 0, i, -1, 1, false); /* one connection floods */
    kd_job *late = push(f, 1, 30, -1, 1, false);
    /* 4 per batch: the late connection's single job is in the first one */
    kd_sched_limits four = {1u << 20, 4, UINT64_MAX, UINT64_MAX};
    kd_job *out[MAXJOBS];
    size_t n = kd_sched_form(&f->s, &four, out, MAXJOBS);
    assert_int_equal(n, 4);
    bool seen = false;
    for (size_t i = 0; i < n; i++)
        seen |= out[i] == late;
    assert_true(seen);
    done_all(f, out, n);
    while ((n = kd_sched_form(&f->s, &four, out, MAXJOBS)) > 0)
        done_all(f, out, n);

    /* three busy connections, one job per batch: they take turns */
    kd_job *q[3][4];
    for (int g = 0; g < 3; g++) {
        for (int i = 0; i < 4; i++)
            q[g][i] = push(f, g, 10 * g + i + 1, -1, 1, false);
    }
    kd_sched_limits one = {1u << 20, 1, UINT64_MAX, UINT64_MAX};
    for (int round = 0; round < 4; round++) {
        for (int g = 0; g < 3; g++) {
            assert_int_equal(kd_sched_form(&f->s, &one, out, MAXJOBS), 1);
            assert_ptr_equal(out[0], q[g][round]);
            kd_sched_done(&f->s, out[0]);
        }
    }
}

/* A connection whose oldest job does not fit sits the batch out: its later
 * jobs never overtake it. */
static void test_no_overtaking_within_a_connection(void **state)
{
    fixture *f = *state;
    kd_job *b300 = push(f, 1, 1, -1, 300, false); /* group 1 joins the ring first */
    kd_job *a400 = push(f, 0, 2, -1, 400, false);
    kd_job *a10 = push(f, 0, 3, -1, 10, false);
    kd_sched_limits lim = {500, 1024, UINT64_MAX, UINT64_MAX};
    kd_job *b1[] = {b300};
    form_expect(f, &lim, b1, 1);
    kd_sched_done(&f->s, b300);
    kd_job *b2[] = {a400, a10};
    form_expect(f, &lim, b2, 2);
    done_all(f, b2, 2);
}

static void test_host_jobs_and_cancel(void **state)
{
    fixture *f = *state;
    kd_job *prefill = push(f, 0, 5, -1, 10, false);
    kd_job *free5 = push(f, 0, 5, -1, 0, true);
    kd_job *reset6 = push(f, 0, 6, -1, 0, true);
    /* the reset heads its slot: runnable at once; the free waits */
    assert_ptr_equal(kd_sched_next_host(&f->s), reset6);
    assert_null(kd_sched_next_host(&f->s));
    kd_sched_done(&f->s, reset6);
    kd_job *b[] = {prefill};
    form_expect(f, &roomy, b, 1);
    assert_null(kd_sched_next_host(&f->s));
    kd_sched_done(&f->s, prefill);
    assert_ptr_equal(kd_sched_next_host(&f->s), free5);
    kd_sched_done(&f->s, free5);

    /* cancelling: a blocked job in the middle, then a runnable one */
    kd_job *x = push(f, 0, 7, -1, 1, false);
    kd_job *y = push(f, 0, 7, -1, 1, false);
    kd_job *z = push(f, 0, 7, -1, 1, false);
    assert_int_equal(f->s.queued, 3);
    kd_sched_cancel(&f->s, y);
    assert_int_equal(y->state, KD_JOB_IDLE);
    kd_sched_cancel(&f->s, x); /* it headed slot 7: z takes over */
    assert_int_equal(f->s.queued, 1);
    kd_job *bz[] = {z};
    form_expect(f, &roomy, bz, 1);
    kd_sched_done(&f->s, z);
    assert_int_equal(kd_sched_slot_jobs(&f->s, 7), 0);
}

/* kd_sched.runnable sums the runnable device jobs: blocked jobs, host jobs
 * and jobs handed out are not in it. */
static void test_runnable_totals(void **state)
{
    fixture *f = *state;
    const kd_cost_sum *r = &f->s.runnable;
    kd_job *a = push_staged(f, 0, 1, -1, 100, 7, false);
    kd_job *b = push(f, 1, 2, -1, 20, false);
    kd_job *behind_a = push(f, 1, 1, -1, 1000, false); /* blocked behind a */
    kd_job *reset = push(f, 0, 3, -1, 0, true);
    assert_int_equal(r->tokens, 120);
    assert_int_equal(r->seqs, 2);
    assert_int_equal(r->stage_in, 7);
    assert_ptr_equal(kd_sched_next_host(&f->s), reset);
    kd_sched_done(&f->s, reset);

    kd_sched_limits small = {100, 1024, UINT64_MAX, UINT64_MAX};
    kd_job *first[] = {a};
    form_expect(f, &small, first, 1); /* b does not fit: it stays runnable */
    assert_int_equal(r->tokens, 20);
    assert_int_equal(r->seqs, 1);
    assert_int_equal(r->stage_in, 0);
    kd_sched_done(&f->s, a); /* unblocks behind_a */
    assert_int_equal(r->tokens, 1020);
    assert_int_equal(r->seqs, 2);
    kd_sched_cancel(&f->s, b);
    assert_int_equal(r->tokens, 1000);
    kd_job *last[] = {behind_a};
    form_expect(f, &roomy, last, 1);
    assert_int_equal(r->tokens + r->seqs, 0);
    kd_sched_done(&f->s, behind_a);
}

/* A gated job (a prefill waiting for its ready word) holds its place in its
 * slots' FIFOs without running: others' jobs and its own connection's jobs
 * on other slots form batches, jobs behind it on its slot wait; ungated it
 * runs; cancelled (a timeout) it lets the next one go. */
static void test_gated_jobs(void **state)
{
    fixture *f = *state;
    kd_job *g = &f->job[f->njobs++];
    static uint32_t gslot = 1;
    *g = (kd_job){.group = &f->group[0], .slots = &gslot, .nslots = 1, .cost = {10, 1, 0, 0},
                  .gated = true};
    assert_int_equal(kd_sched_push(&f->s, g), 0);
    kd_job *behind = push(f, 0, 1, -1, 10, false); /* same slot */
    kd_job *other = push(f, 1, 2, -1, 10, false);
    kd_job *own = push(f, 0, 3, -1, 10, false);
    assert_int_equal(f->s.runnable.seqs, 2);
    kd_job *want[] = {other, own};
    form_expect(f, &roomy, want, 2);
    kd_sched_done(&f->s, other);
    kd_sched_done(&f->s, own);
    assert_int_equal(kd_sched_form(&f->s, &roomy, (kd_job *[MAXJOBS]){0}, MAXJOBS), 0);

    kd_sched_ungate(&f->s, g);
    kd_sched_ungate(&f->s, g); /* twice: no effect */
    kd_job *first[] = {g};
    form_expect(f, &roomy, first, 1);
    kd_sched_done(&f->s, g);
    kd_job *next[] = {behind};
    form_expect(f, &roomy, next, 1);
    kd_sched_done(&f->s, behind);

    /* Cancelled while gated at the head: the job behind it runs. */
    *g = (kd_job){.group = &f->group[0], .slots = &gslot, .nslots = 1, .cost = {10, 1, 0, 0},
                  .gated = true};
    assert_int_equal(kd_sched_push(&f->s, g), 0);
    kd_job *after = push(f, 1, 1, -1, 10, false);
    assert_int_equal(f->s.runnable.seqs, 0);
    kd_sched_cancel(&f->s, g);
    kd_job *last[] = {after};
    form_expect(f, &roomy, last, 1);
    kd_sched_done(&f->s, after);
}

/* The gated jobs that head their FIFOs, oldest first, are listed for a launch
 * ahead of their gates: one behind a running job on its slot joins the list
 * when that job is done; ungating, passing or cancelling takes it off; started
 * ahead of its gate it runs, and holds back the jobs behind it on its slot
 * until it is done. */
static void test_gated_heads(void **state)
{
    fixture *f = *state;
    static uint32_t s1 = 1, s2 = 2, s3 = 3;
    kd_job *running = push(f, 1, 1, -1, 10, false);
    kd_job *first[] = {running};
    form_expect(f, &roomy, first, 1);
    kd_job *g1 = &f->job[f->njobs++], *g2 = &f->job[f->njobs++], *g3 = &f->job[f->njobs++];
    *g1 = (kd_job){.group = &f->group[0], .slots = &s1, .nslots = 1, .cost = {10, 1, 0, 0},
                   .gated = true};
    *g2 = (kd_job){.group = &f->group[0], .slots = &s2, .nslots = 1, .cost = {10, 1, 0, 0},
                   .gated = true};
    *g3 = (kd_job){.group = &f->group[2], .slots = &s3, .nslots = 1, .cost = {10, 1, 0, 0},
                   .gated = true};
    assert_int_equal(kd_sched_push(&f->s, g1), 0); /* behind `running` on slot 1 */
    assert_int_equal(kd_sched_push(&f->s, g2), 0);
    assert_int_equal(kd_sched_push(&f->s, g3), 0);
    kd_job *behind = push(f, 0, 2, -1, 10, false); /* behind g2 on slot 2 */
    assert_ptr_equal(kd_sched_gated_head(&f->s), g2);
    kd_sched_done(&f->s, running);
    assert_ptr_equal(kd_sched_gated_head(&f->s), g1); /* older than g2 */
    kd_sched_pass_gated(&f->s, g1);                   /* it waits on the host */
    assert_ptr_equal(kd_sched_gated_head(&f->s), g2);
    kd_sched_start_gated(&f->s, g2);
    assert_int_equal(g2->state, KD_JOB_RUNNING);
    assert_ptr_equal(kd_sched_gated_head(&f->s), g3);
    assert_int_equal(kd_sched_form(&f->s, &roomy, (kd_job *[MAXJOBS]){0}, MAXJOBS), 0);
    kd_sched_ungate(&f->s, g3);
    assert_null(kd_sched_gated_head(&f->s));
    kd_job *ungated[] = {g3};
    form_expect(f, &roomy, ungated, 1);
    kd_sched_done(&f->s, g3);
    kd_sched_done(&f->s, g2);
    kd_job *next[] = {behind};
    form_expect(f, &roomy, next, 1);
    kd_sched_done(&f->s, behind);
    kd_sched_ungate(&f->s, g1); /* passed, still gated: its gate lifts as before */
    kd_job *last[] = {g1};
    form_expect(f, &roomy, last, 1);
    kd_sched_done(&f->s, g1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_same_slot_runs_in_arrival_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_multi_slot_job_waits_for_every_slot, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_batch_limits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fairness_across_connections, setup, teardown),
        cmocka_unit_test_setup_teardown(test_no_overtaking_within_a_connection, setup, teardown),
        cmocka_unit_test_setup_teardown(test_host_jobs_and_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_runnable_totals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gated_jobs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gated_heads, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
