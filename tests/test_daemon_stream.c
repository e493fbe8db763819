/*
 * test_daemon_stream.c - stream-ordered prefills (PROTOCOL.md
 * §Stream-ordered requests) end to end on the cpu backend, with the host
 * form of libkdaclient (semaphore words in a shared memory region): a
 * request sent before its inputs exist runs only once a thread writes its
 * ready word, and gives bit for bit what the host-synchronised call gives;
 * a ready word never written times out (READY_TIMEOUT) without delaying
 * another client's prefills; every failure path leaves the failure value in
 * the done word - written by kdad (admission error, run-time error, the
 * client's connection dropped) or by libkdaclient (kdad killed with
 * SIGKILL while a batch runs).  Built against --backend cuda as well
 * (test_daemon_stream_cuda: kdad's GPU writes the done words), which adds
 * the stream form on a real CUDA stream of this process.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "daemon_kdac.h"

#ifdef DH_BACKEND_IS_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

#define READY_TIMEOUT_MS 1500
static const char yaml[] = "heads: 4\nslots: 64\ncpu_threads: 2\nlog:\n  level: debug\n"
                           "batching:\n  ready_timeout_ms: 1500\n  ready_spin_us: 2000\n"
                           "  ready_on_device: true\n";

#define LEN 64
#define SHM_BYTES (2u << 20)
#define OFF_IN 4096u /* the words live below, 8 bytes apart */

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* A client with layer "L", a slot, and a shared memory region. */
typedef struct fixture {
    dh_daemon d;
    dh_layer layer;
    test_rng rng;
    kdac_client *c;
    kdac_shm shm;
    uint32_t region;
} fixture;

static void add_region(kdac_client *c, kdac_shm *shm, uint32_t *region)
{
    kdac_error err;
    if (kdac_shm_create(shm, SHM_BYTES, "stream", &err) != KDAC_OK ||
        kdac_region_register_shm(c, shm->fd, shm->size, region, &err) != KDAC_OK)
        fail_msg("shm: %s", err.message);
}

static void setup(fixture *f)
{
    memset(f, 0, sizeof(*f));
    dh_start_or_skip(&f->d, yaml);
    rng_seed(&f->rng, 77);
    dh_layer_make(&f->layer, &f->rng);
    f->c = dh_kdac_open(&f->d, &f->layer);
    add_region(f->c, &f->shm, &f->region);
    const kdac_server_info *info = kdac_client_info(f->c);
    bool found = false;
    for (uint32_t i = 0; i < info->nfeatures; i++)
        found |= strcmp(info->features[i], KDAC_FEATURE_SEMAPHORES) == 0;
    assert_true(found);
}

static void teardown(fixture *f)
{
    kdac_client_close(f->c);
    kdac_shm_close(&f->shm);
    dh_stop(&f->d);
}

static uint64_t *word(fixture *f, uint32_t i)
{
    return (uint64_t *)((uint8_t *)f->shm.base + 8u * i);
}

static kdac_sem sem(fixture *f, uint32_t i, uint64_t value, bool host)
{
    return (kdac_sem){f->region, 8u * i, value, host ? word(f, i) : NULL, 0};
}

/* Offsets of the tensors of one sequence in the region. */
typedef struct layout {
    uint64_t q, k, v, g, beta, out;
} layout;

static layout layout_at(uint64_t base)
{
    uint64_t t = DH_TOKEN_BYTES(LEN);
    return (layout){base, base + t, base + 2 * t, base + 3 * t, base + 4 * t,
                    base + 4 * t + ((DH_BETA_BYTES(LEN) + 15) / 16 * 16)};
}

static void write_inputs(fixture *f, const layout *l, const dh_seq *s)
{
    uint8_t *b = f->shm.base;
    memcpy(b + l->q, s->q, DH_TOKEN_BYTES(LEN));
    memcpy(b + l->k, s->k, DH_TOKEN_BYTES(LEN));
    memcpy(b + l->v, s->v, DH_TOKEN_BYTES(LEN));
    memcpy(b + l->g, s->g, DH_TOKEN_BYTES(LEN));
    memcpy(b + l->beta, s->beta, DH_BETA_BYTES(LEN));
}

static kdac_seq region_seq(fixture *f, uint64_t slot, const layout *l)
{
    kdac_seq q;
    memset(&q, 0, sizeof(q));
    q.slot = slot;
    q.len = LEN;
    q.q = kdac_tensor_region(f->region, l->q);
    q.k = kdac_tensor_region(f->region, l->k);
    q.v = kdac_tensor_region(f->region, l->v);
    q.g = kdac_tensor_region(f->region, l->g);
    q.beta = kdac_tensor_region(f->region, l->beta);
    q.out = kdac_output_region(f->region, l->out);
    return q;
}

/* What a callback saw. */
typedef struct answer {
    bool done;
    int status;
    uint64_t pos;
    uint64_t at_ns;
} answer;

static void on_answer(kdac_client *c, void *data, const kdac_result *res, int status)
{
    answer *a = data;
    a->done = true;
    a->status = status;
    a->at_ns = now_ns();
    if (status == KDAC_OK)
        a->pos = res->u.prefill.pos[0];
}

/* Drives c until a is answered (at most ms); false on timeout. */
static bool wait_answer(kdac_client *c, answer *a, int ms)
{
    uint64_t end = now_ns() + (uint64_t)ms * 1000000u;
    while (!a->done && now_ns() < end) {
        struct pollfd p = {kdac_client_fd(c), POLLIN, 0};
        if (kdac_client_events(c) & KDAC_WRITABLE)
            p.events |= POLLOUT;
        poll(&p, 1, 10);
        kdac_client_progress(c);
    }
    return a->done;
}

/* Stores a ready word from another thread after a delay. */
typedef struct writer {
    fixture *f;
    const layout *l;
    const dh_seq *s;     /* inputs to write first, or NULL */
    uint64_t *word;
    uint64_t value;
    int delay_ms;
    uint64_t wrote_ns;
    pthread_t thread;
} writer;

static void *writer_main(void *arg)
{
    writer *w = arg;
    usleep((useconds_t)w->delay_ms * 1000u);
    if (w->s)
        write_inputs(w->f, w->l, w->s);
    w->wrote_ns = now_ns();
    __atomic_store_n(w->word, w->value, __ATOMIC_RELEASE);
    return NULL;
}

/* ---------------------------------------------------------------------- */
/* Ordering and results                                                   */
/* ---------------------------------------------------------------------- */

/* A request sent before its inputs exist runs once a thread has written
 * them and then the ready word; its output, position and the state it
 * leaves equal the host-synchronised call's, bit for bit; the done word
 * holds the value, with no failure bit. */
static void test_ready_orders_and_matches_sync(void **state)
{
    fixture f;
    setup(&f);
    dh_seq s;
    dh_seq_make(&s, &f.rng, LEN);
    uint64_t sync_slot = dh_kdac_alloc(f.c), stream_slot = dh_kdac_alloc(f.c);
    kdac_error err;

    uint16_t *ref = malloc(DH_TOKEN_BYTES(LEN));
    kdac_seq iq = dh_kdac_seq(sync_slot, &s, ref);
    kdac_prefill_result pr;
    assert_int_equal(kdac_prefill(f.c, "L", &iq, 1, &pr, &err), KDAC_OK);

    layout l = layout_at(OFF_IN);
    kdac_seq rq = region_seq(&f, stream_slot, &l);
    kdac_sem ready = sem(&f, 0, 5, true), done = sem(&f, 1, 7, true);
    answer a = {0};
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &rq, 1, &ready, &done, on_answer, &a, &err),
                     KDAC_OK);
    /* Nothing runs while the word is below its value (the inputs are zeros). */
    assert_false(wait_answer(f.c, &a, 300));
    assert_int_equal(kdac_sem_check(&done), 0);
    __atomic_store_n(word(&f, 0), 4, __ATOMIC_RELEASE); /* below: still waits */
    assert_false(wait_answer(f.c, &a, 100));

    writer w = {&f, &l, &s, word(&f, 0), 5, 100, 0, 0};
    pthread_create(&w.thread, NULL, writer_main, &w);
    assert_true(wait_answer(f.c, &a, 10000));
    pthread_join(w.thread, NULL);
    assert_int_equal(a.status, KDAC_OK);
    assert_true(a.at_ns > w.wrote_ns);
    assert_int_equal(kdac_sem_check(&done), 1);
    assert_int_equal(*word(&f, 1), 7);
    assert_int_equal(a.pos, pr.pos[0]);
    assert_memory_equal((uint8_t *)f.shm.base + l.out, ref, DH_TOKEN_BYTES(LEN));

    /* The states too: the next chunk from each slot gives the same output. */
    uint16_t *out2 = malloc(DH_TOKEN_BYTES(LEN));
    iq.slot = stream_slot;
    iq.out = kdac_output_inline(out2);
    assert_int_equal(kdac_prefill(f.c, "L", &iq, 1, NULL, &err), KDAC_OK);
    iq.slot = sync_slot;
    iq.out = kdac_output_inline(ref);
    assert_int_equal(kdac_prefill(f.c, "L", &iq, 1, NULL, &err), KDAC_OK);
    assert_memory_equal(out2, ref, DH_TOKEN_BYTES(LEN));

    /* A ready word already at its value: it runs at once; done alone works too. */
    answer b = {0};
    kdac_sem done2 = sem(&f, 2, 1, true);
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &rq, 1, &ready, &done2, on_answer, &b,
                                            &err), KDAC_OK);
    assert_true(wait_answer(f.c, &b, 10000));
    assert_int_equal(b.status, KDAC_OK);
    assert_int_equal(kdac_sem_check(&done2), 1);
    answer c = {0};
    kdac_sem done3 = sem(&f, 3, 9, true);
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &rq, 1, NULL, &done3, on_answer, &c, &err),
                     KDAC_OK);
    assert_true(wait_answer(f.c, &c, 10000));
    assert_int_equal(kdac_sem_check(&done3), 1);

    free(out2);
    free(ref);
    dh_seq_free(&s);
    teardown(&f);
}

/* The wire checks: offsets, values, regions; the library refuses the same
 * before sending. */
static void test_sem_refusals(void **state)
{
    fixture f;
    setup(&f);
    uint64_t slot = dh_kdac_alloc(f.c);
    layout l = layout_at(OFF_IN);
    kdac_seq rq = region_seq(&f, slot, &l);
    kdac_error err;
    kdac_sem bad = sem(&f, 0, 1, true);
    bad.offset = 4;
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &rq, 1, &bad, NULL, on_answer, NULL, &err),
                     KDAC_E_INVALID_PARAMS);
    bad = sem(&f, 0, KDAC_SEM_FAILED, true);
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &rq, 1, NULL, &bad, on_answer, NULL, &err),
                     KDAC_E_INVALID_PARAMS);
    /* Outside the region, and an unknown region: the daemon's checks. */
    answer a = {0}, b = {0};
    kdac_sem out_of = sem(&f, 0, 1, false);
    out_of.offset = SHM_BYTES;
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &rq, 1, &out_of, NULL, on_answer, &a, &err),
                     KDAC_OK);
    assert_true(wait_answer(f.c, &a, 10000));
    assert_int_equal(a.status, KDAC_E_REGION_BOUNDS);
    kdac_sem unknown = sem(&f, 0, 1, false);
    unknown.region = 99;
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &rq, 1, NULL, &unknown, on_answer, &b,
                                            &err), KDAC_OK);
    assert_true(wait_answer(f.c, &b, 10000));
    assert_int_equal(b.status, KDAC_E_REGION_INVALID);
    teardown(&f);
}

/* ---------------------------------------------------------------------- */
/* Timeouts cost others nothing                                           */
/* ---------------------------------------------------------------------- */

static double median_ms(uint64_t *v, int n)
{
    for (int i = 1; i < n; i++) { /* insertion sort: n is small */
        uint64_t x = v[i];
        int j = i;
        for (; j > 0 && v[j - 1] > x; j--)
            v[j] = v[j - 1];
        v[j] = x;
    }
    return v[n / 2] / 1e6;
}

/* Client A's request waits for a word nobody writes; client B's prefills
 * meanwhile run as fast as without it; A's request then fails with
 * READY_TIMEOUT after the configured bound, and kdad has written the
 * failure value (the library was given no address to write it). */
static void test_unready_word_times_out_without_delaying_others(void **state)
{
    enum { N = 20 };
    fixture f;
    setup(&f);
    dh_seq s;
    dh_seq_make(&s, &f.rng, LEN);
    kdac_client *other = dh_kdac_open(&f.d, &f.layer);
    uint64_t bslot = dh_kdac_alloc(other), aslot = dh_kdac_alloc(f.c);
    uint16_t *out = malloc(DH_TOKEN_BYTES(LEN));
    kdac_seq bq = dh_kdac_seq(bslot, &s, out);
    kdac_error err;
    uint64_t base[N], during[N];
    for (int i = 0; i < N; i++) {
        uint64_t t0 = now_ns();
        assert_int_equal(kdac_prefill(other, "L", &bq, 1, NULL, &err), KDAC_OK);
        base[i] = now_ns() - t0;
    }

    layout l = layout_at(OFF_IN);
    write_inputs(&f, &l, &s);
    kdac_seq aq = region_seq(&f, aslot, &l);
    kdac_sem ready = sem(&f, 0, 1, true);
    kdac_sem done = sem(&f, 1, 3, false); /* kdad alone can write it */
    answer a = {0};
    uint64_t sent = now_ns();
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &aq, 1, &ready, &done, on_answer, &a, &err),
                     KDAC_OK);
    assert_false(wait_answer(f.c, &a, 50)); /* admitted, waiting */
    for (int i = 0; i < N; i++) {
        uint64_t t0 = now_ns();
        assert_int_equal(kdac_prefill(other, "L", &bq, 1, NULL, &err), KDAC_OK);
        during[i] = now_ns() - t0;
    }
    uint64_t others_end = now_ns();
    double mb = median_ms(base, N), md = median_ms(during, N);
    print_message("other client's prefill: median %.3f ms alone, %.3f ms while a request "
                  "waited for its ready word (max %.3f ms)\n", mb, md, during[N - 1] / 1e6);
    assert_true(others_end - sent < (uint64_t)READY_TIMEOUT_MS * 1000000u);
    assert_false(a.done);
    assert_true(md < 4 * mb + 5.0);

    assert_true(wait_answer(f.c, &a, READY_TIMEOUT_MS + 5000));
    assert_int_equal(a.status, KDAC_E_READY_TIMEOUT);
    uint64_t waited_ms = (a.at_ns - sent) / 1000000u;
    print_message("READY_TIMEOUT after %llu ms (bound %d ms)\n", (unsigned long long)waited_ms,
                  READY_TIMEOUT_MS);
    assert_true(waited_ms >= READY_TIMEOUT_MS - 10);
    assert_true(waited_ms < READY_TIMEOUT_MS + 1000);
    assert_int_equal(__atomic_load_n(word(&f, 1), __ATOMIC_ACQUIRE), 3 | KDAC_SEM_FAILED);

    /* The slot is free again for the client's next request. */
    kdac_seq iq = dh_kdac_seq(aslot, &s, out);
    assert_int_equal(kdac_prefill(f.c, "L", &iq, 1, NULL, &err), KDAC_OK);
    kdac_client_close(other);
    free(out);
    dh_seq_free(&s);
    teardown(&f);
}


/* How long the daemon takes to notice a ready word: written while the loop
 * still spins on the new wait (ready_spin_us), and written later, when it
 * polls on its timer; against a request whose word was ready when sent.
 * Each time runs from the store (or the send) to the done word, the
 * prefill included; printed, and bounded loosely (the host is shared). */
static void test_ready_notice_latency(void **state)
{
    enum { N = 15 };
    fixture f;
    setup(&f);
    dh_seq s;
    dh_seq_make(&s, &f.rng, LEN);
    uint64_t slot = dh_kdac_alloc(f.c);
    layout l = layout_at(OFF_IN);
    write_inputs(&f, &l, &s);
    kdac_seq rq = region_seq(&f, slot, &l);
    kdac_error err;
    uint64_t t[3][N];
    for (int mode = 0; mode < 3; mode++) {
        for (int i = 0; i < N; i++) {
            uint64_t v = 1 + (uint64_t)(mode * N + i);
            kdac_sem ready = sem(&f, 0, v, true), done = sem(&f, 1, v, true);
            if (mode == 0)
                __atomic_store_n(word(&f, 0), v, __ATOMIC_RELEASE);
            answer a = {0};
            uint64_t t0 = now_ns();
            assert_int_equal(kdac_prefill_send_sems(f.c, "L", &rq, 1, &ready, &done, on_answer,
                                                    &a, &err), KDAC_OK);
            kdac_client_progress(f.c);
            if (mode > 0) {
                usleep(mode == 1 ? 200 : 20000); /* inside the 2 ms spin / long after it */
                t0 = now_ns();
                __atomic_store_n(word(&f, 0), v, __ATOMIC_RELEASE);
            }
            while (kdac_sem_check(&done) == 0 && now_ns() - t0 < 5000000000ull)
                usleep(20);
            t[mode][i] = now_ns() - t0;
            assert_int_equal(kdac_sem_check(&done), 1);
            assert_true(wait_answer(f.c, &a, 10000));
            assert_int_equal(a.status, KDAC_OK);
        }
    }
    double m0 = median_ms(t[0], N), m1 = median_ms(t[1], N), m2 = median_ms(t[2], N);
    print_message("to the done word: ready when sent %.3f ms; written during the spin %.3f ms; "
                  "written 20 ms later (timer) %.3f ms (medians of %d)\n", m0, m1, m2, N);
    assert_true(m2 < 100.0);
    dh_seq_free(&s);
    teardown(&f);
}

/* ---------------------------------------------------------------------- */
/* Failure paths                                                          */
/* ---------------------------------------------------------------------- */

/* kdad writes the failure value itself (the library has no address): an
 * admission error after the done word resolved (unknown layer, a bad slot),
 * a run-time error (POSITION_MISMATCH), and the connection dropped while the
 * request waited for its ready word. */
static void test_daemon_writes_failure_values(void **state)
{
    fixture f;
    setup(&f);
    dh_seq s;
    dh_seq_make(&s, &f.rng, LEN);
    uint64_t slot = dh_kdac_alloc(f.c);
    layout l = layout_at(OFF_IN);
    write_inputs(&f, &l, &s);
    kdac_seq rq = region_seq(&f, slot, &l);
    kdac_error err;

    answer a = {0};
    kdac_sem d0 = sem(&f, 0, 11, false);
    assert_int_equal(kdac_prefill_send_sems(f.c, "nope", &rq, 1, NULL, &d0, on_answer, &a, &err),
                     KDAC_OK);
    assert_true(wait_answer(f.c, &a, 10000));
    assert_int_equal(a.status, KDAC_E_UNKNOWN_LAYER);
    assert_int_equal(*word(&f, 0), 11 | KDAC_SEM_FAILED);

    answer b = {0};
    kdac_sem d1 = sem(&f, 1, 12, false);
    kdac_seq stale = rq;
    stale.slot = slot ^ (1ull << 40); /* another generation */
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &stale, 1, NULL, &d1, on_answer, &b, &err),
                     KDAC_OK);
    assert_true(wait_answer(f.c, &b, 10000));
    assert_int_equal(b.status, KDAC_E_STALE_SLOT);
    assert_int_equal(*word(&f, 1), 12 | KDAC_SEM_FAILED);

    answer c = {0};
    kdac_sem d2 = sem(&f, 2, 13, false), r2 = sem(&f, 3, 1, false);
    kdac_seq wrong = rq;
    wrong.flags = KDAC_SEQ_EXPECT_POS;
    wrong.expect_pos = 999;
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &wrong, 1, &r2, &d2, on_answer, &c, &err),
                     KDAC_OK);
    assert_false(wait_answer(f.c, &c, 100));
    __atomic_store_n(word(&f, 3), 1, __ATOMIC_RELEASE);
    assert_true(wait_answer(f.c, &c, 10000));
    assert_int_equal(c.status, KDAC_E_POSITION_MISMATCH);
    assert_int_equal(*word(&f, 2), 13 | KDAC_SEM_FAILED);

    /* Dropped: a second connection sends a gated request and goes. */
    kdac_client *g = dh_kdac_open(&f.d, &f.layer);
    kdac_shm gshm;
    uint32_t gregion;
    add_region(g, &gshm, &gregion);
    uint64_t gslot = dh_kdac_alloc(g);
    memcpy((uint8_t *)gshm.base + OFF_IN, (uint8_t *)f.shm.base + OFF_IN,
           l.out - OFF_IN); /* the same inputs */
    kdac_seq gq = rq;
    gq.slot = gslot;
    gq.q.region = gq.k.region = gq.v.region = gq.g.region = gq.beta.region = gregion;
    gq.out.region = gregion;
    kdac_sem gr = {gregion, 0, 1, NULL, 0}, gd = {gregion, 8, 21, NULL, 0};
    answer ga = {0};
    assert_int_equal(kdac_prefill_send_sems(g, "L", &gq, 1, &gr, &gd, on_answer, &ga, &err),
                     KDAC_OK);
    assert_false(wait_answer(g, &ga, 100)); /* sent and admitted */
    shutdown(kdac_client_fd(g), SHUT_RDWR); /* the connection drops under the library */
    uint64_t *gdone = (uint64_t *)((uint8_t *)gshm.base + 8);
    uint64_t end = now_ns() + 10000000000ull;
    while (__atomic_load_n(gdone, __ATOMIC_ACQUIRE) == 0 && now_ns() < end)
        usleep(1000);
    assert_int_equal(*gdone, 21 | KDAC_SEM_FAILED);
    kdac_client_close(g);
    kdac_shm_close(&gshm);

    dh_seq_free(&s);
    teardown(&f);
}

/* kdad killed with SIGKILL while a batch runs and a request waits: the
 * library notices the lost connection and writes the failure value into
 * the waiting request's done word itself; the running one's word is
 * released too (its value if the batch finished before the kill). */
static void test_library_writes_failure_when_kdad_dies(void **state)
{
    fixture f;
    setup(&f);
    enum { BIG = 8192 };
    dh_seq big;
    dh_seq_make(&big, &f.rng, BIG);
    uint64_t slot_big = dh_kdac_alloc(f.c), slot = dh_kdac_alloc(f.c);
    uint16_t *out = malloc(DH_TOKEN_BYTES(BIG));
    kdac_seq bq = dh_kdac_seq(slot_big, &big, out);
    layout l = layout_at(OFF_IN);
    kdac_seq rq = region_seq(&f, slot, &l);
    kdac_error err;
    answer a = {0}, b = {0};
    kdac_sem running_done = sem(&f, 0, 31, true);
    kdac_sem ready = sem(&f, 1, 1, true), waiting_done = sem(&f, 2, 32, true);
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &bq, 1, NULL, &running_done, on_answer, &a,
                                            &err), KDAC_OK);
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &rq, 1, &ready, &waiting_done, on_answer, &b,
                                            &err), KDAC_OK);
    assert_false(wait_answer(f.c, &b, 50));
    kill(f.d.pid, SIGKILL);
    assert_true(wait_answer(f.c, &b, 10000));
    assert_true(wait_answer(f.c, &a, 10000));
    assert_int_equal(b.status, KDAC_E_DISCONNECTED);
    assert_int_equal(*word(&f, 2), 32 | KDAC_SEM_FAILED);
    assert_int_equal(kdac_sem_check(&waiting_done), -1);
    assert_int_not_equal(kdac_sem_check(&running_done), 0);
    print_message("the running request: %s\n", a.status == KDAC_OK ? "finished before the kill"
                                                                   : "failed with the daemon");
    assert_int_equal(dh_signal_wait(&f.d, 0), -1);
    kdac_client_close(f.c);
    kdac_shm_close(&f.shm);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", f.d.dir);
    assert_int_equal(system(cmd), 0);
    free(out);
    dh_seq_free(&big);
}

#ifdef DH_BACKEND_IS_CUDA
/* ---------------------------------------------------------------------- */
/* The stream form on a CUDA stream                                       */
/* ---------------------------------------------------------------------- */

#define CUDA_OK(call)                                                              \
    do {                                                                           \
        cudaError_t e_ = (call);                                                   \
        if (e_ != cudaSuccess)                                                     \
            fail_msg("%s: %s", #call, cudaGetErrorString(e_));                     \
    } while (0)

typedef CUresult (*wait64_fn)(CUstream s, CUdeviceptr addr, cuuint64_t value, unsigned flags);

/* Waits for a CUDA stream (driving the client meanwhile) at most ms; false on timeout.  The
 * stream waits on words other processes write: a bounded wait says which step never came. */
static bool stream_finishes(kdac_client *c, cudaStream_t st, int ms)
{
    uint64_t end = now_ns() + (uint64_t)ms * 1000000u;
    cudaError_t e;
    while ((e = cudaStreamQuery(st)) == cudaErrorNotReady && now_ns() < end) {
        kdac_client_progress(c);
        usleep(100);
    }
    if (e != cudaSuccess && e != cudaErrorNotReady)
        fail_msg("the stream failed: %s", cudaGetErrorString(e));
    return e == cudaSuccess;
}

static wait64_fn stream_wait64(void)
{
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult found;
    CUDA_OK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &fn, 12000, cudaEnableDefault,
                                             &found));
    return (wait64_fn)fn;
}

/* The client's stream produces the inputs (a copy into the region), runs
 * the prefill through kdad, and consumes the output (a copy out), all
 * enqueued while a gate at the stream's head holds it: the host enqueues
 * everything, and nothing runs, before the gate opens.  Then the output
 * equals the host-synchronised call's.  A request that fails (unknown
 * layer) releases the stream with the failure value. */
static void test_stream_form_on_a_cuda_stream(void **state)
{
    fixture f;
    setup(&f);
    kdac_error err;
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    uint64_t dev;
    assert_int_equal(kdac_shm_map_device(&f.shm, &dev, &err), KDAC_OK);
    wait64_fn wait64 = stream_wait64();

    dh_seq s;
    dh_seq_make(&s, &f.rng, LEN);
    uint64_t sync_slot = dh_kdac_alloc(f.c), slot = dh_kdac_alloc(f.c);
    uint16_t *ref = malloc(DH_TOKEN_BYTES(LEN)), *got;
    /* Pinned: a copy into pageable memory would return only once done, and this one waits
       behind the gate the host opens below. */
    CUDA_OK(cudaMallocHost((void **)&got, DH_TOKEN_BYTES(LEN)));
    memset(got, 0, DH_TOKEN_BYTES(LEN));
    kdac_seq iq = dh_kdac_seq(sync_slot, &s, ref);
    assert_int_equal(kdac_prefill(f.c, "L", &iq, 1, NULL, &err), KDAC_OK);

    layout l = layout_at(OFF_IN);
    uint64_t in_bytes = l.out - OFF_IN;
    uint8_t *staged = calloc(1, OFF_IN + in_bytes);
    memcpy(staged + l.q, s.q, DH_TOKEN_BYTES(LEN));
    memcpy(staged + l.k, s.k, DH_TOKEN_BYTES(LEN));
    memcpy(staged + l.v, s.v, DH_TOKEN_BYTES(LEN));
    memcpy(staged + l.g, s.g, DH_TOKEN_BYTES(LEN));
    memcpy(staged + l.beta, s.beta, DH_BETA_BYTES(LEN));
    void *src, *dst;
    CUDA_OK(cudaMalloc(&src, in_bytes));
    CUDA_OK(cudaMalloc(&dst, DH_TOKEN_BYTES(LEN)));
    CUDA_OK(cudaMemcpy(src, staged + OFF_IN, in_bytes, cudaMemcpyHostToDevice));

    /* gate (word 4) -> producer -> ready (word 0) / wait done (word 1) -> consumer */
    assert_int_equal(wait64((CUstream)st, (CUdeviceptr)(dev + 32), 1, CU_STREAM_WAIT_VALUE_GEQ),
                     CUDA_SUCCESS);
    CUDA_OK(cudaMemcpyAsync((uint8_t *)f.shm.base + OFF_IN, src, in_bytes, cudaMemcpyDeviceToHost,
                            st));
    kdac_seq rq = region_seq(&f, slot, &l);
    kdac_sem ready = {f.region, 0, 1, word(&f, 0), dev};
    kdac_sem done = {f.region, 8, 1, word(&f, 1), dev + 8};
    answer a = {0};
    assert_int_equal(kdac_prefill_on_stream(f.c, st, "L", &rq, 1, &ready, &done, on_answer, &a,
                                            &err), KDAC_OK);
    CUDA_OK(cudaMemcpyAsync(dst, (uint8_t *)f.shm.base + l.out, DH_TOKEN_BYTES(LEN),
                            cudaMemcpyHostToDevice, st));
    CUDA_OK(cudaMemcpyAsync(got, dst, DH_TOKEN_BYTES(LEN), cudaMemcpyDeviceToHost, st));
    assert_false(wait_answer(f.c, &a, 200));
    assert_int_equal(cudaStreamQuery(st), cudaErrorNotReady);
    assert_int_equal(*word(&f, 0), 0);
    __atomic_store_n(word(&f, 4), 1, __ATOMIC_RELEASE); /* open the gate */
    if (!wait_answer(f.c, &a, 10000))
        fail_msg("no answer after the gate opened (ready word %llu, done word %llu)",
                 (unsigned long long)*word(&f, 0), (unsigned long long)*word(&f, 1));
    if (!stream_finishes(f.c, st, 10000))
        fail_msg("answered (status %d), but the stream did not finish (done word %llu)",
                 a.status, (unsigned long long)*word(&f, 1));
    assert_int_equal(a.status, KDAC_OK);
    assert_int_equal(kdac_sem_check(&done), 1);
    assert_memory_equal(got, ref, DH_TOKEN_BYTES(LEN));

    /* Failure: the stream goes on, the done word says so. */
    kdac_sem done2 = {f.region, 16, 1, word(&f, 2), dev + 16};
    ready.value = 2;
    answer b = {0};
    assert_int_equal(kdac_prefill_on_stream(f.c, st, "nope", &rq, 1, &ready, &done2, on_answer,
                                            &b, &err), KDAC_OK);
    assert_true(wait_answer(f.c, &b, 10000));
    if (!stream_finishes(f.c, st, 10000))
        fail_msg("a failed request left the stream waiting (done word %llx)",
                 (unsigned long long)*word(&f, 2));
    assert_int_equal(b.status, KDAC_E_UNKNOWN_LAYER);
    assert_int_equal(kdac_sem_check(&done2), -1);

    CUDA_OK(cudaFree(src));
    CUDA_OK(cudaFree(dst));
    CUDA_OK(cudaStreamDestroy(st));
    kdac_client_close(f.c);
    f.c = NULL;
    kdac_shm_unmap_device(&f.shm);
    free(staged);
    cudaFreeHost(got);
    free(ref);
    dh_seq_free(&s);
    teardown(&f);
}

/* Tensors in device memory (a CUDA IPC region), words in shared memory: kdad
 * queues the request on the device behind a wait for its ready word
 * (batching.ready_on_device, on in this suite).  On a CUDA stream behind a gate, nothing runs
 * before the gate opens, then the output equals the synchronised call's.  A
 * ready word never written ends in READY_TIMEOUT after the bound, while
 * another client's prefills run; kdad has stored the ready value itself to
 * release its own wait, the done word holds the failure value, the output
 * region is untouched and the slot's state too (its next chunk equals that
 * of a fresh slot). */
static void test_device_tensors_wait_on_the_device(void **state)
{
    fixture f;
    setup(&f);
    kdac_error err;
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    uint64_t dev;
    assert_int_equal(kdac_shm_map_device(&f.shm, &dev, &err), KDAC_OK);
    wait64_fn wait64 = stream_wait64();
    dh_seq s;
    dh_seq_make(&s, &f.rng, LEN);
    uint64_t sync_slot = dh_kdac_alloc(f.c), slot = dh_kdac_alloc(f.c), late_slot = dh_kdac_alloc(f.c);
    uint16_t *ref = malloc(DH_TOKEN_BYTES(LEN)), *out2 = malloc(DH_TOKEN_BYTES(LEN)), *got;
    CUDA_OK(cudaMallocHost((void **)&got, DH_TOKEN_BYTES(LEN)));
    kdac_seq iq = dh_kdac_seq(sync_slot, &s, ref);
    assert_int_equal(kdac_prefill(f.c, "L", &iq, 1, NULL, &err), KDAC_OK);

    /* the region: the layout's blocks from offset 0, in a 2 MiB allocation */
    layout l = layout_at(0);
    uint64_t in_bytes = l.out, region_bytes = 2u << 20;
    uint8_t *staged = calloc(1, in_bytes), *buf, *src;
    memcpy(staged + l.q, s.q, DH_TOKEN_BYTES(LEN));
    memcpy(staged + l.k, s.k, DH_TOKEN_BYTES(LEN));
    memcpy(staged + l.v, s.v, DH_TOKEN_BYTES(LEN));
    memcpy(staged + l.g, s.g, DH_TOKEN_BYTES(LEN));
    memcpy(staged + l.beta, s.beta, DH_BETA_BYTES(LEN));
    CUDA_OK(cudaMalloc((void **)&buf, region_bytes));
    CUDA_OK(cudaMalloc((void **)&src, in_bytes));
    CUDA_OK(cudaMemcpy(src, staged, in_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(buf, 0, region_bytes));
    cudaIpcMemHandle_t h;
    CUDA_OK(cudaIpcGetMemHandle(&h, buf));
    uint32_t region;
    assert_int_equal(kdac_region_register_cuda(f.c, &h, region_bytes, NULL, &region, &err),
                     KDAC_OK);
    kdac_seq rq;
    memset(&rq, 0, sizeof(rq));
    rq.slot = slot;
    rq.len = LEN;
    rq.q = kdac_tensor_region(region, l.q);
    rq.k = kdac_tensor_region(region, l.k);
    rq.v = kdac_tensor_region(region, l.v);
    rq.g = kdac_tensor_region(region, l.g);
    rq.beta = kdac_tensor_region(region, l.beta);
    rq.out = kdac_output_region(region, l.out);

    /* gate (word 4) -> producer -> ready (word 0) / wait done (word 1) -> consumer */
    assert_int_equal(wait64((CUstream)st, (CUdeviceptr)(dev + 32), 1, CU_STREAM_WAIT_VALUE_GEQ),
                     CUDA_SUCCESS);
    CUDA_OK(cudaMemcpyAsync(buf, src, in_bytes, cudaMemcpyDeviceToDevice, st));
    kdac_sem ready = {f.region, 0, 1, word(&f, 0), dev};
    kdac_sem done = {f.region, 8, 1, word(&f, 1), dev + 8};
    answer a = {0};
    assert_int_equal(kdac_prefill_on_stream(f.c, st, "L", &rq, 1, &ready, &done, on_answer, &a,
                                            &err), KDAC_OK);
    CUDA_OK(cudaMemcpyAsync(got, buf + l.out, DH_TOKEN_BYTES(LEN), cudaMemcpyDeviceToHost, st));
    assert_false(wait_answer(f.c, &a, 200));
    assert_int_equal(cudaStreamQuery(st), cudaErrorNotReady);
    assert_int_equal(*word(&f, 1), 0);
    print_message("enqueued behind the gate; opening it\n");
    __atomic_store_n(word(&f, 4), 1, __ATOMIC_RELEASE); /* open the gate */
    if (!stream_finishes(f.c, st, 10000))
        fail_msg("the stream did not finish (ready word %llu, done word %llu)",
                 (unsigned long long)*word(&f, 0), (unsigned long long)*word(&f, 1));
    assert_true(wait_answer(f.c, &a, 10000));
    assert_int_equal(a.status, KDAC_OK);
    assert_int_equal(kdac_sem_check(&done), 1);
    assert_memory_equal(got, ref, DH_TOKEN_BYTES(LEN));

    /* A ready word nobody writes (word 3); the output block holds a pattern meanwhile. */
    CUDA_OK(cudaMemset(buf + l.out, 0xab, DH_TOKEN_BYTES(LEN)));
    rq.slot = late_slot;
    kdac_sem late_ready = sem(&f, 3, 1, false), late_done = sem(&f, 5, 9, false);
    answer b = {0};
    uint64_t sent = now_ns();
    assert_int_equal(kdac_prefill_send_sems(f.c, "L", &rq, 1, &late_ready, &late_done, on_answer,
                                            &b, &err), KDAC_OK);
    assert_false(wait_answer(f.c, &b, 50));
    print_message("a request waits for a word nobody writes\n");
    kdac_client *other = dh_kdac_open(&f.d, &f.layer);
    uint64_t oslot = dh_kdac_alloc(other);
    iq.slot = oslot;
    iq.out = kdac_output_inline(out2);
    for (int i = 0; i < 5; i++) {
        uint64_t t0 = now_ns();
        assert_int_equal(kdac_prefill(other, "L", &iq, 1, NULL, &err), KDAC_OK);
        assert_true(now_ns() - t0 < 1000000000ull);
    }
    assert_false(b.done);
    assert_true(wait_answer(f.c, &b, READY_TIMEOUT_MS + 5000));
    assert_int_equal(b.status, KDAC_E_READY_TIMEOUT);
    assert_true((now_ns() - sent) / 1000000u >= READY_TIMEOUT_MS - 10);
    assert_int_equal(__atomic_load_n(word(&f, 5), __ATOMIC_ACQUIRE), 9 | KDAC_SEM_FAILED);
    uint64_t r3 = __atomic_load_n(word(&f, 3), __ATOMIC_ACQUIRE);
    assert_int_equal(r3, 1); /* kdad released its own device-side wait */
    CUDA_OK(cudaMemcpy(got, buf + l.out, DH_TOKEN_BYTES(LEN), cudaMemcpyDeviceToHost));
    for (uint64_t i = 0; i < DH_TOKEN_BYTES(LEN) / 2; i++)
        assert_int_equal(got[i], 0xabab);
    iq.slot = late_slot; /* untouched: like a fresh slot */
    assert_int_equal(kdac_prefill(f.c, "L", &iq, 1, NULL, &err), KDAC_OK);
    assert_memory_equal(out2, ref, DH_TOKEN_BYTES(LEN));
    print_message("device-side wait: READY_TIMEOUT after %llu ms, ready word left at %llu\n",
                  (unsigned long long)((b.at_ns - sent) / 1000000u), (unsigned long long)r3);

    kdac_client_close(other);
    kdac_region_release(f.c, region, &err);
    CUDA_OK(cudaStreamDestroy(st));
    kdac_client_close(f.c);
    f.c = NULL;
    kdac_shm_unmap_device(&f.shm);
    CUDA_OK(cudaFree(buf));
    CUDA_OK(cudaFree(src));
    cudaFreeHost(got);
    free(staged);
    free(out2);
    free(ref);
    dh_seq_free(&s);
    teardown(&f);
}
#endif

int main(void)
{
    if (dh_backend_available(yaml) == 77)
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_ready_orders_and_matches_sync, dh_teardown),
        cmocka_unit_test_teardown(test_sem_refusals, dh_teardown),
        cmocka_unit_test_teardown(test_unready_word_times_out_without_delaying_others,
                                  dh_teardown),
        cmocka_unit_test_teardown(test_ready_notice_latency, dh_teardown),
        cmocka_unit_test_teardown(test_daemon_writes_failure_values, dh_teardown),
        cmocka_unit_test_teardown(test_library_writes_failure_when_kdad_dies, dh_teardown),
#ifdef DH_BACKEND_IS_CUDA
        cmocka_unit_test_teardown(test_stream_form_on_a_cuda_stream, dh_teardown),
        cmocka_unit_test_teardown(test_device_tensors_wait_on_the_device, dh_teardown),
#endif
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
