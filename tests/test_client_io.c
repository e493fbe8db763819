/*
 * test_client_io.c - libkdaclient's transport (io.c): frames cut at any
 * byte in both directions, requests that wait for room in the socket
 * (KDAC_WRITABLE), pipelined requests answered out of order and matched by
 * id, and every way a connection can fail under requests in flight: the
 * daemon vanishing, a goodbye, oversized frames either way, an answer to an
 * unknown id, close with requests pending, and calls a callback may not make;
 * blocking calls that spin before they sleep (kdac_client_set_spin).
 * The daemon is the in-process fake (fake_kdad.h); its H is FAKE_HEADS.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "fake_kdad.h"
#include "kdaclient.h"

#define H FAKE_HEADS
#define TOK(len) ((size_t)(len) * H * 128 * 2)
#define BETA(len) ((size_t)(len) * H * 2)

static void assert_contains(const char *text, const char *part)
{
    if (!strstr(text, part))
        fail_msg("\"%s\" lacks \"%s\"", text, part);
}

static uint8_t *pattern(size_t n, unsigned seed)
{
    uint8_t *p = malloc(n);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(i * 31 + seed * 7 + (i >> 9));
    return p;
}

static bool is_pattern(const void *data, size_t n, unsigned seed)
{
    const uint8_t *p = data;
    for (size_t i = 0; i < n; i++) {
        if (p[i] != (uint8_t)(i * 31 + seed * 7 + (i >> 9)))
            return false;
    }
    return true;
}

/* A client connected to the fake (10 s timeout). */
static kdac_client *connect_to(const fake_server *s)
{
    kdac_client *c;
    kdac_error err;
    assert_int_equal(fake_client_open(s, 10000, &c, &err), KDAC_OK);
    return c;
}

/* Closes the client; the fake's script must have ended clean. */
static void close_and_stop(kdac_client *c, fake_server *s)
{
    kdac_client_close(c);
    assert_int_equal(fake_stop(s), 0);
}

/* The client's health call fails with status, its message naming part; then
 * the fake stops clean. */
static void expect_health_error(fake_server *s, int status, const char *part)
{
    kdac_client *c = connect_to(s);
    kdac_error err;
    kdac_health_info h;
    assert_int_equal(kdac_health(c, &h, &err), status);
    assert_contains(err.message, part);
    close_and_stop(c, s);
}

/* A callback's record of what it saw. */
typedef struct seen {
    int calls;
    int status;
    uint64_t pos;
    int order;
    kdac_error error;
} seen;

typedef struct log_ctx {
    int done;
    seen s[300];
} log_ctx;

typedef struct call_ref {
    log_ctx *log;
    int index;
} call_ref;

static void record_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    call_ref *r = data;
    seen *s = &r->log->s[r->index];
    s->calls++;
    s->status = status;
    s->error = res->error;
    s->order = r->log->done++;
    if (status == KDAC_OK && strcmp(res->method, "prefill") == 0)
        s->pos = res->u.prefill.pos[0];
}

/* One sequence of len tokens, every input from the same bytes. */
static kdac_seq seq_of(uint64_t slot, uint32_t len, const void *in, void *out)
{
    kdac_seq s;
    memset(&s, 0, sizeof(s));
    s.slot = slot;
    s.len = len;
    s.q = s.k = s.v = s.g = s.beta = kdac_tensor_inline(in);
    s.out = kdac_output_inline(out);
    return s;
}

/* The fake answers a one-sequence prefill with pos and out = pattern(seed). */
static void answer_prefill(fake_conn *fc, uint32_t id, uint32_t len, uint64_t pos, unsigned seed)
{
    uint8_t *out = pattern(TOK(len), seed);
    kp_prefill_seq_result sr = {pos, kp_ref_inline(out, TOK(len))};
    kp_prefill_result r = {.seqs = &sr, .nseqs = 1, .queue_us = 5, .run_us = 7};
    kp_error e;
    if (fake_check(fc, kp_prefill_result_encode(&fc->w, id, &r, &e) == KP_OK, "%s", e.message))
        fake_send(fc);
    free(out);
}

/* ---------------------------------------------------------------------- */
/* Framing                                                                */
/* ---------------------------------------------------------------------- */

#define BIG_LEN 1000 /* 4 MB of inline tensors: more than the socket buffers hold */

static void script_slow_reader(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    usleep(200 * 1000); /* let the client find the socket full */
    fc->read_chunk = 4093;
    uint32_t id = fake_expect(fc, KP_METHOD_PREFILL);
    kp_prefill_params p;
    kp_error e;
    if (!id || !fake_check(fc, kp_prefill_params_decode(&fc->msg, &fc->session, &p, &e) == KP_OK,
                           "prefill: %s", e.message))
        return;
    const kp_prefill_seq *q = &p.seqs[0];
    fake_check(fc, p.nseqs == 1 && q->len == BIG_LEN && q->slot == 77, "seqs");
    for (int t = KP_TENSOR_Q; t <= KP_TENSOR_BETA; t++)
        fake_check(fc, q->tensors[t].kind == KP_REF_INLINE &&
                           is_pattern(q->tensors[t].data, q->tensors[t].nbytes, 1),
                   "tensor %d arrived damaged", t);
    fc->write_chunk = 777; /* the response in odd pieces */
    answer_prefill(fc, id, BIG_LEN, BIG_LEN, 9);
    fake_wait_eof(fc);
}

/* A request far larger than the socket buffers leaves in pieces while the
 * loop polls for KDAC_WRITABLE; the response arrives in 777-byte pieces; the
 * bytes are intact both ways. */
static void test_partial_frames(void **state)
{
    fake_server *s = fake_start(script_slow_reader, NULL);
    kdac_client *c = connect_to(s);
    kdac_error err;
    uint8_t *in = pattern(TOK(BIG_LEN), 1);
    uint8_t *out = calloc(1, TOK(BIG_LEN));
    kdac_seq q = seq_of(77, BIG_LEN, in, out);
    log_ctx log = {0};
    call_ref ref = {&log, 0};
    assert_int_equal(kdac_prefill_send(c, "L", &q, 1, record_cb, &ref, &err), KDAC_OK);
    kdac_io_status st;
    kdac_client_io_status(c, &st);
    assert_int_equal(st.inflight, 1);
    assert_true(st.send_queued > 0);
    assert_int_equal(kdac_client_events(c), KDAC_READABLE | KDAC_WRITABLE);
    assert_true(fake_client_run(c, &log.done, 1));
    assert_int_equal(log.s[0].status, KDAC_OK);
    assert_int_equal(log.s[0].pos, BIG_LEN);
    assert_true(is_pattern(out, TOK(BIG_LEN), 9));
    kdac_client_io_status(c, &st);
    assert_int_equal(st.inflight, 0);
    assert_int_equal(st.send_queued, 0);
    assert_true(st.sent_bytes > 4 * TOK(BIG_LEN));
    assert_true(st.recv_bytes > TOK(BIG_LEN));
    assert_int_equal(kdac_client_events(c), KDAC_READABLE);
    close_and_stop(c, s);
    free(in);
    free(out);
}

/* ---------------------------------------------------------------------- */
/* Pipelining                                                             */
/* ---------------------------------------------------------------------- */

#define NPIPE 8

static void script_reverse(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    uint32_t ids[NPIPE];
    uint64_t slots[NPIPE];
    for (int i = 0; i < NPIPE; i++) {
        ids[i] = fake_expect(fc, KP_METHOD_PREFILL);
        kp_prefill_params p;
        kp_error e;
        if (!ids[i] || !fake_check(fc, kp_prefill_params_decode(&fc->msg, &fc->session, &p, &e) ==
                                           KP_OK, "prefill: %s", e.message))
            return;
        slots[i] = p.seqs[0].slot;
        for (int j = 0; j < i; j++)
            fake_check(fc, ids[j] != ids[i], "id %u reused while in flight", ids[i]);
    }
    /* Answers in reverse; the one for slot 3 is an error. */
    for (int i = NPIPE - 1; i >= 0; i--) {
        if (slots[i] == 3)
            fake_send_error(fc, ids[i], KP_E_STALE_SLOT, "seqs[0].slot: slot 0x3 is stale");
        else
            answer_prefill(fc, ids[i], 2, 1000 + slots[i], (unsigned)slots[i]);
    }
    fake_wait_eof(fc);
}

static void test_pipelined_out_of_order(void **state)
{
    fake_server *s = fake_start(script_reverse, NULL);
    kdac_client *c = connect_to(s);
    kdac_error err;
    uint8_t *in = pattern(TOK(2), 0);
    uint8_t *outs[NPIPE];
    log_ctx log = {0};
    call_ref refs[NPIPE];
    for (int i = 0; i < NPIPE; i++) {
        outs[i] = calloc(1, TOK(2));
        refs[i] = (call_ref){&log, i};
        kdac_seq q = seq_of((uint64_t)i, 2, in, outs[i]);
        assert_int_equal(kdac_prefill_send(c, "L", &q, 1, record_cb, &refs[i], &err), KDAC_OK);
    }
    kdac_io_status st;
    kdac_client_io_status(c, &st);
    assert_int_equal(st.inflight, NPIPE);
    assert_true(fake_client_run(c, &log.done, NPIPE));
    for (int i = 0; i < NPIPE; i++) {
        assert_int_equal(log.s[i].calls, 1);
        assert_int_equal(log.s[i].order, NPIPE - 1 - i);
        if (i == 3) {
            assert_int_equal(log.s[i].status, KDAC_E_STALE_SLOT);
            assert_contains(log.s[i].error.message, "slot 0x3 is stale");
            assert_false(log.s[i].error.retryable);
            continue;
        }
        assert_int_equal(log.s[i].status, KDAC_OK);
        assert_int_equal(log.s[i].pos, 1000 + i);
        assert_true(is_pattern(outs[i], TOK(2), (unsigned)i));
    }
    close_and_stop(c, s);
    for (int i = 0; i < NPIPE; i++)
        free(outs[i]);
    free(in);
}

/* ---------------------------------------------------------------------- */
/* Failures with requests in flight                                       */
/* ---------------------------------------------------------------------- */

/* Reads n requests, then closes the connection without answering. */
static void script_vanish(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    for (int i = 0; i < *(int *)arg; i++)
        fake_read(fc);
}

static void test_daemon_gone_blocking(void **state)
{
    int n = 1;
    fake_server *s = fake_start(script_vanish, &n);
    kdac_client *c = connect_to(s);
    kdac_error err;
    kdac_health_info h;
    assert_int_equal(kdac_health(c, &h, &err), KDAC_E_DISCONNECTED);
    assert_contains(err.message, "closed the connection with requests in flight");
    assert_true(err.retryable);
    assert_int_equal(kdac_client_events(c), 0);
    /* Every later call fails at once with the same reason. */
    assert_int_equal(kdac_health(c, &h, &err), KDAC_E_DISCONNECTED);
    uint64_t slot;
    assert_int_equal(kdac_slot_alloc(c, 1, 0, &slot, &err), KDAC_E_DISCONNECTED);
    assert_int_equal(kdac_client_progress(c), KDAC_E_DISCONNECTED);
    close_and_stop(c, s);
}

static void test_daemon_gone_async(void **state)
{
    int n = 3;
    fake_server *s = fake_start(script_vanish, &n);
    kdac_client *c = connect_to(s);
    kdac_error err;
    log_ctx log = {0};
    call_ref refs[3];
    for (int i = 0; i < 3; i++) {
        refs[i] = (call_ref){&log, i};
        assert_int_equal(kdac_health_send(c, record_cb, &refs[i], &err), KDAC_OK);
    }
    assert_true(fake_client_run(c, &log.done, 3));
    for (int i = 0; i < 3; i++) {
        assert_int_equal(log.s[i].calls, 1);
        assert_int_equal(log.s[i].status, KDAC_E_DISCONNECTED);
    }
    assert_int_equal(kdac_client_progress(c), KDAC_E_DISCONNECTED);
    /* A send on the dead connection is refused, and its callback never runs. */
    call_ref late = {&log, 3};
    assert_int_equal(kdac_health_send(c, record_cb, &late, &err), KDAC_E_DISCONNECTED);
    kdac_client_close(c);
    assert_int_equal(log.s[3].calls, 0);
    assert_int_equal(fake_stop(s), 0);
}

static void script_goodbye(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    uint32_t first = fake_expect(fc, KP_METHOD_HEALTH);
    fake_expect(fc, KP_METHOD_HEALTH);
    kp_health_result h = {KP_HEALTH_DRAINING, 10, 0, 0};
    kp_error e;
    if (fake_check(fc, kp_health_result_encode(&fc->w, first, &h, &e) == KP_OK, "%s", e.message))
        fake_send(fc);
    fake_send_goodbye(fc, KP_E_SHUTTING_DOWN, "draining finished; kdad exits");
}

/* A goodbye fails the requests it did not answer with its own error. */
static void test_goodbye(void **state)
{
    fake_server *s = fake_start(script_goodbye, NULL);
    kdac_client *c = connect_to(s);
    kdac_error err;
    log_ctx log = {0};
    call_ref refs[2] = {{&log, 0}, {&log, 1}};
    assert_int_equal(kdac_health_send(c, record_cb, &refs[0], &err), KDAC_OK);
    assert_int_equal(kdac_health_send(c, record_cb, &refs[1], &err), KDAC_OK);
    assert_true(fake_client_run(c, &log.done, 2));
    assert_int_equal(log.s[0].status, KDAC_OK);
    assert_int_equal(log.s[1].status, KDAC_E_SHUTTING_DOWN);
    assert_true(log.s[1].error.retryable);
    assert_contains(log.s[1].error.message, "draining finished");
    assert_int_equal(kdac_client_progress(c), KDAC_E_SHUTTING_DOWN);
    close_and_stop(c, s);
}

static void small_frames(kp_hello_result *h)
{
    h->limits.max_frame_bytes = 65536;
    h->limits.max_inline_bytes = 65536;
}

static void script_oversized(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    fake_expect(fc, KP_METHOD_HEALTH);
    static const uint8_t header[] = {0x00, 0x01, 0x00, 0x01}; /* 65537 bytes: one too many */
    fake_send_raw(fc, header, sizeof(header));
    fake_wait_eof(fc);
}

/* A frame over the announced cap is refused on its header. */
static void test_oversized_from_daemon(void **state)
{
    fake_server *s = fake_start_with(script_oversized, NULL, small_frames);
    expect_health_error(s, KDAC_E_FRAME_TOO_LARGE, "65537");
}

static void script_hello_eof(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    fake_wait_eof(fc);
}

/* A request whose frame would exceed the daemon's cap is refused before it
 * is sent, and its callback never runs. */
static void test_oversized_from_client(void **state)
{
    fake_server *s = fake_start_with(script_hello_eof, NULL, small_frames);
    kdac_client *c = connect_to(s);
    kdac_error err;
    /* 15 tokens inline (61560 bytes, under max_inline_bytes) plus 255 empty
     * sequences: the frame passes 65536 bytes. */
    uint8_t *in = pattern(TOK(15), 0);
    kdac_seq seqs[256];
    seqs[0] = seq_of(1000, 15, in, NULL);
    for (int i = 1; i < 256; i++)
        seqs[i] = seq_of((uint64_t)(0x100000000ull + i), 0, NULL, NULL);
    log_ctx log = {0};
    call_ref ref = {&log, 0};
    assert_int_equal(kdac_prefill_send(c, "L", seqs, 256, record_cb, &ref, &err),
                     KDAC_E_FRAME_TOO_LARGE);
    assert_contains(err.message, "exceeds the peer's cap of 65536");
    /* Inline bytes over max_inline_bytes: refused before encoding. */
    uint8_t *big = pattern(TOK(16), 0);
    seqs[0] = seq_of(1000, 16, big, NULL);
    assert_int_equal(kdac_prefill_send(c, "L", seqs, 1, record_cb, &ref, &err),
                     KDAC_E_LIMIT_EXCEEDED);
    assert_contains(err.message, "max_inline_bytes 65536");
    /* Nothing was queued; the connection is still fine. */
    kdac_io_status st;
    kdac_client_io_status(c, &st);
    assert_int_equal(st.inflight, 0);
    assert_int_equal(kdac_client_events(c), KDAC_READABLE);
    kdac_client_close(c);
    assert_int_equal(log.s[0].calls, 0);
    assert_int_equal(fake_stop(s), 0);
    free(in);
    free(big);
}

static void script_wrong_id(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    uint32_t id = fake_expect(fc, KP_METHOD_HEALTH);
    kp_health_result h = {KP_HEALTH_OK, 1, 0, 0};
    kp_error e;
    if (fake_check(fc, kp_health_result_encode(&fc->w, id + 1000, &h, &e) == KP_OK, "%s",
                   e.message))
        fake_send(fc);
    fake_wait_eof(fc);
}

static void test_answer_to_unknown_id(void **state)
{
    fake_server *s = fake_start(script_wrong_id, NULL);
    expect_health_error(s, KDAC_E_PROTOCOL, "not in flight");
}

static void script_read3_eof(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    for (int i = 0; i < 3; i++)
        fake_expect(fc, KP_METHOD_SLOT_INFO);
    fake_wait_eof(fc);
}

/* Closing with requests in flight completes each once, with CANCELED. */
static void test_close_cancels(void **state)
{
    fake_server *s = fake_start(script_read3_eof, NULL);
    kdac_client *c = connect_to(s);
    kdac_error err;
    log_ctx log = {0};
    call_ref refs[3];
    for (int i = 0; i < 3; i++) {
        refs[i] = (call_ref){&log, i};
        assert_int_equal(kdac_slot_info_send(c, NULL, 0, record_cb, &refs[i], &err), KDAC_OK);
    }
    assert_int_equal(kdac_client_close(c), KDAC_OK);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(log.s[i].calls, 1);
        assert_int_equal(log.s[i].status, KDAC_E_CANCELED);
    }
    assert_int_equal(fake_stop(s), 0);
}

/* ---------------------------------------------------------------------- */
/* What a callback may do                                                 */
/* ---------------------------------------------------------------------- */

typedef struct reentry {
    int calls;
    int blocking_rc, close_rc, progress_rc, send_rc;
} reentry;

static void count_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    (*(int *)data)++;
}

static int second_done;

static void reenter_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    reentry *r = data;
    r->calls++;
    kdac_health_info h;
    r->blocking_rc = kdac_health(c, &h, NULL);
    r->close_rc = kdac_client_close(c);
    r->progress_rc = kdac_client_progress(c);
    r->send_rc = kdac_health_send(c, count_cb, &second_done, NULL);
}

/* Answers two health requests, each after *(int *)arg milliseconds (arg NULL: at once). */
static void script_two_health(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    for (int i = 0; i < 2; i++) {
        uint32_t id = fake_expect(fc, KP_METHOD_HEALTH);
        if (arg)
            usleep((useconds_t)(*(int *)arg * 1000));
        kp_health_result h = {KP_HEALTH_OK, 1, 0, 0};
        kp_error e;
        if (fake_check(fc, kp_health_result_encode(&fc->w, id, &h, &e) == KP_OK, "%s",
                       e.message))
            fake_send(fc);
    }
    fake_wait_eof(fc);
}

static void test_callback_reentry(void **state)
{
    fake_server *s = fake_start(script_two_health, NULL);
    kdac_client *c = connect_to(s);
    kdac_error err;
    reentry r = {0};
    second_done = 0;
    assert_int_equal(kdac_health_send(c, reenter_cb, &r, &err), KDAC_OK);
    assert_true(fake_client_run(c, &r.calls, 1));
    assert_int_equal(r.blocking_rc, KDAC_E_INVALID_ARGUMENT);
    assert_int_equal(r.close_rc, KDAC_E_INVALID_ARGUMENT);
    assert_int_equal(r.progress_rc, KDAC_E_INVALID_ARGUMENT);
    assert_int_equal(r.send_rc, KDAC_OK);
    assert_true(fake_client_run(c, &second_done, 1));
    assert_int_equal(kdac_client_close(c), KDAC_OK);
    assert_int_equal(fake_stop(s), 0);
}

/* ---------------------------------------------------------------------- */
/* Spinning before sleeping                                                */
/* ---------------------------------------------------------------------- */

static double mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Answers that come while the call spins, and after it gave up spinning, both complete. */
static void test_spin_then_sleep(void **state)
{
    int delay_ms = 20;
    fake_server *s = fake_start(script_two_health, &delay_ms);
    kdac_client *c = connect_to(s);
    kdac_error err;
    kdac_health_info h;
    assert_int_equal(kdac_client_set_spin(c, 200000, &err), KDAC_OK); /* answer within the spin */
    assert_int_equal(kdac_health(c, &h, &err), KDAC_OK);
    assert_int_equal(kdac_client_set_spin(c, 1000, &err), KDAC_OK); /* answer after it */
    assert_int_equal(kdac_health(c, &h, &err), KDAC_OK);
    close_and_stop(c, s);
}

/* Reads n requests and answers none, until the client hangs up. */
static void script_vanish_late(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    for (int i = 0; i < *(int *)arg; i++)
        fake_read(fc);
    fake_wait_eof(fc);
}

/* The call's timeout bounds the spin, and bad values are refused. */
static void test_spin_bounded_by_timeout(void **state)
{
    int n = 1;
    fake_server *s = fake_start(script_vanish_late, &n);
    kdac_client *c;
    kdac_error err;
    assert_int_equal(fake_client_open(s, 100, &c, &err), KDAC_OK);
    assert_int_equal(kdac_client_set_spin(c, -1, &err), KDAC_E_INVALID_ARGUMENT);
    assert_contains(err.message, "spin_us");
    assert_int_equal(kdac_client_set_spin(c, 1000001, &err), KDAC_E_INVALID_ARGUMENT);
    assert_int_equal(kdac_client_set_spin(c, 1000000, &err), KDAC_OK);
    kdac_health_info h;
    const double t0 = mono_ms();
    assert_int_equal(kdac_health(c, &h, &err), KDAC_E_TIMEOUT);
    const double took = mono_ms() - t0;
    if (took < 90 || took > 700)
        fail_msg("a 100 ms timeout with a 1 s spin took %.0f ms", took);
    close_and_stop(c, s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_partial_frames),
        cmocka_unit_test(test_pipelined_out_of_order),
        cmocka_unit_test(test_daemon_gone_blocking),
        cmocka_unit_test(test_daemon_gone_async),
        cmocka_unit_test(test_goodbye),
        cmocka_unit_test(test_oversized_from_daemon),
        cmocka_unit_test(test_oversized_from_client),
        cmocka_unit_test(test_answer_to_unknown_id),
        cmocka_unit_test(test_close_cancels),
        cmocka_unit_test(test_callback_reentry),
        cmocka_unit_test(test_spin_then_sleep),
        cmocka_unit_test(test_spin_bounded_by_timeout),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
