/*
 * test_stats.c - daemon/stats.c: the latency histogram and its quantiles,
 * the error and disconnect counters, the stats result, and the Prometheus
 * text rendering.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "stats.h"

static void has(const char *text, const char *line)
{
    if (!strstr(text, line))
        fail_msg("\"%s\" missing from:\n%s", line, text);
}

static void test_histogram_and_quantiles(void **unused)
{
    kd_stats s;
    kd_stats_init(&s, 0);
    assert_int_equal(s.lat_bounds[0], 10);
    assert_int_equal(s.lat_bounds[1], 20);
    assert_int_equal(s.lat_bounds[2], 50);
    assert_int_equal(s.lat_bounds[3], 100);
    assert_int_equal(s.lat_bounds[KD_LAT_BOUNDS - 1], 100000000);
    const uint64_t us[] = {5, 15, 15, 18, 1000, 200000000};
    for (size_t i = 0; i < sizeof(us) / sizeof(us[0]); i++)
        kd_stats_latency(&s, us[i]);
    assert_int_equal(s.lat_counts[0], 1); /* <= 10 */
    assert_int_equal(s.lat_counts[1], 3); /* <= 20 */
    assert_int_equal(s.lat_counts[KD_LAT_BOUNDS], 1); /* beyond every bound */
    kd_stats_gauges g = {.slots_total = 8, .slots_used = 3};
    kd_stats_view v;
    kp_stats_result r;
    kd_stats_result(&s, &g, 5000000000ull, &v, &r);
    assert_int_equal(r.uptime_us, 5000000);
    assert_int_equal(r.latency_count, 6);
    assert_int_equal(r.latency_p50_us, 20);  /* rank 3 of 6 is in the (10, 20] bucket */
    assert_int_equal(r.latency_p90_us, 200000000); /* in the overflow bucket: the max */
    assert_int_equal(r.latency_max_us, 200000000);
    assert_int_equal(r.latency_nbounds, KD_LAT_BOUNDS);
    assert_int_equal(r.slots_used, 3);
}

static void test_counters_and_prometheus(void **unused)
{
    kd_stats s;
    kd_stats_init(&s, 0);
    s.requests = 7;
    s.connections = 2;
    kd_stats_error(&s, KP_E_INVALID_PARAMS);
    kd_stats_error(&s, KP_E_INVALID_PARAMS);
    kd_stats_error(&s, KP_E_BUSY);
    kd_stats_error(&s, 0); /* not an error: ignored */
    s.disconnects[KD_DISC_PEER_CLOSED] = 4;
    s.bytes_in[KP_TRANSPORT_ID_SHM] = 1234;
    s.batches_held = 3;
    s.batches_gathered = 2;
    kd_stats_latency(&s, 30);
    kd_stats_latency(&s, 70);
    assert_string_equal(kd_disconnect_name(KD_DISC_OUTPUT_LIMIT), "output_limit");

    kd_stats_gauges g = {.slots_total = 8, .slots_used = 3, .slots_lost = 1, .layers = 2,
                         .rings = 1, .queued = 5, .running = 1,
                         .ring_doorbells = 17, .has_memory = true,
                         .memory = {.pool = 1ull << 30, .scratch = 256ull << 20, .total = 1ull << 31}};
    kd_stats_view v;
    kp_stats_result r;
    kd_stats_result(&s, &g, 0, &v, &r);
    assert_int_equal(r.batches_held, 3);
    assert_int_equal(r.batches_gathered, 2);
    assert_int_equal(r.rings, 1);
    assert_int_equal(r.ring_doorbells, 17);
    assert_true(r.has_memory);
    assert_int_equal(r.memory.scratch, 256 << 20);
    assert_int_equal(r.nerrors, 2);
    assert_string_equal(r.errors[0].name, "INVALID_PARAMS");
    assert_int_equal(r.errors[0].value, 2);
    assert_string_equal(r.errors[1].name, "BUSY");
    assert_int_equal(r.ndisconnects, 1);
    assert_string_equal(r.disconnects[0].name, "peer_closed");

    char *text = kd_stats_prometheus(&s, &g, 2000000000ull);
    assert_non_null(text);
    has(text, "# TYPE kdad_requests_total counter\nkdad_requests_total 7\n");
    has(text, "kdad_connections 2\n");
    has(text, "kdad_uptime_seconds 2.000\n");
    has(text, "kdad_errors_total{code=\"INVALID_PARAMS\"} 2\n");
    has(text, "kdad_errors_total{code=\"BUSY\"} 1\n");
    has(text, "kdad_disconnects_total{reason=\"peer_closed\"} 4\n");
    has(text, "kdad_pool_slots{state=\"used\"} 3\n");
    has(text, "kdad_pool_slots{state=\"lost\"} 1\n");
    has(text, "kdad_queued_requests 5\n");
    has(text, "# TYPE kdad_batches_held_total counter\nkdad_batches_held_total 3\n");
    has(text, "# TYPE kdad_batches_gathered_total counter\nkdad_batches_gathered_total 2\n");
    has(text, "# TYPE kdad_rings gauge\nkdad_rings 1\n");
    has(text, "# TYPE kdad_ring_doorbells_total counter\nkdad_ring_doorbells_total 17\n");
    has(text, "kdad_transport_bytes_total{transport=\"shm\",direction=\"in\"} 1234\n");
    has(text, "# TYPE kdad_memory_bytes gauge\nkdad_memory_bytes{use=\"pool\"} 1073741824\n");
    has(text, "kdad_memory_bytes{use=\"scratch\"} 268435456\nkdad_memory_bytes{use=\"kernel\"} 0\n");
    /* cumulative buckets: 30 us is <= 5e-05 s, 70 us <= 0.0001 s */
    has(text, "kdad_prefill_latency_seconds_bucket{le=\"2e-05\"} 0\n");
    has(text, "kdad_prefill_latency_seconds_bucket{le=\"5e-05\"} 1\n");
    has(text, "kdad_prefill_latency_seconds_bucket{le=\"0.0001\"} 2\n");
    has(text, "kdad_prefill_latency_seconds_bucket{le=\"+Inf\"} 2\n");
    has(text, "kdad_prefill_latency_seconds_sum 0.000100\n");
    has(text, "kdad_prefill_latency_seconds_count 2\n");
    free(text);
}

/* A batch whose every step took a known time (microseconds). */
static kd_batch_timing timing(uint64_t base_us, uint64_t step_us, uint64_t device_us)
{
    uint64_t t = base_us * 1000, d = step_us * 1000;
    return (kd_batch_timing){.formed_ns = t, .submit_ns = t + d, .staged_ns = t + 2 * d,
                             .launched_ns = t + 3 * d, .signaled_ns = t + 4 * d,
                             .done_ns = t + 5 * d, .unstaged_ns = t + 6 * d,
                             .replied_ns = t + 7 * d, .device_ns = device_us * 1000,
                             .kernel_ns = device_us * 500};
}

static void test_batch_phases(void **unused)
{
    uint64_t us[KD_PHASE_COUNT];
    kd_batch_timing t = timing(1000, 10, 50);
    kd_batch_phases(&t, us);
    assert_int_equal(us[KD_PHASE_FORM], 10);
    assert_int_equal(us[KD_PHASE_STAGE], 10);
    assert_int_equal(us[KD_PHASE_LAUNCH], 10);
    assert_int_equal(us[KD_PHASE_WAIT], 10);
    assert_int_equal(us[KD_PHASE_NOTICE], 10);
    assert_int_equal(us[KD_PHASE_UNSTAGE], 10);
    assert_int_equal(us[KD_PHASE_REPLY], 10);
    assert_int_equal(us[KD_PHASE_TOTAL], 70);
    assert_int_equal(us[KD_PHASE_DEVICE], 50);
    assert_int_equal(us[KD_PHASE_KERNEL], 25);
    assert_int_equal(us[KD_PHASE_HOST], 20);
    assert_string_equal(kd_phase_name(KD_PHASE_NOTICE), "notice");
    assert_string_equal(kd_phase_name(KD_PHASE_HOST), "host");
    /* A step that was not stamped counts 0, and so do the spans around it. */
    t.signaled_ns = 0;
    t.device_ns = 900000; /* longer than the whole: host clamps at 0 */
    kd_batch_phases(&t, us);
    assert_int_equal(us[KD_PHASE_WAIT], 0);
    assert_int_equal(us[KD_PHASE_NOTICE], 0);
    assert_int_equal(us[KD_PHASE_TOTAL], 70);
    assert_int_equal(us[KD_PHASE_HOST], 0);

    /* 100 batches with wait = 1..100 us: nearest-rank quantiles and sums. */
    kd_stats *s = malloc(sizeof(*s));
    assert_non_null(s);
    kd_stats_init(s, 0);
    for (uint64_t i = 1; i <= 100; i++) {
        kd_batch_timing b = timing(5000 * i, 1, 3);
        b.signaled_ns = b.launched_ns + i * 1000;
        b.done_ns = b.signaled_ns + 2000;
        b.unstaged_ns = b.done_ns;
        b.replied_ns = b.done_ns + 1000;
        kd_stats_batch(s, &b);
    }
    kd_stats_gauges g = {0};
    kd_stats_view v;
    kp_stats_result r;
    kd_stats_result(s, &g, 0, &v, &r);
    assert_true(r.has_batch_phases);
    assert_int_equal(r.batch_count, 100);
    assert_int_equal(r.batch_window, 100);
    assert_int_equal(r.nphases, KD_PHASE_COUNT);
    const kp_phase *w = &r.phases[KD_PHASE_WAIT];
    assert_string_equal(w->name, "wait");
    assert_int_equal(w->p50_us, 50);
    assert_int_equal(w->p90_us, 90);
    assert_int_equal(w->p99_us, 99);
    assert_int_equal(w->sum_us, 5050);
    assert_int_equal(r.phases[KD_PHASE_NOTICE].p50_us, 2);
    assert_int_equal(r.phases[KD_PHASE_UNSTAGE].sum_us, 0);
    assert_int_equal(r.phases[KD_PHASE_DEVICE].sum_us, 300);
    assert_int_equal(r.phases[KD_PHASE_TOTAL].p50_us, 3 + 50 + 2 + 1);

    /* The window keeps the most recent KD_PHASE_WINDOW batches; sums keep all. */
    for (uint64_t i = 0; i < KD_PHASE_WINDOW; i++) {
        kd_batch_timing b = timing(1000000 + 100 * i, 1, 3);
        b.signaled_ns = b.launched_ns + 7000;
        b.done_ns = b.signaled_ns;
        kd_stats_batch(s, &b);
    }
    kd_stats_result(s, &g, 0, &v, &r);
    assert_int_equal(r.batch_count, 100 + KD_PHASE_WINDOW);
    assert_int_equal(r.batch_window, KD_PHASE_WINDOW);
    assert_int_equal(r.phases[KD_PHASE_WAIT].p50_us, 7);
    assert_int_equal(r.phases[KD_PHASE_WAIT].p99_us, 7);
    assert_int_equal(r.phases[KD_PHASE_WAIT].sum_us, 5050 + 7 * KD_PHASE_WINDOW);

    char *text = kd_stats_prometheus(s, &g, 0);
    assert_non_null(text);
    has(text, "# TYPE kdad_batch_phase_seconds summary\n");
    has(text, "kdad_batch_phase_seconds{phase=\"wait\",quantile=\"0.5\"} 0.000007\n");
    has(text, "kdad_batch_phase_seconds{phase=\"wait\",quantile=\"0.99\"} 0.000007\n");
    has(text, "kdad_batch_phase_seconds_sum{phase=\"wait\"} 0.012218\n");
    has(text, "kdad_batch_phase_seconds_count{phase=\"device\"} 1124\n");
    free(text);
    free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_histogram_and_quantiles),
        cmocka_unit_test(test_counters_and_prometheus),
        cmocka_unit_test(test_batch_phases),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
