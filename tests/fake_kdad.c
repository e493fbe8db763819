/*
 * fake_kdad.c - the in-process fake daemon of the client tests (see
 * fake_kdad.h).
 */
#define _GNU_SOURCE /* accept4 */
#include "fake_kdad.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

/* Longest a script waits for the client before it gives up (a hung test
 * fails instead of hanging). */
#define FAKE_WAIT_MS 10000

struct fake_server {
    char dir[64];
    char path[108];
    int listen_fd;
    pthread_t thread;
    fake_script script;
    void *arg;
    fake_conn conn;
};

bool fake_check(fake_conn *fc, bool cond, const char *fmt, ...)
{
    if (cond)
        return true;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fake kdad: check failed: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fc->failures++;
    return false;
}

static void default_hello(kp_hello_result *h)
{
    memset(h, 0, sizeof(*h));
    h->version = KP_PROTOCOL_VERSION;
    h->server = "fake-kdad 0.0";
    h->instance = 0x1234abcdull;
    h->backend = KP_BACKEND_CPU;
    h->geometry.heads = FAKE_HEADS;
    h->geometry.head_dim = KP_HEAD_DIM;
    h->geometry.slots = 64;
    h->geometry.state_dtype = KP_DTYPE_F32;
    h->transports = KP_TRANSPORT_INLINE | KP_TRANSPORT_SHM;
    kp_limits_default(&h->limits);
}

/* Waits until fd is readable; false after FAKE_WAIT_MS. */
static bool wait_readable(int fd)
{
    struct pollfd p = {fd, POLLIN, 0};
    int rc;
    do {
        rc = poll(&p, 1, FAKE_WAIT_MS);
    } while (rc < 0 && errno == EINTR);
    return rc > 0;
}

/* One recvmsg into buf, collecting descriptors. */
static ssize_t fake_recv(fake_conn *fc, void *buf, size_t n)
{
    if (!wait_readable(fc->fd)) {
        fake_check(fc, false, "timed out waiting for the client");
        return -1;
    }
    union {
        char buf[CMSG_SPACE(4 * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    if (fc->read_chunk && n > fc->read_chunk)
        n = fc->read_chunk;
    struct iovec iov = {buf, n};
    struct msghdr mh;
    memset(&mh, 0, sizeof(mh));
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof(ctl.buf);
    ssize_t got;
    do {
        got = recvmsg(fc->fd, &mh, MSG_CMSG_CLOEXEC);
    } while (got < 0 && errno == EINTR);
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfd && fc->nfds < 8; i++)
            memcpy(&fc->fds[fc->nfds++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
    }
    return got;
}

bool fake_read(fake_conn *fc)
{
    kp_msg_close(&fc->msg);
    kp_msg_init(&fc->msg);
    free(fc->body);
    fc->body = NULL;
    kp_error e;
    for (;;) {
        uint8_t *buf;
        size_t room = kp_reader_space(&fc->rd, &buf);
        int rc;
        if (!buf) {
            rc = kp_reader_commit(&fc->rd, 0, &e);
        } else {
            ssize_t got = fake_recv(fc, buf, room);
            if (got <= 0)
                return false;
            rc = kp_reader_commit(&fc->rd, (size_t)got, &e);
        }
        if (rc < 0)
            return fake_check(fc, false, "bad frame from the client: %s", e.message);
        if (rc == KP_READ_FRAME)
            break;
    }
    size_t len;
    fc->body = kp_reader_take(&fc->rd, &len);
    if (kp_msg_decode(&fc->msg, fc->body, len, fc->rd.max_frame, &e) != KP_OK)
        return fake_check(fc, false, "bad message from the client: %s", e.message);
    return fake_check(fc, fc->msg.kind == KP_MSG_REQUEST, "the client sent a non-request");
}

uint32_t fake_expect(fake_conn *fc, kp_method m)
{
    if (!fake_read(fc))
        return 0;
    if (!fake_check(fc, fc->msg.method == m, "expected %s, got %s", kp_method_name(m),
                    fc->msg.name))
        return 0;
    return fc->msg.id;
}

void fake_send_raw(fake_conn *fc, const void *data, size_t n)
{
    const uint8_t *p = data;
    while (n > 0) {
        size_t take = fc->write_chunk && fc->write_chunk < n ? fc->write_chunk : n;
        ssize_t w = send(fc->fd, p, take, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            /* The client may have closed on purpose (tests of its failures). */
            return;
        }
        p += w;
        n -= (size_t)w;
    }
}

void fake_send(fake_conn *fc)
{
    uint8_t *frame;
    size_t len;
    kp_error e;
    if (!fake_check(fc, kp_writer_flatten(&fc->w, &frame, &len, &e) == KP_OK, "flatten: %s",
                    e.message))
        return;
    fake_send_raw(fc, frame, len);
    free(frame);
}

void fake_send_error(fake_conn *fc, uint32_t id, int code, const char *message)
{
    kp_error e, err;
    kp_fail(&e, code, "%s", message);
    if (fake_check(fc, kp_error_response_encode(&fc->w, id, &e, &err) == KP_OK, "encode: %s",
                   err.message))
        fake_send(fc);
}

void fake_send_goodbye(fake_conn *fc, int code, const char *message)
{
    kp_error e, err;
    kp_fail(&e, code, "%s", message);
    if (fake_check(fc, kp_goodbye_encode(&fc->w, &e, &err) == KP_OK, "encode: %s", err.message))
        fake_send(fc);
}

void fake_hello(fake_conn *fc)
{
    uint32_t id = fake_expect(fc, KP_METHOD_HELLO);
    if (!id)
        return;
    kp_hello_params p;
    kp_error e;
    if (!fake_check(fc, kp_hello_params_decode(&fc->msg, &fc->session, &p, &e) == KP_OK,
                    "hello params: %s", e.message))
        return;
    fake_check(fc, p.nversions == 1 && p.versions[0] == KP_PROTOCOL_VERSION,
               "the client offered %u versions", p.nversions);
    if (fake_check(fc, kp_hello_result_encode(&fc->w, id, &fc->hello, &e) == KP_OK,
                   "hello result: %s", e.message))
        fake_send(fc);
    kp_reader_set_max_frame(&fc->rd, fc->hello.limits.max_frame_bytes);
}

bool fake_wait_eof(fake_conn *fc)
{
    uint8_t buf[4096];
    for (;;) {
        ssize_t got = fake_recv(fc, buf, sizeof(buf));
        if (got == 0)
            return true;
        if (got < 0)
            return false;
    }
}

static void *server_main(void *arg)
{
    fake_server *s = arg;
    fake_conn *fc = &s->conn;
    if (!wait_readable(s->listen_fd)) {
        fake_check(fc, false, "no client connected");
        return NULL;
    }
    fc->fd = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (!fake_check(fc, fc->fd >= 0, "accept: %s", strerror(errno)))
        return NULL;
    s->script(fc, s->arg);
    close(fc->fd);
    return NULL;
}

fake_server *fake_start_with(fake_script script, void *arg,
                             void (*configure)(kp_hello_result *hello))
{
    fake_server *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    snprintf(s->dir, sizeof(s->dir), "/tmp/kdac-test-XXXXXX");
    if (!mkdtemp(s->dir)) {
        free(s);
        return NULL;
    }
    snprintf(s->path, sizeof(s->path), "%s/kdad.sock", s->dir);
    s->script = script;
    s->arg = arg;
    fake_conn *fc = &s->conn;
    fc->fd = -1;
    default_hello(&fc->hello);
    if (configure)
        configure(&fc->hello);
    kp_session_from_hello(&fc->session, &fc->hello);
    kp_reader_init(&fc->rd, KP_HELLO_MAX_FRAME_BYTES);
    kp_msg_init(&fc->msg);
    kp_writer_init(&fc->w, UINT32_MAX);

    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", s->path);
    s->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s->listen_fd < 0 || bind(s->listen_fd, (struct sockaddr *)&addr, sizeof(addr)) != 0 ||
        listen(s->listen_fd, 4) != 0 || pthread_create(&s->thread, NULL, server_main, s) != 0) {
        perror("fake kdad");
        abort();
    }
    return s;
}

fake_server *fake_start(fake_script script, void *arg)
{
    return fake_start_with(script, arg, NULL);
}

const char *fake_path(const fake_server *s)
{
    return s->path;
}

int fake_stop(fake_server *s)
{
    pthread_join(s->thread, NULL);
    fake_conn *fc = &s->conn;
    int failures = fc->failures;
    for (int i = 0; i < fc->nfds; i++)
        close(fc->fds[i]);
    kp_msg_close(&fc->msg);
    free(fc->body);
    kp_reader_close(&fc->rd);
    kp_writer_close(&fc->w);
    close(s->listen_fd);
    unlink(s->path);
    rmdir(s->dir);
    free(s);
    return failures;
}

int fake_client_open(const fake_server *s, int timeout_ms, kdac_client **c, kdac_error *err)
{
    kdac_options o;
    kdac_options_init(&o);
    o.socket_path = s->path;
    o.timeout_ms = timeout_ms;
    o.client_name = "libkdaclient tests";
    return kdac_client_open(c, &o, err);
}

bool fake_client_run(kdac_client *c, const int *count, int target)
{
    for (int spins = 0; *count < target; spins++) {
        int ev = kdac_client_events(c);
        if (ev == 0 || spins > 10000)
            return false;
        struct pollfd p = {kdac_client_fd(c), POLLIN, 0};
        if (ev & KDAC_WRITABLE)
            p.events |= POLLOUT;
        if (poll(&p, 1, FAKE_WAIT_MS) <= 0)
            return false;
        if (kdac_client_progress(c) != KDAC_OK)
            return *count >= target;
    }
    return true;
}
