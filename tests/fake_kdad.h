/*
 * fake_kdad.h - an in-process stand-in for kdad, for libkdaclient's unit
 * tests: a Unix socket in a temporary folder and a thread that accepts one
 * connection and runs a test's script against it, built on the same codec
 * (proto/) as the daemon.  Scripts read requests and write exactly the
 * frames a test needs: answers out of order, frames cut into single bytes,
 * oversized headers, goodbyes, or nothing at all.
 *
 * Checks inside the script thread cannot use cmocka (it longjmps on the
 * test's thread): they go through fake_check, and the test asserts
 * fake_stop() == 0 at the end.
 */
#ifndef FAKE_KDAD_H
#define FAKE_KDAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kdaclient.h"
#include "kdaproto.h"

#define FAKE_HEADS 4 /* H of the fake daemon */

typedef struct fake_conn {
    int fd;                    /* the accepted connection (blocking) */
    kp_session session;        /* what the fake announced in hello */
    kp_hello_result hello;     /* the hello result it sends */
    size_t write_chunk;        /* write frames in pieces of this size (0: whole) */
    size_t read_chunk;         /* read at most this much per recvmsg (0: what fits) */
    int fds[8];                /* descriptors received with SCM_RIGHTS, in order */
    int nfds;
    kp_reader rd;
    uint8_t *body;             /* body of the last request read */
    kp_msg msg;                /* its decoded envelope */
    kp_writer w;
    int failures;              /* fake_check failures */
} fake_conn;

typedef void (*fake_script)(fake_conn *fc, void *arg);

typedef struct fake_server fake_server;

/* Listens on a fresh socket and runs script on the first connection (in a
 * thread).  configure (may be NULL) adjusts the hello result before. */
fake_server *fake_start(fake_script script, void *arg);
fake_server *fake_start_with(fake_script script, void *arg,
                             void (*configure)(kp_hello_result *hello));
const char *fake_path(const fake_server *s);
/* Waits for the script to end and removes the socket; returns the number of
 * failed checks (and of the thread's own errors). */
int fake_stop(fake_server *s);

/* Records a failure (printed) when cond is false; returns cond. */
bool fake_check(fake_conn *fc, bool cond, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Reads the next request into fc->msg; false on EOF or a bad frame. */
bool fake_read(fake_conn *fc);
/* Reads the next request and checks its method; returns its id (0 on failure). */
uint32_t fake_expect(fake_conn *fc, kp_method m);
/* Answers hello with fc->hello (reading the request first). */
void fake_hello(fake_conn *fc);
/* Writes fc->w's frame (in fc->write_chunk pieces when set). */
void fake_send(fake_conn *fc);
/* Writes raw bytes. */
void fake_send_raw(fake_conn *fc, const void *data, size_t n);
/* Encodes and sends an error response / a goodbye. */
void fake_send_error(fake_conn *fc, uint32_t id, int code, const char *message);
void fake_send_goodbye(fake_conn *fc, int code, const char *message);
/* Reads until the client closes its end (true) or 10 s pass (false). */
bool fake_wait_eof(fake_conn *fc);

/* Client side: opens a client on the fake's socket. */
int fake_client_open(const fake_server *s, int timeout_ms, kdac_client **c, kdac_error *err);
/* Client side: an event loop (poll + kdac_client_progress) until *count
 * reaches target; false after 10 s or when progress fails. */
bool fake_client_run(kdac_client *c, const int *count, int target);

#endif /* FAKE_KDAD_H */
