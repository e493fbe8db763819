/*
 * test_daemon.c - kdad end to end: a real daemon process on a temporary
 * socket, driven over the wire protocol (daemon_harness.h), every result
 * checked against the float64 oracle or against another path to the same
 * value.  Built twice: test_daemon (cpu backend) and test_daemon_cuda
 * (DH_BACKEND "cuda"; exits 77 without a usable GPU).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bf16.h"
#include "daemon_harness.h"
#include "safetensors.h"

#define OUT_TOL 0.005   /* docs/kda.md: output rel RMS error against the oracle */
#define STATE_TOL 0.005 /* final state */

static const char base_yaml[] = "heads: 4\nslots: 64\ncpu_threads: 2\nlog:\n  level: debug\n";

/* A daemon with base_yaml plus extra lines. */
static void start(dh_daemon *d, const char *extra)
{
    char yaml[2048];
    snprintf(yaml, sizeof(yaml), "%s%s", base_yaml, extra ? extra : "");
    dh_start_or_skip(d, yaml);
}

static void send_simple(dh_client *c, uint32_t id, kp_method m)
{
    switch (m) {
    case KP_METHOD_HEALTH: assert_int_equal(kp_health_params_encode(&c->w, id, NULL), KP_OK); break;
    case KP_METHOD_LAYER_LIST: assert_int_equal(kp_layer_list_params_encode(&c->w, id, NULL), KP_OK); break;
    default: fail_msg("send_simple: method %d", (int)m);
    }
    dh_send(c);
}

static kp_slot_info slot_info(dh_client *c, uint64_t slot, uint32_t *pool_free)
{
    kp_slot_info_params p = {true, {&slot, 1}};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_slot_info_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    kp_slot_info_result r;
    assert_int_equal(kp_slot_info_result_decode(&c->msg, &r, NULL), KP_OK);
    assert_int_equal(r.nslots, 1);
    if (pool_free)
        *pool_free = r.pool_free;
    return r.slots[0];
}

/* Oracle check of one sequence run from a zero state: output and final state. */
static void check_oracle(dh_client *c, const dh_layer *l, uint64_t slot, const dh_seq *s,
                         const uint16_t *out)
{
    double *state = calloc(DH_STATE_ELEMS, sizeof(double));
    double *ref = calloc((size_t)s->len * DH_HEADS * 128 + 1, sizeof(double));
    float *got = malloc(DH_STATE_ELEMS * sizeof(float));
    dh_oracle(l, s, state, ref);
    double out_err = dh_err_bf16(out, ref, (size_t)s->len * DH_HEADS * 128);
    assert_int_equal(dh_read_state(c, slot, got), s->len);
    double state_err = dh_err_f32(got, state, DH_STATE_ELEMS);
    if (out_err > OUT_TOL || state_err > STATE_TOL)
        fail_msg("len %u: output error %.2e, state error %.2e", s->len, out_err, state_err);
    free(state);
    free(ref);
    free(got);
}

static uint32_t send_drop(dh_client *c, const char *name)
{
    kp_layer_drop_params p = {name};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_layer_drop_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    return id;
}

/* The answer to layer.drop id, which must succeed. */
static kp_layer_drop_result expect_drop(dh_client *c, uint32_t id)
{
    dh_expect_result(c, id);
    kp_layer_drop_result r;
    assert_int_equal(kp_layer_drop_result_decode(&c->msg, &r, NULL), KP_OK);
    return r;
}

/* ---------------------------------------------------------------------- */

static void test_hello_and_layers(void **unused)
{
    dh_daemon d;
    dh_client c;
    test_rng r;
    dh_layer l, other;
    start(&d, NULL);
    dh_connect(&c, &d);

    /* Nothing but hello before hello; the connection stays usable. */
    kp_slot_alloc_params ap = {1, true};
    uint32_t id = dh_id(&c);
    assert_int_equal(kp_slot_alloc_params_encode(&c.w, id, &ap, NULL), KP_OK);
    dh_send(&c);
    dh_expect_error(&c, id, KP_E_HELLO_REQUIRED, "send hello first");

    kp_hello_params hp = {{3, KP_PROTOCOL_VERSION}, 2, "test"};
    id = dh_id(&c);
    assert_int_equal(kp_hello_params_encode(&c.w, id, &hp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    kp_hello_result hr;
    assert_int_equal(kp_hello_result_decode(&c.msg, &hr, NULL), KP_OK);
    assert_int_equal(hr.version, 1);
    assert_string_equal(hr.server, "kdad " KDAD_VERSION);
    assert_int_equal(hr.backend, strcmp(DH_BACKEND, "cuda") == 0 ? KP_BACKEND_CUDA : KP_BACKEND_CPU);
    assert_int_equal(hr.has_gpu, strcmp(DH_BACKEND, "cuda") == 0);
    assert_int_equal(hr.geometry.heads, DH_HEADS);
    assert_int_equal(hr.geometry.slots, 64);
    assert_int_equal(hr.geometry.state_dtype, KP_DTYPE_F32);
    assert_true(hr.transports & KP_TRANSPORT_INLINE);
    assert_true(hr.transports & KP_TRANSPORT_SHM);
    assert_false(hr.slots_persist);
    assert_int_equal(hr.limits.max_batch_tokens, KP_DEFAULT_MAX_BATCH_TOKENS);
    kp_session_from_hello(&c.session, &hr);
    uint64_t instance = hr.instance;

    dh_hello(&c); /* a second hello changes nothing */
    id = dh_id(&c);
    send_simple(&c, id, KP_METHOD_HEALTH);
    dh_expect_result(&c, id);
    kp_health_result health;
    assert_int_equal(kp_health_result_decode(&c.msg, &health, NULL), KP_OK);
    assert_int_equal(health.status, KP_HEALTH_OK);

    rng_seed(&r, 1);
    dh_layer_make(&l, &r);
    dh_layer_make(&other, &r);
    /* register: new, identical again (created false), different content */
    kp_layer_register_params lp = {"L0", kp_ref_inline(l.A_log, sizeof(l.A_log)),
                                   kp_ref_inline(l.dt_bias, sizeof(l.dt_bias)), -5.0f,
                                   KP_DEFAULT_SCALE};
    kp_layer_register_result lr;
    for (int i = 0; i < 2; i++) {
        id = dh_id(&c);
        assert_int_equal(kp_layer_register_params_encode(&c.w, id, &lp, NULL), KP_OK);
        dh_send(&c);
        dh_expect_result(&c, id);
        assert_int_equal(kp_layer_register_result_decode(&c.msg, &lr, NULL), KP_OK);
        assert_int_equal(lr.created, i == 0);
    }
    lp.A_log = kp_ref_inline(other.A_log, sizeof(other.A_log));
    id = dh_id(&c);
    assert_int_equal(kp_layer_register_params_encode(&c.w, id, &lp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_error(&c, id, KP_E_LAYER_EXISTS, "L0");

    id = dh_id(&c);
    send_simple(&c, id, KP_METHOD_LAYER_LIST);
    dh_expect_result(&c, id);
    kp_layer_list_result ll;
    assert_int_equal(kp_layer_list_result_decode(&c.msg, &ll, NULL), KP_OK);
    assert_int_equal(ll.nlayers, 1);
    assert_string_equal(ll.layers[0].name, "L0");
    assert_int_equal(ll.layers[0].source, KP_LAYER_SOURCE_CLIENT);

    /* registered twice: two drops give the registrations back, saying what is left; a
       third finds nothing */
    for (uint64_t left = 1; left + 1 > 0; left--) {
        kp_layer_drop_result dr = expect_drop(&c, send_drop(&c, "L0"));
        assert_true(dr.known);
        assert_int_equal(dr.registrations, left);
        assert_int_equal(dr.removed, left == 0);
        assert_int_equal(dr.in_use, 0);
    }
    dh_expect_error(&c, send_drop(&c, "L0"), KP_E_UNKNOWN_LAYER, "L0");
    dh_close(&c);

    /* The instance stays for the daemon's life. */
    dh_connect(&c, &d);
    dh_hello(&c);
    assert_true(instance != 0);
    dh_close(&c);
    dh_stop(&d);
}

static void wait_log(const dh_daemon *d, const char *needle, int n);

static uint64_t memory_sum(const kp_memory *m)
{
    return m->pool + m->staging + m->scratch + m->kernel + m->lanes + m->layers;
}

/* hello and stats show the memory kdad holds by use, as the backend allocated it: the cuda
 * backend's device memory (its split scratch as configured), the cpu backend's pool in host
 * memory; the start-up line says the same. */
static void test_memory(void **unused)
{
    dh_daemon d;
    dh_client c;
    test_rng r;
    dh_layer l;
    start(&d, "cuda_split_scratch: 64MiB\n");
    dh_connect(&c, &d);
    kp_hello_result hr;
    dh_hello_result(&c, &hr);
    const kp_memory m = hr.memory;
    assert_true(hr.has_memory);
    assert_true(m.pool == 64 * kp_state_bytes(DH_HEADS, KP_DTYPE_F32));
    assert_int_equal(m.layers, 0);
    assert_int_equal(m.lanes, 0); /* batching.ready_on_device is off */
    assert_true(m.total == memory_sum(&m));
#ifdef DH_BACKEND_IS_CUDA
    assert_true(m.scratch == 64ull << 20);
    assert_true(m.staging > 0 && m.kernel > 0);
    wait_log(&d, "memory (device): ", 1);
#else
    assert_int_equal(m.staging + m.scratch + m.kernel, 0);
    wait_log(&d, "memory (host): ", 1);
#endif

    /* a layer: its weights' copy on the device counts while it is registered */
    rng_seed(&r, 5);
    dh_layer_make(&l, &r);
    dh_register_layer(&c, "L", &l);
    kp_stats_result st;
    dh_stats(&c, &st);
    assert_true(st.has_memory);
    assert_true(st.memory.pool == m.pool && st.memory.scratch == m.scratch);
    assert_true(st.memory.total == memory_sum(&st.memory));
#ifdef DH_BACKEND_IS_CUDA
    assert_true(st.memory.layers >= sizeof(l.A_log) + sizeof(l.dt_bias));
#else
    assert_int_equal(st.memory.layers, 0); /* the cpu kernel reads the host copy */
#endif
    kp_layer_drop_result dr = expect_drop(&c, send_drop(&c, "L"));
    assert_true(dr.removed);
    dh_stats(&c, &st);
    assert_true(st.memory.total == m.total);
    dh_close(&c);
    dh_stop(&d);
#ifdef DH_BACKEND_IS_CUDA
    /* No scratch, and the gated lanes: four more kernel instances (without scratch) and tables */
    start(&d, "cuda_split_scratch: 0\nbatching:\n  ready_on_device: true\n");
    dh_connect(&c, &d);
    dh_hello(&c);
    dh_stats(&c, &st);
    assert_int_equal(st.memory.scratch, 0);
    assert_true(st.memory.kernel == m.kernel && st.memory.staging == m.staging);
    assert_true(st.memory.lanes > 4 * m.kernel && (st.memory.lanes - 4 * m.kernel) % 4 == 0);
    assert_true(st.memory.total == memory_sum(&st.memory));
    dh_close(&c);
    dh_stop(&d);
#endif
}

/*
 * Many connections at once, each with its own slot and length, all checked
 * against the oracle.  A chain of long requests on one slot keeps the device
 * busy meanwhile, so the others arrive while it runs and must be batched.
 */
#define NCONN 16
/*
 * Work that keeps the backend busy while other requests arrive: on the CPU a
 * chain of 1500-token requests; on a GPU, which runs those in well under a
 * millisecond, one request long enough (~ms) for the others to queue behind it.
 */
#ifdef DH_BACKEND_IS_CUDA
#define CHAIN 1
#define CHAIN_LEN 20000
#define MAX_LAUNCHES (CHAIN + NCONN - 1)   /* GPU timing varies: at least some requests shared a launch */
#else
#define CHAIN 4
#define CHAIN_LEN 1500
#define MAX_LAUNCHES (CHAIN + NCONN / 4)   /* the chain's launches, the 16 others riding along */
#endif
static void test_concurrent_clients_match_oracle(void **unused)
{
    dh_daemon d;
    dh_client blocker, c[NCONN];
    dh_seq big, s[NCONN];
    dh_layer l;
    test_rng r;
    uint64_t slot[NCONN];
    /* One cpu worker: the loop and this test keep a core to themselves while it runs the
     * chain (with a worker per core, the arrivals could queue behind the computation
     * until the chain was done). */
    dh_start_or_skip(&d, "heads: 4\nslots: 64\ncpu_threads: 1\nlog:\n  level: debug\n");
    rng_seed(&r, 2);
    dh_layer_make(&l, &r);

    dh_connect(&blocker, &d);
    dh_hello(&blocker);
    dh_register_layer(&blocker, "L", &l);
    uint64_t big_slot = dh_alloc(&blocker);
    dh_seq_make(&big, &r, CHAIN_LEN);
    for (int i = 0; i < NCONN; i++) {
        dh_connect(&c[i], &d);
        dh_hello(&c[i]);
        slot[i] = dh_alloc(&c[i]);
        dh_seq_make(&s[i], &r, 20 + 7 * (uint32_t)i);
    }
    uint32_t big_id[CHAIN];
    for (int i = 0; i < CHAIN; i++)
        big_id[i] = dh_send_prefill(&blocker, "L", big_slot, &big, CHAIN_LEN * i);
    uint32_t ids[NCONN];
    for (int i = 0; i < NCONN; i++)
        ids[i] = dh_send_prefill(&c[i], "L", slot[i], &s[i], 0);

    uint16_t *big_out = malloc(DH_TOKEN_BYTES(CHAIN_LEN)), *out[NCONN];
    for (int i = 0; i < CHAIN; i++)
        assert_int_equal(dh_recv_prefill(&blocker, big_id[i], &big, i ? NULL : big_out),
                         CHAIN_LEN * (i + 1));
    uint64_t tokens = CHAIN_LEN * CHAIN;
    for (int i = 0; i < NCONN; i++) {
        out[i] = malloc(DH_TOKEN_BYTES(s[i].len));
        assert_int_equal(dh_recv_prefill(&c[i], ids[i], &s[i], out[i]), s[i].len);
        tokens += s[i].len;
    }
    kp_stats_result st;
    dh_stats(&blocker, &st);
    assert_int_equal(st.seqs, NCONN + CHAIN);
    assert_int_equal(st.tokens, tokens);
    assert_int_equal(st.latency_count, NCONN + CHAIN);
    assert_true(st.latency_max_us >= st.latency_p50_us);
    if (st.batches > MAX_LAUNCHES)
        fail_msg("%llu launches for %d prefills: requests were not batched",
                 (unsigned long long)st.batches, NCONN + CHAIN);

    /* the chain's first request started from a zero state */
    double *state = calloc(DH_STATE_ELEMS, sizeof(double));
    double *ref = malloc((size_t)CHAIN_LEN * DH_HEADS * 128 * sizeof(double));
    dh_oracle(&l, &big, state, ref);
    double err = dh_err_bf16(big_out, ref, (size_t)CHAIN_LEN * DH_HEADS * 128);
    if (err > OUT_TOL)
        fail_msg("the long request's output error is %.2e", err);
    free(state);
    free(ref);
    for (int i = 0; i < NCONN; i++) {
        check_oracle(&c[i], &l, slot[i], &s[i], out[i]);
        free(out[i]);
    }
    free(big_out);
    for (int i = 0; i < NCONN; i++) {
        dh_close(&c[i]);
        dh_seq_free(&s[i]);
    }
    dh_close(&blocker);
    dh_seq_free(&big);
    dh_stop(&d);
}

static kp_prefill_seq inline_seq(uint64_t slot, const dh_seq *s)
{
    kp_prefill_seq q;
    memset(&q, 0, sizeof(q));
    q.slot = slot;
    q.len = s ? s->len : 0;
    if (s && s->len) {
        q.q = kp_ref_inline(s->q, DH_TOKEN_BYTES(s->len));
        q.k = kp_ref_inline(s->k, DH_TOKEN_BYTES(s->len));
        q.v = kp_ref_inline(s->v, DH_TOKEN_BYTES(s->len));
        q.g = kp_ref_inline(s->g, DH_TOKEN_BYTES(s->len));
        q.beta = kp_ref_inline(s->beta, DH_BETA_BYTES(s->len));
    }
    return q;
}

/* A phase of the stats' per-batch breakdown, which must be there. */
static const kp_phase *batch_phase(const kp_stats_result *st, const char *name)
{
    for (uint32_t i = 0; i < st->nphases; i++) {
        if (strcmp(st->phases[i].name, name) == 0)
            return &st->phases[i];
    }
    fail_msg("stats: no batch phase \"%s\" among %u", name, st->nphases);
    return NULL;
}

/* One request, three sequences: a normal one, a fresh one on an empty slot,
 * and a zero-length one that only checks its position.  Its result and the
 * stats carry the batch's timing. */
static void test_multi_sequence_request(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    dh_seq a, b;
    test_rng r;
    start(&d, NULL);
    rng_seed(&r, 3);
    dh_layer_make(&l, &r);
    dh_seq_make(&a, &r, 77);
    dh_seq_make(&b, &r, 130);
    dh_connect(&c, &d);
    dh_hello(&c);
    dh_register_layer(&c, "L", &l);
    uint64_t s0 = dh_alloc(&c), s2 = dh_alloc(&c);
    kp_slot_alloc_params ap = {1, false};
    uint32_t id = dh_id(&c);
    assert_int_equal(kp_slot_alloc_params_encode(&c.w, id, &ap, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    kp_slot_list sl;
    assert_int_equal(kp_slot_alloc_result_decode(&c.msg, &sl, NULL), KP_OK);
    uint64_t s1 = sl.slots[0];
    assert_int_equal(slot_info(&c, s1, NULL).status, KP_SLOT_EMPTY);

    kp_prefill_seq q[3] = {inline_seq(s0, &a), inline_seq(s1, &b), inline_seq(s2, NULL)};
    q[1].fresh = true;
    q[2].has_expect_pos = true;
    q[2].expect_pos = 0;
    kp_prefill_params p = {.layer = "L", .seqs = q, .nseqs = 3};
    id = dh_id(&c);
    assert_int_equal(kp_prefill_params_encode(&c.w, id, &p, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    kp_prefill_result res;
    kp_error e;
    if (kp_prefill_result_decode(&c.msg, &c.session, &p, &res, &e) != KP_OK)
        fail_msg("%s", e.message);
    assert_int_equal(res.nseqs, 3);
    assert_int_equal(res.seqs[0].pos, 77);
    assert_int_equal(res.seqs[1].pos, 130);
    assert_int_equal(res.seqs[2].pos, 0);
    assert_int_equal(res.seqs[2].out.kind, KP_REF_ABSENT);
    /* The batch's device time, of which the kernel is a part, within its run. */
    assert_true(res.timed);
    assert_true(res.device_us > 0);
    assert_true(res.kernel_us <= res.device_us);
    assert_true(res.device_us <= res.run_us + 1);
#ifndef DH_BACKEND_IS_CUDA /* the cpu backend always times kda_cpu_prefill */
    assert_true(res.kernel_us > 0);
#endif
    uint64_t run_us = res.run_us, device_us = res.device_us;
    uint16_t *oa = malloc(DH_TOKEN_BYTES(77)), *ob = malloc(DH_TOKEN_BYTES(130));
    memcpy(oa, res.seqs[0].out.data, DH_TOKEN_BYTES(77));
    memcpy(ob, res.seqs[1].out.data, DH_TOKEN_BYTES(130));

    /* Only the layer registration and this prefill ran batches so far: the
     * prefill is the one batch timed, and the stats' phases are its own. */
    kp_stats_result st;
    dh_stats(&c, &st);
    assert_true(st.has_batch_phases);
    assert_int_equal(st.batch_count, 1);
    assert_int_equal(st.batch_window, 1);
    const kp_phase *dev = batch_phase(&st, "device"), *tot = batch_phase(&st, "total");
    assert_int_equal(dev->sum_us, device_us);
    assert_int_equal(dev->p50_us, device_us);
    assert_int_equal(dev->p99_us, device_us);
    assert_true(tot->sum_us >= run_us);
    assert_true(tot->sum_us >= dev->sum_us);
    uint64_t steps = 0;
    static const char *const order[] = {"form", "stage", "launch", "wait", "notice", "unstage",
                                        "reply"};
    for (size_t i = 0; i < sizeof(order) / sizeof(order[0]); i++)
        steps += batch_phase(&st, order[i])->sum_us;
    assert_true(steps <= tot->sum_us && steps + 7 >= tot->sum_us); /* the steps add up */
#ifndef DH_BACKEND_IS_CUDA /* a GPU may start the batch before its last enqueue call returns */
    assert_true(batch_phase(&st, "wait")->sum_us >= device_us);
#endif
    assert_int_equal(batch_phase(&st, "host")->sum_us, tot->sum_us - dev->sum_us);
    assert_true(batch_phase(&st, "kernel")->sum_us <= dev->sum_us);

    check_oracle(&c, &l, s0, &a, oa);
    check_oracle(&c, &l, s1, &b, ob);
    assert_int_equal(slot_info(&c, s1, NULL).status, KP_SLOT_READY);
    free(oa);
    free(ob);
    dh_seq_free(&a);
    dh_seq_free(&b);
    dh_close(&c);
    dh_stop(&d);
}

/* One prefill of 1000 tokens equals 300 + 300 + 400 on the same slot,
 * pipelined with expect_pos, to rounding; both match the oracle. */
static void test_chunked_continuation(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    dh_seq all;
    test_rng r;
    start(&d, NULL);
    rng_seed(&r, 4);
    dh_layer_make(&l, &r);
    dh_seq_make(&all, &r, 1000);
    dh_connect(&c, &d);
    dh_hello(&c);
    dh_register_layer(&c, "L", &l);
    uint64_t one = dh_alloc(&c), chunked = dh_alloc(&c);

    uint16_t *whole = malloc(DH_TOKEN_BYTES(1000)), *parts = malloc(DH_TOKEN_BYTES(1000));
    uint32_t id = dh_send_prefill(&c, "L", one, &all, 0);
    assert_int_equal(dh_recv_prefill(&c, id, &all, whole), 1000);

    const uint32_t cut[4] = {0, 300, 600, 1000};
    dh_seq chunk[3];
    uint32_t ids[3];
    for (int i = 0; i < 3; i++) {
        chunk[i] = dh_seq_slice(&all, cut[i], cut[i + 1] - cut[i]);
        ids[i] = dh_send_prefill(&c, "L", chunked, &chunk[i], cut[i]);
    }
    for (int i = 0; i < 3; i++)
        assert_int_equal(dh_recv_prefill(&c, ids[i], &chunk[i],
                                         parts + (size_t)cut[i] * DH_HEADS * 128),
                         cut[i + 1]);

    size_t n = (size_t)1000 * DH_HEADS * 128;
    double *ref = malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++)
        ref[i] = kda_bf16_to_f32(whole[i]);
    double diff = dh_err_bf16(parts, ref, n);
    if (diff > OUT_TOL)
        fail_msg("one prefill and three chunks differ: rel RMS %.2e", diff);
    float *s1 = malloc(DH_STATE_ELEMS * sizeof(float)), *s2 = malloc(DH_STATE_ELEMS * sizeof(float));
    double *sref = malloc(DH_STATE_ELEMS * sizeof(double));
    assert_int_equal(dh_read_state(&c, one, s1), 1000);
    assert_int_equal(dh_read_state(&c, chunked, s2), 1000);
    for (size_t i = 0; i < DH_STATE_ELEMS; i++)
        sref[i] = s1[i];
    diff = dh_err_f32(s2, sref, DH_STATE_ELEMS);
    if (diff > STATE_TOL)
        fail_msg("final states of one prefill and three chunks differ: rel RMS %.2e", diff);
    check_oracle(&c, &l, one, &all, whole);
    check_oracle(&c, &l, chunked, &all, parts);
    free(ref);
    free(sref);
    free(s1);
    free(s2);
    free(whole);
    free(parts);
    dh_seq_free(&all);
    dh_close(&c);
    dh_stop(&d);
}

static void write_state(dh_client *c, uint64_t slot, uint64_t pos, kp_dtype dtype,
                        const void *state)
{
    dh_write_state(c, slot, pos, dtype,
                   kp_ref_inline(state, DH_STATE_ELEMS * kp_dtype_size(dtype)));
}

/* Runs the same tokens on several slots: the outputs must be identical. */
static void same_continuation(dh_client *c, const uint64_t *slots, int n, const dh_seq *s,
                              uint64_t pos)
{
    uint16_t *first = malloc(DH_TOKEN_BYTES(s->len)), *out = malloc(DH_TOKEN_BYTES(s->len));
    uint32_t ids[8];
    for (int i = 0; i < n; i++)
        ids[i] = dh_send_prefill(c, "L", slots[i], s, (int64_t)pos);
    for (int i = 0; i < n; i++) {
        assert_int_equal(dh_recv_prefill(c, ids[i], s, i ? out : first), pos + s->len);
        if (i)
            assert_memory_equal(first, out, DH_TOKEN_BYTES(s->len));
    }
    free(first);
    free(out);
}

static void test_fork_snapshot_restore(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    dh_seq s, next, last;
    test_rng r;
    uint64_t pos;
    start(&d, NULL);
    rng_seed(&r, 5);
    dh_layer_make(&l, &r);
    dh_seq_make(&s, &r, 200);
    dh_seq_make(&next, &r, 64);
    dh_seq_make(&last, &r, 32);
    dh_connect(&c, &d);
    dh_hello(&c);
    dh_register_layer(&c, "L", &l);
    uint64_t a = dh_alloc(&c), dst = dh_alloc(&c);
    uint32_t id = dh_send_prefill(&c, "L", a, &s, 0);
    dh_recv_prefill(&c, id, &s, NULL);

    /* fork into a new slot and into an existing one */
    uint64_t f = dh_fork(&c, a, NULL, &pos);
    assert_int_equal(pos, 200);
    assert_true(f != a && f != dst);
    assert_int_equal(dh_fork(&c, a, &dst, &pos), dst);
    assert_int_equal(slot_info(&c, dst, NULL).pos, 200);
    uint64_t three[3] = {a, f, dst};
    same_continuation(&c, three, 3, &next, 200);

    /* snapshot (f32, exact) and restore into another slot */
    float *snap = malloc(DH_STATE_ELEMS * sizeof(float)), *back = malloc(DH_STATE_ELEMS * 4);
    assert_int_equal(dh_read_state(&c, a, snap), 264);
    uint64_t w = dh_alloc(&c);
    write_state(&c, w, 264, KP_DTYPE_F32, snap);
    kp_slot_info info = slot_info(&c, w, NULL);
    assert_int_equal(info.pos, 264);
    assert_int_equal(info.status, KP_SLOT_READY);
    assert_int_equal(dh_read_state(&c, w, back), 264);
    assert_memory_equal(snap, back, DH_STATE_ELEMS * sizeof(float));
    uint64_t two[2] = {a, w};
    same_continuation(&c, two, 2, &last, 264);

    /* a bf16 snapshot restores exactly its bf16 values into the f32 pool */
    uint16_t *half = malloc(DH_STATE_ELEMS * 2);
    dh_read_state_as(&c, a, KP_DTYPE_BF16, half);
    assert_int_equal(dh_read_state(&c, a, snap), 296);
    for (size_t i = 0; i < DH_STATE_ELEMS; i++)
        assert_int_equal(half[i], kda_f32_to_bf16(snap[i]));
    uint64_t x = dh_alloc(&c);
    write_state(&c, x, 7, KP_DTYPE_BF16, half);
    assert_int_equal(dh_read_state(&c, x, back), 7);
    for (size_t i = 0; i < DH_STATE_ELEMS; i++)
        assert_true(back[i] == kda_bf16_to_f32(half[i]));

    /* a new slot reads as zeros, and so does its fork */
    uint64_t z = dh_alloc(&c);
    uint64_t zf = dh_fork(&c, z, NULL, &pos);
    assert_int_equal(pos, 0);
    assert_int_equal(dh_read_state(&c, zf, back), 0);
    for (size_t i = 0; i < DH_STATE_ELEMS; i++)
        assert_true(back[i] == 0.0f);

    /* forks that cannot be */
    kp_slot_alloc_params ap = {1, false};
    id = dh_id(&c);
    assert_int_equal(kp_slot_alloc_params_encode(&c.w, id, &ap, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    kp_slot_list sl;
    assert_int_equal(kp_slot_alloc_result_decode(&c.msg, &sl, NULL), KP_OK);
    uint64_t empty = sl.slots[0];
    uint32_t free_before, free_after;
    slot_info(&c, a, &free_before);
    kp_slot_fork_params fp = {empty, false, 0};
    id = dh_id(&c);
    assert_int_equal(kp_slot_fork_params_encode(&c.w, id, &fp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_error(&c, id, KP_E_STATE_LOST, "empty");
    /* the destination allocated for the failed fork went back to the pool */
    slot_info(&c, a, &free_after);
    assert_int_equal(free_before, free_after);
    fp = (kp_slot_fork_params){a, true, a};
    id = dh_id(&c);
    assert_int_equal(kp_slot_fork_params_encode(&c.w, id, &fp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_error(&c, id, KP_E_INVALID_PARAMS, "same slot");

    free(snap);
    free(back);
    free(half);
    dh_seq_free(&s);
    dh_seq_free(&next);
    dh_seq_free(&last);
    dh_close(&c);
    dh_stop(&d);
}

static uint32_t send_slot_list(dh_client *c, kp_method m, const uint64_t *slots, uint32_t n)
{
    kp_slot_list p = {slots, n};
    uint32_t id = dh_id(c);
    if (m == KP_METHOD_SLOT_FREE)
        assert_int_equal(kp_slot_free_params_encode(&c->w, id, &p, NULL), KP_OK);
    else
        assert_int_equal(kp_slot_reset_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    return id;
}

static uint32_t send_alloc(dh_client *c, uint32_t count, bool zero)
{
    kp_slot_alloc_params p = {count, zero};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_slot_alloc_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    return id;
}

static void test_handles_positions_and_quotas(void **unused)
{
    dh_daemon d;
    dh_client c, other;
    dh_layer l;
    dh_seq s, t;
    test_rng r;
    start(&d, "limits:\n  max_batch_tokens: 512\n  max_slots_per_client: 10\n");
    rng_seed(&r, 6);
    dh_layer_make(&l, &r);
    dh_seq_make(&s, &r, 100);
    dh_seq_make(&t, &r, 600);
    dh_connect(&c, &d);
    dh_hello(&c);
    dh_register_layer(&c, "L", &l);
    uint64_t a = dh_alloc(&c);

    /* unknown, stale and zero handles */
    uint32_t id = dh_send_prefill(&c, "L", ((uint64_t)1 << 32) | 1000, &s, -1);
    dh_expect_error(&c, id, KP_E_UNKNOWN_SLOT, "outside the pool of 64");
    id = dh_send_prefill(&c, "L", 0, &s, -1);
    dh_expect_error(&c, id, KP_E_STALE_SLOT, "stale");
    uint64_t gone = dh_alloc(&c);
    id = send_slot_list(&c, KP_METHOD_SLOT_FREE, &gone, 1);
    dh_expect_result(&c, id);
    id = dh_send_prefill(&c, "L", gone, &s, -1);
    dh_expect_error(&c, id, KP_E_STALE_SLOT, "seqs[0].slot");
    id = send_slot_list(&c, KP_METHOD_SLOT_FREE, &gone, 1);
    dh_expect_error(&c, id, KP_E_STALE_SLOT, "slots[0]");
    id = dh_send_prefill(&c, "nope", a, &s, -1);
    dh_expect_error(&c, id, KP_E_UNKNOWN_LAYER, "nope");
    id = dh_send_prefill(&c, "L", a, &t, -1);
    dh_expect_error(&c, id, KP_E_INVALID_PARAMS, "seqs[0].len: 600 is outside [0, 512]");
    dh_seq half = dh_seq_slice(&t, 0, 300);
    kp_prefill_seq two[2] = {inline_seq(a, &half), inline_seq(gone, &half)};
    kp_prefill_params over = {.layer = "L", .seqs = two, .nseqs = 2};
    id = dh_id(&c);
    assert_int_equal(kp_prefill_params_encode(&c.w, id, &over, NULL), KP_OK);
    dh_send(&c);
    dh_expect_error(&c, id, KP_E_LIMIT_EXCEEDED, "600 tokens in total exceed max_batch_tokens 512");

    /* a wrong expect_pos changes nothing; a pipelined chain after it fails too */
    id = dh_send_prefill(&c, "L", a, &s, 5);
    dh_expect_error(&c, id, KP_E_POSITION_MISMATCH, "is at position 0, expect_pos 5");
    uint32_t chain[3] = {dh_send_prefill(&c, "L", a, &s, 7), dh_send_prefill(&c, "L", a, &s, 107),
                         dh_send_prefill(&c, "L", a, &s, 207)};
    for (int i = 0; i < 3; i++)
        dh_expect_error(&c, chain[i], KP_E_POSITION_MISMATCH, "is at position 0");
    assert_int_equal(slot_info(&c, a, NULL).pos, 0);
    id = dh_send_prefill(&c, "L", a, &s, 0);
    assert_int_equal(dh_recv_prefill(&c, id, &s, NULL), 100);

    /* reset returns to position 0 with a zero state */
    id = send_slot_list(&c, KP_METHOD_SLOT_RESET, &a, 1);
    dh_expect_result(&c, id);
    float *st = malloc(DH_STATE_ELEMS * sizeof(float));
    assert_int_equal(dh_read_state(&c, a, st), 0);
    for (size_t i = 0; i < DH_STATE_ELEMS; i++)
        assert_true(st[i] == 0.0f);
    free(st);

    /* an empty slot has no state to continue, but can start fresh */
    id = send_alloc(&c, 1, false);
    dh_expect_result(&c, id);
    kp_slot_list sl;
    assert_int_equal(kp_slot_alloc_result_decode(&c.msg, &sl, NULL), KP_OK);
    uint64_t e = sl.slots[0];
    id = dh_send_prefill(&c, "L", e, &s, -1);
    dh_expect_error(&c, id, KP_E_STATE_LOST, "empty");
    kp_prefill_seq q = inline_seq(e, &s);
    q.fresh = true;
    kp_prefill_params p = {.layer = "L", .seqs = &q, .nseqs = 1};
    id = dh_id(&c);
    assert_int_equal(kp_prefill_params_encode(&c.w, id, &p, NULL), KP_OK);
    dh_send(&c);
    assert_int_equal(dh_recv_prefill(&c, id, &s, NULL), 100);

    /* a prefill and a free pipelined on one slot: both run, in order */
    id = dh_send_prefill(&c, "L", e, &s, 100);
    uint32_t fid = send_slot_list(&c, KP_METHOD_SLOT_FREE, &e, 1);
    assert_int_equal(dh_recv_prefill(&c, id, &s, NULL), 200);
    dh_expect_result(&c, fid);

    /* other connections cannot touch our slots */
    dh_connect(&other, &d);
    dh_hello(&other);
    id = dh_send_prefill(&other, "L", a, &s, -1);
    dh_expect_error(&other, id, KP_E_PERMISSION_DENIED, "another client");

    /* quota: 10 per client (we hold 1), and the pool of 64 */
    id = send_alloc(&c, 10, true);
    dh_expect_error(&c, id, KP_E_QUOTA_EXCEEDED, "max_slots_per_client 10");
    id = send_alloc(&c, 9, true);
    dh_expect_result(&c, id);
    dh_close(&c);
    uint32_t pool_free = 0;
    for (int tries = 0; tries < 200 && pool_free != 64; tries++) {
        uint64_t mine = dh_alloc(&other);
        slot_info(&other, mine, &pool_free);
        pool_free++; /* ours */
        id = send_slot_list(&other, KP_METHOD_SLOT_FREE, &mine, 1);
        dh_expect_result(&other, id);
        if (pool_free != 64)
            usleep(10000);
    }
    assert_int_equal(pool_free, 64); /* the closed connection's slots came back */

    dh_seq_free(&s);
    dh_seq_free(&t);
    dh_close(&other);
    dh_stop(&d);
}

/* layer.register: created, or false for the same weights again. */
/*
 * Layers count registrations: two clients (two kdactl runs, two workers of a
 * serving stack) registering the same weights each hold one, and the first
 * one's drop leaves the layer to the second.  Other weights under a live
 * name are refused; a request in flight keeps the weights it admitted.
 */
static void test_layer_registrations(void **unused)
{
    dh_daemon d;
    dh_client a, b;
    dh_layer l, other;
    dh_seq s;
    test_rng r;
    uint16_t *out = malloc(DH_TOKEN_BYTES(64));
    start(&d, NULL);
    rng_seed(&r, 21);
    dh_layer_make(&l, &r);
    dh_layer_make(&other, &r);
    dh_seq_make(&s, &r, 64);
    dh_connect(&a, &d);
    dh_hello(&a);
    dh_connect(&b, &d);
    dh_hello(&b);

    assert_true(dh_register_layer(&a, "L", &l));
    assert_false(dh_register_layer(&b, "L", &l));
    kp_layer_drop_result dr = expect_drop(&a, send_drop(&a, "L"));
    assert_false(dr.removed);
    assert_int_equal(dr.registrations, 1); /* b's */
    uint64_t slot = dh_alloc(&b);
    uint32_t id = dh_send_prefill(&b, "L", slot, &s, 0);
    assert_int_equal(dh_recv_prefill(&b, id, &s, out), 64);
    check_oracle(&b, &l, slot, &s, out);

    /* other weights under the live name: refused, the layer unchanged */
    kp_layer_register_params op = {"L", kp_ref_inline(other.A_log, sizeof(other.A_log)),
                                   kp_ref_inline(other.dt_bias, sizeof(other.dt_bias)),
                                   other.lower_bound, other.scale};
    id = dh_id(&a);
    assert_int_equal(kp_layer_register_params_encode(&a.w, id, &op, NULL), KP_OK);
    dh_send(&a);
    dh_expect_error(&a, id, KP_E_LAYER_EXISTS, "with other weights (registrations: 1)");

    /* the last drop while a prefill that uses the layer waits for its ready word: the name
       goes, the weights stay with the prefill (the drop says so), which runs with them */
    uint64_t fresh = dh_alloc(&b);
    int fd = dh_memfd(4096, true);
    uint64_t *word = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(word != MAP_FAILED);
    kp_sem ready = {true, dh_register_shm(&b, fd, 4096), 0, 1};
    id = b.semaphores ? dh_send_prefill_ready(&b, "L", fresh, &s, 0, &ready)
                      : dh_send_prefill(&b, "L", fresh, &s, 0);
    dr = expect_drop(&b, send_drop(&b, "L"));
    assert_true(dr.removed);
    assert_int_equal(dr.registrations, 0);
    if (b.semaphores) /* (without a ready word the prefill may be done by then) */
        assert_int_equal(dr.in_use, 1);
    __atomic_store_n(word, 1, __ATOMIC_RELEASE);
    assert_int_equal(dh_recv_prefill(&b, id, &s, out), 64);
    check_oracle(&b, &l, fresh, &s, out);
    munmap(word, 4096);
    close(fd);
    id = dh_send_prefill(&b, "L", fresh, &s, 64);
    dh_expect_error(&b, id, KP_E_UNKNOWN_LAYER, "no layer \"L\"");
    dh_expect_error(&b, send_drop(&b, "L"), KP_E_UNKNOWN_LAYER, "has no layer \"L\"");

    /* now free: other weights may take the name */
    assert_true(dh_register_layer(&a, "L", &other));

    free(out);
    dh_seq_free(&s);
    dh_close(&a);
    dh_close(&b);
    dh_stop(&d);
}

/* limits.max_layers_per_uid: announced in hello (as is max_slots_per_uid),
 * counted over a uid's connections, below the daemon-wide max_layers.
 * (Other uids: test_access.) */
static void test_layers_per_uid(void **unused)
{
    dh_daemon d;
    dh_client a, b;
    dh_layer l;
    test_rng r;
    start(&d, "limits:\n  max_layers: 5\n  max_layers_per_uid: 3\n");
    rng_seed(&r, 23);
    dh_layer_make(&l, &r);
    dh_connect(&a, &d);
    dh_hello(&a);
    dh_connect(&b, &d);
    dh_hello(&b);
    assert_int_equal(a.session.limits.max_layers, 5);
    assert_int_equal(a.session.limits.max_layers_per_uid, 3);
    assert_int_equal(a.session.limits.max_slots_per_uid, 64); /* 0 in the file: the pool */
    assert_true(dh_register_layer(&a, "L0", &l));
    assert_true(dh_register_layer(&a, "L1", &l));
    assert_true(dh_register_layer(&b, "L2", &l));
    kp_layer_register_params lp = {"L3", kp_ref_inline(l.A_log, sizeof(l.A_log)),
                                   kp_ref_inline(l.dt_bias, sizeof(l.dt_bias)), l.lower_bound,
                                   l.scale};
    uint32_t id = dh_id(&b);
    assert_int_equal(kp_layer_register_params_encode(&b.w, id, &lp, NULL), KP_OK);
    dh_send(&b);
    dh_expect_error(&b, id, KP_E_QUOTA_EXCEEDED, "holds 3 layers, limits.max_layers_per_uid");
    assert_false(dh_register_layer(&b, "L2", &l)); /* another registration is not another layer */
    kp_stats_result st;
    dh_stats(&a, &st); /* what the uid holds: in stats */
    assert_true(st.has_uid);
    assert_int_equal(st.uid, getuid());
    assert_int_equal(st.uid_layers, 3);
    assert_int_equal(st.uid_slots, 0);
    assert_int_equal(st.layers, 3);
    /* a name given back is room again */
    dh_expect_result(&a, send_drop(&a, "L0"));
    assert_true(dh_register_layer(&b, "L3", &l));
    dh_close(&a);
    dh_close(&b);
    dh_stop(&d);
}

/* A position never wraps: a prefill that would carry a slot past 2^64 - 1
 * tokens is refused (LIMIT_EXCEEDED) and leaves the slot as it was. */
static void test_position_limit(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    dh_seq s;
    test_rng r;
    start(&d, NULL);
    rng_seed(&r, 22);
    dh_layer_make(&l, &r);
    dh_seq_make(&s, &r, 5);
    dh_connect(&c, &d);
    dh_hello(&c);
    dh_register_layer(&c, "L", &l);
    uint64_t slot = dh_alloc(&c);
    float *state = malloc(DH_STATE_ELEMS * sizeof(float));
    float *back = malloc(DH_STATE_ELEMS * sizeof(float));
    for (size_t i = 0; i < DH_STATE_ELEMS; i++)
        state[i] = (float)(i % 97) / 97.0f - 0.5f;
    write_state(&c, slot, UINT64_MAX - 1, KP_DTYPE_F32, state);
    uint32_t id = dh_send_prefill(&c, "L", slot, &s, -1);
    dh_expect_error(&c, id, KP_E_LIMIT_EXCEEDED, "is at position 18446744073709551614: 5 more "
                    "tokens would pass the last position");
    assert_true(slot_info(&c, slot, NULL).pos == UINT64_MAX - 1);
    assert_true(dh_read_state(&c, slot, back) == UINT64_MAX - 1);
    assert_memory_equal(back, state, DH_STATE_ELEMS * sizeof(float));
    /* one token fits exactly; nothing more after it */
    dh_seq one = dh_seq_slice(&s, 0, 1);
    id = dh_send_prefill(&c, "L", slot, &one, -1);
    assert_true(dh_recv_prefill(&c, id, &one, NULL) == UINT64_MAX);
    id = dh_send_prefill(&c, "L", slot, &one, -1);
    dh_expect_error(&c, id, KP_E_LIMIT_EXCEEDED, "2^64 - 1");
    free(state);
    free(back);
    dh_seq_free(&s);
    dh_close(&c);
    dh_stop(&d);
}

/* A client that vanishes mid-request (or mid-frame) costs nobody else. */
static void test_disconnect_mid_request(void **unused)
{
    dh_daemon d;
    dh_client gone, half, c;
    dh_layer l;
    dh_seq big, s;
    test_rng r;
    start(&d, NULL);
    rng_seed(&r, 7);
    dh_layer_make(&l, &r);
    dh_seq_make(&big, &r, 2000);
    dh_seq_make(&s, &r, 50);

    dh_connect(&gone, &d);
    dh_hello(&gone);
    dh_register_layer(&gone, "L", &l);
    uint64_t gs = dh_alloc(&gone);
    dh_send_prefill(&gone, "L", gs, &big, 0);
    dh_send_prefill(&gone, "L", gs, &big, 2000); /* queued behind the first */
    dh_close(&gone);

    dh_connect(&half, &d);
    dh_hello(&half);
    kp_health_params_encode(&half.w, dh_id(&half), NULL);
    uint8_t *frame;
    size_t len;
    assert_int_equal(kp_writer_flatten(&half.w, &frame, &len, NULL), KP_OK);
    dh_write(&half, frame, 2); /* half a length prefix */
    free(frame);
    dh_close(&half);
    dh_connect(&half, &d);
    dh_hello(&half);
    dh_send_prefill(&half, "L", 0, &s, -1);
    shutdown(half.fd, SHUT_RDWR); /* a whole request, then gone before the answer */
    dh_close(&half);

    dh_connect(&c, &d);
    dh_hello(&c);
    uint64_t mine = dh_alloc(&c);
    uint16_t *out = malloc(DH_TOKEN_BYTES(50));
    uint32_t id = dh_send_prefill(&c, "L", mine, &s, 0);
    assert_int_equal(dh_recv_prefill(&c, id, &s, out), 50);
    check_oracle(&c, &l, mine, &s, out);

    /* the vanished client's slot returns once its running request is done */
    uint32_t pool_free = 0;
    for (int tries = 0; tries < 1000 && pool_free != 63; tries++) {
        slot_info(&c, mine, &pool_free);
        if (pool_free != 63)
            usleep(20000);
    }
    assert_int_equal(pool_free, 63);
    kp_stats_result st;
    dh_stats(&c, &st);
    assert_true(dh_counter(st.disconnects, st.ndisconnects, "peer_closed") >= 3);
    assert_int_equal(st.connections, 1);
    free(out);
    dh_seq_free(&big);
    dh_seq_free(&s);
    dh_close(&c);
    dh_stop(&d);
}

/* Raw bytes on a fresh connection: the daemon answers with `code` (a
 * goodbye, or an error response on `id` first when id != 0). */
static void expect_refused(const dh_daemon *d, bool hello, const void *bytes, size_t n,
                           uint32_t id, int code, const char *substr)
{
    dh_client c;
    dh_connect(&c, d);
    if (hello)
        dh_hello(&c);
    dh_write(&c, bytes, n);
    if (id)
        dh_expect_error(&c, id, code, substr);
    dh_expect_goodbye(&c, code, substr);
    dh_close(&c);
}

static void test_malformed_frames(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    dh_seq s, big;
    test_rng r;
    start(&d, NULL);

    /* msgpack-c issue 1013: five bytes asking for ~96 GB */
    static const uint8_t bomb[] = {0, 0, 0, 5, 0xdd, 0xff, 0xff, 0xff, 0xff};
    expect_refused(&d, false, bomb, sizeof(bomb), 0, KP_E_PROTOCOL, "announces");
    static const uint8_t empty[] = {0, 0, 0, 0};
    expect_refused(&d, false, empty, sizeof(empty), 0, KP_E_PROTOCOL, "empty frame");
    static const uint8_t big_before_hello[] = {0, 1, 0, 1};
    expect_refused(&d, false, big_before_hello, sizeof(big_before_hello), 0,
                   KP_E_FRAME_TOO_LARGE, "65537");
    static const uint8_t nil[] = {0, 0, 0, 1, 0xc0};
    expect_refused(&d, true, nil, sizeof(nil), 0, KP_E_PROTOCOL, "expected an array");
    /* [0, 7, "health", 5]: params not a map, answered on the id, then closed */
    static const uint8_t not_map[] = {0, 0, 0, 10, 0x94, 0, 7, 0xa6, 'h', 'e', 'a', 'l', 't',
                                      'h', 5};
    expect_refused(&d, true, not_map, sizeof(not_map) - 1, 0, KP_E_PROTOCOL, "truncated");
    uint8_t fixed[sizeof(not_map)];
    memcpy(fixed, not_map, sizeof(fixed));
    fixed[3] = 11;
    expect_refused(&d, true, fixed, sizeof(fixed), 7, KP_E_PROTOCOL, "params: expected a map");
    uint8_t deep[4 + 17 + 1] = {0, 0, 0, 18};
    memset(deep + 4, 0x91, 17);
    deep[21] = 0xc0;
    expect_refused(&d, true, deep, sizeof(deep), 0, KP_E_PROTOCOL, "deeper than 16");
    static const uint8_t ext[] = {0, 0, 0, 3, 0xd4, 1, 2};
    expect_refused(&d, true, ext, sizeof(ext), 0, KP_E_PROTOCOL, "ext types");
    /* [2, "hello", {}]: clients send no notifications */
    static const uint8_t note[] = {0, 0, 0, 9, 0x93, 2, 0xa5, 'h', 'e', 'l', 'l', 'o', 0x80};
    expect_refused(&d, true, note, sizeof(note), 0, KP_E_PROTOCOL, "requests only");
    /* no version in common */
    dh_connect(&c, &d);
    kp_hello_params hp = {{9}, 1, NULL};
    assert_int_equal(kp_hello_params_encode(&c.w, 1, &hp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_error(&c, 1, KP_E_UNSUPPORTED_VERSION, "[9]");
    dh_expect_goodbye(&c, KP_E_UNSUPPORTED_VERSION, NULL);
    dh_close(&c);

    /* errors that keep the connection: unknown method and field, wrong sizes */
    dh_connect(&c, &d);
    dh_hello(&c);
    static const uint8_t unknown[] = {0, 0, 0, 10, 0x94, 0, 9, 0xa5, 'f', 'l', 'y', 'n', 'g', 0x80};
    dh_write(&c, unknown, sizeof(unknown));
    dh_expect_error(&c, 9, KP_E_UNKNOWN_METHOD, "\"flyng\"");
    /* [0, 10, "health", {"x": true}] */
    static const uint8_t field[] = {0, 0, 0, 14, 0x94, 0, 10, 0xa6, 'h', 'e', 'a', 'l', 't', 'h',
                                    0x81, 0xa1, 'x', 0xc3};
    dh_write(&c, field, sizeof(field));
    dh_expect_error(&c, 10, KP_E_INVALID_PARAMS, "unknown field \"x\"");
    rng_seed(&r, 8);
    dh_layer_make(&l, &r);
    dh_register_layer(&c, "L", &l);
    dh_seq_make(&s, &r, 12);
    uint64_t slot = dh_alloc(&c);
    kp_prefill_seq q = inline_seq(slot, &s);
    q.q.nbytes = 100;
    kp_prefill_params p = {.layer = "L", .seqs = &q, .nseqs = 1};
    uint32_t id = dh_id(&c);
    assert_int_equal(kp_prefill_params_encode(&c.w, id, &p, NULL), KP_OK);
    dh_send(&c);
    dh_expect_error(&c, id, KP_E_INVALID_PARAMS, "seqs[0].q: expected 12288 bytes");

    /* reusing an id that is still in flight ends the connection */
    dh_seq_make(&big, &r, 3000);
    id = dh_send_prefill(&c, "L", slot, &big, 0);
    assert_int_equal(kp_health_params_encode(&c.w, id, NULL), KP_OK);
    dh_send(&c);
    /* the prefill's answer may come first; the goodbye must come */
    assert_true(dh_recv(&c));
    if (c.msg.kind == KP_MSG_RESPONSE)
        assert_true(dh_recv(&c));
    kp_error remote, e;
    assert_int_equal(kp_goodbye_decode(&c.msg, &remote, &e), KP_OK);
    assert_int_equal(remote.code, KP_E_PROTOCOL);
    assert_non_null(strstr(remote.message, "already in flight"));
    dh_close(&c);

    /* and the daemon still serves everyone else */
    dh_connect(&c, &d);
    dh_hello(&c);
    slot = dh_alloc(&c);
    uint16_t *out = malloc(DH_TOKEN_BYTES(12));
    dh_register_layer(&c, "L", &l);
    id = dh_send_prefill(&c, "L", slot, &s, 0);
    assert_int_equal(dh_recv_prefill(&c, id, &s, out), 12);
    check_oracle(&c, &l, slot, &s, out);
    kp_stats_result st;
    dh_stats(&c, &st);
    assert_true(dh_counter(st.disconnects, st.ndisconnects, "protocol") >= 8);
    assert_true(dh_counter(st.errors, st.nerrors, "UNKNOWN_METHOD") == 1);
    free(out);
    dh_seq_free(&s);
    dh_seq_free(&big);
    dh_close(&c);
    dh_stop(&d);
}

/* The drain test: a prefill gated on a ready word, DRAIN_CHAIN more behind it on its slot. */
#define DRAIN_CHAIN 4
#define DRAIN_LEN 64
typedef struct drain_seen {
    uint32_t first_id;          /* ids first_id .. first_id + DRAIN_CHAIN: the prefills */
    uint64_t pos[DRAIN_CHAIN + 1];
    uint32_t answered;
    uint32_t health_id;         /* a health request whose answer we wait for */
    int health_status;          /* its status, -1 until answered */
    uint32_t refused_id;
    bool refused;
    int goodbyes;
} drain_seen;

/* Reads one frame and records it; false at EOF. */
static bool drain_read(dh_client *c, drain_seen *v)
{
    if (!dh_recv(c))
        return false;
    kp_error remote, e;
    if (c->msg.kind == KP_MSG_NOTIFICATION) {
        assert_int_equal(kp_goodbye_decode(&c->msg, &remote, &e), KP_OK);
        assert_int_equal(remote.code, KP_E_SHUTTING_DOWN);
        v->goodbyes++;
        return true;
    }
    assert_int_equal(v->goodbyes, 0); /* nothing after the goodbye */
    uint32_t id = c->msg.id;
    if (id == v->refused_id) {
        assert_int_equal(kp_response_error_decode(&c->msg, &remote, &e), KP_OK);
        assert_int_equal(remote.code, KP_E_SHUTTING_DOWN);
        v->refused = true;
        return true;
    }
    assert_null(c->msg.error);
    if (id == v->health_id) {
        kp_health_result hr;
        assert_int_equal(kp_health_result_decode(&c->msg, &hr, NULL), KP_OK);
        v->health_status = (int)hr.status;
        return true;
    }
    assert_true(id >= v->first_id && id <= v->first_id + DRAIN_CHAIN);
    kp_prefill_seq q;
    memset(&q, 0, sizeof(q));
    q.len = DRAIN_LEN;
    kp_prefill_params req = {.layer = "L", .seqs = &q, .nseqs = 1};
    kp_prefill_result res;
    assert_int_equal(kp_prefill_result_decode(&c->msg, &c->session, &req, &res, NULL), KP_OK);
    v->pos[id - v->first_id] = res.seqs[0].pos;
    v->answered++;
    return true;
}

/* Sends health and reads until its answer; returns its status. */
static int drain_health(dh_client *c, drain_seen *v)
{
    v->health_id = dh_id(c);
    v->health_status = -1;
    assert_int_equal(kp_health_params_encode(&c->w, v->health_id, NULL), KP_OK);
    dh_send(c);
    while (v->health_status < 0)
        assert_true(drain_read(c, v));
    return v->health_status;
}

/* SIGTERM: admitted work finishes and is answered, new work is refused, a
 * goodbye closes every connection, and kdad exits 0.  The admitted work is
 * a prefill gated on a ready word in shared memory and a chain behind it on
 * its slot: nothing of it can finish before the word is written, which the
 * test does only once it has seen new work refused. */
static void test_sigterm_drains(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    dh_seq s;
    test_rng r;
    drain_seen v;
    memset(&v, 0, sizeof(v));
    start(&d, NULL);
    rng_seed(&r, 9);
    dh_layer_make(&l, &r);
    dh_seq_make(&s, &r, DRAIN_LEN);
    dh_connect(&c, &d);
    dh_hello(&c);
    if (!c.semaphores) { /* a cuda driver without stream memory operations */
        print_message("kdad does not announce %s: no ready word to hold the drain\n",
                      KP_FEATURE_PREFILL_SEMAPHORES);
        dh_close(&c);
        dh_stop(&d);
        skip();
    }
    dh_register_layer(&c, "L", &l);
    int fd = dh_memfd(4096, true);
    uint64_t *word = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(word != MAP_FAILED);
    kp_sem ready = {true, dh_register_shm(&c, fd, 4096), 0, 1};
    uint64_t a = dh_alloc(&c);
    v.first_id = dh_send_prefill_ready(&c, "L", a, &s, 0, &ready);
    for (uint32_t i = 1; i <= DRAIN_CHAIN; i++)
        dh_send_prefill(&c, "L", a, &s, (int64_t)DRAIN_LEN * i);
    v.refused_id = UINT32_MAX;
    assert_int_equal(drain_health(&c, &v), KP_HEALTH_OK); /* all admitted by now */

    kill(d.pid, SIGTERM);
    while (drain_health(&c, &v) == KP_HEALTH_OK)
        usleep(2000);
    kp_slot_alloc_params p = {1, true};
    v.refused_id = dh_id(&c);
    assert_int_equal(kp_slot_alloc_params_encode(&c.w, v.refused_id, &p, NULL), KP_OK);
    dh_send(&c);
    while (!v.refused)
        assert_true(drain_read(&c, &v));
    assert_int_equal(v.answered, 0); /* still held by the word */

    __atomic_store_n(word, 1, __ATOMIC_RELEASE);
    while (drain_read(&c, &v))
        ;
    assert_int_equal(v.answered, DRAIN_CHAIN + 1);
    for (uint32_t i = 0; i <= DRAIN_CHAIN; i++)
        assert_int_equal(v.pos[i], (uint64_t)DRAIN_LEN * (i + 1));
    assert_int_equal(v.goodbyes, 1);
    dh_seq_free(&s);
    dh_close(&c);
    munmap(word, 4096);
    close(fd);
    dh_expect_exit(&d, 0); /* it exits by itself after the drain */
}

/* SIGTERM the moment the socket first accepts: kdad must already handle it
 * (drain, exit 0), not die of the default action.  The socket is polled
 * without sleeping so the signal lands as early as a client could send it. */
static void test_sigterm_at_first_accept(void **unused)
{
    enum { ROUNDS = 20 };
    for (int round = 0; round < ROUNDS; round++) {
        dh_daemon d;
        dh_spawn(&d, base_yaml);
        while (!dh_accepts(&d)) {
            int status;
            if (waitpid(d.pid, &status, WNOHANG) == d.pid) {
                if (WIFEXITED(status) && WEXITSTATUS(status) == 69)
                    skip(); /* the backend is unavailable */
                fail_msg("round %d: kdad exited during start-up (status 0x%x)", round, status);
            }
        }
        kill(d.pid, SIGTERM);
        dh_expect_exit(&d, 0); /* -1 (and the log printed) if the signal killed it */
    }
}

static void write_layer_file(const char *path, const dh_layer *l, const char *a_name)
{
    st_writer *w = st_writer_new();
    const int64_t a_shape[1] = {DH_HEADS}, dt_shape[2] = {DH_HEADS, 128};
    char err[256];
    assert_int_equal(st_writer_add(w, a_name, ST_F32, 1, a_shape, l->A_log), 0);
    assert_int_equal(st_writer_add(w, "dt_bias", ST_F32, 2, dt_shape, l->dt_bias), 0);
    if (st_writer_write(w, path, err, sizeof(err)) != 0)
        fail_msg("writing %s: %s", path, err);
    st_writer_free(w);
}

static kp_layer_list_result list_layers(dh_client *c)
{
    uint32_t id = dh_id(c);
    send_simple(c, id, KP_METHOD_LAYER_LIST);
    dh_expect_result(c, id);
    kp_layer_list_result r;
    assert_int_equal(kp_layer_list_result_decode(&c->msg, &r, NULL), KP_OK);
    return r;
}

static bool has_layer(const kp_layer_list_result *r, const char *name)
{
    for (uint32_t i = 0; i < r->nlayers; i++) {
        if (strcmp(r->layers[i].name, name) == 0)
            return true;
    }
    return false;
}

/* Layers from the config (relative to its folder), and SIGHUP reloading them. */
static void test_config_layers_and_reload(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l, m;
    dh_seq s;
    test_rng r;
    rng_seed(&r, 10);
    dh_layer_make(&l, &r);
    dh_layer_make(&m, &r);
    l.lower_bound = -3.0f;
    dh_seq_make(&s, &r, 90);
    /* The layer file must exist before the daemon reads its config. */
    char dir[] = "/tmp/kdad-layers-XXXXXX", lpath[96], mpath[96];
    assert_non_null(mkdtemp(dir));
    snprintf(lpath, sizeof(lpath), "%s/l.safetensors", dir);
    snprintf(mpath, sizeof(mpath), "%s/m.safetensors", dir);
    write_layer_file(lpath, &l, "A_log");
    write_layer_file(mpath, &m, "my_a_log");
    char yaml[1024];
    snprintf(yaml, sizeof(yaml), "%slayers:\n  - name: cfg.L\n    file: %s\n"
             "    lower_bound: -3\n", base_yaml, lpath);
    dh_start_or_skip(&d, yaml);

    dh_connect(&c, &d);
    dh_hello(&c);
    kp_layer_list_result ll = list_layers(&c);
    assert_int_equal(ll.nlayers, 1);
    assert_string_equal(ll.layers[0].name, "cfg.L");
    assert_int_equal(ll.layers[0].source, KP_LAYER_SOURCE_CONFIG);
    assert_true(ll.layers[0].lower_bound == -3.0f);
    kp_layer_drop_params dp = {"cfg.L"};
    uint32_t id = dh_id(&c);
    assert_int_equal(kp_layer_drop_params_encode(&c.w, id, &dp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_error(&c, id, KP_E_PERMISSION_DENIED, "configuration");
    uint64_t slot = dh_alloc(&c);
    uint16_t *out = malloc(DH_TOKEN_BYTES(90));
    id = dh_send_prefill(&c, "cfg.L", slot, &s, 0);
    dh_recv_prefill(&c, id, &s, out);
    check_oracle(&c, &l, slot, &s, out); /* the weights are the file's */

    /* reload: cfg.L goes, cfg.M (with a custom tensor name) comes */
    snprintf(yaml, sizeof(yaml), "%slayers:\n  - name: cfg.M\n    file: m.safetensors\n"
             "    A_log: my_a_log\n    lower_bound: -5\nlimits:\n  max_batch_tokens: 1000\n",
             base_yaml);
    char moved[160];
    snprintf(moved, sizeof(moved), "%s/m.safetensors", d.dir); /* relative to the config */
    assert_int_equal(rename(mpath, moved), 0);
    dh_write_config(&d, yaml);
    kill(d.pid, SIGHUP);
    bool reloaded = false;
    for (int tries = 0; tries < 250 && !reloaded; tries++) {
        ll = list_layers(&c);
        reloaded = has_layer(&ll, "cfg.M") && !has_layer(&ll, "cfg.L");
        if (!reloaded)
            usleep(20000);
    }
    assert_true(reloaded);
    /* new connections see the reloaded limits; this one keeps its hello's */
    dh_client c2;
    dh_connect(&c2, &d);
    dh_hello(&c2);
    assert_int_equal(c2.session.limits.max_batch_tokens, 1000);
    assert_int_equal(c.session.limits.max_batch_tokens, 65536);
    dh_close(&c2);
    slot = dh_alloc(&c);
    id = dh_send_prefill(&c, "cfg.M", slot, &s, 0);
    dh_recv_prefill(&c, id, &s, out);
    check_oracle(&c, &m, slot, &s, out);

    /* a broken file changes nothing, and kdad keeps serving */
    dh_write_config(&d, "heads: 0\n");
    kill(d.pid, SIGHUP);
    char *log = NULL;
    for (int tries = 0; tries < 250; tries++) {
        free(log);
        log = dh_log(&d);
        if (strstr(log, "reload failed"))
            break;
        usleep(20000);
    }
    assert_non_null(strstr(log, "reload failed"));
    assert_non_null(strstr(log, "kdad.yaml:1:8: heads: 0 is outside [1, 128]"));
    free(log);
    ll = list_layers(&c);
    assert_true(has_layer(&ll, "cfg.M"));

    free(out);
    dh_seq_free(&s);
    dh_close(&c);
    unlink(lpath);
    rmdir(dir);
    unlink(moved);
    dh_stop(&d);
}

/* Waits until kdad's log holds needle n times (the log keeps every reload's lines). */
static void wait_log(const dh_daemon *d, const char *needle, int n)
{
    for (int tries = 0; tries < 250; tries++) {
        char *log = dh_log(d);
        int seen = 0;
        for (const char *p = log; (p = strstr(p, needle)); p++)
            seen++;
        free(log);
        if (seen >= n)
            return;
        usleep(20000);
    }
    fail_msg("kdad's log never said %d time(s): %s", n, needle);
}

/* The limits a connection that says hello now is given. */
static kp_limits hello_limits(const dh_daemon *d)
{
    dh_client c;
    dh_connect(&c, d);
    dh_hello(&c);
    kp_limits l = c.session.limits;
    dh_close(&c);
    return l;
}

/* A prefill of n inline sequences on fresh slots; checks every position. */
static void prefill_wide(dh_client *c, uint32_t n, const dh_seq *s)
{
    kp_prefill_seq q[8];
    assert_true(n <= 8);
    for (uint32_t i = 0; i < n; i++) {
        q[i] = inline_seq(dh_alloc(c), s);
        q[i].fresh = true;
    }
    kp_prefill_params p = {.layer = "L", .seqs = q, .nseqs = n};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_prefill_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    kp_prefill_result res;
    kp_error e;
    if (kp_prefill_result_decode(&c->msg, &c->session, &p, &res, &e) != KP_OK)
        fail_msg("%s", e.message);
    assert_int_equal(res.nseqs, n);
    for (uint32_t i = 0; i < n; i++)
        assert_int_equal(res.seqs[i].pos, s->len);
}

/*
 * The backends size their launch buffers at start: the cuda backend's
 * descriptor and step tables and graph buckets from max_batch_seqs, its
 * staging buffers from max_inline_bytes.  A reload may lower max_batch_seqs
 * and raise it back, never above its start value (the whole reload is
 * refused); max_inline_bytes waits for a restart.  A request admitted under
 * the larger limits still runs after they were lowered.
 */
static void test_reload_batch_sizes(void **unused)
{
    (void)unused;
    dh_daemon d;
    dh_client c;
    dh_layer l;
    dh_seq s;
    test_rng r;
    rng_seed(&r, 11);
    dh_layer_make(&l, &r);
    dh_seq_make(&s, &r, 33);
    static const char fmt[] = "%slimits:\n  max_batch_seqs: %u\n  max_seqs_per_request: %u\n"
                              "  max_inline_bytes: %u\n";
    const uint32_t inline_start = KP_DEFAULT_MAX_INLINE_BYTES;
    char yaml[1024];
    snprintf(yaml, sizeof(yaml), fmt, base_yaml, 8, 8, inline_start);
    dh_start_or_skip(&d, yaml);
    dh_connect(&c, &d);
    dh_hello(&c);
    assert_int_equal(c.session.limits.max_batch_seqs, 8);
    dh_register_layer(&c, "L", &l);

    /* lowered: new connections get 4; this one keeps its 8, and a batch of 8 still runs */
    snprintf(yaml, sizeof(yaml), fmt, base_yaml, 4, 4, inline_start);
    dh_write_config(&d, yaml);
    kill(d.pid, SIGHUP);
    wait_log(&d, "reloaded:", 1);
    assert_int_equal(hello_limits(&d).max_batch_seqs, 4);
    prefill_wide(&c, 8, &s);

    /* raised above the start value: refused as a whole, 4 stays in force */
    snprintf(yaml, sizeof(yaml), fmt, base_yaml, 16, 16, inline_start);
    dh_write_config(&d, yaml);
    kill(d.pid, SIGHUP);
    wait_log(&d, "reload failed, the configuration in force stays: limits.max_batch_seqs: 16 "
                 "is above 8, the value at start (the launch buffers are sized for it); "
                 "restart to raise it", 1);
    kp_limits now = hello_limits(&d);
    assert_int_equal(now.max_batch_seqs, 4);
    assert_int_equal(now.max_seqs_per_request, 4);

    /* back up to the start value, and restart-only keys changed: they keep their values */
    char restart_only[256];
    snprintf(restart_only, sizeof(restart_only), "%scuda_split_scratch: 0\n", base_yaml);
    snprintf(yaml, sizeof(yaml), fmt, restart_only, 8, 8, 1u << 20);
    dh_write_config(&d, yaml);
    kill(d.pid, SIGHUP);
    wait_log(&d, "reloaded:", 2);
    wait_log(&d, "reload: limits.max_inline_bytes changed; it takes effect at the next restart", 1);
    wait_log(&d, "reload: cuda_split_scratch changed; it takes effect at the next restart", 1);
    now = hello_limits(&d);
    assert_int_equal(now.max_batch_seqs, 8);
    assert_int_equal(now.max_inline_bytes, inline_start);
    dh_client c2;
    dh_connect(&c2, &d);
    dh_hello(&c2);
    prefill_wide(&c2, 8, &s); /* the uid's layer */

    dh_close(&c2);
    dh_close(&c);
    dh_seq_free(&s);
    dh_stop(&d);
}

/* Runs kdad with args; returns its exit code, with stdout+stderr in out. */
static int run_kdad(char *out, size_t size, char *const args[])
{
    char exe[512], log[] = "/tmp/kdad-cli-XXXXXX";
    snprintf(exe, sizeof(exe), "%s/daemon/kdad", KDAD_BUILD_DIR);
    int fd = mkstemp(log);
    assert_true(fd >= 0);
    char *argv[8] = {exe};
    for (int i = 0; args[i] && i < 6; i++)
        argv[i + 1] = args[i];
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fd, 1);
    posix_spawn_file_actions_adddup2(&fa, fd, 2);
    pid_t pid;
    extern char **environ;
    assert_int_equal(posix_spawn(&pid, exe, &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    ssize_t n = pread(fd, out, size - 1, 0);
    out[n > 0 ? n : 0] = '\0';
    close(fd);
    unlink(log);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void test_check_config_cli(void **unused)
{
    char path[] = "/tmp/kdad-check-XXXXXX", out[4096];
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    const char good[] = "heads: 8\nlimits:\n  max_frame_bytes: 1MiB\n  max_inline_bytes: 512KiB\n"
                        "  max_inflight_bytes: 1MiB\nclients:\n  output_hard_limit: 2MiB\n"
                        "  output_soft_limit: 1MiB\n";
    assert_int_equal(pwrite(fd, good, sizeof(good) - 1, 0), (ssize_t)sizeof(good) - 1);
    char *check[] = {"--check-config", path, NULL};
    assert_int_equal(run_kdad(out, sizeof(out), check), 0);
    assert_non_null(strstr(out, ": ok"));
    assert_non_null(strstr(out, "8 heads"));

    const char bad[] = "heads: 8\nslots: lots\n";
    assert_int_equal(ftruncate(fd, 0), 0);
    assert_int_equal(pwrite(fd, bad, sizeof(bad) - 1, 0), (ssize_t)sizeof(bad) - 1);
    assert_int_equal(run_kdad(out, sizeof(out), check), 2);
    char want[160];
    snprintf(want, sizeof(want), "%s:2:8: slots: \"lots\" is not a non-negative integer", path);
    if (!strstr(out, want))
        fail_msg("expected \"%s\" in: %s", want, out);

    char *flag[] = {"--check-config", path, "--heads", "0", NULL};
    assert_int_equal(ftruncate(fd, 0), 0);
    assert_int_equal(run_kdad(out, sizeof(out), flag), 2);
    assert_non_null(strstr(out, "--heads: 0 is outside [1, 128]"));
    char *junk[] = {"--bogus", NULL};
    assert_int_equal(run_kdad(out, sizeof(out), junk), 2);
    assert_non_null(strstr(out, "kdad --help lists the options"));  /* one line, not the usage */
    close(fd);
    unlink(path);
}

/* metrics.prometheus_file: rewritten with the counters every interval. */
static void test_metrics_file(void **unused)
{
    dh_daemon d;
    dh_client c;
    char dir[] = "/tmp/kdad-metrics-XXXXXX", path[96], extra[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/kdad.prom", dir);
    snprintf(extra, sizeof(extra), "metrics:\n  prometheus_file: %s\n  interval_ms: 100\n", path);
    start(&d, extra);
    dh_connect(&c, &d);
    dh_hello(&c);
    uint32_t id = dh_id(&c);
    send_simple(&c, id, KP_METHOD_HEALTH);
    dh_expect_result(&c, id);
    bool seen = false;
    for (int tries = 0; tries < 200 && !seen; tries++) {
        usleep(20000);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        char text[8192];
        size_t n = fread(text, 1, sizeof(text) - 1, f);
        fclose(f);
        text[n] = '\0';
        /* hello and health answered on our connection */
        seen = strstr(text, "kdad_requests_total 2\n") && strstr(text, "kdad_connections 1\n") &&
               strstr(text, "kdad_pool_slots{state=\"total\"} 64\n");
    }
    assert_true(seen);
    dh_close(&c);
    dh_stop(&d);
    unlink(path);
    rmdir(dir);
}

/* Reads one sd_notify datagram containing `want` (skipping others); false
 * after `ms` milliseconds. */
static bool notify_wait(int fd, const char *want, int ms, char *got, size_t size)
{
    for (int waited = 0; waited < ms; waited += 10) {
        ssize_t n = recv(fd, got, size - 1, MSG_DONTWAIT);
        if (n > 0) {
            got[n] = '\0';
            if (strstr(got, want))
                return true;
            continue;
        }
        usleep(10000);
    }
    return false;
}

/* Socket activation (LISTEN_FDS) and the service-manager protocol
 * (NOTIFY_SOCKET, WATCHDOG_USEC), as systemd would run kdad. */
static void test_systemd_activation_and_notify(void **unused)
{
    char dir[] = "/tmp/kdad-systemd-XXXXXX", lpath[96], npath[96], cpath[96], got[512];
    assert_non_null(mkdtemp(dir));
    snprintf(lpath, sizeof(lpath), "%s/kdad.sock", dir);
    snprintf(npath, sizeof(npath), "%s/notify", dir);
    snprintf(cpath, sizeof(cpath), "%s/kdad.yaml", dir);
    FILE *f = fopen(cpath, "w");
    assert_non_null(f);
    fputs(base_yaml, f);
    fclose(f);
    int lfd = socket(AF_UNIX, SOCK_STREAM, 0), nfd = socket(AF_UNIX, SOCK_DGRAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX}, na = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", lpath);
    snprintf(na.sun_path, sizeof(na.sun_path), "%s", npath);
    assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(lfd, 16), 0);
    assert_int_equal(bind(nfd, (struct sockaddr *)&na, sizeof(na)), 0);

    char exe[512];
    snprintf(exe, sizeof(exe), "%s/daemon/kdad", KDAD_BUILD_DIR);
    char log[96];
    snprintf(log, sizeof(log), "%s/kdad.log", dir);
    pid_t pid = fork();
    if (pid == 0) {
        char num[32];
        int logfd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(logfd, 2);
        dup2(lfd, 3);
        snprintf(num, sizeof(num), "%d", (int)getpid());
        setenv("LISTEN_PID", num, 1);
        setenv("LISTEN_FDS", "1", 1);
        setenv("NOTIFY_SOCKET", npath, 1);
        setenv("WATCHDOG_USEC", "200000", 1);
        execl(exe, exe, "--config", cpath, "--backend", DH_BACKEND, (char *)NULL);
        _exit(127);
    }
    close(lfd);
    bool ready = notify_wait(nfd, "READY=1", 30000, got, sizeof(got));
    if (!ready) {
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid && WIFEXITED(status) &&
            WEXITSTATUS(status) == 69)
            skip();
    }
    assert_true(ready);
    assert_non_null(strstr(got, "STATUS=serving: backend"));

    dh_daemon d;
    memset(&d, 0, sizeof(d));
    snprintf(d.sock, sizeof(d.sock), "%s", lpath);
    d.pid = pid;
    dh_client c;
    dh_connect(&c, &d); /* through the socket systemd (we) passed */
    dh_hello(&c);
    assert_true(notify_wait(nfd, "WATCHDOG=1", 2000, got, sizeof(got)));
    dh_close(&c);
    kill(pid, SIGTERM);
    assert_true(notify_wait(nfd, "STOPPING=1", 10000, got, sizeof(got)));
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    /* the socket file is systemd's: kdad leaves it in place */
    assert_int_equal(access(lpath, F_OK), 0);
    close(nfd);
    unlink(lpath);
    unlink(npath);
    unlink(cpath);
    unlink(log);
    rmdir(dir);
}

/* The cuda build of this suite exits 77 (skipped) without a usable GPU. */
int main(void)
{
    if (dh_backend_available(base_yaml) == 77)
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_hello_and_layers, dh_teardown),
        cmocka_unit_test_teardown(test_memory, dh_teardown),
        cmocka_unit_test_teardown(test_concurrent_clients_match_oracle, dh_teardown),
        cmocka_unit_test_teardown(test_multi_sequence_request, dh_teardown),
        cmocka_unit_test_teardown(test_chunked_continuation, dh_teardown),
        cmocka_unit_test_teardown(test_fork_snapshot_restore, dh_teardown),
        cmocka_unit_test_teardown(test_handles_positions_and_quotas, dh_teardown),
        cmocka_unit_test_teardown(test_layer_registrations, dh_teardown),
        cmocka_unit_test_teardown(test_layers_per_uid, dh_teardown),
        cmocka_unit_test_teardown(test_position_limit, dh_teardown),
        cmocka_unit_test_teardown(test_disconnect_mid_request, dh_teardown),
        cmocka_unit_test_teardown(test_malformed_frames, dh_teardown),
        cmocka_unit_test_teardown(test_sigterm_drains, dh_teardown),
        cmocka_unit_test_teardown(test_sigterm_at_first_accept, dh_teardown),
        cmocka_unit_test_teardown(test_config_layers_and_reload, dh_teardown),
        cmocka_unit_test_teardown(test_reload_batch_sizes, dh_teardown),
        cmocka_unit_test_teardown(test_check_config_cli, dh_teardown),
        cmocka_unit_test_teardown(test_metrics_file, dh_teardown),
        cmocka_unit_test_teardown(test_systemd_activation_and_notify, dh_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
