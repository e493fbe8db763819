/*
 * test_daemon_shm.c - kdad's shared-memory regions end to end: a sealed
 * memfd registered over SCM_RIGHTS, tensors read from and outputs written
 * into it (bit-identical to the inline path), hostile offsets and sizes,
 * refused descriptors, release and lifetime.  Built twice like test_daemon.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon_harness.h"

static const char yaml[] = "heads: 4\nslots: 64\ncpu_threads: 2\nlog:\n  level: debug\n"
                           "limits:\n  max_regions_per_client: 3\n";

static uint32_t send_register(dh_client *c, uint64_t size, int fd)
{
    kp_region_register_shm_params p = {size};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_region_register_shm_params_encode(&c->w, id, &p, NULL), KP_OK);
    if (fd >= 0)
        dh_send_fd(c, fd);
    else
        dh_send(c);
    return id;
}

static uint32_t send_release(dh_client *c, uint32_t region)
{
    kp_region_release_params p = {region};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_region_release_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    return id;
}

/* A region laid out as q, k, v, g, beta, out for `len` tokens, 16-aligned. */
typedef struct layout {
    uint64_t off[KP_PREFILL_TENSORS];
    uint64_t size;
} layout;

static layout plan(uint32_t len, uint64_t base)
{
    layout l;
    uint64_t at = base;
    for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
        l.off[t] = at;
        at += (t == KP_TENSOR_BETA ? DH_BETA_BYTES(len) : DH_TOKEN_BYTES(len));
        at = (at + 15) / 16 * 16;
    }
    l.size = at;
    return l;
}

static void fill(uint8_t *map, const layout *l, const dh_seq *s)
{
    const uint16_t *src[5] = {s->q, s->k, s->v, s->g, s->beta};
    for (int t = 0; t < 5; t++)
        memcpy(map + l->off[t], src[t],
               t == KP_TENSOR_BETA ? DH_BETA_BYTES(s->len) : DH_TOKEN_BYTES(s->len));
}

static kp_prefill_seq region_seq(uint64_t slot, uint32_t region, const layout *l, uint32_t len,
                                 bool out)
{
    kp_prefill_seq q;
    memset(&q, 0, sizeof(q));
    q.slot = slot;
    q.len = len;
    for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
        if (t == KP_TENSOR_OUT && !out)
            continue;
        q.tensors[t] = kp_ref_region(region, l->off[t], t == KP_TENSOR_BETA ? DH_BETA_BYTES(len)
                                                                            : DH_TOKEN_BYTES(len));
    }
    return q;
}

static uint32_t send_prefill(dh_client *c, const kp_prefill_seq *q)
{
    kp_prefill_params p = {.layer = "L", .seqs = q, .nseqs = 1};
    uint32_t id = dh_id(c);
    kp_error e;
    if (kp_prefill_params_encode(&c->w, id, &p, &e) != KP_OK)
        fail_msg("%s", e.message);
    dh_send(c);
    return id;
}

/* A daemon started with cfg (the test is skipped where it cannot start), a
 * client that said hello and registered layer "L" (made from seed). */
static void start(dh_daemon *d, const char *cfg, uint64_t seed, dh_client *c, dh_layer *l,
                  test_rng *r)
{
    dh_start_or_skip(d, cfg);
    rng_seed(r, seed);
    dh_connect(c, d);
    dh_hello(c);
    dh_layer_make(l, r);
    dh_register_layer(c, "L", l);
}

/* ---------------------------------------------------------------------- */

static void test_shm_matches_inline(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    dh_seq s;
    test_rng r;
    start(&d, yaml, 21, &c, &l, &r);
    dh_seq_make(&s, &r, 77);
    uint64_t a = dh_alloc(&c), b = dh_alloc(&c);

    layout lay = plan(77, 0);
    uint64_t state_off = (lay.size + 15) / 16 * 16;
    uint64_t size = state_off + 2 * DH_STATE_ELEMS * 4;
    int fd = dh_memfd(size, true);
    uint8_t *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(map != MAP_FAILED);
    fill(map, &lay, &s);
    memset(map + lay.off[KP_TENSOR_OUT], 0xff, DH_TOKEN_BYTES(77)); /* poison */
    uint32_t region = dh_register_shm(&c, fd, size);
    close(fd); /* the daemon keeps its own mapping */

    kp_prefill_seq q = region_seq(a, region, &lay, 77, true);
    uint32_t id = send_prefill(&c, &q);
    dh_expect_result(&c, id);
    kp_prefill_params req = {.layer = "L", .seqs = &q, .nseqs = 1};
    kp_prefill_result res;
    assert_int_equal(kp_prefill_result_decode(&c.msg, &c.session, &req, &res, NULL), KP_OK);
    assert_int_equal(res.seqs[0].pos, 77);
    assert_int_equal(res.seqs[0].out.kind, KP_REF_ABSENT); /* it is in the region */

    uint16_t *inline_out = malloc(DH_TOKEN_BYTES(77));
    id = dh_send_prefill(&c, "L", b, &s, 0);
    dh_recv_prefill(&c, id, &s, inline_out);
    assert_memory_equal(map + lay.off[KP_TENSOR_OUT], inline_out, DH_TOKEN_BYTES(77));

    /* snapshot into the region, restore from it into a third slot */
    kp_slot_read_params rp;
    memset(&rp, 0, sizeof(rp));
    rp.slot = a;
    rp.has_dtype = true;
    rp.dtype = KP_DTYPE_F32;
    rp.out = kp_ref_region(region, state_off, DH_STATE_ELEMS * 4);
    id = dh_id(&c);
    assert_int_equal(kp_slot_read_params_encode(&c.w, id, &rp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    float *st = malloc(DH_STATE_ELEMS * 4);
    dh_read_state(&c, b, st);
    assert_memory_equal(map + state_off, st, DH_STATE_ELEMS * 4);
    uint64_t w = dh_alloc(&c);
    kp_slot_write_params wp = {w, 77, KP_DTYPE_F32,
                               kp_ref_region(region, state_off, DH_STATE_ELEMS * 4)};
    id = dh_id(&c);
    assert_int_equal(kp_slot_write_params_encode(&c.w, id, &wp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    float *back = malloc(DH_STATE_ELEMS * 4);
    assert_int_equal(dh_read_state(&c, w, back), 77);
    assert_memory_equal(back, st, DH_STATE_ELEMS * 4);

    kp_stats_result sr;
    dh_stats(&c, &sr);
    assert_int_equal(sr.regions, 1);
    assert_true(sr.bytes_in[KP_TRANSPORT_ID_SHM] >= 4 * DH_TOKEN_BYTES(77) + DH_BETA_BYTES(77));
    assert_true(sr.bytes_out[KP_TRANSPORT_ID_SHM] >= DH_TOKEN_BYTES(77) + DH_STATE_ELEMS * 4);

    free(st);
    free(back);
    free(inline_out);
    munmap(map, size);
    dh_seq_free(&s);
    dh_close(&c);
    dh_stop(&d);
}

/* Runs two chained shared-memory prefills of s (first `split` tokens, then
 * the rest) on a fresh slot of a daemon started with yaml; returns the
 * outputs (len tokens) and the final f32 state, both malloc'd. */
static void run_chain(const char *cfg, const dh_seq *s, uint32_t split, uint16_t **out,
                      float **state)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    test_rng r;
    start(&d, cfg, 5, &c, &l, &r);
    uint64_t slot = dh_alloc(&c);
    uint32_t lens[2] = {split, s->len - split};
    layout lay[2] = {plan(lens[0], 0), {{0}, 0}};
    lay[1] = plan(lens[1], (lay[0].size + 4095) / 4096 * 4096);
    uint64_t size = lay[1].size;
    int fd = dh_memfd(size, true);
    uint8_t *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(map != MAP_FAILED);
    dh_seq part[2] = {dh_seq_slice(s, 0, lens[0]), dh_seq_slice(s, lens[0], lens[1])};
    for (int i = 0; i < 2; i++) {
        fill(map, &lay[i], &part[i]);
        memset(map + lay[i].off[KP_TENSOR_OUT], 0xff, DH_TOKEN_BYTES(lens[i])); /* poison */
    }
    uint32_t region = dh_register_shm(&c, fd, size);
    close(fd);
    *out = malloc(DH_TOKEN_BYTES(s->len));
    for (int i = 0; i < 2; i++) {
        kp_prefill_seq q = region_seq(slot, region, &lay[i], lens[i], true);
        uint32_t id = send_prefill(&c, &q);
        dh_expect_result(&c, id);
        kp_prefill_params req = {.layer = "L", .seqs = &q, .nseqs = 1};
        kp_prefill_result res;
        assert_int_equal(kp_prefill_result_decode(&c.msg, &c.session, &req, &res, NULL), KP_OK);
        assert_int_equal(res.seqs[0].pos, i ? s->len : lens[0]);
        memcpy(*out + (i ? (size_t)lens[0] * DH_HEADS * 128 : 0), map + lay[i].off[KP_TENSOR_OUT],
               DH_TOKEN_BYTES(lens[i]));
    }
    *state = malloc(DH_STATE_ELEMS * 4);
    assert_int_equal(dh_read_state(&c, slot, *state), s->len);
    munmap(map, size);
    dh_close(&c);
    dh_stop(&d);
}

/* With staging too small for a request, the cuda backend copies the
 * shared-memory tensors that fit and reads the others through the region's
 * mapping: the results are bit-identical to a daemon that copies them all
 * (the cpu backend reads the mapping either way). */
static void test_shm_staging_fallback(void **unused)
{
    static const char big[] = "heads: 4\nslots: 8\ncpu_threads: 2\n";
    /* staging: 256 KiB (an inline f32 state) + a state + alignment slack:
     * about 0.9 MiB, so q and k of a 400-token request are copied, v and g
     * are not, beta and out are again */
    static const char small[] = "heads: 4\nslots: 8\ncpu_threads: 2\n"
                                "limits:\n  max_inline_bytes: 256KiB\n";
    test_rng r;
    dh_seq s;
    rng_seed(&r, 31);
    dh_seq_make(&s, &r, 430);
    uint16_t *out_big, *out_small;
    float *state_big, *state_small;
    run_chain(big, &s, 400, &out_big, &state_big);
    run_chain(small, &s, 400, &out_small, &state_small);
    assert_memory_equal(out_big, out_small, DH_TOKEN_BYTES(430));
    assert_memory_equal(state_big, state_small, DH_STATE_ELEMS * 4);
    free(out_big);
    free(out_small);
    free(state_big);
    free(state_small);
    dh_seq_free(&s);
}

static void test_shm_hostile_references(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    test_rng r;
    start(&d, yaml, 22, &c, &l, &r);
    uint64_t a = dh_alloc(&c);
    layout lay = plan(10, 0);
    int fd = dh_memfd(lay.size, true);
    uint32_t region = dh_register_shm(&c, fd, lay.size);
    close(fd);

    kp_prefill_seq q = region_seq(a, region, &lay, 10, true);
    q.k.offset = 8;
    uint32_t id = send_prefill(&c, &q);
    dh_expect_error(&c, id, KP_E_INVALID_PARAMS, "seqs[0].k.offset: 8 is not a multiple of 16");

    q = region_seq(a, region, &lay, 10, true);
    q.v.offset = lay.size; /* just past the end: overlaps nothing */
    id = send_prefill(&c, &q);
    dh_expect_error(&c, id, KP_E_REGION_BOUNDS, "seqs[0].v: bytes");

    q = region_seq(a, region, &lay, 10, true);
    q.g.offset = UINT64_MAX - 15;
    id = send_prefill(&c, &q);
    dh_expect_error(&c, id, KP_E_REGION_BOUNDS, "overflows");

    q = region_seq(a, region, &lay, 10, true);
    q.beta.region = region + 7;
    id = send_prefill(&c, &q);
    dh_expect_error(&c, id, KP_E_REGION_INVALID, "is not registered");

    q = region_seq(a, region, &lay, 10, true);
    q.out.offset = lay.off[KP_TENSOR_Q];
    id = send_prefill(&c, &q);
    dh_expect_error(&c, id, KP_E_INVALID_PARAMS, "overlaps");

    /* none of it touched the slot, and a good request still runs */
    q = region_seq(a, region, &lay, 10, true);
    id = send_prefill(&c, &q);
    dh_expect_result(&c, id);
    dh_close(&c);
    dh_stop(&d);
}

static void test_shm_registration_refused(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_start_or_skip(&d, yaml);
    dh_connect(&c, &d);
    dh_hello(&c);

    int fd = dh_memfd(4096, false);
    uint32_t id = send_register(&c, 4096, fd);
    dh_expect_error(&c, id, KP_E_REGION_INVALID, "F_SEAL_SHRINK");
    close(fd);
    fd = dh_memfd(4096, true);
    id = send_register(&c, 8192, fd);
    dh_expect_error(&c, id, KP_E_REGION_INVALID, "holds 4096");
    close(fd);
    id = send_register(&c, 4096, -1);
    dh_expect_error(&c, id, KP_E_INVALID_PARAMS, "no file descriptor arrived");
    int pipefd[2];
    assert_int_equal(pipe(pipefd), 0);
    id = send_register(&c, 4096, pipefd[0]);
    dh_expect_error(&c, id, KP_E_REGION_INVALID, "not a memfd");
    close(pipefd[0]);
    close(pipefd[1]);

    /* CUDA memory: not on the cpu backend; on cuda, not from another GPU */
    static const uint8_t handle[KP_CUDA_IPC_HANDLE_BYTES] = {0};
    kp_region_register_cuda_params cp = {4096, "GPU-0", KP_CUDA_HANDLE_IPC, handle};
    id = dh_id(&c);
    assert_int_equal(kp_region_register_cuda_params_encode(&c.w, id, &cp, NULL), KP_OK);
    dh_send(&c);
    if (strcmp(DH_BACKEND, "cpu") == 0)
        dh_expect_error(&c, id, KP_E_NOT_SUPPORTED, "cpu backend");
    else
        dh_expect_error(&c, id, KP_E_REGION_INVALID, "not this daemon's GPU");

    /* A frame that claims a descriptor takes it even when its params are bad:
     * [0, 77, "region.register_shm", {"x": 1}] with a memfd, then a good
     * frame without one finds the queue empty. */
    static const uint8_t bad[] = {0, 0, 0, 27, 0x94, 0, 77, 0xb3, 'r', 'e', 'g', 'i', 'o', 'n',
                                  '.', 'r', 'e', 'g', 'i', 's', 't', 'e', 'r', '_', 's', 'h',
                                  'm', 0x81, 0xa1, 'x', 1};
    fd = dh_memfd(4096, true);
    dh_write_fd(&c, bad, sizeof(bad), fd);
    close(fd);
    dh_expect_error(&c, 77, KP_E_INVALID_PARAMS, "unknown field \"x\"");
    id = send_register(&c, 4096, -1);
    dh_expect_error(&c, id, KP_E_INVALID_PARAMS, "no file descriptor arrived");

    /* max_regions_per_client: 3 */
    for (int i = 0; i < 3; i++) {
        fd = dh_memfd(4096, true);
        dh_register_shm(&c, fd, 4096);
        close(fd);
    }
    fd = dh_memfd(4096, true);
    id = send_register(&c, 4096, fd);
    dh_expect_error(&c, id, KP_E_QUOTA_EXCEEDED, "max_regions_per_client 3");
    close(fd);

    dh_close(&c);

    /* unclaimed descriptors pile up to 4; the fifth ends the connection */
    dh_connect(&c, &d);
    dh_hello(&c);
    for (int i = 0; i < 5; i++) {
        fd = dh_memfd(16, true);
        id = dh_id(&c);
        assert_int_equal(kp_health_params_encode(&c.w, id, NULL), KP_OK);
        dh_send_fd(&c, fd);
        close(fd);
        if (i < 4)
            dh_expect_result(&c, id);
    }
    dh_expect_goodbye(&c, KP_E_PROTOCOL, "more than 4");
    dh_close(&c);
    dh_stop(&d);
}

static void test_shm_release_and_lifetime(void **unused)
{
    dh_daemon d;
    dh_client c, watcher;
    dh_layer l;
    dh_seq s;
    test_rng r;
    start(&d, yaml, 23, &c, &l, &r);
    dh_seq_make(&s, &r, 3000);
    uint64_t a = dh_alloc(&c);
    layout lay = plan(3000, 0);
    int fd = dh_memfd(lay.size, true);
    uint8_t *map = mmap(NULL, lay.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(map != MAP_FAILED);
    fill(map, &lay, &s);
    uint32_t region = dh_register_shm(&c, fd, lay.size);
    close(fd);

    /* released while a request uses it: the release is answered after it */
    kp_prefill_seq q = region_seq(a, region, &lay, 3000, true);
    uint32_t pid = send_prefill(&c, &q);
    uint32_t rid = send_release(&c, region);
    dh_expect_result(&c, pid);
    dh_expect_result(&c, rid);
    uint32_t id = send_prefill(&c, &q);
    dh_expect_error(&c, id, KP_E_REGION_INVALID, "is not registered");
    id = send_release(&c, region);
    dh_expect_error(&c, id, KP_E_REGION_INVALID, "region: ");

    /* a connection's regions die with it */
    fd = dh_memfd(4096, true);
    dh_register_shm(&c, fd, 4096);
    close(fd);
    dh_connect(&watcher, &d);
    dh_hello(&watcher);
    kp_stats_result st;
    dh_stats(&watcher, &st);
    assert_int_equal(st.regions, 1);
    dh_close(&c);
    for (int tries = 0; tries < 250; tries++) {
        dh_stats(&watcher, &st);
        if (st.regions == 0)
            break;
        usleep(20000);
    }
    assert_int_equal(st.regions, 0);
    munmap(map, lay.size);
    dh_seq_free(&s);
    dh_close(&watcher);
    dh_stop(&d);
}

int main(void)
{
    if (dh_backend_available(yaml) == 77)
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_shm_matches_inline, dh_teardown),
        cmocka_unit_test_teardown(test_shm_staging_fallback, dh_teardown),
        cmocka_unit_test_teardown(test_shm_hostile_references, dh_teardown),
        cmocka_unit_test_teardown(test_shm_registration_refused, dh_teardown),
        cmocka_unit_test_teardown(test_shm_release_and_lifetime, dh_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
