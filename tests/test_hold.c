/*
 * test_hold.c - holding the next batch while the device is busy: the policy
 * (daemon/hold.c) against the real scheduler and a made-up clock; then the
 * engine in-process (daemon.c): a kdad daemon object whose backend is the
 * cpu one with its device replaced by a two-deep fake that the test
 * finishes by hand, fed prefill requests over a socketpair.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon.h"
#include "hold.h"
#include "scheduler.h"
#include "loop_io.h"

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

static const kd_hold_policy on = {true, 50, 1000, 0, 85};
/* the same, gathering for 150 us up to 85% of the SMs */
static const kd_hold_policy gather = {true, 50, 1000, 150, 85};
#define HEADS_P 2 /* chains per sequence in the policy tests */
#define WAVE 8    /* chains the made-up device runs at once */
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
    kd_hold_view v = {busy, &f->s.runnable, &lim, HEADS_P, 0, 0, false, now};
    return kd_hold_next(&f->h, p, &v);
}

/* The same on a device of WAVE chains at once; awaited: a connection is. */
static kd_hold_verdict next_waves(policy_fixture *f, const kd_hold_policy *p, bool busy,
                                  bool awaited, uint64_t now)
{
    kd_hold_view v = {busy, &f->s.runnable, &lim, HEADS_P, WAVE, 0, awaited, now};
    return kd_hold_next(&f->h, p, &v);
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
    const kd_hold_policy full = {true, 100, 1000, 0, 85};
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
    const kd_hold_policy off = {false, 50, 1000, 0, 85};
    assert_int_equal(next(f, &on, true, T0), KD_HOLD_GO); /* nothing runnable */
    kd_job *a = push(f, 10, 0);
    assert_int_equal(next(f, &off, true, T0), KD_HOLD_GO);
    assert_int_equal(next(f, &on, true, T0), KD_HOLD_BEGIN);
    kd_sched_cancel(&f->s, a); /* its connection closed */
    assert_int_equal(next(f, &on, true, T0 + US), KD_HOLD_GO);
    assert_false(f->h.holding);
}

/* Chains over the rounds they take, in percent of the SMs. */
static void test_wave_percent(void **state)
{
    (void)state;
    assert_int_equal(kd_wave_percent(288, 132, 66), 72);  /* 3 requests x 96 heads: 3 rounds */
    assert_int_equal(kd_wave_percent(384, 132, 66), 96);  /* 4 requests: the same 3 rounds */
    assert_int_equal(kd_wave_percent(768, 132, 66), 96);
    assert_int_equal(kd_wave_percent(96, 132, 66), 72);   /* more than pair: one CTA each */
    assert_int_equal(kd_wave_percent(64, 132, 66), 96);   /* paired: two SMs each */
    assert_int_equal(kd_wave_percent(132, 132, 0), 100);
    assert_int_equal(kd_wave_percent(0, 132, 66), 100);
    assert_int_equal(kd_wave_percent(5, 0, 0), 100);      /* no waves */
}

/* On an idle device, a batch that fills its last wave poorly waits for awaited work. */
static void test_gather_fills_the_wave(void **state)
{
    policy_fixture *f = *state;
    push(f, 10, 0); /* 2 of 8 chains */
    assert_int_equal(next_waves(f, &gather, false, true, T0), KD_HOLD_GATHER_BEGIN);
    assert_true(f->h.holding && f->h.gathering);
    assert_int_equal(kd_hold_deadline(&f->h, &gather), T0 + 150 * US);
    push(f, 10, 0);
    push(f, 10, 0); /* 6 of 8: 75% */
    assert_int_equal(next_waves(f, &gather, false, true, T0 + 10 * US), KD_HOLD_KEEP);
    push(f, 10, 0); /* 8 of 8 */
    assert_int_equal(next_waves(f, &gather, false, true, T0 + 20 * US), KD_HOLD_GO);
    assert_false(f->h.holding || f->h.gathering);
    run_all(f);

    /* nobody awaited, gathering off, or a device without waves: at once */
    push(f, 10, 0);
    assert_int_equal(next_waves(f, &gather, false, false, T0), KD_HOLD_GO);
    assert_int_equal(next_waves(f, &on, false, true, T0), KD_HOLD_GO);
    assert_int_equal(next(f, &gather, false, T0), KD_HOLD_GO);
    /* gathered gather_us at most */
    assert_int_equal(next_waves(f, &gather, false, true, T0), KD_HOLD_GATHER_BEGIN);
    assert_int_equal(next_waves(f, &gather, false, true, T0 + 150 * US - 1), KD_HOLD_KEEP);
    assert_int_equal(next_waves(f, &gather, false, true, T0 + 150 * US), KD_HOLD_GO);
}

/* A hold on a busy device becomes a gathering, with its own deadline, when the device finishes. */
static void test_hold_then_gather(void **state)
{
    policy_fixture *f = *state;
    push(f, 10, 0);
    assert_int_equal(next_waves(f, &gather, true, true, T0), KD_HOLD_BEGIN);
    assert_int_equal(next_waves(f, &gather, true, true, T0 + 500 * US), KD_HOLD_KEEP);
    assert_int_equal(next_waves(f, &gather, false, true, T0 + 600 * US), KD_HOLD_GATHER_BEGIN);
    assert_int_equal(kd_hold_deadline(&f->h, &gather), T0 + 750 * US);
    assert_int_equal(next_waves(f, &gather, false, true, T0 + 750 * US), KD_HOLD_GO);
}

/* ---------------------------------------------------------------------- */
/* The engine, with a fake device                                         */
/* ---------------------------------------------------------------------- */

#define HEADS 2
#define NSLOTS 12      /* the pool */
#define CLIENT_SLOTS 8 /* the fixture client's; a second one may take the rest */
#define SMALL 8    /* tokens: a small request */
#define BIG 128    /* tokens: 50% of max_batch_tokens */
#define MAX_BATCHES 8

static const char yaml[] = "heads: 2\nslots: 12\ncpu_threads: 1\n"
                           "limits:\n  max_batch_tokens: 256\n"
                           "batching:\n  hold_max_us: 1000000\n";

typedef struct engine_fixture {
    uv_loop_t loop;
    kd_daemon d;
    kd_backend_ops ops;             /* the cpu backend's, submit replaced */
    kd_batch *batch[MAX_BATCHES];   /* submitted to the fake device, in order */
    uint64_t submitted_ns[MAX_BATCHES];
    bool completed[MAX_BATCHES];
    uint32_t nbatches;
    loop_client c;                  /* the client's end */
    uint64_t slot[CLIENT_SLOTS];
    loop_client b;                  /* a second client, for gathering (open_b) */
    uint64_t bslot[NSLOTS - CLIENT_SLOTS];
    bool b_open;
    uint8_t zeros[BIG * HEADS * 128 * 2]; /* every input tensor */
} engine_fixture;

static engine_fixture *current;

/* The fake device: it starts every batch at once and finishes when told. */
static int fake_submit(kd_backend *b, kd_batch *batch, kp_error *err)
{
    engine_fixture *f = current;
    assert_true(f->nbatches < MAX_BATCHES);
    f->submitted_ns[f->nbatches] = uv_hrtime();
    f->batch[f->nbatches++] = batch;
    kd_backend_launched(b, batch);
    return KP_OK;
}

static void send_frame_on(engine_fixture *f, loop_client *c)
{
    loop_send_frame(&f->loop, c->fd, &c->w);
}

static void send_frame(engine_fixture *f)
{
    send_frame_on(f, &f->c);
}

/* Turns the loop until the daemon has read and admitted what was sent. */
static void settle(engine_fixture *f)
{
    for (int i = 0; i < 100; i++)
        uv_run(&f->loop, UV_RUN_NOWAIT);
}

/* Runs the loop until a response arrives on c; checks it is a success and returns its id. */
static uint32_t recv_ok_on(engine_fixture *f, loop_client *c)
{
    assert_true(loop_recv_msg(&f->loop, c->fd, &c->reader, &c->msg, &c->body));
    assert_int_equal(c->msg.kind, KP_MSG_RESPONSE);
    if (c->msg.error)
        fail_msg("request %u failed", c->msg.id);
    return c->msg.id;
}

static uint32_t recv_ok(engine_fixture *f)
{
    return recv_ok_on(f, &f->c);
}

/* Expects the responses to ids[0..n), in any order. */
static void expect_answers(engine_fixture *f, const uint32_t *ids, int n)
{
    uint32_t seen = 0;
    for (int k = 0; k < n; k++) {
        uint32_t id = recv_ok(f);
        int i = 0;
        while (i < n && ids[i] != id)
            i++;
        assert_true(i < n && !(seen & (1u << i)));
        seen |= 1u << i;
    }
}

/* A prefill of len tokens on c's slot `slot`. */
static void send_prefill_on(engine_fixture *f, loop_client *c, uint64_t slot, uint32_t id,
                            uint32_t len)
{
    uint64_t tb = kp_token_tensor_bytes(len, HEADS);
    kp_prefill_seq q;
    memset(&q, 0, sizeof(q));
    q.slot = slot;
    q.len = len;
    q.q = q.k = q.v = q.g = kp_ref_inline(f->zeros, tb);
    q.beta = kp_ref_inline(f->zeros, kp_beta_bytes(len, HEADS));
    kp_prefill_params p = {.layer = "l", .seqs = &q, .nseqs = 1};
    assert_int_equal(kp_prefill_params_encode(&c->w, id, &p, NULL), KP_OK);
    send_frame_on(f, c);
}

static void send_prefill(engine_fixture *f, uint32_t id, int slot, uint32_t len)
{
    send_prefill_on(f, &f->c, f->slot[slot], id, len);
}

/* Connects c: hello, and n slots of its own into slots[]. */
static void open_client(engine_fixture *f, loop_client *c, uint64_t *slots, uint32_t n)
{
    int fd;
    assert_non_null(loop_daemon_connect(&f->d, getuid(), &fd));
    loop_client_init(c, fd);
    kp_hello_params hp = {{1}, 1, NULL};
    assert_int_equal(kp_hello_params_encode(&c->w, 1, &hp, NULL), KP_OK);
    send_frame_on(f, c);
    assert_int_equal(recv_ok_on(f, c), 1);
    kp_slot_alloc_params ap = {n, true};
    assert_int_equal(kp_slot_alloc_params_encode(&c->w, 3, &ap, NULL), KP_OK);
    send_frame_on(f, c);
    assert_int_equal(recv_ok_on(f, c), 3);
    kp_slot_list sl;
    assert_int_equal(kp_slot_alloc_result_decode(&c->msg, &sl, NULL), KP_OK);
    memcpy(slots, sl.slots, n * sizeof(*slots));
}

/* The fake device finished batch i; its outputs are still on their way back. */
static void device_done(engine_fixture *f, uint32_t i)
{
    kd_backend_device_done(f->d.backend, f->batch[i]);
}

/* Batch i is done: its requests are answered. */
static void complete(engine_fixture *f, uint32_t i)
{
    assert_false(f->completed[i]);
    f->completed[i] = true;
    kd_backend_complete(f->d.backend, f->batch[i]);
}

static int engine_setup(void **state)
{
    engine_fixture *f = calloc(1, sizeof(*f));
    current = f;
    loop_daemon_start(&f->d, &f->loop, yaml);
    f->ops = *f->d.backend->ops;
    f->ops.submit = fake_submit;
    f->d.backend->ops = &f->ops;
    f->d.backend->info.depth = 2; /* as cuda: the next batch may go while one runs */
    open_client(f, &f->c, f->slot, CLIENT_SLOTS);
    float a_log[HEADS] = {0}, dt_bias[HEADS * 128] = {0};
    kp_layer_register_params lp = {"l", kp_ref_inline(a_log, sizeof(a_log)),
                                   kp_ref_inline(dt_bias, sizeof(dt_bias)), -5.0f,
                                   KP_DEFAULT_SCALE};
    assert_int_equal(kp_layer_register_params_encode(&f->c.w, 2, &lp, NULL), KP_OK);
    send_frame(f);
    assert_int_equal(recv_ok(f), 2);
    *state = f;
    return 0;
}

static int engine_teardown(void **state)
{
    engine_fixture *f = *state;
    for (uint32_t i = 0; i < f->nbatches; i++) {
        if (!f->completed[i])
            complete(f, i);
    }
    loop_client_close(&f->c);
    if (f->b_open)
        loop_client_close(&f->b);
    loop_daemon_stop(&f->d, &f->loop);
    free(f);
    current = NULL;
    return 0;
}

/* One batch runs; three small requests arrive meanwhile: they are held, and
 * go together, in one batch, when it completes. */
static void test_held_until_the_running_batch_completes(void **state)
{
    engine_fixture *f = *state;
    send_prefill(f, 10, 0, SMALL);
    settle(f);
    assert_int_equal(f->nbatches, 1); /* the device was idle: at once */
    for (uint32_t id = 11; id <= 13; id++)
        send_prefill(f, id, (int)id - 10, SMALL);
    settle(f);
    assert_int_equal(f->nbatches, 1);
    assert_int_equal(f->d.sched.queued, 3);
    assert_int_equal(f->d.stats.batches_held, 1);

    complete(f, 0);
    assert_int_equal(f->nbatches, 2);
    assert_int_equal(f->batch[1]->nseqs, 3);
    assert_int_equal(recv_ok(f), 10);
    complete(f, 1);
    expect_answers(f, (const uint32_t[]){11, 12, 13}, 3);
    assert_int_equal(f->d.stats.batches, 2);
}

/* The device finishing is what counts: a held batch goes while the one
 * before it still copies its outputs back. */
static void test_held_until_the_device_finishes(void **state)
{
    engine_fixture *f = *state;
    send_prefill(f, 10, 0, SMALL);
    settle(f);
    send_prefill(f, 11, 1, SMALL);
    send_prefill(f, 12, 2, SMALL);
    settle(f);
    assert_int_equal(f->nbatches, 1);
    device_done(f, 0);
    assert_int_equal(f->nbatches, 2);
    assert_int_equal(f->batch[1]->nseqs, 2);
    assert_int_equal(f->d.backend->inflight, 2);
    complete(f, 0);
    complete(f, 1);
    expect_answers(f, (const uint32_t[]){10, 11, 12}, 3);
}

/* A batch that fills hold_fill_percent (50%) of max_batch_tokens is not held,
 * and takes what was held with it. */
static void test_big_batch_not_held(void **state)
{
    engine_fixture *f = *state;
    send_prefill(f, 10, 0, SMALL);
    settle(f);
    send_prefill(f, 11, 1, BIG);
    settle(f);
    assert_int_equal(f->nbatches, 2); /* at once, while batch 0 runs */
    assert_int_equal(f->d.stats.batches_held, 0);
    complete(f, 0);
    complete(f, 1);
    expect_answers(f, (const uint32_t[]){10, 11}, 2);

    send_prefill(f, 12, 2, SMALL);
    settle(f);
    assert_int_equal(f->nbatches, 3); /* the device is idle */
    send_prefill(f, 13, 3, SMALL);
    settle(f);
    assert_int_equal(f->nbatches, 3);
    assert_int_equal(f->d.stats.batches_held, 1);
    send_prefill(f, 14, 4, BIG - SMALL);
    settle(f);
    assert_int_equal(f->nbatches, 4);
    assert_int_equal(f->batch[3]->nseqs, 2);
    complete(f, 2);
    complete(f, 3);
    expect_answers(f, (const uint32_t[]){12, 13, 14}, 3);
}

/* A batch is held hold_max_us at most, even if the device never finishes. */
static void test_hold_max_us(void **state)
{
    engine_fixture *f = *state;
    f->d.cfg.hold_max_us = 20000;
    send_prefill(f, 10, 0, SMALL);
    settle(f);
    uint64_t sent = uv_hrtime();
    send_prefill(f, 11, 1, SMALL);
    while (f->nbatches < 2) {
        uv_run(&f->loop, UV_RUN_ONCE);
        assert_true(uv_hrtime() - sent < 10ull * 1000 * 1000 * 1000);
    }
    uint64_t held = f->submitted_ns[1] - sent;
    assert_true(held >= 20000 * US);
    assert_false(f->completed[0]);
    assert_int_equal(f->d.stats.batches_held, 1);
    complete(f, 0);
    complete(f, 1);
    expect_answers(f, (const uint32_t[]){10, 11}, 2);
}

/* batching.hold_while_busy: false launches the next batch behind the running one. */
static void test_hold_off(void **state)
{
    engine_fixture *f = *state;
    f->d.cfg.hold_while_busy = false;
    send_prefill(f, 10, 0, SMALL);
    settle(f);
    send_prefill(f, 11, 1, SMALL);
    settle(f);
    assert_int_equal(f->nbatches, 2);
    assert_int_equal(f->d.stats.batches_held, 0);
    complete(f, 0);
    complete(f, 1);
    expect_answers(f, (const uint32_t[]){10, 11}, 2);
}

/* Makes the fake device one of waves: 4 chains at once (two 1-sequence
 * requests of HEADS heads), gathering for `gather_us`. */
static void give_waves(engine_fixture *f, uint32_t gather_us)
{
    f->d.backend->info.wave_chains = 2 * HEADS;
    f->d.backend->info.paired_chains = 0;
    f->d.cfg.gather_us = gather_us;
}

/* Connects the second client, B, with the slots A did not take. */
static void open_b(engine_fixture *f)
{
    open_client(f, &f->b, f->bslot, NSLOTS - CLIENT_SLOTS);
    f->b_open = true;
}

/* Two closed-loop clients.  A's request runs (the device has finished it,
 * the answer is not out yet), so A is awaited: B's request alone (half a
 * wave) waits for A's next, and both go in one batch. */
static void test_gathered_until_the_wave_fills(void **state)
{
    engine_fixture *f = *state;
    give_waves(f, 1000000);
    open_b(f);

    send_prefill(f, 10, 0, SMALL);
    settle(f);
    assert_int_equal(f->nbatches, 1); /* nobody is awaited: at once */
    device_done(f, 0);

    send_prefill_on(f, &f->b, f->bslot[0], 20, SMALL);
    settle(f);
    assert_int_equal(f->nbatches, 1); /* half a wave, and A is awaited */
    assert_int_equal(f->d.stats.batches_gathered, 1);
    complete(f, 0);
    assert_int_equal(recv_ok(f), 10);
    send_prefill(f, 11, 1, SMALL);
    settle(f);
    assert_int_equal(f->nbatches, 2); /* a full wave */
    assert_int_equal(f->batch[1]->nseqs, 2);
    complete(f, 1);
    assert_int_equal(recv_ok(f), 11);
    assert_int_equal(recv_ok_on(f, &f->b), 20);
}

/* Draining ends a gathering at once: no new work is coming. */
static void test_draining_ends_gathering(void **state)
{
    engine_fixture *f = *state;
    give_waves(f, 1000000);
    open_b(f);
    send_prefill(f, 10, 0, SMALL);
    settle(f);
    device_done(f, 0); /* A awaited while its answer is not out */
    send_prefill_on(f, &f->b, f->bslot[0], 20, SMALL);
    settle(f);
    assert_int_equal(f->nbatches, 1); /* gathered */
    kd_daemon_drain(&f->d);
    assert_int_equal(f->nbatches, 2); /* half a wave, at once */
    assert_int_equal(f->batch[1]->nseqs, 1);
    complete(f, 0);
    complete(f, 1);
    assert_int_equal(recv_ok(f), 10);
    assert_int_equal(recv_ok_on(f, &f->b), 20);
}

/* A lone client never waits for itself: its own request is not awaited. */
static void test_lone_client_not_gathered(void **state)
{
    engine_fixture *f = *state;
    give_waves(f, 1000000);
    for (uint32_t i = 0; i < 3; i++) {
        send_prefill(f, 10 + i, 0, SMALL);
        settle(f);
        assert_int_equal(f->nbatches, i + 1);
        complete(f, i);
        assert_int_equal(recv_ok(f), 10 + i);
    }
    assert_int_equal(f->d.stats.batches_gathered, 0);
}

/* A batch is gathered gather_us at most. */
static void test_gather_us(void **state)
{
    engine_fixture *f = *state;
    give_waves(f, 20000);
    open_b(f);
    send_prefill_on(f, &f->b, f->bslot[0], 20, SMALL);
    settle(f);
    device_done(f, 0); /* B awaited while its answer is not out */

    uint64_t sent = uv_hrtime();
    send_prefill(f, 10, 0, SMALL);
    while (f->nbatches < 2) {
        uv_run(&f->loop, UV_RUN_ONCE);
        assert_true(uv_hrtime() - sent < 10ull * 1000 * 1000 * 1000);
    }
    assert_true(f->submitted_ns[1] - sent >= 20000 * US);
    assert_int_equal(f->d.stats.batches_gathered, 1);
    complete(f, 0);
    complete(f, 1);
    assert_int_equal(recv_ok_on(f, &f->b), 20);
    assert_int_equal(recv_ok(f), 10);
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
        cmocka_unit_test(test_wave_percent),
        cmocka_unit_test_setup_teardown(test_gather_fills_the_wave, policy_setup, policy_teardown),
        cmocka_unit_test_setup_teardown(test_hold_then_gather, policy_setup, policy_teardown),
        cmocka_unit_test_setup_teardown(test_held_until_the_running_batch_completes,
                                        engine_setup, engine_teardown),
        cmocka_unit_test_setup_teardown(test_held_until_the_device_finishes, engine_setup,
                                        engine_teardown),
        cmocka_unit_test_setup_teardown(test_big_batch_not_held, engine_setup, engine_teardown),
        cmocka_unit_test_setup_teardown(test_hold_max_us, engine_setup, engine_teardown),
        cmocka_unit_test_setup_teardown(test_hold_off, engine_setup, engine_teardown),
        cmocka_unit_test_setup_teardown(test_gathered_until_the_wave_fills, engine_setup,
                                        engine_teardown),
        cmocka_unit_test_setup_teardown(test_lone_client_not_gathered, engine_setup,
                                        engine_teardown),
        cmocka_unit_test_setup_teardown(test_draining_ends_gathering, engine_setup,
                                        engine_teardown),
        cmocka_unit_test_setup_teardown(test_gather_us, engine_setup, engine_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
