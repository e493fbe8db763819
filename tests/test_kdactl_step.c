/*
 * test_kdactl_step.c - kdactl step and kdactl bench --decode against a real
 * kdad (CPU backend, H = 4): positions advancing over repeated steps, the
 * times reported, bench --decode over inline and shared memory (cuda-ipc
 * refused on the CPU backend), and the usage and input errors.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "e2e_json.h"
#include "golden.h"
#include "kdad_proc.h"

static kdad_proc daemon_;
static const char *S;

static int start_daemon(void **state)
{
    (void)state;
    if (!kdad_start(&daemon_, 4, NULL))
        return -1;
    S = daemon_.sock;
    return 0;
}

static int stop_daemon(void **state)
{
    (void)state;
    return kdad_stop(&daemon_) == 0 ? 0 : -1;
}

static void test_step_random(void **state)
{
    (void)state;
    json_object *o = kdactl_json(S, "step", "--random", "--seqs", "3", "--tokens", "2",
                                 "--repeat", "2", NULL);
    assert_int_equal(jint(o, "seqs"), 3);
    assert_int_equal(jint(o, "tokens"), 6);
    json_object *steps = jget(o, "steps");
    assert_int_equal(json_object_array_length(steps), 2);
    for (int k = 0; k < 2; k++) {
        json_object *st = json_object_array_get_idx(steps, k);
        json_object *pos = jget(st, "pos");
        assert_int_equal(json_object_array_length(pos), 3);
        for (int i = 0; i < 3; i++)
            assert_int_equal(json_object_get_int64(json_object_array_get_idx(pos, i)), 2 * (k + 1));
        assert_true(jint(st, "kernel_us") <= jint(st, "device_us"));
        assert_true(jdouble(st, "round_trip_us") > 0);
    }
    json_object_put(o);

    cmd_result r = kdactl(S, "step", "--random", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "pos 1");
    expect_text(r.out, "kernel");
    cmd_free(&r);
}

static void test_step_errors(void **state)
{
    (void)state;
    cmd_result r = kdactl(S, "step", NULL);
    expect_exit(&r, 2);
    expect_text(r.err, "--input FILE or --random");
    cmd_free(&r);
    r = kdactl(S, "step", "--random", "--tokens", "17", NULL);
    expect_exit(&r, 2);
    expect_text(r.err, "--tokens");
    cmd_free(&r);
    char path[512];
    snprintf(path, sizeof(path), "%s/fixed_h4_t256.safetensors", golden_dir());
    r = kdactl(S, "step", "--input", path, NULL);
    expect_exit(&r, 5);
    expect_text(r.err, "256 tokens");
    cmd_free(&r);
    r = kdactl(S, "step", "--help", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "Usage: kdactl step");
    cmd_free(&r);
}

static void test_bench_decode(void **state)
{
    (void)state;
    const char *transports[] = {"inline", "shm"};
    for (int t = 0; t < 2; t++) {
        json_object *o = kdactl_json(S, "bench", "--decode", "--seqs", "16", "--tokens", "2",
                                     "--steps", "20", "--warmup", "2", "--transport", transports[t],
                                     NULL);
        assert_int_equal(jint(o, "seqs"), 16);
        assert_int_equal(jint(o, "tokens"), 2);
        assert_int_equal(jint(o, "steps"), 20);
        assert_string_equal(jstr(o, "transport"), transports[t]);
        assert_true(jdouble(o, "step_p50_us") > 0);
        assert_true(jdouble(o, "step_p99_us") >= jdouble(o, "step_p50_us"));
        assert_true(jdouble(o, "kernel_p50_us") <= jdouble(o, "step_p50_us"));
        json_object_put(o);
    }
    cmd_result r = kdactl(S, "bench", "--decode", "--seqs", "32", "--steps", "5", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "32 sequences x 1 tokens per step");
    expect_text(r.out, "p99");
    cmd_free(&r);
    r = kdactl(S, "bench", "--decode", "--transport", "cuda-ipc", NULL);
    expect_exit(&r, 6);
    cmd_free(&r);
    r = kdactl(S, "bench", "--decode", "--tokens", "0", NULL);
    expect_exit(&r, 2);
    cmd_free(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_step_random),
        cmocka_unit_test(test_step_errors),
        cmocka_unit_test(test_bench_decode),
    };
    return cmocka_run_group_tests(tests, start_daemon, stop_daemon);
}
