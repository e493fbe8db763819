/*
 * test_client_conn.c - libkdaclient's connection (client.c, errors.c):
 * finding the socket, connecting, the hello handshake and what it reports,
 * a daemon that is not running, one that speaks another protocol version or
 * no kdad protocol at all, one that never answers, and the error table.
 * The daemon is the in-process fake (fake_kdad.h).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>

#include "fake_kdad.h"
#include "kdaclient.h"

static int open_at(const char *path, int timeout_ms, kdac_client **c, kdac_error *err)
{
    kdac_options o;
    kdac_options_init(&o);
    o.socket_path = path;
    o.timeout_ms = timeout_ms;
    o.client_name = "test_client_conn";
    return kdac_client_open(c, &o, err);
}

static void assert_contains(const char *text, const char *part)
{
    if (!strstr(text, part))
        fail_msg("\"%s\" lacks \"%s\"", text, part);
}

/* ---------------------------------------------------------------------- */

static void script_hello_then_eof(fake_conn *fc, void *arg)
{
    fake_hello(fc);
    fake_wait_eof(fc);
}

static void configure_gpu(kp_hello_result *h)
{
    h->backend = KP_BACKEND_CUDA;
    h->has_gpu = true;
    h->gpu.name = "NVIDIA H200";
    h->gpu.uuid = "GPU-5a1c0e1e-0000-1111-2222-333344445555";
    h->gpu.index = 3;
    h->geometry.heads = 96;
    h->geometry.slots = 4096;
    h->geometry.state_dtype = KP_DTYPE_BF16;
    h->transports = KP_TRANSPORT_INLINE | KP_TRANSPORT_SHM | KP_TRANSPORT_CUDA_IPC;
    h->slots_persist = true;
    h->limits.max_batch_tokens = 32768;
    h->limits.max_slots_per_uid = 2048;
    h->limits.has_clients = true;
    h->limits.clients = (kp_client_bounds){
        .max_connections = 100, .max_connections_per_uid = 8,
        .max_inflight_bytes_per_uid = 3ull << 30, .max_inflight_bytes_total = 6ull << 30,
        .output_hard_limit = 1u << 30, .output_soft_limit = 1u << 29, .output_soft_seconds = 10,
        .max_output_bytes_per_uid = 2ull << 30, .max_output_bytes_total = 4ull << 30,
        .max_region_bytes_per_connection = 5ull << 30, .max_region_bytes_per_uid = 7ull << 30,
        .frame_stall_seconds = 30, .output_stall_seconds = 31};
    static const char *const features[] = {"future.thing"};
    h->features = features;
    h->nfeatures = 1;
}

/* Everything hello announced reaches kdac_client_info. */
static void test_hello_info(void **state)
{
    fake_server *s = fake_start_with(script_hello_then_eof, NULL, configure_gpu);
    kdac_client *c;
    kdac_error err;
    assert_int_equal(open_at(fake_path(s), 0, &c, &err), KDAC_OK);
    const kdac_server_info *i = kdac_client_info(c);
    assert_int_equal(i->version, 1);
    assert_string_equal(i->server, "fake-kdad 0.0");
    assert_int_equal(i->instance, 0x1234abcdull);
    assert_string_equal(i->backend, "cuda");
    assert_true(i->has_gpu);
    assert_string_equal(i->gpu_name, "NVIDIA H200");
    assert_string_equal(i->gpu_uuid, "GPU-5a1c0e1e-0000-1111-2222-333344445555");
    assert_int_equal(i->gpu_index, 3);
    assert_int_equal(i->heads, 96);
    assert_int_equal(i->slots, 4096);
    assert_int_equal(i->state_dtype, KDAC_DTYPE_BF16);
    assert_int_equal(i->transports,
                     KDAC_TRANSPORT_INLINE | KDAC_TRANSPORT_SHM | KDAC_TRANSPORT_CUDA_IPC);
    assert_true(i->slots_persist);
    assert_int_equal(i->nfeatures, 1);
    assert_string_equal(i->features[0], "future.thing");
    assert_int_equal(i->limits.max_batch_tokens, 32768);
    assert_int_equal(i->limits.max_frame_bytes, KP_DEFAULT_MAX_FRAME_BYTES);
    assert_int_equal(i->limits.max_inflight_bytes, KP_DEFAULT_MAX_INFLIGHT_BYTES);
    assert_int_equal(i->bounds.max_slots_per_uid, 2048);
    assert_true(i->has_bounds);
    assert_int_equal(i->bounds.max_connections, 100);
    assert_int_equal(i->bounds.max_connections_per_uid, 8);
    assert_int_equal(i->bounds.max_inflight_bytes_per_uid, 3ull << 30);
    assert_int_equal(i->bounds.max_inflight_bytes_total, 6ull << 30);
    assert_int_equal(i->bounds.output_hard_limit, 1u << 30);
    assert_int_equal(i->bounds.output_soft_limit, 1u << 29);
    assert_int_equal(i->bounds.output_soft_seconds, 10);
    assert_int_equal(i->bounds.max_output_bytes_per_uid, 2ull << 30);
    assert_int_equal(i->bounds.max_output_bytes_total, 4ull << 30);
    assert_int_equal(i->bounds.max_region_bytes_per_connection, 5ull << 30);
    assert_int_equal(i->bounds.max_region_bytes_per_uid, 7ull << 30);
    assert_int_equal(i->bounds.frame_stall_seconds, 30);
    assert_int_equal(i->bounds.output_stall_seconds, 31);
    assert_string_equal(kdac_client_path(c), fake_path(s));
    assert_true(kdac_client_fd(c) >= 0);
    assert_int_equal(kdac_client_events(c), KDAC_READABLE);
    assert_int_equal(kdac_client_close(c), KDAC_OK);
    assert_int_equal(fake_stop(s), 0);
}

/* No socket file, and a socket file nobody listens on: "not running". */
static void test_not_running(void **state)
{
    char dir[] = "/tmp/kdac-test-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[64];
    snprintf(path, sizeof(path), "%s/kdad.sock", dir);
    kdac_client *c = (kdac_client *)&c;
    kdac_error err;
    assert_int_equal(open_at(path, 0, &c, &err), KDAC_E_NOT_RUNNING);
    assert_null(c);
    assert_int_equal(err.code, KDAC_E_NOT_RUNNING);
    assert_true(err.retryable);
    assert_contains(err.message, "daemon not running");
    assert_contains(err.message, path);

    /* A stale socket: bound, then its listener gone. */
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
    assert_int_equal(bind(fd, (struct sockaddr *)&addr, sizeof(addr)), 0);
    close(fd);
    assert_int_equal(open_at(path, 0, &c, &err), KDAC_E_NOT_RUNNING);
    assert_contains(err.message, "nothing listens");
    unlink(path);
    rmdir(dir);
}

static void script_unsupported(fake_conn *fc, void *arg)
{
    uint32_t id = fake_expect(fc, KP_METHOD_HELLO);
    fake_send_error(fc, id, KP_E_UNSUPPORTED_VERSION,
                    "versions: the client speaks [1]; this daemon speaks [2]");
    fake_send_goodbye(fc, KP_E_UNSUPPORTED_VERSION, "no protocol version in common");
}

/* A daemon of another protocol version: its message reaches the caller. */
static void test_version_mismatch(void **state)
{
    fake_server *s = fake_start(script_unsupported, NULL);
    kdac_client *c;
    kdac_error err;
    assert_int_equal(open_at(fake_path(s), 0, &c, &err), KDAC_E_UNSUPPORTED_VERSION);
    assert_null(c);
    assert_contains(err.message, "this daemon speaks [2]");
    assert_string_equal(kdac_err_name(err.code), "UNSUPPORTED_VERSION");
    assert_int_equal(fake_stop(s), 0);
}

static void script_http(fake_conn *fc, void *arg)
{
    fake_read(fc); /* the hello; not checked */
    static const char reply[] = "HTTP/1.1 400 Bad Request\r\n\r\n";
    fake_send_raw(fc, reply, sizeof(reply) - 1);
    fake_wait_eof(fc);
}

static void script_nil_body(fake_conn *fc, void *arg)
{
    fake_read(fc);
    static const uint8_t nil_frame[] = {0, 0, 0, 1, 0xc0};
    fake_send_raw(fc, nil_frame, sizeof(nil_frame));
    fake_wait_eof(fc);
}

/* Something that answers, but not in the kdad protocol: a clear PROTOCOL
 * error whether its bytes look like a huge frame or a well-framed non-RPC
 * object. */
static void test_not_kdad(void **state)
{
    fake_script scripts[] = {script_http, script_nil_body};
    const char *why[] = {"exceeds the cap", "expected an array"};
    for (int i = 0; i < 2; i++) {
        fake_server *s = fake_start(scripts[i], NULL);
        kdac_client *c;
        kdac_error err;
        assert_int_equal(open_at(fake_path(s), 5000, &c, &err), KDAC_E_PROTOCOL);
        assert_contains(err.message, "does not speak the kdad protocol");
        assert_contains(err.message, why[i]);
        assert_int_equal(fake_stop(s), 0);
    }
}

static void script_silent(fake_conn *fc, void *arg)
{
    fake_read(fc);
    fake_wait_eof(fc);
}

/* A peer that never answers: open gives up after timeout_ms. */
static void test_hello_timeout(void **state)
{
    fake_server *s = fake_start(script_silent, NULL);
    kdac_client *c;
    kdac_error err;
    assert_int_equal(open_at(fake_path(s), 150, &c, &err), KDAC_E_TIMEOUT);
    assert_contains(err.message, "150 ms");
    assert_int_equal(fake_stop(s), 0);
}

/* A daemon that refuses this uid: goodbye PERMISSION_DENIED instead of hello. */
static void script_refuse(fake_conn *fc, void *arg)
{
    fake_send_goodbye(fc, KP_E_PERMISSION_DENIED, "uid 1000 is not allowed to connect");
}

static void test_permission_denied(void **state)
{
    fake_server *s = fake_start(script_refuse, NULL);
    kdac_client *c;
    kdac_error err;
    assert_int_equal(open_at(fake_path(s), 5000, &c, &err), KDAC_E_PERMISSION_DENIED);
    assert_contains(err.message, "uid 1000 is not allowed");
    assert_int_equal(fake_stop(s), 0);
}

/* $KDAD_SOCKET, then $XDG_RUNTIME_DIR/kdad.sock if it exists, then /run/kdad. */
static void test_default_socket(void **state)
{
    char buf[KDAC_PATH_MAX];
    char dir[] = "/tmp/kdac-test-XXXXXX";
    assert_non_null(mkdtemp(dir));
    setenv("KDAD_SOCKET", "/somewhere/k.sock", 1);
    assert_int_equal(kdac_socket_default(buf, sizeof(buf)), KDAC_OK);
    assert_string_equal(buf, "/somewhere/k.sock");
    unsetenv("KDAD_SOCKET");
    setenv("XDG_RUNTIME_DIR", dir, 1);
    assert_int_equal(kdac_socket_default(buf, sizeof(buf)), KDAC_OK);
    assert_string_equal(buf, KDAC_SYSTEM_SOCKET); /* no user instance there */
    char user[128];
    snprintf(user, sizeof(user), "%s/kdad.sock", dir);
    FILE *f = fopen(user, "w");
    fclose(f);
    assert_int_equal(kdac_socket_default(buf, sizeof(buf)), KDAC_OK);
    assert_string_equal(buf, user);
    assert_int_equal(kdac_socket_default(buf, 8), KDAC_E_INVALID_ARGUMENT);
    unlink(user);
    rmdir(dir);
    unsetenv("XDG_RUNTIME_DIR");

    /* open() without a path follows $KDAD_SOCKET. */
    fake_server *s = fake_start(script_hello_then_eof, NULL);
    setenv("KDAD_SOCKET", fake_path(s), 1);
    kdac_client *c;
    assert_int_equal(kdac_client_open(&c, NULL, NULL), KDAC_OK);
    assert_string_equal(kdac_client_path(c), fake_path(s));
    kdac_client_close(c);
    unsetenv("KDAD_SOCKET");
    assert_int_equal(fake_stop(s), 0);
}

/* One kdad per GPU: kdad-N.sock in $XDG_RUNTIME_DIR if it exists, else in /run/kdad;
 * $KDAD_GPU picks it for the default rule, below $KDAD_SOCKET. */
static void test_socket_for_gpu(void **state)
{
    char buf[KDAC_PATH_MAX];
    char dir[] = "/tmp/kdac-test-XXXXXX";
    assert_non_null(mkdtemp(dir));
    unsetenv("XDG_RUNTIME_DIR");
    assert_int_equal(kdac_socket_for_gpu("1", buf, sizeof(buf)), KDAC_OK);
    assert_string_equal(buf, "/run/kdad/kdad-1.sock");
    const char *uuid = "GPU-5a1c0e1e-0000-1111-2222-333344445555";
    assert_int_equal(kdac_socket_for_gpu(uuid, buf, sizeof(buf)), KDAC_OK);
    assert_string_equal(buf, "/run/kdad/kdad-GPU-5a1c0e1e-0000-1111-2222-333344445555.sock");
    static const char *const bad[] = {"", "../x", "1/2", "a b", "1.sock",
        "0123456789012345678901234567890123456789012345678901234567890123456789"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(kdac_socket_for_gpu(bad[i], buf, sizeof(buf)), KDAC_E_INVALID_ARGUMENT);
    assert_int_equal(kdac_socket_for_gpu(NULL, buf, sizeof(buf)), KDAC_E_INVALID_ARGUMENT);
    assert_int_equal(kdac_socket_for_gpu("1", buf, 16), KDAC_E_INVALID_ARGUMENT);

    /* a user instance: its socket exists under $XDG_RUNTIME_DIR */
    setenv("XDG_RUNTIME_DIR", dir, 1);
    char user[128];
    snprintf(user, sizeof(user), "%s/kdad-1.sock", dir);
    assert_int_equal(kdac_socket_for_gpu("1", buf, sizeof(buf)), KDAC_OK);
    assert_string_equal(buf, "/run/kdad/kdad-1.sock");
    FILE *f = fopen(user, "w");
    fclose(f);
    assert_int_equal(kdac_socket_for_gpu("1", buf, sizeof(buf)), KDAC_OK);
    assert_string_equal(buf, user);
    assert_int_equal(kdac_socket_for_gpu("0", buf, sizeof(buf)), KDAC_OK);
    assert_string_equal(buf, "/run/kdad/kdad-0.sock");

    /* the default rule: $KDAD_SOCKET, then $KDAD_GPU, then kdad.sock */
    setenv("KDAD_GPU", "1", 1);
    assert_int_equal(kdac_socket_default(buf, sizeof(buf)), KDAC_OK);
    assert_string_equal(buf, user);
    setenv("KDAD_SOCKET", "/somewhere/k.sock", 1);
    assert_int_equal(kdac_socket_default(buf, sizeof(buf)), KDAC_OK);
    assert_string_equal(buf, "/somewhere/k.sock");
    unsetenv("KDAD_SOCKET");
    setenv("KDAD_GPU", "../etc", 1);
    assert_int_equal(kdac_socket_default(buf, sizeof(buf)), KDAC_E_INVALID_ARGUMENT);
    kdac_client *c = NULL;
    kdac_error err;
    assert_int_equal(kdac_client_open(&c, NULL, &err), KDAC_E_INVALID_ARGUMENT);
    assert_contains(err.message, "KDAD_GPU");
    unsetenv("KDAD_GPU");
    unlink(user);
    rmdir(dir);
    unsetenv("XDG_RUNTIME_DIR");
}

static void test_bad_options(void **state)
{
    kdac_options o;
    kdac_options_init(&o);
    kdac_error err;
    kdac_client *c;
    char longpath[200];
    memset(longpath, 'a', sizeof(longpath) - 1);
    longpath[sizeof(longpath) - 1] = 0;
    o.socket_path = longpath;
    assert_int_equal(kdac_client_open(&c, &o, &err), KDAC_E_INVALID_ARGUMENT);
    assert_contains(err.message, "socket path longer");
    o.socket_path = "/tmp/x";
    o.timeout_ms = -1;
    assert_int_equal(kdac_client_open(&c, &o, &err), KDAC_E_INVALID_ARGUMENT);
    assert_int_equal(kdac_client_open(NULL, NULL, &err), KDAC_E_INVALID_ARGUMENT);
    assert_int_equal(kdac_client_close(NULL), KDAC_OK);
}

/* The table: wire codes equal PROTOCOL.md's, names and flags as documented. */
static void test_error_table(void **state)
{
    assert_string_equal(kdac_err_name(0), "OK");
    assert_string_equal(kdac_strerror(0), "success");
#define CHECK_ROW(name, code, retryable, message)                  \
    assert_string_equal(kdac_err_name(code), #name);              \
    assert_string_equal(kdac_strerror(code), message);            \
    assert_int_equal(kdac_err_retryable(code), retryable);
    KDAC_ERRORS(CHECK_ROW)
#undef CHECK_ROW
    /* Every wire code of the codec's table is in the client's, unchanged. */
#define CHECK_WIRE(name, code, retryable, closes, message)         \
    assert_string_equal(kdac_err_name(code), #name);              \
    assert_int_equal(kdac_err_retryable(code), retryable);
    KP_ERRORS(CHECK_WIRE)
#undef CHECK_WIRE
    assert_int_equal(KDAC_E_POSITION_MISMATCH, -17);
    assert_int_equal(KDAC_E_NOT_RUNNING, -100);
    assert_string_equal(kdac_err_name(-77), "UNKNOWN_CODE");
    assert_string_equal(kdac_strerror(-77), "unknown error code");
    assert_false(kdac_err_retryable(-77));
    assert_int_equal(kdac_version(), KDAC_VERSION_HEX);
    assert_string_equal(kdac_version_string(), KDAD_VERSION);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello_info),        cmocka_unit_test(test_not_running),
        cmocka_unit_test(test_version_mismatch),  cmocka_unit_test(test_not_kdad),
        cmocka_unit_test(test_hello_timeout),     cmocka_unit_test(test_permission_denied),
        cmocka_unit_test(test_default_socket),
        cmocka_unit_test(test_socket_for_gpu),    cmocka_unit_test(test_bad_options),
        cmocka_unit_test(test_error_table),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
