/*
 * test_shard.c - libkdaclient's head-sharded client (kdac_shard_*) against
 * real kdad processes: one daemon serving all H heads, two daemons of H/2
 * heads, and three of H/4, H/2 and H/4.  test_shard: the CPU backend, H = 4,
 * every daemon `device: 0` (as two instances sharing one GPU would be
 * configured).  test_shard_cuda: the cuda backend, H = 32, rank r of each
 * shard on GPU r % (the GPUs present): two instances on two GPUs, or sharing
 * one; it exits 77 without a GPU.
 *
 * The sharded results must equal the single daemon's bit for bit: the KDA
 * recurrence of head h reads only head h's inputs, weights and state, and
 * writes only head h's output and state, so splitting the heads across
 * processes changes where a head's chain runs, not what it computes (the
 * same backend runs the same per-head code).  Outputs, positions and the
 * final states (f32 and bf16) are compared, also after a state written back
 * into a sharded slot.
 *
 * Failures: an unreachable rank, the same daemon twice, a layer one rank
 * refuses (rolled back on the others), an allocation over one rank's quota
 * (all or none), a prefill one rank refuses after the other applied it
 * (reported with each rank's outcome; later reads see the slots out of
 * step), and a rank whose daemon went away (nothing is sent to any rank).
 * Last, scripts/bench-ranks.sh drives the two halves at once.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kdaclient.h"
#include "kdad_proc.h"
#include "testutil.h"

#ifdef SHARD_CUDA
#include <cuda_runtime_api.h>
#define BACKEND "cuda"
#define H 32 /* Kimi Linear's KDA heads: 16 per GPU at TP = 2 */
#else
#define BACKEND "cpu"
#define H 4
#endif
#define D KDAC_HEAD_DIM
#define STATE_ELEMS ((size_t)H * D * D)

static kdad_proc full, half[2], uneven[2];
static int ngpus = 1; /* ranks r run on device r % ngpus (cpu: the key is accepted, unused) */

/* "device: N\n" plus more, in a static buffer per call slot. */
static const char *yaml(int rank, const char *more)
{
    static char bufs[8][160];
    static int next;
    char *b = bufs[next++ % 8];
    snprintf(b, sizeof(bufs[0]), "device: %d\n%s", rank % ngpus, more ? more : "");
    return b;
}

static int start_all(void **state)
{
    /* rank 1 of the pair allows 8 slots per client: the all-or-none allocation test */
    if (!kdad_start_on(&full, BACKEND, H, yaml(0, NULL)) ||
        !kdad_start_on(&half[0], BACKEND, H / 2, yaml(0, NULL)) ||
        !kdad_start_on(&half[1], BACKEND, H / 2, yaml(1, "limits:\n  max_slots_per_client: 8\n")) ||
        !kdad_start_on(&uneven[0], BACKEND, H / 4, yaml(0, NULL)) ||
        !kdad_start_on(&uneven[1], BACKEND, H / 4, yaml(1, NULL)))
        return -1;
    return 0;
}

static int stop_all(void **state)
{
    int bad = 0;
    bad |= kdad_stop(&full) != 0;
    for (int i = 0; i < 2; i++) {
        bad |= kdad_stop(&half[i]) != 0;
        bad |= kdad_stop(&uneven[i]) != 0;
    }
    return bad ? -1 : 0;
}

static void assert_contains(const char *text, const char *part)
{
    if (!strstr(text, part))
        fail_msg("\"%s\" does not contain \"%s\"", text, part);
}

static kdac_client *open_one(const char *path)
{
    kdac_options o;
    kdac_options_init(&o);
    o.socket_path = path;
    o.timeout_ms = 60000;
    kdac_client *c;
    kdac_error e;
    if (kdac_client_open(&c, &o, &e) != KDAC_OK)
        fail_msg("open %s: %s", path, e.message);
    return c;
}

static kdac_shard *open_shard(const char *const *paths, uint32_t n)
{
    kdac_options o;
    kdac_options_init(&o);
    o.timeout_ms = 60000;
    kdac_shard *s;
    kdac_error e;
    if (kdac_shard_open(&s, paths, n, &o, &e) != KDAC_OK)
        fail_msg("shard open: %s", e.message);
    return s;
}

/* One sequence's inputs and outputs over all H heads. */
typedef struct seq {
    uint32_t len;
    uint16_t *q, *k, *v, *g, *beta, *out;
} seq;

static void seq_make(seq *s, test_rng *r, uint32_t len)
{
    size_t tok = (size_t)len * H * D;
    s->len = len;
    uint16_t **t[5] = {&s->q, &s->k, &s->v, &s->g, &s->out};
    for (int i = 0; i < 5; i++) {
        *t[i] = malloc(tok * 2 + 2);
        assert_non_null(*t[i]);
        fill_normal_bf16(r, *t[i], tok, 0, 1);
    }
    s->beta = malloc((size_t)len * H * 2 + 2);
    assert_non_null(s->beta);
    fill_normal_bf16(r, s->beta, (size_t)len * H, 0, 1);
}

static void seq_free(seq *s)
{
    free(s->q);
    free(s->k);
    free(s->v);
    free(s->g);
    free(s->beta);
    free(s->out);
}

static kdac_layer layer_make(test_rng *r, const char *name, float *A_log, float *dt_bias)
{
    for (int h = 0; h < H; h++)
        A_log[h] = (float)rng_uniform(r);
    for (int i = 0; i < H * D; i++)
        dt_bias[i] = (float)rng_uniform(r);
    return (kdac_layer){name, A_log, dt_bias, -5.0f, KDAC_DEFAULT_SCALE};
}

/* The single daemon's prefill of seqs (outputs into ref[i]), and the same
 * through the shard (outputs into seqs[i].out): equal outputs and positions. */
static void prefill_both(kdac_client *one, const uint64_t *one_slots, kdac_shard *s,
                         const uint64_t *shard_slots, seq *seqs, uint32_t n, uint32_t flags,
                         uint64_t expect_pos)
{
    const uint32_t nr = kdac_shard_nranks(s);
    kdac_seq a[4];
    kdac_shard_seq b[4];
    uint16_t *ref[4];
    for (uint32_t i = 0; i < n; i++) {
        ref[i] = malloc((size_t)seqs[i].len * H * D * 2 + 2);
        a[i] = (kdac_seq){.slot = one_slots[i], .len = seqs[i].len, .flags = flags,
                          .expect_pos = expect_pos, .q = kdac_tensor_inline(seqs[i].q),
                          .k = kdac_tensor_inline(seqs[i].k), .v = kdac_tensor_inline(seqs[i].v),
                          .g = kdac_tensor_inline(seqs[i].g),
                          .beta = kdac_tensor_inline(seqs[i].beta),
                          .out = kdac_output_inline(ref[i])};
        memset(seqs[i].out, 0xa5, (size_t)seqs[i].len * H * D * 2);
        b[i] = (kdac_shard_seq){.slot = shard_slots + (size_t)i * nr, .len = seqs[i].len,
                                .flags = flags, .expect_pos = expect_pos, .q = seqs[i].q,
                                .k = seqs[i].k, .v = seqs[i].v, .g = seqs[i].g,
                                .beta = seqs[i].beta, .out = seqs[i].out};
    }
    kdac_prefill_result res;
    kdac_error e;
    if (kdac_prefill(one, "L", a, n, &res, &e) != KDAC_OK)
        fail_msg("prefill on one daemon: %s", e.message);
    uint64_t pos[4];
    int status[KDAC_SHARD_MAX_RANKS];
    if (kdac_shard_prefill(s, "L", b, n, pos, status, &e) != KDAC_OK)
        fail_msg("sharded prefill: %s", e.message);
    for (uint32_t r = 0; r < nr; r++)
        assert_int_equal(status[r], 0);
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(pos[i], res.pos[i]);
        size_t bytes = (size_t)seqs[i].len * H * D * 2;
        assert_memory_equal(seqs[i].out, ref[i], bytes);
        /* not a vacuous comparison: every head of the last token was written */
        for (int h = 0; h < H; h++) {
            const uint16_t *o = seqs[i].out + ((size_t)(seqs[i].len - 1) * H + h) * D;
            bool any = false;
            for (int j = 0; j < D; j++)
                any |= (o[j] & 0x7fff) != 0;
            assert_true(any);
        }
        free(ref[i]);
    }
}

/* The assembled sharded state equals the single daemon's, in both dtypes. */
static void states_equal(kdac_client *one, uint64_t one_slot, kdac_shard *s,
                         const uint64_t *shard_slot, uint64_t want_pos)
{
    const kdac_dtype dtypes[2] = {KDAC_DTYPE_F32, KDAC_DTYPE_BF16};
    float *x = malloc(STATE_ELEMS * 4), *y = malloc(STATE_ELEMS * 4);
    for (int d = 0; d < 2; d++) {
        size_t bytes = kdac_state_bytes(H, dtypes[d]);
        uint64_t p1, p2;
        kdac_error e;
        memset(y, 0x5a, bytes);
        if (kdac_slot_read(one, one_slot, dtypes[d], kdac_output_inline(x), &p1, &e) ||
            kdac_shard_slot_read(s, shard_slot, dtypes[d], y, &p2, &e))
            fail_msg("slot.read: %s", e.message);
        assert_int_equal(p1, want_pos);
        assert_int_equal(p2, want_pos);
        assert_memory_equal(x, y, bytes);
    }
    free(x);
    free(y);
}

static bool has_layer(kdac_client *c, const char *name)
{
    kdac_layer_info list[16];
    uint32_t n = 0;
    assert_int_equal(kdac_layer_list(c, list, 16, &n, NULL), KDAC_OK);
    for (uint32_t i = 0; i < n && i < 16; i++) {
        if (strcmp(list[i].name, name) == 0)
            return true;
    }
    return false;
}

static void sharded_equals_one(const char *const *paths, uint32_t nranks,
                               const uint32_t *want_first)
{
    test_rng r;
    rng_seed(&r, 26 + nranks);
    float A_log[H], dt_bias[H * D];
    kdac_layer layer = layer_make(&r, "L", A_log, dt_bias);
    kdac_client *one = open_one(full.sock);
    kdac_shard *s = open_shard(paths, nranks);
    /* which GPU each daemon serves: UUID and PCI bus id ("0000:19:00.0") */
    for (uint32_t i = 0; i < nranks; i++) {
        const kdac_server_info *info = kdac_client_info(kdac_shard_client(s, i));
#ifdef SHARD_CUDA
        unsigned dom, bus, dev, fn;
        assert_true(info->has_gpu);
        assert_int_equal(strncmp(info->gpu_uuid, "GPU-", 4), 0);
        assert_int_equal(sscanf(info->gpu_pci_bus_id, "%4x:%2x:%2x.%1x", &dom, &bus, &dev, &fn),
                         4);
        assert_int_equal(strlen(info->gpu_pci_bus_id), 12);
#else
        assert_false(info->has_gpu);
        assert_string_equal(info->gpu_pci_bus_id, "");
#endif
    }
    /* with two GPUs, ranks 0 and 1 are on different ones: no state crosses GPUs */
    if (ngpus >= 2 && strcmp(BACKEND, "cuda") == 0)
        assert_string_not_equal(kdac_client_info(kdac_shard_client(s, 0))->gpu_uuid,
                                kdac_client_info(kdac_shard_client(s, 1))->gpu_uuid);
    assert_int_equal(kdac_shard_nranks(s), nranks);
    assert_int_equal(kdac_shard_heads(s), H);
    for (uint32_t i = 0; i < nranks; i++)
        assert_int_equal(kdac_shard_first_head(s, i), want_first[i]);
    kdac_error e;
    bool created;
    if (kdac_layer_register(one, &layer, &created, &e) ||
        kdac_shard_layer_register(s, &layer, &e))
        fail_msg("layer: %s", e.message);
    /* the same layer again: a second registration on every rank, as on one daemon */
    if (kdac_shard_layer_register(s, &layer, &e))
        fail_msg("layer again: %s", e.message);

    uint64_t a[3], b[3 * KDAC_SHARD_MAX_RANKS];
    if (kdac_slot_alloc(one, 3, 0, a, &e) || kdac_shard_slot_alloc(s, 3, 0, b, &e))
        fail_msg("slot.alloc: %s", e.message);
    seq x[2];
    seq_make(&x[0], &r, 200);
    seq_make(&x[1], &r, 77);
    prefill_both(one, a, s, b, x, 2, 0, 0);
    seq_free(&x[0]);
    seq_free(&x[1]);
    /* continuing, guarded by the position both hold */
    seq_make(&x[0], &r, 33);
    seq_make(&x[1], &r, 33);
    uint64_t two[2] = {a[0], a[2]}, shard_two[2 * KDAC_SHARD_MAX_RANKS];
    memcpy(shard_two, b, nranks * sizeof(uint64_t));
    memcpy(shard_two + nranks, b + 2 * nranks, nranks * sizeof(uint64_t));
    prefill_both(one, two, s, shard_two, x, 1, KDAC_SEQ_EXPECT_POS, 200);
    states_equal(one, a[0], s, b, 233);
    states_equal(one, a[1], s, b + nranks, 77);

    /* a state written into a sharded slot continues as on the daemon it came from */
    float *st = malloc(STATE_ELEMS * 4);
    uint64_t pos;
    if (kdac_slot_read(one, a[1], KDAC_DTYPE_F32, kdac_output_inline(st), &pos, &e) ||
        kdac_shard_slot_write(s, b + 2 * nranks, pos, KDAC_DTYPE_F32, st, &e))
        fail_msg("write: %s", e.message);
    two[0] = a[1];
    memcpy(shard_two, b + 2 * nranks, nranks * sizeof(uint64_t));
    prefill_both(one, two, s, shard_two, &x[1], 1, 0, 0);
    states_equal(one, a[1], s, b + 2 * nranks, 110);
    free(st);
    seq_free(&x[0]);
    seq_free(&x[1]);

    if (kdac_slot_free(one, a, 3, &e) || kdac_shard_slot_free(s, b, 3, &e))
        fail_msg("slot.free: %s", e.message);
    /* two registrations on every rank, given back by two drops */
    assert_int_equal(kdac_layer_drop(one, "L", NULL), KDAC_OK);
    for (int k = 0; k < 2; k++) {
        for (uint32_t i = 0; i < nranks; i++)
            assert_true(has_layer(kdac_shard_client(s, i), "L"));
        if (kdac_shard_layer_drop(s, "L", &e))
            fail_msg("layer drop: %s", e.message);
    }
    for (uint32_t i = 0; i < nranks; i++)
        assert_false(has_layer(kdac_shard_client(s, i), "L"));
    assert_int_equal(kdac_shard_layer_drop(s, "L", &e), KDAC_E_UNKNOWN_LAYER);
    assert_contains(e.message, "rank 0 (");
    kdac_slot_info_result info;
    for (uint32_t i = 0; i < nranks; i++) {
        assert_int_equal(kdac_slot_info(kdac_shard_client(s, i), NULL, 0, &info, &e), KDAC_OK);
        assert_int_equal(info.nslots, 0);
    }
    kdac_shard_close(s);
    kdac_client_close(one);
}

static void test_two_halves_equal_one_daemon(void **state)
{
    const char *paths[2] = {half[0].sock, half[1].sock};
    const uint32_t first[2] = {0, H / 2};
    sharded_equals_one(paths, 2, first);
}

static void test_uneven_ranks_equal_one_daemon(void **state)
{
    const char *paths[3] = {uneven[0].sock, half[0].sock, uneven[1].sock};
    const uint32_t first[3] = {0, H / 4, 3 * H / 4};
    sharded_equals_one(paths, 3, first);
}

static void test_open_refusals(void **state)
{
    kdac_shard *s = (kdac_shard *)1;
    kdac_error e;
    char dead[160];
    snprintf(dead, sizeof(dead), "%s/nobody.sock", half[0].dir);
    const char *paths[2] = {half[0].sock, dead};
    assert_int_equal(kdac_shard_open(&s, paths, 2, NULL, &e), KDAC_E_NOT_RUNNING);
    assert_null(s);
    char want[200];
    snprintf(want, sizeof(want), "rank 1 (%s): ", dead);
    assert_contains(e.message, want);
    const char *same[2] = {half[0].sock, half[0].sock};
    assert_int_equal(kdac_shard_open(&s, same, 2, NULL, &e), KDAC_E_INVALID_ARGUMENT);
    assert_contains(e.message, "is the same daemon as rank 0");
    assert_int_equal(kdac_shard_open(&s, paths, 0, NULL, &e), KDAC_E_INVALID_ARGUMENT);
    assert_int_equal(kdac_shard_open(&s, paths, KDAC_SHARD_MAX_RANKS + 1, NULL, &e),
                     KDAC_E_INVALID_ARGUMENT);
}

/* A layer rank 1 refuses, an allocation over rank 1's quota, and a prefill rank 1
 * refuses after rank 0 applied it. */
static void test_one_rank_refuses(void **state)
{
    const char *paths[2] = {half[0].sock, half[1].sock};
    kdac_shard *s = open_shard(paths, 2);
    kdac_error e;
    test_rng r;
    rng_seed(&r, 7);
    float A_log[H], dt_bias[H * D];
    kdac_layer layer = layer_make(&r, "X", A_log, dt_bias);
    /* rank 1 already has another "X" (the A_log of its first head differs) */
    kdac_layer other = layer;
    float other_A[H / 2];
    memcpy(other_A, A_log + H / 2, sizeof(other_A));
    other_A[0] += 1.0f;
    other.A_log = other_A;
    other.dt_bias = dt_bias + H / 2 * D;
    assert_int_equal(kdac_layer_register(kdac_shard_client(s, 1), &other, NULL, &e), KDAC_OK);
    assert_int_equal(kdac_shard_layer_register(s, &layer, &e), KDAC_E_LAYER_EXISTS);
    char want[200];
    snprintf(want, sizeof(want), "rank 1 (%s): layer X: ", half[1].sock);
    assert_contains(e.message, want);
    assert_contains(e.message, "given back on the ranks before it");
    assert_false(has_layer(kdac_shard_client(s, 0), "X"));
    assert_int_equal(kdac_layer_drop(kdac_shard_client(s, 1), "X", NULL), KDAC_OK);
    assert_int_equal(kdac_shard_layer_register(s, &layer, &e), KDAC_OK);
    assert_true(has_layer(kdac_shard_client(s, 0), "X"));

    /* 5 + 5 slots: rank 1 allows 8, so the second five stay on neither rank */
    uint64_t five[2 * 5], slots[2 * 5];
    assert_int_equal(kdac_shard_slot_alloc(s, 5, 0, five, &e), KDAC_OK);
    assert_int_equal(kdac_shard_slot_alloc(s, 5, 0, slots, &e), KDAC_E_QUOTA_EXCEEDED);
    assert_contains(e.message, "rank 1 (");
    assert_contains(e.message, "the other ranks' slots were freed again");
    kdac_slot_info_result info;
    for (uint32_t i = 0; i < 2; i++) {
        assert_int_equal(kdac_slot_info(kdac_shard_client(s, i), NULL, 0, &info, NULL), KDAC_OK);
        assert_int_equal(info.nslots, 5);
    }
    assert_int_equal(kdac_shard_slot_free(s, five, 5, &e), KDAC_OK);

    /* rank 1's half of the slot moves on alone; a guarded sharded prefill then applies on
     * rank 0 only, and says so */
    assert_int_equal(kdac_shard_slot_alloc(s, 1, 0, slots, &e), KDAC_OK);
    seq x;
    seq_make(&x, &r, 10);
    uint16_t *half_in = calloc((size_t)10 * (H / 2) * D + 1, 2);
    kdac_seq alone = {.slot = slots[1], .len = 10, .q = kdac_tensor_inline(half_in),
                      .k = kdac_tensor_inline(half_in), .v = kdac_tensor_inline(half_in),
                      .g = kdac_tensor_inline(half_in), .beta = kdac_tensor_inline(half_in),
                      .out = kdac_output_inline(NULL)};
    assert_int_equal(kdac_prefill(kdac_shard_client(s, 1), "X", &alone, 1, NULL, &e), KDAC_OK);
    kdac_shard_seq q = {.slot = slots, .len = 10, .flags = KDAC_SEQ_EXPECT_POS, .expect_pos = 0,
                        .q = x.q, .k = x.k, .v = x.v, .g = x.g, .beta = x.beta, .out = x.out};
    int status[2] = {1, 1};
    assert_int_equal(kdac_shard_prefill(s, "X", &q, 1, NULL, status, &e),
                     KDAC_E_POSITION_MISMATCH);
    assert_int_equal(status[0], 0);
    assert_int_equal(status[1], KDAC_E_POSITION_MISMATCH);
    assert_false(e.retryable);
    assert_contains(e.message, "rank 1 (");
    assert_contains(e.message, "took effect on rank 0: the sharded slots are out of step");
    /* both halves moved to 10 by now, by different inputs; a FRESH prefill realigns them */
    float *st = malloc(STATE_ELEMS * 4);
    uint64_t pos = 0;
    assert_int_equal(kdac_shard_slot_read(s, slots, KDAC_DTYPE_F32, st, &pos, &e), KDAC_OK);
    assert_int_equal(pos, 10);
    q.flags = KDAC_SEQ_FRESH;
    assert_int_equal(kdac_shard_prefill(s, "X", &q, 1, &pos, status, &e), KDAC_OK);
    assert_int_equal(pos, 10);
    /* a slot whose halves stand at different positions is reported by reads */
    assert_int_equal(kdac_prefill(kdac_shard_client(s, 1), "X", &alone, 1, NULL, &e), KDAC_OK);
    assert_int_equal(kdac_shard_slot_read(s, slots, KDAC_DTYPE_F32, st, &pos, &e),
                     KDAC_E_POSITION_MISMATCH);
    assert_contains(e.message, "rank 0 is at position 10, rank 1 (");
    assert_contains(e.message, "at 20: the sharded slot is out of step");
    free(st);
    free(half_in);
    seq_free(&x);
    assert_int_equal(kdac_shard_slot_free(s, slots, 1, &e), KDAC_OK);
    assert_int_equal(kdac_layer_drop(kdac_shard_client(s, 0), "X", NULL), KDAC_OK);
    assert_int_equal(kdac_layer_drop(kdac_shard_client(s, 1), "X", NULL), KDAC_OK);
    kdac_shard_close(s);
}

/* A rank whose daemon stopped: the call names it and sends nothing anywhere. */
static void test_rank_down(void **state)
{
    kdad_proc a, b;
    assert_true(kdad_start_on(&a, BACKEND, H / 2, yaml(0, NULL)));
    assert_true(kdad_start_on(&b, BACKEND, H / 2, yaml(1, NULL)));
    const char *paths[2] = {a.sock, b.sock};
    kdac_shard *s = open_shard(paths, 2);
    test_rng r;
    rng_seed(&r, 9);
    float A_log[H], dt_bias[H * D];
    kdac_layer layer = layer_make(&r, "L", A_log, dt_bias);
    kdac_error e;
    uint64_t slots[2];
    assert_int_equal(kdac_shard_layer_register(s, &layer, &e), KDAC_OK);
    assert_int_equal(kdac_shard_slot_alloc(s, 1, 0, slots, &e), KDAC_OK);
    char bsock[sizeof(b.sock)];
    snprintf(bsock, sizeof(bsock), "%s", b.sock);
    assert_int_equal(kdad_stop(&b), 0);

    seq x;
    seq_make(&x, &r, 50);
    kdac_shard_seq q = {.slot = slots, .len = 50, .q = x.q, .k = x.k, .v = x.v, .g = x.g,
                        .beta = x.beta, .out = x.out};
    int status[2] = {1, 1};
    int rc = kdac_shard_prefill(s, "L", &q, 1, NULL, status, &e);
    assert_true(rc < 0);
    assert_int_equal(status[0], rc);
    assert_int_equal(status[1], rc);
    char want[200];
    snprintf(want, sizeof(want), "rank 1 (%s): the connection failed", bsock);
    assert_contains(e.message, want);
    /* rank 0 was not touched */
    kdac_slot_info_result info;
    assert_int_equal(kdac_slot_info(kdac_shard_client(s, 0), &slots[0], 1, &info, &e), KDAC_OK);
    assert_int_equal(info.slots[0].pos, 0);
    float *st = malloc(STATE_ELEMS * 4);
    assert_true(kdac_shard_slot_read(s, slots, KDAC_DTYPE_F32, st, NULL, &e) < 0);
    assert_contains(e.message, want);
    free(st);
    seq_free(&x);
    kdac_shard_close(s);
    assert_int_equal(kdad_stop(&a), 0);
}

/* scripts/bench-ranks.sh: one kdactl bench per daemon, started together, summed. */
static void test_bench_ranks(void **state)
{
    setenv("KDACTL", build_path("client/kdactl"), 1);
    char script[512];
    const char *src = getenv("KDAD_SOURCE_DIR"); /* a GPU host's copy of the tree */
    snprintf(script, sizeof(script), "%s/scripts/bench-ranks.sh", src ? src : KDAD_SOURCE_DIR);
    char *argv[] = {"/bin/bash", script, "--json", half[0].sock, half[1].sock, "--",
                    "--requests", "20", "--tokens", "32", "--clients", "2", NULL};
    cmd_result r = cmd_run(argv);
    if (r.status != 0)
        fail_msg("bench-ranks.sh: exit %d: %s", r.status, r.err);
    /* 20 requests of 32 tokens on each of the two ranks of 2 heads */
    assert_contains(r.out, "\"rank\": 0, \"target\": \"");
    assert_contains(r.out, "\"rank\": 1, ");
    char want[64];
    snprintf(want, sizeof(want), "\"heads\": %d, \"tokens\": 640, ", H / 2);
    assert_contains(r.out, want);
    assert_contains(r.out, "], \"tokens\": 1280, ");
    cmd_free(&r);
    char *bad[] = {"/bin/bash", script, "/nonexistent/kdad.sock", "--", "--requests", "1", NULL};
    r = cmd_run(bad);
    assert_int_equal(r.status, 3);
    assert_contains(r.err, "rank 0 (/nonexistent/kdad.sock)");
    cmd_free(&r);
    unsetenv("KDACTL");
}

int main(void)
{
#ifdef SHARD_CUDA
    if (cudaGetDeviceCount(&ngpus) != cudaSuccess || ngpus == 0) {
        fprintf(stderr, "skipped: no CUDA device\n");
        return 77;
    }
    fprintf(stderr, "%d GPU(s): rank r of each shard on device r %% %d\n", ngpus, ngpus);
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_halves_equal_one_daemon),
        cmocka_unit_test(test_uneven_ranks_equal_one_daemon),
        cmocka_unit_test(test_open_refusals),
        cmocka_unit_test(test_one_rank_refuses),
        cmocka_unit_test(test_rank_down),
        cmocka_unit_test(test_bench_ranks),
    };
    return cmocka_run_group_tests(tests, start_all, stop_all);
}
