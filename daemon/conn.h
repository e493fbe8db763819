/*
 * conn.h - one client connection: the socket, the read state machine that
 * cuts frames (proto/ kp_reader) and collects passed file descriptors, the
 * bounded output queue, backpressure, and the close sequence.
 *
 * Reading: small frames are read through a 64 KiB buffer, large bodies
 * straight into the frame (no copy).  Every read uses recvmsg with room for
 * KP_MAX_PENDING_FDS descriptors; received descriptors join a FIFO that
 * fd-carrying requests take from in frame order (PROTOCOL.md §File
 * descriptors).  Each complete frame goes to dispatch.c at once.  Reading
 * pauses while the connection has max_inflight_requests unanswered requests
 * or max_inflight_bytes of their frames, and after KD_READ_BUDGET_BYTES per
 * wakeup (the loop serves the others, and comes back).
 *
 * Writing: responses queue as kp_writer iovec lists (large tensors are
 * referenced, not copied) and go out with sendmsg as the socket takes them.
 * Unread output above clients.output_hard_limit closes the connection at
 * once; above the soft limit for output_soft_seconds, too.
 *
 * The frame ring (PROTOCOL.md §Frame ring): after ring.attach the frames of
 * both directions travel through a shared memory region instead of the
 * socket, which then carries only doorbell bytes (and passed descriptors).
 * The daemon's awake loop polls every ring (kd_conn_ring_poll) and publishes
 * what it waits for before it sleeps (kd_conn_ring_sleep), so that a client
 * rings only a sleeping daemon; kdad rings a client only when the client says
 * it sleeps.
 *
 * Closing: kd_conn_close stops reading, drops the connection's queued
 * requests, releases its regions and (unless slots persist) its slots,
 * queues a goodbye when there is a reason to give, and closes the socket
 * once the output is flushed (or after KD_CLOSE_FLUSH_MS).  Requests already
 * on the device finish; their responses are discarded.  The struct lives
 * until its last request is gone (refs).
 */
#ifndef KDAD_CONN_H
#define KDAD_CONN_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include <uv.h>

#include "access.h"
#include "kdaproto.h"
#include "region.h"
#include "scheduler.h"
#include "stats.h"

typedef struct kd_daemon kd_daemon;
typedef struct kd_req kd_req;

/* One queued outgoing frame. */
typedef struct kd_out {
    struct kd_out *next;
    kp_writer w;
    size_t iov_index;    /* first iovec not fully sent */
    size_t iov_offset;   /* bytes of it already sent */
    uint64_t bytes;      /* frame size */
    bool started;        /* some bytes went out: it must be finished */
    void **keep;         /* buffers the iovecs reference, freed with the frame */
    uint32_t nkeep, keep_cap;
} kd_out;

typedef struct kd_conn {
    kd_daemon *d;
    uint64_t serial;           /* >= 1, unique per daemon start (slot owner key) */
    int fd;
    uv_poll_t poll;
    int events;                /* UV_READABLE / UV_WRITABLE now polled */
    kd_peer peer;
    bool uid_counted;          /* counts toward its uid's connections (quota.h) */

    kp_reader reader;
    uint8_t *rbuf;             /* KD_READ_BUFFER_BYTES */
    size_t rpos, rlen;         /* unconsumed bytes rbuf[rpos, rlen) */
    int fds[KP_MAX_PENDING_FDS]; /* received, unclaimed descriptors, oldest first */
    uint32_t nfds;

    kp_session session;        /* geometry and limits from our hello result */
    bool hello_done;

    kd_out *out_head, *out_tail;
    uint64_t out_bytes;        /* queued and not yet sent */
    kd_out *spare;             /* sent frames kept for the next responses (SPARE_FRAMES) */
    uint32_t nspare;
    uint64_t over_soft_since;  /* uv_hrtime() when out_bytes passed the soft limit, or 0 */

    kd_req *req_head, *req_tail; /* unanswered requests, arrival order */
    uint32_t inflight;
    uint64_t inflight_bytes;
    uint64_t last_prefill_ns;  /* uv_hrtime() of its last prefill answer (hold.h, gathering) */

    kd_regions regions;
    kp_ring ring;              /* the frame ring's state, once ring_region is set */
    kd_region *ring_region;    /* the region holding it (one reference, dropped at close) */
    bool ring_on;              /* frames travel through the ring (the attach answer has left) */
    kd_sched_group group;      /* fairness in batch formation */

    bool closing;              /* no more reading; responses are discarded */
    bool poll_closed;          /* uv_close was called on the poll handle */
    uint64_t close_deadline;   /* uv_hrtime() by which the socket closes anyway */
    bool input_queued;         /* on the daemon's list of buffered input to process */
    struct kd_conn *input_next;
    uint32_t refs;             /* 1 while open, +1 per unanswered request */
    struct kd_conn *prev, *next; /* the daemon's connections */
} kd_conn;

/*
 * Adopts an accepted socket (non-blocking): checks the peer against the
 * access lists (access.h), the connection limit and its uid's connection
 * quota (quota.h), refusing with a goodbye, and starts reading.  Returns
 * NULL only without memory (the fd is closed).
 */
kd_conn *kd_conn_new(kd_daemon *d, int fd, const kd_peer *peer);

/* Starts the close sequence (see above).  goodbye: the error to send first,
 * or NULL to close silently (the peer is gone). */
void kd_conn_close(kd_conn *c, kd_disconnect reason, const kp_error *goodbye);

void kd_conn_ref(kd_conn *c);
void kd_conn_unref(kd_conn *c);

/* The owner key of this connection's slots: the connection itself, or its
 * uid when slots persist. */
uint64_t kd_conn_owner(const kd_conn *c);

/* Takes the oldest received descriptor, or -1 when none is waiting. */
int kd_conn_take_fd(kd_conn *c);

/* A frame to fill with an encoder: capped at what the peer accepts. */
kd_out *kd_out_new(kd_conn *c);
/* The frame references buf: free it with the frame.  0 or KP_E_NO_MEMORY
 * (then buf is freed at once, and the caller must not send o). */
int kd_out_keep(kd_out *o, void *buf);
void kd_out_free(kd_out *o);

/* Queues a frame (takes o).  Discarded when the connection is closing. */
void kd_conn_send(kd_conn *c, kd_out *o);

/* Re-evaluates backpressure after requests were answered: resumes reading,
 * and processes input already buffered. */
void kd_conn_update(kd_conn *c);
/* Processes buffered input (called from the daemon's idle handler). */
void kd_conn_process_input(kd_conn *c);

/*
 * ring.attach: frames move to the ring in `reg` (size bytes per direction,
 * already checked) once the answer to this, the only request in flight, has
 * left on the socket.  INVALID_PARAMS when the connection has a ring already
 * or anything else in flight or buffered.
 */
int kd_conn_attach_ring(kd_conn *c, kd_region *reg, uint64_t size, kp_error *err);
/* The awake loop: reads what the ring holds and writes what fits. */
void kd_conn_ring_poll(kd_conn *c);
/* Before the loop sleeps (awake false) or when it wakes: publishes what this
 * connection's ring waits for.  Going to sleep returns false when the ring
 * has work already (the loop stays awake). */
bool kd_conn_ring_sleep(kd_conn *c, bool asleep);

/* Periodic checks: the soft output limit and the close deadline. */
void kd_conn_housekeeping(kd_conn *c, uint64_t now);

#endif /* KDAD_CONN_H */
