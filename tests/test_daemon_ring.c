/*
 * test_daemon_ring.c - the frame ring (PROTOCOL.md §Frame ring) end to end:
 * libkdaclient over a ring gives bit for bit what it gives over the socket
 * (frames larger than the ring streaming both ways, a descriptor passed
 * after the attach, a spinning client, requests pipelined from an event
 * loop); ring.attach's refusals; a client scribbling impossible counters or
 * garbage into the ring loses its own connection only; a closed connection
 * unmaps its ring.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "daemon_kdac.h"

static const char yaml[] = "heads: 4\nslots: 64\ncpu_threads: 2\nlog:\n  level: debug\n"
                           "limits:\n  max_regions_per_client: 3\n";

/* ---------------------------------------------------------------------- */
/* libkdaclient over the ring                                             */
/* ---------------------------------------------------------------------- */

/* A daemon, and the layer every libkdaclient test registers on it. */
static void start_with_layer(dh_daemon *d, test_rng *r, dh_layer *l)
{
    dh_start_or_skip(d, yaml);
    rng_seed(r, 31);
    dh_layer_make(l, r);
}

static void attach(kdac_client *c, uint64_t bytes_per_direction)
{
    kdac_error err;
    if (kdac_ring_attach(c, bytes_per_direction, &err) != KDAC_OK)
        fail_msg("ring.attach: %s", err.message);
}

static void prefill(kdac_client *c, const kdac_seq *q)
{
    kdac_error err;
    if (kdac_prefill(c, "L", q, 1, NULL, &err) != KDAC_OK)
        fail_msg("prefill: %s", err.message);
}

static kdac_stats_info *stats(kdac_client *c)
{
    static kdac_stats_info info;
    kdac_error err;
    if (kdac_stats(c, &info, &err) != KDAC_OK)
        fail_msg("stats: %s", err.message);
    return &info;
}

static void read_state(kdac_client *c, uint64_t slot, float *state)
{
    kdac_error err;
    if (kdac_slot_read(c, slot, KDAC_DTYPE_F32, kdac_output_inline(state), NULL, &err) != KDAC_OK)
        fail_msg("slot.read: %s", err.message);
}

/* An answer counted by the event-loop test (a failure fails the test). */
static void counting_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    (void)c;
    if (status != KDAC_OK)
        fail_msg("prefill: %s", res->error.message);
    ++*(int *)data;
}

/* The same prefills on a socket client and a ring client agree bit for bit:
 * inline frames of up to 300 KiB through a 4 KiB ring, a sleeping and a
 * spinning client, shm regions registered over the ring. */
static void test_ring_matches_socket(void **unused)
{
    (void)unused;
    dh_daemon d;
    test_rng r;
    dh_layer l;
    start_with_layer(&d, &r, &l);
    kdac_client *sock = dh_kdac_open(&d, &l), *ring = dh_kdac_open(&d, &l);
    kdac_error err;
    attach(ring, 4096);
    assert_int_equal(kdac_ring_attach(ring, 4096, &err), KDAC_E_INVALID_ARGUMENT);

    static const uint32_t lens[] = {1, 37, 300, 64, 1, 129};
    uint64_t s_slot = dh_kdac_alloc(sock), r_slot = dh_kdac_alloc(ring);
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        if (i == 3)
            assert_int_equal(kdac_client_set_spin(ring, 100000, &err), KDAC_OK);
        dh_seq s;
        dh_seq_make(&s, &r, lens[i]);
        uint16_t *a = malloc(DH_TOKEN_BYTES(s.len)), *b = malloc(DH_TOKEN_BYTES(s.len));
        kdac_seq qa = dh_kdac_seq(s_slot, &s, a), qb = dh_kdac_seq(r_slot, &s, b);
        prefill(sock, &qa);
        prefill(ring, &qb);
        assert_memory_equal(a, b, DH_TOKEN_BYTES(s.len));
        free(a);
        free(b);
        dh_seq_free(&s);
    }
    float *sa = malloc(DH_STATE_ELEMS * sizeof(float)), *sb = malloc(DH_STATE_ELEMS * sizeof(float));
    read_state(sock, s_slot, sa);
    read_state(ring, r_slot, sb);
    assert_memory_equal(sa, sb, DH_STATE_ELEMS * sizeof(float));

    /* A region registered over the ring: its descriptor rides on a doorbell. */
    dh_seq s;
    dh_seq_make(&s, &r, 50);
    size_t tok = DH_TOKEN_BYTES(s.len), beta = DH_BETA_BYTES(s.len);
    kdac_shm shm;
    uint32_t region;
    assert_int_equal(kdac_shm_create(&shm, 5 * tok + beta, "ring-test-region", &err), KDAC_OK);
    if (kdac_region_register_shm(ring, shm.fd, shm.size, &region, &err) != KDAC_OK)
        fail_msg("region.register_shm over the ring: %s", err.message);
    uint8_t *m = shm.base;
    memcpy(m, s.q, tok);
    memcpy(m + tok, s.k, tok);
    memcpy(m + 2 * tok, s.v, tok);
    memcpy(m + 3 * tok, s.g, tok);
    memcpy(m + 5 * tok, s.beta, beta);
    kdac_seq qr;
    memset(&qr, 0, sizeof(qr));
    qr.slot = r_slot;
    qr.len = s.len;
    qr.q = kdac_tensor_region(region, 0);
    qr.k = kdac_tensor_region(region, tok);
    qr.v = kdac_tensor_region(region, 2 * tok);
    qr.g = kdac_tensor_region(region, 3 * tok);
    qr.beta = kdac_tensor_region(region, 5 * tok);
    qr.out = kdac_output_region(region, 4 * tok);
    uint16_t *a = malloc(tok);
    kdac_seq qa = dh_kdac_seq(s_slot, &s, a);
    prefill(sock, &qa);
    prefill(ring, &qr);
    assert_memory_equal(a, m + 4 * tok, tok);

    /* Pipelined from an event loop that sleeps on the client's descriptor:
     * kdad rings for each answer. */
    assert_int_equal(kdac_client_set_spin(ring, 0, &err), KDAC_OK);
    enum { N = 4 };
    uint64_t slots[N];
    uint16_t *outs[N];
    int done = 0;
    for (int i = 0; i < N; i++) {
        slots[i] = dh_kdac_alloc(ring);
        outs[i] = malloc(tok);
        kdac_seq q = dh_kdac_seq(slots[i], &s, outs[i]);
        assert_int_equal(kdac_prefill_send(ring, "L", &q, 1, counting_cb, &done, &err), KDAC_OK);
    }
    for (int spins = 0; done < N && spins < 6000; spins++) {
        struct pollfd p = {kdac_client_fd(ring), POLLIN, 0};
        if (kdac_client_events(ring) & KDAC_WRITABLE)
            p.events |= POLLOUT;
        poll(&p, 1, 10);
        assert_int_equal(kdac_client_progress(ring), KDAC_OK);
    }
    assert_int_equal(done, N);
    uint16_t *first = malloc(tok);
    uint64_t fresh = dh_kdac_alloc(sock);
    kdac_seq qf = dh_kdac_seq(fresh, &s, first);
    prefill(sock, &qf);
    for (int i = 0; i < N; i++) {
        assert_memory_equal(first, outs[i], tok);
        free(outs[i]);
    }
    free(first);
    free(a);
    free(sa);
    free(sb);
    kdac_shm_close(&shm);
    dh_seq_free(&s);
    kdac_client_close(sock);
    kdac_client_close(ring);
    dh_stop(&d);
}

/* ---------------------------------------------------------------------- */
/* The wire: refusals and hostile clients                                 */
/* ---------------------------------------------------------------------- */

typedef struct raw_ring {
    kp_ring ring;
    uint8_t *map;
    size_t bytes;
    uint32_t region;
} raw_ring;

static uint32_t register_shm(dh_client *c, int fd, uint64_t size)
{
    kp_region_register_shm_params p = {size};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_region_register_shm_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send_fd(c, fd);
    dh_expect_result(c, id);
    kp_region_register_result res;
    assert_int_equal(kp_region_register_result_decode(&c->msg, &res, NULL), KP_OK);
    return res.region;
}

/* A sealed, mapped memfd of header + 2 x size bytes, registered on c. */
static void ring_region(dh_client *c, raw_ring *rr, uint64_t size)
{
    rr->bytes = KP_RING_HEADER_BYTES + 2 * size;
    int fd = memfd_create("kdad-ring-test", MFD_ALLOW_SEALING | MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)rr->bytes), 0);
    assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    rr->map = mmap(NULL, rr->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(rr->map != MAP_FAILED);
    rr->region = register_shm(c, fd, rr->bytes);
    close(fd);
}

static void raw_client(dh_client *c, const dh_daemon *d, raw_ring *rr, uint64_t size)
{
    dh_connect(c, d);
    dh_hello(c);
    ring_region(c, rr, size);
    dh_attach_ring(c, &rr->ring, rr->map, rr->region, size);
}

static void raw_close(dh_client *c, raw_ring *rr)
{
    dh_close(c);
    munmap(rr->map, rr->bytes);
}

static uint32_t send_attach(dh_client *c, uint32_t region, uint64_t size)
{
    /* Encoded by hand: the codec refuses sizes that are not powers of two. */
    uint32_t id = dh_id(c);
    kp_ring_attach_params p = {region, KP_RING_MIN_SIZE};
    assert_int_equal(kp_ring_attach_params_encode(&c->w, id, &p, NULL), KP_OK);
    uint8_t *frame;
    size_t len;
    assert_int_equal(kp_writer_flatten(&c->w, &frame, &len, NULL), KP_OK);
    /* the size is the last field: a u64 written as msgpack uint 16 (cd) */
    assert_true(len >= 3 && frame[len - 3] == 0xcd);
    frame[len - 2] = (uint8_t)(size >> 8);
    frame[len - 1] = (uint8_t)size;
    dh_write(c, frame, len);
    free(frame);
    return id;
}

static void expect_health(dh_client *c)
{
    uint32_t id = dh_id(c);
    assert_int_equal(kp_health_params_encode(&c->w, id, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
}

static void test_ring_attach_refused(void **unused)
{
    (void)unused;
    dh_daemon d;
    dh_start_or_skip(&d, yaml);
    dh_client c;
    dh_connect(&c, &d);
    dh_hello(&c);
    dh_expect_error(&c, send_attach(&c, 7, 4096), KP_E_REGION_INVALID, "not a shared-memory");
    raw_ring rr;
    ring_region(&c, &rr, 4096);
    dh_expect_error(&c, send_attach(&c, rr.region, 6000), KP_E_INVALID_PARAMS, "power of two");
    dh_expect_error(&c, send_attach(&c, rr.region, 8192), KP_E_REGION_INVALID, "needs");

    /* Frames sent behind ring.attach before its answer would be lost to the
     * switch: refused, and the frame behind it is answered on the socket. */
    uint32_t attach = dh_id(&c);
    kp_ring_attach_params p = {rr.region, 4096};
    assert_int_equal(kp_ring_attach_params_encode(&c.w, attach, &p, NULL), KP_OK);
    uint8_t *f1, *f2;
    size_t n1, n2;
    assert_int_equal(kp_writer_flatten(&c.w, &f1, &n1, NULL), KP_OK);
    uint32_t health = dh_id(&c);
    assert_int_equal(kp_health_params_encode(&c.w, health, NULL), KP_OK);
    assert_int_equal(kp_writer_flatten(&c.w, &f2, &n2, NULL), KP_OK);
    uint8_t *both = malloc(n1 + n2);
    memcpy(both, f1, n1);
    memcpy(both + n1, f2, n2);
    dh_write(&c, both, n1 + n2);
    free(both);
    free(f1);
    free(f2);
    dh_expect_error(&c, attach, KP_E_INVALID_PARAMS, "only request in flight");
    dh_expect_result(&c, health);

    /* Attached: the ring's region cannot be released, nor a second ring attached. */
    dh_attach_ring(&c, &rr.ring, rr.map, rr.region, 4096);
    expect_health(&c);
    kp_region_release_params rel = {rr.region};
    uint32_t id = dh_id(&c);
    assert_int_equal(kp_region_release_params_encode(&c.w, id, &rel, NULL), KP_OK);
    dh_send(&c);
    dh_expect_error(&c, id, KP_E_REGION_INVALID, "frame ring");
    dh_expect_error(&c, send_attach(&c, rr.region, 4096), KP_E_INVALID_PARAMS, "already");
    expect_health(&c);
    raw_close(&c, &rr);
    dh_stop(&d);
}

/* The connection ends without an answer (EOF on the socket). */
static void expect_closed(dh_client *c)
{
    assert_false(dh_recv(c));
}

static void test_ring_hostile_client(void **unused)
{
    (void)unused;
    dh_daemon d;
    dh_start_or_skip(&d, yaml);
    dh_client bystander;
    dh_connect(&bystander, &d);
    dh_hello(&bystander);

    /* A head counter further ahead than the ring holds: the goodbye says so. */
    dh_client c;
    raw_ring rr;
    raw_client(&c, &d, &rr, 4096);
    kp_ring_header *h = (kp_ring_header *)rr.map;
    __atomic_store_n(&h->client.head, rr.ring.head + 4096 + 1, __ATOMIC_RELEASE);
    assert_int_equal(send(c.fd, "", 1, MSG_NOSIGNAL), 1);
    dh_expect_goodbye(&c, KP_E_PROTOCOL, "impossible");
    raw_close(&c, &rr);
    expect_health(&bystander);

    /* A tail counter ahead of what kdad wrote: found when it answers, and
     * the ring cannot carry a goodbye any more. */
    raw_client(&c, &d, &rr, 4096);
    h = (kp_ring_header *)rr.map;
    __atomic_store_n(&h->client.tail, 12345, __ATOMIC_RELEASE);
    uint32_t id = dh_id(&c);
    assert_int_equal(kp_health_params_encode(&c.w, id, NULL), KP_OK);
    dh_send(&c);
    expect_closed(&c);
    raw_close(&c, &rr);
    expect_health(&bystander);

    /* Garbage through the ring: the goodbye comes back through it. */
    raw_client(&c, &d, &rr, 4096);
    static const uint8_t junk[] = {0, 0, 0, 2, 0xc1, 0xc1};
    dh_write(&c, junk, sizeof(junk));
    dh_expect_goodbye(&c, KP_E_PROTOCOL, NULL);
    raw_close(&c, &rr);
    expect_health(&bystander);
    dh_close(&bystander);
    dh_stop(&d);
}

/* Whether kdad's address space maps a file whose name contains `name`. */
static bool kdad_maps(const dh_daemon *d, const char *name)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/maps", (int)d->pid);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[512];
    bool found = false;
    while (!found && fgets(line, sizeof(line), f))
        found = strstr(line, name) != NULL;
    fclose(f);
    return found;
}

static void test_ring_released_on_close(void **unused)
{
    (void)unused;
    dh_daemon d;
    test_rng r;
    dh_layer l;
    start_with_layer(&d, &r, &l);
    kdac_client *c = dh_kdac_open(&d, &l);
    attach(c, 0);
    assert_true(kdad_maps(&d, "kdac-ring"));
    kdac_client_close(c);
    bool gone = false;
    for (int i = 0; i < 500 && !gone; i++) {
        gone = !kdad_maps(&d, "kdac-ring");
        if (!gone)
            nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    }
    assert_true(gone);
    c = dh_kdac_open(&d, &l);
    attach(c, 0);
    uint64_t slot = dh_kdac_alloc(c);
    dh_seq s;
    dh_seq_make(&s, &r, 3);
    kdac_seq q = dh_kdac_seq(slot, &s, NULL);
    prefill(c, &q);
    dh_seq_free(&s);
    kdac_client_close(c);
    dh_stop(&d);
}

/* A loop that never polls (batching.spin_us 0): every exchange goes by
 * doorbells, frames streaming both ways through a 4 KiB ring; then a caller
 * that polls the ring itself (kdac_client_set_polling) and sleeps again. */
static void test_ring_doorbells_only(void **unused)
{
    (void)unused;
    dh_daemon d;
    dh_start_or_skip(&d, "heads: 4\nslots: 16\ncpu_threads: 2\nbatching:\n  spin_us: 0\n");
    test_rng r;
    rng_seed(&r, 7);
    dh_layer l;
    dh_layer_make(&l, &r);
    kdac_client *sock = dh_kdac_open(&d, &l), *ring = dh_kdac_open(&d, &l);
    assert_int_equal(stats(sock)->rings, 0);
    attach(ring, 4096);
    assert_int_equal(stats(sock)->rings, 1);
    uint64_t a = dh_kdac_alloc(sock), b = dh_kdac_alloc(ring);
    uint64_t rung = 0;
    for (int i = 0; i < 4; i++) {
        dh_seq s;
        dh_seq_make(&s, &r, i % 2 ? 200 : 3);
        uint16_t *x = malloc(DH_TOKEN_BYTES(s.len)), *y = malloc(DH_TOKEN_BYTES(s.len));
        kdac_seq qa = dh_kdac_seq(a, &s, x), qb = dh_kdac_seq(b, &s, y);
        prefill(sock, &qa);
        if (i < 2) {
            prefill(ring, &qb);
        } else { /* the caller polls: no doorbell is rung for the answer */
            int done = 0;
            kdac_error err;
            rung = stats(sock)->ring_doorbells;
            kdac_client_set_polling(ring, true);
            assert_int_equal(kdac_prefill_send(ring, "L", &qb, 1, counting_cb, &done, &err),
                             KDAC_OK);
            for (long spins = 0; !done && spins < 200000000; spins++)
                assert_int_equal(kdac_client_progress(ring), KDAC_OK);
            kdac_client_set_polling(ring, false);
            assert_int_equal(kdac_client_progress(ring), KDAC_OK);
            assert_int_equal(done, 1);
            /* a small answer to a polling client: nothing rung (a long one may
             * still ring for room to write) */
            if (s.len == 3)
                assert_int_equal(stats(sock)->ring_doorbells, rung);
        }
        assert_memory_equal(x, y, DH_TOKEN_BYTES(s.len));
        free(x);
        free(y);
        dh_seq_free(&s);
    }
    assert_true(rung > 0); /* the sleeping client's answers were rung */
    kdac_client_close(ring);
    for (int i = 0; i < 500 && stats(sock)->rings != 0; i++)
        nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    assert_int_equal(stats(sock)->rings, 0);
    kdac_client_close(sock);
    dh_stop(&d);
}

int main(void)
{
    if (dh_backend_available(yaml) == 77)
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_ring_matches_socket, dh_teardown),
        cmocka_unit_test_teardown(test_ring_attach_refused, dh_teardown),
        cmocka_unit_test_teardown(test_ring_hostile_client, dh_teardown),
        cmocka_unit_test_teardown(test_ring_released_on_close, dh_teardown),
        cmocka_unit_test_teardown(test_ring_doorbells_only, dh_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
