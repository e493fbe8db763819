/*
 * test_proto_ring.c - the frame ring's shared memory streams (proto/ring.c):
 * bytes arrive intact and in order across the wrap in both directions, a
 * full ring takes nothing and an empty one gives nothing, counters no honest
 * peer could write are refused before a byte is copied, wants reach the
 * peer, and ring.attach's size rules.
 */
#include <stdlib.h>
#include <string.h>

#include "kdaproto.h"
#include "test_proto_harness.h"

#define SIZE 4096u

typedef struct pair {
    void *mem;
    kp_ring daemon, client;
} pair;

static void pair_init(pair *p)
{
    p->mem = calloc(1, KP_RING_HEADER_BYTES + 2 * SIZE);
    assert_non_null(p->mem);
    kp_ring_init(&p->client, p->mem, SIZE, false, KP_RING_WANT_DATA);
    kp_ring_init(&p->daemon, p->mem, SIZE, true, 0);
}

static size_t put(kp_ring *r, const uint8_t *src, size_t n)
{
    struct iovec v[2] = {{(void *)src, n / 3}, {(void *)(src + n / 3), n - n / 3}};
    size_t done;
    assert_int_equal(kp_ring_writev(r, v, 2, &done, NULL), KP_OK);
    return done;
}

static size_t get(kp_ring *r, uint8_t *dst, size_t n)
{
    size_t done;
    assert_int_equal(kp_ring_read(r, dst, n, &done, NULL), KP_OK);
    return done;
}

/* Random chunk sizes, both directions, many wraps: every byte arrives once,
 * in order. */
static void test_streams_intact(void **unused)
{
    (void)unused;
    pair p;
    pair_init(&p);
    kp_ring *ends[2][2] = {{&p.client, &p.daemon}, {&p.daemon, &p.client}};
    uint32_t seed = 7;
    for (int dir = 0; dir < 2; dir++) {
        kp_ring *w = ends[dir][0], *r = ends[dir][1];
        enum { TOTAL = 200000 };
        uint8_t *src = malloc(TOTAL), *dst = malloc(TOTAL);
        for (size_t i = 0; i < TOTAL; i++)
            src[i] = (uint8_t)(i * 131 + dir);
        size_t sent = 0, got = 0;
        while (got < TOTAL) {
            seed = seed * 1103515245u + 12345u;
            size_t want = 1 + (seed >> 8) % 3000;
            if (sent < TOTAL)
                sent += put(w, src + sent, want < TOTAL - sent ? want : TOTAL - sent);
            assert_true(sent - got <= SIZE);
            seed = seed * 1103515245u + 12345u;
            got += get(r, dst + got, 1 + (seed >> 8) % 3000);
        }
        assert_memory_equal(src, dst, TOTAL);
        assert_false(kp_ring_readable(r));
        free(src);
        free(dst);
    }
    free(p.mem);
}

static void test_full_and_empty(void **unused)
{
    (void)unused;
    pair p;
    pair_init(&p);
    uint8_t buf[SIZE + 100];
    memset(buf, 0xab, sizeof(buf));
    assert_false(kp_ring_readable(&p.daemon));
    assert_int_equal(get(&p.daemon, buf, 10), 0);
    assert_int_equal(put(&p.client, buf, sizeof(buf)), SIZE); /* fills, no more */
    assert_false(kp_ring_writable(&p.client));
    assert_int_equal(put(&p.client, buf, 1), 0);
    assert_true(kp_ring_readable(&p.daemon));
    assert_int_equal(get(&p.daemon, buf, 1), 1);
    assert_true(kp_ring_writable(&p.client));
    assert_int_equal(put(&p.client, buf, 5), 1);
    free(p.mem);
}

/* Counters the peer could not have written: refused, nothing copied. */
static void test_impossible_counters(void **unused)
{
    (void)unused;
    pair p;
    pair_init(&p);
    kp_ring_header *h = p.mem;
    uint8_t buf[64];
    size_t n = 99;
    kp_error e;
    h->client.head = SIZE + 1; /* more than the ring holds */
    assert_int_equal(kp_ring_read(&p.daemon, buf, sizeof(buf), &n, &e), KP_E_PROTOCOL);
    assert_int_equal(n, 0);
    assert_non_null(strstr(e.message, "head"));
    assert_int_equal(p.daemon.tail, 0);
    h->client.head = (uint64_t)-5; /* behind our tail */
    assert_int_equal(kp_ring_read(&p.daemon, buf, sizeof(buf), &n, &e), KP_E_PROTOCOL);
    h->client.head = 0;

    struct iovec v = {buf, sizeof(buf)};
    h->client.tail = 1; /* ahead of what the daemon wrote */
    assert_int_equal(kp_ring_writev(&p.daemon, &v, 1, &n, &e), KP_E_PROTOCOL);
    assert_int_equal(n, 0);
    assert_non_null(strstr(e.message, "tail"));
    assert_int_equal(p.daemon.head, 0);
    h->client.tail = 0;
    assert_int_equal(kp_ring_writev(&p.daemon, &v, 1, &n, NULL), KP_OK);
    assert_int_equal(n, sizeof(buf));
    /* Our own counters in shared memory are only copies: scribbling on them
     * changes nothing. */
    h->daemon.head = 12345;
    assert_int_equal(kp_ring_writev(&p.daemon, &v, 1, &n, NULL), KP_OK);
    assert_int_equal(p.daemon.head, 2 * sizeof(buf));
    assert_int_equal(h->daemon.head, 2 * sizeof(buf));
    free(p.mem);
}

static void test_wants(void **unused)
{
    (void)unused;
    pair p;
    pair_init(&p);
    /* The client's init published WANT_DATA; the daemon's none. */
    assert_true(kp_ring_peer_wants(&p.daemon, KP_RING_WANT_DATA));
    assert_false(kp_ring_peer_wants(&p.daemon, KP_RING_WANT_SPACE));
    assert_false(kp_ring_peer_wants(&p.client, KP_RING_WANT_DATA));
    kp_ring_set_wants(&p.daemon, KP_RING_WANT_DATA | KP_RING_WANT_SPACE);
    assert_true(kp_ring_peer_wants(&p.client, KP_RING_WANT_SPACE));
    kp_ring_set_wants(&p.client, 0);
    assert_false(kp_ring_peer_wants(&p.daemon, KP_RING_WANT_DATA));
    free(p.mem);
}

static void test_sizes(void **unused)
{
    (void)unused;
    kp_error e;
    assert_int_equal(kp_ring_check_size(4096, KP_RING_HEADER_BYTES + 8192, NULL), KP_OK);
    assert_int_equal(kp_ring_check_size(4096, KP_RING_HEADER_BYTES + 8191, &e),
                     KP_E_REGION_INVALID);
    assert_int_equal(kp_ring_check_size(2048, UINT64_MAX, &e), KP_E_INVALID_PARAMS);
    assert_int_equal(kp_ring_check_size(6000, UINT64_MAX, &e), KP_E_INVALID_PARAMS);
    assert_non_null(strstr(e.message, "power of two"));
    assert_int_equal(kp_ring_check_size(KP_RING_MAX_SIZE * 2, UINT64_MAX, &e),
                     KP_E_INVALID_PARAMS);
    assert_int_equal(kp_ring_check_size(KP_RING_MAX_SIZE, 100, &e), KP_E_REGION_INVALID);
}

static void test_attach_params(void **unused)
{
    (void)unused;
    kp_ring_attach_params in = {3, 1u << 16}, out;
    ENC(kp_ring_attach_params_encode(&test_writer, 9, &in, &enc_err_));
    wire x;
    open_request(&x, KP_METHOD_RING_ATTACH, 9);
    DEC(kp_ring_attach_params_decode(&x.msg, &test_session, &out, &dec_err_));
    assert_int_equal(out.region, 3);
    assert_int_equal(out.size, 1u << 16);
    wire_close(&x);

    edit e;
    edit_begin(&e);
    edit_set(&e, e.map, "size", v_u64(5000));
    expect_refused(&e, KP_E_INVALID_PARAMS, "size: 5000 is not a power of two");
    edit_set(&e, e.map, "size", v_u64(1024));
    expect_refused(&e, KP_E_INVALID_PARAMS, "size: 1024 is outside");
    edit_set(&e, e.map, "size", v_u64(4096));
    edit_set(&e, e.map, "region", v_u64(0));
    expect_refused(&e, KP_E_INVALID_PARAMS, "region: 0 is outside");
    edit_set(&e, e.map, "region", v_u64(1));
    expect_accepted(&e);
    edit_del(e.map, "size");
    expect_refused(&e, KP_E_INVALID_PARAMS, "size: required field is missing");
    edit_end(&e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_streams_intact),
        cmocka_unit_test(test_full_and_empty),
        cmocka_unit_test(test_impossible_counters),
        cmocka_unit_test(test_wants),
        cmocka_unit_test(test_sizes),
        cmocka_unit_test(test_attach_params),
    };
    return cmocka_run_group_tests(tests, harness_setup, harness_teardown);
}
