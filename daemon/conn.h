/*
 * conn.h - the transport: client connections' bytes and descriptors on one
 * event loop.  It cuts frames, queues output within limits, carries the
 * frame ring, and closes sockets; it knows nothing of requests, quotas or
 * the daemon.  Upward it calls the handlers given when the transport was
 * created (kd_conn_handlers), as libuv's streams call their callbacks; the
 * owner steers reading with kd_conn_pause / kd_conn_resume.
 *
 * Reading: small frames are read through a buffer, large bodies straight
 * into the frame (no copy).  Every read uses recvmsg with room for
 * KP_MAX_PENDING_FDS descriptors; received descriptors join a FIFO that
 * fd-carrying requests take from in frame order (PROTOCOL.md §File
 * descriptors).  Each complete frame goes to on_frame at once; reading stops
 * while the connection is paused, and after read_budget bytes per wakeup
 * (the loop serves the others, and comes back).
 *
 * Writing: responses queue as kp_writer iovec lists (large tensors are
 * referenced, not copied) and go out with sendmsg as the socket takes them.
 * Unread output above output_hard closes the connection at once; above
 * output_soft for output_soft_ns, too.  The owner hears of every byte held
 * for a frame still arriving (on_partial) and of unread output (on_output),
 * and pauses reading when it must.
 *
 * Slow peers: a frame begun and no byte of it for frame_stall_ns (while
 * reading was not paused), or unread output of which no byte was taken for
 * output_stall_ns while the peer sent nothing either, closes the connection
 * (reason "stalled").
 *
 * The frame ring (PROTOCOL.md §Frame ring): after kd_conn_attach_ring the
 * frames of both directions travel through shared memory instead of the
 * socket, which then carries only doorbell bytes (and passed descriptors).
 * While the loop is awake (kd_transport_stay_awake: spin_us after an answer
 * or a doorbell) every ring is polled; before it sleeps, each ring learns
 * what its connection waits for, so that a client rings only a sleeping
 * daemon; kdad rings a client only when the client says it sleeps.
 *
 * Closing: kd_conn_close stops reading, calls on_close (the owner lets go
 * of what the connection held), queues a goodbye when there is a reason to
 * give, and closes the socket once the output is flushed (or after
 * close_flush_ns).  on_free follows once the socket is closed; then the
 * struct is freed.
 */
#ifndef KDAD_CONN_H
#define KDAD_CONN_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "kdaproto.h"

/* Why a connection closed (the `disconnects` counters). */
#define KD_DISCONNECTS(X)                                                       \
    X(PEER_CLOSED, "peer_closed")         /* the client closed or reset it */   \
    X(PROTOCOL, "protocol")               /* a PROTOCOL error */                \
    X(FRAME_TOO_LARGE, "frame_too_large") /* a frame over the cap */            \
    X(VERSION, "unsupported_version")     /* hello found no common version */   \
    X(OUTPUT_LIMIT, "output_limit")       /* unread responses over the limit */ \
    X(PERMISSION, "permission")           /* peer not in the access lists */    \
    X(TOO_MANY, "too_many_connections")   /* clients.max_connections reached */ \
    X(QUOTA, "quota")                     /* its uid's connection quota reached */ \
    X(IO_ERROR, "io_error")               /* read or write failed */            \
    X(STALLED, "stalled")                 /* a frame or the output made no progress */ \
    X(SHUTDOWN, "shutdown")               /* kdad drained and exits */          \
    X(DEVICE_FAILED, "device_failed")     /* the device failed; kdad exits */

typedef enum kd_disconnect {
#define KD_DISC_ENUM(id, name) KD_DISC_##id,
    KD_DISCONNECTS(KD_DISC_ENUM)
#undef KD_DISC_ENUM
    KD_DISC_COUNT
} kd_disconnect;

const char *kd_disconnect_name(kd_disconnect d);

typedef struct kd_conn kd_conn;
typedef struct kd_transport kd_transport;

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

/* The owner's side.  Every handler may close the connection. */
typedef struct kd_conn_handlers {
    /* A complete frame; the body is the handler's (malloc'd). */
    void (*on_frame)(kd_conn *c, uint8_t *body, size_t len, uint64_t arrival_ns);
    /* The byte stream broke the protocol (a bad frame header, descriptors
     * misused, a ring counter no client could write); the connection
     * closes next, with e as its goodbye. */
    void (*on_error)(kd_conn *c, const kp_error *e);
    /* The close sequence began: no more frames come. */
    void (*on_close)(kd_conn *c, kd_disconnect reason);
    /* The socket is closed; c is freed when this returns. */
    void (*on_free)(kd_conn *c);
    /* The bytes held for the frame still arriving changed by delta (back to
     * 0 before on_frame, and at the close). */
    void (*on_partial)(kd_conn *c, int64_t delta);
    /* The unread output changed by delta (back to 0 by on_free). */
    void (*on_output)(kd_conn *c, int64_t delta);
} kd_conn_handlers;

/* Set by the owner (and changed on reload). */
typedef struct kd_transport_limits {
    uint64_t output_hard;     /* unread output that closes at once */
    uint64_t output_soft;     /* unread output that closes after output_soft_ns */
    uint64_t output_soft_ns;
    uint64_t close_flush_ns;  /* the time a goodbye gets to drain before the close */
    uint64_t read_budget;     /* bytes read per connection and wakeup */
    uint64_t write_budget;    /* bytes written per connection and wakeup */
    uint32_t read_buffer;     /* frames smaller than this are read through a buffer */
    uint64_t frame_stall_ns;  /* a frame begun and no byte of it for this long: closed */
    uint64_t output_stall_ns; /* output queued and no byte of it taken for this long: closed */
    uint32_t spin_us;         /* the loop polls this long after kd_transport_stay_awake */
} kd_transport_limits;

struct kd_conn {
    kd_transport *t;
    void *data;                /* the owner's */
    uint64_t id;               /* the owner's number for it, in log lines */
    int fd;
    uv_poll_t poll;
    int events;                /* UV_READABLE / UV_WRITABLE now polled */

    kp_reader reader;
    uint8_t *rbuf;             /* limits.read_buffer bytes */
    size_t rpos, rlen;         /* unconsumed bytes rbuf[rpos, rlen) */
    int fds[KP_MAX_PENDING_FDS]; /* received, unclaimed descriptors, oldest first */
    uint32_t nfds;
    uint64_t max_frame;        /* the largest frame either way */
    uint64_t partial;          /* bytes held for the frame still arriving (on_partial) */
    uint64_t frame_start_ns;   /* uv_hrtime() when that frame began */
    uint64_t last_read_ns;     /* uv_hrtime() of the last byte read, or of a resume */
    uint64_t last_write_ns;    /* uv_hrtime() of the last byte sent, or of output queued */

    kd_out *out_head, *out_tail;
    uint64_t out_bytes;        /* queued and not yet sent */
    kd_out *spare;             /* sent frames kept for the next responses */
    uint32_t nspare;
    uint64_t over_soft_since;  /* uv_hrtime() when out_bytes passed the soft limit, or 0 */

    kp_ring ring;              /* the frame ring's state, once attached */
    bool ring_attached;        /* frames move to the ring once the output is flushed */
    bool ring_on;              /* frames travel through the ring */

    bool paused;               /* the owner stopped reading (kd_conn_pause) */
    bool closing;              /* no more reading; output is discarded */
    bool poll_closed;          /* uv_close was called on the poll handle */
    uint64_t close_deadline;   /* uv_hrtime() by which the socket closes anyway */
    bool input_queued;         /* on the transport's list of buffered input to process */
    struct kd_conn *input_next;
    uint32_t refs;             /* 1 while the socket is open, +1 while the loop works on it */
    struct kd_conn *prev, *next;
};

struct kd_transport {
    uv_loop_t *loop;
    kd_conn_handlers h;
    kd_transport_limits lim;
    kd_conn *conns;            /* open and closing */
    uint32_t nconns;           /* all of them */
    uint32_t nopen;            /* not closing */
    uint32_t nrings;           /* on a frame ring (closing ones too) */
    uint64_t ring_doorbells;   /* rung to sleeping ring clients */
    kd_conn *input_head;       /* connections with buffered input to process */
    uv_idle_t input_idle;
    uv_idle_t spin;            /* keeps the loop polling (spin_us) */
    uint64_t spin_until_ns;
    bool stopped;              /* kd_transport_close was called */
};

void kd_transport_init(kd_transport *t, uv_loop_t *loop, const kd_conn_handlers *h,
                       const kd_transport_limits *lim);
/* Closes the transport's loop handles (every connection must be gone). */
void kd_transport_close(kd_transport *t);
/* Keeps the loop polling, and the frame rings polled, for spin_us. */
void kd_transport_stay_awake(kd_transport *t);
/* Whether the loop polls instead of sleeping now. */
bool kd_transport_awake(const kd_transport *t);
/* Periodic checks: the soft output limit and the close deadlines. */
void kd_transport_housekeeping(kd_transport *t, uint64_t now);

/* Adopts a connected, non-blocking socket and starts reading; id names it
 * in log lines.  NULL only without memory (then the fd is closed). */
kd_conn *kd_conn_new(kd_transport *t, int fd, uint64_t id, void *data);

/* Starts the close sequence (see above).  goodbye: the error to send first,
 * or NULL to close silently (the peer is gone). */
void kd_conn_close(kd_conn *c, kd_disconnect reason, const kp_error *goodbye);

/* Backpressure: no frames are read while paused. */
void kd_conn_pause(kd_conn *c);
void kd_conn_resume(kd_conn *c);

/* The largest frame read or written from now on (hello raises it). */
void kd_conn_set_max_frame(kd_conn *c, uint64_t bytes);

/* Takes the oldest received descriptor, or -1 when none is waiting. */
int kd_conn_take_fd(kd_conn *c);

/* A frame to fill with an encoder: capped at max_frame. */
kd_out *kd_out_new(kd_conn *c);
/* The frame references buf: free it with the frame.  0 or KP_E_NO_MEMORY
 * (then buf is freed at once, and the caller must not send o). */
int kd_out_keep(kd_out *o, void *buf);
void kd_out_free(kd_out *o);

/* Queues a frame (takes o).  Discarded when the connection is closing. */
void kd_conn_send(kd_conn *c, kd_out *o);

/*
 * Frames move to a ring of size bytes per direction at mem (checked by the
 * caller, and valid until on_free) once the output queued now has left on
 * the socket.  INVALID_PARAMS when the connection has a ring already or
 * bytes buffered either way.
 */
int kd_conn_attach_ring(kd_conn *c, void *mem, uint64_t size, kp_error *err);

#endif /* KDAD_CONN_H */
