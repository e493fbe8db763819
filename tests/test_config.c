/*
 * test_config.c - daemon/config.c: the built-in default, files on top of it,
 * overrides, and every kind of bad value refused with FILE:LINE:COLUMN and a
 * reason; daemon/layer.c's loading of config layers from safetensors files.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "layer.h"
#include "safetensors.h"

static char err[KD_CONFIG_ERR_MAX];

/* Loads YAML text named "t.yaml" over the built-in default. */
static int load(kd_config *c, const char *text)
{
    return kd_config_load_text(c, "t.yaml", text, strlen(text), err, sizeof(err));
}

/* The text must be refused with exactly this message. */
static void refused(const char *text, const char *message)
{
    kd_config c;
    if (load(&c, text) == 0) {
        kd_config_free(&c);
        fail_msg("accepted: %s", text);
    }
    if (strcmp(err, message) != 0)
        fail_msg("for %s\n expected: %s\n got:      %s", text, message, err);
}

/* The built-in config/kdad.yaml carries the defaults that defaults.h names. */
static void test_builtin_default(void **unused)
{
    kd_config c;
    assert_int_equal(kd_config_load(&c, NULL, NULL, err, sizeof(err)), 0);
    assert_int_equal(c.backend, KD_BACKEND_AUTO);
    assert_int_equal(c.cuda_completion, KD_CUDA_COMPLETION_POLL);
    assert_true(c.cuda_split_scratch == KD_DEFAULT_CUDA_SPLIT_SCRATCH);
    assert_int_equal(c.heads, KD_DEFAULT_HEADS);
    assert_int_equal(c.slots, KD_DEFAULT_SLOTS);
    assert_int_equal(c.state_dtype, KP_DTYPE_F32);
    assert_false(c.slots_persist);
    assert_int_equal(c.socket_mode, 0660);
    assert_string_equal(c.socket_path, "");
    assert_int_equal(c.nallowed_uids + c.nallowed_gids, 0);
    kp_limits def;
    kp_limits_default(&def);
    assert_int_equal(c.limits.max_frame_bytes, def.max_frame_bytes);
    assert_int_equal(c.limits.max_inline_bytes, def.max_inline_bytes);
    assert_int_equal(c.limits.max_batch_tokens, def.max_batch_tokens);
    assert_int_equal(c.limits.max_batch_seqs, def.max_batch_seqs);
    assert_int_equal(c.limits.max_seqs_per_request, def.max_seqs_per_request);
    assert_int_equal(c.limits.max_slots_per_client, def.max_slots_per_client);
    assert_int_equal(c.limits.max_regions_per_client, def.max_regions_per_client);
    assert_int_equal(c.limits.max_inflight_requests, def.max_inflight_requests);
    assert_int_equal(c.limits.max_inflight_bytes, def.max_inflight_bytes);
    assert_int_equal(c.limits.max_layers, def.max_layers);
    assert_int_equal(c.ngraph_buckets, 0);
    assert_int_equal(c.max_queued_requests, KD_DEFAULT_MAX_QUEUED_REQUESTS);
    assert_int_equal(c.spin_us, KD_DEFAULT_SPIN_US);
    assert_true(c.hold_while_busy);
    assert_int_equal(c.hold_fill_percent, KD_DEFAULT_HOLD_FILL_PERCENT);
    assert_int_equal(c.hold_max_us, KD_DEFAULT_HOLD_MAX_US);
    assert_int_equal(c.gather_us, KD_DEFAULT_GATHER_US);
    assert_int_equal(c.gather_wave_percent, KD_DEFAULT_GATHER_WAVE_PERCENT);
    assert_int_equal(c.ready_spin_us, KD_DEFAULT_READY_SPIN_US);
    assert_int_equal(c.ready_timeout_ms, KD_DEFAULT_READY_TIMEOUT_MS);
    assert_false(c.ready_on_device);
    assert_int_equal(c.max_connections, KD_DEFAULT_MAX_CONNECTIONS);
    assert_int_equal(c.max_connections_per_uid, KD_DEFAULT_MAX_CONNECTIONS_PER_UID);
    assert_int_equal(c.max_inflight_bytes_per_uid, KD_DEFAULT_MAX_INFLIGHT_BYTES_PER_UID);
    /* 0 in the file: half of the machine's memory */
    const uint64_t half_ram = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE) / 2;
    assert_true(c.max_inflight_bytes_total == half_ram);
    assert_int_equal(c.output_hard_limit, KD_DEFAULT_OUTPUT_HARD_LIMIT);
    assert_int_equal(c.output_soft_limit, KD_DEFAULT_OUTPUT_SOFT_LIMIT);
    assert_int_equal(c.output_soft_seconds, KD_DEFAULT_OUTPUT_SOFT_SECONDS);
    assert_true(c.max_output_bytes_per_uid == half_ram / 4);
    assert_true(c.max_output_bytes_total == half_ram / 2);
    assert_true(c.max_region_bytes_per_connection > 0 &&
                c.max_region_bytes_per_connection <= half_ram / 2);
    assert_true(c.max_region_bytes_per_uid == 2 * c.max_region_bytes_per_connection);
    assert_int_equal(c.frame_stall_seconds, KD_DEFAULT_FRAME_STALL_SECONDS);
    assert_int_equal(c.output_stall_seconds, KD_DEFAULT_OUTPUT_STALL_SECONDS);
    assert_true(c.transport_shm && c.transport_cuda_ipc);
    assert_int_equal(c.nlayers, 0);
    assert_int_equal(c.log_level, KD_LOG_INFO);
    assert_string_equal(c.prometheus_file, "");
    assert_int_equal(c.metrics_interval_ms, KD_DEFAULT_METRICS_INTERVAL_MS);
    assert_int_equal(c.drain_timeout_ms, KD_DEFAULT_DRAIN_TIMEOUT_MS);
    kd_config_free(&c);

    /* config/kdad.yaml documents every key (each appears as "key:") */
    static const char *const keys[] = {
        "socket:", "path:", "mode:", "group:", "access:", "allowed_uids:", "allowed_gids:",
        "backend:", "device:", "cuda_completion:", "cuda_split_scratch:", "cpu_threads:", "heads:", "slots:", "state_dtype:",
        "slots_persist:", "limits:", "max_frame_bytes:", "max_inline_bytes:",
        "max_batch_tokens:", "max_batch_seqs:", "max_seqs_per_request:",
        "max_slots_per_client:", "max_regions_per_client:", "max_inflight_requests:",
        "max_inflight_bytes:", "max_layers:", "batching:", "graph_buckets:",
        "max_queued_requests:", "spin_us:", "hold_while_busy:", "hold_fill_percent:",
        "hold_max_us:", "ready_on_device:", "clients:", "max_connections:", "max_connections_per_uid:",
        "max_inflight_bytes_per_uid:", "max_inflight_bytes_total:", "output_hard_limit:",
        "output_soft_limit:", "output_soft_seconds:", "max_output_bytes_per_uid:",
        "max_output_bytes_total:", "max_region_bytes_per_connection:", "max_region_bytes_per_uid:",
        "frame_stall_seconds:", "output_stall_seconds:", "transports:", "shm:", "cuda_ipc:",
        "layers:", "lower_bound:", "scale:", "A_log:", "dt_bias:", "file:", "log:", "level:",
        "metrics:", "prometheus_file:", "interval_ms:", "drain_timeout_ms:"};
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        if (!strstr(kd_builtin_config, keys[i]))
            fail_msg("config/kdad.yaml does not mention %s", keys[i]);
    }
}

static void test_file_over_default(void **unused)
{
    kd_config c;
    const char *text = "# a comment\n"
                       "heads: 8\n"
                       "state_dtype: bf16\n"
                       "cuda_completion: block\n"
                       "cuda_split_scratch: 0\n"
                       "slots_persist: true\n"
                       "socket:\n  path: /tmp/k.sock\n  mode: 0600\n"
                       "access:\n  allowed_uids: [0, 1000]\n  allowed_gids: [27]\n"
                       "limits:\n  max_frame_bytes: 64MiB\n  max_inline_bytes: 32MiB\n"
                       "  max_batch_seqs: 300\n  max_seqs_per_request: 100\n"
                       "batching:\n  graph_buckets: [1, 16, 512]\n  spin_us: 0\n"
                       "  hold_while_busy: false\n  hold_fill_percent: 100\n  hold_max_us: 250\n"
                       "clients:\n  output_hard_limit: 128MiB\n  output_soft_limit: 64MiB\n"
                       "log:\n  level: debug\n";
    if (load(&c, text) != 0)
        fail_msg("%s", err);
    assert_int_equal(c.heads, 8);
    assert_int_equal(c.state_dtype, KP_DTYPE_BF16);
    assert_int_equal(c.cuda_completion, KD_CUDA_COMPLETION_BLOCK);
    assert_true(c.cuda_split_scratch == 0);
    assert_true(c.slots_persist);
    assert_string_equal(c.socket_path, "/tmp/k.sock");
    assert_int_equal(c.socket_mode, 0600);
    assert_int_equal(c.nallowed_uids, 2);
    assert_int_equal(c.allowed_uids[1], 1000);
    assert_int_equal(c.nallowed_gids, 1);
    assert_int_equal(c.allowed_gids[0], 27);
    assert_int_equal(c.limits.max_frame_bytes, 64u << 20);
    assert_int_equal(c.limits.max_inline_bytes, 32u << 20);
    assert_int_equal(c.limits.max_batch_seqs, 300);
    assert_int_equal(c.ngraph_buckets, 3);
    assert_int_equal(c.graph_buckets[2], 512);
    assert_int_equal(c.spin_us, 0);
    assert_false(c.hold_while_busy);
    assert_int_equal(c.hold_fill_percent, 100);
    assert_int_equal(c.hold_max_us, 250);
    assert_int_equal(c.log_level, KD_LOG_DEBUG);
    /* untouched keys keep the default */
    assert_int_equal(c.slots, 256);
    assert_int_equal(c.limits.max_batch_tokens, 65536);
    kd_config_free(&c);

    /* an empty file (only comments) changes nothing */
    assert_int_equal(load(&c, "# nothing\n"), 0);
    assert_int_equal(c.heads, 96);
    kd_config_free(&c);
}

static void test_bad_values_name_the_place(void **unused)
{
    refused("heads: 8\nfoo: 1\n", "t.yaml:2:1: unknown key \"foo\"");
    refused("limits:\n  max_frame: 1\n", "t.yaml:2:3: unknown key \"limits.max_frame\"");
    refused("heads: [1]\n", "t.yaml:1:8: heads: expected a scalar, got a list");
    refused("limits: 5\n", "t.yaml:1:9: limits: expected a mapping, got a scalar");
    refused("heads: 200\n", "t.yaml:1:8: heads: 200 is outside [1, 128]");
    refused("heads: -1\n", "t.yaml:1:8: heads: \"-1\" is not a non-negative integer");
    refused("backend: gpu\n", "t.yaml:1:10: backend: \"gpu\" is not one of: auto, cpu, cuda");
    refused("cuda_completion: spin\n",
            "t.yaml:1:18: cuda_completion: \"spin\" is not one of: poll, block");
    refused("cuda_split_scratch: 65GiB\n",
            "t.yaml:1:21: cuda_split_scratch: 65GiB is outside [0, 68719476736]");
    refused("heads: 8\ncuda_split_scratch: 1001\n",
            "t.yaml:2:21: cuda_split_scratch: 1001 is odd: the scratch holds bf16 values of 2 bytes");
    refused("log:\n  level: loud\n",
            "t.yaml:2:10: log.level: \"loud\" is not one of: error, warning, notice, info, debug");
    refused("heads: 8\nheads: 9\n", "t.yaml:2:1: key \"heads\" given twice (first at line 1)");
    refused("limits:\n  max_frame_bytes: 12XB\n",
            "t.yaml:2:20: limits.max_frame_bytes: \"12XB\" is not a size (bytes, or a number "
            "with KiB, MiB or GiB)");
    refused("socket:\n  mode: 0999\n",
            "t.yaml:2:9: socket.mode: \"0999\" is not an octal permission mode like 0660");
    refused("slots_persist: yes\n", "t.yaml:1:16: slots_persist: \"yes\" is not true or false");
    refused("access:\n  allowed_uids: [0, 4294967295]\n",
            "t.yaml:2:21: access.allowed_uids: \"4294967295\" is not an integer in "
            "[0, 4294967294]");
    refused("access:\n  allowed_uids: [0, no-such-user.kdad]\n",
            "t.yaml:2:21: access.allowed_uids: no user \"no-such-user.kdad\" on this system");
    refused("access:\n  allowed_gids: [no-such-group.kdad]\n",
            "t.yaml:2:18: access.allowed_gids: no group \"no-such-group.kdad\" on this system");
    refused("clients:\n  max_inflight_bytes_total: 64MiB\n",
            "t.yaml:2:29: clients.max_inflight_bytes_total: 67108864 is below "
            "limits.max_frame_bytes 268435456: a frame of the largest size could never be "
            "admitted");
    refused("clients:\n  max_inflight_bytes_per_uid: 64MiB\n",
            "t.yaml:2:31: clients.max_inflight_bytes_per_uid: 67108864 is below "
            "limits.max_frame_bytes 268435456: a frame of the largest size could never be "
            "admitted");
    /* whole-config rules point at the key that breaks them */
    refused("limits:\n  max_inline_bytes: 300MiB\n",
            "t.yaml:2:21: limits.max_inline_bytes: 314572800 must be in [1, max_frame_bytes "
            "268435456]");
    refused("clients:\n  output_hard_limit: 1MiB\n",
            "t.yaml:2:22: clients.output_hard_limit: 1048576 is below limits.max_frame_bytes "
            "+ 4: one response could never be sent");
    refused("batching:\n  spin_us: 200000\n",
            "t.yaml:2:12: batching.spin_us: 200000 is outside [0, 100000]");
    refused("batching:\n  hold_fill_percent: 0\n",
            "t.yaml:2:22: batching.hold_fill_percent: 0 is outside [1, 100]");
    refused("batching:\n  hold_max_us: 0\n",
            "t.yaml:2:16: batching.hold_max_us: 0 is outside [1, 1000000]");
    refused("batching:\n  hold_while_busy: 1\n",
            "t.yaml:2:20: batching.hold_while_busy: \"1\" is not true or false");
    refused("batching:\n  graph_buckets: [1, 4, 2]\n",
            "t.yaml:2:18: batching.graph_buckets: buckets must be strictly increasing (2 after "
            "4)");
    refused("batching:\n  graph_buckets: [1, 2, 4]\n",
            "t.yaml:2:18: batching.graph_buckets: the largest bucket 4 is below "
            "limits.max_batch_seqs 256");
    /* layers */
    refused("layers:\n  - name: a\n    file: x.st\n",
            "t.yaml:2:5: layers[0]: missing key \"lower_bound\"");
    refused("layers:\n  - name: a b\n    file: x\n    lower_bound: -1\n",
            "t.yaml:2:11: layers[0].name: \"a b\" must be 1..64 bytes of [A-Za-z0-9._:/-]");
    refused("layers:\n  - name: a\n    file: x\n    lower_bound: 0\n",
            "t.yaml:4:18: layers[0].lower_bound: \"0\" is not a number in [-5, 0)");
    refused("layers:\n  - name: a\n    file: x\n    lower_bound: -1\n    colour: red\n",
            "t.yaml:5:5: layers[0]: unknown key \"colour\" (known: name, file, A_log, dt_bias, "
            "lower_bound, scale)");
    refused("layers:\n  - {name: a, file: x, lower_bound: -1}\n"
            "  - {name: a, file: y, lower_bound: -2}\n",
            "t.yaml:3:5: layers: layer \"a\" is defined twice (first at line 2)");
    /* per-uid bounds: within the daemon-wide ones; 0 sizes them from those */
    refused("limits:\n  max_layers: 10\n  max_layers_per_uid: 11\n",
            "t.yaml:3:23: limits.max_layers_per_uid: 11 is above limits.max_layers 10");
    refused("slots: 8\nlimits:\n  max_slots_per_uid: 9\n",
            "t.yaml:3:22: limits.max_slots_per_uid: 9 is above the pool's 8 slots");
    kd_config c;
    assert_int_equal(load(&c, "slots: 8\nlimits:\n  max_layers: 9\n"), 0);
    assert_int_equal(c.limits.max_layers_per_uid, 5);
    assert_int_equal(c.limits.max_slots_per_uid, 8);
    kd_config_free(&c);
    /* YAML itself */
    assert_int_equal(load(&c, "heads: [\n"), -1);
    assert_non_null(strstr(err, "t.yaml:2:1: YAML syntax:"));
}

/* elapsed wall time since *t0, in seconds */
static double since(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) + (double)(t.tv_nsec - t0->tv_nsec) / 1e9;
}

/* 100,000 nested flow collections (libyaml's scanner is quadratic in their
 * depth: minutes) are refused at once, at the first level too deep. */
static void test_deep_nesting_refused_quickly(void **unused)
{
    enum { LEVELS = 100000 };
    static const char *const open_close[][3] = {{"[", "]", "t.yaml:1:71"},
                                                 {"{a: ", "}", "t.yaml:1:260"}};
    for (size_t k = 0; k < 2; k++) {
        size_t lo = strlen(open_close[k][0]), lc = strlen(open_close[k][1]);
        char *text = malloc(7 + LEVELS * (lo + lc) + 3);
        size_t n = 0;
        memcpy(text, "heads: ", 7);
        n = 7;
        for (int i = 0; i < LEVELS; i++, n += lo)
            memcpy(text + n, open_close[k][0], lo);
        text[n++] = '1';
        for (int i = 0; i < LEVELS; i++, n += lc)
            memcpy(text + n, open_close[k][1], lc);
        text[n++] = '\n';
        text[n] = '\0';
        struct timespec t0;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        kd_config c;
        assert_int_equal(kd_config_load_text(&c, "t.yaml", text, n, err, sizeof(err)), -1);
        double took = since(&t0);
        free(text);
        char want[96];
        snprintf(want, sizeof(want), "%s: collections nested deeper than 64 levels",
                 open_close[k][2]);
        assert_string_equal(err, want);
        if (took > 1.0)
            fail_msg("refusing %d levels took %.2f s", LEVELS, took);
    }
}

static void test_overrides_and_files(void **unused)
{
    kd_config c;
    kd_config_overrides ov = {.backend = "cpu", .heads = "12", .state_dtype = "bf16",
                              .socket = "/tmp/o.sock", .slots = "9", .device = "1"};
    assert_int_equal(kd_config_load(&c, NULL, &ov, err, sizeof(err)), 0);
    assert_int_equal(c.backend, KD_BACKEND_CPU);
    assert_int_equal(c.heads, 12);
    assert_int_equal(c.slots, 9);
    assert_string_equal(c.device, "1");
    assert_int_equal(c.state_dtype, KP_DTYPE_BF16);
    assert_string_equal(c.socket_path, "/tmp/o.sock");
    kd_config_free(&c);

    /* device: an ordinal, a UUID or a prefix of one (the backend resolves it) */
    static const char *const devices[] = {"0", "1023", "GPU-5a1c0e1e-0000-1111-2222-333344445555",
                                          "GPU-5A1C", "GPU-5a1c0e1e-", "GPU-5"};
    for (size_t i = 0; i < sizeof(devices) / sizeof(devices[0]); i++) {
        kd_config_overrides d = {.device = devices[i]};
        assert_int_equal(kd_config_load(&c, NULL, &d, err, sizeof(err)), 0);
        assert_string_equal(c.device, devices[i]);
        kd_config_free(&c);
    }
    static const char *const bad_devices[] = {"1024", "-1", "GPU-", "gpu-5a1c", "GPU--5a",
                                              "GPU-xyz", "MIG-5a1c", "0x1", "1 ", "",
                                              "GPU-5a1c0e1e-0000-1111-2222-3333444455556"};
    for (size_t i = 0; i < sizeof(bad_devices) / sizeof(bad_devices[0]); i++) {
        kd_config_overrides d = {.device = bad_devices[i]};
        assert_int_equal(kd_config_load(&c, NULL, &d, err, sizeof(err)), -1);
        char want[256];
        snprintf(want, sizeof(want), "--device: \"%s\" is neither a CUDA ordinal in [0, 1023] "
                 "nor a GPU UUID (GPU-xxxxxxxx-xxxx-..., or a unique prefix of one)",
                 bad_devices[i]);
        assert_string_equal(err, want);
    }
    assert_int_equal(load(&c, "device: GPU-0a1b2c3d\n"), 0);
    assert_string_equal(c.device, "GPU-0a1b2c3d");
    kd_config_free(&c);

    kd_config_overrides bad = {.heads = "0"};
    assert_int_equal(kd_config_load(&c, NULL, &bad, err, sizeof(err)), -1);
    assert_string_equal(err, "--heads: 0 is outside [1, 128]");
    kd_config_overrides dtype = {.state_dtype = "f16"};
    assert_int_equal(kd_config_load(&c, NULL, &dtype, err, sizeof(err)), -1);
    assert_string_equal(err, "--state-dtype: \"f16\" is not one of: bf16, f32");

    assert_int_equal(kd_config_load(&c, "/nonexistent/kdad.yaml", NULL, err, sizeof(err)), -1);
    assert_string_equal(err, "/nonexistent/kdad.yaml: cannot open: No such file or directory");

    /* a real file: errors carry its path; overrides beat it */
    char path[] = "/tmp/kdad-config-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    const char text[] = "heads: 16\nslots: 0\n";
    assert_int_equal(write(fd, text, sizeof(text) - 1), (ssize_t)sizeof(text) - 1);
    close(fd);
    char want[128];
    snprintf(want, sizeof(want), "%s:2:8: slots: 0 is outside [1, 16777216]", path);
    assert_int_equal(kd_config_load(&c, path, NULL, err, sizeof(err)), -1);
    assert_string_equal(err, want);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("heads: 16\nslots: 7\n", f);
    fclose(f);
    kd_config_overrides slots = {.slots = "5"};
    assert_int_equal(kd_config_load(&c, path, &slots, err, sizeof(err)), 0);
    assert_int_equal(c.heads, 16);
    assert_int_equal(c.slots, 5);
    kd_config_free(&c);
    unlink(path);
}

static void test_default_socket_path(void **unused)
{
    kd_config c;
    char buf[256];
    assert_int_equal(kd_config_load(&c, NULL, NULL, err, sizeof(err)), 0);
    setenv("XDG_RUNTIME_DIR", "/run/user/1000", 1);
    assert_string_equal(kd_config_socket_path(&c, buf, sizeof(buf)), "/run/user/1000/kdad.sock");
    unsetenv("XDG_RUNTIME_DIR");
    assert_string_equal(kd_config_socket_path(&c, buf, sizeof(buf)), "/run/kdad/kdad.sock");
    kd_config_free(&c);
}

static void write_weights(const char *path, int64_t heads, const char *a_name, float poison)
{
    float a[16], dt[16 * 128];
    for (int i = 0; i < 16; i++)
        a[i] = 0.5f;
    for (int i = 0; i < 16 * 128; i++)
        dt[i] = 0.25f;
    dt[7] = poison;
    const int64_t a_shape[1] = {heads}, dt_shape[2] = {heads, 128};
    st_writer *w = st_writer_new();
    assert_int_equal(st_writer_add(w, a_name, ST_F32, 1, a_shape, a), 0);
    assert_int_equal(st_writer_add(w, "dt_bias", ST_F32, 2, dt_shape, dt), 0);
    char e[256];
    assert_int_equal(st_writer_write(w, path, e, sizeof(e)), 0);
    st_writer_free(w);
}

static void test_layer_files(void **unused)
{
    char dir[] = "/tmp/kdad-layerconf-XXXXXX", path[128], yaml[512];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/w.safetensors", dir);
    kd_config c;
    float *a, *dt;

    write_weights(path, 4, "alog", 0.25f);
    snprintf(yaml, sizeof(yaml), "heads: 4\nlayers:\n  - name: L\n    file: %s\n"
             "    A_log: alog\n    lower_bound: -2.5\n    scale: 0.5\n", path);
    assert_int_equal(load(&c, yaml), 0);
    assert_int_equal(c.nlayers, 1);
    assert_string_equal(c.layers[0].a_log_tensor, "alog");
    assert_string_equal(c.layers[0].dt_bias_tensor, "dt_bias"); /* the default name */
    assert_true(c.layers[0].lower_bound == -2.5f && c.layers[0].scale == 0.5f);
    if (kd_layer_conf_load(&c.layers[0], 0, 4, &a, &dt, err, sizeof(err)) != 0)
        fail_msg("%s", err);
    assert_true(a[3] == 0.5f && dt[4 * 128 - 1] == 0.25f);
    free(a);
    free(dt);
    /* the wrong number of heads */
    assert_int_equal(kd_layer_conf_load(&c.layers[0], 0, 8, &a, &dt, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "t.yaml:4:11: layers[0].file: "));
    assert_non_null(strstr(err, "heads is 8"));
    kd_config_free(&c);

    /* a tensor that is not in the file, a NaN weight, a missing file */
    snprintf(yaml, sizeof(yaml), "heads: 4\nlayers:\n  - name: L\n    file: %s\n"
             "    lower_bound: -1\n", path);
    assert_int_equal(load(&c, yaml), 0);
    assert_int_equal(kd_layer_conf_load(&c.layers[0], 0, 4, &a, &dt, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "A_log"));
    kd_config_free(&c);
    write_weights(path, 4, "A_log", NAN);
    assert_int_equal(load(&c, yaml), 0);
    assert_int_equal(kd_layer_conf_load(&c.layers[0], 0, 4, &a, &dt, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "dt_bias[7] is nan: weights must be finite"));
    kd_config_free(&c);
    unlink(path);
    assert_int_equal(load(&c, yaml), 0);
    assert_int_equal(kd_layer_conf_load(&c.layers[0], 0, 4, &a, &dt, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "t.yaml:4:11: layers[0].file: "));
    kd_config_free(&c);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_builtin_default),
        cmocka_unit_test(test_file_over_default),
        cmocka_unit_test(test_bad_values_name_the_place),
        cmocka_unit_test(test_deep_nesting_refused_quickly),
        cmocka_unit_test(test_overrides_and_files),
        cmocka_unit_test(test_default_socket_path),
        cmocka_unit_test(test_layer_files),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
