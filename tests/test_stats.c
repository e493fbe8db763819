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
    kd_stats_latency(&s, 30);
    kd_stats_latency(&s, 70);
    assert_string_equal(kd_disconnect_name(KD_DISC_OUTPUT_LIMIT), "output_limit");

    kd_stats_gauges g = {.slots_total = 8, .slots_used = 3, .slots_lost = 1, .layers = 2,
                         .queued = 5, .running = 1};
    kd_stats_view v;
    kp_stats_result r;
    kd_stats_result(&s, &g, 0, &v, &r);
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
    has(text, "kdad_transport_bytes_total{transport=\"shm\",direction=\"in\"} 1234\n");
    /* cumulative buckets: 30 us is <= 5e-05 s, 70 us <= 0.0001 s */
    has(text, "kdad_prefill_latency_seconds_bucket{le=\"2e-05\"} 0\n");
    has(text, "kdad_prefill_latency_seconds_bucket{le=\"5e-05\"} 1\n");
    has(text, "kdad_prefill_latency_seconds_bucket{le=\"0.0001\"} 2\n");
    has(text, "kdad_prefill_latency_seconds_bucket{le=\"+Inf\"} 2\n");
    has(text, "kdad_prefill_latency_seconds_sum 0.000100\n");
    has(text, "kdad_prefill_latency_seconds_count 2\n");
    free(text);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_histogram_and_quantiles),
        cmocka_unit_test(test_counters_and_prometheus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
