/*
 * cmd_info.c - kdactl's read-only commands about the daemon: hello (what
 * the handshake announced), ping (round trips), health, stats.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* Parses only --help; returns -1 to go on. */
static int simple_options(const char *cmd, const char *help, int argc, char **argv)
{
    static const struct option opts[] = {{"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    int o;
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        if (o == 'h') {
            fputs(help, stdout);
            return EXIT_OK;
        }
        return ctl_usage(cmd, "unknown option");
    }
    if (optind < argc)
        return ctl_usage(cmd, "unexpected argument '%s'", argv[optind]);
    return -1;
}

static const char *transports_text(uint32_t t, char *buf, size_t size)
{
    snprintf(buf, size, "%s%s%s", t & KDAC_TRANSPORT_INLINE ? "inline " : "",
             t & KDAC_TRANSPORT_SHM ? "shm " : "", t & KDAC_TRANSPORT_CUDA_IPC ? "cuda_ipc " : "");
    size_t n = strlen(buf);
    if (n)
        buf[n - 1] = 0;
    return buf;
}

typedef struct named_u64 {
    const char *name;
    uint64_t value;
} named_u64;

/* A JSON object of unsigned numbers, in the table's order. */
static json_object *u64s_json(const named_u64 *v, size_t n)
{
    json_object *o = json_object_new_object();
    for (size_t i = 0; i < n; i++)
        json_object_object_add(o, v[i].name, json_u64(v[i].value));
    return o;
}

static json_object *limits_json(const kdac_limits *l)
{
    const named_u64 v[] = {
        {"max_frame_bytes", l->max_frame_bytes},
        {"max_inline_bytes", l->max_inline_bytes},
        {"max_batch_tokens", l->max_batch_tokens},
        {"max_batch_seqs", l->max_batch_seqs},
        {"max_seqs_per_request", l->max_seqs_per_request},
        {"max_slots_per_client", l->max_slots_per_client},
        {"max_regions_per_client", l->max_regions_per_client},
        {"max_inflight_requests", l->max_inflight_requests},
        {"max_inflight_bytes", l->max_inflight_bytes},
        {"max_layers", l->max_layers},
    };
    return u64s_json(v, sizeof(v) / sizeof(v[0]));
}

/* The clients.* bounds, named as the daemon's configuration keys. */
static json_object *client_bounds_json(const kdac_bounds *b)
{
    const named_u64 v[] = {
        {"max_connections", b->max_connections},
        {"max_connections_per_uid", b->max_connections_per_uid},
        {"max_inflight_bytes_per_uid", b->max_inflight_bytes_per_uid},
        {"max_inflight_bytes_total", b->max_inflight_bytes_total},
        {"output_hard_limit", b->output_hard_limit},
        {"output_soft_limit", b->output_soft_limit},
        {"output_soft_seconds", b->output_soft_seconds},
        {"max_output_bytes_per_uid", b->max_output_bytes_per_uid},
        {"max_output_bytes_total", b->max_output_bytes_total},
        {"max_region_bytes_per_connection", b->max_region_bytes_per_connection},
        {"max_region_bytes_per_uid", b->max_region_bytes_per_uid},
        {"frame_stall_seconds", b->frame_stall_seconds},
        {"output_stall_seconds", b->output_stall_seconds},
    };
    return u64s_json(v, sizeof(v) / sizeof(v[0]));
}

/* A byte count for text output ("48.0 MiB"). */
static const char *bytes_text(uint64_t v, char *buf, size_t size)
{
    format_bytes((double)v, buf, size);
    return buf;
}

/* The per-uid and daemon-wide bounds, as hello prints them. */
static void bounds_text(const kdac_bounds *b)
{
    char a[32], o[32], r[32], s[32];
    printf("  per uid     %u connections, %s of requests in flight, %s of unread output, "
           "%s of regions\n", b->max_connections_per_uid,
           bytes_text(b->max_inflight_bytes_per_uid, a, sizeof(a)),
           bytes_text(b->max_output_bytes_per_uid, o, sizeof(o)),
           bytes_text(b->max_region_bytes_per_uid, r, sizeof(r)));
    printf("  all uids    %u connections, %s of requests in flight, %s of unread output\n",
           b->max_connections, bytes_text(b->max_inflight_bytes_total, a, sizeof(a)),
           bytes_text(b->max_output_bytes_total, o, sizeof(o)));
    printf("  per client  %s of unread output (%s for %u s), %s of regions\n",
           bytes_text(b->output_hard_limit, o, sizeof(o)),
           bytes_text(b->output_soft_limit, s, sizeof(s)), b->output_soft_seconds,
           bytes_text(b->max_region_bytes_per_connection, r, sizeof(r)));
    printf("  stalls      closed after %u s without a byte of a frame begun, %u s without "
           "one of the output taken\n", b->frame_stall_seconds, b->output_stall_seconds);
}

/* The daemon's memory by use (hello and stats "memory"). */
static json_object *memory_json(const kdac_memory *m)
{
    const named_u64 v[] = {
        {"pool", m->pool},
        {"staging", m->staging},
        {"scratch", m->scratch},
        {"kernel", m->kernel},
        {"lanes", m->lanes},
        {"layers", m->layers},
        {"total", m->total},
    };
    return u64s_json(v, sizeof(v) / sizeof(v[0]));
}

/* One line: "  memory      1.5 GiB (device): pool 1.0 GiB, staging ..." */
static void memory_text(const kdac_memory *m, const char *where)
{
    char t[32], p[32], st[32], sc[32], k[32], ln[32], ly[32];
    printf("  memory      %s%s: pool %s, staging %s, scratch %s, kernel %s, lanes %s, layers %s\n",
           bytes_text(m->total, t, sizeof(t)), where, bytes_text(m->pool, p, sizeof(p)),
           bytes_text(m->staging, st, sizeof(st)), bytes_text(m->scratch, sc, sizeof(sc)),
           bytes_text(m->kernel, k, sizeof(k)), bytes_text(m->lanes, ln, sizeof(ln)),
           bytes_text(m->layers, ly, sizeof(ly)));
}

static void hello_json(const kdac_client *c)
{
    const kdac_server_info *i = kdac_client_info(c);
    json_object *o = json_object_new_object();
    json_object_object_add(o, "socket", json_object_new_string(kdac_client_path(c)));
    json_object_object_add(o, "version", json_u64(i->version));
    json_object_object_add(o, "server", json_object_new_string(i->server));
    json_object_object_add(o, "instance", json_id(i->instance));
    json_object_object_add(o, "backend", json_object_new_string(i->backend));
    json_object *gpu = NULL;
    if (i->has_gpu) {
        gpu = json_object_new_object();
        json_object_object_add(gpu, "name", json_object_new_string(i->gpu_name));
        json_object_object_add(gpu, "uuid", json_object_new_string(i->gpu_uuid));
        json_object_object_add(gpu, "index", json_u64(i->gpu_index));
        json_object_object_add(gpu, "pci_bus_id", json_object_new_string(i->gpu_pci_bus_id));
        json_object_object_add(gpu, "mps", json_object_new_boolean(i->gpu_mps));
    }
    json_object_object_add(o, "gpu", gpu);
    json_object_object_add(o, "heads", json_u64(i->heads));
    json_object_object_add(o, "head_dim", json_u64(KDAC_HEAD_DIM));
    json_object_object_add(o, "slots", json_u64(i->slots));
    json_object_object_add(o, "state_dtype", json_object_new_string(dtype_name(i->state_dtype)));
    json_object *tr = json_object_new_array();
    static const char *const names[] = {"inline", "shm", "cuda_ipc"};
    for (int t = 0; t < 3; t++) {
        if (i->transports & (1u << t))
            json_object_array_add(tr, json_object_new_string(names[t]));
    }
    json_object_object_add(o, "transports", tr);
    json_object_object_add(o, "slots_persist", json_object_new_boolean(i->slots_persist));
    json_object *f = json_object_new_array();
    for (uint32_t k = 0; k < i->nfeatures; k++)
        json_object_array_add(f, json_object_new_string(i->features[k]));
    json_object_object_add(o, "features", f);
    json_object *l = limits_json(&i->limits);
    if (i->bounds.max_layers_per_uid)
        json_object_object_add(l, "max_layers_per_uid", json_u64(i->bounds.max_layers_per_uid));
    if (i->bounds.max_slots_per_uid)
        json_object_object_add(l, "max_slots_per_uid", json_u64(i->bounds.max_slots_per_uid));
    if (i->has_bounds)
        json_object_object_add(l, "clients", client_bounds_json(&i->bounds));
    json_object_object_add(o, "limits", l);
    if (i->has_memory)
        json_object_object_add(o, "memory", memory_json(&i->memory));
    ctl_print_json(o);
}

static void hello_text(const kdac_client *c)
{
    const kdac_server_info *i = kdac_client_info(c);
    const kdac_limits *l = &i->limits;
    char tr[64];
    printf("kdad at %s\n", kdac_client_path(c));
    printf("  server      %s (instance 0x%016llx)\n", i->server,
           (unsigned long long)i->instance);
    printf("  protocol    %u\n", i->version);
    printf("  backend     %s\n", i->backend);
    if (i->has_gpu)
        printf("  gpu         %s (%s, index %u%s%s%s)\n", i->gpu_name, i->gpu_uuid, i->gpu_index,
               i->gpu_pci_bus_id[0] ? ", PCI " : "", i->gpu_pci_bus_id,
               i->gpu_mps ? ", shared through MPS" : "");
    else
        printf("  gpu         none\n");
    printf("  geometry    %u heads x %d, %u slots, state %s\n", i->heads, KDAC_HEAD_DIM, i->slots,
           dtype_name(i->state_dtype));
    printf("  transports  %s\n", transports_text(i->transports, tr, sizeof(tr)));
    printf("  slots       %s\n", i->slots_persist ? "persist (owned by uid)"
                                                  : "freed when their connection closes");
    printf("  features    ");
    for (uint32_t k = 0; k < i->nfeatures; k++)
        printf("%s%s", k ? ", " : "", i->features[k]);
    printf("%s\n", i->nfeatures ? "" : "none");
    printf("  limits      frame %llu B, inline %llu B, batch %u tokens / %u seqs, "
           "%u seqs per request\n", (unsigned long long)l->max_frame_bytes,
           (unsigned long long)l->max_inline_bytes, l->max_batch_tokens, l->max_batch_seqs,
           l->max_seqs_per_request);
    printf("              %u slots and %u regions per client, %u requests / %llu B in flight, "
           "%u layers\n", l->max_slots_per_client, l->max_regions_per_client,
           l->max_inflight_requests, (unsigned long long)l->max_inflight_bytes, l->max_layers);
    if (i->bounds.max_layers_per_uid || i->bounds.max_slots_per_uid)
        printf("              %u layers and %u slots per uid\n", i->bounds.max_layers_per_uid,
               i->bounds.max_slots_per_uid);
    if (i->has_bounds)
        bounds_text(&i->bounds);
    if (i->has_memory)
        memory_text(&i->memory, i->has_gpu ? " on the GPU" : " of host memory");
}

int cmd_hello(ctl *g, int argc, char **argv)
{
    int rc = simple_options("hello",
                            "Usage: kdactl hello\n"
                            "Connects, runs the protocol handshake and prints what the daemon\n"
                            "announced: server, backend, GPU, heads, slots, transports, limits,\n"
                            "and the memory it holds by use.\n",
                            argc, argv);
    if (rc >= 0)
        return rc;
    kdac_client *c;
    if ((rc = ctl_connect(g, &c)))
        return rc;
    if (g->json)
        hello_json(c);
    else
        hello_text(c);
    kdac_client_close(c);
    return EXIT_OK;
}

static const char ping_help[] =
    "Usage: kdactl ping [--count N] [--spin US] [--ring]\n"
    "Connects and times N health round trips (default 1): each one up to\n"
    "10, then min, p50, mean, p99 and max.\n"
    "  -n, --count N   round trips (1..1000000)\n"
    "  -P, --spin US   wait for each answer without sleeping for up to US microseconds\n"
    "                  (kdac_client_set_spin; default 0)\n"
    "  -r, --ring      through a frame ring instead of the socket (kdac_ring_attach)\n";

static int parse_ping(int argc, char **argv, uint64_t *count, uint64_t *spin_us, bool *ring)
{
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'}, {"count", required_argument, NULL, 'n'},
        {"spin", required_argument, NULL, 'P'}, {"ring", no_argument, NULL, 'r'},
        {NULL, 0, NULL, 0}};
    int o;
    while ((o = getopt_long(argc, argv, "hn:P:r", opts, NULL)) != -1) {
        switch (o) {
        case 'h':
            fputs(ping_help, stdout);
            return EXIT_OK;
        case 'n':
            if (!parse_u64(optarg, 1, 1000000, count))
                return ctl_usage("ping", "--count: '%s' is not in [1, 1000000]", optarg);
            break;
        case 'P':
            if (!parse_u64(optarg, 0, 1000000, spin_us))
                return ctl_usage("ping", "--spin: '%s' is not in [0, 1000000]", optarg);
            break;
        case 'r':
            *ring = true;
            break;
        default:
            return ctl_usage("ping", "unknown option");
        }
    }
    if (optind < argc)
        return ctl_usage("ping", "unexpected argument '%s'", argv[optind]);
    return -1;
}

int cmd_ping(ctl *g, int argc, char **argv)
{
    uint64_t count = 1, spin_us = 0;
    bool ring = false;
    int rc = parse_ping(argc, argv, &count, &spin_us, &ring);
    if (rc >= 0)
        return rc;
    double *rtt = malloc(count * sizeof(double));
    if (!rtt)
        return ctl_error(g, EXIT_INPUT, "out of memory");
    kdac_client *c;
    if ((rc = ctl_connect(g, &c))) {
        free(rtt);
        return rc;
    }
    double sum = 0;
    kdac_health_info h;
    kdac_error err;
    if ((ring && kdac_ring_attach(c, 0, &err)) ||
        kdac_client_set_spin(c, (int)spin_us, &err)) {
        kdac_client_close(c);
        free(rtt);
        return ctl_fail(g, "ping", &err);
    }
    for (uint64_t i = 0; i < count; i++) {
        double t0 = now_s();
        if (kdac_health(c, &h, &err) != KDAC_OK) {
            kdac_client_close(c);
            free(rtt);
            return ctl_fail(g, "ping", &err);
        }
        rtt[i] = (now_s() - t0) * 1e6;
        sum += rtt[i];
        if (!g->json && count <= 10)
            printf("pong from %s at %s: %s, %.0f us\n", kdac_client_info(c)->server,
                   kdac_client_path(c), h.draining ? "draining" : "ok", rtt[i]);
    }
    sort_doubles(rtt, count);
    double p50 = quantile(rtt, count, 0.5), p99 = quantile(rtt, count, 0.99);
    if (g->json) {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "socket", json_object_new_string(kdac_client_path(c)));
        json_object_object_add(o, "server", json_object_new_string(kdac_client_info(c)->server));
        json_object_object_add(o, "status", json_object_new_string(h.draining ? "draining" : "ok"));
        json_object_object_add(o, "count", json_u64(count));
        json_object_object_add(o, "ring", json_object_new_boolean(ring));
        json_object_object_add(o, "spin_us", json_u64(spin_us));
        json_object_object_add(o, "rtt_us_min", json_object_new_double(rtt[0]));
        json_object_object_add(o, "rtt_us_avg", json_object_new_double(sum / count));
        json_object_object_add(o, "rtt_us_p50", json_object_new_double(p50));
        json_object_object_add(o, "rtt_us_p99", json_object_new_double(p99));
        json_object_object_add(o, "rtt_us_max", json_object_new_double(rtt[count - 1]));
        ctl_print_json(o);
    } else if (count > 1) {
        printf("%llu pings%s: min %.0f us, p50 %.0f us, avg %.0f us, p99 %.0f us, max %.0f us\n",
               (unsigned long long)count, ring ? " over a frame ring" : "", rtt[0], p50,
               sum / count, p99, rtt[count - 1]);
    }
    kdac_client_close(c);
    free(rtt);
    return EXIT_OK;
}

int cmd_health(ctl *g, int argc, char **argv)
{
    int rc = simple_options("health",
                            "Usage: kdactl health\n"
                            "Prints ok or draining, uptime, requests queued and batches running.\n",
                            argc, argv);
    if (rc >= 0)
        return rc;
    kdac_client *c;
    if ((rc = ctl_connect(g, &c)))
        return rc;
    kdac_health_info h;
    kdac_error err;
    rc = kdac_health(c, &h, &err);
    kdac_client_close(c);
    if (rc)
        return ctl_fail(g, "health", &err);
    if (g->json) {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "status", json_object_new_string(h.draining ? "draining" : "ok"));
        json_object_object_add(o, "uptime_us", json_u64(h.uptime_us));
        json_object_object_add(o, "queued", json_u64(h.queued));
        json_object_object_add(o, "running", json_u64(h.running));
        ctl_print_json(o);
    } else {
        printf("%s: up %.1f s, %u requests queued, %u batches running\n",
               h.draining ? "draining" : "ok", h.uptime_us / 1e6, h.queued, h.running);
    }
    return EXIT_OK;
}

static json_object *counters_json(const kdac_counter *c, uint32_t n)
{
    json_object *o = json_object_new_object();
    for (uint32_t i = 0; i < n; i++)
        json_object_object_add(o, c[i].name, json_u64(c[i].value));
    return o;
}

static json_object *held_json(const kdac_held *h)
{
    const named_u64 v[] = {
        {"inflight_bytes", h->inflight_bytes},
        {"partial_bytes", h->partial_bytes},
        {"output_bytes", h->output_bytes},
        {"region_bytes", h->region_bytes},
    };
    return u64s_json(v, sizeof(v) / sizeof(v[0]));
}

static void stats_json(const kdac_stats_info *s, const kdac_usage_info *u)
{
    json_object *o = json_object_new_object();
    json_object_object_add(o, "uptime_us", json_u64(s->uptime_us));
    json_object_object_add(o, "connections", json_u64(s->connections));
    json_object_object_add(o, "connections_total", json_u64(s->connections_total));
    json_object_object_add(o, "requests", json_u64(s->requests));
    json_object_object_add(o, "batches", json_u64(s->batches));
    json_object_object_add(o, "batches_held", json_u64(s->batches_held));
    json_object_object_add(o, "batches_gathered", json_u64(s->batches_gathered));
    json_object_object_add(o, "seqs", json_u64(s->seqs));
    json_object_object_add(o, "tokens", json_u64(s->tokens));
    json_object *lat = json_object_new_object();
    json_object_object_add(lat, "count", json_u64(s->latency_count));
    json_object_object_add(lat, "p50", json_u64(s->latency_p50_us));
    json_object_object_add(lat, "p90", json_u64(s->latency_p90_us));
    json_object_object_add(lat, "p99", json_u64(s->latency_p99_us));
    json_object_object_add(lat, "max", json_u64(s->latency_max_us));
    json_object *bounds = json_object_new_array(), *counts = json_object_new_array();
    for (uint32_t i = 0; i < s->latency_nbounds; i++)
        json_object_array_add(bounds, json_u64(s->latency_bounds_us[i]));
    for (uint32_t i = 0; i <= s->latency_nbounds; i++)
        json_object_array_add(counts, json_u64(s->latency_counts[i]));
    json_object_object_add(lat, "bounds", bounds);
    json_object_object_add(lat, "counts", counts);
    json_object_object_add(o, "latency_us", lat);
    json_object *pool = json_object_new_object();
    json_object_object_add(pool, "slots", json_u64(s->slots_total));
    json_object_object_add(pool, "used", json_u64(s->slots_used));
    json_object_object_add(pool, "lost", json_u64(s->slots_lost));
    json_object_object_add(o, "pool", pool);
    json_object_object_add(o, "layers", json_u64(s->layers));
    json_object_object_add(o, "regions", json_u64(s->regions));
    json_object_object_add(o, "rings", json_u64(s->rings));
    json_object_object_add(o, "ring_doorbells", json_u64(s->ring_doorbells));
    json_object_object_add(o, "errors", counters_json(s->errors, s->nerrors));
    json_object_object_add(o, "disconnects", counters_json(s->disconnects, s->ndisconnects));
    json_object *tb = json_object_new_object();
    static const char *const names[] = {"inline", "shm", "cuda_ipc"};
    for (int t = 0; t < 3; t++) {
        json_object *io = json_object_new_object();
        json_object_object_add(io, "in", json_u64(s->bytes_in[t]));
        json_object_object_add(io, "out", json_u64(s->bytes_out[t]));
        json_object_object_add(tb, names[t], io);
    }
    json_object_object_add(o, "transport_bytes", tb);
    if (s->nphases) {
        json_object *bt = json_object_new_object(), *ph = json_object_new_object();
        json_object_object_add(bt, "count", json_u64(s->batch_count));
        json_object_object_add(bt, "window", json_u64(s->batch_window));
        for (uint32_t i = 0; i < s->nphases; i++) {
            json_object *p = json_object_new_object();
            json_object_object_add(p, "p50", json_u64(s->phases[i].p50_us));
            json_object_object_add(p, "p90", json_u64(s->phases[i].p90_us));
            json_object_object_add(p, "p99", json_u64(s->phases[i].p99_us));
            json_object_object_add(p, "sum", json_u64(s->phases[i].sum_us));
            json_object_object_add(ph, s->phases[i].name, p);
        }
        json_object_object_add(bt, "phases", ph);
        json_object_object_add(o, "batch_us", bt);
    }
    if (u->has_uid) {
        json_object *uid = json_object_new_object();
        json_object_object_add(uid, "uid", json_u64(u->uid));
        json_object_object_add(uid, "layers", json_u64(u->layers));
        json_object_object_add(uid, "slots", json_u64(u->slots));
        if (u->has_uid_held) {
            json_object_object_add(uid, "connections", json_u64(u->connections));
            json_object_object_add(uid, "held", held_json(&u->held));
        }
        json_object_object_add(o, "uid", uid);
    }
    if (u->has_clients) {
        json_object *cl = json_object_new_object();
        json_object_object_add(cl, "held", held_json(&u->total));
        json_object_object_add(cl, "peak", held_json(&u->peak));
        json_object_object_add(cl, "stalled", json_u64(u->stalled));
        json_object_object_add(cl, "refused", json_u64(u->refused));
        json_object_object_add(cl, "bounds", client_bounds_json(&u->bounds));
        json_object_object_add(o, "clients", cl);
    }
    if (u->has_memory)
        json_object_object_add(o, "memory", memory_json(&u->memory));
    ctl_print_json(o);
}

static void print_counters(const char *title, const kdac_counter *c, uint32_t n)
{
    printf("  %-12s", title);
    for (uint32_t i = 0; i < n; i++)
        printf("%s%s %llu", i ? ", " : "", c[i].name, (unsigned long long)c[i].value);
    printf("%s\n", n ? "" : "none");
}

/* What is held, against the bounds when known (0: not shown). */
static void held_text(const char *title, const kdac_held *h, uint64_t inflight_bound,
                      uint64_t output_bound, uint64_t region_bound)
{
    char a[32], p[32], o[32], r[32], b[3][40];
    const uint64_t bound[3] = {inflight_bound, output_bound, region_bound};
    for (int k = 0; k < 3; k++) {
        char v[32];
        if (bound[k])
            snprintf(b[k], sizeof(b[k]), " of %s", bytes_text(bound[k], v, sizeof(v)));
        else
            b[k][0] = 0;
    }
    printf("  %-12s%s%s in flight (%s arriving), %s%s unread output, %s%s in regions\n", title,
           bytes_text(h->inflight_bytes, a, sizeof(a)), b[0],
           bytes_text(h->partial_bytes, p, sizeof(p)), bytes_text(h->output_bytes, o, sizeof(o)),
           b[1], bytes_text(h->region_bytes, r, sizeof(r)), b[2]);
}

/* The caller's uid and all clients against the bounds. */
static void usage_text(const kdac_usage_info *u)
{
    const kdac_bounds *b = &u->bounds;
    if (u->has_uid) {
        printf("  uid %-8u%u layers", u->uid, u->layers);
        if (b->max_layers_per_uid)
            printf(" of %u", b->max_layers_per_uid);
        printf(", %u slots", u->slots);
        if (b->max_slots_per_uid)
            printf(" of %u", b->max_slots_per_uid);
        if (u->has_uid_held) {
            printf(", %u connections", u->connections);
            if (b->max_connections_per_uid)
                printf(" of %u", b->max_connections_per_uid);
        }
        printf("\n");
        if (u->has_uid_held)
            held_text("", &u->held, b->max_inflight_bytes_per_uid, b->max_output_bytes_per_uid,
                      b->max_region_bytes_per_uid);
    }
    if (u->has_clients) {
        held_text("all clients", &u->total, b->max_inflight_bytes_total, b->max_output_bytes_total,
                  0);
        held_text("  peak", &u->peak, 0, 0, 0);
        printf("  %-12s%llu stalled, %llu refused (clients.max_connections or a per-uid "
               "quota)\n", "closed", (unsigned long long)u->stalled,
               (unsigned long long)u->refused);
    }
}

static void stats_text(const kdac_stats_info *s, const kdac_usage_info *u)
{
    printf("kdad statistics (up %.1f s)\n", s->uptime_us / 1e6);
    printf("  connections %u open, %llu since start\n", s->connections,
           (unsigned long long)s->connections_total);
    printf("  requests    %llu answered\n", (unsigned long long)s->requests);
    printf("  prefill     %llu sequences, %llu tokens in %llu batches (%llu held while the "
           "device was busy, %llu gathered on an idle one)\n",
           (unsigned long long)s->seqs, (unsigned long long)s->tokens,
           (unsigned long long)s->batches, (unsigned long long)s->batches_held,
           (unsigned long long)s->batches_gathered);
    printf("  latency     %llu prefills: p50 %llu us, p90 %llu us, p99 %llu us, max %llu us\n",
           (unsigned long long)s->latency_count, (unsigned long long)s->latency_p50_us,
           (unsigned long long)s->latency_p90_us, (unsigned long long)s->latency_p99_us,
           (unsigned long long)s->latency_max_us);
    printf("  pool        %u slots, %u used, %u lost\n", s->slots_total, s->slots_used,
           s->slots_lost);
    printf("  registry    %u layers, %u regions\n", s->layers, s->regions);
    if (u->has_memory)
        memory_text(&u->memory, "");
    printf("  rings       %u connections on a frame ring, %llu doorbells rung\n", s->rings,
           (unsigned long long)s->ring_doorbells);
    usage_text(u);
    print_counters("errors", s->errors, s->nerrors);
    print_counters("disconnects", s->disconnects, s->ndisconnects);
    static const char *const names[] = {"inline", "shm", "cuda_ipc"};
    for (int t = 0; t < 3; t++) {
        char in[32], out[32];
        format_bytes((double)s->bytes_in[t], in, sizeof(in));
        format_bytes((double)s->bytes_out[t], out, sizeof(out));
        printf("  %-12s%s in, %s out\n", names[t], in, out);
    }
    if (s->nphases) {
        printf("  batches     %llu timed; per batch over the last %u, p50 / p90 / p99 / mean us:\n",
               (unsigned long long)s->batch_count, s->batch_window);
        for (uint32_t i = 0; i < s->nphases; i++) {
            const kdac_phase *p = &s->phases[i];
            printf("    %-10s%8llu %8llu %8llu %10.1f\n", p->name, (unsigned long long)p->p50_us,
                   (unsigned long long)p->p90_us, (unsigned long long)p->p99_us,
                   s->batch_count ? (double)p->sum_us / (double)s->batch_count : 0.0);
        }
    }
}

/* stats --prometheus: the daemon's own rendering, printed as it comes. */
static int stats_prometheus(ctl *g)
{
    kdac_client *c;
    int rc = ctl_connect(g, &c);
    if (rc)
        return rc;
    char *text;
    kdac_error err;
    rc = kdac_stats_prometheus(c, &text, &err);
    kdac_client_close(c);
    if (rc)
        return ctl_fail(g, "stats", &err);
    fputs(text, stdout);
    free(text);
    return EXIT_OK;
}

int cmd_stats(ctl *g, int argc, char **argv)
{
    static const char help[] =
        "Usage: kdactl stats [--prometheus]\n"
        "Prints the daemon's counters since it started: connections,\n"
        "requests, prefill sequences and tokens, latency percentiles, pool\n"
        "use, what the caller's uid and all clients make the daemon hold against\n"
        "the bounds (clients.*), errors by name, disconnects by reason, bytes by\n"
        "transport, each batch's time by phase (form, stage, launch, wait,\n"
        "notice, unstage, reply, total, device, kernel, host), and the memory\n"
        "the daemon holds by use.\n"
        "  -p, --prometheus  the same counters in the Prometheus text format, as the\n"
        "                    daemon renders them (its metrics.prometheus_file)\n";
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'}, {"prometheus", no_argument, NULL, 'p'},
        {NULL, 0, NULL, 0}};
    bool prometheus = false;
    int o;
    while ((o = getopt_long(argc, argv, "hp", opts, NULL)) != -1) {
        if (o == 'h') {
            fputs(help, stdout);
            return EXIT_OK;
        }
        if (o != 'p')
            return ctl_usage("stats", "unknown option");
        prometheus = true;
    }
    if (optind < argc)
        return ctl_usage("stats", "unexpected argument '%s'", argv[optind]);
    if (prometheus && g->json)
        return ctl_usage("stats", "--prometheus and --json are two different outputs");
    if (prometheus)
        return stats_prometheus(g);
    kdac_client *c;
    int rc = ctl_connect(g, &c);
    if (rc)
        return rc;
    kdac_stats_info s;
    kdac_usage_info u;
    kdac_error err;
    rc = kdac_stats_usage(c, &s, &u, sizeof(u), &err);
    kdac_client_close(c);
    if (rc)
        return ctl_fail(g, "stats", &err);
    if (g->json)
        stats_json(&s, &u);
    else
        stats_text(&s, &u);
    return EXIT_OK;
}
