/*
 * daemon_harness.c - see daemon_harness.h.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include "daemon_harness.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bf16.h"
#include "kda_ref.h"

extern char **environ;

#define START_WAIT_MS 30000
#define RECV_WAIT_MS 120000
#define EXIT_WAIT_MS 60000

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ---------------------------------------------------------------------- */
/* The daemon process                                                     */
/* ---------------------------------------------------------------------- */

char *dh_log(const dh_daemon *d)
{
    FILE *f = fopen(d->log, "rb");
    if (!f)
        return strdup("(no log)");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    size_t got = fread(s, 1, (size_t)n, f);
    s[got] = '\0';
    fclose(f);
    return s;
}

static void print_log(const dh_daemon *d)
{
    char *log = dh_log(d);
    fprintf(stderr, "---- kdad log (%s) ----\n%s---- end of log ----\n", d->log, log);
    free(log);
}

void dh_write_config(const dh_daemon *d, const char *yaml)
{
    char tmp[160];
    snprintf(tmp, sizeof(tmp), "%s.tmp", d->config);
    FILE *f = fopen(tmp, "w");
    assert_non_null(f);
    fputs(yaml ? yaml : "", f);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(rename(tmp, d->config), 0);
}

static bool socket_accepts(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

/* The daemon of the running test, killed by dh_teardown if the test fails. */
static pid_t running_pid;

int dh_teardown(void **state)
{
    if (running_pid > 0) {
        kill(running_pid, SIGKILL);
        waitpid(running_pid, NULL, 0);
        running_pid = 0;
    }
    return 0;
}

int dh_backend_available(const char *yaml)
{
    dh_daemon d;
    if (dh_start(&d, yaml) == 77)
        return 77;
    dh_stop(&d);
    return 0;
}

void dh_spawn(dh_daemon *d, const char *yaml)
{
    memset(d, 0, sizeof(*d));
    snprintf(d->dir, sizeof(d->dir), "/tmp/kdad-test-XXXXXX");
    assert_non_null(mkdtemp(d->dir));
    snprintf(d->sock, sizeof(d->sock), "%s/kdad.sock", d->dir);
    snprintf(d->config, sizeof(d->config), "%s/kdad.yaml", d->dir);
    snprintf(d->log, sizeof(d->log), "%s/kdad.log", d->dir);
    dh_write_config(d, yaml);

    char exe[512];
    snprintf(exe, sizeof(exe), "%s/daemon/kdad", KDAD_BUILD_DIR);
    char *argv[] = {exe, "--config", d->config, "--socket", d->sock, "--backend", DH_BACKEND,
                    NULL};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, d->log, O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
    int rc = posix_spawn(&d->pid, exe, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    assert_int_equal(rc, 0);
    running_pid = d->pid;
}

bool dh_accepts(const dh_daemon *d)
{
    return socket_accepts(d->sock);
}

int dh_start(dh_daemon *d, const char *yaml)
{
    dh_spawn(d, yaml);
    double deadline = now_ms() + START_WAIT_MS;
    while (now_ms() < deadline) {
        int status;
        if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
            d->pid = running_pid = 0;
            if (WIFEXITED(status) && WEXITSTATUS(status) == 69) {
                char *log = dh_log(d);
                fprintf(stderr, "skipped: backend %s is not available here: %s", DH_BACKEND,
                        log);
                free(log);
                return 77;
            }
            print_log(d);
            fail_msg("kdad exited during start-up (status 0x%x)", status);
        }
        if (socket_accepts(d->sock))
            return 0;
        usleep(20000);
    }
    print_log(d);
    fail_msg("kdad did not start listening within %d ms", START_WAIT_MS);
    return -1;
}

void dh_start_or_skip(dh_daemon *d, const char *yaml)
{
    if (dh_start(d, yaml) == 77)
        skip();
}

int dh_signal_wait(dh_daemon *d, int sig)
{
    if (d->pid <= 0)
        return -1;
    if (sig)
        kill(d->pid, sig);
    double deadline = now_ms() + EXIT_WAIT_MS;
    int status;
    while (now_ms() < deadline) {
        pid_t got = waitpid(d->pid, &status, WNOHANG);
        if (got == d->pid) {
            d->pid = running_pid = 0;
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
                print_log(d);
            return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        }
        usleep(10000);
    }
    kill(d->pid, SIGKILL);
    waitpid(d->pid, &status, 0);
    d->pid = running_pid = 0;
    print_log(d);
    return -1;
}

static void remove_folder(dh_daemon *d)
{
    char path[160];
    const char *files[] = {d->config, d->log, d->sock};
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++)
        unlink(files[i]);
    snprintf(path, sizeof(path), "%s.tmp", d->config);
    unlink(path);
    rmdir(d->dir);
}

void dh_stop(dh_daemon *d)
{
    assert_int_equal(dh_signal_wait(d, SIGTERM), 0);
    remove_folder(d);
}

void dh_expect_exit(dh_daemon *d, int code)
{
    assert_int_equal(dh_signal_wait(d, 0), code);
    remove_folder(d);
}

/* ---------------------------------------------------------------------- */
/* Workloads and the oracle                                               */
/* ---------------------------------------------------------------------- */

void dh_seq_make(dh_seq *s, test_rng *r, uint32_t len)
{
    size_t tok = (size_t)len * DH_HEADS * 128 + 1, beta = (size_t)len * DH_HEADS + 1;
    s->len = len;
    s->q = malloc(tok * 2);
    s->k = malloc(tok * 2);
    s->v = malloc(tok * 2);
    s->g = malloc(tok * 2);
    s->beta = malloc(beta * 2);
    assert_true(s->q && s->k && s->v && s->g && s->beta);
    fill_normal_bf16(r, s->q, tok, 0, 1);
    fill_normal_bf16(r, s->k, tok, 0, 1);
    fill_normal_bf16(r, s->v, tok, 0, 1);
    fill_normal_bf16(r, s->g, tok, 0, 1);
    fill_normal_bf16(r, s->beta, beta, 0, 1);
}

void dh_seq_free(dh_seq *s)
{
    free(s->q);
    free(s->k);
    free(s->v);
    free(s->g);
    free(s->beta);
    memset(s, 0, sizeof(*s));
}

dh_seq dh_seq_slice(const dh_seq *s, uint32_t from, uint32_t len)
{
    size_t t = (size_t)from * DH_HEADS * 128, b = (size_t)from * DH_HEADS;
    return (dh_seq){len, s->q + t, s->k + t, s->v + t, s->g + t, s->beta + b};
}

void dh_layer_make(dh_layer *l, test_rng *r)
{
    for (int h = 0; h < DH_HEADS; h++)
        l->A_log[h] = (float)rng_uniform(r);
    for (int i = 0; i < DH_HEADS * 128; i++)
        l->dt_bias[i] = (float)rng_uniform(r);
    l->lower_bound = -5.0f;
    l->scale = KP_DEFAULT_SCALE;
}

void dh_oracle(const dh_layer *l, const dh_seq *s, double *state, double *out)
{
    kda_layer kl = {l->A_log, l->dt_bias, l->lower_bound, l->scale};
    kda_ref_sequence(DH_HEADS, &kl, s->q, s->k, s->v, s->g, s->beta, s->len, state, out);
}

double dh_err_bf16(const uint16_t *x, const double *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = kda_bf16_to_f32(x[i]) - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

double dh_err_f32(const float *x, const double *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = x[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* ---------------------------------------------------------------------- */
/* Client                                                                 */
/* ---------------------------------------------------------------------- */

void dh_connect(dh_client *c, const dh_daemon *d)
{
    memset(c, 0, sizeof(*c));
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(c->fd >= 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", d->sock);
    assert_int_equal(connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    kp_reader_init(&c->reader, UINT32_MAX);
    assert_int_equal(kp_writer_init(&c->w, UINT32_MAX), KP_OK);
    kp_msg_init(&c->msg);
    c->next_id = 1;
}

void dh_close(dh_client *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    kp_reader_close(&c->reader);
    kp_writer_close(&c->w);
    kp_msg_close(&c->msg);
    free(c->body);
    c->body = NULL;
    for (int i = 0; i < c->nheld; i++)
        free(c->held[i].body);
    c->nheld = 0;
}

uint32_t dh_id(dh_client *c)
{
    return c->next_id++;
}

/* Waits (at most RECV_WAIT_MS) for the socket to be readable: a doorbell,
 * a frame, or EOF. */
static void wait_socket(dh_client *c, double deadline)
{
    struct pollfd p = {c->fd, POLLIN, 0};
    int left = (int)(deadline - now_ms());
    if (left <= 0 || poll(&p, 1, left) != 1)
        fail_msg("nothing from kdad within %d ms", RECV_WAIT_MS);
}

/* Reads pending doorbells; false at EOF. */
static bool drain_doorbells(dh_client *c)
{
    uint8_t bells[64];
    for (;;) {
        ssize_t n = recv(c->fd, bells, sizeof(bells), MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno == ECONNRESET))
            return false;
        if (n < 0)
            return true;
    }
}

static void ring_write(dh_client *c, const uint8_t *p, size_t n)
{
    double deadline = now_ms() + RECV_WAIT_MS;
    while (n > 0) {
        struct iovec v = {(void *)p, n};
        size_t put;
        kp_ring_set_wants(c->ring, KP_RING_WANT_DATA | KP_RING_WANT_SPACE);
        assert_int_equal(kp_ring_writev(c->ring, &v, 1, &put, NULL), KP_OK);
        if (put > 0) {
            static const uint8_t bell = 0;
            assert_int_equal(send(c->fd, &bell, 1, MSG_NOSIGNAL), 1);
            p += put;
            n -= put;
        } else if (!kp_ring_writable(c->ring)) {
            wait_socket(c, deadline);
            assert_true(drain_doorbells(c));
        }
    }
}

/* Reads len bytes from the ring; false at EOF with nothing left in it. */
static bool ring_read(dh_client *c, uint8_t *dst, size_t len, double deadline)
{
    while (len > 0) {
        size_t got;
        assert_int_equal(kp_ring_read(c->ring, dst, len, &got, NULL), KP_OK);
        dst += got;
        len -= got;
        if (len > 0 && !kp_ring_readable(c->ring)) {
            wait_socket(c, deadline);
            if (!drain_doorbells(c) && !kp_ring_readable(c->ring))
                return false;
        }
    }
    return true;
}

static void take_frame(dh_client *c, uint8_t *body, size_t len);

static bool ring_recv(dh_client *c)
{
    double deadline = now_ms() + RECV_WAIT_MS;
    uint8_t h[KP_FRAME_HEADER_BYTES];
    if (!ring_read(c, h, sizeof(h), deadline))
        return false;
    size_t len = (size_t)h[0] << 24 | (size_t)h[1] << 16 | (size_t)h[2] << 8 | h[3];
    uint8_t *body = malloc(len ? len : 1);
    assert_non_null(body);
    if (!ring_read(c, body, len, deadline)) {
        free(body);
        return false;
    }
    take_frame(c, body, len);
    return true;
}

void dh_attach_ring(dh_client *c, kp_ring *ring, void *map, uint32_t region, uint64_t size)
{
    kp_ring_attach_params p = {region, size};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_ring_attach_params_encode(&c->w, id, &p, NULL), KP_OK);
    kp_ring_init(ring, map, size, false, KP_RING_WANT_DATA);
    dh_send(c);
    dh_expect_result(c, id);
    c->ring = ring;
}

/* Writes all n bytes; false if the daemon has closed the connection. */
static bool write_all(dh_client *c, const void *bytes, size_t n)
{
    if (c->ring) {
        ring_write(c, bytes, n);
        return true;
    }
    const uint8_t *p = bytes;
    while (n > 0) {
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EPIPE || errno == ECONNRESET))
            return false;
        assert_true(w > 0);
        p += w;
        n -= (size_t)w;
    }
    return true;
}

void dh_write(dh_client *c, const void *bytes, size_t n)
{
    assert_true(write_all(c, bytes, n));
}

/* dh_send that returns false, instead of failing, if kdad has closed the connection. */
static bool dh_try_send(dh_client *c)
{
    uint8_t *frame;
    size_t len;
    assert_int_equal(kp_writer_flatten(&c->w, &frame, &len, NULL), KP_OK);
    bool sent = write_all(c, frame, len);
    free(frame);
    return sent;
}

void dh_send(dh_client *c)
{
    assert_true(dh_try_send(c));
}

void dh_write_fd(dh_client *c, const void *bytes, size_t n, int fd)
{
    if (c->ring) { /* the descriptor goes ahead of its frame, on a doorbell */
        kp_ring *ring = c->ring;
        c->ring = NULL;
        dh_write_fd(c, "", 1, fd);
        c->ring = ring;
        ring_write(c, bytes, n);
        return;
    }
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } control;
    memset(&control, 0, sizeof(control));
    struct iovec v = {(void *)bytes, n};
    struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = control.buf,
                       .msg_controllen = sizeof(control.buf)};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    ssize_t w = sendmsg(c->fd, &m, MSG_NOSIGNAL);
    assert_true(w > 0);
    if ((size_t)w < n)
        dh_write(c, (const uint8_t *)bytes + w, n - (size_t)w);
}

void dh_send_fd(dh_client *c, int fd)
{
    uint8_t *frame;
    size_t len;
    assert_int_equal(kp_writer_flatten(&c->w, &frame, &len, NULL), KP_OK);
    dh_write_fd(c, frame, len, fd);
    free(frame);
}

/* Makes body (a frame's bytes, now owned by c) the current message. */
static void take_frame(dh_client *c, uint8_t *body, size_t len)
{
    kp_msg_close(&c->msg);
    free(c->body);
    c->body = body;
    c->body_len = len;
    kp_error e;
    if (kp_msg_decode(&c->msg, c->body, c->body_len, UINT32_MAX, &e) != KP_OK)
        fail_msg("undecodable frame from kdad: %s", e.message);
}

bool dh_recv(dh_client *c)
{
    kp_msg_close(&c->msg);
    free(c->body);
    c->body = NULL;
    if (c->ring)
        return ring_recv(c);
    double deadline = now_ms() + RECV_WAIT_MS;
    for (;;) {
        uint8_t *buf;
        size_t space = kp_reader_space(&c->reader, &buf);
        assert_non_null(buf);
        struct pollfd p = {c->fd, POLLIN, 0};
        int left = (int)(deadline - now_ms());
        if (left <= 0 || poll(&p, 1, left) != 1)
            fail_msg("no frame from kdad within %d ms", RECV_WAIT_MS);
        ssize_t n = recv(c->fd, buf, space, 0);
        if (n == 0 || (n < 0 && errno == ECONNRESET))
            return false;
        assert_true(n > 0);
        kp_error e;
        int rc = kp_reader_commit(&c->reader, (size_t)n, &e);
        assert_true(rc >= 0);
        if (rc == KP_READ_FRAME)
            break;
    }
    size_t len;
    uint8_t *body = kp_reader_take(&c->reader, &len);
    take_frame(c, body, len);
    return true;
}

void dh_recv_response(dh_client *c, uint32_t id)
{
    for (int i = 0; i < c->nheld; i++) {
        if (c->held[i].id != id)
            continue;
        uint8_t *body = c->held[i].body;
        size_t len = c->held[i].len;
        c->held[i] = c->held[--c->nheld];
        take_frame(c, body, len);
        return;
    }
    for (;;) {
        assert_true(dh_recv(c));
        if (c->msg.kind != KP_MSG_RESPONSE || c->msg.id == id)
            return;
        if (c->nheld == DH_HELD_MAX)
            fail_msg("more than %d responses arrived while waiting for %u", DH_HELD_MAX, id);
        c->held[c->nheld].body = c->body;
        c->held[c->nheld].len = c->body_len;
        c->held[c->nheld++].id = c->msg.id;
        kp_msg_close(&c->msg);
        c->body = NULL;
    }
}

void dh_expect_result(dh_client *c, uint32_t id)
{
    dh_recv_response(c, id);
    assert_int_equal(c->msg.kind, KP_MSG_RESPONSE);
    if (c->msg.error) {
        kp_error remote, e;
        assert_int_equal(kp_response_error_decode(&c->msg, &remote, &e), KP_OK);
        fail_msg("request %u failed: %s: %s", id, kp_code_name(remote.code), remote.message);
    }
    assert_int_equal(c->msg.id, id);
}

void dh_expect_error(dh_client *c, uint32_t id, int code, const char *substr)
{
    dh_recv_response(c, id);
    assert_int_equal(c->msg.kind, KP_MSG_RESPONSE);
    assert_int_equal(c->msg.id, id);
    assert_non_null(c->msg.error);
    kp_error remote, e;
    assert_int_equal(kp_response_error_decode(&c->msg, &remote, &e), KP_OK);
    if (remote.code != code || (substr && !strstr(remote.message, substr)))
        fail_msg("request %u: expected %s containing \"%s\", got %s: %s", id,
                 kp_code_name(code), substr ? substr : "", kp_code_name(remote.code),
                 remote.message);
}

void dh_expect_goodbye(dh_client *c, int code, const char *substr)
{
    assert_true(dh_recv(c));
    kp_error remote, e;
    if (kp_goodbye_decode(&c->msg, &remote, &e) != KP_OK)
        fail_msg("expected a goodbye, got a message of kind %d", (int)c->msg.kind);
    if (remote.code != code || (substr && !strstr(remote.message, substr)))
        fail_msg("goodbye: expected %s containing \"%s\", got %s: %s", kp_code_name(code),
                 substr ? substr : "", kp_code_name(remote.code), remote.message);
    assert_false(dh_recv(c)); /* then the daemon closes */
}

void dh_hello_result(dh_client *c, kp_hello_result *r)
{
    kp_hello_params p = {{KP_PROTOCOL_VERSION}, 1, "daemon_harness"};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_hello_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    assert_int_equal(kp_hello_result_decode(&c->msg, r, NULL), KP_OK);
    kp_session_from_hello(&c->session, r);
    assert_int_equal(r->geometry.heads, DH_HEADS);
    c->semaphores = false;
    for (uint32_t i = 0; i < r->nfeatures; i++)
        c->semaphores |= strcmp(r->features[i], KP_FEATURE_PREFILL_SEMAPHORES) == 0;
}

void dh_hello(dh_client *c)
{
    kp_hello_result r;
    dh_hello_result(c, &r);
}

int dh_memfd(size_t size, bool seal)
{
    int fd = memfd_create("kdad-test", MFD_ALLOW_SEALING | MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)size), 0);
    if (seal)
        assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    return fd;
}

uint64_t dh_alloc(dh_client *c)
{
    return dh_alloc_flags(c, true);
}

uint64_t dh_alloc_flags(dh_client *c, bool zero)
{
    kp_slot_alloc_params p = {1, zero};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_slot_alloc_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    kp_slot_list r;
    assert_int_equal(kp_slot_alloc_result_decode(&c->msg, &r, NULL), KP_OK);
    assert_int_equal(r.nslots, 1);
    return r.slots[0];
}

uint32_t dh_register_shm(dh_client *c, int fd, uint64_t size)
{
    kp_region_register_shm_params p = {size};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_region_register_shm_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send_fd(c, fd);
    dh_expect_result(c, id);
    kp_region_register_result r;
    assert_int_equal(kp_region_register_result_decode(&c->msg, &r, NULL), KP_OK);
    assert_true(r.region >= 1);
    return r.region;
}

bool dh_register_layer(dh_client *c, const char *name, const dh_layer *l)
{
    kp_layer_register_params p = {name, kp_ref_inline(l->A_log, sizeof(l->A_log)),
                                  kp_ref_inline(l->dt_bias, sizeof(l->dt_bias)), l->lower_bound,
                                  l->scale};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_layer_register_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    kp_layer_register_result r;
    assert_int_equal(kp_layer_register_result_decode(&c->msg, &r, NULL), KP_OK);
    return r.created;
}

uint32_t dh_send_prefill(dh_client *c, const char *layer, uint64_t slot, const dh_seq *s,
                         int64_t expect_pos)
{
    return dh_send_prefill_ready(c, layer, slot, s, expect_pos, NULL);
}

uint32_t dh_send_prefill_ready(dh_client *c, const char *layer, uint64_t slot, const dh_seq *s,
                               int64_t expect_pos, const kp_sem *ready)
{
    kp_prefill_seq q;
    memset(&q, 0, sizeof(q));
    q.slot = slot;
    q.len = s->len;
    q.has_expect_pos = expect_pos >= 0;
    q.expect_pos = expect_pos >= 0 ? (uint64_t)expect_pos : 0;
    if (s->len) {
        q.q = kp_ref_inline(s->q, DH_TOKEN_BYTES(s->len));
        q.k = kp_ref_inline(s->k, DH_TOKEN_BYTES(s->len));
        q.v = kp_ref_inline(s->v, DH_TOKEN_BYTES(s->len));
        q.g = kp_ref_inline(s->g, DH_TOKEN_BYTES(s->len));
        q.beta = kp_ref_inline(s->beta, DH_BETA_BYTES(s->len));
    }
    kp_prefill_params p = {.layer = layer, .seqs = &q, .nseqs = 1};
    if (ready)
        p.ready = *ready;
    uint32_t id = dh_id(c);
    kp_error e;
    if (kp_prefill_params_encode(&c->w, id, &p, &e) != KP_OK)
        fail_msg("encoding a prefill: %s", e.message);
    dh_send(c);
    return id;
}

uint64_t dh_recv_prefill(dh_client *c, uint32_t id, const dh_seq *s, uint16_t *out)
{
    dh_expect_result(c, id);
    kp_prefill_seq q;
    memset(&q, 0, sizeof(q));
    q.len = s->len;
    kp_prefill_params req = {.layer = "", .seqs = &q, .nseqs = 1};
    kp_prefill_result r;
    kp_error e;
    if (kp_prefill_result_decode(&c->msg, &c->session, &req, &r, &e) != KP_OK)
        fail_msg("prefill result: %s", e.message);
    if (out && s->len)
        memcpy(out, r.seqs[0].out.data, DH_TOKEN_BYTES(s->len));
    return r.seqs[0].pos;
}

uint64_t dh_read_state(dh_client *c, uint64_t slot, float *state)
{
    return dh_read_state_as(c, slot, KP_DTYPE_F32, state);
}

uint64_t dh_read_state_as(dh_client *c, uint64_t slot, kp_dtype dtype, void *state)
{
    kp_slot_read_params p;
    memset(&p, 0, sizeof(p));
    p.slot = slot;
    p.has_dtype = true;
    p.dtype = dtype;
    uint32_t id = dh_id(c);
    assert_int_equal(kp_slot_read_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    kp_slot_read_result r;
    kp_error e;
    if (kp_slot_read_result_decode(&c->msg, &c->session, &r, &e) != KP_OK)
        fail_msg("slot.read result: %s", e.message);
    assert_int_equal(r.dtype, dtype);
    assert_int_equal(r.state.kind, KP_REF_INLINE);
    memcpy(state, r.state.data, DH_STATE_ELEMS * kp_dtype_size(dtype));
    return r.pos;
}

uint64_t dh_fork(dh_client *c, uint64_t src, const uint64_t *dst, uint64_t *pos)
{
    kp_slot_fork_params p = {src, dst != NULL, dst ? *dst : 0};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_slot_fork_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    kp_slot_fork_result r;
    assert_int_equal(kp_slot_fork_result_decode(&c->msg, &r, NULL), KP_OK);
    if (pos)
        *pos = r.pos;
    return r.slot;
}

void dh_write_state(dh_client *c, uint64_t slot, uint64_t pos, kp_dtype dtype, kp_ref state)
{
    kp_slot_write_params p = {slot, pos, dtype, state};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_slot_write_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
}

void dh_stats(dh_client *c, kp_stats_result *r)
{
    uint32_t id = dh_id(c);
    assert_int_equal(kp_stats_params_encode(&c->w, id, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    kp_error e;
    if (kp_stats_result_decode(&c->msg, r, &e) != KP_OK)
        fail_msg("stats result: %s", e.message);
}

uint64_t dh_counter(const kp_counter *v, uint32_t n, const char *name)
{
    for (uint32_t i = 0; i < n; i++) {
        if (strcmp(v[i].name, name) == 0)
            return v[i].value;
    }
    return 0;
}
