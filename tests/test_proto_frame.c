/*
 * test_proto_frame.c - framing and pre-validation of the wire codec
 * (proto/frame.c, proto/writer.c, the envelope in proto/decode.c).
 *
 * Covers: the resumable reader fed whole, byte by byte, in random splits and
 * through the direct space/commit interface; caps checked on the header
 * before allocation; "need more" versus "dead"; hostile frames (the 5-byte
 * 96 GB array of msgpack-c issue 1013, huge map counts, counts that only fit
 * if enclosing containers' elements are ignored, deep nesting, bin and str
 * lengths past the frame, trailing and truncated bytes, ext and reserved
 * types, the object cap); that kp_frame_check accepts exactly what msgpack-c
 * can then unpack completely (random mutations); zero copy both ways; and
 * the msgpack-RPC envelope.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kdaproto.h"

#define BIG_CAP (256u << 20)

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_next(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void expect_error(int rc, const kp_error *err, int code, const char *substr)
{
    assert_int_equal(rc, code);
    assert_int_equal(err->code, code);
    if (!strstr(err->message, substr))
        fail_msg("message \"%s\" lacks \"%s\"", err->message, substr);
}

/* A frame: 4-byte big-endian length + body. */
static uint8_t *make_frame(const uint8_t *body, size_t len, size_t *frame_len)
{
    uint8_t *f = malloc(len + 4);
    assert_non_null(f);
    f[0] = (uint8_t)(len >> 24);
    f[1] = (uint8_t)(len >> 16);
    f[2] = (uint8_t)(len >> 8);
    f[3] = (uint8_t)len;
    memcpy(f + 4, body, len);
    *frame_len = len + 4;
    return f;
}

/* A valid body of `len` bytes: a bin8/16/32 whose payload follows a pattern. */
static uint8_t *make_bin_body(size_t len, uint8_t seed)
{
    assert_true(len >= 6);
    uint8_t *b = malloc(len);
    assert_non_null(b);
    size_t payload = len - 5;
    b[0] = 0xc6;
    b[1] = (uint8_t)(payload >> 24);
    b[2] = (uint8_t)(payload >> 16);
    b[3] = (uint8_t)(payload >> 8);
    b[4] = (uint8_t)payload;
    for (size_t i = 0; i < payload; i++)
        b[5 + i] = (uint8_t)(i * 31 + seed);
    return b;
}

/* ---------------------------------------------------------------------- */
/* Reader                                                                 */
/* ---------------------------------------------------------------------- */

static void test_reader_whole_frame(void **state)
{
    uint8_t body[] = {0x93, 0x01, 0x02, 0x03};
    size_t flen;
    uint8_t *frame = make_frame(body, sizeof(body), &flen);
    kp_reader r;
    kp_error err;
    kp_reader_init(&r, BIG_CAP);
    const uint8_t *p = frame;
    size_t left = flen;
    assert_int_equal(kp_reader_feed(&r, &p, &left, &err), KP_READ_FRAME);
    assert_int_equal(left, 0);
    size_t len;
    uint8_t *got = kp_reader_take(&r, &len);
    assert_int_equal(len, sizeof(body));
    assert_memory_equal(got, body, sizeof(body));
    assert_int_equal(r.frames, 1);
    /* Nothing more: need more, not dead. */
    assert_int_equal(kp_reader_feed(&r, &p, &left, &err), KP_READ_MORE);
    free(got);
    free(frame);
    kp_reader_close(&r);
}

/* A stream of frames of varied sizes (some beyond the reader's first chunk,
 * so the body buffer grows), as one byte array. */
typedef struct stream {
    uint8_t *bytes;
    size_t len;
    uint8_t *bodies[8];
    size_t body_len[8];
    int n;
} stream;

static void stream_make(stream *s)
{
    static const size_t sizes[] = {6, 7, 300, 70000, 6, 200000, 1000, 9};
    memset(s, 0, sizeof(*s));
    s->n = 8;
    for (int i = 0; i < s->n; i++) {
        s->body_len[i] = sizes[i];
        s->bodies[i] = make_bin_body(sizes[i], (uint8_t)i);
        s->len += 4 + sizes[i];
    }
    s->bytes = malloc(s->len);
    assert_non_null(s->bytes);
    size_t at = 0;
    for (int i = 0; i < s->n; i++) {
        size_t flen;
        uint8_t *f = make_frame(s->bodies[i], s->body_len[i], &flen);
        memcpy(s->bytes + at, f, flen);
        at += flen;
        free(f);
    }
}

static void stream_free(stream *s)
{
    for (int i = 0; i < s->n; i++)
        free(s->bodies[i]);
    free(s->bytes);
}

/* Feeds the stream in pieces whose sizes come from next_piece; checks every
 * frame comes out whole and in order, and that each decodes. */
static void feed_stream(const stream *s, size_t (*next_piece)(void))
{
    kp_reader r;
    kp_error err;
    kp_reader_init(&r, BIG_CAP);
    int got = 0;
    size_t at = 0;
    while (at < s->len) {
        size_t piece = next_piece();
        if (piece > s->len - at)
            piece = s->len - at;
        const uint8_t *p = s->bytes + at;
        size_t left = piece;
        for (;;) {
            int rc = kp_reader_feed(&r, &p, &left, &err);
            assert_true(rc == KP_READ_MORE || rc == KP_READ_FRAME);
            if (rc == KP_READ_MORE) {
                assert_int_equal(left, 0);
                break;
            }
            size_t len;
            uint8_t *body = kp_reader_take(&r, &len);
            assert_true(got < s->n);
            assert_int_equal(len, s->body_len[got]);
            assert_memory_equal(body, s->bodies[got], len);
            assert_int_equal(kp_frame_check(body, len, BIG_CAP, &err), KP_OK);
            free(body);
            got++;
        }
        at += piece;
    }
    assert_int_equal(got, s->n);
    assert_null(r.body); /* nothing half-read is left */
    kp_reader_close(&r);
}

static size_t one_byte(void)
{
    return 1;
}

static size_t random_piece(void)
{
    switch (rng_next() % 4) {
    case 0: return 1 + rng_next() % 3;
    case 1: return 1 + rng_next() % 17;
    case 2: return 1 + rng_next() % 5000;
    default: return 1 + rng_next() % 150000;
    }
}

static void test_reader_byte_by_byte(void **state)
{
    stream s;
    stream_make(&s);
    feed_stream(&s, one_byte);
    stream_free(&s);
}

static void test_reader_random_splits(void **state)
{
    stream s;
    stream_make(&s);
    for (int round = 0; round < 50; round++)
        feed_stream(&s, random_piece);
    stream_free(&s);
}

/* The direct interface: receive straight into the reader's buffer. */
static void test_reader_space_commit(void **state)
{
    stream s;
    stream_make(&s);
    kp_reader r;
    kp_error err;
    kp_reader_init(&r, BIG_CAP);
    size_t at = 0;
    int got = 0;
    while (at < s.len) {
        uint8_t *buf;
        size_t space = kp_reader_space(&r, &buf);
        assert_non_null(buf);
        assert_true(space > 0);
        size_t n = 1 + rng_next() % space;
        if (n > s.len - at)
            n = s.len - at;
        memcpy(buf, s.bytes + at, n);
        at += n;
        int rc = kp_reader_commit(&r, n, &err);
        assert_true(rc == KP_READ_MORE || rc == KP_READ_FRAME);
        if (rc == KP_READ_FRAME) {
            /* A complete frame offers no space until it is taken. */
            assert_int_equal(kp_reader_space(&r, &buf), 0);
            size_t len;
            uint8_t *body = kp_reader_take(&r, &len);
            assert_int_equal(len, s.body_len[got]);
            assert_memory_equal(body, s.bodies[got], len);
            free(body);
            got++;
        }
    }
    assert_int_equal(got, s.n);
    kp_reader_close(&r);
    stream_free(&s);
}

static void test_reader_cap_checked_on_header(void **state)
{
    /* 0xffffffff announced under a 1 MiB cap: refused on the 4th byte. */
    const uint8_t header[] = {0xff, 0xff, 0xff, 0xff, 0x00};
    kp_reader r;
    kp_error err;
    kp_reader_init(&r, 1u << 20);
    const uint8_t *p = header;
    size_t left = 3;
    assert_int_equal(kp_reader_feed(&r, &p, &left, &err), KP_READ_MORE);
    left = 2;
    int rc = kp_reader_feed(&r, &p, &left, &err);
    expect_error(rc, &err, KP_E_FRAME_TOO_LARGE, "4294967295 bytes exceeds the cap of 1048576");
    assert_int_equal(left, 1); /* stopped right after the header */
    assert_null(r.body);       /* nothing was allocated */
    assert_int_equal(r.body_cap, 0);
    /* Dead stays dead, with the same reason. */
    left = 1;
    expect_error(kp_reader_feed(&r, &p, &left, &err), &err, KP_E_FRAME_TOO_LARGE, "exceeds");
    uint8_t *buf;
    assert_int_equal(kp_reader_space(&r, &buf), 0);
    assert_null(buf);
    kp_reader_close(&r);
}

static void test_reader_hello_cap_then_raise(void **state)
{
    size_t body_len = KP_HELLO_MAX_FRAME_BYTES + 1;
    uint8_t *body = make_bin_body(body_len, 1);
    size_t flen;
    uint8_t *frame = make_frame(body, body_len, &flen);
    kp_reader r;
    kp_error err;

    kp_reader_init(&r, KP_HELLO_MAX_FRAME_BYTES);
    const uint8_t *p = frame;
    size_t left = flen;
    expect_error(kp_reader_feed(&r, &p, &left, &err), &err, KP_E_FRAME_TOO_LARGE, "65537");
    kp_reader_close(&r);

    kp_reader_init(&r, KP_HELLO_MAX_FRAME_BYTES);
    kp_reader_set_max_frame(&r, BIG_CAP); /* after hello */
    p = frame;
    left = flen;
    assert_int_equal(kp_reader_feed(&r, &p, &left, &err), KP_READ_FRAME);
    size_t len;
    uint8_t *got = kp_reader_take(&r, &len);
    assert_int_equal(len, body_len);
    free(got);
    kp_reader_close(&r);
    free(frame);
    free(body);
}

static void test_reader_empty_frame_is_dead(void **state)
{
    const uint8_t bytes[] = {0, 0, 0, 0, 0xc0};
    kp_reader r;
    kp_error err;
    kp_reader_init(&r, BIG_CAP);
    const uint8_t *p = bytes;
    size_t left = sizeof(bytes);
    expect_error(kp_reader_feed(&r, &p, &left, &err), &err, KP_E_PROTOCOL, "empty frame");
    kp_reader_close(&r);
}

/* Memory follows the bytes received, not the length announced. */
static void test_reader_allocates_as_bytes_arrive(void **state)
{
    const uint8_t bytes[] = {0x06, 0x40, 0x00, 0x00, 0xc6, 0x06, 0x3f, 0xff, 0xfb, 1, 2, 3};
    kp_reader r;
    kp_error err;
    kp_reader_init(&r, BIG_CAP);
    const uint8_t *p = bytes;
    size_t left = sizeof(bytes);
    assert_int_equal(kp_reader_feed(&r, &p, &left, &err), KP_READ_MORE);
    assert_int_equal(r.body_len, 100u << 20);
    assert_true(r.body_cap <= (64u << 10));
    assert_int_equal(r.body_have, 8);
    kp_reader_close(&r);
}

/* A stream cut mid-frame is "need more", never a frame and never dead. */
static void test_reader_truncated_needs_more(void **state)
{
    uint8_t *body = make_bin_body(1000, 3);
    size_t flen;
    uint8_t *frame = make_frame(body, 1000, &flen);
    for (size_t cut = 0; cut < flen; cut += 97) {
        kp_reader r;
        kp_error err;
        kp_reader_init(&r, BIG_CAP);
        const uint8_t *p = frame;
        size_t left = cut;
        assert_int_equal(kp_reader_feed(&r, &p, &left, &err), KP_READ_MORE);
        size_t len;
        assert_null(kp_reader_take(&r, &len));
        assert_int_equal(len, 0);
        kp_reader_close(&r);
    }
    free(frame);
    free(body);
}

/* ---------------------------------------------------------------------- */
/* Pre-validation                                                         */
/* ---------------------------------------------------------------------- */

static void check_rejects(const uint8_t *body, size_t len, const char *substr)
{
    kp_error err;
    expect_error(kp_frame_check(body, len, BIG_CAP, &err), &err, KP_E_PROTOCOL, substr);
    /* Through the full decode path msgpack-c never runs: it would have made a
     * zone for the container before failing. */
    kp_msg msg;
    kp_msg_init(&msg);
    expect_error(kp_msg_decode(&msg, body, len, BIG_CAP, &err), &err, KP_E_PROTOCOL, substr);
    assert_null(msg.unpacked.zone);
    assert_false(msg.has_id);
    kp_msg_close(&msg);
}

/* msgpack-c issue 1013: 5 bytes asking for 2^32-1 objects (~96 GB). */
static void test_bomb_array32(void **state)
{
    const uint8_t bomb[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
    check_rejects(bomb, sizeof(bomb), "array at offset 0 announces 4294967295 objects, but only "
                  "0 bytes");
}

static void test_bomb_map32(void **state)
{
    const uint8_t bomb[] = {0xdf, 0xff, 0xff, 0xff, 0xff};
    check_rejects(bomb, sizeof(bomb), "map at offset 0 announces 8589934590 objects");
}

static void test_bomb_inside_envelope(void **state)
{
    /* [0, 1, "hello", {"a": <array16 of 65535>}] with 3 bytes after it */
    const uint8_t bomb[] = {0x94, 0x00, 0x01, 0xa5, 'h', 'e', 'l', 'l', 'o', 0x81, 0xa1, 'a',
                            0xdc, 0xff, 0xff, 0xc0, 0xc0, 0xc0};
    check_rejects(bomb, sizeof(bomb), "array at offset 12 announces 65535 objects, but only 3");
}

/* A count that fits the bytes left only if the elements still owed to the
 * enclosing array are forgotten. */
static void test_counts_include_enclosing_promises(void **state)
{
    const uint8_t body[] = {0x93, 0xdc, 0x00, 0x04, 0xc0, 0xc0, 0xc0, 0xc0};
    check_rejects(body, sizeof(body), "announces 4 objects, but only 2 bytes are left");
}

static void test_nested_counts_cannot_multiply(void **state)
{
    /* 16 nested array16 headers each claiming 200 elements in a 300-byte frame. */
    uint8_t body[300];
    memset(body, 0xc0, sizeof(body));
    for (int i = 0; i < 16; i++) {
        body[3 * i] = 0xdc;
        body[3 * i + 1] = 0x00;
        body[3 * i + 2] = 200;
    }
    check_rejects(body, sizeof(body), "array at offset 3 announces 200 objects");
}

static void nested_arrays(uint8_t *body, int depth)
{
    for (int i = 0; i < depth; i++)
        body[i] = 0x91;
    body[depth] = 0xc0;
}

static void test_depth_limit(void **state)
{
    uint8_t body[KP_MAX_DEPTH + 2];
    kp_error err;
    nested_arrays(body, KP_MAX_DEPTH);
    assert_int_equal(kp_frame_check(body, KP_MAX_DEPTH + 1, BIG_CAP, &err), KP_OK);
    nested_arrays(body, KP_MAX_DEPTH + 1);
    check_rejects(body, KP_MAX_DEPTH + 2, "nests deeper than 16 levels");
    /* Empty containers count as a level too. */
    nested_arrays(body, KP_MAX_DEPTH + 1);
    body[KP_MAX_DEPTH] = 0x90;
    check_rejects(body, KP_MAX_DEPTH + 1, "nests deeper");
}

static void test_bin_length_beyond_frame(void **state)
{
    const uint8_t bin32[] = {0xc6, 0x00, 0x10, 0x00, 0x00, 1, 2, 3};
    check_rejects(bin32, sizeof(bin32), "claims 1048576 bytes, only 3 left");
    const uint8_t str8[] = {0x92, 0xd9, 0x05, 'a', 'b', 0xc0};
    check_rejects(str8, sizeof(str8), "str/bin at offset 1 claims 5 bytes, only 3 left");
    const uint8_t fixstr[] = {0xa4, 'a'};
    check_rejects(fixstr, sizeof(fixstr), "claims 4 bytes, only 1 left");
}

static void test_trailing_bytes(void **state)
{
    const uint8_t body[] = {0x92, 0x01, 0x02, 0xc0};
    check_rejects(body, sizeof(body), "trailing bytes: the object ends at offset 3 of a 4-byte");
}

static void test_truncated_values(void **state)
{
    const uint8_t missing[] = {0x93, 0x01, 0x02};
    check_rejects(missing, sizeof(missing), "announces 3 objects, but only 2 bytes");
    const uint8_t header[] = {0x92, 0x01, 0xcd, 0x01};
    check_rejects(header, sizeof(header), "needs 3 header bytes, 2 left");
    const uint8_t after_bin[] = {0x92, 0xc4, 0x01, 0xaa};
    check_rejects(after_bin, sizeof(after_bin), "truncated frame: it ends at offset 4 with 1");
}

static void test_ext_and_reserved_rejected(void **state)
{
    const uint8_t fixext[] = {0xd4, 0x01, 0x02};
    check_rejects(fixext, sizeof(fixext), "ext types are not used");
    const uint8_t ext8[] = {0xc7, 0x01, 0x05, 0x00};
    check_rejects(ext8, sizeof(ext8), "byte 0xc7 at offset 0");
    const uint8_t reserved[] = {0x91, 0xc1};
    check_rejects(reserved, sizeof(reserved), "byte 0xc1 at offset 1: reserved");
}

static void test_object_cap(void **state)
{
    /* array32 of n nils: n + 1 objects. */
    size_t n = KP_MAX_OBJECTS - 1;
    uint8_t *body = malloc(5 + n + 1);
    assert_non_null(body);
    body[0] = 0xdd;
    body[1] = (uint8_t)(n >> 24);
    body[2] = (uint8_t)(n >> 16);
    body[3] = (uint8_t)(n >> 8);
    body[4] = (uint8_t)n;
    memset(body + 5, 0xc0, n + 1);
    kp_error err;
    assert_int_equal(kp_frame_check(body, 5 + n, BIG_CAP, &err), KP_OK);
    n += 1;
    body[4] = (uint8_t)n;
    body[3] = (uint8_t)(n >> 8);
    body[2] = (uint8_t)(n >> 16);
    check_rejects(body, 5 + n, "more than 262144 msgpack objects");
    free(body);
}

static void test_frame_size_cap_in_check(void **state)
{
    const uint8_t body[] = {0x92, 0x01, 0x02};
    kp_error err;
    expect_error(kp_frame_check(body, sizeof(body), 2, &err), &err, KP_E_FRAME_TOO_LARGE,
                 "3 bytes exceeds the cap of 2");
    expect_error(kp_frame_check(body, 0, BIG_CAP, &err), &err, KP_E_PROTOCOL, "empty frame");
}

/* Property: whatever the bytes, msgpack-c unpacks completely every frame
 * kp_frame_check accepts (kp_msg_decode answers KP_E_INTERNAL exactly when
 * they disagree), and a rejected frame never reaches msgpack-c.  Inputs:
 * mutations of a valid request, and random bytes. */
static void test_scanner_agrees_with_msgpack(void **state)
{
    kp_writer w;
    kp_error err;
    assert_int_equal(kp_writer_init(&w, BIG_CAP), KP_OK);
    uint16_t tensor[2 * 2 * 128];
    memset(tensor, 0x3c, sizeof(tensor));
    kp_prefill_seq seq = {.slot = 5, .len = 1, .has_expect_pos = true, .expect_pos = 7};
    for (int t = 0; t < KP_TENSOR_OUT; t++)
        seq.tensors[t] = kp_ref_inline(tensor, t == KP_TENSOR_BETA ? 4 : sizeof(tensor));
    kp_prefill_params p = {.layer = "L0", .seqs = &seq, .nseqs = 1};
    assert_int_equal(kp_prefill_params_encode(&w, 9, &p, &err), KP_OK);
    uint8_t *frame;
    size_t flen;
    assert_int_equal(kp_writer_flatten(&w, &frame, &flen, &err), KP_OK);
    const uint8_t *valid = frame + 4;
    size_t vlen = flen - 4;

    uint8_t *buf = malloc(vlen);
    assert_non_null(buf);
    int accepted = 0, rejected = 0;
    for (int round = 0; round < 20000; round++) {
        size_t len = vlen;
        memcpy(buf, valid, vlen);
        if (round % 4 == 3) {
            len = 1 + rng_next() % 64;
            for (size_t i = 0; i < len; i++)
                buf[i] = (uint8_t)rng_next();
        } else {
            int flips = 1 + (int)(rng_next() % 4);
            for (int i = 0; i < flips; i++)
                buf[rng_next() % vlen] = (uint8_t)rng_next();
            if (round % 4 == 2)
                len = 1 + rng_next() % vlen;
        }
        kp_msg msg;
        kp_msg_init(&msg);
        int check = kp_frame_check(buf, len, BIG_CAP, &err);
        int rc = kp_msg_decode(&msg, buf, len, BIG_CAP, &err);
        assert_int_not_equal(rc, KP_E_INTERNAL);
        if (check == KP_OK) {
            accepted++;
        } else {
            rejected++;
            assert_int_equal(rc, check);
            assert_null(msg.unpacked.zone);
        }
        kp_msg_close(&msg);
    }
    assert_true(accepted > 100);
    assert_true(rejected > 100);
    free(buf);
    free(frame);
    kp_writer_close(&w);
}

/* ---------------------------------------------------------------------- */
/* Zero copy                                                              */
/* ---------------------------------------------------------------------- */

/* Decoded inline tensors point into the frame body (msgpack-c references
 * bin payloads in place). */
static void test_decoded_bins_point_into_the_frame(void **state)
{
    kp_writer w;
    kp_error err;
    assert_int_equal(kp_writer_init(&w, BIG_CAP), KP_OK);
    static uint16_t q[1 * 2 * 128], beta[2];
    for (size_t i = 0; i < sizeof(q) / 2; i++)
        q[i] = (uint16_t)i;
    kp_prefill_seq seq = {.slot = 1, .len = 1};
    for (int t = 0; t < KP_TENSOR_OUT; t++)
        seq.tensors[t] = t == KP_TENSOR_BETA ? kp_ref_inline(beta, sizeof(beta))
                                             : kp_ref_inline(q, sizeof(q));
    kp_prefill_params p = {.layer = "L", .seqs = &seq, .nseqs = 1};
    assert_int_equal(kp_prefill_params_encode(&w, 1, &p, &err), KP_OK);
    uint8_t *frame;
    size_t flen;
    assert_int_equal(kp_writer_flatten(&w, &frame, &flen, &err), KP_OK);

    kp_msg msg;
    kp_msg_init(&msg);
    assert_int_equal(kp_msg_decode(&msg, frame + 4, flen - 4, BIG_CAP, &err), KP_OK);
    kp_session s = {.geometry = {.heads = 2, .head_dim = 128, .slots = 4}};
    kp_limits_default(&s.limits);
    kp_prefill_params got;
    assert_int_equal(kp_prefill_params_decode(&msg, &s, &got, &err), KP_OK);
    const uint8_t *data = got.seqs[0].q.data;
    assert_true(data > frame + 4 && data + sizeof(q) <= frame + flen);
    assert_memory_equal(data, q, sizeof(q));
    kp_msg_close(&msg);
    free(frame);
    kp_writer_close(&w);
}

/* Large payloads are referenced by the iovec list, small ones copied. */
static void test_writer_references_large_payloads(void **state)
{
    kp_writer w;
    kp_error err;
    assert_int_equal(kp_writer_init(&w, BIG_CAP), KP_OK);
    size_t big = 1u << 20;
    uint8_t *state_bytes = malloc(big);
    assert_non_null(state_bytes);
    memset(state_bytes, 0x5a, big);
    kp_slot_write_params p = {.slot = 3, .pos = 10, .dtype = KP_DTYPE_BF16,
                              .state = kp_ref_inline(state_bytes, big)};
    assert_int_equal(kp_slot_write_params_encode(&w, 77, &p, &err), KP_OK);

    size_t n;
    const struct iovec *iov = kp_writer_iov(&w, &n);
    int refs = 0;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        total += iov[i].iov_len;
        if (iov[i].iov_base == state_bytes) {
            assert_int_equal(iov[i].iov_len, big);
            refs++;
        }
    }
    assert_int_equal(refs, 1);
    assert_int_equal(total, kp_writer_frame_bytes(&w));
    /* The prefix is the body length, big-endian. */
    const uint8_t *prefix = iov[0].iov_base;
    uint64_t body = total - 4;
    assert_int_equal(prefix[0], (uint8_t)(body >> 24));
    assert_int_equal(prefix[1], (uint8_t)(body >> 16));
    assert_int_equal(prefix[2], (uint8_t)(body >> 8));
    assert_int_equal(prefix[3], (uint8_t)body);

    /* A small payload is copied: no iovec points at it. */
    uint8_t small[64] = {1};
    p.state = kp_ref_inline(small, sizeof(small));
    assert_int_equal(kp_slot_write_params_encode(&w, 78, &p, &err), KP_OK);
    iov = kp_writer_iov(&w, &n);
    for (size_t i = 0; i < n; i++)
        assert_ptr_not_equal(iov[i].iov_base, small);
    free(state_bytes);
    kp_writer_close(&w);
}

static void test_writer_respects_peer_cap(void **state)
{
    kp_writer w;
    kp_error err;
    assert_int_equal(kp_writer_init(&w, 1000), KP_OK);
    uint8_t bytes[2000] = {0};
    kp_slot_write_params p = {.slot = 3, .pos = 0, .dtype = KP_DTYPE_BF16,
                              .state = kp_ref_inline(bytes, sizeof(bytes))};
    expect_error(kp_slot_write_params_encode(&w, 1, &p, &err), &err, KP_E_FRAME_TOO_LARGE,
                 "exceeds the peer's cap of 1000");
    kp_writer_set_max_frame(&w, 4096);
    assert_int_equal(kp_slot_write_params_encode(&w, 1, &p, &err), KP_OK);
    kp_writer_close(&w);
}

/* ---------------------------------------------------------------------- */
/* Envelope                                                               */
/* ---------------------------------------------------------------------- */

static int decode_bytes(kp_msg *msg, const uint8_t *body, size_t len, kp_error *err)
{
    kp_msg_init(msg);
    return kp_msg_decode(msg, body, len, BIG_CAP, err);
}

static void test_envelope_shapes(void **state)
{
    kp_msg msg;
    kp_error err;

    /* [0, 7, "health", {}] */
    const uint8_t req[] = {0x94, 0x00, 0x07, 0xa6, 'h', 'e', 'a', 'l', 't', 'h', 0x80};
    assert_int_equal(decode_bytes(&msg, req, sizeof(req), &err), KP_OK);
    assert_int_equal(msg.kind, KP_MSG_REQUEST);
    assert_true(msg.has_id);
    assert_int_equal(msg.id, 7);
    assert_int_equal(msg.method, KP_METHOD_HEALTH);
    assert_string_equal(msg.name, "health");
    kp_msg_close(&msg);

    /* Unknown method: decodes, answerable with UNKNOWN_METHOD. */
    const uint8_t unknown[] = {0x94, 0x00, 0x08, 0xa3, 'f', 'o', 'o', 0x80};
    assert_int_equal(decode_bytes(&msg, unknown, sizeof(unknown), &err), KP_OK);
    assert_int_equal(msg.method, KP_METHOD_UNKNOWN);
    assert_string_equal(msg.name, "foo");
    kp_msg_close(&msg);

    /* An empty method name (msgpack-c hands it over as a NULL pointer): unknown, "". */
    const uint8_t empty[] = {0x94, 0x00, 0x08, 0xa0, 0x80};
    assert_int_equal(decode_bytes(&msg, empty, sizeof(empty), &err), KP_OK);
    assert_int_equal(msg.method, KP_METHOD_UNKNOWN);
    assert_string_equal(msg.name, "");
    kp_msg_close(&msg);

    /* Params not a map: a protocol error, but the id is known. */
    const uint8_t bad_params[] = {0x94, 0x00, 0x09, 0xa3, 'f', 'o', 'o', 0x90};
    expect_error(decode_bytes(&msg, bad_params, sizeof(bad_params), &err), &err, KP_E_PROTOCOL,
                 "params: expected a map, got array");
    assert_true(msg.has_id);
    assert_int_equal(msg.id, 9);
    kp_msg_close(&msg);

    /* [1, 3, nil, {}] and [1, 3, {...}, nil] */
    const uint8_t ok[] = {0x94, 0x01, 0x03, 0xc0, 0x80};
    assert_int_equal(decode_bytes(&msg, ok, sizeof(ok), &err), KP_OK);
    assert_int_equal(msg.kind, KP_MSG_RESPONSE);
    assert_non_null(msg.result);
    assert_null(msg.error);
    kp_msg_close(&msg);
    const uint8_t both[] = {0x94, 0x01, 0x03, 0x80, 0x80};
    expect_error(decode_bytes(&msg, both, sizeof(both), &err), &err, KP_E_PROTOCOL,
                 "[1, id, nil, result]");
    kp_msg_close(&msg);

    /* [2, "goodbye", {}] */
    const uint8_t note[] = {0x93, 0x02, 0xa7, 'g', 'o', 'o', 'd', 'b', 'y', 'e', 0x80};
    assert_int_equal(decode_bytes(&msg, note, sizeof(note), &err), KP_OK);
    assert_int_equal(msg.kind, KP_MSG_NOTIFICATION);
    assert_false(msg.has_id);
    assert_string_equal(msg.name, "goodbye");
    kp_msg_close(&msg);

    const uint8_t kind3[] = {0x93, 0x03, 0x01, 0x80};
    expect_error(decode_bytes(&msg, kind3, sizeof(kind3), &err), &err, KP_E_PROTOCOL,
                 "message type: expected 0, 1 or 2");
    kp_msg_close(&msg);
    const uint8_t not_array[] = {0x80};
    expect_error(decode_bytes(&msg, not_array, sizeof(not_array), &err), &err, KP_E_PROTOCOL,
                 "expected an array [type, ...], got map");
    kp_msg_close(&msg);
    const uint8_t big_id[] = {0x94, 0x00, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0, 0xa1, 'x', 0x80};
    expect_error(decode_bytes(&msg, big_id, sizeof(big_id), &err), &err, KP_E_PROTOCOL,
                 "message id: expected an unsigned 32-bit integer");
    kp_msg_close(&msg);
    const uint8_t short_req[] = {0x93, 0x00, 0x01, 0xa1, 'x'};
    expect_error(decode_bytes(&msg, short_req, sizeof(short_req), &err), &err, KP_E_PROTOCOL,
                 "request: expected 4 elements, got 3");
    kp_msg_close(&msg);
}

/* A message whose frame went through writer -> reader -> decoder: the
 * complete path a connection takes. */
static void test_writer_reader_decoder_path(void **state)
{
    kp_writer w;
    kp_error err;
    assert_int_equal(kp_writer_init(&w, BIG_CAP), KP_OK);
    assert_int_equal(kp_health_params_encode(&w, 4242, &err), KP_OK);
    size_t n;
    const struct iovec *iov = kp_writer_iov(&w, &n);
    kp_reader r;
    kp_reader_init(&r, KP_HELLO_MAX_FRAME_BYTES);
    int rc = KP_READ_MORE;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *p = iov[i].iov_base;
        size_t left = iov[i].iov_len;
        rc = kp_reader_feed(&r, &p, &left, &err);
    }
    assert_int_equal(rc, KP_READ_FRAME);
    size_t len;
    uint8_t *body = kp_reader_take(&r, &len);
    kp_msg msg;
    assert_int_equal(decode_bytes(&msg, body, len, &err), KP_OK);
    assert_int_equal(msg.id, 4242);
    assert_int_equal(msg.method, KP_METHOD_HEALTH);
    kp_msg_close(&msg);
    free(body);
    kp_reader_close(&r);
    kp_writer_close(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reader_whole_frame),
        cmocka_unit_test(test_reader_byte_by_byte),
        cmocka_unit_test(test_reader_random_splits),
        cmocka_unit_test(test_reader_space_commit),
        cmocka_unit_test(test_reader_cap_checked_on_header),
        cmocka_unit_test(test_reader_hello_cap_then_raise),
        cmocka_unit_test(test_reader_empty_frame_is_dead),
        cmocka_unit_test(test_reader_allocates_as_bytes_arrive),
        cmocka_unit_test(test_reader_truncated_needs_more),
        cmocka_unit_test(test_bomb_array32),
        cmocka_unit_test(test_bomb_map32),
        cmocka_unit_test(test_bomb_inside_envelope),
        cmocka_unit_test(test_counts_include_enclosing_promises),
        cmocka_unit_test(test_nested_counts_cannot_multiply),
        cmocka_unit_test(test_depth_limit),
        cmocka_unit_test(test_bin_length_beyond_frame),
        cmocka_unit_test(test_trailing_bytes),
        cmocka_unit_test(test_truncated_values),
        cmocka_unit_test(test_ext_and_reserved_rejected),
        cmocka_unit_test(test_object_cap),
        cmocka_unit_test(test_frame_size_cap_in_check),
        cmocka_unit_test(test_scanner_agrees_with_msgpack),
        cmocka_unit_test(test_decoded_bins_point_into_the_frame),
        cmocka_unit_test(test_writer_references_large_payloads),
        cmocka_unit_test(test_writer_respects_peer_cap),
        cmocka_unit_test(test_envelope_shapes),
        cmocka_unit_test(test_writer_reader_decoder_path),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
