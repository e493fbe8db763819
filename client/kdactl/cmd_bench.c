/*
 * cmd_bench.c - kdactl bench: a load generator.  C connections ("clients")
 * each keep D prefill requests in flight (each on its own slots, so they
 * may share a batch), all driven from one epoll loop through libkdaclient's
 * non-blocking API, until a request count or a duration is reached.  It
 * reports requests/s, tokens/s and client-side latency percentiles (send to
 * completion), plus the daemon's own queue and run times.
 *
 * Lengths: fixed (every sequence T tokens), uniform (U[1, 2T-1], mean T),
 * mixed (the packed workload [1300, 547, 2048, 963, 271, 3063] scaled to
 * mean T, cycled).
 *
 * Ctrl-C (SIGINT) or SIGTERM stops sending: the requests in flight finish, the results so far
 * print, the temporary layer is dropped, and kdactl exits 130.  A second Ctrl-C kills it.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

#include "bench_buffers.h"
#include "common.h"
#include "prefill_io.h"

static const char bench_help[] =
    "Usage: kdactl bench [--clients C] [--depth D] [--requests N | --duration SEC]\n"
    "                    [--tokens T] [--dist fixed|mixed|uniform] [--seqs S]\n"
    "                    [--lengths L1,L2,...] [--transport inline|shm|cuda-ipc|cuda-vmm]\n"
    "                    [--warmup W] [--seed X] [--spin US] [--ring] [--align BYTES]\n"
    "       kdactl bench --decode [...]   decode steps ('kdactl bench --decode --help')\n"
    "\n"
    "Load generator: C connections each keep D prefill requests of S sequences in\n"
    "flight (every sequence on its own slot), until N requests completed (default 100)\n"
    "or SEC seconds passed.  Reports requests/s, tokens/s, latency p50/p90/p99 (send\n"
    "to completion, in the client) and the daemon's queue and run times.\n"
    "\n"
    "  -c, --clients C        connections (default 1)\n"
    "  -d, --depth D          requests in flight per connection (default 1)\n"
    "  -n, --requests N       stop after N requests (default 100)\n"
    "  -D, --duration SEC     stop sending after SEC seconds instead\n"
    "  -T, --tokens T         mean tokens per sequence (default 1024)\n"
    "  -l, --dist DIST        fixed: all T; uniform: U[1, 2T-1]; mixed: the packed\n"
    "                         workload [1300, 547, 2048, 963, 271, 3063] scaled to mean T\n"
    "  -N, --seqs N           sequences per request (default 1)\n"
    "  -L, --lengths LIST     every request holds exactly these sequence lengths, e.g.\n"
    "                         1300,547,2048,963,271,3063 (instead of --tokens, --dist\n"
    "                         and --seqs)\n"
    "  -x, --transport MODE   inline (default), shm (memfd regions), cuda-ipc (device\n"
    "                         memory, cudaMalloc in multiples of 2 MiB) or cuda-vmm (device\n"
    "                         memory, cuMemCreate); both need a CUDA build and the daemon's\n"
    "                         cuda backend\n"
    "  -W, --warmup W         untimed requests per connection first (default 1)\n"
    "  -S, --seed X           seed of inputs and lengths (default 1)\n"
    "  -P, --spin US          after each answer, poll the sockets without sleeping for up to\n"
    "                         US microseconds (default 0): no thread wake-up in the latency,\n"
    "                         for a core's time (libkdaclient: kdac_client_set_spin)\n"
    "  -r, --ring             frames through a shared memory ring instead of the socket\n"
    "                         (kdac_ring_attach); with --spin the answers come without a\n"
    "                         system call on either side\n"
    "  -A, --align BYTES      start every sequence's tensors and output at a multiple of\n"
    "                         BYTES in the region (a power of two; default 256: packed back\n"
    "                         to back, as a varlen batch holds them)\n";

typedef enum dist { DIST_FIXED, DIST_UNIFORM, DIST_MIXED, DIST_LIST } dist;
static const char *const dist_names[] = {"fixed", "uniform", "mixed", "list"};
static const char *const transport_names[] = {"inline", "shm", "cuda-ipc", "cuda-vmm"};
static const uint32_t mixed_lengths[] = {1300, 547, 2048, 963, 271, 3063}; /* mean 1365.33 */
#define NMIXED 6
#define MAX_LENGTHS 256 /* entries of --lengths */
#define NDAEMON 4       /* per-request daemon times kept: queue, run, device, kernel */

typedef struct bench_opts {
    uint64_t clients, depth, requests, tokens, seqs, warmup, seed;
    uint64_t spin_us; /* poll the sockets without sleeping this long after each answer */
    bool ring;        /* frames through a ring (kdac_ring_attach) */
    uint64_t align;   /* each sequence's tensors start at a multiple of this (bench_buffers.h) */
    double duration; /* 0: count mode */
    dist dist;
    bench_transport transport;
    uint32_t lengths[MAX_LENGTHS]; /* DIST_LIST: the sequences of every request */
} bench_opts;

struct bench;

typedef struct bench_client {
    struct bench *b;
    kdac_client *c;
    bench_region reg;
    uint64_t *slots; /* [depth * seqs] */
    int events;      /* what epoll watches now */
} bench_client;

/* One request in flight: a client's slot d. */
typedef struct bench_req {
    bench_client *bc;
    uint32_t slot;
    uint64_t tokens;
    double t0;
    kdac_seq *seqs; /* [seqs] */
} bench_req;

typedef struct bench {
    const ctl *g;
    bench_opts o;
    bench_data data;
    bench_client *clients;
    bench_req *reqs; /* [clients * depth] */
    char layer[KDAC_NAME_MAX + 1];
    bool layer_registered; /* holds one registration, given back at teardown */
    uint64_t rng;
    uint32_t mixed_next;
    /* progress of the run */
    double start, stop_at;
    bool polling; /* --ring within --spin: every client is polled, none rung */
    uint64_t sent, done, errors, tokens;
    double *lat_us;
    uint64_t nlat, cap_lat;
    uint64_t queue_us, run_us; /* sums over successes */
    double *daemon_us;  /* per success: the daemon's queue, run, device and kernel times */
    kdac_error first_error;
    int lost; /* a connection failed: its exit code */
    progress bar;
} bench;

static uint32_t max_len(const bench_opts *o)
{
    switch (o->dist) {
    case DIST_UNIFORM:
        return (uint32_t)(2 * o->tokens - 1);
    case DIST_MIXED:
        return (uint32_t)ceil(3063.0 * o->tokens * NMIXED / 8192.0);
    case DIST_LIST: {
        uint32_t m = 0;
        for (uint64_t j = 0; j < o->seqs; j++)
            m = o->lengths[j] > m ? o->lengths[j] : m;
        return m;
    }
    default:
        return (uint32_t)o->tokens;
    }
}

/* Sequence length of entry i of the mixed pattern, scaled to the mean length o->tokens. */
static uint32_t mixed_len(const bench_opts *o, uint64_t i)
{
    double l = mixed_lengths[i % NMIXED] * (double)o->tokens * NMIXED / 8192.0;
    return l < 1 ? 1 : (uint32_t)llround(l);
}

/* The most tokens one request can hold: its tensors are packed back to back within a block of
   this many tokens per tensor (a larger block only spreads the batch over more addresses). */
static uint64_t max_total(const bench_opts *o)
{
    uint64_t most = 0;
    switch (o->dist) {
    case DIST_MIXED:                               /* seqs consecutive entries of the cycle */
        for (uint64_t start = 0; start < NMIXED; start++) {
            uint64_t sum = 0;
            for (uint64_t j = 0; j < o->seqs; j++)
                sum += mixed_len(o, start + j);
            most = sum > most ? sum : most;
        }
        return most;
    case DIST_LIST:
        for (uint64_t j = 0; j < o->seqs; j++)
            most += o->lengths[j];
        return most;
    default:                                       /* fixed; uniform: every sequence at its longest */
        return o->seqs * max_len(o);
    }
}

/* The length of sequence j of the next request. */
static uint32_t next_len(bench *b, uint32_t j)
{
    switch (b->o.dist) {
    case DIST_LIST:
        return b->o.lengths[j];
    case DIST_UNIFORM:
        return 1 + (uint32_t)(rng_uniform(&b->rng) * (double)(2 * b->o.tokens - 1));
    case DIST_MIXED:
        return mixed_len(&b->o, b->mixed_next++);
    default:
        return (uint32_t)b->o.tokens;
    }
}

static volatile sig_atomic_t interrupted; /* Ctrl-C: stop sending, report, clean up */

static void on_interrupt(int sig)
{
    interrupted = sig;
}

static bool more_to_send(const bench *b)
{
    if (interrupted)
        return false;
    if (b->o.duration > 0)
        return now_s() < b->stop_at;
    return b->sent < b->o.requests;
}

static void done_cb(kdac_client *c, void *data, const kdac_result *res, int status);

/* Fills request r's sequences with fresh lengths, packed back to back as in a varlen batch
   (spread max_len apart, a mixed request spanned twice the addresses a real batch does), each
   starting at a multiple of --align. */
static void fill_req(bench *b, bench_req *r)
{
    uint64_t at = 0;
    r->tokens = 0;
    for (uint32_t j = 0; j < b->o.seqs; j++) {
        kdac_seq *s = &r->seqs[j];
        memset(s, 0, sizeof(*s));
        s->slot = r->bc->slots[r->slot * b->o.seqs + j];
        s->len = next_len(b, j);
        bench_seq_tensors(&b->data, &r->bc->reg, j, at, r->slot, s);
        at = bench_align(at + kdac_token_bytes(s->len, b->data.heads), b->o.align);
        r->tokens += s->len;
    }
}

static void submit(bench *b, bench_req *r)
{
    fill_req(b, r);
    kdac_error err;
    r->t0 = now_s();
    b->sent++;
    if (kdac_prefill_send(r->bc->c, b->layer, r->seqs, (uint32_t)b->o.seqs, done_cb, r, &err)) {
        /* Refused before sending: counts as a failed request. */
        b->done++;
        if (!b->errors++)
            b->first_error = err;
        if (!b->lost && ctl_exit_code(err.code) == EXIT_LOST)
            b->lost = EXIT_LOST;
    }
}

static void done_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    bench_req *r = data;
    bench *b = r->bc->b;
    b->done++;
    if (status != KDAC_OK) {
        if (!b->errors++)
            b->first_error = res->error;
        if (ctl_exit_code(status) == EXIT_LOST && !b->lost)
            b->lost = EXIT_LOST;
        return; /* a failing connection stops its requests */
    }
    if (b->nlat == b->cap_lat) {
        uint64_t cap = b->cap_lat ? 2 * b->cap_lat : 1024;
        double *grown = realloc(b->lat_us, cap * sizeof(double));
        if (!grown)
            return;
        b->lat_us = grown;
        grown = realloc(b->daemon_us, cap * NDAEMON * sizeof(double));
        if (!grown)
            return;
        b->daemon_us = grown;
        b->cap_lat = cap;
    }
    double *d = &b->daemon_us[b->nlat * NDAEMON];
    d[0] = (double)res->u.prefill.queue_us;
    d[1] = (double)res->u.prefill.run_us;
    d[2] = (double)res->u.prefill.device_us;
    d[3] = (double)res->u.prefill.kernel_us;
    b->lat_us[b->nlat++] = (now_s() - r->t0) * 1e6;
    b->tokens += r->tokens;
    b->queue_us += res->u.prefill.queue_us;
    b->run_us += res->u.prefill.run_us;
    progress_update(&b->bar, b->o.duration > 0 ? (uint64_t)((now_s() - b->start) * 1000)
                                               : b->done);
    if (more_to_send(b))
        submit(b, r);
}

/* Keeps epoll's interest in each client's fd equal to what it asks for. */
static void rearm(bench *b, int ep)
{
    for (uint64_t i = 0; i < b->o.clients; i++) {
        bench_client *bc = &b->clients[i];
        int want = kdac_client_events(bc->c);
        if (want == bc->events)
            continue;
        struct epoll_event ev = {0};
        ev.data.ptr = bc;
        ev.events = (want & KDAC_READABLE ? EPOLLIN : 0) | (want & KDAC_WRITABLE ? EPOLLOUT : 0);
        epoll_ctl(ep, want ? EPOLL_CTL_MOD : EPOLL_CTL_DEL, kdac_client_fd(bc->c), &ev);
        bc->events = want;
    }
}

/* The timed phase: every client's D requests, then refills until done. */
static int run_loop(bench *b)
{
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0)
        return ctl_error(b->g, EXIT_INPUT, "epoll_create1: %s", strerror(errno));
    for (uint64_t i = 0; i < b->o.clients; i++) {
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &b->clients[i]};
        epoll_ctl(ep, EPOLL_CTL_ADD, kdac_client_fd(b->clients[i].c), &ev);
        b->clients[i].events = KDAC_READABLE;
    }
    progress_begin(&b->bar, b->g, "bench",
                   b->o.duration > 0 ? (uint64_t)(b->o.duration * 1000) : b->o.requests, false);
    b->start = now_s();
    b->stop_at = b->start + b->o.duration;
    for (uint64_t i = 0; i < b->o.clients * b->o.depth && more_to_send(b); i++)
        submit(b, &b->reqs[i]);
    double last_answer = now_s();
    uint64_t turn = 0;
    while (b->done < b->sent) {
        uint64_t done = b->done;
        /* --spin: within spin_us of the last event, look without sleeping */
        const bool spin = (now_s() - last_answer) * 1e6 < (double)b->o.spin_us;
        if (b->o.ring && spin != b->polling) {
            /* Rings announce nothing while polled; leaving the poll, the
             * last progress call asks for doorbells again. */
            b->polling = spin;
            for (uint64_t i = 0; i < b->o.clients; i++) {
                kdac_client_set_polling(b->clients[i].c, spin);
                kdac_client_progress(b->clients[i].c);
            }
        }
        rearm(b, ep);
        struct epoll_event evs[64];
        /* Polling ring clients read their rings below; their sockets (doorbells,
         * descriptors, a closing daemon) are looked at every 64th turn, not
         * every turn: the system call would be most of the time to notice an
         * answer. */
        int n = 0;
        if (!b->polling || turn++ % 64 == 0)
            n = epoll_wait(ep, evs, 64, spin ? 0 : 100);
        for (int i = 0; i < n; i++)
            kdac_client_progress(((bench_client *)evs[i].data.ptr)->c);
        if (b->polling) {
            for (uint64_t i = 0; i < b->o.clients; i++)
                kdac_client_progress(b->clients[i].c);
        }
        if (n > 0 || b->done != done)
            last_answer = now_s();
        if (b->o.duration > 0)
            progress_update(&b->bar, (uint64_t)((now_s() - b->start) * 1000));
    }
    progress_end(&b->bar);
    for (uint64_t i = 0; i < b->o.clients && b->polling; i++)
        kdac_client_set_polling(b->clients[i].c, false);
    close(ep);
    return EXIT_OK;
}

/* Connects every client, registers its buffers and allocates its slots. */
static int setup(bench *b)
{
    kdac_error err;
    int rc;
    b->clients = calloc(b->o.clients, sizeof(*b->clients));
    b->reqs = calloc(b->o.clients * b->o.depth, sizeof(*b->reqs));
    if (!b->clients || !b->reqs)
        return ctl_error(b->g, EXIT_INPUT, "out of memory");
    for (uint64_t i = 0; i < b->o.clients; i++) {
        bench_client *bc = &b->clients[i];
        bc->b = b;
        if ((rc = ctl_connect(b->g, &bc->c)))
            return rc;
        if (b->o.ring && kdac_ring_attach(bc->c, 0, &err))
            return ctl_fail(b->g, "bench: attach a frame ring", &err);
        const kdac_server_info *info = kdac_client_info(bc->c);
        if (i == 0) {
            static const uint32_t need[] = {KDAC_TRANSPORT_INLINE, KDAC_TRANSPORT_SHM,
                                            KDAC_TRANSPORT_CUDA_IPC, KDAC_TRANSPORT_CUDA_IPC};
            if (!(info->transports & need[b->o.transport]))
                return ctl_error(b->g, EXIT_UNSUPPORTED, "%s: not supported: the daemon "
                                 "(backend %s) does not offer this transport",
                                 transport_names[b->o.transport], info->backend);
            char why[256];
            if ((rc = bench_data_init(&b->data, b->o.transport, info->heads,
                                      (uint32_t)b->o.seqs, max_len(&b->o), max_total(&b->o),
                                      b->o.align, (uint32_t)(b->o.clients * b->o.depth),
                                      b->o.seed, why,
                                      sizeof(why))))
                return ctl_error(b->g, rc, "bench: %s", why);
            layer_weights w;
            if (layer_weights_random(&w, (int32_t)info->heads, b->o.seed))
                return ctl_error(b->g, EXIT_INPUT, "out of memory");
            layer_weights_name(&w, b->layer, sizeof(b->layer));
            kdac_layer layer = {b->layer, w.A_log, w.dt_bias, w.lower_bound, w.scale};
            rc = kdac_layer_register(bc->c, &layer, NULL, &err);
            layer_weights_free(&w);
            if (rc)
                return ctl_fail(b->g, "bench: register the layer", &err);
            b->layer_registered = true;
        }
        if ((rc = bench_region_init(&bc->reg, &b->data, bc->c, (uint32_t)i, (uint32_t)b->o.depth,
                                    &err)))
            return ctl_fail(b->g, "bench: register buffers", &err);
        uint32_t nslots = (uint32_t)(b->o.depth * b->o.seqs);
        bc->slots = calloc(nslots, sizeof(uint64_t));
        if (!bc->slots)
            return ctl_error(b->g, EXIT_INPUT, "out of memory");
        if (kdac_slot_alloc(bc->c, nslots, 0, bc->slots, &err))
            return ctl_fail(b->g, "bench: allocate slots", &err);
        for (uint64_t d = 0; d < b->o.depth; d++) {
            bench_req *r = &b->reqs[i * b->o.depth + d];
            r->bc = bc;
            r->slot = (uint32_t)d;
            r->seqs = calloc(b->o.seqs, sizeof(kdac_seq));
            if (!r->seqs)
                return ctl_error(b->g, EXIT_INPUT, "out of memory");
        }
        for (uint64_t w = 0; w < b->o.warmup; w++) {
            bench_req *r = &b->reqs[i * b->o.depth];
            fill_req(b, r);
            if (kdac_prefill(bc->c, b->layer, r->seqs, (uint32_t)b->o.seqs, NULL, &err))
                return ctl_fail(b->g, "bench: warm-up prefill", &err);
        }
    }
    return EXIT_OK;
}

static void teardown(bench *b)
{
    for (uint64_t i = 0; b->clients && i < b->o.clients; i++) {
        bench_client *bc = &b->clients[i];
        if (!bc->c)
            continue;
        if (bc->slots)
            kdac_slot_free(bc->c, bc->slots, (uint32_t)(b->o.depth * b->o.seqs), NULL);
        bench_region_free(&bc->reg, bc->c);
        if (i == 0 && b->layer_registered)
            kdac_layer_drop(bc->c, b->layer, NULL);
        kdac_client_close(bc->c);
        free(bc->slots);
    }
    for (uint64_t i = 0; b->reqs && i < b->o.clients * b->o.depth; i++)
        free(b->reqs[i].seqs);
    free(b->clients);
    free(b->reqs);
    free(b->lat_us);
    free(b->daemon_us);
    bench_data_free(&b->data);
}

/* Mean and median of column k of the daemon's per-request times. */
static void daemon_times(const bench *b, int k, double *mean, double *p50)
{
    *mean = *p50 = 0;
    if (b->nlat == 0)
        return;
    double *v = malloc(b->nlat * sizeof(double));
    if (!v)
        return;
    for (uint64_t i = 0; i < b->nlat; i++) {
        v[i] = b->daemon_us[i * NDAEMON + k];
        *mean += v[i] / (double)b->nlat;
    }
    sort_doubles(v, b->nlat);
    *p50 = quantile(v, b->nlat, 0.5);
    free(v);
}

static void report(bench *b, double seconds)
{
    sort_doubles(b->lat_us, b->nlat);
    uint64_t ok = b->nlat;
    double rps = seconds > 0 ? ok / seconds : 0, tps = seconds > 0 ? b->tokens / seconds : 0;
    double mean = 0;
    for (uint64_t i = 0; i < ok; i++)
        mean += b->lat_us[i] / (double)ok;
    double p50 = quantile(b->lat_us, ok, 0.5), p90 = quantile(b->lat_us, ok, 0.9),
           p99 = quantile(b->lat_us, ok, 0.99), max = ok ? b->lat_us[ok - 1] : 0;
    double q = ok ? (double)b->queue_us / ok : 0, r = ok ? (double)b->run_us / ok : 0;
    double dmean[NDAEMON], dp50[NDAEMON];
    for (int k = 0; k < NDAEMON; k++)
        daemon_times(b, k, &dmean[k], &dp50[k]);
    const kdac_server_info *info = kdac_client_info(b->clients[0].c);
    if (b->g->json) {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "server", json_object_new_string(info->server));
        json_object_object_add(o, "backend", json_object_new_string(info->backend));
        json_object_object_add(o, "heads", json_u64(info->heads));
        json_object_object_add(o, "transport",
                               json_object_new_string(transport_names[b->o.transport]));
        json_object_object_add(o, "clients", json_u64(b->o.clients));
        json_object_object_add(o, "depth", json_u64(b->o.depth));
        json_object_object_add(o, "spin_us", json_u64(b->o.spin_us));
        json_object_object_add(o, "ring", json_object_new_boolean(b->o.ring));
        json_object_object_add(o, "seqs_per_request", json_u64(b->o.seqs));
        json_object_object_add(o, "dist", json_object_new_string(dist_names[b->o.dist]));
        if (b->o.dist == DIST_LIST) {
            json_object *l = json_object_new_array();
            for (uint64_t j = 0; j < b->o.seqs; j++)
                json_object_array_add(l, json_u64(b->o.lengths[j]));
            json_object_object_add(o, "lengths", l);
        }
        json_object_object_add(o, "tokens_mean", json_u64(b->o.tokens));
        json_object_object_add(o, "align", json_u64(b->o.align));
        json_object_object_add(o, "interrupted", json_object_new_boolean(interrupted != 0));
        json_object_object_add(o, "requests", json_u64(ok));
        json_object_object_add(o, "errors", json_u64(b->errors));
        json_object_object_add(o, "tokens", json_u64(b->tokens));
        json_object_object_add(o, "seconds", json_object_new_double(seconds));
        json_object_object_add(o, "requests_per_s", json_object_new_double(rps));
        json_object_object_add(o, "tokens_per_s", json_object_new_double(tps));
        json_object *lat = json_object_new_object();
        json_object_object_add(lat, "mean", json_object_new_double(mean / 1e3));
        json_object_object_add(lat, "p50", json_object_new_double(p50 / 1e3));
        json_object_object_add(lat, "p90", json_object_new_double(p90 / 1e3));
        json_object_object_add(lat, "p99", json_object_new_double(p99 / 1e3));
        json_object_object_add(lat, "max", json_object_new_double(max / 1e3));
        json_object_object_add(o, "latency_ms", lat);
        json_object_object_add(o, "daemon_queue_us_mean", json_object_new_double(q));
        json_object_object_add(o, "daemon_run_us_mean", json_object_new_double(r));
        /* Per request: medians of the four, means of device and kernel (the
         * batch that ran it; 0 from a daemon that does not report them). */
        static const char *const p50_names[NDAEMON] = {
            "daemon_queue_us_p50", "daemon_run_us_p50", "daemon_device_us_p50",
            "daemon_kernel_us_p50"};
        for (int k = 0; k < NDAEMON; k++)
            json_object_object_add(o, p50_names[k], json_object_new_double(dp50[k]));
        json_object_object_add(o, "daemon_device_us_mean", json_object_new_double(dmean[2]));
        json_object_object_add(o, "daemon_kernel_us_mean", json_object_new_double(dmean[3]));
        json_object_object_add(o, "first_error", b->errors ? json_object_new_string(
                                                                 b->first_error.message)
                                                           : NULL);
        ctl_print_json(o);
        return;
    }
    printf("bench: %s (backend %s, %u heads), transport %s%s, %llu clients x %llu in flight, "
           "%llu seq%s/request, %s lengths, mean %llu tokens, aligned to %llu bytes\n",
           info->server, info->backend, info->heads, transport_names[b->o.transport],
           b->o.ring ? " over a frame ring" : "", (unsigned long long)b->o.clients,
           (unsigned long long)b->o.depth, (unsigned long long)b->o.seqs,
           b->o.seqs == 1 ? "" : "s", dist_names[b->o.dist], (unsigned long long)b->o.tokens,
           (unsigned long long)b->o.align);
    printf("  requests   %llu ok, %llu failed in %.2f s%s\n", (unsigned long long)ok,
           (unsigned long long)b->errors, seconds,
           interrupted ? " (interrupted: the results so far)" : "");
    printf("  throughput %.1f requests/s, %.0f tokens/s\n", rps, tps);
    printf("  latency    p50 %.2f ms, p90 %.2f ms, p99 %.2f ms, max %.2f ms (mean %.2f ms)\n",
           p50 / 1e3, p90 / 1e3, p99 / 1e3, max / 1e3, mean / 1e3);
    printf("  daemon     queue %.0f us + run %.0f us per request (mean); medians: queue %.0f us, "
           "run %.0f us, device %.0f us, kernel %.0f us\n", q, r, dp50[0], dp50[1], dp50[2],
           dp50[3]);
    if (b->errors)
        printf("  first error: %s (%s)\n", b->first_error.message,
               kdac_err_name(b->first_error.code));
}

static int parse_bench(int argc, char **argv, bench_opts *o)
{
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'},           {"clients", required_argument, NULL, 'c'},
        {"depth", required_argument, NULL, 'd'},    {"requests", required_argument, NULL, 'n'},
        {"duration", required_argument, NULL, 'D'}, {"tokens", required_argument, NULL, 'T'},
        {"dist", required_argument, NULL, 'l'},     {"seqs", required_argument, NULL, 'N'},
        {"transport", required_argument, NULL, 'x'}, {"warmup", required_argument, NULL, 'W'},
        {"seed", required_argument, NULL, 'S'},     {"lengths", required_argument, NULL, 'L'},
        {"spin", required_argument, NULL, 'P'},     {"ring", no_argument, NULL, 'r'},
        {"align", required_argument, NULL, 'A'},    {NULL, 0, NULL, 0}};
    *o = (bench_opts){1, 1, 100, 1024, 1, 1, 1, 0, false, BENCH_PACKED, 0, DIST_FIXED,
                      BENCH_INLINE, {0}};
    bool has_requests = false, has_shape = false;
    int opt;
    while ((opt = getopt_long(argc, argv, "hc:d:n:D:T:l:N:x:W:S:L:P:rA:", opts, NULL)) != -1) {
        uint64_t *target = NULL, max = 0, min = 1;
        switch (opt) {
        case 'h':
            fputs(bench_help, stdout);
            return EXIT_OK;
        case 'c': target = &o->clients; max = 1024; break;
        case 'd': target = &o->depth; max = 1024; break;
        case 'n': target = &o->requests; max = UINT32_MAX; has_requests = true; break;
        case 'T': target = &o->tokens; max = 1u << 20; has_shape = true; break;
        case 'N': target = &o->seqs; max = 4096; has_shape = true; break;
        case 'L': {
            char *list = optarg, *end;
            uint64_t n = 0, total = 0;
            for (char *tok = strtok_r(list, ",", &end); tok; tok = strtok_r(NULL, ",", &end)) {
                uint64_t len;
                if (n == MAX_LENGTHS || !parse_u64(tok, 1, 1u << 20, &len))
                    return ctl_usage("bench", "--lengths: '%s' is not a length in [1, 2^20] "
                                     "(at most %d of them)", tok, MAX_LENGTHS);
                o->lengths[n++] = (uint32_t)len;
                total += len;
            }
            if (n == 0)
                return ctl_usage("bench", "--lengths: no length given");
            o->seqs = n;
            o->tokens = total / n;
            o->dist = DIST_LIST;
            break;
        }
        case 'W': target = &o->warmup; max = 1000; min = 0; break;
        case 'r': o->ring = true; break;
        case 'A':
            if (!parse_u64(optarg, BENCH_PACKED, 1ull << 30, &o->align) ||
                (o->align & (o->align - 1)))
                return ctl_usage("bench", "--align: '%s' is not a power of two in [%d, 2^30]",
                                 optarg, BENCH_PACKED);
            break;
        case 'P': target = &o->spin_us; max = 1000000; min = 0; break;
        case 'S': target = &o->seed; max = UINT64_MAX / 16; min = 0; break;
        case 'D':
            if (!parse_double(optarg, &o->duration) || o->duration <= 0 || o->duration > 86400)
                return ctl_usage("bench", "--duration: '%s' is not in (0, 86400] seconds",
                                 optarg);
            break;
        case 'l': {
            int k = -1;
            for (int i = 0; i < 3; i++)
                k = strcmp(optarg, dist_names[i]) == 0 ? i : k;
            if (k < 0)
                return ctl_usage("bench", "--dist: '%s' is not fixed, mixed or uniform", optarg);
            o->dist = (dist)k;
            has_shape = true;
            break;
        }
        case 'x': {
            int k = -1;
            for (int i = 0; i < (int)(sizeof(transport_names) / sizeof(transport_names[0])); i++)
                k = strcmp(optarg, transport_names[i]) == 0 ? i : k;
            if (k < 0)
                return ctl_usage("bench", "--transport: '%s' is not inline, shm, cuda-ipc or cuda-vmm",
                                 optarg);
            o->transport = (bench_transport)k;
            break;
        }
        default:
            return ctl_usage("bench", "unknown option");
        }
        if (target && !parse_u64(optarg, min, max, target))
            return ctl_usage("bench", "'%s' is not in [%llu, %llu]", optarg,
                             (unsigned long long)min, (unsigned long long)max);
    }
    if (optind < argc)
        return ctl_usage("bench", "unexpected argument '%s'", argv[optind]);
    if (has_requests && o->duration > 0)
        return ctl_usage("bench", "give --requests or --duration, not both");
    if (o->dist == DIST_LIST && has_shape)
        return ctl_usage("bench", "--lengths replaces --tokens, --seqs and --dist");
    return -1;
}

int cmd_bench(ctl *g, int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--decode") == 0)
            return cmd_bench_decode(g, argc, argv); /* cmd_step.c */
    }
    bench b;
    memset(&b, 0, sizeof(b));
    int rc = parse_bench(argc, argv, &b.o);
    if (rc >= 0)
        return rc;
    b.g = g;
    b.rng = b.o.seed * 16 + 15;
    b.data.shm.fd = -1;
    /* One Ctrl-C ends the run cleanly; SA_RESETHAND leaves a second one to kill. */
    struct sigaction sa = {.sa_handler = on_interrupt, .sa_flags = SA_RESETHAND};
    sigemptyset(&sa.sa_mask);
    struct sigaction old_int, old_term;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    rc = setup(&b);
    if (rc == EXIT_OK && !interrupted) {
        rc = run_loop(&b);
        double seconds = now_s() - b.start;
        if (rc == EXIT_OK) {
            report(&b, seconds);
            rc = b.lost ? b.lost : b.errors ? EXIT_REFUSED : EXIT_OK;
        }
    }
    teardown(&b);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (interrupted && (rc == EXIT_OK || rc == EXIT_REFUSED))
        rc = EXIT_INTERRUPTED;
    return rc;
}
