/*
 * test_proto_prefill.c - prefill's validation (proto/prefill.c): every check
 * the codec makes on arrival (tensor sizes against len and H, types and
 * fields per sequence, region reference form, duplicate slots, outputs
 * overlapping other ranges, the token and inline limits), the checks on its
 * result, and the region bounds walk the daemon runs.  Each invalid request
 * is the valid four-sequence request of test_proto_harness.c with one change.
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
        cmocka_unit_test_setup_teardown(test_prefill_limits, prefill_setup, prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_result_checked, prefill_setup, prefill_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_check_regions, prefill_setup, prefill_teardown),
        cmocka_unit_test(test_field_name),
    };
    return cmocka_run_group_tests(tests, harness_setup, harness_teardown);
}
