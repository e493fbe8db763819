/*
 * client_int.h - private to libkdaclient: the client object, the record of
 * one request in flight, and the functions the library's files share.
 *
 *   errors.c   the error table (kdac_err_*, kdac_fail)
 *   client.c   open (connect + hello), close, info, socket path, version
 *   io.c       the send queue, the frame reader, dispatch, progress, waiting
 *   calls.c    one encoder + result decoder per method, blocking wrappers
 *   shm.c      memfd regions
 *   shard.c    head-sharded clients (public API only)
 *   stream.c   stream-ordered prefills: semaphore words, the CUDA driver loaded at run time
 */
#ifndef KDAC_CLIENT_INT_H
#define KDAC_CLIENT_INT_H

#include "kdaclient.h"
#include "kdaproto.h"

/* Buckets of the id -> request table (ids are sequential, so id % N spreads
 * them evenly). */
#define CLIENT_HASH_BUCKETS 256
/* Reads smaller than this go through the staging buffer; larger frame
 * bodies are received in place. */
#define CLIENT_STAGE_BYTES (64u << 10)
/* iovecs handed to one sendmsg (below IOV_MAX = 1024). */
#define CLIENT_SEND_IOVS 256

typedef struct pending pending;

/* Turns a success response into res (and whatever the request's caller
 * asked to be filled).  Returns 0 or a kp_code with err set. */
typedef int (*decode_fn)(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res,
                         kp_error *err);
/* The same straight from the frame body, in one pass, for the results that
 * allow it; false: decode the frame the general way. */
typedef bool (*read_fn)(kdac_client *c, pending *p, const uint8_t *body, size_t len,
                        kdac_result *res);

/* One request from submission to completion. */
struct pending {
    uint32_t id;
    kp_method method;
    kdac_cb cb;
    void *data;
    decode_fn decode;
    read_fn read;           /* NULL: every result goes through decode */
    kp_writer *w;           /* its frame; NULL once fully written (given back) */
    bool sent;              /* every byte of the frame is in the socket */
    int fd;                 /* descriptor to pass with the frame's first byte, or -1 */
    bool fd_sent;           /* ring: it went ahead on a doorbell (PROTOCOL.md §Frame ring) */
    size_t iov_index;       /* send progress: current iovec ... */
    size_t iov_off;         /* ... and bytes of it already written */
    uint64_t unsent;        /* frame bytes not yet written */
    pending *hash_next;     /* bucket chain */
    pending *send_next;     /* send queue */
    bool has_done;          /* a done word to release with the failure value on any error */
    void *done_host;        /* its address here, or NULL (device memory) */
    uint64_t done_dev;      /* its device address (with done_ctx), when done_host is NULL */
    void *done_ctx;         /* the CUcontext of done_dev, or NULL */
    uint64_t done_value;
    union {                 /* what the result decoder needs, per method */
        struct {
            kp_prefill_seq *seqs; /* the request as encoded (lengths, out kinds) */
            void **outs;          /* inline output destinations, NULL: discard */
            uint64_t *pos;        /* result positions */
            uint32_t nseqs;
        } prefill;
        struct {
            void *lists;          /* slots, expect_pos, lens: the caller's, copied */
            void *out;            /* inline output destination, NULL: discard */
            uint64_t *pos;        /* result positions */
            kp_step_params req;   /* the request as encoded (counts, out kind) */
        } step;
        uint32_t alloc_count;
        struct {
            void *dst;            /* inline state destination, NULL with an out region */
            kp_dtype dtype;
        } read;
        struct {
            kdac_stats_info *info;  /* NULL: not asked for */
            kdac_usage_info *usage; /* NULL: not asked for */
            size_t usage_size;      /* the caller's sizeof(*usage) */
        } stats;
        char **prometheus;        /* kdac_stats_prometheus: the malloc'd text */
        struct {
            kdac_layer_info *layers;
            uint32_t cap;
            uint32_t *n;
        } layers;
        bool *created;
        uint32_t *region;
    } ctx;
};

struct kdac_client {
    int fd;
    char path[KDAC_PATH_MAX];
    int timeout_ms;
    int spin_us;              /* blocking calls read without sleeping this long first */
    kdac_server_info info;
    kp_session session;       /* geometry and limits for the codec */
    bool hello_done;

    kp_reader rd;
    uint8_t *stage;           /* CLIENT_STAGE_BYTES */
    uint64_t sent_bytes, recv_bytes;

    uint32_t next_id;
    uint32_t inflight;
    pending *table[CLIENT_HASH_BUCKETS];
    pending *send_head, *send_tail;
    uint64_t send_queued;     /* bytes in the send queue */
    int write_errno;          /* a write failed: the read side reports why */

    bool failed;              /* the connection is unusable */
    kdac_error failure;       /* why */
    int cb_depth;             /* > 0 while a callback runs */

    /* The frame ring (kdac_ring_attach): frames travel through ring_shm, the
     * socket carries doorbells.  While ring_polling (a blocking call's spin,
     * kdac_client_set_polling) the daemon is told not to ring; otherwise
     * every progress call ends by telling it what this client waits for. */
    kdac_shm ring_shm;
    kp_ring ring;
    bool ring_on;
    bool ring_polling;

    void *scratch;            /* arrays of the last blocking call's result */
    size_t scratch_cap;
    kp_writer *spare_writer;  /* a sent frame's writer, for the next request (or NULL) */
};

/* errors.c: fill err (may be NULL) with code and a printf-style message
 * (the table's when fmt is NULL); returns code. */
int kdac_fail(kdac_error *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* kp_error -> kdac_error (same codes) */
int kdac_from_kp(kdac_error *err, const kp_error *e);

/* io.c */
int client_progress(kdac_client *c);
/* Allocates a request record; NULL when out of memory. */
pending *pending_new(kdac_client *c, kp_method m, kdac_cb cb, void *data, decode_fn decode);
void pending_free(kdac_client *c, pending *p);
/* The id the next request gets (unused by requests in flight). */
uint32_t client_next_id(kdac_client *c);
/* Queues an encoded request, tries to write it, and tracks it until its
 * response; takes ownership of p. */
void client_submit(kdac_client *c, pending *p);
/* Fails the connection: every request in flight completes with code. */
void client_fail(kdac_client *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Completes every request in flight with code (used by close and failures). */
void client_complete_all(kdac_client *c, const kdac_error *e);
/* Refuses calls on a failed connection or from inside a callback. */
int client_check_usable(kdac_client *c, bool blocking, kdac_error *err);

/* calls.c: kdac_prefill_send_sems's checks of the semaphores against the
 * daemon's features, and the request itself (ctx: the CUcontext of a
 * device-only done word, or NULL). */
int client_prefill_check_sems(kdac_client *c, const kdac_sem *ready, const kdac_sem *done,
                              kdac_error *err);
int client_prefill_send(kdac_client *c, const char *layer, const kdac_seq *seqs, uint32_t nseqs,
                        const kdac_sem *ready, const kdac_sem *done, void *ctx, kdac_cb cb,
                        void *data, kdac_error *err);
/* stream.c: stores the failure value in p's done word, once (no-op without one). */
void client_sem_fail(pending *p);

/* The ring.attach answer arrived: frames take the ring from here on. */
void client_ring_start(kdac_client *c);

/* A blocking call: a *_send with sync_cb, then sync_wait. */
typedef struct sync_call {
    bool done;
    int status;
    kdac_result res; /* arrays rebased to the client's scratch */
} sync_call;

void sync_cb(kdac_client *c, void *data, const kdac_result *res, int status);
/* Drives the connection until s completes, or the timeout fails it. */
int sync_wait(kdac_client *c, sync_call *s, kdac_error *err);

/* The clients.* bounds of a hello or stats answer (the per-uid layers and
 * slots, which come in hello's limits, left 0). */
void kdac_bounds_from_wire(kdac_bounds *out, const kp_client_bounds *b);
/* hello's and stats' "memory". */
kdac_memory kdac_memory_from_wire(const kp_memory *m);

#endif /* KDAC_CLIENT_INT_H */
