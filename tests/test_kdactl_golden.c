/*
 * test_kdactl_golden.c - `kdactl prefill` end to end against a real kdad
 * (CPU backend, f32 pool): every golden case, through the daemon, meets the
 * accuracy contract (output and final-state relative RMS error at most
 * max(0.005, fla's error in the case's metadata)); synthetic inputs match
 * the float64 oracle on the same bytes and come out bit for bit the same
 * whether the tensors travel inline or through a shared-memory region;
 * inputs that do not fit the daemon are refused with exit code 5; and many
 * runs at once on the same files (each registering and dropping the same
 * content-named layer) never break each other and leave nothing behind.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "bf16.h"
#include "e2e_json.h"
#include "golden.h"
#include "kda_ref.h"
#include "kdad_proc.h"
#include "prefill_io.h"

static char tmpdir[] = "/tmp/kdactl-golden-XXXXXX";

static int setup(void **state)
{
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state)
{
    return rmdir(tmpdir);
}

static double bound(double fla_err)
{
    return fla_err > 0.005 ? fla_err : 0.005;
}

/* The output file of a run, with its two tensors checked for shape. */
typedef struct result_file {
    st_file *f;
    const uint16_t *out;
    const float *state;
} result_file;

static void open_result(result_file *r, const char *path, int64_t T, int64_t H, int64_t N)
{
    char err[512];
    assert_int_equal(st_open(path, &r->f, err, sizeof(err)), 0);
    const st_tensor *o = st_expect(r->f, "out", ST_BF16, 3, (const int64_t[]){T, H, 128}, err,
                                   sizeof(err));
    const st_tensor *s = st_expect(r->f, "final_state", ST_F32, 4,
                                   (const int64_t[]){N, H, 128, 128}, err, sizeof(err));
    if (!o || !s)
        fail_msg("%s: %s", path, err);
    r->out = o->data;
    r->state = s->data;
}

/* Every golden case through kdactl and kdad; a daemon per head count. */
static void test_golden_cases(void **state)
{
    char err[512], out_path[128];
    char **paths;
    int n = golden_list(golden_dir(), &paths, err, sizeof(err));
    if (n <= 0)
        fail_msg("%s", err);
    snprintf(out_path, sizeof(out_path), "%s/out.safetensors", tmpdir);
    kdad_proc d;
    int heads = 0;
    for (int i = 0; i < n; i++) {
        golden_case c;
        if (golden_load(paths[i], &c, err, sizeof(err)))
            fail_msg("%s", err);
        if (c.heads != heads) {
            if (heads)
                assert_int_equal(kdad_stop(&d), 0);
            assert_true(kdad_start(&d, c.heads, NULL));
            heads = c.heads;
        }
        cmd_result r = kdactl(d.sock, "--json", "prefill", "--input", paths[i], "--output",
                              out_path, NULL);
        expect_exit(&r, 0);
        json_object *o = json_out(&r);
        assert_int_equal(jint(o, "tokens"), c.total_tokens);
        assert_int_equal(jint(o, "seqs"), c.nseqs);
        assert_string_equal(jstr(o, "backend"), "cpu");
        assert_string_equal(jstr(o, "transport"), "inline");
        assert_true(json_object_get_boolean(jget(o, "layer_created")));
        json_object *pos = jget(o, "positions");
        for (int64_t k = 0; k < c.nseqs; k++)
            assert_int_equal(json_object_get_int64(json_object_array_get_idx(pos, k)),
                             c.cu_seqlens[k + 1] - c.cu_seqlens[k]);
        json_object_put(o);
        cmd_free(&r);

        result_file res;
        open_result(&res, out_path, c.total_tokens, c.heads, c.nseqs);
        size_t nout = (size_t)c.total_tokens * c.heads * 128;
        size_t nstate = (size_t)c.nseqs * c.heads * 128 * 128;
        double out_err = rel_rms_bf16(res.out, c.expected_out, nout);
        double state_err = rel_rms_f32(res.state, c.expected_state, nstate);
        printf("  %-24s out %.5f (bound %.5f)  state %.5f (bound %.5f)\n", c.name, out_err,
               bound(c.fla_out_err), state_err, bound(c.fla_state_err));
        assert_true(out_err <= bound(c.fla_out_err));
        assert_true(state_err <= bound(c.fla_state_err));
        st_close(res.f);
        golden_free(&c);
    }
    assert_int_equal(kdad_stop(&d), 0);
    unlink(out_path);
    golden_list_free(paths, n);
}

/* Synthetic inputs: what kdactl sent is what prefill_input_random makes
 * from the seed; the daemon's answer matches the oracle on those bytes, and
 * is identical over inline and shm. */
static void test_random_inline_and_shm(void **state)
{
    const uint32_t T = 300, NSEQ = 3;
    const int32_t HEADS = 4;
    kdad_proc d;
    assert_true(kdad_start(&d, HEADS, NULL));
    char a[128], b[128];
    snprintf(a, sizeof(a), "%s/inline.safetensors", tmpdir);
    snprintf(b, sizeof(b), "%s/shm.safetensors", tmpdir);
    cmd_result r = kdactl(d.sock, "prefill", "--random", "--tokens", "300", "--heads", "4",
                          "--seqs", "3", "--seed", "7", "--output", a, NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "prefill: 300 tokens x 4 heads in 3 sequences");
    expect_text(r.out, "(backend cpu)");
    expect_text(r.out, "transport  inline");
    cmd_free(&r);
    r = kdactl(d.sock, "--json", "prefill", "--random", "--tokens", "300", "--heads", "4",
               "--seqs", "3", "--seed", "7", "--transport", "shm", "--output", b, NULL);
    expect_exit(&r, 0);
    json_object *o = json_out(&r);
    assert_string_equal(jstr(o, "transport"), "shm");
    json_object_put(o);
    cmd_free(&r);

    result_file ra, rb;
    open_result(&ra, a, T, HEADS, NSEQ);
    open_result(&rb, b, T, HEADS, NSEQ);
    size_t nout = (size_t)T * HEADS * 128, nstate = (size_t)NSEQ * HEADS * 128 * 128;
    assert_memory_equal(ra.out, rb.out, nout * 2);
    assert_memory_equal(ra.state, rb.state, nstate * 4);

    prefill_input in;
    char err[256];
    assert_int_equal(prefill_input_random(&in, T, HEADS, NSEQ, 7, err, sizeof(err)), 0);
    kda_layer layer = {in.weights.A_log, in.weights.dt_bias, in.weights.lower_bound,
                       in.weights.scale};
    double *out = calloc(nout, sizeof(double)), *st = calloc(nstate, sizeof(double));
    double *got_out = malloc(nout * sizeof(double)), *got_st = malloc(nstate * sizeof(double));
    size_t row = (size_t)HEADS * 128;
    for (uint32_t s = 0; s < NSEQ; s++) {
        size_t t0 = (size_t)in.cu_seqlens[s];
        kda_ref_sequence(HEADS, &layer, in.q + t0 * row, in.k + t0 * row, in.v + t0 * row,
                         in.g + t0 * row, in.beta + t0 * HEADS, prefill_input_len(&in, s),
                         st + s * row * 128, out + t0 * row);
    }
    for (size_t i = 0; i < nout; i++)
        got_out[i] = kda_bf16_to_f32(ra.out[i]);
    for (size_t i = 0; i < nstate; i++)
        got_st[i] = ra.state[i];
    double out_err = rel_rms_f64_f64(got_out, out, nout);
    double state_err = rel_rms_f64_f64(got_st, st, nstate);
    printf("  random T=300 H=4 N=3: out %.5f state %.5f\n", out_err, state_err);
    assert_true(out_err <= 0.005);
    assert_true(state_err <= 0.005);
    free(out), free(st), free(got_out), free(got_st);
    prefill_input_free(&in);
    st_close(ra.f);
    st_close(rb.f);
    unlink(a);
    unlink(b);

    /* What does not fit this daemon is refused before anything runs. */
    r = kdactl(d.sock, "prefill", "--random", "--tokens", "16", "--heads", "8", NULL);
    expect_exit(&r, 5);
    expect_text(r.err, "the input has 8 heads; the daemon at");
    cmd_free(&r);
    char *golden_h1 = NULL;
    char **paths;
    int n = golden_list(golden_dir(), &paths, err, sizeof(err));
    for (int i = 0; i < n; i++) {
        if (strstr(paths[i], "long_h1"))
            golden_h1 = paths[i];
    }
    assert_non_null(golden_h1);
    r = kdactl(d.sock, "prefill", "--input", golden_h1, NULL);
    expect_exit(&r, 5);
    cmd_free(&r);
    golden_list_free(paths, n);
    r = kdactl(d.sock, "prefill", "--input", "/nonexistent.safetensors", NULL);
    expect_exit(&r, 5);
    expect_text(r.err, "/nonexistent.safetensors");
    cmd_free(&r);
    /* Nothing is left behind: no slot, no layer. */
    r = kdactl(d.sock, "--json", "stats", NULL);
    o = json_out(&r);
    assert_int_equal(jint(o, "pool.used"), 0);
    assert_int_equal(jint(o, "layers"), 0);
    json_object_put(o);
    cmd_free(&r);
    assert_int_equal(kdad_stop(&d), 0);
}

/*
 * Concurrent runs: RUNNERS processes loop `kdactl prefill` over three golden
 * files at once against one daemon.  Runs of one file register the same
 * content-named layer and drop it at their end, while others still use it:
 * every run must succeed (the daemon counts registrations), every output
 * meets the contract, and no layer or slot remains afterwards.
 */
#define RUNNERS 24 /* one slot each: within the pool of 64 */
#define RUNS 5
static void test_concurrent_prefills(void **state)
{
    static const char *const names[] = {"fixed_h4_t256", "beta_extreme_h4_t200",
                                        "lb3_scale_h4_t300"};
    enum { NFILES = sizeof(names) / sizeof(names[0]) };
    char inputs[NFILES][512], out_path[RUNNERS][160], err[512];
    for (int f = 0; f < NFILES; f++)
        snprintf(inputs[f], sizeof(inputs[f]), "%s/%s.safetensors", golden_dir(), names[f]);
    kdad_proc d;
    assert_true(kdad_start(&d, 4, NULL));
    pid_t pids[RUNNERS];
    fflush(NULL);
    for (int i = 0; i < RUNNERS; i++) {
        snprintf(out_path[i], sizeof(out_path[i]), "%s/concurrent-%d.safetensors", tmpdir, i);
        pids[i] = fork();
        assert_true(pids[i] >= 0);
        if (pids[i] > 0)
            continue;
        /* a runner: no cmocka here; the exit code and stderr tell */
        for (int k = 0; k < RUNS; k++) {
            cmd_result r = kdactl(d.sock, "prefill", "--input", inputs[(i + k) % NFILES],
                                  "--output", out_path[i], NULL);
            if (r.status != 0) {
                fprintf(stderr, "runner %d, run %d: exit %d: %s", i, k, r.status, r.err);
                _exit(1);
            }
            cmd_free(&r);
        }
        _exit(0);
    }
    int failed = 0;
    for (int i = 0; i < RUNNERS; i++) {
        int status;
        failed += waitpid(pids[i], &status, 0) != pids[i] || !WIFEXITED(status) ||
                  WEXITSTATUS(status) != 0;
    }
    if (failed) {
        kdad_stop(&d);
        fail_msg("%d of %d runners failed", failed, RUNNERS);
    }
    /* each runner's last output: the file of its last run, within the contract */
    for (int i = 0; i < RUNNERS; i++) {
        golden_case c;
        if (golden_load(inputs[(i + RUNS - 1) % NFILES], &c, err, sizeof(err)))
            fail_msg("%s", err);
        result_file res;
        open_result(&res, out_path[i], c.total_tokens, c.heads, c.nseqs);
        assert_true(rel_rms_bf16(res.out, c.expected_out,
                                 (size_t)c.total_tokens * c.heads * 128) <= bound(c.fla_out_err));
        assert_true(rel_rms_f32(res.state, c.expected_state,
                                (size_t)c.nseqs * c.heads * 128 * 128) <= bound(c.fla_state_err));
        st_close(res.f);
        golden_free(&c);
        unlink(out_path[i]);
    }
    cmd_result r = kdactl(d.sock, "--json", "stats", NULL);
    expect_exit(&r, 0);
    json_object *o = json_out(&r);
    assert_int_equal(jint(o, "pool.used"), 0);
    assert_int_equal(jint(o, "layers"), 0);
    json_object_put(o);
    cmd_free(&r);
    assert_int_equal(kdad_stop(&d), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_cases),
        cmocka_unit_test(test_random_inline_and_shm),
        cmocka_unit_test(test_concurrent_prefills),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
