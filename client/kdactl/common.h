/*
 * common.h - what kdactl's commands share: global options, exit codes,
 * connecting with clear messages, error reporting (human or JSON), number
 * and handle parsing, JSON output, an event loop that waits for pipelined
 * requests, and the terminal progress bar.
 *
 * Commands live one group per file: cmd_info.c (hello, ping, stats,
 * health), cmd_layer.c, cmd_slot.c, cmd_prefill.c (+ prefill_io.c for its
 * files), cmd_bench.c (+ bench_buffers.c for its transports).
 */
#ifndef KDACTL_COMMON_H
#define KDACTL_COMMON_H

#include <stdbool.h>
#include <stdint.h>

#include <json-c/json.h>

#include "kdaclient.h"

/* Exit codes (documented in `kdactl --help` and docs/client.md). */
enum {
    EXIT_OK = 0,          /* success */
    EXIT_REFUSED = 1,     /* the daemon answered with an error (bench: some requests failed) */
    EXIT_USAGE = 2,       /* unknown command or bad option */
    EXIT_UNREACHABLE = 3, /* daemon not running, or its socket cannot be reached */
    EXIT_PROTOCOL = 4,    /* the daemon speaks another protocol version, or is not kdad */
    EXIT_INPUT = 5,       /* a file cannot be read or written, is malformed, or does not fit
                             the daemon (e.g. its heads) */
    EXIT_UNSUPPORTED = 6, /* the daemon or this kdactl lacks the feature (e.g. cuda-ipc) */
    EXIT_LOST = 7,        /* the connection was lost or timed out mid-command */
    EXIT_INTERRUPTED = 130, /* bench stopped by Ctrl-C (SIGINT) or SIGTERM, results printed */
};

/* Global options, before or after the command. */
typedef struct ctl {
    const char *socket; /* --socket, else $KDAD_SOCKET, else the default */
    const char *gpu;    /* --gpu: the socket of kdad@GPU (kdac_socket_for_gpu), unless --socket */
    bool json;          /* --json: one JSON document on stdout */
    int timeout_ms;     /* --timeout (seconds on the command line); 0: the command's default */
    bool progress;      /* a progress bar is allowed (stderr is a terminal, not --json) */
    int retries;        /* --retries N (--no-retry: 0): tries again after a retryable error */
    int retry_ms;       /* --retry-delay MS: the first back-off, doubled each time */
} ctl;

#define CTL_DEFAULT_RETRIES 5
#define CTL_DEFAULT_RETRY_MS 100
#define CTL_MAX_RETRY_MS 5000   /* a back-off grows to this and stays */

/* A command: argv[0] is its name; returns an exit code. */
typedef int (*ctl_command)(ctl *g, int argc, char **argv);

int cmd_hello(ctl *g, int argc, char **argv);
int cmd_ping(ctl *g, int argc, char **argv);
int cmd_health(ctl *g, int argc, char **argv);
int cmd_stats(ctl *g, int argc, char **argv);
int cmd_layer(ctl *g, int argc, char **argv);
int cmd_slot(ctl *g, int argc, char **argv);
int cmd_prefill(ctl *g, int argc, char **argv);
int cmd_bench(ctl *g, int argc, char **argv);
int cmd_step(ctl *g, int argc, char **argv);        /* cmd_step.c */
int cmd_bench_decode(ctl *g, int argc, char **argv); /* cmd_step.c: kdactl bench --decode */

/* The exit code for a libkdaclient error code. */
int ctl_exit_code(int code);

/* Reports a failure of `what` (stderr, or a JSON error document with
 * --json) and returns its exit code. */
int ctl_fail(const ctl *g, const char *what, const kdac_error *err);
/* Reports a usage error (with a pointer to --help) and returns EXIT_USAGE. */
int ctl_usage(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Reports an error of the given exit code with a printf-style message. */
int ctl_error(const ctl *g, int exit_code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Fills err with code (retryable per the table) and a printf-style
 * message; returns code.  For errors kdactl itself finds. */
int ctl_set_error(kdac_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Connects and says clearly why not (not running, other protocol version).
 * Returns EXIT_OK with *c open, or the exit code. */
int ctl_connect(const ctl *g, kdac_client **c);

/*
 * After `call` failed with err: true (after sleeping the back-off, with a note on stderr) when
 * the daemon called the error retryable and tries are left, so the caller makes the same call
 * again.  Errors of the connection itself (not running, lost, timed out) are not retried.
 *   int attempt = 0;
 *   while (kdac_slot_alloc(c, ..., &err) && ctl_retry(g, "slot alloc", &err, &attempt)) {}
 */
bool ctl_retry(const ctl *g, const char *what, const kdac_error *err, int *attempt);
/* CALL (nonzero on failure, filling err) made until it succeeds or ctl_retry stops; its result. */
#define CTL_RETRYING(g, what, err, call)                                                       \
    __extension__({                                                                            \
        int attempt_ = 0, rc_;                                                                 \
        while ((rc_ = (call)) && ctl_retry((g), (what), &(err), &attempt_)) {                  \
        }                                                                                      \
        rc_;                                                                                   \
    })

/* The choice nearest to word by edit distance, if it is close enough to be a typo; else NULL. */
const char *ctl_suggest(const char *word, const char *const *choices, size_t n);

/* A state dtype: f32, fp32, float32 or bf16, bfloat16 (any case). */
bool parse_dtype(const char *s, kdac_dtype *out);

/* Parses an unsigned integer (decimal or 0x hex) in [min, max]. */
bool parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out);
bool parse_double(const char *s, double *out);
/* A slot handle: decimal or 0x hex, not 0. */
bool parse_handle(const char *s, uint64_t *out);

/* Prints a JSON document on stdout and releases it. */
void ctl_print_json(json_object *o);
json_object *json_u64(uint64_t v);
/* A 64-bit identifier (slot handle, instance) as the text shows it, "0x%016llx": a JSON number
 * would lose its low bits in tools that read numbers as doubles (jq, JavaScript). */
json_object *json_id(uint64_t v);
/* "bf16" / "f32" */
const char *dtype_name(kdac_dtype t);
/* Bytes as "12.3 MiB". */
void format_bytes(double bytes, char *buf, size_t size);
/* Monotonic seconds. */
double now_s(void);
/* Sorts v[n] ascending; the q-quantile of sorted v[n] (nearest rank; 0 when n is 0). */
void sort_doubles(double *v, uint64_t n);
double quantile(const double *v, uint64_t n, double q);

/* Terminal progress bar on stderr (drawn only when g->progress and the
 * total is large enough to be worth it). */
typedef struct progress {
    bool on;
    const char *label;
    bool bytes;         /* format the counts as bytes */
    uint64_t total;
    uint64_t send_total; /* > 0: a request's bar, which names its phase (send, run, receive) */
    double start, last;
} progress;

void progress_begin(progress *p, const ctl *g, const char *label, uint64_t total, bool bytes);
void progress_update(progress *p, uint64_t done);
/* A request's bar: sent and received bytes; send_total is what the request sends. */
void progress_request(progress *p, uint64_t send_total);
void progress_io(progress *p, uint64_t sent, uint64_t received);
void progress_end(progress *p);

/*
 * Drives c until *count reaches target: poll on its fd, kdac_client_progress,
 * and the progress bar (if any) fed with the bytes moved since `base`
 * (sent + received; a request's bar with the two apart).  Returns 0, or the
 * connection's error code.
 */
int ctl_wait(kdac_client *c, const int *count, int target, progress *bar, uint64_t sent_base,
             uint64_t recv_base);

#endif /* KDACTL_COMMON_H */
