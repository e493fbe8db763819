/*
 * loop_io.c - see loop_io.h.
 */
#include "loop_io.h"

#include <errno.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

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
