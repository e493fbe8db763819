/*
 * test_client.c - daemon/client.c and daemon/dispatch.c in-process: a kdad
 * daemon object (cpu backend) on a test-owned event loop, one end of a
 * socketpair adopted as a client's connection, hostile and awkward byte
 * streams written to the other end.  (The transport alone: test_conn.c.)  Each test ends with a drain and a clean loop
 * close, and the sanitizer build checks the daemon's memory.
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
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon.h"
#include "dispatch.h"
#include "loop_io.h"

typedef struct fixture {
    uv_loop_t loop;
    kd_daemon d;
    loop_client c;   /* the client's end */
    kd_client *cl;   /* the daemon's end */
} fixture;

static const char yaml[] = "heads: 2\nslots: 8\ncpu_threads: 1\n"
                           "limits:\n  max_inflight_requests: 2\n";

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof(*f));
    int fd;
    loop_daemon_start(&f->d, &f->loop, yaml);
    f->cl = loop_daemon_connect(&f->d, getuid(), &fd);
    assert_non_null(f->cl);
    loop_client_init(&f->c, fd);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    loop_client_close(&f->c);
    loop_daemon_stop(&f->d, &f->loop);
    free(f);
    return 0;
}

/* Writes everything, running the daemon's loop whenever the socket is full (loop_io.h). */
static void write_to(fixture *f, int fd, const void *bytes, size_t n)
{
    loop_write_all(&f->loop, fd, bytes, n);
}

static void send_frame(fixture *f)
{
    loop_send_frame(&f->loop, f->c.fd, &f->c.w);
}

/* Runs the daemon's loop until a frame arrives on the client end; false at EOF. */
static bool recv_frame(fixture *f)
{
    return loop_recv_msg(&f->loop, f->c.fd, &f->c.reader, &f->c.msg, &f->c.body);
}

static void expect_error(fixture *f, uint32_t id, int code, const char *substr)
{
    kp_error remote, e;
    assert_true(recv_frame(f));
    assert_int_equal(f->c.msg.kind, KP_MSG_RESPONSE);
    assert_int_equal(f->c.msg.id, id);
    assert_int_equal(kp_response_error_decode(&f->c.msg, &remote, &e), KP_OK);
    assert_int_equal(remote.code, code);
    if (!strstr(remote.message, substr))
        fail_msg("\"%s\" not in \"%s\"", substr, remote.message);
}

static void expect_goodbye(fixture *f, int code, const char *substr)
{
    kp_error remote, e;
    assert_true(recv_frame(f));
    assert_int_equal(kp_goodbye_decode(&f->c.msg, &remote, &e), KP_OK);
    assert_int_equal(remote.code, code);
    if (!strstr(remote.message, substr))
        fail_msg("\"%s\" not in \"%s\"", substr, remote.message);
    assert_false(recv_frame(f));
}

static void expect_ok(fixture *f, uint32_t id)
{
    assert_true(recv_frame(f));
    assert_int_equal(f->c.msg.kind, KP_MSG_RESPONSE);
    assert_int_equal(f->c.msg.id, id);
    assert_null(f->c.msg.error);
}

static void hello(fixture *f)
{
    kp_hello_params p = {{1}, 1, NULL};
    assert_int_equal(kp_hello_params_encode(&f->c.w, 1, &p, NULL), KP_OK);
    send_frame(f);
    expect_ok(f, 1);
}

/* ---------------------------------------------------------------------- */

static void test_prevalidation_refuses_hostile_frames(void **state)
{
    fixture *f = *state;
    hello(f);
    /* an array32 announcing 2^32 - 1 elements in 9 bytes */
    static const uint8_t bomb[] = {0, 0, 0, 5, 0xdd, 0xff, 0xff, 0xff, 0xff};
    write_to(f, f->c.fd, bomb, sizeof(bomb));
    expect_goodbye(f, KP_E_PROTOCOL, "announces 4294967295 objects");
    assert_int_equal(f->d.stats.disconnects[KD_DISC_PROTOCOL], 1);
}

static void test_too_many_objects(void **state)
{
    fixture *f = *state;
    hello(f);
    /* [0, 2, "health", {}] would be fine; one array of 262145 nils is not */
    size_t n = KP_MAX_OBJECTS + 1, body = 5 + n;
    uint8_t *frame = malloc(4 + body);
    frame[0] = (uint8_t)(body >> 24);
    frame[1] = (uint8_t)(body >> 16);
    frame[2] = (uint8_t)(body >> 8);
    frame[3] = (uint8_t)body;
    frame[4] = 0xdd;
    frame[5] = (uint8_t)(n >> 24);
    frame[6] = (uint8_t)(n >> 16);
    frame[7] = (uint8_t)(n >> 8);
    frame[8] = (uint8_t)n;
    memset(frame + 9, 0xc0, n);
    write_to(f, f->c.fd, frame, 4 + body);
    free(frame);
    expect_goodbye(f, KP_E_PROTOCOL, "more than 262144 msgpack objects");
}

/* Frames cut anywhere and frames glued together both work. */
static void test_frames_split_and_coalesced(void **state)
{
    fixture *f = *state;
    assert_int_equal(kp_health_params_encode(&f->c.w, 4, NULL), KP_OK);
    send_frame(f);
    expect_error(f, 4, KP_E_HELLO_REQUIRED, "health: send hello first");
    kp_hello_params p = {{1}, 1, "byte by byte"};
    assert_int_equal(kp_hello_params_encode(&f->c.w, 5, &p, NULL), KP_OK);
    uint8_t *frame;
    size_t len;
    assert_int_equal(kp_writer_flatten(&f->c.w, &frame, &len, NULL), KP_OK);
    for (size_t i = 0; i < len; i++) {
        write_to(f, f->c.fd, frame + i, 1);
        uv_run(&f->loop, UV_RUN_NOWAIT);
    }
    free(frame);
    expect_ok(f, 5);

    uint8_t glued[3 * 64];
    size_t at = 0;
    for (uint32_t id = 10; id < 13; id++) {
        assert_int_equal(kp_health_params_encode(&f->c.w, id, NULL), KP_OK);
        assert_int_equal(kp_writer_flatten(&f->c.w, &frame, &len, NULL), KP_OK);
        memcpy(glued + at, frame, len);
        at += len;
        free(frame);
    }
    write_to(f, f->c.fd, glued, at);
    for (uint32_t id = 10; id < 13; id++)
        expect_ok(f, id);
}

/* With max_inflight_requests 2, a pipeline of four requests on one slot
 * never has more than two admitted at once, and all four are answered. */
static void test_backpressure(void **state)
{
    fixture *f = *state;
    hello(f);
    kp_slot_alloc_params ap = {1, true};
    assert_int_equal(kp_slot_alloc_params_encode(&f->c.w, 2, &ap, NULL), KP_OK);
    send_frame(f);
    expect_ok(f, 2);
    kp_slot_list sl;
    assert_int_equal(kp_slot_alloc_result_decode(&f->c.msg, &sl, NULL), KP_OK);
    uint64_t slot = sl.slots[0];
    for (uint32_t id = 3; id < 7; id++) {
        kp_slot_list rp = {&slot, 1};
        assert_int_equal(kp_slot_reset_params_encode(&f->c.w, id, &rp, NULL), KP_OK);
        send_frame(f);
    }
    uint32_t most = 0;
    for (uint32_t id = 3; id < 7; id++) {
        for (int i = 0; i < 50; i++) {
            uv_run(&f->loop, UV_RUN_NOWAIT);
            most = f->cl->inflight > most ? f->cl->inflight : most;
        }
        expect_ok(f, id);
    }
    assert_true(most <= 2);
}

static void test_access_lists_and_connection_limit(void **state)
{
    fixture *f = *state;
    uint32_t allowed = 4242, *saved = f->d.cfg.allowed_uids;
    f->d.cfg.allowed_uids = &allowed;
    f->d.cfg.nallowed_uids = 1;
    int other;
    loop_daemon_connect(&f->d, 1000, &other);
    int keep = f->c.fd;
    f->c.fd = other;
    expect_goodbye(f, KP_E_PERMISSION_DENIED, "uid 1000");
    close(other);
    f->d.cfg.nallowed_uids = 0;
    f->d.cfg.allowed_uids = saved;

    f->d.cfg.max_connections = 1;
    loop_daemon_connect(&f->d, getuid(), &other);
    f->c.fd = other;
    expect_goodbye(f, KP_E_BUSY, "too many connections");
    close(other);
    f->c.fd = keep;
    hello(f); /* the first connection is unaffected */
    assert_int_equal(f->d.stats.disconnects[KD_DISC_PERMISSION], 1);
    assert_int_equal(f->d.stats.disconnects[KD_DISC_TOO_MANY], 1);
}

/* A client that never reads its responses is cut off, not buffered forever. */
static void test_output_hard_limit(void **state)
{
    fixture *f = *state;
    hello(f);
    int small = 4096;
    assert_int_equal(setsockopt(f->cl->conn->fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)), 0);
    f->d.net.lim.output_hard = 65536; /* as a reload of clients.output_hard_limit sets it */
    uint8_t *frame;
    size_t len;
    /* The same id each time: an answered request is no longer in flight. */
    assert_int_equal(kp_stats_params_encode(&f->c.w, 100, NULL), KP_OK);
    assert_int_equal(kp_writer_flatten(&f->c.w, &frame, &len, NULL), KP_OK);
    /* stats answers are ~1 KiB: a few hundred unread ones pass 64 KiB */
    kd_disconnect limit = KD_DISC_OUTPUT_LIMIT;
    for (uint32_t i = 0; i < 600 && !f->d.stats.disconnects[limit]; i++) {
        write_to(f, f->c.fd, frame, len);
        uv_run(&f->loop, UV_RUN_NOWAIT);
    }
    free(frame);
    assert_int_equal(f->d.stats.disconnects[limit], 1);
    /* what was queued before the limit still arrives, then the goodbye */
    kp_error remote, e;
    bool goodbye = false;
    while (recv_frame(f)) {
        if (f->c.msg.kind == KP_MSG_NOTIFICATION) {
            assert_int_equal(kp_goodbye_decode(&f->c.msg, &remote, &e), KP_OK);
            assert_int_equal(remote.code, KP_E_BUSY);
            goodbye = true;
        }
    }
    assert_true(goodbye);
}

/* Descriptors queue in arrival order: one that came with an earlier frame
 * is the one the next fd-carrying request takes. */
static void test_descriptor_fifo(void **state)
{
    fixture *f = *state;
    int mfd = memfd_create("t", MFD_ALLOW_SEALING | MFD_CLOEXEC);
    assert_int_equal(ftruncate(mfd, 4096), 0);
    assert_int_equal(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    kp_hello_params p = {{1}, 1, NULL};
    assert_int_equal(kp_hello_params_encode(&f->c.w, 1, &p, NULL), KP_OK);
    uint8_t *frame;
    size_t len;
    assert_int_equal(kp_writer_flatten(&f->c.w, &frame, &len, NULL), KP_OK);
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } control = {0};
    struct iovec v = {frame, len};
    struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = control.buf,
                       .msg_controllen = sizeof(control.buf)};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &mfd, sizeof(int));
    assert_int_equal(sendmsg(f->c.fd, &m, 0), (ssize_t)len);
    free(frame);
    close(mfd);
    expect_ok(f, 1);
    assert_int_equal(f->cl->conn->nfds, 1);
    kp_region_register_shm_params rp = {4096};
    assert_int_equal(kp_region_register_shm_params_encode(&f->c.w, 2, &rp, NULL), KP_OK);
    send_frame(f);
    expect_ok(f, 2);
    assert_int_equal(f->cl->conn->nfds, 0);
    assert_int_equal(f->cl->regions.count, 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_prevalidation_refuses_hostile_frames, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_too_many_objects, setup, teardown),
        cmocka_unit_test_setup_teardown(test_frames_split_and_coalesced, setup, teardown),
        cmocka_unit_test_setup_teardown(test_backpressure, setup, teardown),
        cmocka_unit_test_setup_teardown(test_access_lists_and_connection_limit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_output_hard_limit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_descriptor_fifo, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
