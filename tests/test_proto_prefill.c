/*
 * test_proto_prefill.c - prefill's validation (proto/prefill.c): every check
 * the codec makes on arrival (tensor sizes against len and H, types and
 * fields per sequence, region reference form, duplicate slots, outputs
 * overlapping other ranges, the token and inline limits), the checks on its
 * result, and the region bounds walk the daemon runs; and the one-pass
 * reader (proto/prefill_read.c) held to the decoder's verdicts on every
 * refused edit, on random requests and on mutated ones.  Each invalid request
 * is the valid four-sequence request of test_proto_harness.c with one change.
 * The semaphores of stream-ordered prefills: encoded and decoded, refused
 * when malformed, declined by the one-pass reader.
 */
#include <stdlib.h>
#include <string.h>

#include "test_proto_harness.h"

/* ---------------------------------------------------------------------- */
/* Invalid params: prefill                                                */
/* ---------------------------------------------------------------------- */

static void test_prefill_wrong_shape_names_field(void **state)
{
    static uint8_t short_bin[100];
    edit e;
    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 2), "q", v_bin(short_bin, sizeof(short_bin)));
    expect_refused(&e, KP_E_INVALID_PARAMS,
                   "seqs[2].q: expected 294912 bytes (len 12 x 96 heads x 128 x 2 bytes bf16), "
                   "got 100");
    edit_end(&e);

    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 0), "beta", v_bin(short_bin, sizeof(short_bin)));
    expect_refused(&e, KP_E_INVALID_PARAMS,
                   "seqs[0].beta: expected 2304 bytes (len 12 x 96 heads x 2 bytes bf16), got 100");
    edit_end(&e);

    /* len changed but tensors not: the shapes no longer match */
    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 0), "len", v_u64(11));
    expect_refused(&e, KP_E_INVALID_PARAMS, "seqs[0].q: expected 270336 bytes (len 11");
    edit_end(&e);
}

/* An inline bin of seqs[1]'s output size. */
static uint8_t out5_bin[TOK_BYTES(5)];

static void test_prefill_types_and_fields(void **state)
{
    edit e;
    struct {
        const char *what;
        int seq; /* -1: top-level params */
        const char *key;
        int op;  /* 0 set, 1 delete, 2 append duplicate */
        msgpack_object v;
        const char *message;
    } cases[] = {
        {"len as str", 1, "len", 0, v_str("5"), "seqs[1].len: expected an unsigned integer, got str"},
        {"slot missing", 0, "slot", 1, {0}, "seqs[0].slot: required field is missing"},
        {"unknown seq field", 0, "expected_pos", 0, v_u64(3), "seqs[0]: unknown field \"expected_pos\""},
        {"negative expect_pos", 0, "expect_pos", 0, v_neg(-1),
         "seqs[0].expect_pos: expected an unsigned integer, got negative integer"},
        {"fresh as int", 0, "fresh", 0, v_u64(1), "seqs[0].fresh: expected a bool, got unsigned integer"},
        {"fresh with expect_pos", 0, "fresh", 0, v_bool(true),
         "seqs[0].expect_pos: not allowed with fresh"},
        {"len above max_batch_tokens", 0, "len", 0, v_u64(70000), "seqs[0].len: 70000 is outside [0, 65536]"},
        {"q as float", 0, "q", 0, v_f64(1.0), "seqs[0].q: expected a bin or a region map, got float64"},
        {"tensor missing", 2, "g", 1, {0}, "seqs[2].g: required field is missing"},
        {"tensor on len 0", 3, "v", 0, v_bin("abc", 3), "seqs[3].v: must be absent when len is 0"},
        {"layer missing", -1, "layer", 1, {0}, "layer: required field is missing"},
        {"layer as int", -1, "layer", 0, v_u64(3), "layer: expected a str, got unsigned integer"},
        {"unknown param", -1, "stream", 0, v_bool(true), "params: unknown field \"stream\""},
        {"duplicate key", -1, "layer", 2, v_str("other"), "params: field \"layer\" appears twice"},
        {"seqs nil", -1, "seqs", 0, v_nil(), "seqs: expected an array, got nil"},
        {"layer empty", -1, "layer", 0, v_str(""), "layer: 0 bytes, at least 1 needed"},
        {"duplicate seq key", 3, "slot", 2, v_u64(9), "seqs[3]: field \"slot\" appears twice"},
        {"len beyond 32 bits", 3, "len", 0, v_u64(1ull << 32),
         "seqs[3].len: 4294967296 is outside [0, 65536]"},
        {"out inline", 1, "out", 0, v_bin(out5_bin, TOK_BYTES(5)),
         "seqs[1].out: must be a region reference"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        encode_valid_prefill();
        edit_begin(&e);
        msgpack_object *map = cases[i].seq < 0 ? e.map : seq_at(&e, (uint32_t)cases[i].seq);
        if (cases[i].op == 0)
            edit_set(&e, map, cases[i].key, cases[i].v);
        else if (cases[i].op == 1)
            edit_del(map, cases[i].key);
        else
            edit_append(&e, map, cases[i].key, cases[i].v);
        print_message("case: %s\n", cases[i].what);
        expect_refused(&e, KP_E_INVALID_PARAMS, cases[i].message);
        edit_end(&e);
    }
}

static void test_prefill_region_refs(void **state)
{
    edit e;
    static uint8_t small[16];

    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 1), "q", v_region(&e, 1, 8));
    expect_refused(&e, KP_E_INVALID_PARAMS, "seqs[1].q.offset: 8 is not a multiple of 16");
    edit_end(&e);

    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 1), "q", v_region(&e, 0, 0));
    expect_refused(&e, KP_E_INVALID_PARAMS, "seqs[1].q.region: 0 is outside [1, 4294967295]");
    edit_end(&e);

    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 1), "k", v_region(&e, 1, UINT64_MAX - 15));
    expect_refused(&e, KP_E_REGION_BOUNDS,
                   "seqs[1].k: offset 18446744073709551600 + 122880 bytes overflows");
    edit_end(&e);

    encode_valid_prefill();
    edit_begin(&e);
    msgpack_object ref = v_region(&e, 1, 0);
    edit_append(&e, &ref, "length", v_u64(5));
    edit_set(&e, seq_at(&e, 1), "q", ref);
    expect_refused(&e, KP_E_INVALID_PARAMS, "seqs[1].q: unknown field \"length\"");
    edit_end(&e);

    encode_valid_prefill();
    edit_begin(&e);
    msgpack_object no_offset = v_region(&e, 1, 0);
    edit_del(&no_offset, "offset");
    edit_set(&e, seq_at(&e, 1), "v", no_offset);
    expect_refused(&e, KP_E_INVALID_PARAMS, "seqs[1].v.offset: required field is missing");
    edit_end(&e);

    /* out must be a region: inline output is asked for by omitting it */
    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 1), "out", v_bin(small, sizeof(small)));
    expect_refused(&e, KP_E_INVALID_PARAMS, "seqs[1].out: must be a region reference");
    edit_end(&e);
}

static void test_prefill_duplicate_slot(void **state)
{
    edit e;
    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 2), "slot", v_u64(SLOT(1)));
    expect_refused(&e, KP_E_INVALID_PARAMS,
                   "seqs[2].slot: slot 0x700000001 is also named by seqs[0]");
    edit_end(&e);
}

/* The overlap check against every pair, on random layouts of 1..12
 * one-token sequences in two regions (offsets on a coarse grid, so that
 * overlaps, adjacency and shared inputs all happen). */
static void test_prefill_overlaps_random(void **state)
{
    (void)state;
    uint64_t rng = 12345;
    int refused = 0, rounds = 3000;
    for (int round = 0; round < rounds; round++) {
        kp_prefill_seq seqs[12];
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t n = 1 + (uint32_t)(rng >> 60) % 12;
        memset(seqs, 0, sizeof(seqs));
        for (uint32_t i = 0; i < n; i++) {
            seqs[i].slot = SLOT(i);
            seqs[i].len = 1;
            for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                uint64_t bytes = t == KP_TENSOR_BETA ? BETA_BYTES(1) : TOK_BYTES(1);
                uint32_t region = 1 + (uint32_t)(rng >> 63);
                /* a grid of half a token tensor: overlaps, adjacency, shared inputs */
                uint64_t off = ((rng >> 20) % 512) * (TOK_BYTES(1) / 2);
                seqs[i].tensors[t] = kp_ref_region(region, off, bytes);
            }
        }
        bool overlap = false;
        for (uint32_t i = 0; i < n; i++) {
            const kp_ref *o = &seqs[i].out;
            for (uint32_t j = 0; j < n; j++) {
                for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
                    const kp_ref *x = &seqs[j].tensors[t];
                    if ((j == i && t == KP_TENSOR_OUT) || x->region != o->region)
                        continue;
                    overlap |= x->offset < o->offset + o->nbytes && o->offset < x->offset + x->nbytes;
                }
            }
        }
        kp_prefill_params p = {.layer = "L", .seqs = seqs, .nseqs = n};
        ENC(kp_prefill_params_encode(&test_writer, 11, &p, &enc_err_));
        wire x;
        open_request(&x, KP_METHOD_PREFILL, 11);
        kp_prefill_params got;
        kp_error e;
        int rc = kp_prefill_params_decode(&x.msg, &test_session, &got, &e);
        assert_int_equal(prefill_read_agrees(x.frame + 4, x.len - 4, &test_session, true),
                         rc == KP_OK);
        if (overlap != (rc != KP_OK))
            fail_msg("round %d, %u seqs: brute force says %s, the check said %s", round, n,
                     overlap ? "overlap" : "none", rc ? e.message : "ok");
        if (rc)
            assert_non_null(strstr(e.message, ".out overlaps "));
        refused += rc != KP_OK;
        wire_close(&x);
    }
    /* both outcomes, often */
    assert_true(refused > rounds / 10 && refused < rounds * 9 / 10);
}

/* ---------------------------------------------------------------------- */
/* The one-pass reader against the decoder                                */
/* ---------------------------------------------------------------------- */

static uint64_t next_rng(uint64_t *rng)
{
    *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
    return *rng >> 33;
}

/* A random request under session s (1 head): lengths 0..4 (0 one time in
 * five), expect_pos / fresh (both, which is refused, now and then), each
 * input inline or by region, out by region or absent, regions 1..3 on a
 * coarse grid (overlaps happen), and a repeated slot now and then. */
static void random_prefill(uint64_t *rng, kp_prefill_seq *seqs, uint32_t *n, const uint8_t *data)
{
    *n = 1 + (uint32_t)(next_rng(rng) % 16);
    memset(seqs, 0, 16 * sizeof(*seqs));
    for (uint32_t i = 0; i < *n; i++) {
        kp_prefill_seq *q = &seqs[i];
        q->slot = next_rng(rng) % 50 == 0 ? SLOT(0) : SLOT(i);
        q->len = next_rng(rng) % 5 == 0 ? 0 : 1 + (uint32_t)(next_rng(rng) % 4);
        q->has_expect_pos = next_rng(rng) % 3 == 0;
        q->expect_pos = next_rng(rng) % 3 ? next_rng(rng) % 1000 : UINT64_MAX - next_rng(rng) % 4;
        q->fresh = next_rng(rng) % (q->has_expect_pos ? 40 : 3) == 0;
        for (int t = 0; t < KP_PREFILL_TENSORS && q->len > 0; t++) {
            uint64_t bytes = t == KP_TENSOR_BETA ? 2ull * q->len : 256ull * q->len;
            uint64_t pick = next_rng(rng) % 10;
            if (t == KP_TENSOR_OUT && pick < 3)
                continue; /* inline output */
            if (t != KP_TENSOR_OUT && pick < 3)
                q->tensors[t] = kp_ref_inline(data, bytes);
            else
                q->tensors[t] = kp_ref_region(1 + (uint32_t)(next_rng(rng) % 3),
                                              (next_rng(rng) % 4096) * 64, bytes);
        }
    }
}

/* A mutant of a frame body: one to three bytes replaced (an interesting value, any value, a
 * flipped bit), one in four also cut short; in a buffer of its own size (*len), so that
 * reading past its end is caught under ASan.  The caller frees it. */
static uint8_t *mutant_of(const uint8_t *body, size_t *len, uint64_t *rng)
{
    static const uint8_t values[] = {0x00, 0x01, 0x7f, 0x80, 0x81, 0x82, 0x85, 0x8f, 0x90,
                                     0x91, 0x92, 0xa0, 0xa3, 0xa6, 0xc0, 0xc1, 0xc2, 0xc3,
                                     0xc4, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd3, 0xd9, 0xdc,
                                     0xde, 0xdf, 0xe0, 0xff};
    uint8_t *m = malloc(*len);
    assert_non_null(m);
    memcpy(m, body, *len);
    for (uint64_t edits = 1 + next_rng(rng) % 3; edits > 0; edits--) {
        size_t at = next_rng(rng) % *len;
        uint64_t how = next_rng(rng) % 3;
        m[at] = how == 0   ? values[next_rng(rng) % sizeof(values)]
                : how == 1 ? (uint8_t)next_rng(rng)
                           : (uint8_t)(m[at] ^ 1u << next_rng(rng) % 8);
    }
    if (next_rng(rng) % 4 == 0)
        *len = 1 + next_rng(rng) % *len;
    return m;
}

static void test_prefill_read_agrees_random(void **state)
{
    (void)state;
    kp_session s = test_session;
    s.geometry.heads = 1;
    static uint8_t data[1024];
    uint64_t rng = 2026;
    int valid = 0, mutated_valid = 0, mutated_read = 0, rounds = 2000;
    for (int round = 0; round < rounds; round++) {
        kp_prefill_seq seqs[16];
        uint32_t n;
        random_prefill(&rng, seqs, &n, data);
        kp_prefill_params p = {.layer = next_rng(&rng) % 2 ? "model.layers.0.kda" : "L",
                               .seqs = seqs, .nseqs = n};
        ENC(kp_prefill_params_encode(&test_writer, (uint32_t)next_rng(&rng), &p, &enc_err_));
        uint8_t *frame;
        size_t len;
        kp_error err;
        assert_int_equal(kp_writer_flatten(&test_writer, &frame, &len, &err), KP_OK);
        valid += prefill_read_agrees(frame + 4, len - 4, &s, true);
        for (int m = 0; m < 24; m++) {
            size_t body = len - 4;
            uint8_t *mutant = mutant_of(frame + 4, &body, &rng);
            kp_msg probe;
            kp_prefill_params got;
            kp_msg_init(&probe);
            mutated_read += kp_prefill_request_read(&probe, mutant, body, UINT32_MAX, &s, &got);
            kp_msg_close(&probe);
            mutated_valid += prefill_read_agrees(mutant, body, &s, false);
            free(mutant);
        }
        free(frame);
    }
    print_message("%d of %d requests valid; mutated: %d valid, %d read\n", valid, rounds,
                  mutated_valid, mutated_read);
    /* both outcomes, often, before and after mutation */
    assert_true(valid > rounds / 10 && valid < rounds * 9 / 10);
    assert_true(mutated_valid > rounds && mutated_read > rounds / 2);
}

/* Body bytes of the valid prefill with bytes [at, at + cut) replaced by n new ones. */
static uint8_t *spliced(const uint8_t *body, size_t len, size_t at, size_t cut,
                        const uint8_t *bytes, size_t n, size_t *out_len)
{
    uint8_t *b = malloc(len - cut + n);
    assert_non_null(b);
    memcpy(b, body, at);
    memcpy(b + at, bytes, n);
    memcpy(b + at + n, body + at + cut, len - at - cut);
    *out_len = len - cut + n;
    return b;
}

/* The valid prefill's frame body, opened into x (closed by the caller). */
static const uint8_t *valid_prefill_body(wire *x, size_t *len)
{
    encode_valid_prefill();
    open_request(x, KP_METHOD_PREFILL, 11);
    *len = x->len - 4;
    return x->frame + 4;
}

/* The envelope [0, 11, "prefill", params]: what the reader declines and
 * the encodings it reads. */
static void test_prefill_read_envelopes(void **state)
{
    (void)state;
    wire x;
    size_t len;
    const uint8_t *body = valid_prefill_body(&x, &len);
    static const uint8_t head[] = {0x94, 0x00, 0x0b, 0xa7, 'p', 'r', 'e', 'f', 'i', 'l', 'l'};
    assert_memory_equal(body, head, sizeof(head));
    struct {
        const char *what;
        size_t at, cut;
        uint8_t bytes[12];
        size_t n;
        bool valid;
    } cases[] = {
        {"as is", 0, 0, {0}, 0, true},
        {"id as uint8", 2, 1, {0xcc, 0x0b}, 2, true},
        {"id as uint64", 2, 1, {0xcf, 0, 0, 0, 0, 0, 0, 0, 0x0b}, 9, true},
        {"method as str8", 3, 1, {0xd9, 7}, 2, true},
        {"id as int8", 2, 1, {0xd0, 0x0b}, 2, true}, /* valid; the reader may leave it */
        {"a response", 1, 1, {0x01}, 1, false},
        {"a notification", 1, 1, {0x02}, 1, false},
        {"id above 32 bits", 2, 1, {0xcf, 0, 0, 0, 1, 0, 0, 0, 0}, 9, false},
        {"negative id", 2, 1, {0xff}, 1, false},
        {"method misspelt", 3, 8, {0xa6, 'p', 'r', 'e', 'f', 'i', 'l'}, 7, false},
        {"method as bin", 3, 1, {0xc4, 7}, 2, false},
        {"three elements, params after them", 0, 1, {0x93}, 1, false},
        {"five elements", 0, 1, {0x95}, 1, false},
        {"trailing nil", len, 0, {0xc0}, 1, false},
        {"cut short", len - 1, 1, {0}, 0, false},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t n;
        uint8_t *b = spliced(body, len, cases[i].at, cases[i].cut, cases[i].bytes, cases[i].n, &n);
        print_message("case: %s\n", cases[i].what);
        bool must_read = cases[i].valid && strcmp(cases[i].what, "id as int8") != 0;
        assert_int_equal(prefill_read_agrees(b, n, &test_session, must_read), cases[i].valid);
        free(b);
    }
    wire_close(&x);
}

/* A region reference's keys in the encoders' order (the reader's fast path), reversed (its
 * general loop), and with a key as str8 (left to the decoder). */
static void test_prefill_read_ref_orders(void **state)
{
    (void)state;
    wire x;
    size_t len;
    const uint8_t *body = valid_prefill_body(&x, &len);
    static const uint8_t ref[] = {0x82, 0xa6, 'r', 'e', 'g', 'i', 'o', 'n'};
    size_t at = 0;
    while (at + sizeof(ref) < len && memcmp(body + at, ref, sizeof(ref)) != 0)
        at++;
    assert_true(at + sizeof(ref) < len);
    const uint8_t region = body[at + sizeof(ref)]; /* a positive fixint */
    const uint8_t *offset_key = body + at + sizeof(ref) + 1, *ov = offset_key + 7;
    assert_true(region >= 1 && region <= 0x7f);
    assert_memory_equal(offset_key, "\xa6offset", 7);
    const size_t olen = *ov <= 0x7f ? 1 : *ov == 0xcc ? 2 : *ov == 0xcd ? 3 : *ov == 0xce ? 5 : 9;
    uint8_t rev[32];
    size_t n = 0, blen;
    rev[n++] = 0x82;
    memcpy(rev + n, offset_key, 7 + olen);
    n += 7 + olen;
    memcpy(rev + n, ref + 1, sizeof(ref) - 1);
    n += sizeof(ref) - 1;
    rev[n++] = region;
    uint8_t *b = spliced(body, len, at, sizeof(ref) + 1 + 7 + olen, rev, n, &blen);
    assert_true(prefill_read_agrees(b, blen, &test_session, true));
    free(b);
    static const uint8_t str8[] = {0x82, 0xd9, 6, 'r', 'e', 'g', 'i', 'o', 'n'};
    b = spliced(body, len, at, sizeof(ref), str8, sizeof(str8), &blen);
    assert_true(prefill_read_agrees(b, blen, &test_session, false));
    kp_msg probe;
    kp_prefill_params got;
    kp_msg_init(&probe);
    assert_false(kp_prefill_request_read(&probe, b, blen, UINT32_MAX, &test_session, &got));
    kp_msg_close(&probe);
    free(b);
    wire_close(&x);
}

/* Integers are packed in their shortest form, each boundary both ways, and
 * read back whole by both decoders. */
static void test_prefill_uint_forms(void **state)
{
    (void)state;
    static const struct {
        uint64_t v;
        size_t bytes; /* type byte included */
    } cases[] = {
        {0, 1}, {0x7f, 1}, {0x80, 2}, {0xff, 2}, {0x100, 3}, {0xffff, 3}, {0x10000, 5},
        {0xffffffffull, 5}, {0x100000000ull, 9}, {UINT64_MAX, 9},
    };
    size_t base = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        kp_prefill_seq seq = {.slot = cases[i].v, .len = 0};
        kp_prefill_params p = {.layer = "L", .seqs = &seq, .nseqs = 1};
        ENC(kp_prefill_params_encode(&test_writer, 11, &p, &enc_err_));
        wire x;
        open_request(&x, KP_METHOD_PREFILL, 11);
        if (i == 0)
            base = x.len - cases[i].bytes;
        assert_int_equal(x.len - base, cases[i].bytes);
        kp_prefill_params got;
        DEC(kp_prefill_params_decode(&x.msg, &test_session, &got, &dec_err_));
        assert_int_equal(got.seqs[0].slot, cases[i].v);
        assert_true(prefill_read_agrees(x.frame + 4, x.len - 4, &test_session, true));
        wire_close(&x);
    }
}

/* A key is compared with its whole length: "slot" followed by a NUL is
 * another, unknown, field. */
static void test_prefill_key_with_nul(void **state)
{
    edit e;
    encode_valid_prefill();
    edit_begin(&e);
    msgpack_object *seq = seq_at(&e, 0);
    msgpack_object_kv *kv = edit_find(seq, "slot");
    static const char slot_nul[] = {'s', 'l', 'o', 't', '\0'};
    kv->key.via.str.ptr = slot_nul;
    kv->key.via.str.size = sizeof(slot_nul);
    expect_refused(&e, KP_E_INVALID_PARAMS, "seqs[0]: unknown field \"slot\"");
    edit_end(&e);
}

static void test_prefill_out_overlaps(void **state)
{
    edit e;
    /* out of seqs[1] onto its own v */
    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 1), "out", v_region(&e, 1, R1_V + 16));
    expect_refused(&e, KP_E_INVALID_PARAMS, "seqs[1].out overlaps seqs[1].v in region 1");
    edit_end(&e);

    /* an input starting inside an earlier output */
    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 0), "q", v_region(&e, 2, 4096 + TOK_BYTES(5) - 16));
    expect_refused(&e, KP_E_INVALID_PARAMS, "seqs[1].out overlaps seqs[0].q in region 2");
    edit_end(&e);

    /* two outputs sharing bytes */
    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 2), "out", v_region(&e, 2, 4096 + 256));
    expect_refused(&e, KP_E_INVALID_PARAMS, "overlaps");
    edit_end(&e);

    /* Inputs may share bytes; an output adjacent to an input is fine. */
    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 1), "k", v_region(&e, 1, R1_Q));
    edit_set(&e, seq_at(&e, 1), "out", v_region(&e, 1, R1_BETA + BETA_BYTES(5) - 16));
    expect_refused(&e, KP_E_INVALID_PARAMS, "seqs[1].out overlaps seqs[1].beta");
    edit_end(&e);

    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, seq_at(&e, 1), "k", v_region(&e, 1, R1_Q));
    edit_set(&e, seq_at(&e, 1), "out", v_region(&e, 1, R1_BETA + BETA_BYTES(5)));
    expect_accepted(&e);
    edit_end(&e);
}

static void test_prefill_limits(void **state)
{
    edit e;
    kp_session s = test_session;

    s.limits.max_batch_tokens = 20; /* every len fits, the sum (29) does not */
    encode_valid_prefill();
    edit_begin(&e);
    expect_refused_with(&e, &s, KP_E_LIMIT_EXCEEDED,
                        "seqs: 29 tokens in total exceed max_batch_tokens 20");
    edit_end(&e);

    s = test_session;
    s.limits.max_inline_bytes = 1u << 20;
    encode_valid_prefill();
    edit_begin(&e);
    expect_refused_with(&e, &s, KP_E_LIMIT_EXCEEDED,
                        "seqs: 2363904 inline tensor bytes exceed max_inline_bytes 1048576");
    edit_end(&e);

    /* inputs by region (no inline input), the inline output (2 x 294912) too big */
    s = test_session;
    s.limits.max_inline_bytes = 500000;
    encode_valid_prefill();
    edit_begin(&e);
    for (uint32_t i = 0; i <= 2; i += 2) {
        for (int t = 0; t < KP_TENSOR_OUT; t++)
            edit_set(&e, seq_at(&e, i), kp_prefill_tensor_name(t), v_region(&e, 3, 0));
    }
    expect_refused_with(&e, &s, KP_E_LIMIT_EXCEEDED,
                        "seqs: the inline output of 589824 bytes would exceed max_inline_bytes "
                        "500000");
    edit_end(&e);

    s = test_session;
    s.limits.max_seqs_per_request = 3;
    encode_valid_prefill();
    edit_begin(&e);
    expect_refused_with(&e, &s, KP_E_INVALID_PARAMS, "seqs: 4 entries, expected 1..3");
    edit_end(&e);

    encode_valid_prefill();
    edit_begin(&e);
    edit_set(&e, e.map, "seqs", v_array(&e, 0, NULL));
    expect_refused(&e, KP_E_INVALID_PARAMS, "seqs: 0 entries, expected 1..256");
    edit_end(&e);
}

/* Encodes r and expects the client's decoder to refuse it for req. */
static void expect_result_refused(const kp_prefill_result *r, const kp_prefill_params *req,
                                  const char *substr)
{
    wire x;
    kp_prefill_result got;
    kp_error err;
    ENC(kp_prefill_result_encode(&test_writer, 1, r, &enc_err_));
    open_result(&x, 1);
    expect_error(kp_prefill_result_decode(&x.msg, &test_session, req, &got, &err), &err,
                 KP_E_PROTOCOL, substr);
    assert_false(prefill_result_read_agrees(x.frame + 4, x.len - 4, req, false));
    wire_close(&x);
}

/* A result carries inline output exactly where the request asked for it, of
 * the size the request implies, and one entry per sequence. */
static void test_prefill_result_checked(void **state)
{
    kp_prefill_seq seqs[4];
    valid_prefill_seqs(seqs);
    kp_prefill_params req = {.layer = "L", .seqs = seqs, .nseqs = 4};
    void *out = filled(TOK_BYTES(12), 4);
    kp_prefill_seq_result rs[4] = {{12, kp_ref_inline(out, TOK_BYTES(12))}, {5, {0}},
                                   {12, kp_ref_inline(out, TOK_BYTES(12))}, {0, {0}}};
    kp_prefill_result r = {.seqs = rs, .nseqs = 4};

    rs[2].out = (kp_ref){0};
    expect_result_refused(&r, &req, "seqs[2].out: missing: the request asked for inline output");
    rs[2].out = kp_ref_inline(out, TOK_BYTES(12));

    rs[1].out = kp_ref_inline(out, TOK_BYTES(5));
    expect_result_refused(&r, &req, "seqs[1].out: unexpected");
    rs[1].out = (kp_ref){0};

    rs[0].out = kp_ref_inline(out, TOK_BYTES(11));
    expect_result_refused(&r, &req, "seqs[0].out: expected 294912 bytes");
    rs[0].out = kp_ref_inline(out, TOK_BYTES(12));

    r.nseqs = 3;
    expect_result_refused(&r, &req, "seqs: 3 results for 4 sequences");
    free(out);
}

/* A value of every integer form, and its boundaries. */
static uint64_t random_u64(uint64_t *rng)
{
    static const uint64_t edges[] = {0, 1, 127, 128, 255, 256, 65535, 65536, 4294967295ull,
                                     4294967296ull, UINT64_MAX};
    if (next_rng(rng) % 2)
        return edges[next_rng(rng) % (sizeof(edges) / sizeof(edges[0]))];
    uint64_t v = next_rng(rng); /* one call per statement: a deterministic sequence */
    return v << (next_rng(rng) % 32);
}

/* The one-pass result reader against the decoder: random results of random requests (some
 * with inline output, which it leaves to the decoder), and their mutants. */
static void test_prefill_result_read_agrees_random(void **state)
{
    (void)state;
    static uint8_t data[TOK_BYTES(4)];
    uint64_t rng = 29;
    int valid = 0, read = 0, mutated_valid = 0, mutated_read = 0, rounds = 1000;
    for (int round = 0; round < rounds; round++) {
        kp_prefill_seq seqs[16];
        kp_prefill_seq_result rs[16];
        const uint32_t n = 1 + (uint32_t)(next_rng(&rng) % 16);
        bool inline_out = false;
        memset(seqs, 0, sizeof(seqs));
        memset(rs, 0, sizeof(rs));
        for (uint32_t i = 0; i < n; i++) {
            seqs[i].len = next_rng(&rng) % 5 == 0 ? 0 : 1 + (uint32_t)(next_rng(&rng) % 4);
            if (seqs[i].len > 0 && next_rng(&rng) % 8 != 0)
                seqs[i].out = kp_ref_region(1, 0, TOK_BYTES(seqs[i].len));
            else if (seqs[i].len > 0)
                rs[i].out = kp_ref_inline(data, TOK_BYTES(seqs[i].len));
            inline_out |= rs[i].out.kind == KP_REF_INLINE;
            rs[i].pos = random_u64(&rng);
        }
        kp_prefill_params req = {.layer = "L", .seqs = seqs, .nseqs = n};
        kp_prefill_result r = {.seqs = rs, .nseqs = n};
        r.queue_us = random_u64(&rng);
        r.run_us = random_u64(&rng);
        r.timed = next_rng(&rng) % 2;
        r.device_us = r.timed ? random_u64(&rng) : 0;
        r.kernel_us = r.timed ? random_u64(&rng) : 0;
        ENC(kp_prefill_result_encode(&test_writer, (uint32_t)random_u64(&rng), &r, &enc_err_));
        uint8_t *frame;
        size_t len;
        kp_error err;
        assert_int_equal(kp_writer_flatten(&test_writer, &frame, &len, &err), KP_OK);
        valid += prefill_result_read_agrees(frame + 4, len - 4, &req, !inline_out);
        read += !inline_out;
        for (int m = 0; m < 24; m++) {
            size_t body = len - 4;
            uint8_t *mutant = mutant_of(frame + 4, &body, &rng);
            uint64_t pos[16];
            kp_prefill_result got;
            mutated_read += kp_prefill_result_read(mutant, body, UINT32_MAX, &req, pos, &got);
            mutated_valid += prefill_result_read_agrees(mutant, body, &req, false);
            free(mutant);
        }
        free(frame);
    }
    print_message("%d of %d results valid, %d read; mutated: %d valid, %d read\n", valid,
                  rounds, read, mutated_valid, mutated_read);
    assert_int_equal(valid, rounds);
    assert_true(read > rounds / 4 && read < rounds);
    assert_true(mutated_valid > rounds && mutated_read > rounds / 2);
}

/* Results the reader takes in any key order, and the ones it leaves to the decoder. */
static void test_prefill_result_read_forms(void **state)
{
    kp_prefill_seq seqs[2];
    memset(seqs, 0, sizeof(seqs));
    seqs[0].len = 3;
    seqs[0].out = kp_ref_region(1, 0, TOK_BYTES(3));
    kp_prefill_params req = {.layer = "L", .seqs = seqs, .nseqs = 2};
    /* [1, 7, nil, {...}] in the bytes a daemon might send */
    static const uint8_t head[] = {0x94, 0x01, 0x07, 0xc0};
    static const uint8_t seqs_kv[] = {0xa4, 's', 'e', 'q', 's', 0x92, 0x81, 0xa3, 'p', 'o', 's',
                                      0x03, 0x81, 0xa3, 'p', 'o', 's', 0xcc, 0xc8};
    static const uint8_t queue_kv[] = {0xa8, 'q', 'u', 'e', 'u', 'e', '_', 'u', 's', 0x05};
    static const uint8_t run_kv[] = {0xa6, 'r', 'u', 'n', '_', 'u', 's', 0xcd, 0x01, 0x2c};
    static const uint8_t device_kv[] = {0xa9, 'd', 'e', 'v', 'i', 'c', 'e', '_', 'u', 's', 0x64};
    static const uint8_t extra_kv[] = {0xa5, 'n', 'e', 'w', 'e', 'r', 0xc3};
    static const uint8_t device_nil[] = {0xa9, 'd', 'e', 'v', 'i', 'c', 'e', '_', 'u', 's', 0xc0};
    static const uint8_t error_map[] = {0x94, 0x01, 0x07, 0x80, 0xc0};
    static const uint8_t trailing[] = {0x00};
    const struct {
        const uint8_t *kv[4];
        size_t n[4];
        uint8_t map;
        bool read, valid;
    } cases[] = {
        /* the encoder's order, untimed and timed (device_us alone is valid) */
        {{seqs_kv, queue_kv, run_kv}, {sizeof(seqs_kv), sizeof(queue_kv), sizeof(run_kv)}, 0x83,
         true, true},
        {{device_kv, run_kv, seqs_kv, queue_kv},
         {sizeof(device_kv), sizeof(run_kv), sizeof(seqs_kv), sizeof(queue_kv)}, 0x84, true, true},
        /* a key this client does not know: valid, left to the decoder, which ignores it */
        {{seqs_kv, queue_kv, run_kv, extra_kv},
         {sizeof(seqs_kv), sizeof(queue_kv), sizeof(run_kv), sizeof(extra_kv)}, 0x84, false, true},
        /* run_us missing: refused by both */
        {{seqs_kv, queue_kv}, {sizeof(seqs_kv), sizeof(queue_kv)}, 0x82, false, false},
        /* a duplicate key: refused by the decoder */
        {{seqs_kv, queue_kv, run_kv, run_kv},
         {sizeof(seqs_kv), sizeof(queue_kv), sizeof(run_kv), sizeof(run_kv)}, 0x84, false, false},
        /* a byte after the result: refused by both */
        {{seqs_kv, queue_kv, run_kv, trailing},
         {sizeof(seqs_kv), sizeof(queue_kv), sizeof(run_kv), sizeof(trailing)}, 0x83, false,
         false},
        /* device_us nil: left to the decoder */
        {{seqs_kv, queue_kv, run_kv, device_nil},
         {sizeof(seqs_kv), sizeof(queue_kv), sizeof(run_kv), sizeof(device_nil)}, 0x84, false,
         true},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        uint8_t body[128];
        size_t len = 0;
        memcpy(body, head, sizeof(head));
        len = sizeof(head);
        body[len++] = cases[c].map;
        for (int k = 0; k < 4 && cases[c].kv[k]; k++) {
            memcpy(body + len, cases[c].kv[k], cases[c].n[k]);
            len += cases[c].n[k];
        }
        uint64_t pos[2];
        kp_prefill_result got;
        bool valid = prefill_result_read_agrees(body, len, &req, false);
        bool read = kp_prefill_result_read(body, len, UINT32_MAX, &req, pos, &got);
        if (valid != cases[c].valid || read != cases[c].read)
            fail_msg("case %zu: valid %d, read %d", c, valid, read);
        if (cases[c].read) {
            assert_int_equal(pos[0], 3);
            assert_int_equal(pos[1], 200);
            assert_int_equal(got.run_us, 300);
            assert_int_equal(got.timed, c == 1);
        }
    }
    /* an error response: its id can be peeked, the reader declines it */
    uint64_t pos[2];
    kp_prefill_result got;
    uint32_t id;
    assert_false(kp_prefill_result_read(error_map, sizeof(error_map), UINT32_MAX, &req, pos, &got));
    assert_true(kp_response_peek_id(error_map, sizeof(error_map), &id));
    assert_int_equal(id, 7);
    /* a request with inline output: a valid result, always the decoder's */
    seqs[1].len = 2;
    void *out = filled(TOK_BYTES(2), 9);
    kp_prefill_seq_result rs[2] = {{3, {0}}, {2, kp_ref_inline(out, TOK_BYTES(2))}};
    kp_prefill_result r = {.seqs = rs, .nseqs = 2, .queue_us = 5, .run_us = 300};
    ENC(kp_prefill_result_encode(&test_writer, 7, &r, &enc_err_));
    wire x;
    open_result(&x, 7);
    assert_true(prefill_result_read_agrees(x.frame + 4, x.len - 4, &req, false));
    assert_false(kp_prefill_result_read(x.frame + 4, x.len - 4, UINT32_MAX, &req, pos, &got));
    wire_close(&x);
    free(out);
}

static int region_sizes(void *ctx, uint32_t region, uint64_t *size)
{
    const uint64_t *sizes = ctx;
    if (region == 0 || region > 2)
        return KP_E_REGION_INVALID;
    *size = sizes[region - 1];
    return KP_OK;
}

static void test_prefill_check_regions(void **state)
{
    kp_prefill_seq seqs[4];
    valid_prefill_seqs(seqs);
    kp_prefill_params p = {.layer = "L", .seqs = seqs, .nseqs = 4};
    kp_error err;
    uint64_t exact[2] = {R1_BETA + BETA_BYTES(5), 4096 + TOK_BYTES(5)};
    assert_int_equal(kp_prefill_check_regions(&p, region_sizes, exact, &err), KP_OK);

    uint64_t short_out[2] = {exact[0], exact[1] - 1};
    expect_error(kp_prefill_check_regions(&p, region_sizes, short_out, &err), &err,
                 KP_E_REGION_BOUNDS, "seqs[1].out: bytes [4096, 4096 + 122880) reach outside "
                 "region 2 of 126975 bytes");

    seqs[1].beta.region = 9;
    expect_error(kp_prefill_check_regions(&p, region_sizes, exact, &err), &err,
                 KP_E_REGION_INVALID, "seqs[1].beta: region 9 is not registered");

    kp_ref r = kp_ref_region(1, UINT64_MAX - 15, 32);
    expect_error(kp_ref_check_bounds(&r, UINT64_MAX, "x", &err), &err, KP_E_REGION_BOUNDS,
                 "x: bytes");
    r = kp_ref_inline("ab", 2);
    assert_int_equal(kp_ref_check_bounds(&r, 0, "x", &err), KP_OK);
}

/* Field names in errors are built without printf; they must read as printf would. */
static void test_field_name(void **state)
{
    (void)state;
    char buf[64];
    assert_string_equal(kp_field_name(buf, sizeof(buf), "seqs", 0, "q"), "seqs[0].q");
    assert_string_equal(kp_field_name(buf, sizeof(buf), "slots", 4095, NULL), "slots[4095]");
    assert_string_equal(kp_field_name(buf, sizeof(buf), "seqs", UINT32_MAX, "beta"),
                        "seqs[4294967295].beta");
    /* truncated, always terminated */
    assert_string_equal(kp_field_name(buf, 8, "seqs", 123, "out"), "seqs[12");
    assert_string_equal(kp_field_name(buf, 1, "seqs", 1, "out"), "");
    char big[6];
    assert_int_equal(kp_strlcpy(big, "abcdefgh", sizeof(big)), 5);
    assert_string_equal(big, "abcde");
}

/* ready and done: round trip, the encoder's and the decoder's refusals, the
 * one-pass reader declining them to the decoder. */
static void test_prefill_semaphores(void **state)
{
    kp_prefill_seq seqs[4];
    valid_prefill_seqs(seqs);
    kp_prefill_params p = {.layer = "L", .seqs = seqs, .nseqs = 4,
                           .ready = {true, 1, 8, 5}, .done = {true, 2, 4096, KP_SEM_VALUE_MAX}};
    ENC(kp_prefill_params_encode(&test_writer, 12, &p, &enc_err_));
    wire x;
    open_request(&x, KP_METHOD_PREFILL, 12);
    kp_prefill_params got;
    DEC(kp_prefill_params_decode(&x.msg, &test_session, &got, &dec_err_));
    assert_true(got.ready.present && got.done.present);
    assert_int_equal(got.ready.region, 1);
    assert_int_equal(got.ready.offset, 8);
    assert_int_equal(got.ready.value, 5);
    assert_int_equal(got.done.region, 2);
    assert_int_equal(got.done.offset, 4096);
    assert_int_equal(got.done.value, KP_SEM_VALUE_MAX);
    assert_int_equal(got.nseqs, 4);
    assert_true(prefill_read_agrees(x.frame + 4, x.len - 4, &test_session, false));
    wire_close(&x);

    static const kp_sem bad[] = {{true, 0, 8, 1}, {true, 1, 12, 1}, {true, 1, 8, 0},
                                 {true, 1, 8, KP_SEM_FAILED}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kp_prefill_params q = {.layer = "L", .seqs = seqs, .nseqs = 4, .done = bad[i]};
        kp_error err;
        expect_error(kp_prefill_params_encode(&test_writer, 13, &q, &err), &err,
                     KP_E_INVALID_PARAMS, "done: needs a region >= 1");
    }

    edit e;
    struct {
        const char *key;
        int form; /* 0: a number, 1: {region, offset} without value, 2: offset 12, 3: region 0,
                     4: value 2^62, 5: an unknown field */
        const char *message;
    } cases[] = {
        {"ready", 0, "ready: expected a map"},
        {"done", 1, "done.value: required field is missing"},
        {"ready", 2, "ready.offset: 12 is not a multiple of 8"},
        {"done", 3, "done.region"},
        {"ready", 4, "ready.value"},
        {"done", 5, "done: unknown field \"when\""},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        encode_valid_prefill();
        edit_begin(&e);
        msgpack_object v;
        if (cases[i].form == 0) {
            v = v_u64(3);
        } else {
            v = v_region(&e, cases[i].form == 3 ? 0 : 1, cases[i].form == 2 ? 12 : 8);
            if (cases[i].form != 1)
                edit_set(&e, &v, "value", v_u64(cases[i].form == 4 ? KP_SEM_FAILED : 1));
            if (cases[i].form == 5)
                edit_set(&e, &v, "when", v_u64(1));
        }
        edit_set(&e, e.map, cases[i].key, v);
        expect_refused(&e, KP_E_INVALID_PARAMS, cases[i].message);
        edit_end(&e);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_prefill_wrong_shape_names_field, prefill_setup, prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_types_and_fields, prefill_setup, prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_region_refs, prefill_setup, prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_duplicate_slot, prefill_setup, prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_out_overlaps, prefill_setup, prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_overlaps_random, prefill_setup,
                                        prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_read_agrees_random, prefill_setup,
                                        prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_key_with_nul, prefill_setup, prefill_teardown),
        cmocka_unit_test(test_prefill_uint_forms),
        cmocka_unit_test_setup_teardown(test_prefill_read_ref_orders, prefill_setup,
                                        prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_read_envelopes, prefill_setup,
                                        prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_limits, prefill_setup, prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_result_checked, prefill_setup, prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_result_read_agrees_random, prefill_setup,
                                        prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_result_read_forms, prefill_setup,
                                        prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_check_regions, prefill_setup, prefill_teardown),
        cmocka_unit_test(test_field_name),
        cmocka_unit_test_setup_teardown(test_prefill_semaphores, prefill_setup, prefill_teardown),
    };
    return cmocka_run_group_tests(tests, harness_setup, harness_teardown);
}
