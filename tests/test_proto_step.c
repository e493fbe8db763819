/*
 * test_proto_step.c - the step method's codec (proto/step.c): a valid
 * request and result survive encode and decode unchanged; every check on
 * arrival refuses the valid request changed in exactly one place, naming the
 * field; the region bounds walk; and the request's size grows by the bytes of
 * its lists alone (no per-sequence msgpack objects).
 */
#include <stdlib.h>
#include <string.h>

#include "test_proto_harness.h"

#define T 6   /* tokens of the valid step: lens 1, 1, 4 */

static uint64_t slots3[3];   /* SLOT(0..2), set up */
static const uint8_t lens3[3] = {1, 1, 4};
static const uint64_t pos3[3] = {10, 20, 30};
static void *q_bytes, *k_bytes, *v_bytes, *g_bytes, *beta_bytes;

static int step_setup(void **state)
{
    for (uint32_t i = 0; i < 3; i++)
        slots3[i] = SLOT(i);
    q_bytes = filled(TOK_BYTES(T), 1);
    k_bytes = filled(TOK_BYTES(T), 2);
    v_bytes = filled(TOK_BYTES(T), 3);
    g_bytes = filled(TOK_BYTES(T), 4);
    beta_bytes = filled(BETA_BYTES(T), 5);
    return 0;
}

static int step_teardown(void **state)
{
    free(q_bytes), free(k_bytes), free(v_bytes), free(g_bytes), free(beta_bytes);
    return 0;
}

/* Three sequences (1, 1 and 4 tokens) with expect_pos, inputs inline, outputs inline. */
static kp_step_params valid_step(void)
{
    kp_step_params p = {.layer = "model.layers.3.kda", .nseqs = 3, .slots = slots3, .lens = lens3,
                        .expect_pos = pos3};
    p.q = kp_ref_inline(q_bytes, TOK_BYTES(T));
    p.k = kp_ref_inline(k_bytes, TOK_BYTES(T));
    p.v = kp_ref_inline(v_bytes, TOK_BYTES(T));
    p.g = kp_ref_inline(g_bytes, TOK_BYTES(T));
    p.beta = kp_ref_inline(beta_bytes, BETA_BYTES(T));
    return p;
}

static void encode_valid_step(void)
{
    kp_step_params p = valid_step();
    ENC(kp_step_params_encode(&test_writer, 21, &p, &enc_err_));
}

/* The same step by regions: inputs in region 1, out in region 2, states in region 3. */
static kp_step_params region_step(void)
{
    kp_step_params p = valid_step();
    p.expect_pos = NULL;
    for (int t = KP_STEP_Q; t <= KP_STEP_BETA; t++)
        p.tensors[t] = kp_ref_region(1, (uint64_t)t * TOK_BYTES(T), t == KP_STEP_BETA ? BETA_BYTES(T) : TOK_BYTES(T));
    p.out = kp_ref_region(2, 0, TOK_BYTES(T));
    p.states = kp_ref_region(3, 4096, (uint64_t)T * STATE_F32_BYTES);
    return p;
}

static void test_step_roundtrip(void **state)
{
    for (int regions = 0; regions < 2; regions++) {
        kp_step_params p = regions ? region_step() : valid_step(), d;
        ENC(kp_step_params_encode(&test_writer, 21, &p, &enc_err_));
        wire x;
        open_request(&x, KP_METHOD_STEP, 21);
        DEC(kp_step_params_decode(&x.msg, &test_session, &d, &dec_err_));
        assert_string_equal(d.layer, p.layer);
        assert_int_equal(d.nseqs, 3);
        assert_int_equal(d.tokens, T);
        for (uint32_t i = 0; i < 3; i++) {
            assert_int_equal(kp_step_u64(d.slots, i), slots3[i]);
            assert_int_equal(d.lens[i], lens3[i]);
        }
        if (regions) {
            assert_null(d.expect_pos);
        } else {
            assert_non_null(d.expect_pos);
            for (uint32_t i = 0; i < 3; i++)
                assert_int_equal(kp_step_u64(d.expect_pos, i), pos3[i]);
        }
        for (int t = 0; t < KP_STEP_TENSORS; t++) {
            assert_int_equal(d.tensors[t].kind, p.tensors[t].kind);
            assert_int_equal(d.tensors[t].region, p.tensors[t].region);
            assert_int_equal(d.tensors[t].offset, p.tensors[t].offset);
            if (p.tensors[t].kind != KP_REF_ABSENT)
                assert_int_equal(d.tensors[t].nbytes, p.tensors[t].nbytes);
            if (p.tensors[t].kind == KP_REF_INLINE)
                assert_memory_equal(d.tensors[t].data, p.tensors[t].data, p.tensors[t].nbytes);
        }
        wire_close(&x);
    }
}

static void test_step_result_roundtrip(void **state)
{
    const kp_step_params req = valid_step();   /* tokens: set as the decoder sets it */
    kp_step_params r6 = req;
    r6.tokens = T;
    const uint64_t pos[3] = {11, 21, 34};
    void *out = filled(TOK_BYTES(T), 9);
    kp_step_result r = {.nseqs = 3, .pos = pos, .out = kp_ref_inline(out, TOK_BYTES(T)), .queue_us = 3,
                        .run_us = 41, .timed = true, .device_us = 30, .kernel_us = 25}, d;
    ENC(kp_step_result_encode(&test_writer, 21, &r, &enc_err_));
    wire x;
    open_result(&x, 21);
    DEC(kp_step_result_decode(&x.msg, &test_session, &r6, &d, &dec_err_));
    assert_int_equal(d.nseqs, 3);
    for (uint32_t i = 0; i < 3; i++)
        assert_int_equal(kp_step_u64(d.pos, i), pos[i]);
    assert_int_equal(d.out.kind, KP_REF_INLINE);
    assert_memory_equal(d.out.data, out, TOK_BYTES(T));
    assert_true(d.timed);
    assert_int_equal(d.queue_us, 3);
    assert_int_equal(d.run_us, 41);
    assert_int_equal(d.device_us, 30);
    assert_int_equal(d.kernel_us, 25);

    /* the request named an out region: an inline out is unexpected */
    kp_step_params with_out = region_step();
    with_out.tokens = T;
    kp_error err;
    expect_error(kp_step_result_decode(&x.msg, &test_session, &with_out, &d, &err), &err, KP_E_PROTOCOL,
                 "out: unexpected");
    wire_close(&x);

    /* and without out, an inline request misses it; positions of the wrong count */
    r.out = (kp_ref){0};
    ENC(kp_step_result_encode(&test_writer, 21, &r, &enc_err_));
    open_result(&x, 21);
    expect_error(kp_step_result_decode(&x.msg, &test_session, &r6, &d, &err), &err, KP_E_PROTOCOL,
                 "out: missing");
    DEC(kp_step_result_decode(&x.msg, &test_session, &with_out, &d, &dec_err_));
    kp_step_params two = r6;
    two.nseqs = 2;
    expect_error(kp_step_result_decode(&x.msg, &test_session, &two, &d, &err), &err, KP_E_PROTOCOL,
                 "pos: expected 16 bytes (2 sequences x 8 bytes u64), got 24");
    wire_close(&x);
    free(out);
}

static void test_step_refusals(void **state)
{
    static uint8_t bytes12[12], lens_bad[3] = {1, 17, 4}, lens_zero[3] = {1, 0, 4}, lens2[2] = {1, 1};
    static uint64_t dup[3], pos2[2];
    static uint8_t small[100];
    dup[0] = dup[2] = SLOT(0);
    dup[1] = SLOT(1);
    edit e;
    struct {
        const char *key;
        int op; /* 0 set, 1 delete */
        msgpack_object v;
        int code;
        const char *message;
    } cases[] = {
        {"slots", 0, v_bin(bytes12, 12), KP_E_INVALID_PARAMS, "slots: 12 bytes, expected 1..256 entries of 8 bytes"},
        {"slots", 0, v_u64(7), KP_E_INVALID_PARAMS, "slots: expected a bin, got unsigned integer"},
        {"slots", 1, {0}, KP_E_INVALID_PARAMS, "slots: required field is missing"},
        {"slots", 0, v_bin(dup, 24), KP_E_INVALID_PARAMS,
         "slots[2]: slot 0x700000000 is also named by slots[0]; a slot appears once per request"},
        {"lens", 0, v_bin(lens2, 2), KP_E_INVALID_PARAMS, "lens: 2 entries for 3 slots"},
        {"lens", 0, v_bin(lens_bad, 3), KP_E_INVALID_PARAMS, "lens[1]: 17 is outside [1, 16]"},
        {"lens", 0, v_bin(lens_zero, 3), KP_E_INVALID_PARAMS, "lens[1]: 0 is outside [1, 16]"},
        {"expect_pos", 0, v_bin(pos2, 16), KP_E_INVALID_PARAMS,
         "expect_pos: expected 24 bytes (3 slots x 8 bytes u64), got 16"},
        {"q", 0, v_bin(small, 100), KP_E_INVALID_PARAMS,
         "q: expected 147456 bytes (6 tokens x 96 heads x 128 x 2 bytes bf16), got 100"},
        {"beta", 0, v_bin(small, 100), KP_E_INVALID_PARAMS,
         "beta: expected 1152 bytes (6 tokens x 96 heads x 2 bytes bf16), got 100"},
        {"g", 1, {0}, KP_E_INVALID_PARAMS, "g: required field is missing"},
        {"out", 0, v_bin(small, 100), KP_E_INVALID_PARAMS, "out: must be a region reference"},
        {"states", 0, v_bin(small, 100), KP_E_INVALID_PARAMS, "states: must be a region reference"},
        {"fresh", 0, v_bool(true), KP_E_INVALID_PARAMS, "params: unknown field \"fresh\""},
        {"layer", 0, v_str(""), KP_E_INVALID_PARAMS, "layer: 0 bytes, at least 1 needed"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        encode_valid_step();
        edit_begin(&e);
        if (cases[i].op == 0)
            edit_set(&e, e.map, cases[i].key, cases[i].v);
        else
            edit_del(e.map, cases[i].key);
        expect_refused(&e, cases[i].code, cases[i].message);
        edit_end(&e);
    }

    /* region forms: states of the wrong size, outputs overlapping another range */
    struct {
        const char *key;
        uint64_t region, offset;
        const char *message;
    } regs[] = {
        {"out", 1, TOK_BYTES(T), "out overlaps k in region 1"},
        {"states", 2, 64, "out overlaps states in region 2"},
        {"states", 1, 4 * TOK_BYTES(T), "states overlaps beta in region 1"},
        {"out", 2, 8, "out.offset: 8 is not a multiple of 16"},
    };
    for (size_t i = 0; i < sizeof(regs) / sizeof(regs[0]); i++) {
        kp_step_params p = region_step();
        ENC(kp_step_params_encode(&test_writer, 21, &p, &enc_err_));
        edit_begin(&e);
        edit_set(&e, e.map, regs[i].key, v_region(&e, regs[i].region, regs[i].offset));
        expect_refused(&e, KP_E_INVALID_PARAMS, regs[i].message);
        edit_end(&e);
    }
    kp_step_params p = region_step();
    ENC(kp_step_params_encode(&test_writer, 21, &p, &enc_err_));
    edit_begin(&e);
    expect_accepted(&e);
    edit_end(&e);
}

static void test_step_limits(void **state)
{
    edit e;
    kp_session s = test_session;
    s.limits.max_batch_tokens = 5;
    encode_valid_step();
    edit_begin(&e);
    expect_refused_with(&e, &s, KP_E_LIMIT_EXCEEDED, "lens: 6 tokens in total exceed max_batch_tokens 5");
    edit_end(&e);

    s = test_session;
    s.limits.max_inline_bytes = 4 * TOK_BYTES(T);   /* the four token tensors fit, beta does not */
    encode_valid_step();
    edit_begin(&e);
    expect_refused_with(&e, &s, KP_E_LIMIT_EXCEEDED, "inline tensor bytes exceed max_inline_bytes");
    edit_end(&e);

    s = test_session;
    s.limits.max_inline_bytes = TOK_BYTES(T) - 1;   /* inputs by region, the inline output too large */
    kp_step_params p = region_step();
    p.out = (kp_ref){0};
    ENC(kp_step_params_encode(&test_writer, 21, &p, &enc_err_));
    edit_begin(&e);
    expect_refused_with(&e, &s, KP_E_LIMIT_EXCEEDED, "the inline output of 147456 bytes would exceed");
    edit_end(&e);

    s = test_session;
    s.limits.max_seqs_per_request = 2;
    encode_valid_step();
    edit_begin(&e);
    expect_refused_with(&e, &s, KP_E_INVALID_PARAMS, "slots: 24 bytes, expected 1..2 entries of 8 bytes");
    edit_end(&e);

    s = test_session;   /* a bf16 pool: the states' implied size halves */
    s.geometry.state_dtype = KP_DTYPE_BF16;
    p = region_step();
    ENC(kp_step_params_encode(&test_writer, 21, &p, &enc_err_));
    wire x;
    open_request(&x, KP_METHOD_STEP, 21);
    kp_step_params d;
    DEC(kp_step_params_decode(&x.msg, &s, &d, &dec_err_));
    assert_int_equal(d.states.nbytes, (uint64_t)T * STATE_BF16_BYTES);
    wire_close(&x);
}

static void test_step_encode_refusals(void **state)
{
    kp_error err;
    kp_step_params p = valid_step();
    const uint8_t bad[3] = {1, 0, 4};
    p.lens = bad;
    expect_error(kp_step_params_encode(&test_writer, 1, &p, &err), &err, KP_E_INVALID_PARAMS,
                 "lens[1]: 0 is outside [1, 16]");
    p = valid_step();
    p.v = (kp_ref){0};
    expect_error(kp_step_params_encode(&test_writer, 1, &p, &err), &err, KP_E_INVALID_PARAMS, "v: required");
    p = valid_step();
    p.out = kp_ref_inline(q_bytes, TOK_BYTES(T));
    expect_error(kp_step_params_encode(&test_writer, 1, &p, &err), &err, KP_E_INVALID_PARAMS,
                 "out: must be a region reference");
    p = valid_step();
    p.nseqs = 0;
    expect_error(kp_step_params_encode(&test_writer, 1, &p, &err), &err, KP_E_INVALID_PARAMS,
                 "at least one sequence");
    kp_step_result r = {.nseqs = 1, .pos = pos3, .out = kp_ref_region(2, 0, 16)};
    expect_error(kp_step_result_encode(&test_writer, 1, &r, &err), &err, KP_E_INVALID_PARAMS,
                 "out: a result carries output inline");
}

static int region_size(void *ctx, uint32_t region, uint64_t *size)
{
    const uint64_t *sizes = ctx;   /* regions 1..3 */
    if (region < 1 || region > 3)
        return KP_E_REGION_INVALID;
    *size = sizes[region - 1];
    return KP_OK;
}

static void test_step_regions(void **state)
{
    kp_step_params p = region_step();
    uint64_t sizes[3] = {5 * TOK_BYTES(T), TOK_BYTES(T), 4096 + (uint64_t)T * STATE_F32_BYTES};
    kp_error err;
    assert_int_equal(kp_step_check_regions(&p, region_size, sizes, &err), KP_OK);
    sizes[2] -= 1;
    expect_error(kp_step_check_regions(&p, region_size, sizes, &err), &err, KP_E_REGION_BOUNDS, "states");
    sizes[2] += 1;
    p.out.region = 4;
    expect_error(kp_step_check_regions(&p, region_size, sizes, &err), &err, KP_E_REGION_INVALID,
                 "out: region 4 is not registered");
}

/* With every tensor a region reference, 256 sequences cost 9 bytes each over 1 (8 of handle,
 * 1 of length) and two longer bin headers: no msgpack object per sequence. */
static void test_step_size_is_the_lists(void **state)
{
    static uint64_t slots[256];
    static uint8_t lens[256];
    size_t frame[2];
    for (int i = 0; i < 256; i++) {
        slots[i] = SLOT(i);
        lens[i] = 1;
    }
    for (int big = 0; big < 2; big++) {
        const uint32_t n = big ? 256 : 1;
        kp_step_params p = {.layer = "L", .nseqs = n, .slots = slots, .lens = lens};
        for (int t = KP_STEP_Q; t <= KP_STEP_BETA; t++)
            p.tensors[t] = kp_ref_region(1, 0, t == KP_STEP_BETA ? BETA_BYTES(n) : TOK_BYTES(n));
        ENC(kp_step_params_encode(&test_writer, 1, &p, &enc_err_));
        wire x;
        open_request(&x, KP_METHOD_STEP, 1);
        kp_step_params d;
        DEC(kp_step_params_decode(&x.msg, &test_session, &d, &dec_err_));
        assert_int_equal(d.nseqs, n);
        frame[big] = x.len;
        wire_close(&x);
    }
    /* the region maps' offsets are 0 in both; the sizes are implied, not sent */
    assert_int_equal(frame[1] - frame[0], 255 * 9 + 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_step_roundtrip, step_setup, step_teardown),
        cmocka_unit_test_setup_teardown(test_step_result_roundtrip, step_setup, step_teardown),
        cmocka_unit_test_setup_teardown(test_step_refusals, step_setup, step_teardown),
        cmocka_unit_test_setup_teardown(test_step_limits, step_setup, step_teardown),
        cmocka_unit_test_setup_teardown(test_step_encode_refusals, step_setup, step_teardown),
        cmocka_unit_test_setup_teardown(test_step_regions, step_setup, step_teardown),
        cmocka_unit_test(test_step_size_is_the_lists),
    };
    return cmocka_run_group_tests(tests, harness_setup, harness_teardown);
}
