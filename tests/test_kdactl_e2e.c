/*
 * test_kdactl_e2e.c - every kdactl command against a real kdad (CPU
 * backend, H = 4, 64 slots, slots that persist across connections) on a
 * temporary socket: hello, ping, health, stats, layer, slot (state bytes
 * checked through save/load), bench over inline and shm (cuda-ipc refused
 * on the CPU backend), the examples, exit codes and messages for a daemon
 * that is not running, speaks another protocol, or dies mid-command, and
 * --help for every command.  (Prefill and its accuracy: test_kdactl_golden.c.)
 */
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "bf16.h"
#include "e2e_json.h"
#include "fake_kdad.h"
#include "golden.h"
#include "kdad_proc.h"

#define H 4
#define STATE_ELEMS ((size_t)H * 128 * 128)

static kdad_proc daemon_;
static const char *S; /* its socket */

static int start_daemon(void **state)
{
    if (!kdad_start(&daemon_, H, "slots_persist: true\nclients:\n"
                                 "  max_inflight_bytes_per_uid: 300MiB\n"
                                 "  output_stall_seconds: 9\n"))
        return -1;
    S = daemon_.sock;
    return 0;
}

static int stop_daemon(void **state)
{
    return kdad_stop(&daemon_) == 0 ? 0 : -1;
}

static char golden_file[512];

static const char *golden(const char *name)
{
    snprintf(golden_file, sizeof(golden_file), "%s/%s.safetensors", golden_dir(), name);
    return golden_file;
}

/* ---------------------------------------------------------------------- */

static void test_hello_ping_health_stats(void **state)
{
    json_object *o = kdactl_json(S, "hello", NULL);
    assert_int_equal(jint(o, "version"), 1);
    assert_string_equal(jstr(o, "backend"), "cpu");
    assert_int_equal(jint(o, "heads"), H);
    assert_int_equal(jint(o, "head_dim"), 128);
    assert_int_equal(jint(o, "slots"), 64);
    assert_true(json_object_get_boolean(jget(o, "slots_persist")));
    assert_string_equal(jstr(o, "socket"), S);
    assert_true(json_object_is_type(jget(o, "gpu"), json_type_null));
    expect_text(json_object_to_json_string(jget(o, "transports")), "\"inline\"");
    assert_true(jint(o, "limits.max_batch_tokens") > 0);
    expect_text(jstr(o, "server"), "kdad");
    /* the per-uid and daemon-wide bounds, as configured */
    assert_int_equal(jint(o, "limits.clients.max_inflight_bytes_per_uid"), 300ll << 20);
    assert_int_equal(jint(o, "limits.clients.output_stall_seconds"), 9);
    assert_int_equal(jint(o, "limits.clients.frame_stall_seconds"), 30); /* the default */
    assert_true(jint(o, "limits.clients.max_inflight_bytes_total") >= 300ll << 20);
    assert_int_equal(jint(o, "limits.max_slots_per_uid"), 64);
    /* the cpu backend's memory: its pool of 64 f32 states, in host memory */
    const int64_t pool = 64ll * STATE_ELEMS * 4;
    assert_int_equal(jint(o, "memory.pool"), pool);
    assert_int_equal(jint(o, "memory.scratch"), 0);
    assert_int_equal(jint(o, "memory.total"), pool);
    json_object_put(o);

    cmd_result r = kdactl(S, "hello", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "backend     cpu");
    expect_text(r.out, "4 heads x 128, 64 slots");
    expect_text(r.out, "300.0 MiB of requests in flight");
    expect_text(r.out, "9 s without one of the output taken");
    expect_text(r.out, "memory      16.0 MiB of host memory: pool 16.0 MiB, staging 0 B, "
                       "scratch 0 B, kernel 0 B, lanes 0 B, layers 0 B");
    cmd_free(&r);

    r = kdactl(S, "ping", "--count", "3", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "3 pings: min");
    cmd_free(&r);
    o = kdactl_json(S, "ping", "--count", "20", NULL);
    assert_int_equal(jint(o, "count"), 20);
    assert_string_equal(jstr(o, "status"), "ok");
    /* a real round trip takes time, and the quantiles are ordered */
    double lo = jdouble(o, "rtt_us_min"), p50 = jdouble(o, "rtt_us_p50"),
           p99 = jdouble(o, "rtt_us_p99"), hi = jdouble(o, "rtt_us_max");
    assert_true(lo > 0 && lo <= p50 && p50 <= p99 && p99 <= hi);
    json_object_put(o);
    /* the same over a frame ring, the client polling */
    o = kdactl_json(S, "ping", "--count", "50", "--ring", "--spin", "2000", NULL);
    assert_int_equal(jint(o, "count"), 50);
    assert_true(jbool(o, "ring"));
    assert_int_equal(jint(o, "spin_us"), 2000);
    assert_true(jdouble(o, "rtt_us_min") > 0);
    json_object_put(o);
    r = kdactl(S, "ping", "--count", "2", "--ring", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "2 pings over a frame ring: min");
    cmd_free(&r);

    o = kdactl_json(S, "health", NULL);
    assert_string_equal(jstr(o, "status"), "ok");
    assert_true(jint(o, "uptime_us") > 0);
    json_object_put(o);

    o = kdactl_json(S, "stats", NULL);
    assert_true(jint(o, "connections_total") >= 5); /* the ones above, and this one */
    assert_true(jint(o, "requests") >= 8);
    assert_int_equal(jint(o, "pool.slots"), 64);
    assert_true(jint(o, "batches_held") <= jint(o, "batches"));
    assert_int_equal(jint(o, "batches_gathered"), 0); /* the cpu backend has no waves */
    jget(o, "latency_us.p99");
    jget(o, "transport_bytes.shm.in");
    /* this connection, and its stats request in flight */
    assert_int_equal(jint(o, "uid.uid"), (int64_t)getuid());
    assert_int_equal(jint(o, "uid.connections"), 1);
    assert_true(jint(o, "uid.held.inflight_bytes") > 0);
    assert_int_equal(jint(o, "uid.held.partial_bytes"), 0);
    assert_true(jint(o, "clients.held.inflight_bytes") >= jint(o, "uid.held.inflight_bytes"));
    assert_true(jint(o, "clients.peak.output_bytes") > 0); /* the answers above */
    assert_int_equal(jint(o, "clients.stalled"), 0);
    assert_int_equal(jint(o, "clients.refused"), 0);
    assert_int_equal(jint(o, "clients.bounds.max_inflight_bytes_per_uid"), 300ll << 20);
    assert_int_equal(jint(o, "memory.pool"), pool);
    assert_int_equal(jint(o, "memory.layers"), 0);
    assert_int_equal(jint(o, "memory.total"), pool);
    json_object_put(o);
    r = kdactl(S, "stats", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "kdad statistics");
    expect_text(r.out, "64 slots");
    expect_text(r.out, "of 300.0 MiB in flight (0 B arriving)");
    expect_text(r.out, "0 stalled, 0 refused");
    expect_text(r.out, "memory      16.0 MiB: pool 16.0 MiB, staging 0 B");
    cmd_free(&r);
}

/* ---------------------------------------------------------------------- */

static void test_layer_commands(void **state)
{
    const char *file = golden("mixed_h4");
    json_object *o = kdactl_json(S, "layer", "register", "e2e.mixed", "--weights", file, NULL);
    assert_true(json_object_get_boolean(jget(o, "created")));
    assert_true(json_object_get_double(jget(o, "lower_bound")) == -5.0);
    json_object_put(o);
    /* The same again is harmless. */
    cmd_result r = kdactl(S, "layer", "register", "e2e.mixed", "--weights", file, NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "already registered");
    cmd_free(&r);
    /* Other content under the name: refused by the daemon. */
    r = kdactl(S, "layer", "register", "e2e.mixed", "--weights", file, "--lower-bound", "-3",
               NULL);
    expect_exit(&r, 1);
    expect_text(r.err, "LAYER_EXISTS");
    cmd_free(&r);
    o = kdactl_json(S, "layer", "list", NULL);
    json_object *layers = jget(o, "layers");
    assert_int_equal(json_object_array_length(layers), 1);
    assert_string_equal(jstr(json_object_array_get_idx(layers, 0), "name"), "e2e.mixed");
    assert_string_equal(jstr(json_object_array_get_idx(layers, 0), "source"), "client");
    json_object_put(o);
    r = kdactl(S, "layer", "list", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "e2e.mixed");
    expect_text(r.out, "lower_bound -5");
    cmd_free(&r);
    /* Registered twice: the first drop gives one registration back, the
     * second removes the name. */
    for (int i = 0; i < 2; i++) {
        r = kdactl(S, "layer", "drop", "e2e.mixed", NULL);
        expect_exit(&r, 0);
        cmd_free(&r);
        r = kdactl(S, "layer", "list", NULL);
        expect_exit(&r, 0);
        assert_true((strstr(r.out, "e2e.mixed") != NULL) == (i == 0));
        cmd_free(&r);
    }
    r = kdactl(S, "--json", "layer", "drop", "e2e.mixed", NULL);
    expect_exit(&r, 1);
    o = json_out(&r);
    assert_string_equal(jstr(o, "error.name"), "UNKNOWN_LAYER");
    assert_int_equal(jint(o, "error.exit_code"), 1);
    json_object_put(o);
    cmd_free(&r);
    /* Weights of another H do not fit this daemon. */
    r = kdactl(S, "layer", "register", "e2e.h1", "--weights", golden("long_h1_t4096"), NULL);
    expect_exit(&r, 5);
    expect_text(r.err, "weights for 1 heads; the daemon serves 4");
    cmd_free(&r);
}

/* ---------------------------------------------------------------------- */

/* A state file for `slot load`: f32 [H, 128, 128] values and a position. */
static float *write_state_file(const char *path, uint64_t pos)
{
    float *v = malloc(STATE_ELEMS * sizeof(float));
    for (size_t i = 0; i < STATE_ELEMS; i++)
        v[i] = (float)sin((double)i * 0.37) * 0.5f;
    st_writer *w = st_writer_new();
    char p[32], err[256];
    snprintf(p, sizeof(p), "%llu", (unsigned long long)pos);
    st_writer_add(w, "state", ST_F32, 3, (const int64_t[]){H, 128, 128}, v);
    st_writer_meta(w, "pos", p);
    assert_int_equal(st_writer_write(w, path, err, sizeof(err)), 0);
    st_writer_free(w);
    return v;
}

/* `slot save` into path; returns the file (caller closes) and checks pos. */
static st_file *save_slot(const char *handle, const char *path, const char *dtype, uint64_t pos)
{
    json_object *o = kdactl_json(S, "slot", "save", handle, "--output", path, "--dtype",
                                 dtype, NULL);
    assert_int_equal(juint(o, "pos"), pos);
    json_object_put(o);
    st_file *f;
    char err[256];
    assert_int_equal(st_open(path, &f, err, sizeof(err)), 0);
    return f;
}

/* A handle as --json prints it: a string, "0x" and 16 hex digits, which `slot` takes back. */
static char *handle_text(json_object *v)
{
    assert_true(json_object_is_type(v, json_type_string));
    const char *s = json_object_get_string(v);
    assert_int_equal(strlen(s), 18);
    assert_memory_equal(s, "0x", 2);
    return strdup(s);
}

static void test_slot_commands(void **state)
{
    char dir[] = "/tmp/kdactl-slots-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char in[96], out[96];
    snprintf(in, sizeof(in), "%s/in.safetensors", dir);
    snprintf(out, sizeof(out), "%s/out.safetensors", dir);

    json_object *o = kdactl_json(S, "slot", "alloc", "--count", "2", NULL);
    char *a = handle_text(json_object_array_get_idx(jget(o, "slots"), 0));
    char *b = handle_text(json_object_array_get_idx(jget(o, "slots"), 1));
    json_object_put(o);

    /* They persist: a later connection sees them, ready at position 0. */
    o = kdactl_json(S, "slot", "info", a, b, NULL);
    json_object *e = json_object_array_get_idx(jget(o, "slots"), 0);
    assert_string_equal(jstr(e, "status"), "ready");
    assert_int_equal(jint(e, "pos"), 0);
    json_object_put(o);

    /* load, then save: the same bytes and position come back (f32 exact,
     * bf16 rounded to nearest even). */
    float *v = write_state_file(in, 123);
    cmd_result r = kdactl(S, "slot", "load", a, "--input", in, NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "at position 123");
    cmd_free(&r);
    st_file *f = save_slot(a, out, "f32", 123);
    const st_tensor *t = st_get(f, "state");
    assert_non_null(t);
    assert_int_equal(t->dtype, ST_F32);
    assert_memory_equal(t->data, v, STATE_ELEMS * sizeof(float));
    assert_string_equal(st_meta(f, "pos"), "123");
    st_close(f);
    f = save_slot(a, out, "bf16", 123);
    t = st_get(f, "state");
    assert_int_equal(t->dtype, ST_BF16);
    const uint16_t *h16 = t->data;
    for (size_t i = 0; i < STATE_ELEMS; i++)
        assert_int_equal(h16[i], kda_f32_to_bf16(v[i]));
    st_close(f);

    /* fork into b: b becomes a copy. */
    o = kdactl_json(S, "slot", "fork", a, "--dst", b, NULL);
    assert_int_equal(jint(o, "pos"), 123);
    json_object_put(o);
    f = save_slot(b, out, "f32", 123);
    assert_memory_equal(st_get(f, "state")->data, v, STATE_ELEMS * sizeof(float));
    st_close(f);
    /* fork into a new slot */
    o = kdactl_json(S, "slot", "fork", a, NULL);
    char *c = handle_text(jget(o, "slot"));
    json_object_put(o);

    /* reset b: zeros at position 0 */
    r = kdactl(S, "slot", "reset", b, NULL);
    expect_exit(&r, 0);
    cmd_free(&r);
    f = save_slot(b, out, "f32", 0);
    const float *z = st_get(f, "state")->data;
    for (size_t i = 0; i < STATE_ELEMS; i++)
        assert_true(z[i] == 0.0f);
    st_close(f);

    /* load into a new slot; an empty slot cannot be saved */
    o = kdactl_json(S, "slot", "load", "--input", in, NULL);
    char *d = handle_text(jget(o, "slot"));
    assert_int_equal(jint(o, "pos"), 123);
    json_object_put(o);
    o = kdactl_json(S, "slot", "alloc", "--empty", NULL);
    char *em = handle_text(json_object_array_get_idx(jget(o, "slots"), 0));
    json_object_put(o);
    r = kdactl(S, "slot", "save", em, "--output", out, NULL);
    expect_exit(&r, 1);
    expect_text(r.err, "STATE_LOST");
    cmd_free(&r);
    r = kdactl(S, "slot", "info", NULL); /* every slot of this uid */
    expect_exit(&r, 0);
    expect_text(r.out, "empty");
    expect_text(r.out, "5 slots listed");
    cmd_free(&r);

    r = kdactl(S, "slot", "free", a, b, c, d, em, NULL);
    expect_exit(&r, 0);
    cmd_free(&r);
    r = kdactl(S, "--json", "slot", "info", a, NULL);
    expect_exit(&r, 1);
    o = json_out(&r);
    assert_string_equal(jstr(o, "error.name"), "STALE_SLOT");
    json_object_put(o);
    cmd_free(&r);
    r = kdactl(S, "slot", "free", "banana", NULL);
    expect_exit(&r, 2);
    cmd_free(&r);
    free(a), free(b), free(c), free(d), free(em), free(v);
    unlink(in);
    unlink(out);
    rmdir(dir);
}

/* ---------------------------------------------------------------------- */

static void test_bench(void **state)
{
    const char *transports[] = {"inline", "shm"};
    for (int i = 0; i < 2; i++) {
        json_object *o = kdactl_json(S, "bench", "--requests", "12", "--clients", "2",
                                     "--depth", "2", "--tokens", "32", "--dist", "mixed",
                                     "--seqs", "2", "--transport", transports[i], NULL);
        assert_int_equal(jint(o, "requests"), 12);
        assert_int_equal(jint(o, "errors"), 0);
        assert_string_equal(jstr(o, "transport"), transports[i]);
        assert_true(json_object_get_double(jget(o, "tokens_per_s")) > 0);
        double p50 = json_object_get_double(jget(o, "latency_ms.p50"));
        double p99 = json_object_get_double(jget(o, "latency_ms.p99"));
        assert_true(p50 > 0 && p99 >= p50);
        json_object_put(o);
    }
    /* The packed workload of the benchmarks, exactly (scaled down by 10). */
    json_object *o = kdactl_json(S, "bench", "--requests", "4", "--lengths",
                                 "130,55,205,96,27,306", "--transport", "shm", NULL);
    assert_int_equal(jint(o, "requests"), 4);
    assert_int_equal(jint(o, "seqs_per_request"), 6);
    assert_int_equal(jint(o, "tokens"), 4 * 819);
    assert_string_equal(jstr(o, "dist"), "list");
    assert_int_equal(jint(o, "align"), 256);
    json_object_put(o);
    /* The same with every sequence at a multiple of 1 MiB: the padded layout stays inside the
     * region (a reference past it would fail the requests with REGION_BOUNDS) */
    o = kdactl_json(S, "bench", "--requests", "4", "--clients", "2", "--depth", "2",
                    "--lengths", "130,55,205,96,27,306", "--transport", "shm", "--align", "1048576",
                    NULL);
    assert_int_equal(jint(o, "requests"), 4);
    assert_int_equal(jint(o, "errors"), 0);
    assert_int_equal(jint(o, "align"), 1048576);
    json_object_put(o);
    cmd_result r = kdactl(S, "bench", "--duration", "1", "--dist", "uniform", "--tokens", "16",
                          "--depth", "3", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "0 failed");
    expect_text(r.out, "latency    p50");
    cmd_free(&r);
    /* Over frame rings: clients polling between answers, then sleeping on doorbells. */
    const char *spin[] = {"2000", "0"};
    for (int i = 0; i < 2; i++) {
        o = kdactl_json(S, "bench", "--requests", "40", "--clients", "3", "--depth", "2",
                        "--tokens", "16", "--transport", "shm", "--ring", "--spin", spin[i], NULL);
        assert_int_equal(jint(o, "requests"), 40);
        assert_int_equal(jint(o, "errors"), 0);
        assert_true(jbool(o, "ring"));
        json_object_put(o);
    }
    r = kdactl(S, "bench", "--transport", "cuda-ipc", "--requests", "1", NULL);
    expect_exit(&r, 6);
    expect_text(r.err, "not supported");
    cmd_free(&r);
    /* bench leaves nothing behind */
    r = kdactl(S, "--json", "stats", NULL);
    o = json_out(&r);
    assert_int_equal(jint(o, "regions"), 0);
    json_object_put(o);
    cmd_free(&r);
}

/* The examples the build compiles, against the daemon. */
static void test_examples(void **state)
{
    char *epoll[] = {(char *)build_path("client/kdac_example_epoll"), (char *)S, NULL};
    cmd_result r = cmd_run(epoll);
    expect_exit(&r, 0);
    expect_text(r.out, "8 sequences x 3 chunks of 64 tokens: 0 failed");
    expect_text(r.out, "chunk 3 done, position 192");
    cmd_free(&r);
    char *uv[] = {(char *)build_path("client/kdac_example_libuv"), (char *)S, NULL};
    r = cmd_run(uv);
    expect_exit(&r, 0);
    expect_text(r.out, "16 prefills of 32 tokens completed, 0 failed");
    cmd_free(&r);
}

/* ---------------------------------------------------------------------- */
/* Failures                                                               */
/* ---------------------------------------------------------------------- */

static void test_not_running(void **state)
{
    cmd_result r = kdactl("/tmp/kdactl-no-such-dir/kdad.sock", "hello", NULL);
    expect_exit(&r, 3);
    expect_text(r.err, "daemon not running: no socket at /tmp/kdactl-no-such-dir/kdad.sock");
    cmd_free(&r);
    r = kdactl("/tmp/kdactl-no-such-dir/kdad.sock", "--json", "stats", NULL);
    expect_exit(&r, 3);
    json_object *o = json_out(&r);
    assert_string_equal(jstr(o, "error.name"), "NOT_RUNNING");
    assert_true(json_object_get_boolean(jget(o, "error.retryable")));
    json_object_put(o);
    cmd_free(&r);
}

static void script_v2(fake_conn *fc, void *arg)
{
    uint32_t id = fake_expect(fc, KP_METHOD_HELLO);
    fake_send_error(fc, id, KP_E_UNSUPPORTED_VERSION,
                    "versions: the client speaks [1]; this daemon speaks [2]");
    fake_send_goodbye(fc, KP_E_UNSUPPORTED_VERSION, "no protocol version in common");
}

static void script_garbage(fake_conn *fc, void *arg)
{
    fake_read(fc);
    fake_send_raw(fc, "SSH-2.0-OpenSSH_9.2\r\n", 21);
    fake_wait_eof(fc);
}

static void test_other_protocol(void **state)
{
    fake_server *s = fake_start(script_v2, NULL);
    cmd_result r = kdactl(fake_path(s), "hello", NULL);
    expect_exit(&r, 4);
    expect_text(r.err, "speaks another protocol version than this kdactl (protocol 1)");
    expect_text(r.err, "this daemon speaks [2]");
    cmd_free(&r);
    assert_int_equal(fake_stop(s), 0);
    s = fake_start(script_garbage, NULL);
    r = kdactl(fake_path(s), "ping", NULL);
    expect_exit(&r, 4);
    expect_text(r.err, "does not speak the kdad protocol");
    cmd_free(&r);
    assert_int_equal(fake_stop(s), 0);
}

static void script_silent(fake_conn *fc, void *arg)
{
    fake_read(fc);
    fake_wait_eof(fc);
}

/* --timeout gives up on a daemon that never answers. */
static void test_timeout(void **state)
{
    fake_server *s = fake_start(script_silent, NULL);
    cmd_result r = kdactl(fake_path(s), "--timeout", "0.3", "health", NULL);
    expect_exit(&r, 7);
    expect_text(r.err, "no answer from the daemon within 300 ms");
    cmd_free(&r);
    assert_int_equal(fake_stop(s), 0);
}

/* On a terminal, a large transfer draws a progress bar on stderr (and
 * erases it); the result still prints. */
static void test_progress_bar(void **state)
{
    char line[512];
    snprintf(line, sizeof(line), "%s --socket %s prefill --random --tokens 8192 --heads 4",
             build_path("client/kdactl"), S);
    char *argv[] = {"/usr/bin/script", "-qec", line, "/dev/null", NULL};
    cmd_result r = cmd_run(argv);
    expect_exit(&r, 0);
    expect_text(r.out, "\rprefill send    [");   /* the bar names the request's phase */
    expect_text(r.out, "\rprefill receive [");
    expect_text(r.out, "B/s");
    expect_text(r.out, "% ");
    expect_text(r.out, "\r\033[K");
    expect_text(r.out, "prefill: 8192 tokens x 4 heads");
    cmd_free(&r);
    /* Without a terminal: no bar. */
    r = kdactl(S, "prefill", "--random", "--tokens", "8192", "--heads", "4", NULL);
    expect_exit(&r, 0);
    assert_null(strstr(r.err, "prefill send"));
    cmd_free(&r);
}

/* A daemon that dies under load: kdactl reports a lost connection (7). */
static void test_daemon_dies(void **state)
{
    kdad_proc d;
    assert_true(kdad_start(&d, H, NULL));
    pid_t child = fork();
    if (child == 0) {
        usleep(700 * 1000);
        kill(d.pid, SIGKILL);
        _exit(0);
    }
    cmd_result r = kdactl(d.sock, "bench", "--duration", "20", "--tokens", "16", NULL);
    expect_exit(&r, 7);
    expect_text(r.out, "first error");
    cmd_free(&r);
    waitpid(child, NULL, 0);
    assert_int_equal(kdad_stop(&d), -1); /* it was killed, not drained */
}

static void test_usage_and_help(void **state)
{
    const char *cmds[] = {"hello", "ping", "health", "stats", "layer", "slot", "prefill", "bench"};
    for (int i = 0; i < 8; i++) {
        cmd_result r = kdactl(S, cmds[i], "--help", NULL);
        expect_exit(&r, 0);
        char want[64];
        snprintf(want, sizeof(want), "Usage: kdactl %s", cmds[i]);
        expect_text(r.out, want);
        cmd_free(&r);
    }
    cmd_result r = kdactl(S, "--help", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "Exit codes:");
    cmd_free(&r);
    r = kdactl(S, "help", "bench", NULL);
    expect_exit(&r, 0);
    expect_text(r.out, "Usage: kdactl bench");
    cmd_free(&r);
    const char *bad[][4] = {{"frobnicate", NULL}, {"slot", NULL}, {"slot", "fork", NULL},
                            {"prefill", "--random", NULL}, {"bench", "--dist", "zipf", NULL},
                            {"layer", "register", "x", NULL}, {"ping", "--count", "0", NULL},
                            {"bench", "--lengths", "5,x", NULL}, {"bench", "--align", "3000", NULL},
                            {"bench", "--align", "128", NULL}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        r = kdactl(S, bad[i][0], bad[i][1], bad[i][2], bad[i][3], NULL);
        if (r.status != 2)
            fail_msg("kdactl %s %s: exit %d, expected 2\n%s", bad[i][0],
                     bad[i][1] ? bad[i][1] : "", r.status, r.err);
        cmd_free(&r);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello_ping_health_stats),
        cmocka_unit_test(test_layer_commands),
        cmocka_unit_test(test_slot_commands),
        cmocka_unit_test(test_bench),
        cmocka_unit_test(test_examples),
        cmocka_unit_test(test_not_running),
        cmocka_unit_test(test_other_protocol),
        cmocka_unit_test(test_timeout),
        cmocka_unit_test(test_progress_bar),
        cmocka_unit_test(test_daemon_dies),
        cmocka_unit_test(test_usage_and_help),
    };
    return cmocka_run_group_tests(tests, start_daemon, stop_daemon);
}
