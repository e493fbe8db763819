/*
 * test_kdactl_cli.c - kdactl's and kdad's command-line habits, from their real output: ids in
 * --json that survive a JSON reader, global options after the command, short errors with a
 * "did you mean", default timeouts, plain messages for bad files, one meaning per short option,
 * retries of retryable errors, Ctrl-C in bench, prefill --check, dtype spellings; kdad's
 * --print-config and --check-config, the socket path checked before the pool is allocated,
 * and the line that says the CPU backend was chosen.  Against a real kdad (CPU backend,
 * H = 4, 64 slots) on a temporary socket, and a fake daemon that never answers.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "e2e_json.h"
#include "fake_kdad.h"
#include "golden.h"
#include "kdaclient.h"
#include "kdad_proc.h"
#include "safetensors.h"

#define H 4
#define SLOTS 64

static kdad_proc daemon_;
static const char *S;

static int start_daemon(void **state)
{
    if (!kdad_start(&daemon_, H, NULL))
        return -1;
    S = daemon_.sock;
    return 0;
}

static int stop_daemon(void **state)
{
    return kdad_stop(&daemon_) == 0 ? 0 : -1;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Runs a command given as a NULL-terminated list (argv[0] a path). */
static cmd_result run(const char *first, ...)
{
    char *argv[32];
    int n = 0;
    va_list ap;
    va_start(ap, first);
    for (const char *a = first; a && n < 31; a = va_arg(ap, const char *))
        argv[n++] = (char *)a;
    va_end(ap);
    argv[n] = NULL;
    return cmd_run(argv);
}

#define KDACTL build_path("client/kdactl")
#define KDAD build_path("daemon/kdad")

static void expect_no_text(const char *text, const char *part)
{
    if (strstr(text, part))
        fail_msg("\"%s\" has \"%s\"", text, part);
}

/* The command exited with code, its stderr saying part; r is then freed. */
static void expect_stderr(cmd_result r, int code, const char *part)
{
    expect_exit(&r, code);
    expect_text(r.err, part);
    cmd_free(&r);
}

/* The command exited with code, its stdout saying part; r is then freed. */
static void expect_stdout(cmd_result r, int code, const char *part)
{
    expect_exit(&r, code);
    expect_text(r.out, part);
    cmd_free(&r);
}

/* The text of the file at path (at most cap - 1 bytes; "" when it cannot be read), which is
 * then removed. */
static void take_file(const char *path, char *text, size_t cap)
{
    FILE *f = fopen(path, "r");
    size_t got = f ? fread(text, 1, cap - 1, f) : 0;
    text[got] = 0;
    if (f)
        fclose(f);
    unlink(path);
}

/* A libkdaclient connection to the daemon. */
static kdac_client *open_client(void)
{
    kdac_options opt;
    kdac_options_init(&opt);
    opt.socket_path = S;
    kdac_client *c;
    kdac_error err;
    assert_int_equal(kdac_client_open(&c, &opt, &err), KDAC_OK);
    return c;
}

/* ---------------------------------------------------------------------- */

/* Slot handles and the instance id are hex strings in --json, and `slot free` takes them. */
static void test_json_ids(void **state)
{
    json_object *o = kdactl_json(S, "slot", "alloc", "--count", "2", NULL);
    json_object *slots = jget(o, "slots");
    assert_int_equal(json_object_array_length(slots), 2);
    char *h[2];
    for (int i = 0; i < 2; i++) {
        json_object *v = json_object_array_get_idx(slots, (size_t)i);
        assert_true(json_object_is_type(v, json_type_string));
        h[i] = strdup(json_object_get_string(v));
        assert_int_equal(strlen(h[i]), 18);
        assert_memory_equal(h[i], "0x", 2);
    }
    json_object_put(o);
    /* The slots lived with that connection (no slots_persist): freeing them again is refused
     * by the daemon, not by kdactl's parser. */
    cmd_result r = kdactl(S, "slot", "free", h[0], h[1], NULL);
    expect_exit(&r, 1);
    expect_no_text(r.err, "is not a slot handle");
    cmd_free(&r);
    free(h[0]);
    free(h[1]);

    o = kdactl_json(S, "hello", NULL);
    json_object *inst = jget(o, "instance");
    assert_true(json_object_is_type(inst, json_type_string));
    assert_int_equal(strlen(json_object_get_string(inst)), 18);
    json_object_put(o);
}

/* --json, --socket and --timeout also after the command (and after its options). */
static void test_global_options_after_command(void **state)
{
    cmd_result r = run(KDACTL, "stats", "--json", "--socket", S, NULL);
    expect_exit(&r, 0);
    json_object *o = json_out(&r);
    assert_int_equal(jint(o, "pool.slots"), SLOTS);
    json_object_put(o);
    cmd_free(&r);
    r = run(KDACTL, "ping", "-n", "2", "-j", "-t", "3", "-s", S, NULL);
    expect_exit(&r, 0);
    o = json_out(&r);
    assert_int_equal(jint(o, "count"), 2);
    json_object_put(o);
    cmd_free(&r);
    char sock_opt[160];
    snprintf(sock_opt, sizeof(sock_opt), "--socket=%s", S);
    r = run(KDACTL, "health", sock_opt, "--json", NULL);
    expect_exit(&r, 0);
    o = json_out(&r);
    assert_string_equal(jstr(o, "status"), "ok");
    json_object_put(o);
    cmd_free(&r);
}

/* A typo: one short error naming the nearest command, not the whole usage. */
static void test_typos(void **state)
{
    static const char *const cases[][3] = {
        {"stast", NULL, "unknown command 'stast'; did you mean 'stats'?"},
        {"slto", NULL, "did you mean 'slot'?"},
        {"slot", "alocc", "unknown action 'alocc'; did you mean 'alloc'?"},
        {"layer", "regster", "did you mean 'register'?"},
        {"--jsn", "health", "unknown option '--jsn'; did you mean '--json'?"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        cmd_result r = run(KDACTL, "--socket", S, cases[i][0], cases[i][1], NULL);
        expect_exit(&r, 2);
        expect_text(r.err, cases[i][2]);
        expect_no_text(r.err, "Exit codes:");       /* not the whole usage */
        int lines = 0;
        for (const char *p = r.err; *p; p++)
            lines += *p == '\n';
        assert_true(lines <= 2);
        cmd_free(&r);
    }
    expect_stderr(run(KDACTL, "zzzzzz", NULL), 2, "unknown command 'zzzzzz'\n");
}

static void script_silent(fake_conn *fc, void *arg)
{
    fake_read(fc);
    fake_wait_eof(fc);
}

/* hello, ping, health and stats give up on a daemon that never answers after 5 s; --timeout
 * still sets another limit. */
static void test_default_timeouts(void **state)
{
    const char *cmds[] = {"health", "stats"};
    for (int i = 0; i < 2; i++) {
        fake_server *s = fake_start(script_silent, NULL);
        double t0 = now_s();
        cmd_result r = run(KDACTL, "--socket", fake_path(s), cmds[i], NULL);
        double took = now_s() - t0;
        expect_exit(&r, 7);
        expect_text(r.err, "within 5000 ms");
        assert_true(took >= 4.5 && took < 30);
        cmd_free(&r);
        assert_int_equal(fake_stop(s), 0);
    }
    fake_server *s = fake_start(script_silent, NULL);
    expect_stderr(run(KDACTL, "ping", "--socket", fake_path(s), "--timeout", "0.2", NULL),
                  7, "within 200 ms");
    assert_int_equal(fake_stop(s), 0);
}

/* The messages issue-prone inputs used to get: each says what is wrong, once. */
static void test_messages(void **state)
{
    cmd_result r = run(KDACTL, "--timeout", NULL);
    expect_exit(&r, 2);
    expect_text(r.err, "kdactl: --timeout needs a value");
    expect_no_text(r.err, "kdactl :");
    cmd_free(&r);
    expect_stderr(run(KDACTL, "--timeout", "x", "health", NULL),
                  2, "kdactl: --timeout: 'x' is not a number of seconds");
    expect_stderr(run(KDACTL, ":", NULL), 2, "kdactl: unknown command ':'");
    expect_stderr(kdactl(S, "prefill", "--input", "/nonexistent/in.safetensors", NULL),
                  5, "kdactl: /nonexistent/in.safetensors: No such file or directory\n");
    r = kdactl(S, "prefill", "--input", "/etc/passwd", NULL);
    expect_exit(&r, 5);
    expect_text(r.err, "kdactl: /etc/passwd: not a safetensors file (");
    expect_no_text(r.err, "/etc/passwd: /etc/passwd");
    cmd_free(&r);
}

/* One letter, one meaning: -n counts, -N sequences, -S seeds, -R random, -T tokens. */
static void test_short_options(void **state)
{
    json_object *o = kdactl_json(S, "ping", "-n", "3", NULL);
    assert_int_equal(jint(o, "count"), 3);
    json_object_put(o);
    o = kdactl_json(S, "prefill", "-R", "-T", "64", "-H", "4", "-N", "2", "-S", "7", NULL);
    assert_int_equal(jint(o, "seqs"), 2);
    assert_int_equal(jint(o, "tokens"), 64);
    json_object_put(o);
    o = kdactl_json(S, "bench", "-n", "3", "-N", "2", "-T", "16", "-S", "5", "-W", "0", NULL);
    assert_int_equal(jint(o, "requests"), 3);
    assert_int_equal(jint(o, "seqs_per_request"), 2);
    json_object_put(o);
    cmd_result r = kdactl(S, "slot", "alloc", "-n", "1", NULL);
    expect_exit(&r, 0);
    cmd_free(&r);
}

/* State dtypes: f32, fp32, float32; bf16, bfloat16 (any case). */
static void test_dtype_spellings(void **state)
{
    char dir[] = "/tmp/kdactl-cli-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char out[96];
    snprintf(out, sizeof(out), "%s/s.safetensors", dir);
    kdac_client *c = open_client();
    kdac_error err;
    uint64_t slot;
    assert_int_equal(kdac_slot_alloc(c, 1, 0, &slot, &err), KDAC_OK);
    char handle[24];
    snprintf(handle, sizeof(handle), "0x%016llx", (unsigned long long)slot);
    /* the slot belongs to c's connection: kdactl cannot touch it, so make it persist-free:
     * each spelling is checked by the parser, then refused by ownership, or saved */
    static const char *const spellings[][2] = {{"fp32", "F32"},     {"float32", "F32"},
                                               {"F32", "F32"},      {"bfloat16", "BF16"},
                                               {"BF16", "BF16"}};
    for (size_t i = 0; i < sizeof(spellings) / sizeof(spellings[0]); i++) {
        cmd_result r = kdactl(S, "slot", "save", handle, "--output", out, "--dtype",
                              spellings[i][0], NULL);
        expect_no_text(r.err, "is neither bf16");
        assert_int_not_equal(r.status, 2);
        cmd_free(&r);
    }
    expect_stderr(kdactl(S, "slot", "save", handle, "--output", out, "--dtype", "f16", NULL),
                  2, "'f16' is neither bf16 (bfloat16) nor f32 (fp32, float32)");
    kdac_client_close(c);
    expect_stdout(run(KDAD, "--print-config", "--state-dtype", "float32", NULL),
                  0, "state_dtype: f32  # --state-dtype");
    expect_stdout(run(KDAD, "--print-config", "--state-dtype", "bfloat16", NULL),
                  0, "state_dtype: bf16  # --state-dtype");
    unlink(out);
    rmdir(dir);
}

/* POOL_FULL is retryable: kdactl backs off and tries again (while the pool frees up), or
 * with --no-retry reports it at once. */
static void test_retries(void **state)
{
    kdac_client *c = open_client();
    kdac_error err;
    uint64_t held[SLOTS];
    assert_int_equal(kdac_slot_alloc(c, SLOTS, 0, held, &err), KDAC_OK);

    double t0 = now_s();
    cmd_result r = kdactl(S, "--no-retry", "slot", "alloc", NULL);
    expect_exit(&r, 1);
    expect_text(r.err, "POOL_FULL");
    expect_no_text(r.err, "retry 1");
    assert_true(now_s() - t0 < 5);
    cmd_free(&r);

    /* A child frees the pool 0.8 s from now; kdactl, retrying, gets its slot. */
    pid_t child = fork();
    if (child == 0) {
        usleep(800 * 1000);
        _exit(0);
    }
    char out_path[] = "/tmp/kdactl-retry-XXXXXX";
    int fd = mkstemp(out_path);
    assert_true(fd >= 0);
    close(fd);
    char line[512];
    snprintf(line, sizeof(line), "%s --socket %s --retries 6 --retry-delay 100 slot alloc "
             ">%s 2>&1", KDACTL, S, out_path);
    pid_t ctl_pid = fork();
    if (ctl_pid == 0) {
        execl("/bin/sh", "sh", "-c", line, (char *)NULL);
        _exit(127);
    }
    waitpid(child, NULL, 0);
    assert_int_equal(kdac_slot_free(c, held, SLOTS, &err), KDAC_OK);
    int st;
    waitpid(ctl_pid, &st, 0);
    char text[4096];
    take_file(out_path, text, sizeof(text));
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail_msg("kdactl slot alloc with retries failed:\n%s", text);
    expect_text(text, "POOL_FULL");
    expect_text(text, "retry 1 of 6 in 100 ms");
    expect_text(text, "retry 2 of 6 in 200 ms");
    expect_text(text, "allocated");
    kdac_client_close(c);
}

/* Ctrl-C in bench: the results so far, exit 130, and its temporary layer is gone. */
static void test_bench_interrupt(void **state)
{
    char out_path[] = "/tmp/kdactl-bench-XXXXXX";
    int fd = mkstemp(out_path);
    assert_true(fd >= 0);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        execl(KDACTL, "kdactl", "--socket", S, "bench", "--duration", "60", "--tokens", "64",
              (char *)NULL);
        _exit(127);
    }
    close(fd);
    usleep(1500 * 1000);
    /* the layer is registered while it runs */
    expect_stdout(kdactl(S, "layer", "list", NULL), 0, "kdactl.");
    double t0 = now_s();
    kill(pid, SIGINT);
    int st;
    waitpid(pid, &st, 0);
    assert_true(now_s() - t0 < 20);
    char text[8192];
    take_file(out_path, text, sizeof(text));
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 130)
        fail_msg("kdactl bench after SIGINT: status %d\n%s", st, text);
    expect_text(text, "(interrupted: the results so far)");
    expect_text(text, "throughput");
    cmd_result r = kdactl(S, "layer", "list", NULL);
    expect_exit(&r, 0);
    expect_no_text(r.out, "kdactl.");
    cmd_free(&r);
}

/* prefill --check: the errors against the file's expected tensors, within the contract; a
 * file whose expected tensors belong to another case fails it. */
static void test_prefill_check(void **state)
{
    char path[512], other[512];
    snprintf(path, sizeof(path), "%s/fixed_h4_t256.safetensors", golden_dir());
    snprintf(other, sizeof(other), "%s/fastgate_h4_t256.safetensors", golden_dir());
    cmd_result r = kdactl(S, "prefill", "--input", path, "--check", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "check      output error 0.00");
    expect_text(r.out, "within the accuracy contract");
    cmd_free(&r);
    json_object *o = kdactl_json(S, "prefill", "--input", path, "-C", NULL);
    assert_true(jbool(o, "check.ok"));
    assert_true(jdouble(o, "check.out_err") > 0.001 && jdouble(o, "check.out_err") < 0.005);
    assert_true(jdouble(o, "check.out_bound") >= 0.005);
    json_object_put(o);

    /* fixed_h4_t256's inputs with fastgate_h4_t256's expected tensors (same shapes) */
    st_file *a, *b;
    char why[256];
    assert_int_equal(st_open(path, &a, why, sizeof(why)), 0);
    assert_int_equal(st_open(other, &b, why, sizeof(why)), 0);
    st_writer *w = st_writer_new();
    for (size_t i = 0; i < st_count(a); i++) {
        const st_tensor *t = st_at(a, i);
        if (strncmp(t->name, "expected_", 9) == 0)
            t = st_get(b, t->name);
        st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data);
    }
    char mixed[] = "/tmp/kdactl-check-XXXXXX";
    int fd = mkstemp(mixed);
    close(fd);
    assert_int_equal(st_writer_write(w, mixed, why, sizeof(why)), 0);
    st_writer_free(w);
    st_close(a);
    st_close(b);
    expect_stdout(kdactl(S, "prefill", "--input", mixed, "--check", NULL),
                  1, "ABOVE the accuracy contract");
    unlink(mixed);

    r = kdactl(S, "prefill", "--random", "--tokens", "16", "--heads", "4", "--check", NULL);
    expect_exit(&r, 2);
    cmd_free(&r);
}

/* kdad --print-config: the effective configuration, readable again; --check-config without a
 * file checks the built-in one with the flags. */
static void test_kdad_config_flags(void **state)
{
    cmd_result r = run(KDAD, "--print-config", "--slots", "8", "--heads", "2", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "slots: 8  # --slots");
    expect_text(r.out, "heads: 2  # --heads");
    expect_text(r.out, "backend: auto  # built-in");
    expect_text(r.out, "limits:\n  max_frame_bytes: ");
    char cfg[] = "/tmp/kdad-print-XXXXXX";
    int fd = mkstemp(cfg);
    assert_true(write(fd, r.out, strlen(r.out)) == (ssize_t)strlen(r.out));
    close(fd);
    cmd_free(&r);
    expect_stdout(run(KDAD, "--check-config", cfg, NULL),
                  0, "ok (backend auto, 2 heads, 8 slots, 0 layers)");
    r = run(KDAD, "--print-config", "--config", cfg, NULL);
    expect_exit(&r, 0);
    char want[128];
    snprintf(want, sizeof(want), "slots: 8  # %s:", cfg);
    expect_text(r.out, want);
    cmd_free(&r);
    unlink(cfg);

    expect_stdout(run(KDAD, "--check-config", NULL), 0, "built-in configuration: ok");
    expect_stderr(run(KDAD, "--check-config", "--heads", "0", NULL), 2, "--heads");
    r = run(KDAD, "--bogus", NULL);
    expect_exit(&r, 2);
    expect_text(r.err, "kdad --help lists the options");
    expect_no_text(r.err, "usage:");
    cmd_free(&r);
}

/* A socket path whose folder is missing fails at once (before the pool), saying what to do;
 * so does a path taken by a file. */
static void test_kdad_socket_path(void **state)
{
    double t0 = now_s();
    cmd_result r = run(KDAD, "--backend", "cpu", "--heads", "2", "--slots", "50000",
                       "--socket", "/nonexistent-kdad/run/kdad.sock", NULL);
    expect_exit(&r, 2);
    expect_text(r.err, "the folder /nonexistent-kdad/run does not exist");
    expect_text(r.err, "mkdir -p /nonexistent-kdad/run");
    expect_no_text(r.err, "backend cpu:"); /* no pool was allocated */
    assert_true(now_s() - t0 < 10);
    cmd_free(&r);
    expect_stderr(run(KDAD, "--backend", "cpu", "--heads", "2", "--socket", "/etc/passwd", NULL),
                  2, "the path exists and is not a socket");
}

/* --backend auto without a usable GPU: the log says plainly that the CPU backend was chosen
 * and why. */
static void test_kdad_cpu_chosen(void **state)
{
    char dir[] = "/tmp/kdad-auto-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char sock[96], log[96];
    snprintf(sock, sizeof(sock), "%s/kdad.sock", dir);
    snprintf(log, sizeof(log), "%s/kdad.log", dir);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 1);
        dup2(fd, 2);
        execl(KDAD, "kdad", "--backend", "auto", "--heads", "1", "--slots", "1", "--socket", sock,
              (char *)NULL);
        _exit(127);
    }
    bool up = false;
    for (int i = 0; i < 600 && !up; i++) {
        cmd_result r = run(KDACTL, "--socket", sock, "health", NULL);
        up = r.status == 0;
        cmd_free(&r);
        if (!up)
            usleep(50 * 1000);
    }
    cmd_result r = run(KDACTL, "--json", "--socket", sock, "hello", NULL);
    bool cpu = strstr(r.out, "\"backend\": \"cpu\"") != NULL;
    cmd_free(&r);
    kill(pid, SIGTERM);
    int st;
    waitpid(pid, &st, 0);
    char text[8192];
    take_file(log, text, sizeof(text));
    rmdir(dir);
    assert_true(up);
    if (!cpu) {
        print_message("skipped: this machine has a usable GPU, so auto chose it\n");
        return;
    }
    expect_text(text, "backend auto: CPU backend chosen (");
    if (!strstr(text, "built without the CUDA backend"))
        expect_text(text, "no GPU");
    expect_no_text(text, "CUDA driver version is insufficient");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_ids),
        cmocka_unit_test(test_global_options_after_command),
        cmocka_unit_test(test_typos),
        cmocka_unit_test(test_default_timeouts),
        cmocka_unit_test(test_messages),
        cmocka_unit_test(test_short_options),
        cmocka_unit_test(test_dtype_spellings),
        cmocka_unit_test(test_retries),
        cmocka_unit_test(test_bench_interrupt),
        cmocka_unit_test(test_prefill_check),
        cmocka_unit_test(test_kdad_config_flags),
        cmocka_unit_test(test_kdad_socket_path),
        cmocka_unit_test(test_kdad_cpu_chosen),
    };
    return cmocka_run_group_tests(tests, start_daemon, stop_daemon);
}
