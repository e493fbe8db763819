/*
 * test_kdactl_io.c - kdactl's file handling (client/kdactl/prefill_io.c),
 * without a daemon: every golden case reads with the shapes, lengths,
 * weights and initial state the golden loader sees; malformed files are
 * refused with the offending tensor named; synthetic inputs are
 * reproducible from their seed; the output file reads back as written.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "golden.h"
#include "prefill_io.h"

static void assert_contains(const char *text, const char *part)
{
    if (!strstr(text, part))
        fail_msg("\"%s\" lacks \"%s\"", text, part);
}

/* Every golden case reads as the golden loader reads it. */
static void test_golden_inputs(void **state)
{
    char err[512];
    char **paths;
    int n = golden_list(golden_dir(), &paths, err, sizeof(err));
    if (n <= 0)
        fail_msg("%s", err);
    for (int i = 0; i < n; i++) {
        golden_case g;
        prefill_input in;
        if (golden_load(paths[i], &g, err, sizeof(err)))
            fail_msg("%s", err);
        if (prefill_input_read(&in, paths[i], err, sizeof(err)))
            fail_msg("%s", err);
        assert_int_equal(in.heads, g.heads);
        assert_int_equal(in.nseqs, g.nseqs);
        assert_int_equal(in.total_tokens, g.total_tokens);
        assert_memory_equal(in.cu_seqlens, g.cu_seqlens, sizeof(int64_t) * (g.nseqs + 1));
        size_t tok = (size_t)g.total_tokens * g.heads * 128;
        assert_memory_equal(in.q, g.q, tok * 2);
        assert_memory_equal(in.g, g.g, tok * 2);
        assert_memory_equal(in.beta, g.beta, (size_t)g.total_tokens * g.heads * 2);
        assert_memory_equal(in.weights.A_log, g.A_log, sizeof(float) * g.heads);
        assert_memory_equal(in.weights.dt_bias, g.dt_bias, sizeof(float) * g.heads * 128);
        assert_true(in.weights.lower_bound == (float)g.lower_bound);
        assert_true(in.weights.scale == (float)g.scale);
        assert_int_equal(in.initial_state != NULL, g.initial_state != NULL);
        if (g.initial_state)
            assert_int_equal(in.initial_dtype == KDAC_DTYPE_BF16, g.initial_is_bf16);
        uint32_t sum = 0;
        for (uint32_t k = 0; k < in.nseqs; k++)
            sum += prefill_input_len(&in, k);
        assert_int_equal(sum, in.total_tokens);
        char name[80], again[80];
        layer_weights_name(&in.weights, name, sizeof(name));
        layer_weights_name(&in.weights, again, sizeof(again));
        assert_string_equal(name, again);
        assert_int_equal(strncmp(name, "kdactl.", 7), 0);
        prefill_input_free(&in);
        golden_free(&g);
    }
    golden_list_free(paths, n);
}

/* Writes a file of the given tensors (name, dtype, shape) for refusal tests. */
static void write_file(const char *path, int ncut, const char *cu_dtype_i32)
{
    int64_t T = 6, H = 2;
    static uint16_t tok[6 * 2 * 128], beta[12];
    static float alog[2], dt[256];
    static int64_t cu[3] = {0, 4, 6};
    static int32_t cu32[3] = {0, 4, 6};
    st_writer *w = st_writer_new();
    const int64_t s3[] = {T, H, 128}, s2[] = {T, H}, sa[] = {H}, sd[] = {H, 128}, sc[] = {3};
    const char *names[4] = {"q", "k", "v", "g"};
    for (int i = 0; i < 4 - ncut; i++)
        st_writer_add(w, names[i], ST_BF16, 3, s3, tok);
    st_writer_add(w, "beta", ST_BF16, 2, s2, beta);
    st_writer_add(w, "A_log", ST_F32, 1, sa, alog);
    st_writer_add(w, "dt_bias", ST_F32, 2, sd, dt);
    if (cu_dtype_i32)
        st_writer_add(w, "cu_seqlens", ST_I32, 1, sc, cu32);
    else
        st_writer_add(w, "cu_seqlens", ST_I64, 1, sc, cu);
    st_writer_meta(w, "lower_bound", "-2.5");
    char err[256];
    assert_int_equal(st_writer_write(w, path, err, sizeof(err)), 0);
    st_writer_free(w);
}

static void test_refused_inputs(void **state)
{
    char dir[] = "/tmp/kdactl-io-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[128], err[512];
    snprintf(path, sizeof(path), "%s/in.safetensors", dir);
    prefill_input in;

    write_file(path, 0, NULL);
    assert_int_equal(prefill_input_read(&in, path, err, sizeof(err)), 0);
    assert_int_equal(in.nseqs, 2);
    assert_int_equal(prefill_input_len(&in, 0), 4);
    assert_true(in.weights.lower_bound == -2.5f);
    assert_true(in.weights.scale == KDAC_DEFAULT_SCALE);
    assert_null(in.initial_state);
    prefill_input_free(&in);

    write_file(path, 1, NULL); /* no g */
    assert_int_equal(prefill_input_read(&in, path, err, sizeof(err)), -1);
    assert_contains(err, "g");
    write_file(path, 0, "i32");
    assert_int_equal(prefill_input_read(&in, path, err, sizeof(err)), -1);
    assert_contains(err, "cu_seqlens");
    snprintf(path, sizeof(path), "%s/missing.safetensors", dir);
    assert_int_equal(prefill_input_read(&in, path, err, sizeof(err)), -1);
    assert_contains(err, "missing.safetensors");
    snprintf(path, sizeof(path), "%s/in.safetensors", dir);
    unlink(path);
    rmdir(dir);
}

static void test_random_inputs(void **state)
{
    prefill_input a, b, c;
    char err[256];
    assert_int_equal(prefill_input_random(&a, 1000, 3, 7, 42, err, sizeof(err)), 0);
    assert_int_equal(prefill_input_random(&b, 1000, 3, 7, 42, err, sizeof(err)), 0);
    assert_int_equal(prefill_input_random(&c, 1000, 3, 7, 43, err, sizeof(err)), 0);
    size_t tok = 1000 * 3 * 128;
    assert_memory_equal(a.q, b.q, tok * 2);
    assert_memory_equal(a.weights.dt_bias, b.weights.dt_bias, 3 * 128 * 4);
    assert_true(memcmp(a.q, c.q, tok * 2) != 0);
    assert_true(memcmp(a.q, a.k, tok * 2) != 0);
    assert_int_equal(a.cu_seqlens[7], 1000);
    for (uint32_t i = 0; i < 7; i++) {
        uint32_t len = prefill_input_len(&a, i);
        assert_true(len == 142 || len == 143);
    }
    /* N(0,1) in bf16: mean near 0, variance near 1. */
    double sum = 0, sq = 0;
    for (size_t i = 0; i < tok; i++) {
        uint32_t u = (uint32_t)a.v[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        sum += f;
        sq += (double)f * f;
    }
    assert_true(sum / tok < 0.01 && sum / tok > -0.01);
    assert_true(sq / tok > 0.98 && sq / tok < 1.02);
    for (int h = 0; h < 3; h++)
        assert_true(a.weights.A_log[h] >= 0 && a.weights.A_log[h] < 1);
    prefill_input_free(&c);
    assert_int_equal(prefill_input_random(&c, 5, 3, 6, 1, err, sizeof(err)), -1);
    prefill_input_free(&a);
    prefill_input_free(&b);
}

static void test_output_roundtrip(void **state)
{
    prefill_input in;
    char err[256];
    assert_int_equal(prefill_input_random(&in, 10, 2, 2, 1, err, sizeof(err)), 0);
    size_t nout = 10 * 2 * 128, nstate = 2 * 2 * 128 * 128;
    uint16_t *out = malloc(nout * 2);
    float *fs = malloc(nstate * 4);
    for (size_t i = 0; i < nout; i++)
        out[i] = (uint16_t)i;
    for (size_t i = 0; i < nstate; i++)
        fs[i] = (float)i * 0.5f;
    char dir[] = "/tmp/kdactl-io-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof(path), "%s/out.safetensors", dir);
    const char *meta[] = {"backend", "cpu", "run_us", "12"};
    assert_int_equal(prefill_output_write(path, &in, out, fs, meta, 2, err, sizeof(err)), 0);
    st_file *f;
    assert_int_equal(st_open(path, &f, err, sizeof(err)), 0);
    const st_tensor *o = st_expect(f, "out", ST_BF16, 3, (const int64_t[]){10, 2, 128}, err,
                                   sizeof(err));
    const st_tensor *s = st_expect(f, "final_state", ST_F32, 4,
                                   (const int64_t[]){2, 2, 128, 128}, err, sizeof(err));
    const st_tensor *cu = st_expect(f, "cu_seqlens", ST_I64, 1, (const int64_t[]){3}, err,
                                    sizeof(err));
    assert_non_null(o);
    assert_non_null(s);
    assert_non_null(cu);
    assert_memory_equal(o->data, out, nout * 2);
    assert_memory_equal(s->data, fs, nstate * 4);
    assert_memory_equal(cu->data, in.cu_seqlens, 3 * 8);
    assert_string_equal(st_meta(f, "backend"), "cpu");
    assert_string_equal(st_meta(f, "run_us"), "12");
    st_close(f);
    char bad[160];
    snprintf(bad, sizeof(bad), "%s/nodir/out.safetensors", dir);
    assert_int_equal(prefill_output_write(bad, &in, out, fs, NULL, 0, err, sizeof(err)), -1);
    assert_contains(err, "nodir");
    unlink(path);
    rmdir(dir);
    free(out);
    free(fs);
    prefill_input_free(&in);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_inputs),
        cmocka_unit_test(test_refused_inputs),
        cmocka_unit_test(test_random_inputs),
        cmocka_unit_test(test_output_roundtrip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
