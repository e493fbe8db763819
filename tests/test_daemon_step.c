/*
 * test_daemon_step.c - the step method through a real kdad (PROTOCOL.md
 * §step):
 *
 *   recurrent form   steps of 1..8 tokens per sequence, inline, equal bit for
 *                    bit to kda_cpu_step on the same states (cpu backend),
 *                    and to the float64 oracle within the contract
 *   chunked form     a step with a sequence over 8 tokens runs the prefill
 *                    kernel: equal bit for bit to a prefill of the same tokens
 *   mixed            a long prefill and steps admitted together
 *   answered first   a step formed into one batch with a long prefill is
 *                    answered before the prefill, with the results of the
 *                    two run apart
 *   replay           steps of changing sizes with region tensors (on cuda:
 *                    the step graphs of their buckets, partly filled) equal
 *                    to the same steps inline (launched directly), bit for
 *                    bit
 *   rollback         a 4-token draft with its states kept in a region, rolled
 *                    back to 2 accepted tokens by slot.write, equals having
 *                    run those 2 tokens only, and continues the same way
 *   refusals         ownership, expect_pos (all or nothing), a position that
 *                    would wrap, an empty slot, unknown layer, a slot twice
 *   admission        a 256-sequence step: the daemon's handling time around
 *                    the kernel (printed)
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "bf16.h"
#include "daemon_harness.h"
#ifndef DH_BACKEND_IS_CUDA
#include "kda_cpu.h"
#endif

#define OUT_TOL 0.005
#define STATE_TOL 0.005
#define H DH_HEADS

static const char yaml[] = "heads: 4\nslots: 300\ncpu_threads: 2\nlog:\n  level: info\n"
                           "limits:\n  max_slots_per_client: 300\n";

static const size_t STATE_F32 = DH_STATE_ELEMS * sizeof(float);

/* A step's request: packed tensors of s (T tokens), slots and lens. */
typedef struct step_req {
    uint32_t n;
    uint64_t slots[300];
    uint8_t lens[300];
    uint64_t expect[300];
    bool has_expect;
    const dh_seq *s;
    const kp_ref *in; /* q, k, v, g, beta as references; NULL: s's bytes inline */
    kp_ref out, states;
} step_req;

static uint32_t send_step(dh_client *c, const char *layer, const step_req *q)
{
    kp_step_params p;
    memset(&p, 0, sizeof(p));
    p.layer = layer;
    p.nseqs = q->n;
    p.slots = q->slots;
    p.lens = q->lens;
    p.expect_pos = q->has_expect ? q->expect : NULL;
    uint32_t T = 0;
    for (uint32_t i = 0; i < q->n; i++)
        T += q->lens[i];
    p.tokens = T;
    p.q = kp_ref_inline(q->s->q, DH_TOKEN_BYTES(T));
    p.k = kp_ref_inline(q->s->k, DH_TOKEN_BYTES(T));
    p.v = kp_ref_inline(q->s->v, DH_TOKEN_BYTES(T));
    p.g = kp_ref_inline(q->s->g, DH_TOKEN_BYTES(T));
    p.beta = kp_ref_inline(q->s->beta, DH_BETA_BYTES(T));
    if (q->in) {
        p.q = q->in[0];
        p.k = q->in[1];
        p.v = q->in[2];
        p.g = q->in[3];
        p.beta = q->in[4];
    }
    p.out = q->out;
    p.states = q->states;
    uint32_t id = dh_id(c);
    assert_int_equal(kp_step_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    return id;
}

/* Reads a step's result: positions into pos, the inline output (if any) into out. */
static void recv_step(dh_client *c, uint32_t id, const step_req *q, uint64_t *pos, uint16_t *out,
                      kp_step_result *res_out)
{
    dh_expect_result(c, id);
    kp_step_params req;
    memset(&req, 0, sizeof(req));
    req.nseqs = q->n;
    for (uint32_t i = 0; i < q->n; i++)
        req.tokens += q->lens[i];
    req.out = q->out;
    kp_step_result res;
    assert_int_equal(kp_step_result_decode(&c->msg, &c->session, &req, &res, NULL), KP_OK);
    for (uint32_t i = 0; pos && i < q->n; i++)
        pos[i] = kp_step_u64(res.pos, i);
    if (out && res.out.kind == KP_REF_INLINE)
        memcpy(out, res.out.data, res.out.nbytes);
    if (res_out)
        *res_out = res;
}

static uint64_t prefill(dh_client *c, uint64_t slot, const dh_seq *s, uint16_t *out)
{
    uint32_t id = dh_send_prefill(c, "L", slot, s, -1);
    return dh_recv_prefill(c, id, s, out);
}

static void start(dh_daemon *d, dh_client *c, dh_layer *l, test_rng *r, uint64_t seed)
{
    dh_start_or_skip(d, yaml);
    rng_seed(r, seed);
    dh_layer_make(l, r);
    dh_connect(c, d);
    dh_hello(c);
    dh_register_layer(c, "L", l);
}

static void finish(dh_daemon *d, dh_client *c)
{
    dh_close(c);
    dh_stop(d);
}

/* ---------------------------------------------------------------------- */

static void test_hello_feature(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_start_or_skip(&d, yaml);
    dh_connect(&c, &d);
    kp_hello_result hr;
    dh_hello_result(&c, &hr);
    bool found = false;
    for (uint32_t i = 0; i < hr.nfeatures; i++)
        found |= strcmp(hr.features[i], KP_FEATURE_STEP) == 0;
    assert_true(found);
    finish(&d, &c);
}

/* Steps of 1..8 tokens: against kda_cpu_step on the same states (bit for
 * bit, cpu backend) and the oracle (within the contract, any backend). */
static void test_step_recurrent(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    test_rng r;
    start(&d, &c, &l, &r, 41);
    enum { N = 6 };
    static const uint8_t lens[N] = {1, 4, 1, 2, 8, 3};
    static const uint32_t pre[N] = {0, 3, 5, 0, 2, 1};
    step_req q = {.n = N};
    uint32_t T = 0;
    for (int i = 0; i < N; i++)
        T += q.lens[i] = lens[i];
    dh_seq s, p[N];
    dh_seq_make(&s, &r, T);
    q.s = &s;
    double *state[N], *ref = calloc((size_t)8 * H * 128, sizeof(double));
    float *init = calloc((size_t)N * DH_STATE_ELEMS, sizeof(float));
    for (int i = 0; i < N; i++) {
        q.slots[i] = dh_alloc(&c);
        state[i] = calloc(DH_STATE_ELEMS, sizeof(double));
        if (pre[i]) {
            dh_seq_make(&p[i], &r, pre[i]);
            assert_true(prefill(&c, q.slots[i], &p[i], NULL) == pre[i]);
            double *o = calloc((size_t)pre[i] * H * 128, sizeof(double));
            dh_oracle(&l, &p[i], state[i], o);
            free(o);
            /* reading makes no difference to the state */
            assert_true(dh_read_state(&c, q.slots[i], init + (size_t)i * DH_STATE_ELEMS) ==
                        pre[i]);
        }
    }
    uint16_t *out = malloc(DH_TOKEN_BYTES(T));
    uint64_t pos[N];
    uint32_t id = send_step(&c, "L", &q);
    recv_step(&c, id, &q, pos, out, NULL);
    uint32_t start_tok = 0;
    float *got = malloc(STATE_F32);
    for (int i = 0; i < N; i++) {
        assert_true(pos[i] == pre[i] + lens[i]);
        dh_seq part = dh_seq_slice(&s, start_tok, lens[i]);
        dh_oracle(&l, &part, state[i], ref);
        double oe = dh_err_bf16(out + (size_t)start_tok * H * 128, ref, (size_t)lens[i] * H * 128);
        assert_true(dh_read_state(&c, q.slots[i], got) == pos[i]);
        double se = dh_err_f32(got, state[i], DH_STATE_ELEMS);
        if (oe > OUT_TOL || se > STATE_TOL)
            fail_msg("seq %d (%u tokens): output error %.2e, state error %.2e", i, lens[i], oe, se);
        start_tok += lens[i];
    }
#ifndef DH_BACKEND_IS_CUDA
    /* The cpu backend runs kda_cpu_step: the same bits. */
    kda_cpu *cpu;
    assert_int_equal(kda_cpu_create(2, &cpu, NULL), KDA_OK);
    kda_pool pool = {init, KDA_DTYPE_F32, H, N};
    kda_step_seq ks[N];
    int32_t ilens[N];
    int64_t islots[N];
    int32_t tokens;
    for (int i = 0; i < N; i++) {
        ilens[i] = lens[i];
        islots[i] = i;
    }
    assert_int_equal(kda_step_seqs_fill(ks, N, islots, ilens, &tokens, NULL), KDA_OK);
    uint16_t *mine = malloc(DH_TOKEN_BYTES(T));
    kda_layer kl = {l.A_log, l.dt_bias, l.lower_bound, l.scale};
    kda_step st = {s.q, s.k, s.v, s.g, s.beta, mine, NULL, &kl, ks, N, tokens};
    assert_int_equal(kda_cpu_step(cpu, &pool, &st, NULL), KDA_OK);
    assert_memory_equal(out, mine, DH_TOKEN_BYTES(T));
    for (int i = 0; i < N; i++) {
        dh_read_state(&c, q.slots[i], got);
        assert_memory_equal(got, init + (size_t)i * DH_STATE_ELEMS, STATE_F32);
    }
    free(mine);
    kda_cpu_destroy(cpu);
#endif
    for (int i = 0; i < N; i++) {
        free(state[i]);
        if (pre[i])
            dh_seq_free(&p[i]);
    }
    free(got);
    free(init);
    free(ref);
    free(out);
    dh_seq_free(&s);
    finish(&d, &c);
}

/* A sequence over 8 tokens (and no states asked): the request runs in the
 * chunked form, as a prefill of the same tokens does. */
static void test_step_chunked_equals_prefill(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    test_rng r;
    start(&d, &c, &l, &r, 42);
    dh_seq base, s;
    dh_seq_make(&base, &r, 7);
    dh_seq_make(&s, &r, 15);
    uint64_t root = dh_alloc(&c);
    prefill(&c, root, &base, NULL);
    step_req q = {.n = 2, .s = &s};
    q.lens[0] = 12;
    q.lens[1] = 3;
    uint64_t p1 = dh_fork(&c, root, NULL, NULL), p2 = dh_fork(&c, root, NULL, NULL);
    q.slots[0] = dh_fork(&c, root, NULL, NULL);
    q.slots[1] = dh_fork(&c, root, NULL, NULL);
    uint16_t *out = malloc(DH_TOKEN_BYTES(15)), *pout = malloc(DH_TOKEN_BYTES(15));
    uint64_t pos[2];
    uint32_t id = send_step(&c, "L", &q);
    recv_step(&c, id, &q, pos, out, NULL);
    assert_true(pos[0] == 19 && pos[1] == 10);
    dh_seq a = dh_seq_slice(&s, 0, 12), b = dh_seq_slice(&s, 12, 3);
    assert_true(prefill(&c, p1, &a, pout) == 19);
    assert_true(prefill(&c, p2, &b, pout + (size_t)12 * H * 128) == 10);
    float *x = malloc(STATE_F32), *y = malloc(STATE_F32);
#ifndef DH_BACKEND_IS_CUDA
    assert_memory_equal(out, pout, DH_TOKEN_BYTES(15));
    dh_read_state(&c, q.slots[0], x);
    dh_read_state(&c, p1, y);
    assert_memory_equal(x, y, STATE_F32);
    dh_read_state(&c, q.slots[1], x);
    dh_read_state(&c, p2, y);
    assert_memory_equal(x, y, STATE_F32);
#else
    /* the prefill kernel may pair a batch's chains differently (kda_cuda.h):
     * the same contract, not always the same bits */
    size_t n = (size_t)15 * H * 128;
    double *ref = malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++)
        ref[i] = kda_bf16_to_f32(pout[i]);
    assert_true(dh_err_bf16(out, ref, n) < 0.01);
    free(ref);
#endif
    free(x);
    free(y);
    free(out);
    free(pout);
    dh_seq_free(&base);
    dh_seq_free(&s);
    finish(&d, &c);
}

/* A long prefill and steps sent together (pipelined), from two clients:
 * both answered, each equal to what it gives alone. */
static void test_step_mixed(void **unused)
{
    dh_daemon d;
    dh_client c, c2;
    dh_layer l;
    test_rng r;
    start(&d, &c, &l, &r, 43);
    dh_connect(&c2, &d);
    dh_hello(&c2);
    dh_register_layer(&c2, "L", &l);
    dh_seq longseq, s;
    dh_seq_make(&longseq, &r, 300);
    dh_seq_make(&s, &r, 3);
    uint64_t pslot = dh_alloc(&c), pref = dh_alloc(&c);
    step_req q = {.n = 2, .s = &s};
    q.lens[0] = 1;
    q.lens[1] = 2;
    q.slots[0] = dh_alloc(&c2);
    q.slots[1] = dh_alloc(&c2);
    step_req q2 = q;
    q2.slots[0] = dh_alloc(&c2);
    q2.slots[1] = dh_alloc(&c2);
    /* alone first: the references */
    uint16_t *pout = malloc(DH_TOKEN_BYTES(300)), *pout2 = malloc(DH_TOKEN_BYTES(300));
    uint16_t *sout = malloc(DH_TOKEN_BYTES(3)), *sout2 = malloc(DH_TOKEN_BYTES(3));
    prefill(&c, pref, &longseq, pout);
    uint32_t id = send_step(&c2, "L", &q2);
    recv_step(&c2, id, &q2, NULL, sout, NULL);
    /* together: several steps pipelined behind and beside the prefill */
    uint32_t pid = dh_send_prefill(&c, "L", pslot, &longseq, -1);
    uint32_t ids[4];
    for (int k = 0; k < 4; k++)
        ids[k] = send_step(&c2, "L", &q);
    for (int k = 0; k < 4; k++) {
        uint64_t pos[2];
        recv_step(&c2, ids[k], &q, pos, sout2, NULL);
        assert_true(pos[0] == (uint64_t)k + 1 && pos[1] == 2 * ((uint64_t)k + 1));
        if (k == 0)
            assert_memory_equal(sout, sout2, DH_TOKEN_BYTES(3));
    }
    assert_true(dh_recv_prefill(&c, pid, &longseq, pout2) == 300);
    assert_memory_equal(pout, pout2, DH_TOKEN_BYTES(300));
    free(pout);
    free(pout2);
    free(sout);
    free(sout2);
    dh_seq_free(&longseq);
    dh_seq_free(&s);
    dh_close(&c2);
    finish(&d, &c);
}

/*
 * Speculative decoding: a draft of K tokens keeps the state after each token
 * in a region; accepting J of them is one slot.write of entry J - 1 (with
 * the position).  The slot then equals one that ran the J tokens only, and
 * goes on the same way.
 */
static void test_step_rollback(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    test_rng r;
    start(&d, &c, &l, &r, 44);
    enum { K = 4, J = 2 };
    dh_seq base, draft, next;
    dh_seq_make(&base, &r, 5);
    dh_seq_make(&draft, &r, K);
    dh_seq_make(&next, &r, 1);
    uint64_t root = dh_alloc(&c);
    prefill(&c, root, &base, NULL);
    uint64_t spec = dh_fork(&c, root, NULL, NULL), ref = dh_fork(&c, root, NULL, NULL);
    /* the region: K states (f32 pool), then the draft's output */
    const size_t states_bytes = K * STATE_F32, size = states_bytes + DH_TOKEN_BYTES(K);
    int fd = dh_memfd(size, true);
    uint8_t *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(map != MAP_FAILED);
    uint32_t region = dh_register_shm(&c, fd, size);
    close(fd);

    step_req q = {.n = 1, .s = &draft};
    q.slots[0] = spec;
    q.lens[0] = K;
    q.states = kp_ref_region(region, 0, states_bytes);
    q.out = kp_ref_region(region, states_bytes, DH_TOKEN_BYTES(K));
    uint64_t pos;
    uint32_t id = send_step(&c, "L", &q);
    recv_step(&c, id, &q, &pos, NULL, NULL);
    assert_true(pos == 5 + K);
    /* the last kept state is the slot's */
    float *x = malloc(STATE_F32), *y = malloc(STATE_F32);
    dh_read_state(&c, spec, x);
    assert_memory_equal(x, map + (K - 1) * STATE_F32, STATE_F32);

    /* accept J: roll back */
    dh_write_state(&c, spec, 5 + J, KP_DTYPE_F32,
                   kp_ref_region(region, (J - 1) * STATE_F32, STATE_F32));
    step_req qr = {.n = 1, .s = &draft};
    qr.slots[0] = ref;
    qr.lens[0] = J;
    uint16_t *rout = malloc(DH_TOKEN_BYTES(J));
    id = send_step(&c, "L", &qr);
    recv_step(&c, id, &qr, &pos, rout, NULL);
    assert_true(pos == 5 + J);
    /* the accepted tokens' outputs are the draft's */
    assert_memory_equal(rout, map + states_bytes, DH_TOKEN_BYTES(J));
    assert_true(dh_read_state(&c, spec, x) == 5 + J);
    assert_true(dh_read_state(&c, ref, y) == 5 + J);
    assert_memory_equal(x, y, STATE_F32);
    /* and both go on alike */
    uint16_t a[DH_TOKEN_BYTES(1) / 2], b[DH_TOKEN_BYTES(1) / 2];
    step_req qn = {.n = 1, .s = &next};
    qn.lens[0] = 1;
    qn.slots[0] = spec;
    qn.has_expect = true;
    qn.expect[0] = 5 + J;
    id = send_step(&c, "L", &qn);
    recv_step(&c, id, &qn, &pos, a, NULL);
    qn.slots[0] = ref;
    id = send_step(&c, "L", &qn);
    recv_step(&c, id, &qn, &pos, b, NULL);
    assert_memory_equal(a, b, sizeof(a));
    dh_read_state(&c, spec, x);
    dh_read_state(&c, ref, y);
    assert_memory_equal(x, y, STATE_F32);
    munmap(map, size);
    free(x);
    free(y);
    free(rout);
    dh_seq_free(&base);
    dh_seq_free(&draft);
    dh_seq_free(&next);
    finish(&d, &c);
}

/* A shared-memory region the tests lay tensors out in, 256-byte aligned. */
typedef struct region {
    uint8_t *map;
    size_t size, used;
    uint32_t id;
} region;

static void region_open(region *g, dh_client *c, size_t size)
{
    int fd = dh_memfd(size, true);
    g->map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(g->map != MAP_FAILED);
    g->id = dh_register_shm(c, fd, size);
    close(fd);
    g->size = size;
    g->used = 0;
}

/* n bytes of the region (copied from src unless NULL): their reference. */
static kp_ref region_put(region *g, const void *src, size_t n)
{
    size_t off = g->used;
    assert_true(off + n <= g->size);
    if (src)
        memcpy(g->map + off, src, n);
    g->used = (off + n + 255) & ~(size_t)255;
    return kp_ref_region(g->id, off, n);
}

/* s's five inputs into the region. */
static void region_inputs(region *g, const dh_seq *s, kp_ref in[5])
{
    in[0] = region_put(g, s->q, DH_TOKEN_BYTES(s->len));
    in[1] = region_put(g, s->k, DH_TOKEN_BYTES(s->len));
    in[2] = region_put(g, s->v, DH_TOKEN_BYTES(s->len));
    in[3] = region_put(g, s->g, DH_TOKEN_BYTES(s->len));
    in[4] = region_put(g, s->beta, DH_BETA_BYTES(s->len));
}

/* A one-sequence prefill of len tokens whose inputs are in a region; out: a region's, or
 * absent (inline output). */
static uint32_t send_prefill_refs(dh_client *c, uint64_t slot, uint32_t len, const kp_ref in[5],
                                  kp_ref out)
{
    kp_prefill_seq q;
    memset(&q, 0, sizeof(q));
    q.slot = slot;
    q.len = len;
    q.q = in[0];
    q.k = in[1];
    q.v = in[2];
    q.g = in[3];
    q.beta = in[4];
    q.out = out;
    kp_prefill_params p = {.layer = "L", .seqs = &q, .nseqs = 1};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_prefill_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    return id;
}

/* The response to a one-sequence prefill of len tokens sent with out_ref: its inline output
 * into out (if out), its result. */
static void recv_prefill_result(dh_client *c, uint32_t id, uint32_t len, kp_ref out_ref,
                                uint16_t *out, kp_prefill_result *res)
{
    dh_expect_result(c, id);
    kp_prefill_seq q;
    memset(&q, 0, sizeof(q));
    q.len = len;
    q.out = out_ref;
    kp_prefill_params req = {.layer = "", .seqs = &q, .nseqs = 1};
    assert_int_equal(kp_prefill_result_decode(&c->msg, &c->session, &req, res, NULL), KP_OK);
    assert_true(res->seqs[0].pos == len);
    if (out)
        memcpy(out, res->seqs[0].out.data, DH_TOKEN_BYTES(len));
}

/* Whether the response to id came already (held while the test waited for another). */
static bool answered(const dh_client *c, uint32_t id)
{
    for (int i = 0; i < c->nheld; i++) {
        if (c->held[i].id == id)
            return true;
    }
    return false;
}

/*
 * A step that shares a batch with a long prefill is answered when its own
 * work is done, before the prefill (PROTOCOL.md, step: how kdad runs it).
 * A first long prefill keeps the device busy while a second one and the step
 * arrive, so the two form one batch when it ends (the cpu backend runs one
 * batch at a time; on cuda the next batch is held while the device is busy).
 * Every input is in a region, so the three requests arrive within
 * microseconds, and so is the first prefill's output, so that it goes to the
 * device at once (nothing to stage on a worker first).  The results equal
 * those of the same work run apart.
 */
static void test_step_answered_first(void **unused)
{
    static const char held_yaml[] =
        "heads: 4\nslots: 300\ncpu_threads: 2\nlog:\n  level: info\n"
        "limits:\n  max_slots_per_client: 300\n"
        "batching:\n  hold_while_busy: true\n  hold_fill_percent: 100\n  hold_max_us: 1000000\n";
#ifdef DH_BACKEND_IS_CUDA
    enum { PLEN = 16384 }; /* a prefill kernel of hundreds of microseconds */
#else
    enum { PLEN = 1024 };
#endif
    dh_daemon d;
    dh_client c;
    dh_layer l;
    test_rng r;
    dh_start_or_skip(&d, held_yaml);
    rng_seed(&r, 47);
    dh_layer_make(&l, &r);
    dh_connect(&c, &d);
    dh_hello(&c);
    dh_register_layer(&c, "L", &l);
    dh_seq ps, ss;
    dh_seq_make(&ps, &r, PLEN);
    dh_seq_make(&ss, &r, 3);
    region g;
    region_open(&g, &c, 6 * DH_TOKEN_BYTES(PLEN + 3) + 8 * DH_TOKEN_BYTES(3) + (1u << 20));
    kp_ref pin[5], sin[5];
    region_inputs(&g, &ps, pin);
    region_inputs(&g, &ss, sin);
    kp_ref out_apart = region_put(&g, NULL, DH_TOKEN_BYTES(3));
    kp_ref out_mixed = region_put(&g, NULL, DH_TOKEN_BYTES(3));
    kp_ref out_busy = region_put(&g, NULL, DH_TOKEN_BYTES(PLEN));
    const kp_ref out_inline = {.kind = KP_REF_ABSENT};
    uint16_t *pout = malloc(DH_TOKEN_BYTES(PLEN)), *pout2 = malloc(DH_TOKEN_BYTES(PLEN));

    /* apart: the references */
    uint64_t ref_slot = dh_alloc(&c);
    step_req q = {.n = 2, .s = &ss, .in = sin, .out = out_apart};
    q.lens[0] = 1;
    q.lens[1] = 2;
    q.slots[0] = dh_alloc(&c);
    q.slots[1] = dh_alloc(&c);
    kp_prefill_result pres;
    recv_prefill_result(&c, send_prefill_refs(&c, ref_slot, PLEN, pin, out_inline), PLEN,
                        out_inline, pout, &pres);
    uint64_t pos[2];
    recv_step(&c, send_step(&c, "L", &q), &q, pos, NULL, NULL);

    /* together: a prefill that keeps the device busy, then the prefill and the step */
    step_req qm = q;
    qm.slots[0] = dh_alloc(&c);
    qm.slots[1] = dh_alloc(&c);
    qm.out = out_mixed;
    uint64_t busy_slot = dh_alloc(&c), mixed_slot = dh_alloc(&c);
    uint32_t busy_id = send_prefill_refs(&c, busy_slot, PLEN, pin, out_busy);
    uint32_t pid = send_prefill_refs(&c, mixed_slot, PLEN, pin, out_inline);
    uint32_t sid = send_step(&c, "L", &qm);
    kp_step_result sres;
    recv_step(&c, sid, &qm, pos, NULL, &sres);
    assert_false(answered(&c, pid)); /* the step came first */
    assert_true(pos[0] == 1 && pos[1] == 2);
    recv_prefill_result(&c, busy_id, PLEN, out_busy, NULL, &pres);
    recv_prefill_result(&c, pid, PLEN, out_inline, pout2, &pres);
    printf("a step beside a prefill of %u tokens (%s): the step's run %llu us, the prefill's "
           "run %llu us, its kernel %llu us\n", PLEN, DH_BACKEND,
           (unsigned long long)sres.run_us, (unsigned long long)pres.run_us,
           (unsigned long long)pres.kernel_us);
    /* the step did not wait for the prefill's chains */
    assert_true(sres.run_us < pres.kernel_us);

    /* the same results as apart */
    assert_memory_equal(pout, pout2, DH_TOKEN_BYTES(PLEN));
    assert_memory_equal(g.map + out_apart.offset, g.map + out_mixed.offset, DH_TOKEN_BYTES(3));
    float *x = malloc(STATE_F32), *y = malloc(STATE_F32);
    for (int i = 0; i < 2; i++) {
        assert_true(dh_read_state(&c, q.slots[i], x) == dh_read_state(&c, qm.slots[i], y));
        assert_memory_equal(x, y, STATE_F32);
    }
    assert_true(dh_read_state(&c, ref_slot, x) == PLEN);
    assert_true(dh_read_state(&c, mixed_slot, y) == PLEN);
    assert_memory_equal(x, y, STATE_F32);
    munmap(g.map, g.size);
    free(x);
    free(y);
    free(pout);
    free(pout2);
    dh_seq_free(&ps);
    dh_seq_free(&ss);
    finish(&d, &c);
}

/*
 * Steps of changing sizes, each sent twice on two sets of slots that hold the
 * same states: with region tensors (on cuda a step alone with nothing to copy:
 * the step graph of its size bucket, whose blocks past the step's sequences
 * exit) and with inline tensors (staged: launched directly).  Outputs and
 * states are the same bits.
 */
static void test_step_graph_replay(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    test_rng r;
    start(&d, &c, &l, &r, 48);
    enum { N = 7, ROUNDS = 6 };
    static const uint32_t sizes[ROUNDS] = {3, 3, 1, 7, 2, 7};
    uint64_t a[N], b[N];
    for (int i = 0; i < N; i++) {
        a[i] = dh_alloc(&c);
        b[i] = dh_alloc(&c);
    }
    region g;
    region_open(&g, &c, 6 * DH_TOKEN_BYTES(N) + (1u << 16));
    kp_ref out = region_put(&g, NULL, DH_TOKEN_BYTES(N));
    uint16_t *inl = malloc(DH_TOKEN_BYTES(N));
    for (int k = 0; k < ROUNDS; k++) {
        dh_seq s;
        dh_seq_make(&s, &r, sizes[k]);
        g.used = out.offset + DH_TOKEN_BYTES(N);
        kp_ref in[5];
        region_inputs(&g, &s, in);
        step_req qi = {.n = sizes[k], .s = &s}, qr = {.n = sizes[k], .s = &s, .in = in};
        qr.out = kp_ref_region(g.id, out.offset, DH_TOKEN_BYTES(sizes[k]));
        for (uint32_t i = 0; i < sizes[k]; i++) {
            qi.slots[i] = a[i];
            qr.slots[i] = b[i];
            qi.lens[i] = qr.lens[i] = 1;
        }
        uint64_t pi[N], pr[N];
        recv_step(&c, send_step(&c, "L", &qi), &qi, pi, inl, NULL);
        recv_step(&c, send_step(&c, "L", &qr), &qr, pr, NULL, NULL);
        assert_memory_equal(pi, pr, sizes[k] * sizeof(uint64_t));
        assert_memory_equal(inl, g.map + out.offset, DH_TOKEN_BYTES(sizes[k]));
        dh_seq_free(&s);
    }
    float *x = malloc(STATE_F32), *y = malloc(STATE_F32);
    for (int i = 0; i < N; i++) {
        assert_true(dh_read_state(&c, a[i], x) == dh_read_state(&c, b[i], y));
        assert_memory_equal(x, y, STATE_F32);
    }
    munmap(g.map, g.size);
    free(x);
    free(y);
    free(inl);
    finish(&d, &c);
}

static void test_step_refusals(void **unused)
{
    dh_daemon d;
    dh_client c, other;
    dh_layer l;
    test_rng r;
    start(&d, &c, &l, &r, 45);
    dh_connect(&other, &d);
    dh_hello(&other);
    dh_seq s;
    dh_seq_make(&s, &r, 5);
    uint64_t a = dh_alloc(&c), b = dh_alloc(&c), theirs = dh_alloc(&other);
    step_req q = {.n = 2, .s = &s};
    q.lens[0] = q.lens[1] = 2;
    q.slots[0] = a;

    q.slots[1] = theirs; /* not ours */
    uint32_t id = send_step(&c, "L", &q);
    dh_expect_error(&c, id, KP_E_PERMISSION_DENIED, "slots[1]");

    q.slots[1] = a; /* twice */
    id = send_step(&c, "L", &q);
    dh_expect_error(&c, id, KP_E_INVALID_PARAMS, "slots[1]");

    q.slots[1] = b;
    id = send_step(&c, "nope", &q);
    dh_expect_error(&c, id, KP_E_UNKNOWN_LAYER, NULL);

    /* expect_pos: the second is wrong, so nothing runs */
    q.has_expect = true;
    q.expect[0] = 0;
    q.expect[1] = 7;
    id = send_step(&c, "L", &q);
    dh_expect_error(&c, id, KP_E_POSITION_MISMATCH, "slots[1]");
    float *x = malloc(STATE_F32), *zero = calloc(1, STATE_F32);
    assert_true(dh_read_state(&c, a, x) == 0);
    assert_memory_equal(x, zero, STATE_F32);
    q.expect[1] = 0;
    uint64_t pos[2];
    id = send_step(&c, "L", &q);
    recv_step(&c, id, &q, pos, NULL, NULL);
    assert_true(pos[0] == 2 && pos[1] == 2);
    q.has_expect = false;

    /* an empty slot has no state to continue */
    q.slots[1] = dh_alloc_flags(&c, false);
    id = send_step(&c, "L", &q);
    dh_expect_error(&c, id, KP_E_STATE_LOST, "slots[1]");
    assert_true(dh_read_state(&c, a, x) == 2);

    /* positions never wrap */
    for (size_t i = 0; i < DH_STATE_ELEMS; i++)
        x[i] = (float)(i % 89) / 89.0f - 0.5f;
    dh_write_state(&c, b, UINT64_MAX - 2, KP_DTYPE_F32, kp_ref_inline(x, STATE_F32));
    q.slots[1] = b;
    q.lens[1] = 3;
    id = send_step(&c, "L", &q);
    dh_expect_error(&c, id, KP_E_LIMIT_EXCEEDED, "slots[1]");
    assert_true(dh_read_state(&c, a, zero) == 2);
    q.lens[1] = 2;
    q.lens[0] = 1;
    id = send_step(&c, "L", &q);
    recv_step(&c, id, &q, pos, NULL, NULL);
    assert_true(pos[0] == 3 && pos[1] == UINT64_MAX);
    free(x);
    free(zero);
    dh_seq_free(&s);
    dh_close(&other);
    finish(&d, &c);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* A 256-sequence step: what the daemon adds to the kernel (queue_us +
 * run_us - kernel_us: admission, descriptors, completion), and the round
 * trip. */
static void test_step_admission_cost(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    test_rng r;
    start(&d, &c, &l, &r, 46);
    enum { N = 256, ROUNDS = 200 };
    dh_seq s;
    dh_seq_make(&s, &r, N);
    step_req *q = calloc(1, sizeof(*q));
    q->n = N;
    q->s = &s;
    kp_slot_alloc_params ap = {N, true};
    uint32_t id = dh_id(&c);
    assert_int_equal(kp_slot_alloc_params_encode(&c.w, id, &ap, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    kp_slot_list sl;
    assert_int_equal(kp_slot_alloc_result_decode(&c.msg, &sl, NULL), KP_OK);
    for (uint32_t i = 0; i < N; i++) {
        q->slots[i] = sl.slots[i];
        q->lens[i] = 1;
    }
    uint64_t host[ROUNDS], rtt[ROUNDS], kern[ROUNDS];
    for (int k = 0; k < ROUNDS; k++) {
        uint64_t t0 = now_ns();
        id = send_step(&c, "L", q);
        kp_step_result res;
        recv_step(&c, id, q, NULL, NULL, &res);
        rtt[k] = (now_ns() - t0) / 1000;
        kern[k] = res.kernel_us;
        uint64_t in_daemon = res.queue_us + res.run_us;
        host[k] = in_daemon > res.kernel_us ? in_daemon - res.kernel_us : 0;
    }
    qsort(host, ROUNDS, sizeof(uint64_t), cmp_u64);
    qsort(rtt, ROUNDS, sizeof(uint64_t), cmp_u64);
    qsort(kern, ROUNDS, sizeof(uint64_t), cmp_u64);
    printf("step 256x1 (H=%d, %s): kernel p50 %llu us; daemon around it p50 %llu us, p99 %llu "
           "us; round trip p50 %llu us\n", H, DH_BACKEND, (unsigned long long)kern[ROUNDS / 2],
           (unsigned long long)host[ROUNDS / 2], (unsigned long long)host[ROUNDS * 99 / 100],
           (unsigned long long)rtt[ROUNDS / 2]);
    /* where the daemon's part goes (docs/daemon.md, batch phases): form (run-time
     * checks, descriptors) and reply (bookkeeping, the answer) are the loop's work */
    kp_stats_result st;
    dh_stats(&c, &st);
    printf("  batch phases p50:");
    uint64_t form = UINT64_MAX;
    for (uint32_t i = 0; i < st.nphases; i++) {
        printf(" %s %llu", st.phases[i].name, (unsigned long long)st.phases[i].p50_us);
        if (strcmp(st.phases[i].name, "form") == 0)
            form = st.phases[i].p50_us;
    }
    printf(" (us)\n");
    /* Loose bounds (shared CI machines, sanitizers: ~1 us per sequence under
     * ASan): the per-sequence work on the loop stays a few loads and stores. */
    assert_true(form < 4u * N);
    assert_true(host[ROUNDS / 2] < 100u * N);
    free(q);
    dh_seq_free(&s);
    finish(&d, &c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_hello_feature, dh_teardown),
        cmocka_unit_test_teardown(test_step_recurrent, dh_teardown),
        cmocka_unit_test_teardown(test_step_chunked_equals_prefill, dh_teardown),
        cmocka_unit_test_teardown(test_step_mixed, dh_teardown),
        cmocka_unit_test_teardown(test_step_answered_first, dh_teardown),
        cmocka_unit_test_teardown(test_step_graph_replay, dh_teardown),
        cmocka_unit_test_teardown(test_step_rollback, dh_teardown),
        cmocka_unit_test_teardown(test_step_refusals, dh_teardown),
        cmocka_unit_test_teardown(test_step_admission_cost, dh_teardown),
    };
    if (dh_backend_available(yaml) == 77)
        return 77;
    return cmocka_run_group_tests(tests, NULL, NULL);
}
