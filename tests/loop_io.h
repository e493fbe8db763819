/*
 * loop_io.h - for tests that run a daemon's event loop in-process and talk
 * to it through the non-blocking client end of a socketpair.
 */
#ifndef KDAD_TEST_LOOP_IO_H
#define KDAD_TEST_LOOP_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "daemon.h"
#include "kdaproto.h"

/* The client end of a connection: the socket, a frame reader and writer, the
 * last message received and its body. */
typedef struct loop_client {
    int fd;
    kp_reader reader;
    kp_writer w;
    kp_msg msg;
    uint8_t *body;
} loop_client;

/* Starts an in-process daemon on the cpu backend from a YAML text, on loop. */
void loop_daemon_start(kd_daemon *d, uv_loop_t *loop, const char *yaml);

/* Drains the daemon, runs the loop until every handle has closed and
 * destroys it (fails the test if a handle stays open). */
void loop_daemon_stop(kd_daemon *d, uv_loop_t *loop);

/* Connects a peer of uid to d over a non-blocking socketpair: the daemon's
 * end (NULL if it refused), the client's in *fd. */
kd_client *loop_daemon_connect(kd_daemon *d, uid_t uid, int *fd);

/* Readies c's reader, writer and message for the socket fd; closes them. */
void loop_client_init(loop_client *c, int fd);
void loop_client_close(loop_client *c);

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
