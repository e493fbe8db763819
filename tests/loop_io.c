/*
 * loop_io.c - see loop_io.h.
 */
#include "loop_io.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
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
