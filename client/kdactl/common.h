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
};

/* Global options, before the command. */
typedef struct ctl {
    const char *socket; /* --socket, else $KDAD_SOCKET, else the default */
    bool json;          /* --json: one JSON document on stdout */
    int timeout_ms;     /* --timeout (seconds on the command line) */
    bool progress;      /* a progress bar is allowed (stderr is a terminal, not --json) */
} ctl;

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

/* Parses an unsigned integer (decimal or 0x hex) in [min, max]. */
bool parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out);
bool parse_double(const char *s, double *out);
/* A slot handle: decimal or 0x hex, not 0. */
bool parse_handle(const char *s, uint64_t *out);

/* Prints a JSON document on stdout and releases it. */
void ctl_print_json(json_object *o);
json_object *json_u64(uint64_t v);
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
    double start, last;
} progress;

void progress_begin(progress *p, const ctl *g, const char *label, uint64_t total, bool bytes);
void progress_update(progress *p, uint64_t done);
void progress_end(progress *p);

/*
 * Drives c until *count reaches target: poll on its fd, kdac_client_progress,
 * and the progress bar (if any) fed with the bytes moved since `base`
 * (sent + received).  Returns 0, or the connection's error code.
 */
int ctl_wait(kdac_client *c, const int *count, int target, progress *bar, uint64_t base);

#endif /* KDACTL_COMMON_H */
