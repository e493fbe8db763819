/*
 * loop_io.h - for tests that run a daemon's event loop in-process and talk
 * to it through the non-blocking client end of a socketpair.
 */
#ifndef KDAD_TEST_LOOP_IO_H
#define KDAD_TEST_LOOP_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "kdaproto.h"

/* Writes everything to fd, running the loop whenever the socket is full (the
 * daemon reads only when its loop runs); fails the test on a write error. */
void loop_write_all(uv_loop_t *loop, int fd, const void *bytes, size_t n);

/* Flattens the frame in w and writes it to fd the same way. */
void loop_send_frame(uv_loop_t *loop, int fd, kp_writer *w);

/* Runs the loop until a whole frame arrives on fd and decodes it into msg,
 * whose body (the caller's to free, after closing msg) goes to *body; false at
 * EOF.  Closes msg and frees *body first.  Fails the test after 100000 turns. */
bool loop_recv_msg(uv_loop_t *loop, int fd, kp_reader *r, kp_msg *msg, uint8_t **body);

#endif
