/*
 * fuzz_wire.c - what kdad reads from its clients (and libkdaclient from
 * kdad), fed hostile bytes: the frame reader (both of its forms, in chunks
 * of every size), the frame ring (counters and data written by a hostile
 * peer, seen from either side), and every frame body that comes out of
 * either through the general decoder, each method's parameter decoder,
 * every result decoder, and the two one-pass readers, which must accept
 * only what the general decoder accepts and fill the same values
 * (test_proto_harness.c checks that).
 *
 * A libFuzzer target (scripts/fuzz.sh builds it with clang); replay.c runs
 * the same function over files, so the seeds (seeds.c) and any input the
 * fuzzer once found (tests/fuzz/corpus/) run in every ctest build, also
 * under ASan + UBSan.
 *
 * Input: byte 0 picks the mode (bit 0: ring, else stream; bit 1: the ring
 * seen from the client, else from the daemon) and seeds the chunk sizes;
 * the rest is the stream, or for the ring the peer's counters (head, tail:
 * 8 bytes each, little-endian) and then the data it wrote.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kdaproto.h"
#include "test_proto_harness.h"

/* A prefill request the results are read against: three sequences, outputs in regions. */
static kp_prefill_seq result_seqs[3];
static const kp_prefill_params result_req = {.layer = "L", .seqs = result_seqs, .nseqs = 3};
/* A step request the step results are read against: two sequences of one token, inline output. */
static const kp_step_params step_req = {.layer = "L", .nseqs = 2, .tokens = 2};

/* The session: 1 head, so that fuzzed inline tensors can have the right sizes. */
static kp_session session;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    setenv("CMOCKA_TEST_ABORT", "1", 1); /* a failed check aborts: the fuzzer's crash */
    harness_setup(NULL);
    session = test_session;
    session.geometry.heads = 1;
    test_session = session; /* prefill_result_read_agrees decodes under test_session */
    for (int i = 0; i < 3; i++) {
        result_seqs[i].slot = (uint64_t)i + 1;
        result_seqs[i].len = 2;
        result_seqs[i].out = kp_ref_region(1, 4096u * (uint64_t)i, 2 * 128 * 2);
    }
    return 0;
}

/* Every decoder of a response; most refuse the shape of the others' results. */
static void decode_results(kp_msg *msg)
{
    kp_error e, remote;
    kp_hello_result hello;
    kp_health_result health;
    kp_stats_result stats;
    kp_layer_register_result layer;
    kp_layer_list_result layers;
    kp_layer_drop_result drop;
    kp_slot_list slots;
    kp_slot_fork_result fork;
    kp_slot_read_result read;
    kp_slot_info_result info;
    kp_region_register_result region;
    kp_prefill_result prefill;
    kp_step_result step;
    if (msg->error) {
        kp_response_error_decode(msg, &remote, &e);
        return;
    }
    kp_empty_result_decode(msg, &e);
    kp_hello_result_decode(msg, &hello, &e);
    kp_health_result_decode(msg, &health, &e);
    kp_stats_result_decode(msg, &stats, &e);
    kp_layer_register_result_decode(msg, &layer, &e);
    kp_layer_list_result_decode(msg, &layers, &e);
    kp_layer_drop_result_decode(msg, &drop, &e);
    kp_slot_alloc_result_decode(msg, &slots, &e);
    kp_slot_fork_result_decode(msg, &fork, &e);
    kp_slot_read_result_decode(msg, &session, &read, &e);
    kp_slot_info_result_decode(msg, &info, &e);
    kp_region_register_result_decode(msg, &region, &e);
    kp_prefill_result_decode(msg, &session, &result_req, &prefill, &e);
    kp_step_result_decode(msg, &session, &step_req, &step, &e);
}

/* Regions 1..4 of a connection (1 holds the seeds' references); others are not registered. */
static const uint64_t region_sizes[5] = {0, 1u << 20, 0, 4096, UINT64_MAX};

static int region_size(void *ctx, uint32_t region, uint64_t *size)
{
    (void)ctx;
    if (region < 1 || region > 4)
        return KP_E_REGION_INVALID;
    *size = region_sizes[region];
    return KP_OK;
}

/* A reference the bounds check passed lies inside its region (overflow-safe). */
static void check_inside(const kp_ref *r)
{
    uint64_t end;
    if (r->kind == KP_REF_REGION &&
        (r->region < 1 || r->region > 4 || __builtin_add_overflow(r->offset, r->nbytes, &end) ||
         end > region_sizes[r->region]))
        abort(); /* the bounds check let a reference out of its region */
}

/* A step the bounds check passes names only bytes inside its regions. */
static void check_step_regions(kp_msg *msg)
{
    kp_step_params p;
    kp_error e;
    if (kp_step_params_decode(msg, &session, &p, &e) != KP_OK ||
        kp_step_check_regions(&p, region_size, NULL, &e) != KP_OK)
        return;
    for (int t = 0; t < KP_STEP_TENSORS; t++)
        check_inside(&p.tensors[t]);
}

/* A prefill the bounds check passes names only bytes inside its regions (overflow-safe). */
static void check_prefill_regions(kp_msg *msg)
{
    kp_prefill_params p;
    kp_error e;
    if (kp_prefill_params_decode(msg, &session, &p, &e) != KP_OK ||
        kp_prefill_check_regions(&p, region_size, NULL, &e) != KP_OK)
        return;
    for (uint32_t i = 0; i < p.nseqs; i++)
        for (int t = 0; t < KP_PREFILL_TENSORS; t++)
            check_inside(&p.seqs[i].tensors[t]);
}

/* One frame body, as the daemon (requests) or libkdaclient (the rest) sees it. */
static void check_body(const uint8_t *body, size_t len)
{
    prefill_read_agrees(body, len, &session, false);
    prefill_result_read_agrees(body, len, &result_req, false);
    uint32_t id;
    kp_response_peek_id(body, len, &id);

    kp_msg msg;
    kp_error e, remote;
    kp_msg_init(&msg);
    if (kp_msg_decode(&msg, body, len, KP_DEFAULT_MAX_FRAME_BYTES, &e) == KP_OK) {
        switch (msg.kind) {
        case KP_MSG_REQUEST:
            if (decode_params(&msg, &session, &e) == KP_OK && msg.method == KP_METHOD_PREFILL)
                check_prefill_regions(&msg);
            if (msg.method == KP_METHOD_STEP)
                check_step_regions(&msg);
            break;
        case KP_MSG_RESPONSE: decode_results(&msg); break;
        case KP_MSG_NOTIFICATION: kp_goodbye_decode(&msg, &remote, &e); break;
        }
    }
    kp_msg_close(&msg);
}

/* Chunk sizes from a small generator: mostly short, sometimes long. */
static size_t next_chunk(uint32_t *rng, size_t left)
{
    *rng = *rng * 1103515245u + 12345u;
    size_t n = (*rng >> 16) % 8 == 0 ? (*rng >> 8) % 4096 : (*rng >> 16) % 17;
    return n < left ? n : left;
}

/* Feeds bytes to the reader in chunks, alternating its two forms; checks every frame.
 * Returns false once the reader is dead. */
static bool feed(kp_reader *r, uint32_t *rng, const uint8_t *p, size_t n)
{
    kp_error e;
    while (n > 0) {
        size_t chunk = next_chunk(rng, n);
        if (chunk == 0)
            chunk = 1;
        int rc;
        if (*rng & 1) {
            const uint8_t *at = p;
            size_t left = chunk;
            rc = kp_reader_feed(r, &at, &left, &e);
            chunk -= left; /* what a completed frame left over stays for the next call */
        } else {
            uint8_t *buf;
            size_t space = kp_reader_space(r, &buf);
            if (chunk > space)
                chunk = space;
            if (chunk)
                memcpy(buf, p, chunk);
            rc = kp_reader_commit(r, chunk, &e);
        }
        if (rc < 0)
            return false;
        if (rc == KP_READ_FRAME) {
            size_t len;
            uint8_t *body = kp_reader_take(r, &len);
            check_body(body, len);
            free(body);
        }
        p += chunk;
        n -= chunk;
    }
    return true;
}

static uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

/* One side of a ring (the daemon's, or libkdaclient's) whose peer's counters and data are
 * the input. */
static void ring_mode(uint32_t rng, bool daemon_side, const uint8_t *data, size_t len)
{
    enum { SIZE = KP_RING_MIN_SIZE };
    static uint8_t region[KP_RING_HEADER_BYTES + 2 * SIZE];
    if (len < 16)
        return;
    memset(region, 0, sizeof(region));
    kp_ring ring;
    kp_ring_init(&ring, region, SIZE, daemon_side, KP_RING_WANT_DATA);
    kp_ring_header *h = (kp_ring_header *)region;
    kp_ring_side *peer = daemon_side ? &h->client : &h->daemon;
    peer->head = le64(data);
    peer->tail = le64(data + 8);
    size_t n = len - 16 < SIZE ? len - 16 : SIZE;
    /* the peer's data area: client -> daemon first, then daemon -> client */
    memcpy(region + KP_RING_HEADER_BYTES + (daemon_side ? 0 : SIZE), data + 16, n);

    kp_reader r;
    kp_reader_init(&r, KP_DEFAULT_MAX_FRAME_BYTES);
    kp_error e;
    uint8_t buf[SIZE];
    for (int round = 0; round < 64; round++) {
        size_t got = 0, want = next_chunk(&rng, sizeof(buf));
        if (kp_ring_read(&ring, buf, want ? want : 1, &got, &e) != KP_OK || got == 0)
            break;
        if (!feed(&r, &rng, buf, got))
            break;
    }
    /* and an answer the other way, against the client's tail */
    static const uint8_t answer[100];
    struct iovec iov = {(void *)answer, sizeof(answer)};
    size_t put;
    for (int round = 0; round < 64; round++) {
        if (kp_ring_writev(&ring, &iov, 1, &put, &e) != KP_OK || put == 0)
            break;
    }
    kp_ring_readable(&ring);
    kp_ring_writable(&ring);
    kp_reader_close(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    if (len < 1)
        return 0;
    uint32_t rng = data[0];
    if (data[0] & 1) {
        ring_mode(rng, !(data[0] & 2), data + 1, len - 1);
        return 0;
    }
    kp_reader r;
    kp_reader_init(&r, KP_DEFAULT_MAX_FRAME_BYTES);
    feed(&r, &rng, data + 1, len - 1);
    kp_reader_close(&r);
    return 0;
}
