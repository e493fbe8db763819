/*
 * loop_io.h - for tests that run a daemon's event loop in-process and talk
 * to it through the non-blocking client end of a socketpair.
 */
#ifndef KDAD_TEST_LOOP_IO_H
#define KDAD_TEST_LOOP_IO_H

#include <stddef.h>
#include <uv.h>

#include "kdaproto.h"

/* Writes everything to fd, running the loop whenever the socket is full (the
 * daemon reads only when its loop runs); fails the test on a write error. */
void loop_write_all(uv_loop_t *loop, int fd, const void *bytes, size_t n);

/* Flattens the frame in w and writes it to fd the same way. */
void loop_send_frame(uv_loop_t *loop, int fd, kp_writer *w);

#endif
