/*
 * kdaproto.h - the kdad wire protocol: constants, limits, the error and
 * method tables, framing, and one C struct with an encoder and a decoder for
 * every message.  The daemon and libkdaclient both use this codec, so the
 * two sides cannot disagree about a message.  The spec is PROTOCOL.md beside
 * this file; "§Name" below refers to its section of that name.
 *
 * Roles:
 *   daemon  kp_reader (bytes -> frames), kp_msg_decode (frame -> envelope),
 *           kp_<method>_params_decode, kp_<method>_result_encode,
 *           kp_error_response_encode, kp_goodbye_encode.
 *   client  kp_<method>_params_encode, kp_reader, kp_msg_decode,
 *           kp_<method>_result_decode, kp_response_error_decode,
 *           kp_goodbye_decode.
 *
 * Conventions:
 *   - Functions return 0 (KP_OK) or a negative kp_code, and fill a kp_error
 *     (code + one sentence naming the offending field) when one is passed.
 *   - Decoded data points into the frame body or into the kp_msg's zone: it
 *     lives until kp_msg_close, and the frame body must outlive the kp_msg.
 *     Strings are copied into the zone and NUL-terminated.  Inline tensors
 *     are NOT copied and have no alignment guarantee.
 *   - Encoders reference inline tensor bytes instead of copying them
 *     (kp_writer): the caller keeps them alive and unchanged until the frame
 *     has been written out.
 *   - Decoders of requests reject unknown fields; decoders of results ignore
 *     them (a newer daemon may add result fields; §Versioning).
 *   - No global state: distinct readers, writers and messages may be used
 *     from distinct threads without locking.
 *
 * No I/O happens here: the transport (libuv in the daemon, whatever loop the
 * client uses) moves bytes and file descriptors; this codec turns bytes into
 * messages and back.
 */
#ifndef KDAPROTO_H
#define KDAPROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include <msgpack.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Protocol constants (fixed by protocol version 1; not configurable)        */
/* ------------------------------------------------------------------------ */

#define KP_PROTOCOL_VERSION 1        /* the one version this codec speaks */
#define KP_HEAD_DIM 128              /* D = K = V; equals KDA_HEAD_DIM in kernels/kda.h */
#define KP_MAX_HEADS 128             /* H; equals KDA_MAX_HEADS */
#define KP_FRAME_HEADER_BYTES 4      /* big-endian u32 body length */
#define KP_HELLO_MAX_FRAME_BYTES 65536u /* frame cap, both ways, until hello succeeds */
#define KP_MAX_DEPTH 16              /* containers nested in one frame */
#define KP_MAX_OBJECTS 262144u       /* msgpack objects in one frame (bounds unpack memory) */
#define KP_MAX_VERSIONS 16           /* entries in hello.versions */
#define KP_NAME_MAX 64               /* layer names, bytes */
#define KP_TEXT_MAX 256              /* free-text strings (client, server, GPU name), bytes */
#define KP_ERRMSG_MAX 512            /* error messages, bytes including the NUL */
#define KP_CUDA_IPC_HANDLE_BYTES 64  /* sizeof(cudaIpcMemHandle_t) */
#define KP_TENSOR_ALIGN 16           /* region offsets are multiples of this (16-byte vector loads) */
#define KP_HIST_MAX_BUCKETS 64       /* latency histogram bounds in stats */
#define KP_MAX_PENDING_FDS 4         /* received fds not yet claimed by a frame, per connection */

/* Hard ceilings on configurable limits: they keep every legal message under
 * KP_MAX_OBJECTS (a prefill sequence is at most 45 objects, a slot.info entry
 * 9) and the frame length inside its u32 prefix. */
#define KP_MAX_FRAME_BYTES_CEILING 0xffffffffu
#define KP_MAX_SEQS_PER_REQUEST_CEILING 4096u
#define KP_MAX_SLOTS_PER_CLIENT_CEILING 16384u

/* ------------------------------------------------------------------------ */
/* Named defaults of the limits announced in hello (config overrides them)   */
/* ------------------------------------------------------------------------ */

#define KP_DEFAULT_MAX_FRAME_BYTES (256u << 20)      /* one frame, either direction */
#define KP_DEFAULT_MAX_INLINE_BYTES (240u << 20)     /* inline tensor bytes per request or result */
#define KP_DEFAULT_MAX_BATCH_TOKENS 65536u           /* tokens per launch, so per request */
#define KP_DEFAULT_MAX_BATCH_SEQS 256u               /* sequences per launch */
#define KP_DEFAULT_MAX_SEQS_PER_REQUEST 256u         /* sequences per prefill request */
#define KP_DEFAULT_MAX_SLOTS_PER_CLIENT 1024u        /* slots one owner may hold */
#define KP_DEFAULT_MAX_REGIONS_PER_CLIENT 64u        /* regions one connection may hold */
#define KP_DEFAULT_MAX_INFLIGHT_REQUESTS 256u        /* unanswered requests per connection */
#define KP_DEFAULT_MAX_INFLIGHT_BYTES (1ull << 30)   /* frame bytes held for unanswered requests */
#define KP_DEFAULT_MAX_LAYERS 256u                   /* layers in the daemon */
#define KP_DEFAULT_MAX_LAYERS_PER_UID 128u           /* client layers of one uid */

/* ------------------------------------------------------------------------ */
/* Errors (§Errors).  ONE table: enum values, names, default messages, the   */
/* retryable flag and whether the daemon closes the connection after it.     */
/* Codes are negative on the wire and in C alike.  PROTOCOL.md's table is    */
/* checked against this one by tests/test_proto_errors.c.                    */
/* ------------------------------------------------------------------------ */

/*  X(NAME, code, retryable, closes, default message) */
#define KP_ERRORS(X)                                                                         \
    X(PROTOCOL, -1, false, true, "malformed frame or message")                              \
    X(FRAME_TOO_LARGE, -2, false, true, "frame larger than the cap in force")               \
    X(UNSUPPORTED_VERSION, -3, false, true, "no protocol version in common")                \
    X(HELLO_REQUIRED, -4, false, false, "hello must succeed before any other request")      \
    X(UNKNOWN_METHOD, -10, false, false, "unknown method")                                  \
    X(INVALID_PARAMS, -11, false, false, "invalid params: wrong field, type, shape or value") \
    X(LIMIT_EXCEEDED, -12, false, false, "request exceeds a limit announced in hello")      \
    X(UNKNOWN_LAYER, -13, false, false, "no layer with this name")                          \
    X(LAYER_EXISTS, -14, false, false, "a different layer with this name exists")           \
    X(UNKNOWN_SLOT, -15, false, false, "no such slot")                                      \
    X(STALE_SLOT, -16, false, false, "slot handle is stale: the slot was freed")            \
    X(POSITION_MISMATCH, -17, false, false, "slot position differs from expect_pos")        \
    X(STATE_LOST, -18, false, false, "slot has no valid state")                             \
    X(REGION_INVALID, -19, false, false, "region unknown, released or unusable")            \
    X(REGION_BOUNDS, -20, false, false, "reference reaches outside its region")             \
    X(PERMISSION_DENIED, -21, false, false, "operation not permitted to this client")       \
    X(NOT_SUPPORTED, -22, false, false, "not supported by this daemon")                     \
    X(READY_TIMEOUT, -23, false, false, "the ready word did not reach its value in time")   \
    X(POOL_FULL, -30, true, false, "no free slot in the pool")                              \
    X(QUOTA_EXCEEDED, -31, false, false, "per-client quota exceeded")                       \
    X(BUSY, -32, true, false, "daemon overloaded; retry later")                             \
    X(SHUTTING_DOWN, -33, true, false, "daemon is shutting down")                           \
    X(DEVICE_FAILED, -40, false, false, "backend or device failure")                        \
    X(NO_MEMORY, -41, true, false, "out of memory")                                         \
    X(INTERNAL, -42, false, false, "internal error")

typedef enum kp_code {
    KP_OK = 0,
#define KP_ENUM_ENTRY(name, code, retryable, closes, message) KP_E_##name = code,
    KP_ERRORS(KP_ENUM_ENTRY)
#undef KP_ENUM_ENTRY
} kp_code;

/* Error detail: filled by every call that can fail, and by the decoders of a
 * remote error (error response, goodbye). */
typedef struct kp_error {
    int code;                    /* KP_OK or a kp_code (a newer daemon may send others) */
    bool retryable;              /* from the table; from the wire for remote errors */
    char message[KP_ERRMSG_MAX]; /* one sentence, naming the field where there is one */
} kp_error;

/* Table lookups.  Unknown codes: name "UNKNOWN_CODE", message "unknown error
 * code", not retryable, not closing. */
const char *kp_code_name(int code);
const char *kp_code_message(int code);
bool kp_code_retryable(int code);
bool kp_code_closes(int code);  /* the daemon closes the connection after it */
bool kp_code_known(int code);

/* Sets err (if any) to code with a printf-style message (the table's default
 * message when fmt is NULL) and returns code. */
int kp_fail(kp_error *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ------------------------------------------------------------------------ */
/* Methods (§Methods).  X(ENUM, "wire name")                                  */
/* ------------------------------------------------------------------------ */

#define KP_METHODS(X)                                   \
    X(HELLO, "hello")                                   \
    X(HEALTH, "health")                                 \
    X(STATS, "stats")                                   \
    X(LAYER_REGISTER, "layer.register")                 \
    X(LAYER_LIST, "layer.list")                         \
    X(LAYER_DROP, "layer.drop")                         \
    X(SLOT_ALLOC, "slot.alloc")                         \
    X(SLOT_FREE, "slot.free")                           \
    X(SLOT_RESET, "slot.reset")                         \
    X(SLOT_FORK, "slot.fork")                           \
    X(SLOT_READ, "slot.read")                           \
    X(SLOT_WRITE, "slot.write")                         \
    X(SLOT_INFO, "slot.info")                           \
    X(REGION_REGISTER_SHM, "region.register_shm")       \
    X(REGION_REGISTER_CUDA, "region.register_cuda")     \
    X(REGION_RELEASE, "region.release")                 \
    X(RING_ATTACH, "ring.attach")                       \
    X(PREFILL, "prefill")                               \
    X(STEP, "step")

typedef enum kp_method {
    KP_METHOD_UNKNOWN = 0, /* a request whose method is not in the table */
#define KP_METHOD_ENTRY(id, wire) KP_METHOD_##id,
    KP_METHODS(KP_METHOD_ENTRY)
#undef KP_METHOD_ENTRY
    KP_METHOD_COUNT
} kp_method;

#define KP_NOTIFY_GOODBYE "goodbye" /* the one notification of v1 (daemon -> client) */

const char *kp_method_name(kp_method m);  /* NULL for KP_METHOD_UNKNOWN or out of range */
/* Looks a wire name up; KP_METHOD_UNKNOWN if it is not a v1 method. */
kp_method kp_method_lookup(const char *name, size_t len);

/* ------------------------------------------------------------------------ */
/* Geometry and limits (announced by hello)                                   */
/* ------------------------------------------------------------------------ */

/* Values match kda_dtype in kernels/kda.h. */
typedef enum kp_dtype {
    KP_DTYPE_BF16 = 0,
    KP_DTYPE_F32 = 1,
} kp_dtype;

const char *kp_dtype_name(kp_dtype t);  /* "bf16" | "f32" */
size_t kp_dtype_size(kp_dtype t);       /* 2 | 4 */

typedef struct kp_geometry {
    uint32_t heads;        /* H, 1..KP_MAX_HEADS */
    uint32_t head_dim;     /* always KP_HEAD_DIM */
    uint32_t slots;        /* pool size */
    kp_dtype state_dtype;  /* pool element type */
} kp_geometry;

/* What one connection, one uid and all clients together may make the daemon
 * hold (the daemon's clients.* configuration keys, named alike). */
typedef struct kp_client_bounds {
    uint32_t max_connections;                 /* connections open, all uids */
    uint32_t max_connections_per_uid;
    uint64_t max_inflight_bytes_per_uid;      /* unanswered request bytes, frames arriving too */
    uint64_t max_inflight_bytes_total;        /* the same, all uids */
    uint64_t output_hard_limit;               /* unread response bytes of one connection */
    uint64_t output_soft_limit;               /* ... tolerated output_soft_seconds */
    uint32_t output_soft_seconds;
    uint64_t max_output_bytes_per_uid;        /* unread response bytes of one uid */
    uint64_t max_output_bytes_total;          /* the same, all uids */
    uint64_t max_region_bytes_per_connection; /* mapped region bytes */
    uint64_t max_region_bytes_per_uid;
    uint32_t frame_stall_seconds;             /* a frame begun and no byte since: closed */
    uint32_t output_stall_seconds;            /* unread output and no byte taken since: closed */
} kp_client_bounds;

typedef struct kp_limits {
    uint64_t max_frame_bytes;        /* frame body cap after hello, both directions */
    uint64_t max_inline_bytes;       /* inline tensor bytes in one request, and in one result */
    uint32_t max_batch_tokens;       /* tokens per launch; a request's tokens never exceed it */
    uint32_t max_batch_seqs;         /* sequences per launch */
    uint32_t max_seqs_per_request;   /* prefill seqs per request, <= max_batch_seqs */
    uint32_t max_slots_per_client;   /* quota of slots per owner */
    uint32_t max_regions_per_client; /* quota of regions per connection */
    uint32_t max_inflight_requests;  /* unanswered requests per connection */
    uint64_t max_inflight_bytes;     /* request frame bytes held unanswered per connection */
    uint32_t max_layers;             /* layers in the daemon */
    uint32_t max_layers_per_uid;     /* client layers of one uid; 0: not announced */
    uint32_t max_slots_per_uid;      /* slots of one uid, all its owners; 0: not announced */
    /* "clients": the daemon's clients.* bounds (PROTOCOL.md, hello); has_clients
       is false from daemons before them */
    bool has_clients;
    kp_client_bounds clients;
} kp_limits;

/* Fills the named defaults above. */
void kp_limits_default(kp_limits *l);
/* Checks limits for consistency and against the ceilings (e.g. inline <= frame,
 * seqs_per_request <= batch_seqs).  Used by the daemon's config loader and by
 * the client on hello's result.  KP_E_INVALID_PARAMS names the field. */
int kp_limits_check(const kp_limits *l, kp_error *err);

/* What both ends know after hello: the daemon from its config, the client
 * from kp_hello_result.  Decoders check shapes and limits against it. */
typedef struct kp_session {
    kp_geometry geometry;
    kp_limits limits;
} kp_session;

/* Bytes of one slot's state: heads * 128 * 128 * dtype size. */
uint64_t kp_state_bytes(uint32_t heads, kp_dtype dtype);

/* Slot handle (§Slots): generation in the high 32 bits, pool index in the low. */
static inline uint64_t kp_slot_handle(uint32_t generation, uint32_t index)
{
    return ((uint64_t)generation << 32) | index;
}
static inline uint32_t kp_slot_index(uint64_t handle) { return (uint32_t)handle; }
static inline uint32_t kp_slot_generation(uint64_t handle) { return (uint32_t)(handle >> 32); }

/* ------------------------------------------------------------------------ */
/* Tensor references (§Tensors)                                              */
/* ------------------------------------------------------------------------ */

typedef enum kp_ref_kind {
    KP_REF_ABSENT = 0, /* the field was not given */
    KP_REF_INLINE = 1, /* msgpack bin: the bytes themselves */
    KP_REF_REGION = 2, /* {"region": id, "offset": bytes} into a registered region */
} kp_ref_kind;

typedef struct kp_ref {
    kp_ref_kind kind;
    const void *data;  /* INLINE: the bytes (decoded: inside the frame, unaligned) */
    uint32_t region;   /* REGION: region id */
    uint64_t offset;   /* REGION: byte offset, a multiple of KP_TENSOR_ALIGN */
    uint64_t nbytes;   /* bytes the field's shape implies (decoders set it; INLINE
                          encoders send exactly nbytes bytes of data) */
} kp_ref;

static inline kp_ref kp_ref_inline(const void *data, uint64_t nbytes)
{
    kp_ref r = {KP_REF_INLINE, data, 0, 0, nbytes};
    return r;
}
static inline kp_ref kp_ref_region(uint32_t region, uint64_t offset, uint64_t nbytes)
{
    kp_ref r = {KP_REF_REGION, NULL, region, offset, nbytes};
    return r;
}

/* Checks a REGION reference against the size of its region, overflow-safe:
 * offset + nbytes <= region_size.  field names the reference in the message
 * ("seqs[2].q").  KP_E_REGION_BOUNDS on failure; 0 for other kinds. */
int kp_ref_check_bounds(const kp_ref *ref, uint64_t region_size, const char *field,
                        kp_error *err);

/* Copies src into dst of size bytes, truncating, always NUL-terminated when
 * size > 0; returns the length written. */
size_t kp_strlcpy(char *dst, const char *src, size_t size);

/* Writes the field name "array[index]", or "array[index].member" when member
 * is not NULL, into buf of size bytes (truncated); returns buf.  Errors name
 * the field they refuse; this builds the name without printf.
 * KP_FIELD_NAME_MAX holds any of the protocol's ("seqs[4095].beta"). */
#define KP_FIELD_NAME_MAX 48
const char *kp_field_name(char *buf, size_t size, const char *array, uint32_t index,
                          const char *member);

/* ------------------------------------------------------------------------ */
/* Framing (§Frames): the resumable frame reader                             */
/* ------------------------------------------------------------------------ */

/* Reader results besides a negative kp_code (the stream is dead). */
enum {
    KP_READ_MORE = 0,  /* all input consumed; the frame is not complete yet */
    KP_READ_FRAME = 1, /* a frame is complete: take it with kp_reader_take */
};

/*
 * A state machine that cuts a byte stream into frame bodies: header (4
 * bytes), then body.  The cap is checked on the header before anything is
 * allocated, and the body buffer grows with the bytes that actually arrive
 * (a header alone cannot make it allocate the cap).  Once a reader fails it
 * stays dead: every later call returns the same code, and the connection must
 * be closed after the goodbye.
 */
typedef struct kp_reader {
    uint64_t max_frame;   /* cap on the body length, applied to headers not yet read */
    uint8_t header[KP_FRAME_HEADER_BYTES];
    uint32_t header_have; /* header bytes received */
    uint8_t *body;        /* malloc'd, body_cap bytes */
    uint64_t body_len;    /* length announced by the header */
    uint64_t body_have;   /* body bytes received */
    uint64_t body_cap;    /* bytes allocated */
    uint64_t frames;      /* frames completed, for diagnostics */
    kp_error failure;     /* code 0 while alive; else why the stream died */
} kp_reader;

void kp_reader_init(kp_reader *r, uint64_t max_frame);
/* Changes the cap (e.g. raised after hello).  Takes effect at the next header. */
void kp_reader_set_max_frame(kp_reader *r, uint64_t max_frame);
/* Frees the partial body, if any. */
void kp_reader_close(kp_reader *r);

/*
 * Copying form: consumes bytes from *data (advancing *data and *len) until a
 * frame completes or the input runs out.  Returns KP_READ_FRAME (bytes after
 * the frame stay in *data for the next call), KP_READ_MORE, or a negative
 * code: KP_E_FRAME_TOO_LARGE, KP_E_PROTOCOL (empty frame), KP_E_NO_MEMORY.
 */
int kp_reader_feed(kp_reader *r, const uint8_t **data, size_t *len, kp_error *err);

/*
 * Direct form, for reading from the socket straight into the frame (no copy
 * for large bodies): kp_reader_space gives where the next bytes belong and
 * how many fit (up to the end of the header or of the body, growing the body
 * buffer as needed); after receiving n <= that many bytes there, call
 * kp_reader_commit.  Same results as kp_reader_feed.  kp_reader_space returns
 * 0 with *buf NULL when a complete frame waits to be taken, when the reader is
 * dead, or when growing the buffer failed; kp_reader_commit(r, 0, err) then
 * says which (KP_READ_FRAME or the negative code).
 */
size_t kp_reader_space(kp_reader *r, uint8_t **buf);
int kp_reader_commit(kp_reader *r, size_t n, kp_error *err);

/* After KP_READ_FRAME: hands over the body (malloc'd; the caller frees it) and
 * readies the reader for the next frame. */
uint8_t *kp_reader_take(kp_reader *r, size_t *len);

/*
 * Pre-validation (§Pre-validation), run by kp_msg_decode before msgpack-c sees
 * the bytes: len <= max_frame; exactly one msgpack object filling the body;
 * every array/map count, plus the elements already promised by the enclosing
 * containers, within the bytes left; every str/bin length within the bytes
 * left; at most KP_MAX_DEPTH nested containers and KP_MAX_OBJECTS objects; no
 * ext types and no reserved byte 0xc1.  KP_E_PROTOCOL or KP_E_FRAME_TOO_LARGE.
 */
int kp_frame_check(const uint8_t *body, size_t len, uint64_t max_frame, kp_error *err);

/* ------------------------------------------------------------------------ */
/* Writing frames                                                            */
/* ------------------------------------------------------------------------ */

/*
 * One outgoing frame as an iovec list: the 4-byte prefix and small fields
 * are copied into the writer; inline tensors of 512 bytes or more are
 * referenced in place (msgpack_vrefbuffer), so a 700 MiB request costs no
 * copy before writev/sendmsg/uv_write.  The list may exceed IOV_MAX: write
 * it in pieces (uv_write does).  Every encoder replaces the writer's content
 * with one complete frame; reuse a writer only after its frame was written.
 */
#define KP_WRITER_PENDING 512 /* bytes of small pieces gathered before a copy into vbuf */

typedef struct kp_writer {
    msgpack_vrefbuffer vbuf;
    msgpack_packer pk;
    uint8_t pending[KP_WRITER_PENDING]; /* packed bytes not yet in vbuf */
    size_t npending;
    uint64_t max_frame;  /* body cap of the peer; larger frames fail to encode */
    uint64_t body_bytes; /* body length of the current frame */
    bool failed;         /* an allocation failed while packing */
} kp_writer;

int kp_writer_init(kp_writer *w, uint64_t max_frame);  /* KP_E_NO_MEMORY */
void kp_writer_close(kp_writer *w);
void kp_writer_set_max_frame(kp_writer *w, uint64_t max_frame);
/* The frame (prefix + body) as iovecs, valid until the next encode or close. */
const struct iovec *kp_writer_iov(const kp_writer *w, size_t *iovcnt);
/* Prefix + body length. */
uint64_t kp_writer_frame_bytes(const kp_writer *w);
/* Copies the frame into one malloc'd buffer (for small frames and tests). */
int kp_writer_flatten(const kp_writer *w, uint8_t **frame, size_t *len, kp_error *err);

/* ------------------------------------------------------------------------ */
/* Decoding the envelope (§Messages)                                         */
/* ------------------------------------------------------------------------ */

typedef enum kp_msg_kind {
    KP_MSG_REQUEST = 0,      /* [0, id, method, params] */
    KP_MSG_RESPONSE = 1,     /* [1, id, error, result] */
    KP_MSG_NOTIFICATION = 2, /* [2, method, params] */
} kp_msg_kind;

typedef struct kp_msg {
    kp_msg_kind kind;
    bool has_id;                   /* id is valid (set as soon as the envelope yields it) */
    uint32_t id;                   /* REQUEST, RESPONSE */
    kp_method method;              /* REQUEST: the method, or KP_METHOD_UNKNOWN */
    const char *name;              /* REQUEST, NOTIFICATION: method name, NUL-terminated */
    const msgpack_object *params;  /* REQUEST, NOTIFICATION: a map */
    const msgpack_object *error;   /* RESPONSE: the error map, or NULL on success */
    const msgpack_object *result;  /* RESPONSE: the result, or NULL on error */
    msgpack_unpacked unpacked;     /* owns the object tree; zone is NULL until unpacked */
} kp_msg;

void kp_msg_init(kp_msg *msg);
void kp_msg_close(kp_msg *msg);

/*
 * Checks (kp_frame_check) and unpacks one frame body, then checks the RPC
 * envelope.  msg must have been kp_msg_init'ed; whatever it held before is
 * released.  body must outlive msg.  On failure msg->has_id tells whether the
 * error can be answered on a request id, and kp_code_closes(code) whether the
 * connection must then be closed (after a goodbye); KP_E_PROTOCOL does.  A
 * request for an unknown method decodes successfully with method
 * KP_METHOD_UNKNOWN: answer it with KP_E_UNKNOWN_METHOD.
 */
int kp_msg_decode(kp_msg *msg, const void *body, size_t len, uint64_t max_frame,
                  kp_error *err);

/*
 * Whether a decoded request claims a file descriptor (§File descriptors):
 * region.register_shm always, region.register_cuda when its params hold
 * "handle_type": "posix_fd".  Decided from the envelope alone, so the
 * receiver takes the fd off its queue even when the params turn out invalid
 * (and then closes it).
 */
bool kp_msg_takes_fd(const kp_msg *msg);

/* ------------------------------------------------------------------------ */
/* Errors on the wire                                                         */
/* ------------------------------------------------------------------------ */

/* [1, id, {code, name, message, retryable}, nil]; the name and retryable flag
 * come from the table, the message from e (the default when empty). */
int kp_error_response_encode(kp_writer *w, uint32_t id, const kp_error *e, kp_error *err);
/* [2, "goodbye", {code, name, message, retryable}]: sent before the daemon
 * closes a connection (§Connection lifecycle). */
int kp_goodbye_encode(kp_writer *w, const kp_error *e, kp_error *err);
/* Decodes a response's error object into remote.  Returns 0 when it decoded
 * (remote->code is then the daemon's negative code), or KP_E_PROTOCOL. */
int kp_response_error_decode(kp_msg *msg, kp_error *remote, kp_error *err);
/* Decodes a goodbye notification into remote; KP_E_PROTOCOL if msg is not one. */
int kp_goodbye_decode(kp_msg *msg, kp_error *remote, kp_error *err);

/* Methods whose result is the empty map {} (layer.drop, slot.free,
 * slot.reset, slot.write, region.release) share these two. */
int kp_empty_result_encode(kp_writer *w, uint32_t id, kp_error *err);
int kp_empty_result_decode(kp_msg *msg, kp_error *err);

/* ------------------------------------------------------------------------ */
/* hello                                                                     */
/* ------------------------------------------------------------------------ */

typedef struct kp_hello_params {
    uint32_t versions[KP_MAX_VERSIONS]; /* protocol versions the client speaks */
    uint32_t nversions;                 /* 1..KP_MAX_VERSIONS */
    const char *client;                 /* optional (NULL): name/version for logs */
} kp_hello_params;

typedef enum kp_backend {
    KP_BACKEND_CPU = 0,
    KP_BACKEND_CUDA = 1,
} kp_backend;

/* kp_hello_result.transports bits */
#define KP_TRANSPORT_INLINE 0x1u   /* "inline": tensors inside the frame */
#define KP_TRANSPORT_SHM 0x2u      /* "shm": region.register_shm */
#define KP_TRANSPORT_CUDA_IPC 0x4u /* "cuda_ipc": region.register_cuda */

typedef struct kp_gpu {
    const char *name;  /* e.g. "NVIDIA H200" */
    const char *uuid;  /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    uint32_t index;    /* CUDA device ordinal inside the daemon */
    const char *pci_bus_id; /* PCI bus id, "0000:19:00.0"; NULL or "": not sent */
    bool mps;               /* the daemon's context is shared through CUDA MPS (false: not
                               shared, or an older daemon that does not say) */
} kp_gpu;

/* The memory kdad holds for its backend, bytes by use (hello and stats "memory"): device
 * memory with the cuda backend, host memory with the cpu backend (its pool alone). */
typedef struct kp_memory {
    uint64_t pool;     /* the state pool */
    uint64_t staging;  /* staging buffers and launch tables */
    uint64_t scratch;  /* the split path's outputs scratch (config cuda_split_scratch) */
    uint64_t kernel;   /* the kernel instance's other buffers: counters, split states, descriptors */
    uint64_t lanes;    /* the gated lanes: a kernel instance (its scratch included) and a table each */
    uint64_t layers;   /* layer weights copied where the kernel reads them */
    uint64_t total;    /* all of the above */
} kp_memory;

typedef struct kp_hello_result {
    uint32_t version;          /* the version chosen for this connection */
    const char *server;        /* "kdad 0.1.0" */
    uint64_t instance;         /* random per daemon start: tells restarts apart */
    kp_backend backend;
    bool has_gpu;              /* gpu is valid */
    kp_gpu gpu;
    kp_geometry geometry;
    uint32_t transports;       /* KP_TRANSPORT_* */
    bool slots_persist;        /* slots survive their connection (§Slots) */
    const char *const *features; /* optional extensions on (KP_FEATURE_*) */
    uint32_t nfeatures;
    kp_limits limits;
    bool has_memory;           /* memory is valid (older daemons do not send it) */
    kp_memory memory;
} kp_hello_result;

int kp_hello_params_encode(kp_writer *w, uint32_t id, const kp_hello_params *p, kp_error *err);
int kp_hello_params_decode(kp_msg *msg, const kp_session *s, kp_hello_params *p, kp_error *err);
int kp_hello_result_encode(kp_writer *w, uint32_t id, const kp_hello_result *r, kp_error *err);
int kp_hello_result_decode(kp_msg *msg, kp_hello_result *r, kp_error *err);
/* The highest version both sides speak, or KP_E_UNSUPPORTED_VERSION. */
int kp_hello_choose_version(const kp_hello_params *p, uint32_t *version, kp_error *err);
/* The session a client gets from hello's result. */
void kp_session_from_hello(kp_session *s, const kp_hello_result *r);

/* ------------------------------------------------------------------------ */
/* health, stats                                                             */
/* ------------------------------------------------------------------------ */

typedef enum kp_health_status {
    KP_HEALTH_OK = 0,       /* "ok": serving */
    KP_HEALTH_DRAINING = 1, /* "draining": finishing in-flight work, refusing new work */
} kp_health_status;

typedef struct kp_health_result {
    kp_health_status status;
    uint64_t uptime_us;
    uint32_t queued;  /* requests waiting for the device */
    uint32_t running; /* batches on the device */
} kp_health_result;

int kp_health_params_encode(kp_writer *w, uint32_t id, kp_error *err);
int kp_health_params_decode(kp_msg *msg, const kp_session *s, kp_error *err);
int kp_health_result_encode(kp_writer *w, uint32_t id, const kp_health_result *r, kp_error *err);
int kp_health_result_decode(kp_msg *msg, kp_health_result *r, kp_error *err);

/* One named counter of an open set (errors by code name, disconnects by reason). */
typedef struct kp_counter {
    const char *name;
    uint64_t value;
} kp_counter;

typedef enum kp_transport {
    KP_TRANSPORT_ID_INLINE = 0,
    KP_TRANSPORT_ID_SHM = 1,
    KP_TRANSPORT_ID_CUDA_IPC = 2,
    KP_TRANSPORT_ID_COUNT
} kp_transport;

/* One phase of the per-batch timing breakdown (stats "batch_us"): quantiles
 * over the daemon's recent batches, and the sum since start, microseconds. */
typedef struct kp_phase {
    const char *name;  /* daemon-defined, at most KP_NAME_MAX bytes ("device", "kernel", ...) */
    uint64_t p50_us, p90_us, p99_us, sum_us;
} kp_phase;

/* Bytes clients make the daemon hold, by kind (stats "clients" and "uid"). */
typedef struct kp_held {
    uint64_t inflight_bytes; /* request frames not answered yet, those still arriving too */
    uint64_t partial_bytes;  /* of which frames still arriving */
    uint64_t output_bytes;   /* responses not read yet */
    uint64_t region_bytes;   /* regions mapped */
} kp_held;

typedef struct kp_stats_result {
    uint64_t uptime_us;
    uint32_t connections;        /* open now */
    uint64_t connections_total;  /* accepted since start */
    uint64_t requests;           /* answered, every method */
    uint64_t batches;            /* backend launches */
    uint64_t batches_held;       /* of those, held while the device was busy (0 from daemons
                                    before the field) */
    uint64_t batches_gathered;   /* ... gathered on an idle device (likewise) */
    uint64_t seqs;               /* sequences prefilled */
    uint64_t tokens;             /* tokens prefilled */
    /* prefill latency, frame arrival to response queued, microseconds */
    uint64_t latency_count, latency_p50_us, latency_p90_us, latency_p99_us, latency_max_us;
    const uint64_t *latency_bounds_us; /* bucket upper bounds, strictly increasing */
    const uint64_t *latency_counts;    /* latency_nbounds + 1 counts (last: above all bounds) */
    uint32_t latency_nbounds;          /* 0..KP_HIST_MAX_BUCKETS */
    uint32_t slots_total, slots_used, slots_lost;
    uint32_t layers;             /* layers registered */
    /* "uid": what the asking client's uid holds against its per-uid bounds;
       absent from older daemons */
    bool has_uid;
    uint32_t uid, uid_layers, uid_slots;
    bool has_uid_held;           /* uid.connections and uid.held (absent from older daemons) */
    uint32_t uid_connections;    /* the uid's connections open */
    kp_held uid_held;            /* what the uid makes the daemon hold */
    /* "clients": what all clients make the daemon hold, against the bounds
       (absent from older daemons) */
    bool has_clients;
    kp_held held, held_peak;     /* now, and the most since start */
    uint64_t stalled;            /* connections closed for a stalled frame or output */
    uint64_t refused;            /* connections refused by max_connections or a per-uid quota */
    kp_client_bounds bounds;     /* the bounds now (a reload may change them after hello) */
    uint32_t regions;            /* regions registered, all connections */
    uint32_t rings;              /* connections whose frames use a frame ring now (0 from
                                    daemons before the field) */
    uint64_t ring_doorbells;     /* doorbells the daemon rang to sleeping ring clients (likewise) */
    const kp_counter *errors;    /* errors answered, by code name */
    uint32_t nerrors;
    const kp_counter *disconnects; /* connections closed, by reason */
    uint32_t ndisconnects;
    uint64_t bytes_in[KP_TRANSPORT_ID_COUNT];  /* tensor bytes read, by transport */
    uint64_t bytes_out[KP_TRANSPORT_ID_COUNT]; /* tensor bytes written, by transport */
    const char *prometheus;      /* the same numbers in the Prometheus text format, when
                                    asked for (KP_STATS_PROMETHEUS); else NULL */
    /* "batch_us": the per-batch phase breakdown; absent from older daemons */
    bool has_batch_phases;
    uint64_t batch_count;        /* batches timed since start (the sums' count) */
    uint32_t batch_window;       /* recent batches the quantiles cover */
    const kp_phase *phases;      /* 0..KP_STATS_MAX_PHASES */
    uint32_t nphases;
    /* "memory": the backend's memory by use now; absent from older daemons */
    bool has_memory;
    kp_memory memory;
} kp_stats_result;

#define KP_STATS_MAX_PHASES 32   /* phases accepted in "batch_us" */

/* Feature announced in hello when stats takes {"format": "prometheus"}. */
#define KP_FEATURE_STATS_PROMETHEUS "stats.prometheus"
/* stats flags */
#define KP_STATS_PROMETHEUS 0x1u /* also return the Prometheus text exposition */

int kp_stats_params_encode(kp_writer *w, uint32_t id, kp_error *err);   /* flags 0 */
int kp_stats_params_encode2(kp_writer *w, uint32_t id, uint32_t flags, kp_error *err);
/* Checks the params; _decode2 also returns the KP_STATS_* flags asked for. */
int kp_stats_params_decode(kp_msg *msg, const kp_session *s, kp_error *err);
int kp_stats_params_decode2(kp_msg *msg, const kp_session *s, uint32_t *flags, kp_error *err);
int kp_stats_result_encode(kp_writer *w, uint32_t id, const kp_stats_result *r, kp_error *err);
int kp_stats_result_decode(kp_msg *msg, kp_stats_result *r, kp_error *err);

/* ------------------------------------------------------------------------ */
/* layer.register, layer.list, layer.drop                                    */
/* ------------------------------------------------------------------------ */

#define KP_DEFAULT_SCALE 0.08838834764831845f /* 1/sqrt(128) */

typedef struct kp_layer_register_params {
    const char *name;  /* 1..KP_NAME_MAX bytes of [A-Za-z0-9._:/-] */
    kp_ref A_log;      /* INLINE only: f32 [H], little-endian, finite */
    kp_ref dt_bias;    /* INLINE only: f32 [H][128], little-endian, finite */
    float lower_bound; /* gate floor, in [-5, 0) */
    float scale;       /* output scale, finite; KP_DEFAULT_SCALE when absent */
} kp_layer_register_params;

typedef struct kp_layer_register_result {
    bool created; /* false: an identical layer of this name already existed */
} kp_layer_register_result;

typedef enum kp_layer_source {
    KP_LAYER_SOURCE_CONFIG = 0, /* "config": loaded at start; cannot be dropped */
    KP_LAYER_SOURCE_CLIENT = 1, /* "client": registered by a client */
} kp_layer_source;

typedef struct kp_layer_info {
    const char *name;
    float lower_bound;
    float scale;
    kp_layer_source source;
} kp_layer_info;

typedef struct kp_layer_list_result {
    const kp_layer_info *layers;
    uint32_t nlayers;
} kp_layer_list_result;

typedef struct kp_layer_drop_params {
    const char *name;
} kp_layer_drop_params;

typedef struct kp_layer_drop_result {
    bool known;             /* the fields below are present (daemons before them answer {}) */
    bool removed;           /* that was the uid's last registration: the name is gone */
    uint64_t registrations; /* the uid's registrations left (0 when removed) */
    uint32_t in_use;        /* admitted requests still using the weights; once removed, the
                               weights' memory goes when the last of them finishes (now: 0) */
} kp_layer_drop_result;

int kp_layer_register_params_encode(kp_writer *w, uint32_t id, const kp_layer_register_params *p,
                                    kp_error *err);
int kp_layer_register_params_decode(kp_msg *msg, const kp_session *s, kp_layer_register_params *p,
                                    kp_error *err);
int kp_layer_register_result_encode(kp_writer *w, uint32_t id, const kp_layer_register_result *r,
                                    kp_error *err);
int kp_layer_register_result_decode(kp_msg *msg, kp_layer_register_result *r, kp_error *err);

int kp_layer_list_params_encode(kp_writer *w, uint32_t id, kp_error *err);
int kp_layer_list_params_decode(kp_msg *msg, const kp_session *s, kp_error *err);
int kp_layer_list_result_encode(kp_writer *w, uint32_t id, const kp_layer_list_result *r,
                                kp_error *err);
int kp_layer_list_result_decode(kp_msg *msg, kp_layer_list_result *r, kp_error *err);

int kp_layer_drop_params_encode(kp_writer *w, uint32_t id, const kp_layer_drop_params *p,
                                kp_error *err);
int kp_layer_drop_params_decode(kp_msg *msg, const kp_session *s, kp_layer_drop_params *p,
                                kp_error *err);
int kp_layer_drop_result_encode(kp_writer *w, uint32_t id, const kp_layer_drop_result *r,
                                kp_error *err);
int kp_layer_drop_result_decode(kp_msg *msg, kp_layer_drop_result *r, kp_error *err);

/* ------------------------------------------------------------------------ */
/* slot.*                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct kp_slot_alloc_params {
    uint32_t count; /* 1..max_slots_per_client; 1 when absent */
    bool zero;      /* true (default): zero state at position 0; false: "empty" (§Slots) */
} kp_slot_alloc_params;

/* A list of slot handles: slot.alloc's result, slot.free / slot.reset params. */
typedef struct kp_slot_list {
    const uint64_t *slots;
    uint32_t nslots; /* 1..max_slots_per_client, no handle twice */
} kp_slot_list;

typedef struct kp_slot_fork_params {
    uint64_t src;
    bool has_dst;  /* false: the daemon allocates the destination */
    uint64_t dst;  /* an existing slot to overwrite, != src */
} kp_slot_fork_params;

typedef struct kp_slot_fork_result {
    uint64_t slot; /* the destination */
    uint64_t pos;  /* its position (= the source's) */
} kp_slot_fork_result;

typedef struct kp_slot_read_params {
    uint64_t slot;
    bool has_dtype; /* false: the pool's dtype */
    kp_dtype dtype;
    kp_ref out;     /* ABSENT (state inline in the result) or REGION */
} kp_slot_read_params;

typedef struct kp_slot_read_result {
    uint64_t pos;
    kp_dtype dtype; /* dtype of the state bytes */
    kp_ref state;   /* INLINE [H][128][128] when the request named no out, else ABSENT */
} kp_slot_read_result;

typedef struct kp_slot_write_params {
    uint64_t slot;
    uint64_t pos;   /* position the slot takes */
    kp_dtype dtype; /* dtype of the given bytes */
    kp_ref state;   /* INLINE or REGION, [H][128][128] V-major */
} kp_slot_write_params;

typedef struct kp_slot_info_params {
    bool has_slots;    /* false: every slot the caller owns */
    kp_slot_list list;
} kp_slot_info_params;

typedef enum kp_slot_status {
    KP_SLOT_READY = 0, /* "ready": has a state */
    KP_SLOT_EMPTY = 1, /* "empty": allocated with zero=false, not written yet */
    KP_SLOT_LOST = 2,  /* "lost": a device failure destroyed its state */
} kp_slot_status;

typedef struct kp_slot_info {
    uint64_t slot;
    uint64_t pos;
    kp_slot_status status;
    uint32_t queued; /* requests waiting on this slot */
} kp_slot_info;

typedef struct kp_slot_info_result {
    const kp_slot_info *slots;
    uint32_t nslots;
    uint32_t pool_free;  /* free slots in the pool */
    uint32_t quota_left; /* slots the caller may still allocate */
} kp_slot_info_result;

int kp_slot_alloc_params_encode(kp_writer *w, uint32_t id, const kp_slot_alloc_params *p,
                                kp_error *err);
int kp_slot_alloc_params_decode(kp_msg *msg, const kp_session *s, kp_slot_alloc_params *p,
                                kp_error *err);
int kp_slot_alloc_result_encode(kp_writer *w, uint32_t id, const kp_slot_list *r, kp_error *err);
int kp_slot_alloc_result_decode(kp_msg *msg, kp_slot_list *r, kp_error *err);

int kp_slot_free_params_encode(kp_writer *w, uint32_t id, const kp_slot_list *p, kp_error *err);
int kp_slot_free_params_decode(kp_msg *msg, const kp_session *s, kp_slot_list *p, kp_error *err);
int kp_slot_reset_params_encode(kp_writer *w, uint32_t id, const kp_slot_list *p, kp_error *err);
int kp_slot_reset_params_decode(kp_msg *msg, const kp_session *s, kp_slot_list *p, kp_error *err);
/* results: kp_empty_result_* */

int kp_slot_fork_params_encode(kp_writer *w, uint32_t id, const kp_slot_fork_params *p,
                               kp_error *err);
int kp_slot_fork_params_decode(kp_msg *msg, const kp_session *s, kp_slot_fork_params *p,
                               kp_error *err);
int kp_slot_fork_result_encode(kp_writer *w, uint32_t id, const kp_slot_fork_result *r,
                               kp_error *err);
int kp_slot_fork_result_decode(kp_msg *msg, kp_slot_fork_result *r, kp_error *err);

int kp_slot_read_params_encode(kp_writer *w, uint32_t id, const kp_slot_read_params *p,
                               kp_error *err);
int kp_slot_read_params_decode(kp_msg *msg, const kp_session *s, kp_slot_read_params *p,
                               kp_error *err);
int kp_slot_read_result_encode(kp_writer *w, uint32_t id, const kp_slot_read_result *r,
                               kp_error *err);
/* Checks the inline state's size against the session's geometry. */
int kp_slot_read_result_decode(kp_msg *msg, const kp_session *s, kp_slot_read_result *r,
                               kp_error *err);

int kp_slot_write_params_encode(kp_writer *w, uint32_t id, const kp_slot_write_params *p,
                                kp_error *err);
int kp_slot_write_params_decode(kp_msg *msg, const kp_session *s, kp_slot_write_params *p,
                                kp_error *err);
/* result: kp_empty_result_* */

int kp_slot_info_params_encode(kp_writer *w, uint32_t id, const kp_slot_info_params *p,
                               kp_error *err);
int kp_slot_info_params_decode(kp_msg *msg, const kp_session *s, kp_slot_info_params *p,
                               kp_error *err);
int kp_slot_info_result_encode(kp_writer *w, uint32_t id, const kp_slot_info_result *r,
                               kp_error *err);
int kp_slot_info_result_decode(kp_msg *msg, kp_slot_info_result *r, kp_error *err);

/* ------------------------------------------------------------------------ */
/* region.*                                                                  */
/* ------------------------------------------------------------------------ */

typedef struct kp_region_register_shm_params {
    uint64_t size; /* bytes from the start of the file, > 0; the fd rides with the frame */
} kp_region_register_shm_params;

typedef enum kp_cuda_handle_type {
    KP_CUDA_HANDLE_IPC = 0,      /* "ipc": cudaIpcMemHandle_t bytes in `handle` */
    KP_CUDA_HANDLE_POSIX_FD = 1, /* "posix_fd": a VMM shareable fd rides with the frame */
} kp_cuda_handle_type;

typedef struct kp_region_register_cuda_params {
    uint64_t size;                   /* bytes from the allocation base, > 0 */
    const char *device;              /* GPU UUID, as hello's gpu.uuid */
    kp_cuda_handle_type handle_type; /* "ipc" when absent */
    const void *handle;              /* IPC: KP_CUDA_IPC_HANDLE_BYTES bytes; POSIX_FD: NULL */
} kp_region_register_cuda_params;

/* Result of both register methods. */
typedef struct kp_region_register_result {
    uint32_t region; /* the id, >= 1, unique within the connection */
} kp_region_register_result;

typedef struct kp_region_release_params {
    uint32_t region;
} kp_region_release_params;

int kp_region_register_shm_params_encode(kp_writer *w, uint32_t id,
                                         const kp_region_register_shm_params *p, kp_error *err);
int kp_region_register_shm_params_decode(kp_msg *msg, const kp_session *s,
                                         kp_region_register_shm_params *p, kp_error *err);
int kp_region_register_cuda_params_encode(kp_writer *w, uint32_t id,
                                          const kp_region_register_cuda_params *p, kp_error *err);
int kp_region_register_cuda_params_decode(kp_msg *msg, const kp_session *s,
                                          kp_region_register_cuda_params *p, kp_error *err);
int kp_region_register_result_encode(kp_writer *w, uint32_t id,
                                     const kp_region_register_result *r, kp_error *err);
int kp_region_register_result_decode(kp_msg *msg, kp_region_register_result *r, kp_error *err);

int kp_region_release_params_encode(kp_writer *w, uint32_t id, const kp_region_release_params *p,
                                    kp_error *err);
int kp_region_release_params_decode(kp_msg *msg, const kp_session *s,
                                    kp_region_release_params *p, kp_error *err);
/* result: kp_empty_result_* */

typedef struct kp_ring_attach_params {
    uint32_t region; /* a host shared memory region holding the ring from offset 0 */
    uint64_t size;   /* bytes of each direction's data area: a power of two */
} kp_ring_attach_params;

int kp_ring_attach_params_encode(kp_writer *w, uint32_t id, const kp_ring_attach_params *p,
                                 kp_error *err);
int kp_ring_attach_params_decode(kp_msg *msg, const kp_session *s, kp_ring_attach_params *p,
                                 kp_error *err);
/* result: kp_empty_result_* */

/* ------------------------------------------------------------------------ */
/* The frame ring (§Frame ring): frames through shared memory                */
/* ------------------------------------------------------------------------ */

/*
 * A ring region holds, from offset 0: the header (KP_RING_HEADER_BYTES), the
 * client -> daemon data area (size bytes), the daemon -> client data area
 * (size bytes).  Each direction is a byte stream carrying the same frames as
 * the socket.  Counters count bytes since the ring was attached (they start
 * at 0 and never wrap in practice); byte n of a stream lives at n % size.
 * Each side writes only its own cache line of the header and trusts only its
 * own counters: the peer's are checked on every read (kp_ring_* return
 * KP_E_PROTOCOL for a counter that no honest peer could have written).
 */
#define KP_RING_HEADER_BYTES 4096u
#define KP_RING_MIN_SIZE 4096u          /* per direction */
#define KP_RING_MAX_SIZE (1ull << 30)
#define KP_RING_DEFAULT_SIZE (1u << 20) /* libkdaclient's choice */

/* wants: why a side sleeps; the peer sends one doorbell byte on the socket
 * after making that kind of progress (§Frame ring, Doorbells). */
#define KP_RING_WANT_DATA 1u  /* waiting for bytes to read */
#define KP_RING_WANT_SPACE 2u /* waiting for room to write */

typedef struct kp_ring_side {
    uint64_t head;  /* bytes written into the stream this side produces */
    uint64_t tail;  /* bytes read from the stream this side consumes */
    uint32_t wants; /* KP_RING_WANT_* while this side sleeps, else 0 */
    uint8_t pad[64 - 20];
} kp_ring_side;

typedef struct kp_ring_header {
    kp_ring_side client; /* written by the client only */
    kp_ring_side daemon; /* written by the daemon only */
} kp_ring_header;

/* One side's view of an attached ring. */
typedef struct kp_ring {
    kp_ring_side *mine;
    const kp_ring_side *peer;
    uint8_t *in, *out; /* the data areas this side reads / writes */
    uint64_t size;
    uint64_t head, tail; /* this side's counters (the truth; `mine` holds copies) */
} kp_ring;

/* Whether a ring of `size` bytes per direction is valid, and fits in `region_bytes`. */
int kp_ring_check_size(uint64_t size, uint64_t region_bytes, kp_error *err);
/* Sets r up over the region at base (already checked with kp_ring_check_size)
 * for the daemon's side or the client's; publishes zero counters and wants. */
void kp_ring_init(kp_ring *r, void *base, uint64_t size, bool daemon_side, uint32_t wants);
/* Copies up to len readable bytes to dst; *got = 0 when none are there. */
int kp_ring_read(kp_ring *r, void *dst, size_t len, size_t *got, kp_error *err);
/* Copies as much of the iovec list as fits; *put = 0 when the ring is full. */
int kp_ring_writev(kp_ring *r, const struct iovec *iov, size_t n, size_t *put, kp_error *err);
/* Whether the peer has written bytes this side has not read (or a bad counter,
 * which the next kp_ring_read reports). */
bool kp_ring_readable(const kp_ring *r);
/* Whether the peer has read bytes since this side last found the ring full. */
bool kp_ring_writable(const kp_ring *r);
/* Publishes why this side is about to sleep (0: awake), then a full fence,
 * so that a peer making progress afterwards sees it, and this side's
 * re-check sees the peer's progress made before. */
void kp_ring_set_wants(kp_ring *r, uint32_t wants);
/* After progress of kind `what` (KP_RING_WANT_DATA: wrote bytes; _SPACE: read
 * bytes): a full fence, then whether the peer sleeps waiting for it. */
bool kp_ring_peer_wants(const kp_ring *r, uint32_t what);

/* ------------------------------------------------------------------------ */
/* prefill                                                                   */
/* ------------------------------------------------------------------------ */

/* The tensors of one prefill sequence, in wire order. */
typedef enum kp_prefill_tensor {
    KP_TENSOR_Q = 0,
    KP_TENSOR_K,
    KP_TENSOR_V,
    KP_TENSOR_G,
    KP_TENSOR_BETA,
    KP_TENSOR_OUT,
    KP_PREFILL_TENSORS
} kp_prefill_tensor;

const char *kp_prefill_tensor_name(kp_prefill_tensor t); /* "q" ... "out" */

typedef struct kp_prefill_seq {
    uint64_t slot;
    bool has_expect_pos;
    uint64_t expect_pos; /* the slot's position must equal it when the sequence runs */
    uint32_t len;        /* tokens, 0..max_batch_tokens */
    bool fresh;          /* start from a zero state at position 0, ignoring the slot's
                            (excludes expect_pos) */
    union {
        struct {
            kp_ref q, k, v, g; /* bf16 [len][H][128]; INLINE or REGION */
            kp_ref beta;       /* bf16 [len][H]; INLINE or REGION */
            kp_ref out;        /* bf16 [len][H][128]; REGION, or ABSENT for inline output */
        };
        kp_ref tensors[KP_PREFILL_TENSORS]; /* the same six, indexed by kp_prefill_tensor */
    };
} kp_prefill_seq;

/*
 * A semaphore of a stream-ordered prefill (PROTOCOL.md §Stream-ordered
 * requests): the 64-bit little-endian word at `offset` (a multiple of
 * KP_SEM_ALIGN) of a region of the connection, and a value.  ready: the
 * request runs once the word, read as unsigned, is >= value.  done: kdad
 * stores value once the outputs and states are written, or value |
 * KP_SEM_FAILED when the request failed.
 */
typedef struct kp_sem {
    bool present;
    uint32_t region;  /* >= 1 */
    uint64_t offset;
    uint64_t value;   /* 1..KP_SEM_VALUE_MAX */
} kp_sem;

#define KP_SEM_ALIGN 8u
/* Bit 62, not 63: cuStreamWaitValue64's GEQ is a cyclic comparison, (int64_t)(word - value) >= 0,
 * so value | 2^63 would compare as below value and never release a stream's wait. */
#define KP_SEM_FAILED (1ull << 62)             /* set in a done word: the request failed */
#define KP_SEM_VALUE_MAX (KP_SEM_FAILED - 1)  /* values leave the failure bit clear */
/* Feature announced in hello when prefill takes "ready" and "done". */
#define KP_FEATURE_PREFILL_SEMAPHORES "prefill.semaphores"

typedef struct kp_prefill_params {
    const char *layer;
    const kp_prefill_seq *seqs;
    uint32_t nseqs; /* 1..max_seqs_per_request */
    kp_sem ready;   /* optional: run once the word reaches the value */
    kp_sem done;    /* optional: written when the request is over */
} kp_prefill_params;

typedef struct kp_prefill_seq_result {
    uint64_t pos; /* the slot's position after this sequence */
    kp_ref out;   /* INLINE bf16 [len][H][128] when the request had no out ref and len > 0 */
} kp_prefill_seq_result;

typedef struct kp_prefill_result {
    const kp_prefill_seq_result *seqs; /* one per request sequence, same order */
    uint32_t nseqs;
    uint64_t queue_us; /* arrival to launch, microseconds */
    uint64_t run_us;   /* launch to completion of the batch that ran it, microseconds */
    bool timed;        /* device_us and kernel_us are present (optional fields) */
    uint64_t device_us; /* the batch's device time (cuda: GPU events; cpu: the worker's run) */
    uint64_t kernel_us; /* of which the prefill kernel alone (0: not measured) */
} kp_prefill_result;

/* Bytes of a bf16 [len][H][128] tensor (q, k, v, g, out) and of bf16 [len][H]
 * (beta); UINT64_MAX if the product overflows (kp_state_bytes likewise). */
uint64_t kp_token_tensor_bytes(uint32_t len, uint32_t heads);
uint64_t kp_beta_bytes(uint32_t len, uint32_t heads);

int kp_prefill_params_encode(kp_writer *w, uint32_t id, const kp_prefill_params *p,
                             kp_error *err);
/* Checks everything the frame and session can tell (§prefill "Checked on
 * arrival"): shapes, limits, duplicate slots, and that no out range overlaps
 * another range of the request.  Slots, layer, positions and region sizes
 * are the daemon's to check (kp_prefill_check_regions helps). */
int kp_prefill_params_decode(kp_msg *msg, const kp_session *s, kp_prefill_params *p,
                             kp_error *err);
/*
 * The daemon's hot path: reads a whole frame body that is a prefill request
 * in one pass over its bytes (no pre-validation scan, no msgpack object
 * tree).  Returns true with msg's envelope (kind, id, method, name; its zone
 * holds p's arrays) and p filled exactly as kp_msg_decode +
 * kp_prefill_params_decode fill them; false, with msg closed, for any frame
 * those would refuse and for valid ones it leaves to them (unusual
 * encodings): decode it the general way, which names what is wrong.
 */
bool kp_prefill_request_read(kp_msg *msg, const void *body, size_t len, uint64_t max_frame,
                             const kp_session *s, kp_prefill_params *p);
int kp_prefill_result_encode(kp_writer *w, uint32_t id, const kp_prefill_result *r,
                             kp_error *err);
/* req is the request this answers: the result must have one entry per
 * sequence, with inline out of the right size exactly where req had no out. */
int kp_prefill_result_decode(kp_msg *msg, const kp_session *s, const kp_prefill_params *req,
                             kp_prefill_result *r, kp_error *err);
/* The id of a response frame body [1, id, ...], read without decoding it; false if the body
 * does not start that way. */
bool kp_response_peek_id(const void *body, size_t len, uint32_t *id);
/*
 * The client's hot path: reads a whole frame body that is the success
 * result of prefill request req in one pass over its bytes.  Returns true
 * with *r filled as kp_msg_decode + kp_prefill_result_decode fill it, except
 * that the positions go to pos[0 .. req->nseqs) and r->seqs stays NULL;
 * false for anything else, and always when a sequence of req takes its
 * output inline: decode it the general way.
 */
bool kp_prefill_result_read(const void *body, size_t len, uint64_t max_frame,
                            const kp_prefill_params *req, uint64_t *pos, kp_prefill_result *r);

/* Returns the size of region `region` in *size, or KP_E_REGION_INVALID. */
typedef int (*kp_region_size_fn)(void *ctx, uint32_t region, uint64_t *size);
/* Bounds-checks every region reference of a decoded prefill, naming the field
 * ("seqs[3].beta") in err: KP_E_REGION_INVALID or KP_E_REGION_BOUNDS. */
int kp_prefill_check_regions(const kp_prefill_params *p, kp_region_size_fn region_size,
                             void *ctx, kp_error *err);

/* ------------------------------------------------------------------------ */
/* step (§step): decode steps, many short sequences packed into one request */
/* ------------------------------------------------------------------------ */

#define KP_FEATURE_STEP "step"    /* hello announces it when the daemon serves step */
#define KP_STEP_MAX_TOKENS 16u    /* tokens per sequence of a step */

/* The tensors of a step, in wire order. */
typedef enum kp_step_tensor {
    KP_STEP_Q = 0,
    KP_STEP_K,
    KP_STEP_V,
    KP_STEP_G,
    KP_STEP_BETA,
    KP_STEP_OUT,
    KP_STEP_STATES,
    KP_STEP_TENSORS
} kp_step_tensor;

const char *kp_step_tensor_name(kp_step_tensor t); /* "q" ... "states" */

/*
 * A step's per-sequence lists are bins: `slots` and `expect_pos` hold u64
 * little-endian [nseqs], `lens` u8 [nseqs].  Decoded, they point into the
 * frame (unaligned: read them with kp_step_u64); to encode, point them at
 * arrays of uint64_t / uint8_t (the host is little-endian, as the codec
 * requires).
 */
typedef struct kp_step_params {
    const char *layer;
    uint32_t nseqs;          /* 1..max_seqs_per_request */
    const void *slots;       /* u64 [nseqs]: slot handles, each once */
    const uint8_t *lens;     /* [nseqs]: tokens, each 1..KP_STEP_MAX_TOKENS */
    const void *expect_pos;  /* optional (NULL): u64 [nseqs], each slot's position when it runs */
    uint32_t tokens;         /* sum of lens: set by the decoder (encoders compute it) */
    union {
        struct {
            kp_ref q, k, v, g; /* bf16 [tokens][H][128]; INLINE or REGION */
            kp_ref beta;       /* bf16 [tokens][H]; INLINE or REGION */
            kp_ref out;        /* bf16 [tokens][H][128]; REGION, or ABSENT for inline output */
            kp_ref states;     /* pool dtype [tokens][H][128][128]: the state after each token;
                                  REGION or ABSENT */
        };
        kp_ref tensors[KP_STEP_TENSORS]; /* the same seven, indexed by kp_step_tensor */
    };
} kp_step_params;

/* Entry i of a u64 list (slots, expect_pos, a result's pos). */
static inline uint64_t kp_step_u64(const void *list, uint32_t i)
{
    uint64_t v;
    __builtin_memcpy(&v, (const uint8_t *)list + (size_t)i * 8, 8);
    return v;
}

typedef struct kp_step_result {
    uint32_t nseqs;
    const void *pos;    /* u64 [nseqs]: each slot's position after the step */
    kp_ref out;         /* INLINE bf16 [tokens][H][128] when the request had no out */
    uint64_t queue_us;  /* as kp_prefill_result */
    uint64_t run_us;
    bool timed;
    uint64_t device_us;
    uint64_t kernel_us; /* of which the step kernel alone (0: not measured) */
} kp_step_result;

int kp_step_params_encode(kp_writer *w, uint32_t id, const kp_step_params *p, kp_error *err);
/* Checks everything the frame and session can tell (§step "Checked on
 * arrival"); sets p->tokens.  Cost: a constant number of msgpack objects
 * whatever nseqs, then one pass over lens and a sort of the handles. */
int kp_step_params_decode(kp_msg *msg, const kp_session *s, kp_step_params *p, kp_error *err);
int kp_step_result_encode(kp_writer *w, uint32_t id, const kp_step_result *r, kp_error *err);
/* req is the request this answers (nseqs, tokens, whether out was named). */
int kp_step_result_decode(kp_msg *msg, const kp_session *s, const kp_step_params *req,
                          kp_step_result *r, kp_error *err);
/* Bounds-checks every region reference of a decoded step, naming the field. */
int kp_step_check_regions(const kp_step_params *p, kp_region_size_fn region_size, void *ctx,
                          kp_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KDAPROTO_H */
