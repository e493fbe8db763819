/*
 * kdaclient.h - libkdaclient, the C client of kdad (the Kimi Delta Attention
 * prefill daemon).  This is the whole public API: one header, no other
 * dependency.  The wire protocol it speaks is proto/PROTOCOL.md (version 1).
 *
 * Model
 *   A kdac_client is one connection to kdad (a Unix stream socket).  Opening
 *   it connects and runs the hello handshake; it then carries any number of
 *   requests at once: they are pipelined on the socket and their responses,
 *   which may come back in any order, are matched to them by id.
 *
 *   Every data-path call exists twice:
 *     kdac_X(...)        blocking: sends, waits for the response, returns it.
 *     kdac_X_send(...)   non-blocking: queues the request and returns at
 *                        once; a callback receives the result later.
 *   The non-blocking form fits any event loop: poll kdac_client_fd() for the
 *   events kdac_client_events() asks for, and call kdac_client_progress()
 *   when it is ready.  Callbacks run inside kdac_client_progress() (and
 *   inside blocking calls, which drive the same connection).
 *   Setup-time calls (layers, regions, stats) are blocking only.
 *
 * Errors
 *   Every call returns 0 or a negative code (KDAC_E_*), and fills the
 *   kdac_error passed to it (NULL to ignore) with the code and one sentence:
 *   the daemon's own message, which names the offending field, or the
 *   library's.  Codes -1..-99 are the daemon's (the wire table of
 *   PROTOCOL.md), -100 and below the library's.  A callback never fires for
 *   a call that returned an error.
 *
 * Memory
 *   Tensor memory named inline (kdac_tensor.data) is sent from where it is,
 *   without a copy: it must stay alive and unchanged until the request
 *   completes (the blocking call returns or the callback has run).  Output
 *   buffers (kdac_output.data) must stay alive until then too; the library
 *   copies inline results into them before completion.  Pointers inside
 *   results are owned by the client: in a callback they are valid until the
 *   callback returns; from a blocking call, until the next call on the same
 *   client.
 *
 * Thread safety
 *   A kdac_client is not thread-safe: use each client from one thread at a
 *   time (its callbacks run on that thread).  Distinct clients are
 *   independent, so a multi-threaded program opens one client per thread.
 *   The functions that take no client (error tables, kdac_shm_*, sizes,
 *   version) are thread-safe.
 *
 * Reentrancy
 *   A callback may submit new requests with the *_send functions.  It must
 *   not call a blocking function or kdac_client_close() on its own client
 *   (they return KDAC_E_INVALID_ARGUMENT).
 */
#ifndef KDACLIENT_H
#define KDACLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The shared library exports exactly the KDAC_EXPORT functions.  Programs
 * linking the static library may define KDAC_STATIC (the CMake target
 * kdaclient::kdaclient_static does) so that its functions stay private to
 * the shared objects they are linked into. */
#if defined(KDAC_STATIC)
#define KDAC_EXPORT
#else
#define KDAC_EXPORT __attribute__((visibility("default")))
#endif

#define KDAC_VERSION_MAJOR 0
#define KDAC_VERSION_MINOR 1
#define KDAC_VERSION_PATCH 0
/* (major << 16) | (minor << 8) | patch, for compile-time checks. */
#define KDAC_VERSION_HEX \
    ((KDAC_VERSION_MAJOR << 16) | (KDAC_VERSION_MINOR << 8) | KDAC_VERSION_PATCH)

/* The library's version at run time, as KDAC_VERSION_HEX and as "0.1.0". */
KDAC_EXPORT unsigned kdac_version(void);
KDAC_EXPORT const char *kdac_version_string(void);

/* ------------------------------------------------------------------------ */
/* Constants                                                                 */
/* ------------------------------------------------------------------------ */

#define KDAC_PROTOCOL_VERSION 1      /* the wire protocol version this library speaks */
#define KDAC_HEAD_DIM 128            /* D: every head is 128 wide */
#define KDAC_NAME_MAX 64             /* layer names, counter names, features (bytes) */
#define KDAC_TEXT_MAX 256            /* server and GPU names (bytes) */
#define KDAC_ERRMSG_MAX 512          /* error messages, including the NUL */
#define KDAC_PATH_MAX 108            /* socket paths (sizeof sun_path), including the NUL */
#define KDAC_CUDA_IPC_HANDLE_BYTES 64 /* sizeof(cudaIpcMemHandle_t) */
#define KDAC_TENSOR_ALIGN 16         /* region offsets must be multiples of this */
#define KDAC_MAX_FEATURES 64         /* feature names in hello */
#define KDAC_HIST_MAX_BUCKETS 64     /* latency histogram bounds in stats */
#define KDAC_STATS_MAX_COUNTERS 64   /* named counters kept per stats map (more are dropped) */
#define KDAC_STATS_MAX_PHASES 32     /* batch phases kept in stats */
#define KDAC_DEFAULT_SCALE 0.08838834764831845f /* 1/sqrt(128): the usual output scale */

/* The system service's socket, and the user instance's (under $XDG_RUNTIME_DIR). */
#define KDAC_SYSTEM_SOCKET "/run/kdad/kdad.sock"
#define KDAC_USER_SOCKET_NAME "kdad.sock"
/* One kdad per GPU (kdad@GPU.service): /run/kdad/kdad-GPU.sock (kdac_socket_for_gpu). */
#define KDAC_SYSTEM_SOCKET_DIR "/run/kdad"

/* ------------------------------------------------------------------------ */
/* Errors                                                                    */
/* ------------------------------------------------------------------------ */

/*
 * X(NAME, code, retryable, message).  The first block is the daemon's table
 * (PROTOCOL.md §Errors, same codes and names); the second is the library's.
 * "retryable": the same call, made again unchanged later, may succeed.
 */
#define KDAC_ERRORS(X)                                                                        \
    X(PROTOCOL, -1, false, "malformed frame or message")                                     \
    X(FRAME_TOO_LARGE, -2, false, "frame larger than the cap in force")                      \
    X(UNSUPPORTED_VERSION, -3, false, "no protocol version in common")                       \
    X(HELLO_REQUIRED, -4, false, "hello must succeed before any other request")              \
    X(UNKNOWN_METHOD, -10, false, "unknown method")                                          \
    X(INVALID_PARAMS, -11, false, "invalid params: wrong field, type, shape or value")       \
    X(LIMIT_EXCEEDED, -12, false, "request exceeds a limit announced in hello")              \
    X(UNKNOWN_LAYER, -13, false, "no layer with this name")                                  \
    X(LAYER_EXISTS, -14, false, "a different layer with this name exists")                   \
    X(UNKNOWN_SLOT, -15, false, "no such slot")                                              \
    X(STALE_SLOT, -16, false, "slot handle is stale: the slot was freed")                    \
    X(POSITION_MISMATCH, -17, false, "slot position differs from expect_pos")                \
    X(STATE_LOST, -18, false, "slot has no valid state")                                     \
    X(REGION_INVALID, -19, false, "region unknown, released or unusable")                    \
    X(REGION_BOUNDS, -20, false, "reference reaches outside its region")                     \
    X(PERMISSION_DENIED, -21, false, "operation not permitted to this client")               \
    X(NOT_SUPPORTED, -22, false, "not supported by this daemon")                             \
    X(READY_TIMEOUT, -23, false, "the ready word did not reach its value in time")           \
    X(POOL_FULL, -30, true, "no free slot in the pool")                                      \
    X(QUOTA_EXCEEDED, -31, false, "per-client quota exceeded")                               \
    X(BUSY, -32, true, "daemon overloaded; retry later")                                     \
    X(SHUTTING_DOWN, -33, true, "daemon is shutting down")                                   \
    X(DEVICE_FAILED, -40, false, "backend or device failure")                                \
    X(NO_MEMORY, -41, true, "out of memory")                                                 \
    X(INTERNAL, -42, false, "internal error")                                                \
    X(NOT_RUNNING, -100, true, "daemon not running: nothing listens on the socket")          \
    X(CONNECT, -101, false, "cannot connect to the daemon's socket")                         \
    X(DISCONNECTED, -102, true, "connection to the daemon lost")                             \
    X(TIMEOUT, -103, true, "timed out waiting for the daemon")                               \
    X(CANCELED, -104, false, "canceled: the client was closed")                              \
    X(INVALID_ARGUMENT, -105, false, "invalid argument")                                     \
    X(SYSTEM, -106, false, "system call failed")

typedef enum kdac_code {
    KDAC_OK = 0,
#define KDAC_CODE_ENTRY(name, code, retryable, message) KDAC_E_##name = code,
    KDAC_ERRORS(KDAC_CODE_ENTRY)
#undef KDAC_CODE_ENTRY
} kdac_code;

/* The detail of a failure. */
typedef struct kdac_error {
    int code;                      /* KDAC_OK or a negative code (a newer daemon may send
                                      codes this table lacks: treat them by `retryable`) */
    bool retryable;                /* the daemon's flag for its errors; the table's otherwise */
    char message[KDAC_ERRMSG_MAX]; /* one sentence; not stable, do not parse it */
} kdac_error;

/* "POOL_FULL" / the table's message / its retryable flag.  Unknown codes:
 * "UNKNOWN_CODE", "unknown error code", false. */
KDAC_EXPORT const char *kdac_err_name(int code);
KDAC_EXPORT const char *kdac_strerror(int code);
KDAC_EXPORT bool kdac_err_retryable(int code);

/* ------------------------------------------------------------------------ */
/* Types shared by requests and results                                      */
/* ------------------------------------------------------------------------ */

typedef enum kdac_dtype {
    KDAC_DTYPE_BF16 = 0, /* bfloat16: the upper 16 bits of an IEEE binary32 */
    KDAC_DTYPE_F32 = 1,  /* IEEE binary32 */
} kdac_dtype;

/* Sizes of the tensors of a prefill and of a slot state, in bytes. */
static inline uint64_t kdac_token_bytes(uint32_t len, uint32_t heads) /* q k v g out */
{
    return (uint64_t)len * heads * KDAC_HEAD_DIM * 2;
}
static inline uint64_t kdac_beta_bytes(uint32_t len, uint32_t heads) /* beta */
{
    return (uint64_t)len * heads * 2;
}
static inline uint64_t kdac_state_bytes(uint32_t heads, kdac_dtype dtype) /* [H][128][128] */
{
    return (uint64_t)heads * KDAC_HEAD_DIM * KDAC_HEAD_DIM * (dtype == KDAC_DTYPE_F32 ? 4 : 2);
}

/*
 * An input tensor: the bytes inline (data, sent from there without a copy),
 * or a range of a region this client registered (region >= 1, offset a
 * multiple of KDAC_TENSOR_ALIGN).  Its size is implied by its field's shape.
 */
typedef struct kdac_tensor {
    const void *data;  /* inline bytes; used when region is 0 */
    uint32_t region;   /* 0: inline; else a region id */
    uint64_t offset;   /* byte offset in the region */
} kdac_tensor;

/*
 * Where an output goes: into a region (region >= 1: the daemon writes it
 * there), or inline (region 0: the daemon returns it in the response and
 * the library copies it to data; data NULL discards it).
 */
typedef struct kdac_output {
    void *data;
    uint32_t region;
    uint64_t offset;
} kdac_output;

static inline kdac_tensor kdac_tensor_inline(const void *data)
{
    kdac_tensor t = {data, 0, 0};
    return t;
}
static inline kdac_tensor kdac_tensor_region(uint32_t region, uint64_t offset)
{
    kdac_tensor t = {NULL, region, offset};
    return t;
}
static inline kdac_output kdac_output_inline(void *data)
{
    kdac_output o = {data, 0, 0};
    return o;
}
static inline kdac_output kdac_output_region(uint32_t region, uint64_t offset)
{
    kdac_output o = {NULL, region, offset};
    return o;
}

/* ------------------------------------------------------------------------ */
/* Connection                                                                */
/* ------------------------------------------------------------------------ */

typedef struct kdac_client kdac_client;

typedef struct kdac_options {
    const char *socket_path; /* NULL: kdac_socket_default() ($KDAD_SOCKET, $KDAD_GPU, ...) */
    const char *client_name; /* sent in hello for the daemon's logs; NULL: "libkdaclient/0.1.0" */
    int timeout_ms;          /* limit for each blocking call (and open); 0: wait forever.
                                A blocking call that times out closes the connection, since
                                the daemon may still act on the request. */
} kdac_options;

/* Fills the defaults (all NULL / 0). */
KDAC_EXPORT void kdac_options_init(kdac_options *opts);

/*
 * The socket path a client uses when the options name none, in buf:
 * $KDAD_SOCKET if set, else kdac_socket_for_gpu($KDAD_GPU) if that is set,
 * else $XDG_RUNTIME_DIR/kdad.sock if that exists, else /run/kdad/kdad.sock.
 * KDAC_E_INVALID_ARGUMENT if it does not fit in size or $KDAD_GPU is not a
 * valid GPU name.
 */
KDAC_EXPORT int kdac_socket_default(char *buf, size_t size);

/*
 * The socket of the kdad instance serving one GPU (one kdad per GPU: the
 * kdad@.service template), in buf: $XDG_RUNTIME_DIR/kdad-GPU.sock if that
 * exists (a user instance), else /run/kdad/kdad-GPU.sock.  gpu is the
 * instance name: a CUDA ordinal ("0", "1", ...) or a GPU UUID, as the unit
 * kdad@GPU.service names it (1..64 bytes of [A-Za-z0-9-]).
 * Errors: INVALID_ARGUMENT (a bad name, or the path does not fit in size).
 */
KDAC_EXPORT int kdac_socket_for_gpu(const char *gpu, char *buf, size_t size);

/*
 * Connects and runs hello (blocking, bounded by opts->timeout_ms).  On
 * success *out is an open client, to be closed with kdac_client_close.
 * opts may be NULL (defaults).
 * Errors: NOT_RUNNING (no socket, or nobody listening), CONNECT (other
 * connect failures, e.g. permission), UNSUPPORTED_VERSION (the daemon speaks
 * another protocol version; the message lists both), PROTOCOL (the peer is
 * not a kdad of a known protocol), DISCONNECTED, TIMEOUT, PERMISSION_DENIED
 * (the daemon's configuration refuses this uid), NO_MEMORY, SYSTEM.
 */
KDAC_EXPORT int kdac_client_open(kdac_client **out, const kdac_options *opts, kdac_error *err);

/*
 * Closes the connection and frees the client.  Requests still in flight
 * complete first, inside this call, with KDAC_E_CANCELED.  Returns 0, or
 * KDAC_E_INVALID_ARGUMENT (doing nothing) when called from one of the
 * client's own callbacks.  NULL is a no-op.
 */
KDAC_EXPORT int kdac_client_close(kdac_client *c);

/* transports bits of kdac_server_info */
#define KDAC_TRANSPORT_INLINE 0x1u   /* tensors inside the frame */
#define KDAC_TRANSPORT_SHM 0x2u      /* host shared memory regions (kdac_region_register_shm) */
#define KDAC_TRANSPORT_CUDA_IPC 0x4u /* device memory regions (kdac_region_register_cuda) */

typedef struct kdac_limits {
    uint64_t max_frame_bytes;        /* one frame, either direction */
    uint64_t max_inline_bytes;       /* inline tensor bytes per request, and per result */
    uint32_t max_batch_tokens;       /* tokens per prefill request */
    uint32_t max_batch_seqs;         /* sequences per launch */
    uint32_t max_seqs_per_request;   /* sequences per prefill request */
    uint32_t max_slots_per_client;   /* slots one owner may hold */
    uint32_t max_regions_per_client; /* regions per connection */
    uint32_t max_inflight_requests;  /* unanswered requests before the daemon stops reading */
    uint64_t max_inflight_bytes;     /* unanswered request bytes before it stops reading */
    uint32_t max_layers;             /* layers in the daemon */
} kdac_limits;

/*
 * The bounds on what one connection, one uid and all clients together may
 * make the daemon hold (docs/daemon.md, "What a client can make kdad hold"),
 * named as the daemon's configuration keys (clients.*, limits.*_per_uid).
 * A field is 0 when the daemon did not send it (an older daemon).
 */
typedef struct kdac_bounds {
    uint32_t max_layers_per_uid;              /* client layers of one uid */
    uint32_t max_slots_per_uid;               /* slots of one uid, all its owners */
    uint32_t max_connections;                 /* connections open, all uids */
    uint32_t max_connections_per_uid;
    uint64_t max_inflight_bytes_per_uid;      /* unanswered request bytes, frames arriving too */
    uint64_t max_inflight_bytes_total;        /* the same, all uids */
    uint64_t output_hard_limit;               /* unread response bytes of one connection */
    uint64_t output_soft_limit;               /* ... tolerated output_soft_seconds */
    uint64_t max_output_bytes_per_uid;        /* unread response bytes of one uid */
    uint64_t max_output_bytes_total;          /* the same, all uids */
    uint64_t max_region_bytes_per_connection; /* mapped region bytes */
    uint64_t max_region_bytes_per_uid;
    uint32_t output_soft_seconds;
    uint32_t frame_stall_seconds;             /* a frame begun and no byte since: closed */
    uint32_t output_stall_seconds;            /* unread output and no byte taken since: closed */
} kdac_bounds;

/*
 * The memory the daemon holds for its backend, bytes by use (docs/daemon.md,
 * "Memory"): device memory with the cuda backend, host memory with the cpu
 * backend (its pool alone).  Counted where the daemon allocates it.
 */
typedef struct kdac_memory {
    uint64_t pool;     /* the state pool */
    uint64_t staging;  /* staging buffers and launch tables */
    uint64_t scratch;  /* the split path's outputs scratch (its cuda_split_scratch) */
    uint64_t kernel;   /* the kernel instance's other buffers */
    uint64_t lanes;    /* the gated lanes (batching.ready_on_device), their scratch included */
    uint64_t layers;   /* layer weights copied where the kernel reads them */
    uint64_t total;    /* all of the above */
} kdac_memory;

/* What hello told: the daemon, its geometry and its limits. */
typedef struct kdac_server_info {
    uint32_t version;                  /* protocol version in use */
    char server[KDAC_TEXT_MAX + 1];    /* "kdad 0.1.0" */
    uint64_t instance;                 /* random per daemon start: a change means a restart */
    char backend[8];                   /* "cuda" or "cpu" */
    bool has_gpu;                      /* the gpu_* fields are set */
    char gpu_name[KDAC_TEXT_MAX + 1];  /* "NVIDIA H200" */
    char gpu_uuid[KDAC_TEXT_MAX + 1];  /* "GPU-xxxxxxxx-..." (what region_register_cuda names) */
    uint32_t gpu_index;                /* CUDA ordinal inside the daemon */
    uint32_t heads;                    /* H */
    uint32_t slots;                    /* pool size */
    kdac_dtype state_dtype;            /* the pool's element type */
    uint32_t transports;               /* KDAC_TRANSPORT_* */
    bool slots_persist;                /* slots belong to the uid and survive disconnects */
    uint32_t nfeatures;
    char features[KDAC_MAX_FEATURES][KDAC_NAME_MAX + 1];
    kdac_limits limits;
    char gpu_pci_bus_id[32];           /* "0000:19:00.0" with has_gpu; "" from a daemon that
                                          does not send it */
    bool gpu_mps;                      /* the daemon's GPU context is shared through CUDA MPS,
                                          so its kernels and a client's run side by side
                                          (docs/daemon.md, "Sharing the GPU: MPS") */
    /* The per-uid and daemon-wide bounds in force at hello (a reload may change
     * them: kdac_stats_usage reports those in force).  has_bounds: the daemon
     * sent the clients.* ones (max_*_per_uid of layers and slots may come
     * without them). */
    bool has_bounds;
    kdac_bounds bounds;
    /* The daemon's memory at hello; has_memory false from a daemon that does not send it.
     * kdac_stats_usage reports it as it is now (layers change it). */
    bool has_memory;
    kdac_memory memory;
} kdac_server_info;

/* The hello result of this connection; valid until kdac_client_close. */
KDAC_EXPORT const kdac_server_info *kdac_client_info(const kdac_client *c);
/* The socket path this client connected to. */
KDAC_EXPORT const char *kdac_client_path(const kdac_client *c);

/* ------------------------------------------------------------------------ */
/* Driving a connection from an event loop                                   */
/* ------------------------------------------------------------------------ */

#define KDAC_READABLE 0x1 /* poll the fd for input (POLLIN, EPOLLIN, UV_READABLE) */
#define KDAC_WRITABLE 0x2 /* poll the fd for output (POLLOUT, EPOLLOUT, UV_WRITABLE) */

/*
 * The connection's socket, non-blocking, for the caller's poller.  It stays
 * the same descriptor until kdac_client_close (also after a failure), so
 * stop polling it before closing the client.  Never read or write it.
 */
KDAC_EXPORT int kdac_client_fd(const kdac_client *c);

/*
 * The events to poll for now: KDAC_READABLE while the connection is alive,
 * plus KDAC_WRITABLE while queued request bytes wait for room in the socket;
 * 0 once the connection failed.  It changes after *_send calls and after
 * kdac_client_progress: re-arm the poller when it does.  Level-triggered
 * and edge-triggered pollers both work (progress runs until the socket
 * would block).
 */
KDAC_EXPORT int kdac_client_events(const kdac_client *c);

/*
 * Does the I/O that is possible without blocking: writes queued requests,
 * reads responses and completes them (running their callbacks).  Call it
 * when the fd is ready (calling it at other times is harmless).  Returns 0,
 * or the negative code of a connection failure (DISCONNECTED, PROTOCOL,
 * FRAME_TOO_LARGE, a goodbye's code such as SHUTTING_DOWN): every request in
 * flight has then completed with that error, and every later call on the
 * client fails with it.
 */
KDAC_EXPORT int kdac_client_progress(kdac_client *c);

/*
 * Latency over CPU: the client's blocking calls keep reading the socket,
 * without sleeping, for up to spin_us microseconds before they sleep in
 * poll(2).  An answer that comes within that time is taken at once instead
 * of after the scheduler wakes the sleeping thread (tens of microseconds on
 * a loaded or virtual machine), for a core's time while waiting.  0 (the
 * default) sleeps at once; at most 1000000.  Callers of the non-blocking
 * form decide for themselves how long to poll.
 * Errors: INVALID_ARGUMENT.
 */
KDAC_EXPORT int kdac_client_set_spin(kdac_client *c, int spin_us, kdac_error *err);

/*
 * For callers that drive kdac_client_progress themselves over a frame ring
 * (kdac_ring_attach): `polling` true promises progress calls without
 * sleeping, so the daemon writes answers into the ring without ringing the
 * socket's doorbell (and progress skips reading the socket).  To sleep again,
 * set it false and call kdac_client_progress once more before waiting on
 * kdac_client_fd: that call tells the daemon to ring, then takes what came
 * meanwhile.  No effect without a ring.
 */
KDAC_EXPORT void kdac_client_set_polling(kdac_client *c, bool polling);

/* Transfer state, for progress bars and flow control. */
typedef struct kdac_io_status {
    uint32_t inflight;       /* requests sent or queued, not yet completed */
    uint64_t send_queued;    /* request bytes not yet written to the socket */
    uint64_t sent_bytes;     /* bytes written since open */
    uint64_t recv_bytes;     /* bytes read since open */
    uint64_t frame_have;     /* bytes of the incoming frame received so far */
    uint64_t frame_len;      /* its length (0 while its header is incomplete) */
} kdac_io_status;

KDAC_EXPORT void kdac_client_io_status(const kdac_client *c, kdac_io_status *st);

/* ------------------------------------------------------------------------ */
/* Results of non-blocking calls                                             */
/* ------------------------------------------------------------------------ */

typedef enum kdac_slot_status {
    KDAC_SLOT_READY = 0, /* holds a valid state */
    KDAC_SLOT_EMPTY = 1, /* allocated with KDAC_SLOT_ALLOC_EMPTY, never written */
    KDAC_SLOT_LOST = 2,  /* a device failure destroyed its state */
} kdac_slot_status;

typedef struct kdac_slot_entry {
    uint64_t slot;           /* handle */
    uint64_t pos;            /* tokens consumed, after the requests that finished */
    kdac_slot_status status;
    uint32_t queued;         /* admitted requests waiting on it */
} kdac_slot_entry;

typedef struct kdac_health_info {
    bool draining;      /* the daemon is shutting down and refuses new work */
    uint64_t uptime_us;
    uint32_t queued;    /* requests waiting for the device */
    uint32_t running;   /* batches on the device */
} kdac_health_info;

typedef struct kdac_prefill_result {
    uint32_t nseqs;
    const uint64_t *pos; /* [nseqs]: each slot's position after its sequence */
    uint64_t queue_us;   /* admission to launch, in the daemon */
    uint64_t run_us;     /* launch to completion of the batch */
    /* The batch's device time (cuda: GPU events from its first copy in to its last
     * copy out; cpu: the worker's run) and the prefill kernel's share of it; 0 when
     * the daemon does not report them. */
    uint64_t device_us;
    uint64_t kernel_us;
} kdac_prefill_result;

typedef struct kdac_step_result {
    uint32_t nseqs;
    const uint64_t *pos; /* [nseqs]: each slot's position after the step */
    uint64_t queue_us;   /* as kdac_prefill_result */
    uint64_t run_us;
    uint64_t device_us;
    uint64_t kernel_us;  /* the step kernel's share of device_us */
} kdac_step_result;

typedef struct kdac_slot_info_result {
    uint32_t nslots;
    const kdac_slot_entry *slots; /* [nslots] */
    uint32_t pool_free;           /* free slots in the pool */
    uint32_t quota_left;          /* slots this client may still allocate */
} kdac_slot_info_result;

/* What a completion callback receives.  `method` is the wire name
 * ("prefill", "slot.alloc", ...); the member of u that matches it is set on
 * success.  Methods with an empty result set none. */
typedef struct kdac_result {
    const char *method;
    kdac_error error; /* code 0 on success; else why the request failed */
    union {
        kdac_prefill_result prefill;                          /* prefill */
        kdac_step_result step;                                /* step */
        struct { uint32_t nslots; const uint64_t *slots; } alloc; /* slot.alloc */
        struct { uint64_t slot, pos; } fork;                  /* slot.fork */
        struct { uint64_t pos; kdac_dtype dtype; } read;      /* slot.read */
        kdac_slot_info_result info;                           /* slot.info */
        kdac_health_info health;                              /* health */
    } u;
} kdac_result;

/*
 * Completion of a *_send call: exactly once per accepted request, with
 * status 0 or a negative code (res->error holds the detail).  res and what
 * it points to are valid until the callback returns.
 */
typedef void (*kdac_cb)(kdac_client *c, void *data, const kdac_result *res, int status);

/* ------------------------------------------------------------------------ */
/* Prefill                                                                   */
/* ------------------------------------------------------------------------ */

/* kdac_seq.flags */
#define KDAC_SEQ_FRESH 0x1u      /* start from a zero state at position 0, whatever the slot held */
#define KDAC_SEQ_EXPECT_POS 0x2u /* fail (POSITION_MISMATCH) unless the slot is at expect_pos */

/*
 * One sequence of a prefill: `len` tokens continuing the state in `slot`
 * (updated in place).  Shapes, with H the daemon's heads:
 *   q, k, v, g, out   bf16 [len][H][128]     beta   bf16 [len][H]
 * With len 0 every tensor is ignored (the sequence only checks expect_pos,
 * or with FRESH zeroes the slot).
 */
typedef struct kdac_seq {
    uint64_t slot;        /* slot handle */
    uint32_t len;         /* tokens */
    uint32_t flags;       /* KDAC_SEQ_* (FRESH and EXPECT_POS exclude each other) */
    uint64_t expect_pos;  /* with KDAC_SEQ_EXPECT_POS */
    kdac_tensor q, k, v, g, beta;
    kdac_output out;
} kdac_seq;

/*
 * Runs one prefill of nseqs sequences (1..max_seqs_per_request, at most
 * max_batch_tokens tokens in all, each slot once) with the weights of
 * `layer`, in one device launch: all of it applies or none.  Inline outputs
 * are copied to seqs[i].out.data before it returns.  res (may be NULL)
 * receives the slots' new positions and the daemon's timings.
 * Errors: INVALID_PARAMS (caught before sending, naming the field),
 * LIMIT_EXCEEDED (inline bytes or tokens over the limits), UNKNOWN_LAYER,
 * UNKNOWN_SLOT, STALE_SLOT, PERMISSION_DENIED, POSITION_MISMATCH,
 * STATE_LOST, REGION_INVALID, REGION_BOUNDS, BUSY, DEVICE_FAILED, and the
 * connection errors.
 */
KDAC_EXPORT int kdac_prefill(kdac_client *c, const char *layer, const kdac_seq *seqs,
                             uint32_t nseqs, kdac_prefill_result *res, kdac_error *err);
/* The non-blocking form: queues the request (seqs is copied; the tensor
 * memory it names is not) and returns; cb gets u.prefill. */
KDAC_EXPORT int kdac_prefill_send(kdac_client *c, const char *layer, const kdac_seq *seqs,
                                  uint32_t nseqs, kdac_cb cb, void *data, kdac_error *err);

/* ------------------------------------------------------------------------ */
/* Stream-ordered prefills (PROTOCOL.md §Stream-ordered requests)             */
/* ------------------------------------------------------------------------ */

/*
 * A semaphore: a 64-bit word at `offset` (a multiple of 8) of a region
 * registered on this connection, and a value in [1, KDAC_SEM_VALUE_MAX].
 * ready: the daemon runs the request once the word (unsigned) is >= value.
 * done: the daemon stores value once the request's outputs and states are
 * written, or value | KDAC_SEM_FAILED when it failed; a wait for >= value is
 * released either way.  `host` is the word's address in this process when
 * the CPU can reach it (a kdac_shm mapping + offset), else NULL; `dev` its
 * device address for the caller's CUDA stream (kdac_shm_map_device, or
 * device memory), 0 when no stream uses it.
 */
typedef struct kdac_sem {
    uint32_t region;
    uint64_t offset;
    uint64_t value;
    void *host;
    uint64_t dev;
} kdac_sem;

/* Bit 62: a stream's cuStreamWaitValue64 GEQ compares cyclically ((int64_t)(word - value) >= 0),
 * so value | KDAC_SEM_FAILED releases it, where value | 2^63 would not. */
#define KDAC_SEM_FAILED (1ull << 62)           /* set in a done word: the request failed */
#define KDAC_SEM_VALUE_MAX (KDAC_SEM_FAILED - 1)
#define KDAC_FEATURE_SEMAPHORES "prefill.semaphores" /* in kdac_server_info.features */

/*
 * kdac_prefill_send with a ready and/or a done semaphore (either may be
 * NULL; both NULL is kdac_prefill_send).  The request may be sent before its
 * inputs exist: the daemon runs it once the ready word reaches its value
 * (READY_TIMEOUT after the daemon's bound).  Whenever the request completes
 * with an error of any kind - the daemon's, a lost connection (the library
 * notices it when it next reads the socket: keep the client's fd in your
 * event loop or call kdac_client_progress), kdac_client_close - the library
 * stores done->value | KDAC_SEM_FAILED in the done word itself before the
 * callback runs (host: a release store; device only: through the CUDA
 * driver, loaded at run time), so nothing waits on it forever.  Keep the
 * words' memory mapped (and the semaphores' host addresses valid) until the
 * request completes.
 * Errors: NOT_SUPPORTED (the daemon lacks the feature), INVALID_PARAMS, and
 * those of kdac_prefill_send.
 */
KDAC_EXPORT int kdac_prefill_send_sems(kdac_client *c, const char *layer, const kdac_seq *seqs,
                                       uint32_t nseqs, const kdac_sem *ready,
                                       const kdac_sem *done, kdac_cb cb, void *data,
                                       kdac_error *err);

/*
 * The stream form: on `stream` (a cudaStream_t / CUstream of the calling
 * thread's current context) enqueues the store of ready->value into the
 * ready word (cuStreamWriteValue64), sends the request without waiting, and
 * enqueues a wait for the done word to reach done->value
 * (cuStreamWaitValue64, GEQ).  Work enqueued on the stream before the call
 * produces the inputs; work enqueued after it may consume the outputs.  Both
 * semaphores need `dev`.  The host never waits: the response arrives later
 * through cb (read it with kdac_client_progress or your event loop), and
 * every failure releases the stream with the failure value (see above), so
 * check the callback's status, or the done word, before trusting outputs.
 * The library links no CUDA: it loads libcuda.so.1 at the first call.
 * Errors: NOT_SUPPORTED (no CUDA driver, or the daemon lacks the feature),
 * INVALID_ARGUMENT (a semaphore without dev), DEVICE_FAILED (the driver
 * refused an enqueue: nothing was sent), and those of kdac_prefill_send.
 */
KDAC_EXPORT int kdac_prefill_on_stream(kdac_client *c, void *stream, const char *layer,
                                       const kdac_seq *seqs, uint32_t nseqs,
                                       const kdac_sem *ready, const kdac_sem *done, kdac_cb cb,
                                       void *data, kdac_error *err);

/* A host done word's state: 0 while below value, 1 reached, -1 reached with
 * KDAC_SEM_FAILED (the request failed).  An acquire load: outputs are
 * visible after 1. */
KDAC_EXPORT int kdac_sem_check(const kdac_sem *done);
/* ------------------------------------------------------------------------ */
/* Decode steps                                                              */
/* ------------------------------------------------------------------------ */

#define KDAC_STEP_MAX_TOKENS 16 /* tokens per sequence of a step */

/*
 * One decode step (PROTOCOL.md §step): nseqs sequences of lens[i] tokens
 * each, continuing the states in slots[i], their tokens back to back in one
 * tensor per input (T = the sum of lens):
 *   q, k, v, g, out   bf16 [T][H][128]     beta   bf16 [T][H]
 *   states            the pool's dtype [T][H][128][128], region only: the state
 *                     after every token (for rolling back a speculative draft)
 * Only daemons that list the feature "step" in hello serve it.
 */
typedef struct kdac_step_request {
    uint32_t nseqs;               /* 1..max_seqs_per_request */
    const uint64_t *slots;        /* [nseqs] slot handles, each once */
    const uint8_t *lens;          /* [nseqs] tokens, each 1..KDAC_STEP_MAX_TOKENS */
    const uint64_t *expect_pos;   /* NULL, or [nseqs]: each slot's position must equal it */
    kdac_tensor q, k, v, g, beta;
    kdac_output out;              /* region, or inline (copied to out.data) */
    kdac_output states;           /* region, or region 0 and data NULL: not kept */
} kdac_step_request;

/*
 * Runs one step with the weights of `layer` in one device launch: all of it
 * applies or none.  The lists are copied before it returns (the send form
 * too); tensor memory must stay as for kdac_prefill.  res (may be NULL)
 * receives the new positions and the timings.  Errors: as kdac_prefill, and
 * UNKNOWN_METHOD from a daemon without the feature.
 */
KDAC_EXPORT int kdac_step(kdac_client *c, const char *layer, const kdac_step_request *step,
                          kdac_step_result *res, kdac_error *err);
/* The non-blocking form; cb gets u.step. */
KDAC_EXPORT int kdac_step_send(kdac_client *c, const char *layer, const kdac_step_request *step, kdac_cb cb,
                               void *data, kdac_error *err);

/* ------------------------------------------------------------------------ */
/* Slots                                                                     */
/* ------------------------------------------------------------------------ */

/* kdac_slot_alloc flags */
#define KDAC_SLOT_ALLOC_EMPTY 0x1u /* leave the slots "empty" instead of zeroing them (for
                                      slots about to be written, forked into or prefilled
                                      FRESH) */

/*
 * Allocates `count` slots (all or none) into slots[count]: each "ready" with
 * a zero state at position 0, or "empty" with KDAC_SLOT_ALLOC_EMPTY.
 * Errors: POOL_FULL (retryable), QUOTA_EXCEEDED, INVALID_PARAMS.
 */
KDAC_EXPORT int kdac_slot_alloc(kdac_client *c, uint32_t count, unsigned flags, uint64_t *slots,
                                kdac_error *err);
KDAC_EXPORT int kdac_slot_alloc_send(kdac_client *c, uint32_t count, unsigned flags, kdac_cb cb,
                                     void *data, kdac_error *err);

/* Frees n slots (all checked before any is freed); their handles go stale.
 * Errors: UNKNOWN_SLOT, STALE_SLOT, PERMISSION_DENIED, INVALID_PARAMS. */
KDAC_EXPORT int kdac_slot_free(kdac_client *c, const uint64_t *slots, uint32_t n,
                               kdac_error *err);
KDAC_EXPORT int kdac_slot_free_send(kdac_client *c, const uint64_t *slots, uint32_t n,
                                    kdac_cb cb, void *data, kdac_error *err);

/* Resets n slots to a zero state at position 0.  Errors: as kdac_slot_free. */
KDAC_EXPORT int kdac_slot_reset(kdac_client *c, const uint64_t *slots, uint32_t n,
                                kdac_error *err);
KDAC_EXPORT int kdac_slot_reset_send(kdac_client *c, const uint64_t *slots, uint32_t n,
                                     kdac_cb cb, void *data, kdac_error *err);

/*
 * Copies src's state and position into dst, or into a newly allocated slot
 * when dst is 0.  *slot (may be NULL) receives the destination, *pos its
 * position.  Errors: handle errors, STATE_LOST (src not ready), POOL_FULL,
 * QUOTA_EXCEEDED.
 */
KDAC_EXPORT int kdac_slot_fork(kdac_client *c, uint64_t src, uint64_t dst, uint64_t *slot,
                               uint64_t *pos, kdac_error *err);
KDAC_EXPORT int kdac_slot_fork_send(kdac_client *c, uint64_t src, uint64_t dst, kdac_cb cb,
                                    void *data, kdac_error *err);

/*
 * Snapshot of a slot's state [H][128][128] (V-major) in `dtype` into `out`:
 * a region range, or an inline buffer of kdac_state_bytes(H, dtype) bytes.
 * *pos (may be NULL) receives the slot's position.  Errors: handle errors,
 * STATE_LOST, LIMIT_EXCEEDED (inline state over max_inline_bytes), region
 * errors.
 */
KDAC_EXPORT int kdac_slot_read(kdac_client *c, uint64_t slot, kdac_dtype dtype, kdac_output out,
                               uint64_t *pos, kdac_error *err);
KDAC_EXPORT int kdac_slot_read_send(kdac_client *c, uint64_t slot, kdac_dtype dtype,
                                    kdac_output out, kdac_cb cb, void *data, kdac_error *err);

/* Restores a state ([H][128][128] in dtype, inline or from a region) and
 * a position into a slot, which becomes "ready".  Errors: handle errors,
 * LIMIT_EXCEEDED, region errors. */
KDAC_EXPORT int kdac_slot_write(kdac_client *c, uint64_t slot, uint64_t pos, kdac_dtype dtype,
                                kdac_tensor state, kdac_error *err);
KDAC_EXPORT int kdac_slot_write_send(kdac_client *c, uint64_t slot, uint64_t pos,
                                     kdac_dtype dtype, kdac_tensor state, kdac_cb cb, void *data,
                                     kdac_error *err);

/* Position, status and queue of n slots, or of every slot this client owns
 * when n is 0 (slots may then be NULL).  Answered without waiting for
 * queued work.  Errors: handle errors. */
KDAC_EXPORT int kdac_slot_info(kdac_client *c, const uint64_t *slots, uint32_t n,
                               kdac_slot_info_result *res, kdac_error *err);
KDAC_EXPORT int kdac_slot_info_send(kdac_client *c, const uint64_t *slots, uint32_t n,
                                    kdac_cb cb, void *data, kdac_error *err);

/* ------------------------------------------------------------------------ */
/* Health and statistics                                                     */
/* ------------------------------------------------------------------------ */

KDAC_EXPORT int kdac_health(kdac_client *c, kdac_health_info *res, kdac_error *err);
KDAC_EXPORT int kdac_health_send(kdac_client *c, kdac_cb cb, void *data, kdac_error *err);

typedef struct kdac_counter {
    char name[KDAC_NAME_MAX + 1];
    uint64_t value;
} kdac_counter;

/* One phase of a batch ("form", "stage", "launch", "wait", "notice",
 * "unstage", "reply", "total", "device", "kernel", "host"). */
typedef struct kdac_phase {
    char name[KDAC_NAME_MAX + 1];
    uint64_t p50_us, p90_us, p99_us, sum_us;
} kdac_phase;

/* transports indices of kdac_stats_info.bytes_in / bytes_out */
#define KDAC_TRANSPORT_ID_INLINE 0
#define KDAC_TRANSPORT_ID_SHM 1
#define KDAC_TRANSPORT_ID_CUDA_IPC 2

/* The daemon's counters since it started (all connections). */
typedef struct kdac_stats_info {
    uint64_t uptime_us;
    uint32_t connections;         /* open now */
    uint64_t connections_total;   /* accepted since start */
    uint64_t requests;            /* answered, every method */
    uint64_t batches;             /* device launches */
    uint64_t batches_held;        /* of those, held while the device was busy */
    uint64_t batches_gathered;    /* ... gathered on an idle device for a fuller wave */
    uint64_t seqs, tokens;        /* prefilled */
    /* prefill latency, frame arrival to response queued, in microseconds */
    uint64_t latency_count, latency_p50_us, latency_p90_us, latency_p99_us, latency_max_us;
    uint32_t latency_nbounds;                             /* 0..KDAC_HIST_MAX_BUCKETS */
    uint64_t latency_bounds_us[KDAC_HIST_MAX_BUCKETS];    /* bucket upper bounds */
    uint64_t latency_counts[KDAC_HIST_MAX_BUCKETS + 1];   /* nbounds + 1 (last: above all) */
    uint32_t slots_total, slots_used, slots_lost;
    uint32_t layers, regions;
    uint32_t rings;                                       /* connections on a frame ring now */
    uint64_t ring_doorbells;                              /* rung to ring clients that slept */
    uint32_t nerrors;                                     /* errors answered, by name */
    kdac_counter errors[KDAC_STATS_MAX_COUNTERS];
    uint32_t ndisconnects;                                /* connections closed, by reason */
    kdac_counter disconnects[KDAC_STATS_MAX_COUNTERS];
    uint64_t bytes_in[3], bytes_out[3];                   /* tensor bytes, by KDAC_TRANSPORT_ID_* */
    /* Per-batch timing by phase (docs/daemon.md, Observability): quantiles over
     * the daemon's recent batches and sums since start, microseconds; nphases is
     * 0 from a daemon that does not report them. */
    uint64_t batch_count;                                 /* batches timed (the sums' count) */
    uint32_t batch_window;                                /* batches the quantiles cover */
    uint32_t nphases;
    kdac_phase phases[KDAC_STATS_MAX_PHASES];
} kdac_stats_info;

KDAC_EXPORT int kdac_stats(kdac_client *c, kdac_stats_info *res, kdac_error *err);

/* Bytes clients make the daemon hold, by kind. */
typedef struct kdac_held {
    uint64_t inflight_bytes; /* request frames not answered yet, those still arriving too */
    uint64_t partial_bytes;  /* of which frames still arriving */
    uint64_t output_bytes;   /* responses not read yet */
    uint64_t region_bytes;   /* regions mapped */
} kdac_held;

/* What the caller's uid and all clients make the daemon hold, against the
 * bounds (a stats answer, kdac_stats_usage). */
typedef struct kdac_usage_info {
    bool has_uid;             /* uid, layers, slots (false from daemons before them) */
    uint32_t uid;             /* the caller's uid, as the daemon sees it */
    uint32_t layers, slots;   /* held by the uid, against bounds.max_*_per_uid */
    bool has_uid_held;        /* connections and held (false from daemons before them) */
    uint32_t connections;     /* the uid's open connections */
    kdac_held held;           /* what the uid holds, this stats request's bytes among them */
    bool has_clients;         /* the fields below (false from daemons before them) */
    kdac_held total;          /* what all clients hold */
    kdac_held peak;           /* the most all clients held since the daemon started */
    uint64_t stalled;         /* connections closed for a stalled frame or output */
    uint64_t refused;         /* connections refused: max_connections or a per-uid quota */
    kdac_bounds bounds;       /* the bounds in force (max_*_per_uid of layers and slots: as
                                 hello told) */
    bool has_memory;          /* memory (false from daemons before it) */
    kdac_memory memory;       /* the daemon's memory by use now */
} kdac_usage_info;

/*
 * kdac_stats, and the usage against the bounds in usage.  res or usage may be
 * NULL (not filled).  usage_size is sizeof(kdac_usage_info) as the caller
 * compiled it: the library writes no further, so that the struct may grow.
 * Errors: those of kdac_stats; INVALID_ARGUMENT when both are NULL.
 */
KDAC_EXPORT int kdac_stats_usage(kdac_client *c, kdac_stats_info *res, kdac_usage_info *usage,
                                 size_t usage_size, kdac_error *err);

/*
 * The same counters in the Prometheus text exposition format (0.0.4), as the
 * daemon renders them for its metrics file (metrics.prometheus_file), with
 * HELP and TYPE lines.  On success *text is a NUL-terminated string the caller
 * releases with free(); on failure it is NULL.  Errors: NOT_SUPPORTED when
 * the daemon does not announce the "stats.prometheus" feature in hello,
 * INVALID_ARGUMENT, and those of kdac_stats.
 */
KDAC_EXPORT int kdac_stats_prometheus(kdac_client *c, char **text, kdac_error *err);

/* ------------------------------------------------------------------------ */
/* Layers (blocking only: they are set up once)                              */
/* ------------------------------------------------------------------------ */

/* A layer's weights and constants; the arrays are the daemon's H long. */
typedef struct kdac_layer {
    const char *name;    /* 1..64 bytes of [A-Za-z0-9._:/-] */
    const float *A_log;  /* [H], finite */
    const float *dt_bias; /* [H][128], finite */
    float lower_bound;   /* gate floor, in [-5, 0) */
    float scale;         /* output scale; KDAC_DEFAULT_SCALE is 1/sqrt(128) */
} kdac_layer;

/*
 * Registers a named layer for the caller's uid (each uid names its own
 * layers; configuration layers are everyone's).  *created (may be NULL) is
 * false when an identical layer of that name already existed (so many
 * processes can register the same layer without coordinating).  Each
 * success takes one registration, which kdac_layer_drop gives back.
 * Errors: LAYER_EXISTS (same name, other content), QUOTA_EXCEEDED
 * (max_layers or max_layers_per_uid), INVALID_PARAMS.
 */
KDAC_EXPORT int kdac_layer_register(kdac_client *c, const kdac_layer *layer, bool *created,
                                    kdac_error *err);

typedef struct kdac_layer_info {
    char name[KDAC_NAME_MAX + 1];
    float lower_bound;
    float scale;
    bool from_config; /* loaded from the daemon's configuration (cannot be dropped) */
} kdac_layer_info;

/* Lists the layers into layers[cap]; *n receives how many exist (more than
 * cap means the list was cut: call again with more room). */
KDAC_EXPORT int kdac_layer_list(kdac_client *c, kdac_layer_info *layers, uint32_t cap,
                                uint32_t *n, kdac_error *err);

/* Gives back one registration of the caller's uid's layer; the name goes
 * with the last (running requests keep its weights until they finish).
 * Errors: UNKNOWN_LAYER (the uid has no layer of that name: other uids'
 * names are their own), PERMISSION_DENIED (a configuration layer). */
KDAC_EXPORT int kdac_layer_drop(kdac_client *c, const char *name, kdac_error *err);

/* ------------------------------------------------------------------------ */
/* Regions: zero-copy memory shared with the daemon (blocking only)          */
/* ------------------------------------------------------------------------ */

/*
 * Host shared memory.  kdac_shm_create makes a memfd of `size` bytes
 * (MFD_ALLOW_SEALING, sized, sealed against shrinking and growing, as the
 * daemon requires) and maps it read-write.  `name` labels it in
 * /proc/PID/fd (NULL: "kdac").  Errors: INVALID_ARGUMENT, SYSTEM.
 */
typedef struct kdac_shm {
    int fd;        /* the memfd (close-on-exec) */
    void *base;    /* its mapping, size bytes */
    uint64_t size;
} kdac_shm;

KDAC_EXPORT int kdac_shm_create(kdac_shm *shm, uint64_t size, const char *name, kdac_error *err);
/* Unmaps and closes it (the daemon keeps its own mapping while registered). */
KDAC_EXPORT void kdac_shm_close(kdac_shm *shm);

/* Pins and maps a kdac_shm for the devices (cuMemHostRegister, DEVICEMAP)
 * in the calling thread's current CUDA context, for semaphore words that a
 * CUDA stream writes or waits on; *dev receives the device address of its
 * base.  Unmap before kdac_shm_close.  Errors: NOT_SUPPORTED (no CUDA
 * driver), DEVICE_FAILED (the driver refused). */
KDAC_EXPORT int kdac_shm_map_device(kdac_shm *shm, uint64_t *dev, kdac_error *err);
KDAC_EXPORT void kdac_shm_unmap_device(kdac_shm *shm);

/*
 * Registers [0, size) of a sealed memfd as a region of this connection:
 * the descriptor travels to the daemon with SCM_RIGHTS (the caller keeps
 * its own).  *region receives the id for kdac_tensor_region /
 * kdac_output_region.  Regions die with the connection.
 * Errors: REGION_INVALID (not sealed against shrinking, smaller than size),
 * QUOTA_EXCEEDED, NOT_SUPPORTED (daemon without shm), INVALID_ARGUMENT.
 */
KDAC_EXPORT int kdac_region_register_shm(kdac_client *c, int fd, uint64_t size,
                                         uint32_t *region, kdac_error *err);

/*
 * Registers device memory with a CUDA IPC handle: ipc_handle is the 64
 * bytes of a cudaIpcMemHandle_t from cudaIpcGetMemHandle on a cudaMalloc
 * allocation; the region is the first `size` bytes of that allocation.
 * device is the GPU's UUID as the daemon reports it (NULL: the daemon's own
 * GPU, kdac_client_info()->gpu_uuid).  The library itself needs no CUDA.
 * Ordering: finish writing the inputs (cudaStreamSynchronize) before
 * sending a request that names them; outputs are complete when it completes.
 * Size the allocation in multiples of 2 MiB: on the H200 the kernel reads an
 * IPC allocation whose size is not a multiple of 64 KiB 13-24% slower.
 * Errors: NOT_SUPPORTED (CPU backend), REGION_INVALID (other GPU, handle
 * cannot be opened, size beyond the allocation), QUOTA_EXCEEDED.
 */
KDAC_EXPORT int kdac_region_register_cuda(kdac_client *c, const void *ipc_handle, uint64_t size,
                                          const char *device, uint32_t *region, kdac_error *err);

/* The same for a VMM allocation exported as a POSIX file descriptor
 * (cuMemExportToShareableHandle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
 * the fd travels with SCM_RIGHTS. */
KDAC_EXPORT int kdac_region_register_cuda_fd(kdac_client *c, int fd, uint64_t size,
                                             const char *device, uint32_t *region,
                                             kdac_error *err);

/* Releases a region once no request uses it.  Errors: REGION_INVALID. */
KDAC_EXPORT int kdac_region_release(kdac_client *c, uint32_t region, kdac_error *err);

/*
 * The frame ring (PROTOCOL.md §Frame ring): moves this connection's frames,
 * both ways, from the socket into a shared memory ring of bytes_per_direction
 * bytes each way (0: 1 MiB; else a power of two in [4 KiB, 1 GiB]).  The
 * socket then carries one-byte doorbells only, and only to a side that said
 * it sleeps: a client that spins (kdac_client_set_spin) while kdad's loop is
 * awake exchanges requests and answers without a system call.  Everything
 * else stays the same: the calls, event-loop integration through
 * kdac_client_fd / kdac_client_events / kdac_client_progress, regions and
 * their descriptors.  Frames larger than the ring stream through it.  The
 * ring takes one region of the connection's quota and lasts as long as the
 * connection.  Call it with no request in flight.
 * Errors: INVALID_ARGUMENT (requests in flight, a ring already), NOT_SUPPORTED
 * (daemon without shm regions, or older than the ring: UNKNOWN_METHOD),
 * QUOTA_EXCEEDED, SYSTEM.
 */
KDAC_EXPORT int kdac_ring_attach(kdac_client *c, uint64_t bytes_per_direction, kdac_error *err);

/* ------------------------------------------------------------------------ */
/* Head-sharded clients: one kdad per GPU, a layer's heads split across them */
/* ------------------------------------------------------------------------ */

/*
 * Tensor parallelism splits a layer's H heads across N ranks, one kdad per
 * GPU (kdad@N.service).  A kdac_shard holds one connection per rank; rank r's
 * daemon serves the heads [first_r, first_r + H_r), H_r being the heads its
 * hello announces and first_r the sum of the ranks' heads before it (N equal
 * daemons of H/N heads: rank r has [r*H/N, (r+1)*H/N)).  H is the sum.
 *
 * A sharded call gives every rank its slice of the heads, sends to all ranks
 * before it waits for any, and drives all connections from one poll(2) loop,
 * so the daemons work concurrently; results are assembled as [.., H, ..].
 * Each head's recurrence reads and writes that head alone, so a sharded
 * prefill equals one daemon serving all H heads, bit for bit when the daemons
 * run the same backend and kernel.
 *
 * A sharded slot is one handle per rank: uint64_t[nranks], rank r's at [r].
 * Tensors are host memory (inline); calls are blocking (bounded by the
 * options' timeout_ms, after which a late rank's connection is closed).  A
 * kdac_shard is used from one thread, as a kdac_client is.
 *
 * Failures name the rank and its socket ("rank 1 (/run/kdad/kdad-1.sock):
 * ...").  Calls check every connection before sending anything.  Setting up
 * is all or none (open, layer registration, slot allocation undo what they
 * did on the other ranks).  A prefill or slot write that one rank refuses
 * after others applied it cannot be undone: the error says which ranks
 * applied it, is not retryable, and rank_status tells each rank's outcome;
 * positions that then differ between ranks are reported by every later read
 * or prefill of that slot (POSITION_MISMATCH).  KDAC_SEQ_EXPECT_POS guards a
 * prefill against slots out of step.
 */
typedef struct kdac_shard kdac_shard;

#define KDAC_SHARD_MAX_RANKS 64

/*
 * Connects to nranks daemons, paths[r] being rank r's socket (e.g. from
 * kdac_socket_for_gpu), each with opts (NULL: defaults; its socket_path is
 * ignored).  Errors: those of kdac_client_open, naming the rank;
 * INVALID_ARGUMENT (two paths reach the same daemon, nranks out of 1..64).
 */
KDAC_EXPORT int kdac_shard_open(kdac_shard **out, const char *const *paths, uint32_t nranks,
                                const kdac_options *opts, kdac_error *err);
/* Closes every connection (their slots are freed unless they persist). NULL: no-op. */
KDAC_EXPORT void kdac_shard_close(kdac_shard *s);
KDAC_EXPORT uint32_t kdac_shard_nranks(const kdac_shard *s);
/* H: all ranks' heads together. */
KDAC_EXPORT uint32_t kdac_shard_heads(const kdac_shard *s);
/* The first head rank serves (its count: kdac_client_info(kdac_shard_client(s, rank))->heads). */
KDAC_EXPORT uint32_t kdac_shard_first_head(const kdac_shard *s, uint32_t rank);
/* Rank's own connection, for per-rank calls (stats, slot.info); NULL after a timeout closed it. */
KDAC_EXPORT kdac_client *kdac_shard_client(const kdac_shard *s, uint32_t rank);

/*
 * Registers a layer of all H heads (A_log [H], dt_bias [H][128]) on every
 * rank, each with its heads' slice, under the same name: one registration
 * per rank, as kdac_layer_register takes.  All or none: when a rank refuses,
 * the ranks before it give back the registration this call took.
 */
KDAC_EXPORT int kdac_shard_layer_register(kdac_shard *s, const kdac_layer *layer,
                                          kdac_error *err);
/* Gives back one registration of the layer on every rank (kdac_layer_drop on
 * each; all are tried, the first failure is reported, naming its rank). */
KDAC_EXPORT int kdac_shard_layer_drop(kdac_shard *s, const char *name, kdac_error *err);

/*
 * Allocates `count` sharded slots into slots[count * nranks] (slot i's
 * handles at slots[i * nranks ..]), flags as kdac_slot_alloc.  All or none.
 */
KDAC_EXPORT int kdac_shard_slot_alloc(kdac_shard *s, uint32_t count, unsigned flags,
                                      uint64_t *slots, kdac_error *err);
/* Frees `count` sharded slots laid out as kdac_shard_slot_alloc fills them. */
KDAC_EXPORT int kdac_shard_slot_free(kdac_shard *s, const uint64_t *slots, uint32_t count,
                                     kdac_error *err);
/*
 * A sharded slot's state, assembled: [H][128][128] in dtype
 * (kdac_state_bytes(H, dtype) bytes), each rank's heads read straight into
 * their place.  *pos (may be NULL): the position, which every rank must
 * share (else POSITION_MISMATCH naming them).
 */
KDAC_EXPORT int kdac_shard_slot_read(kdac_shard *s, const uint64_t *slot, kdac_dtype dtype,
                                     void *state, uint64_t *pos, kdac_error *err);
/* Restores an assembled state [H][128][128] and a position into a sharded slot. */
KDAC_EXPORT int kdac_shard_slot_write(kdac_shard *s, const uint64_t *slot, uint64_t pos,
                                      kdac_dtype dtype, const void *state, kdac_error *err);

/* One sequence of a sharded prefill: host tensors of all H heads. */
typedef struct kdac_shard_seq {
    const uint64_t *slot;  /* a sharded slot: [nranks] handles */
    uint32_t len;          /* tokens */
    uint32_t flags;        /* KDAC_SEQ_* */
    uint64_t expect_pos;   /* with KDAC_SEQ_EXPECT_POS */
    const void *q, *k, *v, *g; /* bf16 [len][H][128] */
    const void *beta;          /* bf16 [len][H] */
    void *out;                 /* bf16 [len][H][128], or NULL to discard */
} kdac_shard_seq;

/*
 * A prefill of nseqs sequences, every rank given its heads' slices (copied
 * out of the [len][H][..] tensors), run concurrently, the outputs gathered
 * into seqs[i].out as each rank answers.  pos[nseqs] (may be NULL) receives
 * the slots' new positions; rank_status[nranks] (may be NULL) each rank's
 * outcome: 0 applied, else its error code (every entry the call's code when
 * nothing was sent).  Errors: those of kdac_prefill, naming the first rank
 * that failed (see above for ranks that applied it).
 */
KDAC_EXPORT int kdac_shard_prefill(kdac_shard *s, const char *layer, const kdac_shard_seq *seqs,
                                   uint32_t nseqs, uint64_t *pos, int *rank_status,
                                   kdac_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KDACLIENT_H */
