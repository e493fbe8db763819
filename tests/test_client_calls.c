/*
 * test_client_calls.c - every call of libkdaclient (calls.c, shm.c) against
 * the in-process fake daemon: the request the daemon receives (decoded with
 * the daemon's own codec) carries exactly the caller's arguments, the
 * result reaches the caller intact, daemon errors keep their code, flag and
 * message, a malformed result fails only its own request, memfd regions
 * arrive sealed over SCM_RIGHTS with their bytes, and calls refused by
 * argument checks never run their callbacks.
 */
#define _GNU_SOURCE /* F_GET_SEALS */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "fake_kdad.h"
#include "kdaclient.h"

#define H FAKE_HEADS
#define STATE_F32 ((size_t)H * 128 * 128 * 4)
#define STATE_BF16 ((size_t)H * 128 * 128 * 2)

static void assert_contains(const char *text, const char *part)
{
    if (!strstr(text, part))
        fail_msg("\"%s\" lacks \"%s\"", text, part);
}

static bool is_bytes(const void *p, size_t n, uint8_t seed)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        if (b[i] != (uint8_t)(i * 13 + seed))
            return false;
    }
    return true;
}

static void *bytes(size_t n, uint8_t seed)
{
    uint8_t *b = malloc(n);
    assert_non_null(b);
    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)(i * 13 + seed);
    return b;
}

/* Encodes a result with `call` into fc->w and sends it when that worked. */
#define ANSWER(fc, call)                                                             \
    do {                                                                             \
        kp_error ans_err_;                                                           \
        if (fake_check((fc), (call) == KP_OK, "%s: %s", #call, ans_err_.message))    \
            fake_send(fc);                                                           \
    } while (0)
#define E (&ans_err_)

/* Decodes the current request's params with `call`. */
#define PARAMS(fc, call)                                                         \
    ({                                                                           \
        kp_error par_err_;                                                       \
        fake_check((fc), (call) == KP_OK, "%s: %s", #call, par_err_.message);    \
    })
#define PE (&par_err_)

static kdac_client *open_fake(fake_server *s)
{
    kdac_client *c;
    kdac_error err;
    int rc = fake_client_open(s, 10000, &c, &err);
    if (rc)
        fail_msg("open: %s", err.message);
    return c;
}

/* ---------------------------------------------------------------------- */
/* Slots                                                                  */
/* ---------------------------------------------------------------------- */

static const uint64_t handles[3] = {0x500000001ull, 0x500000007ull, 0x90000000aull};

static void script_slots(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    uint32_t id;
    /* alloc 3, empty */
    if ((id = fake_expect(fc, KP_METHOD_SLOT_ALLOC))) {
        kp_slot_alloc_params p;
        if (PARAMS(fc, kp_slot_alloc_params_decode(&fc->msg, &fc->session, &p, PE)))
            fake_check(fc, p.count == 3 && !p.zero, "alloc count %u zero %d", p.count, p.zero);
        kp_slot_list r = {handles, 3};
        ANSWER(fc, kp_slot_alloc_result_encode(&fc->w, id, &r, E));
    }
    /* free, reset */
    kp_method lists[2] = {KP_METHOD_SLOT_FREE, KP_METHOD_SLOT_RESET};
    for (int m = 0; m < 2; m++) {
        if (!(id = fake_expect(fc, lists[m])))
            continue;
        kp_slot_list p;
        bool ok = m == 0 ? PARAMS(fc, kp_slot_free_params_decode(&fc->msg, &fc->session, &p, PE))
                         : PARAMS(fc, kp_slot_reset_params_decode(&fc->msg, &fc->session, &p, PE));
        if (ok)
            fake_check(fc, p.nslots == 2 && p.slots[0] == handles[0] && p.slots[1] == handles[1],
                       "slot list");
        ANSWER(fc, kp_empty_result_encode(&fc->w, id, E));
    }
    /* fork into a new slot */
    if ((id = fake_expect(fc, KP_METHOD_SLOT_FORK))) {
        kp_slot_fork_params p;
        if (PARAMS(fc, kp_slot_fork_params_decode(&fc->msg, &fc->session, &p, PE)))
            fake_check(fc, p.src == handles[0] && !p.has_dst, "fork params");
        kp_slot_fork_result r = {handles[2], 300};
        ANSWER(fc, kp_slot_fork_result_encode(&fc->w, id, &r, E));
    }
    /* read f32 inline */
    uint8_t *state = bytes(STATE_F32, 3);
    if ((id = fake_expect(fc, KP_METHOD_SLOT_READ))) {
        kp_slot_read_params p;
        if (PARAMS(fc, kp_slot_read_params_decode(&fc->msg, &fc->session, &p, PE)))
            fake_check(fc, p.slot == handles[2] && p.has_dtype && p.dtype == KP_DTYPE_F32 &&
                               p.out.kind == KP_REF_ABSENT, "read params");
        kp_slot_read_result r = {300, KP_DTYPE_F32, kp_ref_inline(state, STATE_F32)};
        ANSWER(fc, kp_slot_read_result_encode(&fc->w, id, &r, E));
    }
    /* read bf16 into a region */
    if ((id = fake_expect(fc, KP_METHOD_SLOT_READ))) {
        kp_slot_read_params p;
        if (PARAMS(fc, kp_slot_read_params_decode(&fc->msg, &fc->session, &p, PE)))
            fake_check(fc, p.dtype == KP_DTYPE_BF16 && p.out.kind == KP_REF_REGION &&
                               p.out.region == 2 && p.out.offset == 4096, "read into region");
        kp_slot_read_result r = {300, KP_DTYPE_BF16, {KP_REF_ABSENT, NULL, 0, 0, 0}};
        ANSWER(fc, kp_slot_read_result_encode(&fc->w, id, &r, E));
    }
    /* write bf16 inline */
    if ((id = fake_expect(fc, KP_METHOD_SLOT_WRITE))) {
        kp_slot_write_params p;
        if (PARAMS(fc, kp_slot_write_params_decode(&fc->msg, &fc->session, &p, PE)))
            fake_check(fc, p.slot == handles[1] && p.pos == 77 && p.dtype == KP_DTYPE_BF16 &&
                               p.state.kind == KP_REF_INLINE &&
                               is_bytes(p.state.data, STATE_BF16, 5), "write params");
        ANSWER(fc, kp_empty_result_encode(&fc->w, id, E));
    }
    /* info of every owned slot */
    if ((id = fake_expect(fc, KP_METHOD_SLOT_INFO))) {
        kp_slot_info_params p;
        if (PARAMS(fc, kp_slot_info_params_decode(&fc->msg, &fc->session, &p, PE)))
            fake_check(fc, !p.has_slots, "info of all slots");
        kp_slot_info info[2] = {{handles[0], 12, KP_SLOT_READY, 0},
                                {handles[1], 0, KP_SLOT_EMPTY, 2}};
        kp_slot_info_result r = {info, 2, 40, 1000};
        ANSWER(fc, kp_slot_info_result_encode(&fc->w, id, &r, E));
    }
    free(state);
    fake_wait_eof(fc);
}

static void test_slot_calls(void **state)
{
    fake_server *s = fake_start(script_slots, NULL);
    kdac_client *c = open_fake(s);
    kdac_error err;
    uint64_t got[3];
    assert_int_equal(kdac_slot_alloc(c, 3, KDAC_SLOT_ALLOC_EMPTY, got, &err), KDAC_OK);
    assert_memory_equal(got, handles, sizeof(handles));
    assert_int_equal(kdac_slot_free(c, handles, 2, &err), KDAC_OK);
    assert_int_equal(kdac_slot_reset(c, handles, 2, &err), KDAC_OK);
    uint64_t slot, pos;
    assert_int_equal(kdac_slot_fork(c, handles[0], 0, &slot, &pos, &err), KDAC_OK);
    assert_int_equal(slot, handles[2]);
    assert_int_equal(pos, 300);
    void *buf = calloc(1, STATE_F32);
    assert_int_equal(kdac_slot_read(c, handles[2], KDAC_DTYPE_F32, kdac_output_inline(buf), &pos,
                                    &err), KDAC_OK);
    assert_int_equal(pos, 300);
    assert_true(is_bytes(buf, STATE_F32, 3));
    pos = 0;
    assert_int_equal(kdac_slot_read(c, handles[2], KDAC_DTYPE_BF16, kdac_output_region(2, 4096),
                                    &pos, &err), KDAC_OK);
    assert_int_equal(pos, 300);
    void *st = bytes(STATE_BF16, 5);
    assert_int_equal(kdac_slot_write(c, handles[1], 77, KDAC_DTYPE_BF16, kdac_tensor_inline(st),
                                     &err), KDAC_OK);
    kdac_slot_info_result info;
    assert_int_equal(kdac_slot_info(c, NULL, 0, &info, &err), KDAC_OK);
    assert_int_equal(info.nslots, 2);
    assert_int_equal(info.slots[0].slot, handles[0]);
    assert_int_equal(info.slots[0].pos, 12);
    assert_int_equal(info.slots[0].status, KDAC_SLOT_READY);
    assert_int_equal(info.slots[1].status, KDAC_SLOT_EMPTY);
    assert_int_equal(info.slots[1].queued, 2);
    assert_int_equal(info.pool_free, 40);
    assert_int_equal(info.quota_left, 1000);
    kdac_client_close(c);
    assert_int_equal(fake_stop(s), 0);
    free(buf);
    free(st);
}

/* ---------------------------------------------------------------------- */
/* Prefill                                                                */
/* ---------------------------------------------------------------------- */

#define TOKB(len) ((size_t)(len) * H * 128 * 2)

static void script_prefill(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    uint32_t id = fake_expect(fc, KP_METHOD_PREFILL);
    kp_prefill_params p;
    if (!id || !PARAMS(fc, kp_prefill_params_decode(&fc->msg, &fc->session, &p, PE)))
        return;
    fake_check(fc, strcmp(p.layer, "model.layers.3.kda") == 0 && p.nseqs == 3, "layer, nseqs");
    /* [0]: 5 tokens inline, expect_pos 10, output inline */
    const kp_prefill_seq *a = &p.seqs[0];
    fake_check(fc, a->slot == handles[0] && a->len == 5 && a->has_expect_pos &&
                       a->expect_pos == 10 && !a->fresh && a->out.kind == KP_REF_ABSENT,
               "seq 0 fields");
    fake_check(fc, is_bytes(a->q.data, TOKB(5), 1) && is_bytes(a->k.data, TOKB(5), 2) &&
                       is_bytes(a->v.data, TOKB(5), 3) && is_bytes(a->g.data, TOKB(5), 4) &&
                       is_bytes(a->beta.data, 5 * H * 2, 5), "seq 0 tensors");
    /* [1]: 7 tokens by region, fresh, output into the region */
    const kp_prefill_seq *b = &p.seqs[1];
    fake_check(fc, b->fresh && !b->has_expect_pos && b->len == 7 && b->q.kind == KP_REF_REGION &&
                       b->q.region == 1 && b->q.offset == 0 && b->beta.offset == 4 * TOKB(7) &&
                       b->out.kind == KP_REF_REGION && b->out.offset == 8 * TOKB(7),
               "seq 1 regions");
    /* [2]: len 0 */
    fake_check(fc, p.seqs[2].len == 0 && p.seqs[2].q.kind == KP_REF_ABSENT, "seq 2 empty");
    uint8_t *out = bytes(TOKB(5), 9);
    kp_prefill_seq_result sr[3] = {{15, kp_ref_inline(out, TOKB(5))},
                                   {7, {KP_REF_ABSENT, NULL, 0, 0, 0}},
                                   {4, {KP_REF_ABSENT, NULL, 0, 0, 0}}};
    kp_prefill_result r = {.seqs = sr, .nseqs = 3, .queue_us = 11, .run_us = 222,
                           .timed = true, .device_us = 180, .kernel_us = 150};
    ANSWER(fc, kp_prefill_result_encode(&fc->w, id, &r, E));
    free(out);
    fake_wait_eof(fc);
}

static void test_prefill_call(void **state)
{
    fake_server *s = fake_start(script_prefill, NULL);
    kdac_client *c = open_fake(s);
    void *in[5] = {bytes(TOKB(5), 1), bytes(TOKB(5), 2), bytes(TOKB(5), 3), bytes(TOKB(5), 4),
                   bytes(5 * H * 2, 5)};
    void *out = calloc(1, TOKB(5));
    kdac_seq seqs[3];
    memset(seqs, 0, sizeof(seqs));
    seqs[0] = (kdac_seq){handles[0], 5, KDAC_SEQ_EXPECT_POS, 10, kdac_tensor_inline(in[0]),
                         kdac_tensor_inline(in[1]), kdac_tensor_inline(in[2]),
                         kdac_tensor_inline(in[3]), kdac_tensor_inline(in[4]),
                         kdac_output_inline(out)};
    seqs[1] = (kdac_seq){handles[1], 7, KDAC_SEQ_FRESH, 0, kdac_tensor_region(1, 0),
                         kdac_tensor_region(1, TOKB(7)), kdac_tensor_region(1, 2 * TOKB(7)),
                         kdac_tensor_region(1, 3 * TOKB(7)), kdac_tensor_region(1, 4 * TOKB(7)),
                         kdac_output_region(1, 8 * TOKB(7))};
    seqs[2].slot = handles[2];
    kdac_prefill_result res;
    kdac_error err;
    assert_int_equal(kdac_prefill(c, "model.layers.3.kda", seqs, 3, &res, &err), KDAC_OK);
    assert_int_equal(res.nseqs, 3);
    assert_int_equal(res.pos[0], 15);
    assert_int_equal(res.pos[1], 7);
    assert_int_equal(res.pos[2], 4);
    assert_int_equal(res.queue_us, 11);
    assert_int_equal(res.run_us, 222);
    assert_int_equal(res.device_us, 180);
    assert_int_equal(res.kernel_us, 150);
    assert_true(is_bytes(out, TOKB(5), 9));
    kdac_client_close(c);
    assert_int_equal(fake_stop(s), 0);
    for (int i = 0; i < 5; i++)
        free(in[i]);
    free(out);
}

/* ---------------------------------------------------------------------- */
/* Step                                                                   */
/* ---------------------------------------------------------------------- */

#define STEP_T 6 /* lens 1, 1, 4 */

static void script_step(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    kp_step_params p;
    /* 1: inline inputs, expect_pos, inline output, states kept in region 2 */
    uint32_t id = fake_expect(fc, KP_METHOD_STEP);
    if (!id || !PARAMS(fc, kp_step_params_decode(&fc->msg, &fc->session, &p, PE)))
        return;
    fake_check(fc, strcmp(p.layer, "L3") == 0 && p.nseqs == 3 && p.tokens == STEP_T, "layer, counts");
    bool lists = true;
    for (uint32_t i = 0; i < 3; i++)
        lists &= kp_step_u64(p.slots, i) == handles[i] && p.lens[i] == (i == 2 ? 4 : 1) &&
                 p.expect_pos && kp_step_u64(p.expect_pos, i) == 100 + i;
    fake_check(fc, lists, "slots, lens, expect_pos");
    fake_check(fc, is_bytes(p.q.data, TOKB(STEP_T), 1) && is_bytes(p.k.data, TOKB(STEP_T), 2) &&
                       is_bytes(p.v.data, TOKB(STEP_T), 3) && is_bytes(p.g.data, TOKB(STEP_T), 4) &&
                       is_bytes(p.beta.data, STEP_T * H * 2, 5), "inline tensors");
    fake_check(fc, p.out.kind == KP_REF_ABSENT && p.states.kind == KP_REF_REGION && p.states.region == 2 &&
                       p.states.offset == 0 && p.states.nbytes == STEP_T * STATE_F32, "out inline, states kept");
    uint8_t *out = bytes(TOKB(STEP_T), 9);
    const uint64_t pos[3] = {101, 102, 106};
    kp_step_result r = {.nseqs = 3, .pos = pos, .out = kp_ref_inline(out, TOKB(STEP_T)), .queue_us = 4,
                        .run_us = 40, .timed = true, .device_us = 30, .kernel_us = 21};
    ANSWER(fc, kp_step_result_encode(&fc->w, id, &r, E));
    free(out);
    /* 2: by regions, no expect_pos, output into region 1 */
    id = fake_expect(fc, KP_METHOD_STEP);
    if (!id || !PARAMS(fc, kp_step_params_decode(&fc->msg, &fc->session, &p, PE)))
        return;
    fake_check(fc, p.nseqs == 1 && p.tokens == 1 && !p.expect_pos && p.q.kind == KP_REF_REGION &&
                       p.beta.offset == 4 * TOKB(1) && p.out.kind == KP_REF_REGION &&
                       p.out.offset == 5 * TOKB(1) && p.states.kind == KP_REF_ABSENT, "regions");
    const uint64_t pos1 = 7;
    kp_step_result r2 = {.nseqs = 1, .pos = &pos1, .queue_us = 1, .run_us = 2};
    ANSWER(fc, kp_step_result_encode(&fc->w, id, &r2, E));
    fake_wait_eof(fc);
}

static void test_step_call(void **state)
{
    fake_server *s = fake_start(script_step, NULL);
    kdac_client *c = open_fake(s);
    void *in[5] = {bytes(TOKB(STEP_T), 1), bytes(TOKB(STEP_T), 2), bytes(TOKB(STEP_T), 3),
                   bytes(TOKB(STEP_T), 4), bytes(STEP_T * H * 2, 5)};
    void *out = calloc(1, TOKB(STEP_T));
    uint64_t slots[3] = {handles[0], handles[1], handles[2]}, expect[3] = {100, 101, 102};
    uint8_t lens[3] = {1, 1, 4};
    kdac_step_request st = {.nseqs = 3, .slots = slots, .lens = lens, .expect_pos = expect,
                    .q = kdac_tensor_inline(in[0]), .k = kdac_tensor_inline(in[1]),
                    .v = kdac_tensor_inline(in[2]), .g = kdac_tensor_inline(in[3]),
                    .beta = kdac_tensor_inline(in[4]), .out = kdac_output_inline(out),
                    .states = kdac_output_region(2, 0)};
    kdac_step_result res;
    kdac_error err;
    assert_int_equal(kdac_step(c, "L3", &st, &res, &err), KDAC_OK);
    assert_int_equal(res.nseqs, 3);
    assert_int_equal(res.pos[0], 101);
    assert_int_equal(res.pos[1], 102);
    assert_int_equal(res.pos[2], 106);
    assert_int_equal(res.queue_us, 4);
    assert_int_equal(res.run_us, 40);
    assert_int_equal(res.device_us, 30);
    assert_int_equal(res.kernel_us, 21);
    assert_true(is_bytes(out, TOKB(STEP_T), 9));

    uint8_t one = 1;
    kdac_step_request st2 = {.nseqs = 1, .slots = slots, .lens = &one, .q = kdac_tensor_region(1, 0),
                     .k = kdac_tensor_region(1, TOKB(1)), .v = kdac_tensor_region(1, 2 * TOKB(1)),
                     .g = kdac_tensor_region(1, 3 * TOKB(1)), .beta = kdac_tensor_region(1, 4 * TOKB(1)),
                     .out = kdac_output_region(1, 5 * TOKB(1))};
    assert_int_equal(kdac_step(c, "L3", &st2, &res, &err), KDAC_OK);
    assert_int_equal(res.nseqs, 1);
    assert_int_equal(res.pos[0], 7);
    kdac_client_close(c);
    assert_int_equal(fake_stop(s), 0);
    for (int i = 0; i < 5; i++)
        free(in[i]);
    free(out);
}

/* ---------------------------------------------------------------------- */
/* Health, stats, layers                                                  */
/* ---------------------------------------------------------------------- */

static void script_registry(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    uint32_t id;
    if ((id = fake_expect(fc, KP_METHOD_HEALTH))) {
        kp_health_result r = {KP_HEALTH_DRAINING, 5000000, 3, 1};
        ANSWER(fc, kp_health_result_encode(&fc->w, id, &r, E));
    }
    if ((id = fake_expect(fc, KP_METHOD_STATS))) {
        uint64_t bounds[3] = {100, 1000, 10000}, counts[4] = {5, 6, 7, 1};
        kp_counter errs[2] = {{"INVALID_PARAMS", 4}, {"STALE_SLOT", 1}};
        kp_counter disc[1] = {{"peer_closed", 9}};
        kp_phase ph[2] = {{"wait", 40, 50, 60, 800}, {"kernel", 30, 35, 39, 600}};
        kp_stats_result r = {
            .uptime_us = 77, .connections = 2, .connections_total = 10, .requests = 300,
            .batches = 20, .seqs = 40, .tokens = 5000, .latency_count = 19,
            .latency_p50_us = 800, .latency_p90_us = 5000, .latency_p99_us = 9000,
            .latency_max_us = 12000, .latency_bounds_us = bounds, .latency_counts = counts,
            .latency_nbounds = 3, .slots_total = 64, .slots_used = 5, .slots_lost = 1,
            .layers = 2, .regions = 3, .errors = errs, .nerrors = 2, .disconnects = disc,
            .ndisconnects = 1, .bytes_in = {1, 2, 3}, .bytes_out = {4, 5, 6},
            .has_batch_phases = true, .batch_count = 20, .batch_window = 20, .phases = ph,
            .nphases = 2};
        ANSWER(fc, kp_stats_result_encode(&fc->w, id, &r, E));
    }
    /* a daemon that reports the usage against the bounds (asked twice) */
    for (int i = 0; i < 2 && (id = fake_expect(fc, KP_METHOD_STATS)); i++) {
        kp_stats_result r = {
            .latency_nbounds = 0, .latency_counts = (const uint64_t[]){0},
            .has_uid = true, .uid = 1234, .uid_layers = 2, .uid_slots = 9,
            .has_uid_held = true, .uid_connections = 3, .uid_held = {100, 40, 7, 4096},
            .has_clients = true, .held = {200, 80, 14, 8192}, .held_peak = {300, 90, 21, 9000},
            .stalled = 5, .refused = 6,
            .bounds = {.max_connections = 50, .max_connections_per_uid = 4,
                       .max_inflight_bytes_per_uid = 1u << 20, .output_stall_seconds = 11},
            .has_memory = true, .memory = {1ull << 33, 2, 3, 4, 5, 6, (1ull << 33) + 20}};
        ANSWER(fc, kp_stats_result_encode(&fc->w, id, &r, E));
    }
    if ((id = fake_expect(fc, KP_METHOD_LAYER_REGISTER))) {
        kp_layer_register_params p;
        if (PARAMS(fc, kp_layer_register_params_decode(&fc->msg, &fc->session, &p, PE))) {
            fake_check(fc, strcmp(p.name, "L7") == 0 && p.lower_bound == -3.0f &&
                               p.scale == 0.25f, "layer fields");
            float a[H];
            memcpy(a, p.A_log.data, sizeof(a));
            fake_check(fc, a[0] == 0.5f && a[H - 1] == 0.5f + H - 1, "A_log values");
        }
        kp_layer_register_result r = {true};
        ANSWER(fc, kp_layer_register_result_encode(&fc->w, id, &r, E));
    }
    if ((id = fake_expect(fc, KP_METHOD_LAYER_LIST))) {
        kp_layer_info l[3] = {{"a", -5, 0.1f, KP_LAYER_SOURCE_CONFIG},
                              {"b", -4, 0.2f, KP_LAYER_SOURCE_CLIENT},
                              {"c", -3, 0.3f, KP_LAYER_SOURCE_CLIENT}};
        kp_layer_list_result r = {l, 3};
        ANSWER(fc, kp_layer_list_result_encode(&fc->w, id, &r, E));
    }
    if ((id = fake_expect(fc, KP_METHOD_LAYER_DROP))) {
        kp_layer_drop_params p;
        if (PARAMS(fc, kp_layer_drop_params_decode(&fc->msg, &fc->session, &p, PE)))
            fake_check(fc, strcmp(p.name, "L7") == 0, "drop name");
        fake_send_error(fc, id, KP_E_PERMISSION_DENIED, "layer L7 comes from the config");
    }
    if ((id = fake_expect(fc, KP_METHOD_HEALTH)))
        fake_send_error(fc, id, -77, "a code from a newer daemon");
    fake_wait_eof(fc);
}

static void test_registry_calls(void **state)
{
    fake_server *s = fake_start(script_registry, NULL);
    kdac_client *c = open_fake(s);
    kdac_error err;
    kdac_health_info h;
    assert_int_equal(kdac_health(c, &h, &err), KDAC_OK);
    assert_true(h.draining);
    assert_int_equal(h.uptime_us, 5000000);
    assert_int_equal(h.queued, 3);
    assert_int_equal(h.running, 1);

    assert_false(kdac_client_info(c)->has_bounds); /* a daemon before limits.clients */
    assert_false(kdac_client_info(c)->has_memory); /* ... and before the memory */
    kdac_stats_info *st = calloc(1, sizeof(*st));
    /* a daemon before the usage against the bounds: none reported */
    kdac_usage_info u;
    memset(&u, 0xab, sizeof(u));
    assert_int_equal(kdac_stats_usage(c, st, &u, sizeof(u), &err), KDAC_OK);
    assert_false(u.has_uid);
    assert_false(u.has_uid_held);
    assert_false(u.has_clients);
    assert_false(u.has_memory);
    assert_int_equal(u.bounds.max_inflight_bytes_per_uid, 0);
    assert_int_equal(st->requests, 300);
    assert_int_equal(st->tokens, 5000);
    assert_int_equal(st->latency_p99_us, 9000);
    assert_int_equal(st->latency_nbounds, 3);
    assert_int_equal(st->latency_bounds_us[2], 10000);
    assert_int_equal(st->latency_counts[3], 1);
    assert_int_equal(st->slots_lost, 1);
    assert_int_equal(st->nerrors, 2);
    assert_string_equal(st->errors[1].name, "STALE_SLOT");
    assert_int_equal(st->errors[1].value, 1);
    assert_int_equal(st->batch_count, 20);
    assert_int_equal(st->batch_window, 20);
    assert_int_equal(st->nphases, 2);
    assert_string_equal(st->phases[1].name, "kernel");
    assert_int_equal(st->phases[1].p50_us, 30);
    assert_int_equal(st->phases[1].p99_us, 39);
    assert_int_equal(st->phases[1].sum_us, 600);
    assert_int_equal(st->phases[0].p90_us, 50);
    assert_int_equal(st->ndisconnects, 1);
    assert_string_equal(st->disconnects[0].name, "peer_closed");
    assert_int_equal(st->bytes_in[KDAC_TRANSPORT_ID_CUDA_IPC], 3);
    assert_int_equal(st->bytes_out[KDAC_TRANSPORT_ID_INLINE], 4);
    free(st);

    /* A daemon that reports it, into a struct as an older caller compiled it */
    memset(&u, 0xab, sizeof(u));
    assert_int_equal(kdac_stats_usage(c, NULL, &u, offsetof(kdac_usage_info, has_clients), &err),
                     KDAC_OK);
    assert_true(u.has_uid);
    assert_int_equal(u.uid, 1234);
    assert_int_equal(u.layers, 2);
    assert_int_equal(u.slots, 9);
    assert_true(u.has_uid_held);
    assert_int_equal(u.connections, 3);
    assert_int_equal(u.held.partial_bytes, 40);
    assert_int_equal(u.held.region_bytes, 4096);
    assert_int_equal(u.stalled, 0xababababababababull); /* past the size given: untouched */
    assert_int_equal(u.memory.total, 0xababababababababull);
    st = calloc(1, sizeof(*st));
    assert_int_equal(kdac_stats_usage(c, st, &u, sizeof(u), &err), KDAC_OK);
    assert_int_equal(st->slots_total, 0); /* both filled from the one answer */
    assert_true(u.has_clients);
    assert_int_equal(u.total.inflight_bytes, 200);
    assert_int_equal(u.total.output_bytes, 14);
    assert_int_equal(u.peak.partial_bytes, 90);
    assert_int_equal(u.peak.region_bytes, 9000);
    assert_int_equal(u.stalled, 5);
    assert_int_equal(u.refused, 6);
    assert_int_equal(u.bounds.max_connections, 50);
    assert_int_equal(u.bounds.max_connections_per_uid, 4);
    assert_int_equal(u.bounds.max_inflight_bytes_per_uid, 1u << 20);
    assert_int_equal(u.bounds.output_stall_seconds, 11);
    assert_int_equal(u.bounds.frame_stall_seconds, 0);
    /* the per-uid layers and slots as hello told */
    assert_int_equal(u.bounds.max_slots_per_uid, kdac_client_info(c)->bounds.max_slots_per_uid);
    assert_true(u.has_memory);
    assert_int_equal(u.memory.pool, 1ull << 33);
    assert_int_equal(u.memory.scratch, 3);
    assert_int_equal(u.memory.layers, 6);
    assert_int_equal(u.memory.total, (1ull << 33) + 20);
    free(st);
    assert_int_equal(kdac_stats_usage(c, NULL, NULL, 0, &err), KDAC_E_INVALID_ARGUMENT);

    float A_log[H], dt_bias[H * 128] = {0};
    for (int i = 0; i < H; i++)
        A_log[i] = 0.5f + i;
    kdac_layer layer = {"L7", A_log, dt_bias, -3.0f, 0.25f};
    bool created = false;
    assert_int_equal(kdac_layer_register(c, &layer, &created, &err), KDAC_OK);
    assert_true(created);

    kdac_layer_info layers[2];
    uint32_t n;
    assert_int_equal(kdac_layer_list(c, layers, 2, &n, &err), KDAC_OK);
    assert_int_equal(n, 3); /* three exist, two fit */
    assert_string_equal(layers[0].name, "a");
    assert_true(layers[0].from_config);
    assert_false(layers[1].from_config);
    assert_true(layers[1].scale == 0.2f);

    assert_int_equal(kdac_layer_drop(c, "L7", &err), KDAC_E_PERMISSION_DENIED);
    assert_contains(err.message, "comes from the config");
    assert_false(err.retryable);

    /* An unknown code keeps its value and the daemon's retryable flag. */
    assert_int_equal(kdac_health(c, &h, &err), -77);
    assert_int_equal(err.code, -77);
    assert_false(err.retryable);
    assert_string_equal(kdac_err_name(err.code), "UNKNOWN_CODE");
    kdac_client_close(c);
    assert_int_equal(fake_stop(s), 0);
}

/* ---------------------------------------------------------------------- */
/* Regions                                                                */
/* ---------------------------------------------------------------------- */

#define SHM_BYTES (1u << 20)

static void configure_gpu(kp_hello_result *h)
{
    h->backend = KP_BACKEND_CUDA;
    h->has_gpu = true;
    h->gpu.name = "NVIDIA H200";
    h->gpu.uuid = "GPU-00000000-1111-2222-3333-444444444444";
    h->transports |= KP_TRANSPORT_CUDA_IPC;
    h->has_memory = true;
    h->memory = (kp_memory){.pool = 100, .staging = 20, .scratch = 1 << 28, .kernel = 3,
                            .total = 123 + (1 << 28)};
}

static void script_regions(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    uint32_t id = fake_expect(fc, KP_METHOD_REGION_REGISTER_SHM);
    if (id) {
        kp_region_register_shm_params p;
        fake_check(fc, kp_msg_takes_fd(&fc->msg), "register_shm must claim a descriptor");
        if (PARAMS(fc, kp_region_register_shm_params_decode(&fc->msg, &fc->session, &p, PE)))
            fake_check(fc, p.size == SHM_BYTES, "size %llu", (unsigned long long)p.size);
        if (fake_check(fc, fc->nfds == 1, "%d descriptors arrived", fc->nfds)) {
            int fd = fc->fds[0];
            int seals = fcntl(fd, F_GET_SEALS);
            struct stat sb;
            fake_check(fc, seals >= 0 && (seals & F_SEAL_SHRINK), "seals 0x%x", seals);
            fake_check(fc, fstat(fd, &sb) == 0 && (uint64_t)sb.st_size == SHM_BYTES, "size");
            void *m = mmap(NULL, SHM_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (fake_check(fc, m != MAP_FAILED, "mmap")) {
                fake_check(fc, is_bytes(m, SHM_BYTES, 7), "region bytes");
                memset(m, 0xab, 64); /* the client sees the daemon's writes */
                munmap(m, SHM_BYTES);
            }
        }
        kp_region_register_result r = {1};
        ANSWER(fc, kp_region_register_result_encode(&fc->w, id, &r, E));
    }
    if ((id = fake_expect(fc, KP_METHOD_REGION_REGISTER_CUDA))) {
        kp_region_register_cuda_params p;
        if (PARAMS(fc, kp_region_register_cuda_params_decode(&fc->msg, &fc->session, &p, PE)))
            fake_check(fc, p.handle_type == KP_CUDA_HANDLE_IPC && p.size == 4096 &&
                               strcmp(p.device, fc->hello.gpu.uuid) == 0 &&
                               is_bytes(p.handle, 64, 2), "cuda ipc params");
        kp_region_register_result r = {2};
        ANSWER(fc, kp_region_register_result_encode(&fc->w, id, &r, E));
    }
    if ((id = fake_expect(fc, KP_METHOD_REGION_REGISTER_CUDA))) {
        kp_region_register_cuda_params p;
        if (PARAMS(fc, kp_region_register_cuda_params_decode(&fc->msg, &fc->session, &p, PE)))
            fake_check(fc, p.handle_type == KP_CUDA_HANDLE_POSIX_FD &&
                               strcmp(p.device, "GPU-other") == 0 && fc->nfds == 2,
                       "cuda posix_fd params, %d fds", fc->nfds);
        fake_send_error(fc, id, KP_E_REGION_INVALID, "device: GPU-other is not this daemon's");
    }
    if ((id = fake_expect(fc, KP_METHOD_REGION_RELEASE))) {
        kp_region_release_params p;
        if (PARAMS(fc, kp_region_release_params_decode(&fc->msg, &fc->session, &p, PE)))
            fake_check(fc, p.region == 1, "release region %u", p.region);
        ANSWER(fc, kp_empty_result_encode(&fc->w, id, E));
    }
    fake_wait_eof(fc);
}

static void test_region_calls(void **state)
{
    fake_server *s = fake_start_with(script_regions, NULL, configure_gpu);
    kdac_client *c = open_fake(s);
    const kdac_server_info *info = kdac_client_info(c);
    assert_true(info->has_memory);
    assert_int_equal(info->memory.pool, 100);
    assert_int_equal(info->memory.staging, 20);
    assert_int_equal(info->memory.scratch, 1 << 28);
    assert_int_equal(info->memory.kernel, 3);
    assert_int_equal(info->memory.lanes, 0);
    assert_int_equal(info->memory.total, 123 + (1 << 28));
    kdac_error err;
    kdac_shm shm;
    assert_int_equal(kdac_shm_create(&shm, SHM_BYTES, "test", &err), KDAC_OK);
    assert_true(shm.fd >= 0);
    assert_int_equal(shm.size, SHM_BYTES);
    /* Sealed: it can neither shrink nor grow. */
    assert_int_not_equal(ftruncate(shm.fd, 4096), 0);
    assert_int_not_equal(ftruncate(shm.fd, 2 * SHM_BYTES), 0);
    uint8_t *m = shm.base;
    for (size_t i = 0; i < SHM_BYTES; i++)
        m[i] = (uint8_t)(i * 13 + 7);
    uint32_t region = 0;
    assert_int_equal(kdac_region_register_shm(c, shm.fd, SHM_BYTES, &region, &err), KDAC_OK);
    assert_int_equal(region, 1);
    assert_int_equal(m[0], 0xab);
    assert_int_equal(m[63], 0xab);

    uint8_t *handle = bytes(64, 2);
    assert_int_equal(kdac_region_register_cuda(c, handle, 4096, NULL, &region, &err), KDAC_OK);
    assert_int_equal(region, 2);
    assert_int_equal(kdac_region_register_cuda_fd(c, shm.fd, 4096, "GPU-other", &region, &err),
                     KDAC_E_REGION_INVALID);
    assert_contains(err.message, "GPU-other");
    assert_int_equal(kdac_region_release(c, 1, &err), KDAC_OK);
    kdac_client_close(c);
    kdac_shm_close(&shm);
    assert_int_equal(shm.fd, -1);
    assert_int_equal(fake_stop(s), 0);
    free(handle);
}

static void script_hello_eof(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    fake_wait_eof(fc);
}

/* A CPU daemon has no GPU to name: refused before anything is sent. */
static void test_cuda_region_without_gpu(void **state)
{
    fake_server *s = fake_start(script_hello_eof, NULL);
    kdac_client *c = open_fake(s);
    kdac_error err;
    uint8_t handle[64] = {0};
    uint32_t region;
    assert_int_equal(kdac_region_register_cuda(c, handle, 4096, NULL, &region, &err),
                     KDAC_E_NOT_SUPPORTED);
    assert_contains(err.message, "backend cpu");
    kdac_client_close(c);
    assert_int_equal(fake_stop(s), 0);
}

/* ---------------------------------------------------------------------- */
/* Failures                                                               */
/* ---------------------------------------------------------------------- */

static void script_bad_alloc(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    uint32_t id = fake_expect(fc, KP_METHOD_SLOT_ALLOC);
    kp_slot_list r = {handles, 3}; /* 3 for 2 asked */
    if (id)
        ANSWER(fc, kp_slot_alloc_result_encode(&fc->w, id, &r, E));
    if ((id = fake_expect(fc, KP_METHOD_HEALTH))) {
        kp_health_result h = {KP_HEALTH_OK, 1, 0, 0};
        ANSWER(fc, kp_health_result_encode(&fc->w, id, &h, E));
    }
    fake_wait_eof(fc);
}

/* A malformed result fails its own request; the connection goes on. */
static void test_malformed_result(void **state)
{
    fake_server *s = fake_start(script_bad_alloc, NULL);
    kdac_client *c = open_fake(s);
    kdac_error err;
    uint64_t slots[3];
    assert_int_equal(kdac_slot_alloc(c, 2, 0, slots, &err), KDAC_E_PROTOCOL);
    assert_contains(err.message, "3 handles for 2 requested");
    kdac_health_info h;
    assert_int_equal(kdac_health(c, &h, &err), KDAC_OK);
    kdac_client_close(c);
    assert_int_equal(fake_stop(s), 0);
}

static int calls;
static void count_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    calls++;
}

/* Argument errors: refused with a named field, nothing sent, no callback. */
static void test_refused_calls(void **state)
{
    fake_server *s = fake_start(script_hello_eof, NULL);
    kdac_client *c = open_fake(s);
    kdac_error err;
    uint8_t buf[TOKB(2)];
    memset(buf, 0, sizeof(buf));
    kdac_seq q;
    memset(&q, 0, sizeof(q));
    q.slot = 1;
    q.len = 2;
    q.q = q.k = q.v = q.g = q.beta = kdac_tensor_inline(buf);
    calls = 0;
    struct {
        int rc;
        const char *part;
    } cases[24];
    int n = 0;
#define CASE(call, part_)                                  \
    do {                                                   \
        cases[n].rc = (call);                              \
        cases[n].part = part_;                             \
        if (cases[n].rc)                                   \
            assert_contains(err.message, cases[n].part);  \
        n++;                                               \
    } while (0)
    CASE(kdac_prefill_send(c, "L", &q, 0, count_cb, NULL, &err), "0 sequences");
    CASE(kdac_prefill_send(c, "L", &q, 1, NULL, NULL, &err), "callback is NULL");
    CASE(kdac_prefill_send(c, NULL, &q, 1, count_cb, NULL, &err), "layer or seqs");
    q.flags = KDAC_SEQ_FRESH | KDAC_SEQ_EXPECT_POS;
    CASE(kdac_prefill_send(c, "L", &q, 1, count_cb, NULL, &err), "exclude each other");
    q.flags = 0x80;
    CASE(kdac_prefill_send(c, "L", &q, 1, count_cb, NULL, &err), "unknown bits");
    q.flags = 0;
    q.v = kdac_tensor_inline(NULL);
    CASE(kdac_prefill_send(c, "L", &q, 1, count_cb, NULL, &err), "seqs[0].v: neither");
    q.v = kdac_tensor_region(3, 8);
    CASE(kdac_prefill_send(c, "L", &q, 1, count_cb, NULL, &err), "not a multiple of 16");
    q.v = q.q;
    q.len = 70000;
    CASE(kdac_prefill_send(c, "L", &q, 1, count_cb, NULL, &err), "max_batch_tokens");
    uint64_t sl[2] = {1, 2};
    uint8_t lens[2] = {1, 0};
    kdac_step_request sr = {.nseqs = 2, .slots = sl, .lens = lens, .q = q.q, .k = q.q, .v = q.q, .g = q.q,
                    .beta = q.q};
    CASE(kdac_step_send(c, "L", &sr, count_cb, NULL, &err), "lens[1]: 0 is outside [1, 16]");
    lens[1] = 17;
    CASE(kdac_step_send(c, "L", &sr, count_cb, NULL, &err), "lens[1]: 17");
    lens[1] = 2;
    sr.states = kdac_output_inline(buf);
    CASE(kdac_step_send(c, "L", &sr, count_cb, NULL, &err), "states: a region only");
    sr.states = kdac_output_region(0, 0);
    sr.nseqs = 0;
    CASE(kdac_step_send(c, "L", &sr, count_cb, NULL, &err), "0 sequences");
    CASE(kdac_slot_alloc_send(c, 0, 0, count_cb, NULL, &err), "count: 0");
    CASE(kdac_slot_alloc_send(c, 1, 0x8, count_cb, NULL, &err), "unknown bits");
    CASE(kdac_slot_free_send(c, NULL, 0, count_cb, NULL, &err), "at least one");
    CASE(kdac_slot_fork_send(c, 5, 5, count_cb, NULL, &err), "equals src");
    CASE(kdac_slot_read_send(c, 5, (kdac_dtype)7, kdac_output_inline(buf), count_cb, NULL, &err),
         "dtype");
    CASE(kdac_slot_read_send(c, 5, KDAC_DTYPE_F32, kdac_output_inline(NULL), count_cb, NULL,
                             &err), "out: neither");
    CASE(kdac_slot_write_send(c, 5, 0, KDAC_DTYPE_F32, kdac_tensor_inline(NULL), count_cb, NULL,
                              &err), "state: neither");
    CASE(kdac_region_register_shm(c, -1, 10, (uint32_t[1]){0}, &err), "not a descriptor");
#undef CASE
    for (int i = 0; i < n; i++) {
        if (cases[i].rc >= 0)
            fail_msg("case %d (%s) was accepted", i, cases[i].part);
    }
    kdac_io_status st;
    kdac_client_io_status(c, &st);
    assert_int_equal(st.inflight, 0);
    kdac_client_close(c);
    assert_int_equal(calls, 0);
    assert_int_equal(fake_stop(s), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_slot_calls),       cmocka_unit_test(test_prefill_call),
        cmocka_unit_test(test_step_call),
        cmocka_unit_test(test_registry_calls),   cmocka_unit_test(test_region_calls),
        cmocka_unit_test(test_cuda_region_without_gpu), cmocka_unit_test(test_malformed_result),
        cmocka_unit_test(test_refused_calls),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
