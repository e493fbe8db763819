/*
 * test_conn.c - daemon/conn.c, the transport, alone: a bare event loop, a
 * kd_transport with handlers that record what they are told, one end of a
 * socketpair adopted as a connection and raw bytes on the other.  No
 * daemon, no backend: framing, descriptors, backpressure, output limits and
 * the close sequence as the transport sees them.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "conn.h"

#define MAX_FRAMES 64

typedef struct fixture {
    uv_loop_t loop;
    kd_transport t;
    kd_conn *c;
    int peer;                       /* the client's end */
    uint8_t *frames[MAX_FRAMES];    /* bodies delivered, in order */
    size_t lens[MAX_FRAMES];
    int nframes;
    int errors, last_error;
    int closes;
    kd_disconnect reason;
    int frees;
    bool pause_each;                /* on_frame pauses the connection */
    int64_t partial;                /* the sum of on_partial's deltas */
    int64_t partial_at_frame;       /* ... when the last frame was delivered */
    int64_t output, output_peak;    /* the sum of on_output's deltas, and its peak */
} fixture;

static void on_frame(kd_conn *c, uint8_t *body, size_t len, uint64_t arrival_ns)
{
    fixture *f = c->data;
    (void)arrival_ns;
    assert_true(f->nframes < MAX_FRAMES);
    f->frames[f->nframes] = body;
    f->lens[f->nframes++] = len;
    f->partial_at_frame = f->partial;
    if (f->pause_each)
        kd_conn_pause(c);
}

static void on_error(kd_conn *c, const kp_error *e)
{
    fixture *f = c->data;
    f->errors++;
    f->last_error = e->code;
}

static void on_close(kd_conn *c, kd_disconnect reason)
{
    fixture *f = c->data;
    f->closes++;
    f->reason = reason;
}

static void on_free(kd_conn *c)
{
    fixture *f = c->data;
    f->frees++;
    f->c = NULL;
}

static void on_partial(kd_conn *c, int64_t delta)
{
    fixture *f = c->data;
    f->partial += delta;
    assert_true(f->partial >= 0);
    assert_int_equal(f->partial, (int64_t)c->partial);
}

static void on_output(kd_conn *c, int64_t delta)
{
    fixture *f = c->data;
    f->output += delta;
    assert_true(f->output >= 0);
    if (f->output > f->output_peak)
        f->output_peak = f->output;
}

static const kd_conn_handlers handlers = {on_frame, on_error, on_close, on_free, on_partial,
                                          on_output};

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof(*f));
    assert_int_equal(uv_loop_init(&f->loop), 0);
    kd_transport_limits lim = {
        .output_hard = 1 << 20, .output_soft = 1 << 19, .output_soft_ns = 1000000000ull,
        .close_flush_ns = 1000000000ull, .read_budget = 1 << 20, .write_budget = 1 << 20,
        .read_buffer = 4096, .spin_us = 0, .frame_stall_ns = 60000000000ull,
        .output_stall_ns = 60000000000ull,
    };
    kd_transport_init(&f->t, &f->loop, &handlers, &lim);
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    assert_int_equal(fcntl(sv[0], F_SETFL, O_NONBLOCK), 0);
    assert_int_equal(fcntl(sv[1], F_SETFL, O_NONBLOCK), 0);
    f->c = kd_conn_new(&f->t, sv[0], 1, f);
    assert_non_null(f->c);
    f->peer = sv[1];
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    if (f->c)
        kd_conn_close(f->c, KD_DISC_SHUTDOWN, NULL);
    if (f->peer >= 0)
        close(f->peer);
    for (int i = 0; i < 100 && f->frees == 0; i++)
        uv_run(&f->loop, UV_RUN_NOWAIT);
    assert_int_equal(f->frees, 1);
    assert_int_equal(f->partial, 0); /* everything reported was given back */
    assert_int_equal(f->output, 0);
    kd_transport_close(&f->t);
    uv_run(&f->loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&f->loop), 0);
    for (int i = 0; i < f->nframes; i++)
        free(f->frames[i]);
    free(f);
    return 0;
}

static void turn(fixture *f, int n)
{
    for (int i = 0; i < n; i++)
        uv_run(&f->loop, UV_RUN_NOWAIT);
}

/* A frame: 4-byte big-endian length, then the body. */
static size_t frame(uint8_t *out, const char *body)
{
    size_t n = strlen(body);
    out[0] = (uint8_t)(n >> 24);
    out[1] = (uint8_t)(n >> 16);
    out[2] = (uint8_t)(n >> 8);
    out[3] = (uint8_t)n;
    memcpy(out + 4, body, n);
    return 4 + n;
}

static void put(fixture *f, const void *bytes, size_t n)
{
    assert_int_equal(write(f->peer, bytes, n), (ssize_t)n);
}

static void expect_frame(fixture *f, int i, const char *body)
{
    assert_true(i < f->nframes);
    assert_int_equal(f->lens[i], strlen(body));
    assert_memory_equal(f->frames[i], body, strlen(body));
}

/* ---------------------------------------------------------------------- */

/* Frames cut anywhere and frames glued together both arrive whole, in order. */
static void test_frames_split_and_glued(void **state)
{
    fixture *f = *state;
    uint8_t buf[256];
    size_t n = frame(buf, "byte by byte");
    for (size_t i = 0; i < n; i++) {
        put(f, buf + i, 1);
        turn(f, 2);
    }
    assert_int_equal(f->nframes, 1);
    expect_frame(f, 0, "byte by byte");

    size_t at = frame(buf, "one");
    at += frame(buf + at, "two");
    at += frame(buf + at, "three");
    put(f, buf, at);
    turn(f, 3);
    assert_int_equal(f->nframes, 4);
    expect_frame(f, 1, "one");
    expect_frame(f, 2, "two");
    expect_frame(f, 3, "three");
    assert_int_equal(f->errors, 0);
}

/* A body larger than the read buffer is read straight into the frame. */
static void test_large_body(void **state)
{
    fixture *f = *state;
    kd_conn_set_max_frame(f->c, 1 << 20);
    size_t n = 100000;
    uint8_t *buf = malloc(4 + n);
    buf[0] = 0;
    buf[1] = (uint8_t)(n >> 16);
    buf[2] = (uint8_t)(n >> 8);
    buf[3] = (uint8_t)n;
    for (size_t i = 0; i < n; i++)
        buf[4 + i] = (uint8_t)(i * 7);
    size_t off = 0;
    while (off < 4 + n) {
        ssize_t w = write(f->peer, buf + off, 4 + n - off);
        if (w > 0)
            off += (size_t)w;
        turn(f, 1);
    }
    turn(f, 3);
    assert_int_equal(f->nframes, 1);
    assert_int_equal(f->lens[0], n);
    assert_memory_equal(f->frames[0], buf + 4, n);
    free(buf);
}

/* A length beyond the cap: on_error, a FRAME_TOO_LARGE goodbye, the close. */
static void test_frame_too_large(void **state)
{
    fixture *f = *state;
    static const uint8_t header[] = {0x7f, 0, 0, 0};
    put(f, header, sizeof(header));
    turn(f, 3);
    assert_int_equal(f->errors, 1);
    assert_int_equal(f->last_error, KP_E_FRAME_TOO_LARGE);
    assert_int_equal(f->closes, 1);
    assert_int_equal(f->reason, KD_DISC_FRAME_TOO_LARGE);
    uint8_t got[512];
    ssize_t n = read(f->peer, got, sizeof(got));
    assert_true(n > 4); /* the goodbye */
    turn(f, 3);
    assert_int_equal(f->frees, 1);
    assert_null(f->c);
}

/* Paused, nothing is delivered; resumed, what was buffered comes in order. */
static void test_pause_resume(void **state)
{
    fixture *f = *state;
    f->pause_each = true;
    uint8_t buf[256];
    size_t at = frame(buf, "a");
    at += frame(buf + at, "b");
    at += frame(buf + at, "c");
    put(f, buf, at);
    turn(f, 5);
    assert_int_equal(f->nframes, 1);
    for (int k = 2; k <= 3; k++) {
        kd_conn_resume(f->c);
        turn(f, 3);
        assert_int_equal(f->nframes, k);
    }
    expect_frame(f, 0, "a");
    expect_frame(f, 1, "b");
    expect_frame(f, 2, "c");
}

/* Descriptors queue in arrival order and are taken one by one. */
static void test_descriptor_fifo(void **state)
{
    fixture *f = *state;
    int fds[2] = {memfd_create("a", MFD_CLOEXEC), memfd_create("b", MFD_CLOEXEC)};
    uint8_t buf[64];
    size_t len = frame(buf, "x");
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(2 * sizeof(int))];
    } control;
    memset(&control, 0, sizeof(control));
    struct iovec v = {buf, len};
    struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = control.buf,
                       .msg_controllen = sizeof(control.buf)};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(2 * sizeof(int));
    memcpy(CMSG_DATA(cm), fds, sizeof(fds));
    assert_int_equal(sendmsg(f->peer, &m, 0), (ssize_t)len);
    turn(f, 3);
    assert_int_equal(f->nframes, 1);
    assert_int_equal(f->c->nfds, 2);
    struct stat a, b, a2, b2;
    fstat(fds[0], &a);
    fstat(fds[1], &b);
    int x = kd_conn_take_fd(f->c), y = kd_conn_take_fd(f->c);
    assert_true(x >= 0 && y >= 0);
    fstat(x, &a2);
    fstat(y, &b2);
    assert_int_equal(a.st_ino, a2.st_ino);
    assert_int_equal(b.st_ino, b2.st_ino);
    assert_int_equal(kd_conn_take_fd(f->c), -1);
    close(x);
    close(y);
    close(fds[0]);
    close(fds[1]);
}

/* More descriptors than KP_MAX_PENDING_FDS unclaimed: a PROTOCOL close, and
 * every descriptor is closed. */
static void test_too_many_descriptors(void **state)
{
    fixture *f = *state;
    for (int k = 0; k < KP_MAX_PENDING_FDS + 1 && f->closes == 0; k++) {
        int fd = memfd_create("d", MFD_CLOEXEC);
        char byte = 0;
        union {
            struct cmsghdr align;
            char buf[CMSG_SPACE(sizeof(int))];
        } control;
        memset(&control, 0, sizeof(control));
        struct iovec v = {&byte, 1};
        struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = control.buf,
                           .msg_controllen = sizeof(control.buf)};
        struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
        assert_int_equal(sendmsg(f->peer, &m, 0), 1);
        close(fd);
        turn(f, 2);
    }
    assert_int_equal(f->closes, 1);
    assert_int_equal(f->reason, KD_DISC_PROTOCOL);
    assert_int_equal(f->last_error, KP_E_PROTOCOL);
}

/* Output the peer does not read: beyond output_hard, a BUSY goodbye after
 * what was already started, and the close. */
static void test_output_hard_limit(void **state)
{
    fixture *f = *state;
    int small = 4096;
    assert_int_equal(setsockopt(f->c->fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)), 0);
    f->t.lim.output_hard = 65536;
    kd_conn_set_max_frame(f->c, 1 << 20);
    /* Small frames (goodbyes will do), queued until the limit cuts in. */
    for (int i = 0; i < 100000 && f->closes == 0; i++) {
        kd_out *o = kd_out_new(f->c);
        kp_error e;
        assert_int_equal(kp_goodbye_encode(&o->w, &(kp_error){KP_E_INTERNAL, false, "filler"},
                                           &e), KP_OK);
        kd_conn_send(f->c, o);
    }
    assert_int_equal(f->closes, 1);
    assert_int_equal(f->reason, KD_DISC_OUTPUT_LIMIT);
    /* Drain: frames, then the BUSY goodbye, then EOF. */
    kp_reader r;
    kp_reader_init(&r, 1 << 20);
    kp_msg msg;
    kp_msg_init(&msg);
    bool busy = false, eof = false;
    for (int i = 0; i < 100000 && !eof; i++) {
        uint8_t *dst;
        size_t space = kp_reader_space(&r, &dst);
        ssize_t n = read(f->peer, dst, space);
        if (n == 0) {
            eof = true;
            break;
        }
        if (n < 0) {
            turn(f, 1);
            continue;
        }
        kp_error e;
        if (kp_reader_commit(&r, (size_t)n, &e) != KP_READ_FRAME)
            continue;
        size_t len;
        uint8_t *body = kp_reader_take(&r, &len);
        kp_error remote;
        assert_int_equal(kp_msg_decode(&msg, body, len, 1 << 20, &e), KP_OK);
        assert_int_equal(kp_goodbye_decode(&msg, &remote, &e), KP_OK);
        if (remote.code == KP_E_BUSY) {
            busy = true;
            assert_non_null(strstr(remote.message, "output limit of 65536 bytes"));
        }
        kp_msg_close(&msg);
        free(body);
    }
    kp_reader_close(&r);
    assert_true(busy);
    assert_true(eof);
}

/* The peer goes away: on_close (peer_closed), then on_free once the socket closed. */
static void test_peer_closes(void **state)
{
    fixture *f = *state;
    close(f->peer);
    f->peer = -1;
    turn(f, 3);
    assert_int_equal(f->closes, 1);
    assert_int_equal(f->reason, KD_DISC_PEER_CLOSED);
    assert_int_equal(f->frees, 1);
    assert_int_equal(f->t.nconns, 0);
    assert_int_equal(f->t.nopen, 0);
}

/* The bytes held for a frame still arriving are reported as they grow, and
 * given back before the frame is delivered. */
static void test_partial_accounting(void **state)
{
    fixture *f = *state;
    kd_conn_set_max_frame(f->c, 1 << 20);
    size_t n = 200000;
    uint8_t *buf = calloc(1, 4 + n);
    buf[1] = (uint8_t)(n >> 16);
    buf[2] = (uint8_t)(n >> 8);
    buf[3] = (uint8_t)n;
    size_t off = 0;
    while (off < 4 + n / 2) { /* the first half */
        ssize_t w = write(f->peer, buf + off, 4 + n / 2 - off);
        if (w > 0)
            off += (size_t)w;
        turn(f, 1);
    }
    turn(f, 3);
    assert_int_equal(f->nframes, 0);
    assert_true(f->partial >= (int64_t)(n / 2) && f->partial <= (int64_t)n);
    while (off < 4 + n) {
        ssize_t w = write(f->peer, buf + off, 4 + n - off);
        if (w > 0)
            off += (size_t)w;
        turn(f, 1);
    }
    turn(f, 3);
    assert_int_equal(f->nframes, 1);
    assert_int_equal(f->partial_at_frame, 0);
    assert_int_equal(f->partial, 0);
    free(buf);
}

/* A frame begun and left: closed after frame_stall_ns (reason stalled), its
 * bytes given back. */
static void test_frame_stall(void **state)
{
    fixture *f = *state;
    f->t.lim.frame_stall_ns = 50000000; /* 50 ms */
    static const uint8_t part[] = {0, 0, 0, 100, 0x94, 0};
    put(f, part, sizeof(part));
    turn(f, 3);
    assert_true(f->partial > 0);
    kd_transport_housekeeping(&f->t, uv_hrtime());
    assert_int_equal(f->closes, 0); /* not yet */
    usleep(80000);
    kd_transport_housekeeping(&f->t, uv_hrtime());
    assert_int_equal(f->closes, 1);
    assert_int_equal(f->reason, KD_DISC_STALLED);
    assert_int_equal(f->partial, 0);
}

/* Output nobody takes: closed after output_stall_ns; idle connections are not. */
static void test_output_stall(void **state)
{
    fixture *f = *state;
    f->t.lim.output_stall_ns = 50000000;
    usleep(80000);
    kd_transport_housekeeping(&f->t, uv_hrtime());
    assert_int_equal(f->closes, 0); /* idle, nothing queued: stays */
    int small = 4096;
    assert_int_equal(setsockopt(f->c->fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)), 0);
    kd_conn_set_max_frame(f->c, 1 << 20);
    for (int i = 0; i < 2000 && !f->c->out_head; i++) {
        kd_out *o = kd_out_new(f->c);
        kp_error e;
        assert_int_equal(kp_goodbye_encode(&o->w, &(kp_error){KP_E_INTERNAL, false, "filler"},
                                           &e), KP_OK);
        kd_conn_send(f->c, o);
    }
    assert_non_null(f->c->out_head);
    assert_true(f->output > 0 && f->output == (int64_t)f->c->out_bytes);
    usleep(80000);
    kd_transport_housekeeping(&f->t, uv_hrtime());
    assert_int_equal(f->closes, 1);
    assert_int_equal(f->reason, KD_DISC_STALLED);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_frames_split_and_glued, setup, teardown),
        cmocka_unit_test_setup_teardown(test_large_body, setup, teardown),
        cmocka_unit_test_setup_teardown(test_frame_too_large, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pause_resume, setup, teardown),
        cmocka_unit_test_setup_teardown(test_descriptor_fifo, setup, teardown),
        cmocka_unit_test_setup_teardown(test_too_many_descriptors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_output_hard_limit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_peer_closes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_partial_accounting, setup, teardown),
        cmocka_unit_test_setup_teardown(test_frame_stall, setup, teardown),
        cmocka_unit_test_setup_teardown(test_output_stall, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
