/*
 * test_quota.c - daemon/quota.c: per-uid connections and unanswered bytes,
 * each uid on its own, charges that stand until refunded, and entries that
 * go once a uid holds nothing.  (test_access drives the same through a real
 * kdad and real uids.)
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <string.h>

#include "quota.h"

static void test_connections_per_uid(void **unused)
{
    kd_quota q;
    kp_error e;
    kd_quota_init(&q);
    assert_int_equal(kd_quota_connect(&q, 1000, 2, &e), KP_OK);
    assert_int_equal(kd_quota_connect(&q, 1000, 2, &e), KP_OK);
    assert_int_equal(kd_quota_connect(&q, 1000, 2, &e), KP_E_QUOTA_EXCEEDED);
    assert_non_null(strstr(e.message, "uid 1000 has 2 connections open"));
    assert_false(e.retryable);
    assert_int_equal(kd_quota_connect(&q, 0, 2, &e), KP_OK); /* another uid */
    assert_int_equal(kd_quota_use(&q, 1000).connections, 2);
    kd_quota_disconnect(&q, 1000);
    assert_int_equal(kd_quota_connect(&q, 1000, 2, &e), KP_OK);
    /* a lower limit (after a reload) refuses new ones, keeps the open ones */
    assert_int_equal(kd_quota_connect(&q, 1000, 1, &e), KP_E_QUOTA_EXCEEDED);
    assert_int_equal(kd_quota_use(&q, 1000).connections, 2);
    kd_quota_disconnect(&q, 1000);
    kd_quota_disconnect(&q, 1000);
    kd_quota_disconnect(&q, 0);
    assert_int_equal(q.n, 0); /* nothing held: no entries */
    kd_quota_disconnect(&q, 7); /* never counted: nothing happens */
    assert_int_equal(q.n, 0);
    kd_quota_destroy(&q);
}

static void test_inflight_bytes_per_uid(void **unused)
{
    kd_quota q;
    kp_error e;
    kd_quota_init(&q);
    assert_int_equal(kd_quota_connect(&q, 5, 10, &e), KP_OK);
    assert_int_equal(kd_quota_connect(&q, 5, 10, &e), KP_OK);
    assert_int_equal(kd_quota_connect(&q, 6, 10, &e), KP_OK);
    assert_int_equal(kd_quota_charge(&q, 5, 600, 1000, UINT64_MAX, &e), KP_OK);
    assert_int_equal(kd_quota_charge(&q, 5, 400, 1000, UINT64_MAX, &e), KP_OK); /* exactly the quota */
    assert_int_equal(kd_quota_charge(&q, 5, 1, 1000, UINT64_MAX, &e), KP_E_BUSY);
    assert_non_null(strstr(e.message, "uid 5 would hold 1001 bytes"));
    assert_int_equal(kd_quota_use(&q, 5).inflight_bytes, 1001); /* the charge stands */
    assert_int_equal(kd_quota_charge(&q, 6, 1000, 1000, UINT64_MAX, &e), KP_OK); /* per uid */
    kd_quota_refund(&q, 5, 1);
    kd_quota_refund(&q, 5, 600);
    assert_int_equal(kd_quota_charge(&q, 5, 600, 1000, UINT64_MAX, &e), KP_OK);
    /* a closed connection's requests still hold bytes until they are answered */
    kd_quota_disconnect(&q, 5);
    kd_quota_disconnect(&q, 5);
    assert_int_equal(kd_quota_use(&q, 5).connections, 0);
    assert_int_equal(kd_quota_use(&q, 5).inflight_bytes, 1000);
    kd_quota_refund(&q, 5, 1000);
    kd_uid_use u = kd_quota_use(&q, 5);
    assert_int_equal(u.connections + u.inflight_bytes, 0);
    assert_int_equal(q.n, 1); /* uid 6 */
    /* a charge needs a connection of that uid: a caller's bug, reported */
    assert_int_equal(kd_quota_charge(&q, 5, 1, 1000, UINT64_MAX, &e), KP_E_INTERNAL);
    kd_quota_destroy(&q);
}

/* clients.max_inflight_bytes_total: all uids together, each under its own quota. */
static void test_inflight_bytes_total(void **unused)
{
    kd_quota q;
    kp_error e;
    kd_quota_init(&q);
    assert_int_equal(kd_quota_connect(&q, 5, 10, &e), KP_OK);
    assert_int_equal(kd_quota_connect(&q, 6, 10, &e), KP_OK);
    assert_int_equal(kd_quota_charge(&q, 5, 700, 1000, 1500, &e), KP_OK);
    assert_int_equal(kd_quota_charge(&q, 6, 800, 1000, 1500, &e), KP_OK); /* exactly the total */
    assert_int_equal(q.inflight_bytes, 1500);
    assert_int_equal(kd_quota_charge(&q, 6, 1, 1000, 1500, &e), KP_E_BUSY);
    assert_non_null(strstr(e.message, "the daemon would hold 1501 bytes"));
    assert_non_null(strstr(e.message, "clients.max_inflight_bytes_total 1500"));
    assert_int_equal(q.inflight_bytes, 1501); /* the charge stands */
    kd_quota_refund(&q, 6, 1);
    kd_quota_refund(&q, 5, 700);
    assert_int_equal(q.inflight_bytes, 800);
    assert_int_equal(kd_quota_charge(&q, 5, 700, 1000, 1500, &e), KP_OK);
    /* a refund larger than what the uid holds gives back only what it holds */
    kd_quota_refund(&q, 6, 5000);
    assert_int_equal(q.inflight_bytes, 700);
    kd_quota_refund(&q, 5, 700);
    assert_int_equal(q.inflight_bytes, 0);
    kd_quota_destroy(&q);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_connections_per_uid),
        cmocka_unit_test(test_inflight_bytes_per_uid),
        cmocka_unit_test(test_inflight_bytes_total),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
