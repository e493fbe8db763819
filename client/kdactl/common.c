/*
 * common.c - kdactl's shared helpers (see common.h).
 */
#include "common.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define KDACTL_STR2(x) #x
#define KDACTL_STR(x) KDACTL_STR2(x)
#define KDACTL_PROTOCOL_TEXT KDACTL_STR(KDAC_PROTOCOL_VERSION)

int ctl_exit_code(int code)
{
    switch (code) {
    case KDAC_OK:
        return EXIT_OK;
    case KDAC_E_NOT_RUNNING:
    case KDAC_E_CONNECT:
        return EXIT_UNREACHABLE;
    case KDAC_E_UNSUPPORTED_VERSION:
    case KDAC_E_PROTOCOL:
    case KDAC_E_FRAME_TOO_LARGE:
        return EXIT_PROTOCOL;
    case KDAC_E_NOT_SUPPORTED:
        return EXIT_UNSUPPORTED;
    case KDAC_E_DISCONNECTED:
    case KDAC_E_TIMEOUT:
    case KDAC_E_SHUTTING_DOWN:
        return EXIT_LOST;
    default:
        return EXIT_REFUSED;
    }
}

static void json_error(int code, const char *name, const char *message, bool retryable,
                       int exit_code)
{
    json_object *e = json_object_new_object();
    json_object_object_add(e, "code", json_object_new_int(code));
    json_object_object_add(e, "name", json_object_new_string(name));
    json_object_object_add(e, "message", json_object_new_string(message));
    json_object_object_add(e, "retryable", json_object_new_boolean(retryable));
    json_object_object_add(e, "exit_code", json_object_new_int(exit_code));
    json_object *o = json_object_new_object();
    json_object_object_add(o, "error", e);
    ctl_print_json(o);
}

int ctl_fail(const ctl *g, const char *what, const kdac_error *err)
{
    int rc = ctl_exit_code(err->code);
    if (g->json)
        json_error(err->code, kdac_err_name(err->code), err->message, err->retryable, rc);
    else
        fprintf(stderr, "kdactl: %s: %s (%s%s)\n", what, err->message, kdac_err_name(err->code),
                err->retryable ? ", retryable" : "");
    return rc;
}

int ctl_error(const ctl *g, int exit_code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (g->json)
        json_error(0, "KDACTL", msg, false, exit_code);
    else
        fprintf(stderr, "kdactl: %s\n", msg);
    return exit_code;
}

int ctl_set_error(kdac_error *err, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    err->code = code;
    err->retryable = kdac_err_retryable(code);
    return code;
}

int ctl_usage(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kdactl%s%s: ", *cmd ? " " : "", cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\nTry 'kdactl%s%s --help'.\n", *cmd ? " " : "", cmd);
    va_end(ap);
    return EXIT_USAGE;
}

bool ctl_retry(const ctl *g, const char *what, const kdac_error *err, int *attempt)
{
    switch (err->code) {
    case KDAC_E_NOT_RUNNING:
    case KDAC_E_CONNECT:
    case KDAC_E_DISCONNECTED:
    case KDAC_E_TIMEOUT:
    case KDAC_E_SHUTTING_DOWN:
        return false;
    default:
        break;
    }
    if (!err->retryable || *attempt >= g->retries)
        return false;
    long ms = g->retry_ms;
    for (int i = 0; i < *attempt && ms < CTL_MAX_RETRY_MS; i++)
        ms *= 2;
    if (ms > CTL_MAX_RETRY_MS)
        ms = CTL_MAX_RETRY_MS;
    (*attempt)++;
    fprintf(stderr, "kdactl: %s: %s (%s); retry %d of %d in %ld ms\n", what, err->message,
            kdac_err_name(err->code), *attempt, g->retries, ms);
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    return true;
}

static size_t edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    if (la > 32 || lb > 32)
        return SIZE_MAX;
    /* Levenshtein with adjacent transpositions ("slto" is one step from "slot") */
    size_t d[33][33];
    for (size_t i = 0; i <= la; i++)
        d[i][0] = i;
    for (size_t j = 0; j <= lb; j++)
        d[0][j] = j;
    for (size_t i = 1; i <= la; i++) {
        for (size_t j = 1; j <= lb; j++) {
            size_t best = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < best)
                best = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < best)
                best = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
                d[i - 2][j - 2] + 1 < best)
                best = d[i - 2][j - 2] + 1;
            d[i][j] = best;
        }
    }
    return d[la][lb];
}

const char *ctl_suggest(const char *word, const char *const *choices, size_t n)
{
    const char *best = NULL;
    size_t best_d = SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        size_t d = edit_distance(word, choices[i]);
        /* a prefix of a choice counts as near too ("bench" for "ben") */
        if (*word && strncmp(choices[i], word, strlen(word)) == 0)
            d = 1;
        if (d < best_d) {
            best_d = d;
            best = choices[i];
        }
    }
    size_t len = strlen(word);
    return best && best_d <= (len <= 4 ? 1u : 2u) ? best : NULL;
}

bool parse_dtype(const char *s, kdac_dtype *out)
{
    static const struct {
        const char *name;
        kdac_dtype t;
    } names[] = {{"f32", KDAC_DTYPE_F32},   {"fp32", KDAC_DTYPE_F32}, {"float32", KDAC_DTYPE_F32},
                 {"bf16", KDAC_DTYPE_BF16}, {"bfloat16", KDAC_DTYPE_BF16}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (strcasecmp(s, names[i].name) == 0) {
            *out = names[i].t;
            return true;
        }
    }
    return false;
}

int ctl_connect(const ctl *g, kdac_client **c)
{
    kdac_options o;
    kdac_options_init(&o);
    o.socket_path = g->socket;
    char gpu_sock[KDAC_PATH_MAX];
    if (!g->socket && g->gpu) {
        if (kdac_socket_for_gpu(g->gpu, gpu_sock, sizeof(gpu_sock)) != KDAC_OK)
            return ctl_usage("", "--gpu: '%s' is not a GPU ordinal or UUID", g->gpu);
        o.socket_path = gpu_sock;
    }
    o.timeout_ms = g->timeout_ms;
    char name[32];
    snprintf(name, sizeof(name), "kdactl/%s", kdac_version_string());
    o.client_name = name;
    kdac_error err;
    int rc = CTL_RETRYING(g, "connect", err, kdac_client_open(c, &o, &err)); /* e.g. BUSY */
    if (rc == KDAC_OK)
        return EXIT_OK;
    if (rc == KDAC_E_UNSUPPORTED_VERSION)
        return ctl_fail(g, "connect: the daemon speaks another protocol version than this "
                        "kdactl (protocol " KDACTL_PROTOCOL_TEXT ")", &err);
    return ctl_fail(g, "connect", &err);
}

bool parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
    if (!s || !*s || *s == '-')
        return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end || v < min || v > max)
        return false;
    *out = v;
    return true;
}

bool parse_double(const char *s, double *out)
{
    if (!s || !*s)
        return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !isfinite(v))
        return false;
    *out = v;
    return true;
}

bool parse_handle(const char *s, uint64_t *out)
{
    return parse_u64(s, 1, UINT64_MAX, out);
}

void ctl_print_json(json_object *o)
{
    puts(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED |
                                             JSON_C_TO_STRING_NOSLASHESCAPE));
    json_object_put(o);
}

json_object *json_u64(uint64_t v)
{
    return json_object_new_uint64(v);
}

json_object *json_id(uint64_t v)
{
    char buf[24];
    snprintf(buf, sizeof(buf), "0x%016llx", (unsigned long long)v);
    return json_object_new_string(buf);
}

const char *dtype_name(kdac_dtype t)
{
    return t == KDAC_DTYPE_F32 ? "f32" : "bf16";
}

void format_bytes(double bytes, char *buf, size_t size)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024 && u < 4) {
        bytes /= 1024;
        u++;
    }
    snprintf(buf, size, u ? "%.1f %s" : "%.0f %s", bytes, units[u]);
}

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int ctl_wait(kdac_client *c, const int *count, int target, progress *bar, uint64_t sent_base,
             uint64_t recv_base)
{
    while (*count < target) {
        struct pollfd p = {kdac_client_fd(c), POLLIN, 0};
        int ev = kdac_client_events(c);
        if (ev & KDAC_WRITABLE)
            p.events |= POLLOUT;
        if (ev && poll(&p, 1, 100) < 0 && errno != EINTR)
            return KDAC_E_SYSTEM;
        int rc = kdac_client_progress(c);
        if (bar) {
            kdac_io_status st;
            kdac_client_io_status(c, &st);
            progress_io(bar, st.sent_bytes - sent_base, st.recv_bytes - recv_base);
        }
        if (rc != KDAC_OK)
            return rc; /* every request in flight has completed with it */
    }
    return KDAC_OK;
}

static int cmp_double(const void *x, const void *y)
{
    double a = *(const double *)x, c = *(const double *)y;
    return a < c ? -1 : a > c;
}

void sort_doubles(double *v, uint64_t n)
{
    qsort(v, n, sizeof(double), cmp_double);
}

double quantile(const double *v, uint64_t n, double q)
{
    if (n == 0)
        return 0;
    uint64_t k = (uint64_t)ceil(q * (double)n);
    return v[k ? k - 1 : 0];
}
