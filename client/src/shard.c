/*
 * shard.c - head-sharded clients (kdaclient.h, "Head-sharded clients"): one
 * connection per rank, each rank's daemon serving a contiguous range of the
 * heads.  Every call fans out to all ranks before it waits for any, then
 * drives all connections at once from one poll(2) loop, so the daemons work
 * concurrently.  Built on the public API alone.
 *
 * Why a sharded prefill equals one daemon serving every head: the KDA
 * recurrence of head h reads only head h's q, k, v, g, beta, A_log, dt_bias
 * and state, and writes only head h's output and state.  Splitting the heads
 * changes which process runs a head's chain, not the chain.
 */
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kdaclient.h"

struct kdac_shard {
    uint32_t nranks;
    uint32_t heads;     /* H: the sum of the ranks' heads */
    int timeout_ms;     /* each call's limit (0: none); a rank past it is closed */
    struct shard_rank {
        kdac_client *c;              /* NULL once closed after a timeout */
        char path[KDAC_PATH_MAX];
        uint32_t first, heads;       /* its heads: [first, first + heads) */
    } *r;
};

/* One rank's part of a call in flight. */
typedef struct rank_call {
    bool pending;
    int status;
    kdac_error error;
    /* what the callbacks fill */
    uint64_t *alloc_out; /* slot.alloc: the caller's [count][nranks], this rank's column */
    uint32_t rank, nranks;
    uint64_t pos;                       /* slot.read */
    uint64_t *seq_pos;                  /* prefill: [nseqs] */
    const struct kdac_shard_seq *seqs;  /* prefill: the caller's sequences (outputs) */
    uint32_t nseqs, first, heads, all_heads;
    uint8_t *out;                       /* prefill: this rank's outputs, back to back */
} rank_call;

static int shard_fail(kdac_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int shard_fail(kdac_error *err, int code, const char *fmt, ...)
{
    if (err) {
        err->code = code;
        err->retryable = kdac_err_retryable(code);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof(err->message), fmt, ap);
        va_end(ap);
    }
    return code;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* A rank's connection, or why it cannot be used: closed after a timeout, or
 * failed (progress reads what the daemon said last: a goodbye, EOF). */
static int rank_usable(kdac_shard *s, uint32_t r, kdac_error *err)
{
    if (!s->r[r].c)
        return shard_fail(err, KDAC_E_DISCONNECTED, "rank %u (%s): closed after a timeout; "
                          "open the shard again", r, s->r[r].path);
    int rc = kdac_client_progress(s->r[r].c);
    if (rc != KDAC_OK)
        return shard_fail(err, rc, "rank %u (%s): the connection failed (%s)", r, s->r[r].path,
                          kdac_err_name(rc));
    return KDAC_OK;
}

static int all_usable(kdac_shard *s, kdac_error *err)
{
    for (uint32_t r = 0; r < s->nranks; r++) {
        int rc = rank_usable(s, r, err);
        if (rc)
            return rc;
    }
    return KDAC_OK;
}

static void call_done(rank_call *rc, const kdac_result *res, int status)
{
    rc->pending = false;
    rc->status = status;
    if (status)
        rc->error = res->error;
}

/*
 * Drives every rank with a call pending until all have completed, or the
 * shard's timeout passed: then the late ranks' connections are closed (the
 * daemon may still act on the request) and their calls fail with TIMEOUT.
 */
static void wait_all(kdac_shard *s, rank_call *calls)
{
    struct pollfd pfd[s->nranks];
    uint32_t who[s->nranks];
    const double deadline = s->timeout_ms ? now_ms() + s->timeout_ms : 0;
    for (;;) {
        nfds_t n = 0;
        for (uint32_t r = 0; r < s->nranks; r++) {
            if (!calls[r].pending)
                continue;
            int ev = kdac_client_events(s->r[r].c);
            pfd[n] = (struct pollfd){kdac_client_fd(s->r[r].c),
                                     (short)((ev & KDAC_READABLE ? POLLIN : 0) |
                                             (ev & KDAC_WRITABLE ? POLLOUT : 0)), 0};
            who[n++] = r;
        }
        if (n == 0)
            return;
        int wait = -1;
        if (deadline) {
            double left = deadline - now_ms();
            wait = left > 0 ? (int)left + 1 : 0;
        }
        int got = poll(pfd, n, wait);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) { /* timed out (poll itself cannot fail on these arguments) */
            for (nfds_t i = 0; i < n; i++) {
                uint32_t r = who[i];
                kdac_client_close(s->r[r].c); /* completes the call with CANCELED */
                s->r[r].c = NULL;
                calls[r].pending = false;
                calls[r].status = shard_fail(&calls[r].error, KDAC_E_TIMEOUT,
                                             "no answer within %d ms; connection closed",
                                             s->timeout_ms);
            }
            return;
        }
        for (nfds_t i = 0; i < n; i++) {
            if (pfd[i].revents)
                kdac_client_progress(s->r[who[i]].c); /* failures complete the call */
        }
    }
}

/* The first failed rank's error, named, with what the others did.  `hint`
 * (NULL for calls that change nothing) follows the ranks that did apply it. */
static int report(kdac_shard *s, const rank_call *calls, const char *what, const char *hint,
                  int *rank_status, kdac_error *err)
{
    int first = -1;
    char applied[256] = "";
    uint32_t napplied = 0;
    for (uint32_t r = 0; r < s->nranks; r++) {
        if (rank_status)
            rank_status[r] = calls[r].status;
        if (calls[r].status && first < 0)
            first = (int)r;
        if (!calls[r].status) {
            snprintf(applied + strlen(applied), sizeof(applied) - strlen(applied), "%s%u",
                     napplied ? ", " : "", r);
            napplied++;
        }
    }
    if (first < 0)
        return KDAC_OK;
    const rank_call *f = &calls[first];
    int code = shard_fail(err, f->error.code, "rank %d (%s): %s: %s", first,
                          s->r[first].path, what, f->error.message);
    if (err)
        err->retryable = f->error.retryable;
    if (hint && napplied && err) {
        /* A retry would apply twice where it succeeded: not retryable as it stands. */
        err->retryable = false;
        size_t len = strlen(err->message);
        snprintf(err->message + len, sizeof(err->message) - len, "; it took effect on rank%s %s: "
                 "%s", napplied > 1 ? "s" : "", applied, hint);
    }
    return code;
}

/* ---------------------------------------------------------------------- */
/* Open and close                                                         */
/* ---------------------------------------------------------------------- */

int kdac_shard_open(kdac_shard **out, const char *const *paths, uint32_t nranks,
                    const kdac_options *opts, kdac_error *err)
{
    if (!out || !paths)
        return shard_fail(err, KDAC_E_INVALID_ARGUMENT, "out or paths is NULL");
    *out = NULL;
    if (nranks < 1 || nranks > KDAC_SHARD_MAX_RANKS)
        return shard_fail(err, KDAC_E_INVALID_ARGUMENT, "nranks: %u, expected 1..%d", nranks,
                          KDAC_SHARD_MAX_RANKS);
    kdac_shard *s = calloc(1, sizeof(*s));
    if (s)
        s->r = calloc(nranks, sizeof(*s->r));
    if (!s || !s->r) {
        free(s);
        return shard_fail(err, KDAC_E_NO_MEMORY, "cannot allocate a shard of %u ranks", nranks);
    }
    s->nranks = nranks;
    s->timeout_ms = opts ? opts->timeout_ms : 0;
    int rc = KDAC_OK;
    for (uint32_t r = 0; r < nranks && rc == KDAC_OK; r++) {
        kdac_options o;
        kdac_options_init(&o);
        if (opts)
            o = *opts;
        if (!paths[r]) {
            rc = shard_fail(err, KDAC_E_INVALID_ARGUMENT, "paths[%u] is NULL", r);
            break;
        }
        o.socket_path = paths[r];
        snprintf(s->r[r].path, sizeof(s->r[r].path), "%s", paths[r]);
        kdac_error e;
        if ((rc = kdac_client_open(&s->r[r].c, &o, &e)) != KDAC_OK) {
            shard_fail(err, rc, "rank %u (%s): %s", r, paths[r], e.message);
            if (err)
                err->retryable = e.retryable;
            break;
        }
        const kdac_server_info *info = kdac_client_info(s->r[r].c);
        for (uint32_t q = 0; q < r; q++) {
            if (kdac_client_info(s->r[q].c)->instance == info->instance) {
                rc = shard_fail(err, KDAC_E_INVALID_ARGUMENT, "rank %u (%s) is the same daemon "
                                "as rank %u (%s): each rank needs its own kdad", r, paths[r], q,
                                s->r[q].path);
                break;
            }
        }
        s->r[r].first = s->heads;
        s->r[r].heads = info->heads;
        s->heads += info->heads;
    }
    if (rc) {
        kdac_shard_close(s);
        return rc;
    }
    *out = s;
    return KDAC_OK;
}

void kdac_shard_close(kdac_shard *s)
{
    if (!s)
        return;
    for (uint32_t r = 0; r < s->nranks; r++)
        kdac_client_close(s->r[r].c);
    free(s->r);
    free(s);
}

uint32_t kdac_shard_nranks(const kdac_shard *s)
{
    return s->nranks;
}

uint32_t kdac_shard_heads(const kdac_shard *s)
{
    return s->heads;
}

uint32_t kdac_shard_first_head(const kdac_shard *s, uint32_t rank)
{
    return rank < s->nranks ? s->r[rank].first : s->heads;
}

kdac_client *kdac_shard_client(const kdac_shard *s, uint32_t rank)
{
    return rank < s->nranks ? s->r[rank].c : NULL;
}

/* ---------------------------------------------------------------------- */
/* Layers                                                                 */
/* ---------------------------------------------------------------------- */

int kdac_shard_layer_register(kdac_shard *s, const kdac_layer *layer, kdac_error *err)
{
    if (!s || !layer || !layer->name || !layer->A_log || !layer->dt_bias)
        return shard_fail(err, KDAC_E_INVALID_ARGUMENT, "shard, layer, its name, A_log or "
                          "dt_bias is NULL");
    int rc = all_usable(s, err);
    if (rc)
        return rc;
    for (uint32_t r = 0; r < s->nranks; r++) {
        kdac_layer part = *layer;
        part.A_log = layer->A_log + s->r[r].first;
        part.dt_bias = layer->dt_bias + (size_t)s->r[r].first * KDAC_HEAD_DIM;
        kdac_error e;
        if ((rc = kdac_layer_register(s->r[r].c, &part, NULL, &e)) == KDAC_OK)
            continue;
        /* Give back the registrations this call took, so that no rank keeps half a layer. */
        for (uint32_t q = 0; q < r; q++)
            kdac_layer_drop(s->r[q].c, layer->name, NULL);
        shard_fail(err, rc, "rank %u (%s): layer %s: %s%s", r, s->r[r].path, layer->name,
                   e.message, r ? " (given back on the ranks before it)" : "");
        if (err)
            err->retryable = e.retryable;
        return rc;
    }
    return KDAC_OK;
}

int kdac_shard_layer_drop(kdac_shard *s, const char *name, kdac_error *err)
{
    if (!s || !name)
        return shard_fail(err, KDAC_E_INVALID_ARGUMENT, "shard or name is NULL");
    int rc = all_usable(s, err), first = KDAC_OK;
    if (rc)
        return rc;
    for (uint32_t r = 0; r < s->nranks; r++) {
        kdac_error e;
        if ((rc = kdac_layer_drop(s->r[r].c, name, &e)) != KDAC_OK && first == KDAC_OK) {
            first = shard_fail(err, rc, "rank %u (%s): layer %s: %s (the other ranks dropped "
                               "theirs)", r, s->r[r].path, name, e.message);
            if (err)
                err->retryable = e.retryable;
        }
    }
    return first;
}

/* ---------------------------------------------------------------------- */
/* Slots                                                                  */
/* ---------------------------------------------------------------------- */

static void alloc_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    rank_call *rc = data;
    if (!status) {
        for (uint32_t i = 0; i < res->u.alloc.nslots; i++)
            rc->alloc_out[(size_t)i * rc->nranks + rc->rank] = res->u.alloc.slots[i];
    }
    call_done(rc, res, status);
}

static void plain_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    call_done(data, res, status);
}

static void read_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    rank_call *rc = data;
    if (!status)
        rc->pos = res->u.read.pos;
    call_done(rc, res, status);
}

/* Sends one request per rank (send(r) queues rank r's); a rank refused at
 * once completes at once.  Then waits for all. */
typedef int (*send_fn)(kdac_shard *s, uint32_t r, rank_call *call, void *arg, kdac_error *e);

static void fan_out(kdac_shard *s, rank_call *calls, send_fn send, void *arg)
{
    for (uint32_t r = 0; r < s->nranks; r++) {
        calls[r].rank = r;
        calls[r].nranks = s->nranks;
        calls[r].pending = true;
        int rc = send(s, r, &calls[r], arg, &calls[r].error);
        if (rc) {
            calls[r].pending = false;
            calls[r].status = rc;
        }
    }
    wait_all(s, calls);
}

typedef struct alloc_args {
    uint32_t count;
    unsigned flags;
} alloc_args;

static int send_alloc(kdac_shard *s, uint32_t r, rank_call *call, void *arg, kdac_error *e)
{
    const alloc_args *a = arg;
    return kdac_slot_alloc_send(s->r[r].c, a->count, a->flags, alloc_cb, call, e);
}

int kdac_shard_slot_alloc(kdac_shard *s, uint32_t count, unsigned flags, uint64_t *slots,
                          kdac_error *err)
{
    if (!s || !slots || count == 0)
        return shard_fail(err, KDAC_E_INVALID_ARGUMENT, "shard or slots is NULL, or count is 0");
    int rc = all_usable(s, err);
    if (rc)
        return rc;
    rank_call calls[s->nranks];
    memset(calls, 0, sizeof(calls));
    for (uint32_t r = 0; r < s->nranks; r++)
        calls[r].alloc_out = slots;
    alloc_args a = {count, flags};
    fan_out(s, calls, send_alloc, &a);
    if ((rc = report(s, calls, "slot.alloc", NULL, NULL, err)) == KDAC_OK)
        return KDAC_OK;
    /* All or none: give back what the other ranks allocated. */
    uint64_t *handles = malloc((size_t)count * sizeof(*handles));
    bool freed = handles != NULL;
    for (uint32_t r = 0; r < s->nranks && handles; r++) {
        if (calls[r].status || !s->r[r].c)
            continue;
        for (uint32_t i = 0; i < count; i++)
            handles[i] = slots[(size_t)i * s->nranks + r];
        freed &= kdac_slot_free(s->r[r].c, handles, count, NULL) == KDAC_OK;
    }
    free(handles);
    if (err) {
        size_t len = strlen(err->message);
        snprintf(err->message + len, sizeof(err->message) - len, "%s", freed
                 ? "; the other ranks' slots were freed again"
                 : "; the other ranks' slots could not all be freed (they go with the shard)");
    }
    return rc;
}

typedef struct free_args {
    const uint64_t *slots;
    uint32_t count;
    uint64_t *handles; /* [nranks][count] */
} free_args;

static int send_free(kdac_shard *s, uint32_t r, rank_call *call, void *arg, kdac_error *e)
{
    const free_args *a = arg;
    uint64_t *h = a->handles + (size_t)r * a->count;
    for (uint32_t i = 0; i < a->count; i++)
        h[i] = a->slots[(size_t)i * s->nranks + r];
    return kdac_slot_free_send(s->r[r].c, h, a->count, plain_cb, call, e);
}

int kdac_shard_slot_free(kdac_shard *s, const uint64_t *slots, uint32_t count, kdac_error *err)
{
    if (!s || !slots || count == 0)
        return shard_fail(err, KDAC_E_INVALID_ARGUMENT, "shard or slots is NULL, or count is 0");
    int rc = all_usable(s, err);
    if (rc)
        return rc;
    uint64_t *handles = malloc((size_t)s->nranks * count * sizeof(*handles));
    if (!handles)
        return shard_fail(err, KDAC_E_NO_MEMORY, "cannot allocate %u handles", count);
    rank_call calls[s->nranks];
    memset(calls, 0, sizeof(calls));
    free_args a = {slots, count, handles};
    fan_out(s, calls, send_free, &a);
    free(handles);
    return report(s, calls, "slot.free", "free the failed ranks' handles (kdac_shard_client)",
                  NULL, err);
}

/* The position every rank agrees on, or POSITION_MISMATCH naming two that differ. */
static int same_pos(kdac_shard *s, const uint64_t *pos, size_t stride, const char *what,
                    uint64_t *out, kdac_error *err)
{
    for (uint32_t r = 1; r < s->nranks; r++) {
        if (pos[r * stride] != pos[0])
            return shard_fail(err, KDAC_E_POSITION_MISMATCH, "%s: rank 0 is at position %llu, "
                              "rank %u (%s) at %llu: the sharded slot is out of step", what,
                              (unsigned long long)pos[0], r, s->r[r].path,
                              (unsigned long long)pos[r * stride]);
    }
    if (out)
        *out = pos[0];
    return KDAC_OK;
}

typedef struct state_args {
    const uint64_t *slot;
    kdac_dtype dtype;
    uint8_t *state; /* read: the caller's [H][128][128] */
    const uint8_t *src; /* write */
    uint64_t pos;
} state_args;

static size_t head_state_bytes(kdac_dtype dtype)
{
    return (size_t)kdac_state_bytes(1, dtype);
}

static int send_read(kdac_shard *s, uint32_t r, rank_call *call, void *arg, kdac_error *e)
{
    const state_args *a = arg;
    void *dst = a->state + s->r[r].first * head_state_bytes(a->dtype);
    return kdac_slot_read_send(s->r[r].c, a->slot[r], a->dtype, kdac_output_inline(dst), read_cb,
                               call, e);
}

int kdac_shard_slot_read(kdac_shard *s, const uint64_t *slot, kdac_dtype dtype, void *state,
                         uint64_t *pos, kdac_error *err)
{
    if (!s || !slot || !state)
        return shard_fail(err, KDAC_E_INVALID_ARGUMENT, "shard, slot or state is NULL");
    int rc = all_usable(s, err);
    if (rc)
        return rc;
    rank_call calls[s->nranks];
    memset(calls, 0, sizeof(calls));
    state_args a = {slot, dtype, state, NULL, 0};
    fan_out(s, calls, send_read, &a);
    if ((rc = report(s, calls, "slot.read", NULL, NULL, err)))
        return rc;
    uint64_t p[s->nranks];
    for (uint32_t r = 0; r < s->nranks; r++)
        p[r] = calls[r].pos;
    return same_pos(s, p, 1, "slot.read", pos, err);
}

static int send_write(kdac_shard *s, uint32_t r, rank_call *call, void *arg, kdac_error *e)
{
    const state_args *a = arg;
    const void *src = a->src + s->r[r].first * head_state_bytes(a->dtype);
    return kdac_slot_write_send(s->r[r].c, a->slot[r], a->pos, a->dtype,
                                kdac_tensor_inline(src), plain_cb, call, e);
}

int kdac_shard_slot_write(kdac_shard *s, const uint64_t *slot, uint64_t pos, kdac_dtype dtype,
                          const void *state, kdac_error *err)
{
    if (!s || !slot || !state)
        return shard_fail(err, KDAC_E_INVALID_ARGUMENT, "shard, slot or state is NULL");
    int rc = all_usable(s, err);
    if (rc)
        return rc;
    rank_call calls[s->nranks];
    memset(calls, 0, sizeof(calls));
    state_args a = {slot, dtype, NULL, state, pos};
    fan_out(s, calls, send_write, &a);
    return report(s, calls, "slot.write", "the sharded slot is out of step (write it again)",
                  NULL, err);
}

/* ---------------------------------------------------------------------- */
/* Prefill                                                                */
/* ---------------------------------------------------------------------- */

#define TOKEN_HEAD_BYTES (KDAC_HEAD_DIM * 2u) /* one head of one token of q, k, v, g, out */

/* Rows of [len][all][row] -> [len][heads][row], heads from `first`. */
static void slice(uint8_t *dst, const uint8_t *src, uint32_t len, uint32_t all, uint32_t first,
                  uint32_t heads, size_t row)
{
    for (uint32_t t = 0; t < len; t++)
        memcpy(dst + (size_t)t * heads * row, src + ((size_t)t * all + first) * row, heads * row);
}

/* The reverse: [len][heads][row] into [len][all][row]. */
static void unslice(uint8_t *dst, const uint8_t *src, uint32_t len, uint32_t all,
                    uint32_t first, uint32_t heads, size_t row)
{
    for (uint32_t t = 0; t < len; t++)
        memcpy(dst + ((size_t)t * all + first) * row, src + (size_t)t * heads * row, heads * row);
}

static void prefill_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    rank_call *rc = data;
    if (!status) {
        /* Gather this rank's heads into the callers' outputs while the others still run. */
        const uint8_t *o = rc->out;
        for (uint32_t i = 0; i < rc->nseqs; i++) {
            const kdac_shard_seq *q = &rc->seqs[i];
            if (q->out)
                unslice(q->out, o, q->len, rc->all_heads, rc->first, rc->heads,
                        TOKEN_HEAD_BYTES);
            o += (size_t)q->len * rc->heads * TOKEN_HEAD_BYTES;
            rc->seq_pos[i] = res->u.prefill.pos[i];
        }
    }
    call_done(rc, res, status);
}

/* Per rank: its slices of every sequence's inputs, then room for its outputs. */
typedef struct prefill_args {
    const char *layer;
    const kdac_shard_seq *seqs;
    uint32_t nseqs;
    uint8_t **buf;      /* [nranks] */
    kdac_seq *rseqs;    /* [nranks][nseqs] */
} prefill_args;

static int send_prefill(kdac_shard *s, uint32_t r, rank_call *call, void *arg, kdac_error *e)
{
    const prefill_args *a = arg;
    const uint32_t h = s->r[r].heads, first = s->r[r].first;
    kdac_seq *rs = a->rseqs + (size_t)r * a->nseqs;
    uint8_t *p = a->buf[r];
    for (uint32_t i = 0; i < a->nseqs; i++) {
        const kdac_shard_seq *q = &a->seqs[i];
        const size_t tok = (size_t)q->len * h * TOKEN_HEAD_BYTES;
        const void *srcs[4] = {q->q, q->k, q->v, q->g};
        kdac_tensor *dsts[4] = {&rs[i].q, &rs[i].k, &rs[i].v, &rs[i].g};
        rs[i] = (kdac_seq){.slot = q->slot[r], .len = q->len, .flags = q->flags,
                           .expect_pos = q->expect_pos};
        for (int t = 0; t < 4; t++) {
            slice(p, srcs[t], q->len, s->heads, first, h, TOKEN_HEAD_BYTES);
            *dsts[t] = kdac_tensor_inline(p);
            p += tok;
        }
        slice(p, q->beta, q->len, s->heads, first, h, 2);
        rs[i].beta = kdac_tensor_inline(p);
        p += (size_t)q->len * h * 2;
    }
    call->out = p;
    for (uint32_t i = 0; i < a->nseqs; i++) {
        rs[i].out = kdac_output_inline(p);
        p += (size_t)a->seqs[i].len * h * TOKEN_HEAD_BYTES;
    }
    call->seqs = a->seqs;
    call->nseqs = a->nseqs;
    call->first = first;
    call->heads = h;
    call->all_heads = s->heads;
    return kdac_prefill_send(s->r[r].c, a->layer, rs, a->nseqs, prefill_cb, call, e);
}

int kdac_shard_prefill(kdac_shard *s, const char *layer, const kdac_shard_seq *seqs,
                       uint32_t nseqs, uint64_t *pos, int *rank_status, kdac_error *err)
{
    if (!s || !layer || !seqs || nseqs == 0)
        return shard_fail(err, KDAC_E_INVALID_ARGUMENT, "shard, layer or seqs is NULL, or nseqs "
                          "is 0");
    uint64_t tokens = 0;
    for (uint32_t i = 0; i < nseqs; i++) {
        const kdac_shard_seq *q = &seqs[i];
        if (!q->slot)
            return shard_fail(err, KDAC_E_INVALID_ARGUMENT, "seqs[%u].slot is NULL", i);
        if (q->len && (!q->q || !q->k || !q->v || !q->g || !q->beta))
            return shard_fail(err, KDAC_E_INVALID_ARGUMENT, "seqs[%u]: q, k, v, g and beta "
                              "are host tensors and must not be NULL", i);
        tokens += q->len;
    }
    /* Per token and head: q k v g out (128 bf16 each) and beta (one bf16). */
    const uint64_t per_head = tokens * (5 * TOKEN_HEAD_BYTES + 2);
    uint8_t *bufs[s->nranks];
    memset(bufs, 0, sizeof(bufs));
    kdac_seq *rseqs = calloc((size_t)s->nranks * nseqs, sizeof(*rseqs));
    uint64_t *seq_pos = calloc((size_t)s->nranks * nseqs, sizeof(*seq_pos));
    int rc = rseqs && seq_pos ? KDAC_OK
                              : shard_fail(err, KDAC_E_NO_MEMORY, "cannot allocate %u sequences",
                                           nseqs);
    for (uint32_t r = 0; r < s->nranks && rc == KDAC_OK; r++) {
        if (!(bufs[r] = malloc(per_head * s->r[r].heads + 1)))
            rc = shard_fail(err, KDAC_E_NO_MEMORY, "cannot allocate rank %u's copy of %llu "
                            "tokens", r, (unsigned long long)tokens);
    }
    if (rc == KDAC_OK)
        rc = all_usable(s, err);
    if (rc == KDAC_OK) {
        rank_call calls[s->nranks];
        memset(calls, 0, sizeof(calls));
        for (uint32_t r = 0; r < s->nranks; r++)
            calls[r].seq_pos = seq_pos + (size_t)r * nseqs;
        prefill_args a = {layer, seqs, nseqs, bufs, rseqs};
        fan_out(s, calls, send_prefill, &a);
        rc = report(s, calls, "prefill", "the sharded slots are out of step (reset them, or "
                    "prefill them again with KDAC_SEQ_FRESH)", rank_status, err);
        for (uint32_t i = 0; i < nseqs && rc == KDAC_OK; i++) {
            char what[48];
            snprintf(what, sizeof(what), "prefill: seqs[%u]", i);
            rc = same_pos(s, seq_pos + i, nseqs, what, pos ? &pos[i] : NULL, err);
        }
    } else if (rank_status) {
        for (uint32_t r = 0; r < s->nranks; r++)
            rank_status[r] = rc; /* nothing was sent to any rank */
    }
    for (uint32_t r = 0; r < s->nranks; r++)
        free(bufs[r]);
    free(rseqs);
    free(seq_pos);
    return rc;
}
