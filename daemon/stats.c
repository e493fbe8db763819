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

const char *kd_disconnect_name(kd_disconnect d)
{
    return (unsigned)d < KD_DISC_COUNT ? disconnect_names[d] : "unknown";
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
#undef METRIC
    if (fclose(f) != 0) {
        free(text);
        return NULL;
    }
    return text;
}
