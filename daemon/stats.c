/*
 * stats.c - see stats.h.
 */
#include "stats.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const disconnect_names[KD_DISC_COUNT] = {
#define KD_DISC_NAME(id, name) [KD_DISC_##id] = name,
    KD_DISCONNECTS(KD_DISC_NAME)
#undef KD_DISC_NAME
};

static const char *const phase_names[KD_PHASE_COUNT] = {
#define KD_PHASE_NAME(id, name) [KD_PHASE_##id] = name,
    KD_PHASES(KD_PHASE_NAME)
#undef KD_PHASE_NAME
};

const char *kd_phase_name(kd_phase p)
{
    return (unsigned)p < KD_PHASE_COUNT ? phase_names[p] : "unknown";
}

/* b - a in microseconds, or 0 unless both were stamped in that order. */
static uint64_t span_us(uint64_t a, uint64_t b)
{
    return a && b && b >= a ? (b - a) / 1000 : 0;
}

void kd_batch_phases(const kd_batch_timing *t, uint64_t us[KD_PHASE_COUNT])
{
    us[KD_PHASE_FORM] = span_us(t->formed_ns, t->submit_ns);
    us[KD_PHASE_STAGE] = span_us(t->submit_ns, t->staged_ns);
    us[KD_PHASE_LAUNCH] = span_us(t->staged_ns, t->launched_ns);
    us[KD_PHASE_WAIT] = span_us(t->launched_ns, t->signaled_ns);
    us[KD_PHASE_NOTICE] = span_us(t->signaled_ns, t->done_ns);
    us[KD_PHASE_UNSTAGE] = span_us(t->done_ns, t->unstaged_ns);
    us[KD_PHASE_REPLY] = span_us(t->unstaged_ns, t->replied_ns);
    us[KD_PHASE_TOTAL] = span_us(t->formed_ns, t->replied_ns);
    us[KD_PHASE_DEVICE] = t->device_ns / 1000;
    us[KD_PHASE_KERNEL] = t->kernel_ns / 1000;
    us[KD_PHASE_HOST] = us[KD_PHASE_TOTAL] > us[KD_PHASE_DEVICE]
                            ? us[KD_PHASE_TOTAL] - us[KD_PHASE_DEVICE] : 0;
}

void kd_stats_batch(kd_stats *s, const kd_batch_timing *t)
{
    uint64_t us[KD_PHASE_COUNT];
    kd_batch_phases(t, us);
    uint32_t *row = s->phase_ring[s->ring_next];
    for (int p = 0; p < KD_PHASE_COUNT; p++) {
        s->phase_sum[p] += us[p];
        row[p] = us[p] > UINT32_MAX ? UINT32_MAX : (uint32_t)us[p];
    }
    s->ring_next = (s->ring_next + 1) % KD_PHASE_WINDOW;
    if (s->ring_len < KD_PHASE_WINDOW)
        s->ring_len++;
    s->batches_timed++;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank quantile q of sorted v[0..n). */
static uint64_t rank_of(const uint32_t *v, uint32_t n, double q)
{
    if (n == 0)
        return 0;
    uint64_t rank = (uint64_t)ceil(q * (double)n);
    return v[rank ? rank - 1 : 0];
}

/* The window's quantiles of every phase into v->phases. */
static void phase_quantiles(const kd_stats *s, kd_stats_view *v)
{
    uint32_t col[KD_PHASE_WINDOW];
    for (int p = 0; p < KD_PHASE_COUNT; p++) {
        for (uint32_t i = 0; i < s->ring_len; i++)
            col[i] = s->phase_ring[i][p];
        qsort(col, s->ring_len, sizeof(col[0]), cmp_u32);
        v->phases[p] = (kp_phase){phase_names[p], rank_of(col, s->ring_len, 0.50),
                                  rank_of(col, s->ring_len, 0.90),
                                  rank_of(col, s->ring_len, 0.99), s->phase_sum[p]};
    }
}

void kd_stats_init(kd_stats *s, uint64_t now_ns)
{
    memset(s, 0, sizeof(*s));
    s->start_ns = now_ns;
    /* 10, 20, 50, 100, ... 50 000 000, 100 000 000 microseconds */
    static const uint64_t steps[3] = {1, 2, 5};
    uint64_t decade = 10;
    for (int i = 0; i < KD_LAT_BOUNDS; i++) {
        s->lat_bounds[i] = decade * steps[i % 3];
        if (i % 3 == 2)
            decade *= 10;
    }
}

void kd_stats_latency(kd_stats *s, uint64_t us)
{
    int b = 0;
    while (b < KD_LAT_BOUNDS && us > s->lat_bounds[b])
        b++;
    s->lat_counts[b]++;
    s->lat_count++;
    s->lat_sum += us;
    if (us > s->lat_max)
        s->lat_max = us;
}

void kd_stats_error(kd_stats *s, int code)
{
    if (code < 0 && -code < KD_ERROR_SLOTS)
        s->errors[-code]++;
}

/* The upper bound of the bucket holding quantile q (the max beyond the last
 * bound, and never above the max). */
static uint64_t quantile(const kd_stats *s, double q)
{
    if (s->lat_count == 0)
        return 0;
    /* nearest rank: the smallest value with at least q of all at or below it */
    uint64_t rank = (uint64_t)ceil(q * (double)s->lat_count);
    if (rank == 0)
        rank = 1;
    uint64_t seen = 0;
    for (int b = 0; b <= KD_LAT_BOUNDS; b++) {
        seen += s->lat_counts[b];
        if (seen >= rank)
            return b < KD_LAT_BOUNDS && s->lat_bounds[b] < s->lat_max ? s->lat_bounds[b]
                                                                       : s->lat_max;
    }
    return s->lat_max;
}

void kd_stats_result(const kd_stats *s, const kd_stats_gauges *g, uint64_t now_ns,
                     kd_stats_view *v, kp_stats_result *r)
{
    memset(r, 0, sizeof(*r));
    r->uptime_us = (now_ns - s->start_ns) / 1000;
    r->connections = s->connections;
    r->connections_total = s->connections_total;
    r->requests = s->requests;
    r->batches = s->batches;
    r->batches_held = s->batches_held;
    r->batches_gathered = s->batches_gathered;
    r->seqs = s->seqs;
    r->tokens = s->tokens;
    r->latency_count = s->lat_count;
    r->latency_p50_us = quantile(s, 0.50);
    r->latency_p90_us = quantile(s, 0.90);
    r->latency_p99_us = quantile(s, 0.99);
    r->latency_max_us = s->lat_max;
    r->latency_bounds_us = s->lat_bounds;
    r->latency_counts = s->lat_counts;
    r->latency_nbounds = KD_LAT_BOUNDS;
    r->slots_total = g->slots_total;
    r->slots_used = g->slots_used;
    r->slots_lost = g->slots_lost;
    r->layers = g->layers;
    r->regions = g->regions;
    r->rings = g->rings;
    r->ring_doorbells = g->ring_doorbells;
    r->has_memory = g->has_memory;
    r->memory = g->memory;
    for (int c = 1; c < KD_ERROR_SLOTS; c++) {
        if (s->errors[c])
            v->errors[r->nerrors++] = (kp_counter){kp_code_name(-c), s->errors[c]};
    }
    r->errors = v->errors;
    for (int d = 0; d < KD_DISC_COUNT; d++) {
        if (s->disconnects[d])
            v->disconnects[r->ndisconnects++] = (kp_counter){disconnect_names[d],
                                                             s->disconnects[d]};
    }
    r->disconnects = v->disconnects;
    memcpy(r->bytes_in, s->bytes_in, sizeof(r->bytes_in));
    memcpy(r->bytes_out, s->bytes_out, sizeof(r->bytes_out));
    phase_quantiles(s, v);
    r->has_batch_phases = true;
    r->batch_count = s->batches_timed;
    r->batch_window = s->ring_len;
    r->phases = v->phases;
    r->nphases = KD_PHASE_COUNT;
}

char *kd_stats_prometheus(const kd_stats *s, const kd_stats_gauges *g, uint64_t now_ns)
{
    static const char *const transports[KP_TRANSPORT_ID_COUNT] = {"inline", "shm", "cuda_ipc"};
    kd_stats_view v;
    kp_stats_result res;
    const kp_stats_result *r = &res;
    kd_stats_result(s, g, now_ns, &v, &res);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f)
        return NULL;
#define METRIC(name, type, help) fprintf(f, "# HELP kdad_" name " " help "\n# TYPE kdad_" name " " type "\n")
    METRIC("uptime_seconds", "gauge", "Seconds since kdad started.");
    fprintf(f, "kdad_uptime_seconds %.3f\n", (double)r->uptime_us / 1e6);
    METRIC("connections", "gauge", "Open client connections.");
    fprintf(f, "kdad_connections %u\n", r->connections);
    METRIC("connections_total", "counter", "Connections accepted.");
    fprintf(f, "kdad_connections_total %llu\n", (unsigned long long)r->connections_total);
    METRIC("requests_total", "counter", "Requests answered, every method, success or error.");
    fprintf(f, "kdad_requests_total %llu\n", (unsigned long long)r->requests);
    METRIC("batches_total", "counter", "Backend launches.");
    fprintf(f, "kdad_batches_total %llu\n", (unsigned long long)r->batches);
    METRIC("batches_held_total", "counter",
           "Batches held back while the device was busy (batching.hold_while_busy).");
    fprintf(f, "kdad_batches_held_total %llu\n", (unsigned long long)s->batches_held);
    METRIC("batches_gathered_total", "counter",
           "Batches held on an idle device for a fuller last wave (batching.gather_us).");
    fprintf(f, "kdad_batches_gathered_total %llu\n", (unsigned long long)s->batches_gathered);
    METRIC("sequences_total", "counter", "Prefill sequences completed.");
    fprintf(f, "kdad_sequences_total %llu\n", (unsigned long long)r->seqs);
    METRIC("tokens_total", "counter", "Prefill tokens completed.");
    fprintf(f, "kdad_tokens_total %llu\n", (unsigned long long)r->tokens);
    METRIC("queued_requests", "gauge", "Admitted requests waiting for the device.");
    fprintf(f, "kdad_queued_requests %u\n", g->queued);
    METRIC("running_batches", "gauge", "Batches on the device.");
    fprintf(f, "kdad_running_batches %u\n", g->running);
    METRIC("pool_slots", "gauge", "State pool slots by state.");
    fprintf(f, "kdad_pool_slots{state=\"total\"} %u\nkdad_pool_slots{state=\"used\"} %u\n"
            "kdad_pool_slots{state=\"lost\"} %u\n", r->slots_total, r->slots_used, r->slots_lost);
    METRIC("layers", "gauge", "Layers registered.");
    fprintf(f, "kdad_layers %u\n", r->layers);
    METRIC("regions", "gauge", "Client memory regions registered.");
    fprintf(f, "kdad_regions %u\n", r->regions);
    METRIC("rings", "gauge", "Connections whose frames use a frame ring.");
    fprintf(f, "kdad_rings %u\n", r->rings);
    METRIC("ring_doorbells_total", "counter",
           "Doorbells rung to frame-ring clients that said they sleep.");
    fprintf(f, "kdad_ring_doorbells_total %llu\n", (unsigned long long)r->ring_doorbells);
    if (r->has_memory) {
        const kp_memory *m = &r->memory;
        const struct { const char *use; uint64_t bytes; } uses[] = {
            {"pool", m->pool},   {"staging", m->staging}, {"scratch", m->scratch},
            {"kernel", m->kernel}, {"lanes", m->lanes},   {"layers", m->layers}};
        METRIC("memory_bytes", "gauge",
               "Memory kdad holds for its backend, by use (device memory on cuda, host on cpu).");
        for (size_t u = 0; u < sizeof(uses) / sizeof(uses[0]); u++)
            fprintf(f, "kdad_memory_bytes{use=\"%s\"} %llu\n", uses[u].use,
                    (unsigned long long)uses[u].bytes);
    }
    static const char *const held_names[KD_HELD_COUNT] = {
#define KD_HELD_NAME(id, name) name,
        KD_HELD(KD_HELD_NAME)
#undef KD_HELD_NAME
    };
    METRIC("held_bytes", "gauge", "Bytes clients make kdad hold, by kind.");
    for (int k = 0; k < KD_HELD_COUNT; k++)
        fprintf(f, "kdad_held_bytes{kind=\"%s\"} %llu\n", held_names[k],
                (unsigned long long)g->held[k].now);
    METRIC("held_bytes_peak", "gauge", "The most bytes clients made kdad hold since start, by kind.");
    for (int k = 0; k < KD_HELD_COUNT; k++)
        fprintf(f, "kdad_held_bytes_peak{kind=\"%s\"} %llu\n", held_names[k],
                (unsigned long long)g->held[k].peak);
    METRIC("held_bytes_bound", "gauge", "The bounds on them, by configuration key.");
    for (int k = 0; k < KD_HELD_COUNT; k++) {
        if (g->held[k].uid_key)
            fprintf(f, "kdad_held_bytes_bound{kind=\"%s\",key=\"%s\"} %llu\n", held_names[k],
                    g->held[k].uid_key, (unsigned long long)g->held[k].bound_uid);
        if (g->held[k].total_key)
            fprintf(f, "kdad_held_bytes_bound{kind=\"%s\",key=\"%s\"} %llu\n", held_names[k],
                    g->held[k].total_key, (unsigned long long)g->held[k].bound_total);
    }
    METRIC("errors_total", "counter", "Errors answered, by code name.");
    for (uint32_t i = 0; i < r->nerrors; i++)
        fprintf(f, "kdad_errors_total{code=\"%s\"} %llu\n", r->errors[i].name,
                (unsigned long long)r->errors[i].value);
    METRIC("disconnects_total", "counter", "Connections closed, by reason.");
    for (uint32_t i = 0; i < r->ndisconnects; i++)
        fprintf(f, "kdad_disconnects_total{reason=\"%s\"} %llu\n", r->disconnects[i].name,
                (unsigned long long)r->disconnects[i].value);
    METRIC("transport_bytes_total", "counter", "Tensor bytes moved, by transport and direction.");
    for (int t = 0; t < KP_TRANSPORT_ID_COUNT; t++)
        fprintf(f, "kdad_transport_bytes_total{transport=\"%s\",direction=\"in\"} %llu\n"
                "kdad_transport_bytes_total{transport=\"%s\",direction=\"out\"} %llu\n",
                transports[t], (unsigned long long)r->bytes_in[t], transports[t],
                (unsigned long long)r->bytes_out[t]);
    METRIC("prefill_latency_seconds", "histogram",
           "Prefill latency from the frame's arrival to its response being queued.");
    uint64_t cumulative = 0;
    for (uint32_t b = 0; b < r->latency_nbounds; b++) {
        cumulative += r->latency_counts[b];
        fprintf(f, "kdad_prefill_latency_seconds_bucket{le=\"%g\"} %llu\n",
                (double)r->latency_bounds_us[b] / 1e6, (unsigned long long)cumulative);
    }
    fprintf(f, "kdad_prefill_latency_seconds_bucket{le=\"+Inf\"} %llu\n",
            (unsigned long long)r->latency_count);
    fprintf(f, "kdad_prefill_latency_seconds_sum %.6f\n", (double)s->lat_sum / 1e6);
    fprintf(f, "kdad_prefill_latency_seconds_count %llu\n", (unsigned long long)r->latency_count);
    METRIC("batch_phase_seconds", "summary",
           "Time per batch by phase (form, stage, launch, wait, notice, unstage, reply, total, "
           "device, kernel, host); quantiles over the most recent batches, sum and count since "
           "start.");
    static const char *const qs[3] = {"0.5", "0.9", "0.99"};
    for (uint32_t p = 0; p < r->nphases; p++) {
        const kp_phase *ph = &r->phases[p];
        const uint64_t q[3] = {ph->p50_us, ph->p90_us, ph->p99_us};
        for (int i = 0; i < 3; i++)
            fprintf(f, "kdad_batch_phase_seconds{phase=\"%s\",quantile=\"%s\"} %.6f\n", ph->name,
                    qs[i], (double)q[i] / 1e6);
        fprintf(f, "kdad_batch_phase_seconds_sum{phase=\"%s\"} %.6f\n"
                "kdad_batch_phase_seconds_count{phase=\"%s\"} %llu\n", ph->name,
                (double)ph->sum_us / 1e6, ph->name, (unsigned long long)r->batch_count);
    }
#undef METRIC
    if (fclose(f) != 0) {
        free(text);
        return NULL;
    }
    return text;
}
