/*
 * loop_io.c - see loop_io.h.
 */
#include "loop_io.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "config.h"

void loop_write_all(uv_loop_t *loop, int fd, const void *bytes, size_t n)
{
    const uint8_t *p = bytes;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EAGAIN) {
            uv_run(loop, UV_RUN_NOWAIT);
            continue;
        }
        assert_true(w > 0);
        p += w;
        n -= (size_t)w;
    }
}

void loop_send_frame(uv_loop_t *loop, int fd, kp_writer *w)
{
    uint8_t *frame;
    size_t len;
    assert_int_equal(kp_writer_flatten(w, &frame, &len, NULL), KP_OK);
    loop_write_all(loop, fd, frame, len);
    free(frame);
}

bool loop_recv_msg(uv_loop_t *loop, int fd, kp_reader *r, kp_msg *msg, uint8_t **body)
{
    kp_msg_close(msg);
    free(*body);
    *body = NULL;
    for (int spins = 0; spins < 100000; spins++) {
        uv_run(loop, UV_RUN_NOWAIT);
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 1) != 1)
            continue;
        uint8_t *buf;
        size_t space = kp_reader_space(r, &buf);
        ssize_t n = recv(fd, buf, space, MSG_DONTWAIT);
        if (n == 0)
            return false;
        if (n < 0) {
            assert_true(errno == EAGAIN || errno == EINTR);
            continue;
        }
        kp_error e;
        int rc = kp_reader_commit(r, (size_t)n, &e);
        assert_true(rc >= 0);
        if (rc != KP_READ_FRAME)
            continue;
        size_t len;
        *body = kp_reader_take(r, &len);
        assert_int_equal(kp_msg_decode(msg, *body, len, UINT32_MAX, &e), KP_OK);
        return true;
    }
    fail_msg("no frame from the daemon");
    return false;
}

void loop_daemon_start(kd_daemon *d, uv_loop_t *loop, const char *yaml)
{
    char err[KD_CONFIG_ERR_MAX];
    kd_config cfg;
    assert_int_equal(uv_loop_init(loop), 0);
    if (kd_config_load_text(&cfg, "test", yaml, strlen(yaml), err, sizeof(err)) != 0)
        fail_msg("%s", err);
    cfg.backend = KD_BACKEND_CPU;
    if (kd_daemon_init(d, loop, &cfg, NULL, NULL, err, sizeof(err)) != 0)
        fail_msg("%s", err);
}

void loop_daemon_stop(kd_daemon *d, uv_loop_t *loop)
{
    kd_daemon_drain(d);
    uv_run(loop, UV_RUN_DEFAULT);
    kd_daemon_destroy(d);
    assert_int_equal(uv_loop_close(loop), 0); /* every handle closed */
}

kd_client *loop_daemon_connect(kd_daemon *d, uid_t uid, int *fd)
{
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    assert_int_equal(fcntl(sv[0], F_SETFL, O_NONBLOCK), 0);
    assert_int_equal(fcntl(sv[1], F_SETFL, O_NONBLOCK), 0);
    kd_peer peer = {getpid(), uid, getgid()};
    *fd = sv[1];
    return kd_client_new(d, sv[0], &peer);
}

void loop_client_init(loop_client *c, int fd)
{
    c->fd = fd;
    kp_reader_init(&c->reader, UINT32_MAX);
    assert_int_equal(kp_writer_init(&c->w, UINT32_MAX), KP_OK);
    kp_msg_init(&c->msg);
    c->body = NULL;
}

void loop_client_close(loop_client *c)
{
    if (c->fd >= 0)
        close(c->fd);
    kp_reader_close(&c->reader);
    kp_writer_close(&c->w);
    kp_msg_close(&c->msg);
    free(c->body);
}
