/*
 * daemon_harness.h - integration tests of kdad: a real daemon process from
 * this build on a socket in a temporary folder, and a minimal blocking
 * client that speaks the wire protocol with the proto/ codec directly (so
 * the tests see exactly the bytes the daemon sends).
 *
 * Every helper asserts with cmocka; include cmocka's prerequisites first.
 */
#ifndef DAEMON_HARNESS_H
#define DAEMON_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "kdaproto.h"
#include "testutil.h"

/* The backend under test: "cpu" by default; test_daemon_cuda builds the same
 * suites with DH_BACKEND="cuda". */
#ifndef DH_BACKEND
#define DH_BACKEND "cpu"
#endif

#define DH_HEADS 4  /* small: the float64 oracle stays fast */

typedef struct dh_daemon {
    pid_t pid;
    char dir[64];      /* temporary folder */
    char sock[108];
    char config[128];
    char log[128];     /* the daemon's stderr */
} dh_daemon;

/*
 * Writes yaml (the whole config file; NULL: an empty one) and starts
 * build/daemon/kdad --config it --socket dir/kdad.sock --backend DH_BACKEND,
 * then waits until the socket accepts.  Returns 0, or 77 when kdad exits
 * with 69 (the backend is not available: the caller skips).  Fails the
 * test otherwise, printing the daemon's log.
 */
int dh_start(dh_daemon *d, const char *yaml);
/* dh_start's first half: writes the config and spawns kdad, without waiting. */
void dh_spawn(dh_daemon *d, const char *yaml);
/* Whether the daemon's socket accepts a connection now. */
bool dh_accepts(const dh_daemon *d);
/* dh_start inside a test: skips the test when the backend is unavailable. */
void dh_start_or_skip(dh_daemon *d, const char *yaml);
/* Starts and stops a daemon once: 77 when its backend is unavailable (the suite skips), else 0. */
int dh_backend_available(const char *yaml);
/* Sends sig (0: none) and waits for the exit; returns the exit code (-1 if
 * killed by a signal or it did not exit within a minute).  Keeps the folder. */
int dh_signal_wait(dh_daemon *d, int sig);
/* SIGTERM, asserts exit code 0 (under ASan this also means: no leak), and
 * removes the folder. */
void dh_stop(dh_daemon *d);
/* Waits for an exit that is under way (no signal), asserts its code, and
 * removes the folder. */
void dh_expect_exit(dh_daemon *d, int code);
/* cmocka teardown: kills a daemon that a failed test left running. */
int dh_teardown(void **state);
/* The daemon's log so far (malloc'd). */
char *dh_log(const dh_daemon *d);
/* Rewrites the config file (for SIGHUP tests). */
void dh_write_config(const dh_daemon *d, const char *yaml);

/* A bf16 [T][H][128] x 4 + beta workload and the layer it runs with. */
typedef struct dh_seq {
    uint32_t len;
    uint16_t *q, *k, *v, *g, *beta;
} dh_seq;

void dh_seq_make(dh_seq *s, test_rng *r, uint32_t len);
void dh_seq_free(dh_seq *s);
/* A sub-range [from, from + len) of s (no copy). */
dh_seq dh_seq_slice(const dh_seq *s, uint32_t from, uint32_t len);

typedef struct dh_layer {
    float A_log[DH_HEADS];
    float dt_bias[DH_HEADS * 128];
    float lower_bound, scale;
} dh_layer;

void dh_layer_make(dh_layer *l, test_rng *r);

/* Runs the float64 oracle over s from `state` (float64 [H][128][128],
 * updated); out: float64 [len][H][128]. */
void dh_oracle(const dh_layer *l, const dh_seq *s, double *state, double *out);
/* Relative RMS error of bf16 / f32 values against float64 ones. */
double dh_err_bf16(const uint16_t *x, const double *ref, size_t n);
double dh_err_f32(const float *x, const double *ref, size_t n);

/* ---------------------------------------------------------------------- */
/* Client                                                                 */
/* ---------------------------------------------------------------------- */

#define DH_HELD_MAX 64

typedef struct dh_client {
    int fd;
    kp_reader reader;
    kp_writer w;
    kp_session session; /* after dh_hello */
    uint32_t next_id;
    uint8_t *body;      /* the last frame received */
    size_t body_len;
    kp_msg msg;
    struct {            /* responses received while waiting for another id */
        uint8_t *body;
        size_t len;
        uint32_t id;
    } held[DH_HELD_MAX];
    int nheld;
    kp_ring *ring;      /* dh_attach_ring: frames go through it, the socket rings */
    bool semaphores;    /* hello announced KP_FEATURE_PREFILL_SEMAPHORES */
} dh_client;

void dh_connect(dh_client *c, const dh_daemon *d);
void dh_close(dh_client *c);
uint32_t dh_id(dh_client *c);

/* Writes raw bytes / the frame in c->w / that frame with fd passed by SCM_RIGHTS. */
void dh_write(dh_client *c, const void *bytes, size_t n);
void dh_send(dh_client *c);
void dh_send_fd(dh_client *c, int fd);
/* Writes raw bytes, passing fd with the first of them. */
void dh_write_fd(dh_client *c, const void *bytes, size_t n, int fd);

/*
 * Moves c's frames to a frame ring (PROTOCOL.md §Frame ring) in `map`, which
 * the caller registered as region `region` and which holds a ring of `size`
 * bytes per direction: ring.attach must succeed.  From then on dh_write puts
 * bytes into the ring (ringing the socket's doorbell after each write) and
 * dh_recv takes frames from it (sleeping on the socket until kdad rings).
 */
void dh_attach_ring(dh_client *c, kp_ring *ring, void *map, uint32_t region, uint64_t size);

/* Reads the next frame into c->msg; false at EOF.  Waits at most 120 s. */
bool dh_recv(dh_client *c);
/* The response to id in c->msg.  Responses may arrive in any order
 * (PROTOCOL.md): others that come first are held for their own calls; a
 * frame that is not a response (a goodbye) is returned as it is. */
void dh_recv_response(dh_client *c, uint32_t id);
/* The response to id is a success (its result in c->msg). */
void dh_expect_result(dh_client *c, uint32_t id);
/* The response to id is an error with code, whose message contains substr
 * (NULL: any). */
void dh_expect_error(dh_client *c, uint32_t id, int code, const char *substr);
/* The next frame is a goodbye with code (message containing substr), then EOF. */
void dh_expect_goodbye(dh_client *c, int code, const char *substr);

/* A memfd of size bytes, sealed against shrinking if seal (as kdad requires). */
int dh_memfd(size_t size, bool seal);

/* Calls that must succeed. */
void dh_hello(dh_client *c);
/* dh_hello that keeps the answer (its strings point into c's message until the next frame). */
void dh_hello_result(dh_client *c, kp_hello_result *r);
/* One slot, zeroed at once (dh_alloc) or only when first used (zero false). */
uint64_t dh_alloc(dh_client *c);
uint64_t dh_alloc_flags(dh_client *c, bool zero);
/* layer.register; returns its "created". */
bool dh_register_layer(dh_client *c, const char *name, const dh_layer *l);
/* region.register_shm of fd (size bytes); returns the region. */
uint32_t dh_register_shm(dh_client *c, int fd, uint64_t size);
/* A one-sequence prefill with inline tensors; returns the request id (the
 * caller reads the response).  expect_pos < 0: none. */
uint32_t dh_send_prefill(dh_client *c, const char *layer, uint64_t slot, const dh_seq *s,
                         int64_t expect_pos);
/* dh_send_prefill with a ready word (PROTOCOL.md §Stream-ordered requests). */
uint32_t dh_send_prefill_ready(dh_client *c, const char *layer, uint64_t slot, const dh_seq *s,
                               int64_t expect_pos, const kp_sem *ready);
/* Reads the response to a one-sequence prefill: copies its output (if out)
 * and returns the slot position. */
uint64_t dh_recv_prefill(dh_client *c, uint32_t id, const dh_seq *s, uint16_t *out);
/* slot.read as f32 into state[H*128*128]; returns the position. */
uint64_t dh_read_state(dh_client *c, uint64_t slot, float *state);
/* The same in dtype (DH_STATE_ELEMS elements of it). */
uint64_t dh_read_state_as(dh_client *c, uint64_t slot, kp_dtype dtype, void *state);
/* slot.fork of src into dst (NULL: a new slot); returns the fork, its position in *pos
 * (pos may be NULL). */
uint64_t dh_fork(dh_client *c, uint64_t src, const uint64_t *dst, uint64_t *pos);
/* slot.write of a state in dtype at pos. */
void dh_write_state(dh_client *c, uint64_t slot, uint64_t pos, kp_dtype dtype, kp_ref state);
/* A stats result (strings and arrays live until the next dh_recv). */
void dh_stats(dh_client *c, kp_stats_result *r);
uint64_t dh_counter(const kp_counter *v, uint32_t n, const char *name);

#define DH_TOKEN_BYTES(len) ((size_t)(len) * DH_HEADS * 128 * 2)
#define DH_BETA_BYTES(len) ((size_t)(len) * DH_HEADS * 2)
#define DH_STATE_ELEMS ((size_t)DH_HEADS * 128 * 128)

#endif /* DAEMON_HARNESS_H */
