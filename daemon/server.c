/*
 * server.c - see server.h.  Besides its own header it includes log.h only.
 */
#define _GNU_SOURCE /* accept4 */
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "log.h"

#define ACCEPTS_PER_WAKEUP 64 /* then the loop serves the connections we have */
#define LISTEN_BACKLOG 256

static void on_readable(uv_poll_t *h, int status, int events)
{
    kd_server *s = h->data;
    for (int i = 0; i < ACCEPTS_PER_WAKEUP; i++) {
        int fd = accept4(s->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                /* The pending connection would wake us forever: pause until the
                 * next housekeeping tick. */
                KD_WARN("accept: %s; pausing new connections for a second", strerror(errno));
                uv_poll_stop(&s->poll);
                s->paused = true;
            } else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
                KD_WARN("accept: %s", strerror(errno));
            }
            return;
        }
        s->on_accept(s->ctx, fd);
    }
}

/* Refuses to take over a path that is not a stale socket of ours. */
static int clear_stale(const char *path, char *err, size_t errlen)
{
    struct stat st;
    if (lstat(path, &st) != 0)
        return errno == ENOENT ? 0 : (snprintf(err, errlen, "%s: %s", path, strerror(errno)), -1);
    if (!S_ISSOCK(st.st_mode)) {
        snprintf(err, errlen, "%s exists and is not a socket", path);
        return -1;
    }
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    bool live = probe >= 0 && connect(probe, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    if (probe >= 0)
        close(probe);
    if (live) {
        snprintf(err, errlen, "%s: another process is listening there (a kdad already running?)",
                 path);
        return -1;
    }
    unlink(path);
    return 0;
}

static int lookup_group(const char *name, gid_t *gid, char *err, size_t errlen)
{
    char *end;
    unsigned long n = strtoul(name, &end, 10);
    if (*name && !*end) {
        *gid = (gid_t)n;
        return 0;
    }
    struct group grp, *found = NULL;
    char buf[4096];
    if (getgrnam_r(name, &grp, buf, sizeof(buf), &found) != 0 || !found) {
        snprintf(err, errlen, "socket.group: no group \"%s\"", name);
        return -1;
    }
    *gid = found->gr_gid;
    return 0;
}

static int create_socket(kd_server *s, const kd_server_socket *sock, char *err, size_t errlen)
{
    const char *path = sock->path;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path)) {
        snprintf(err, errlen, "socket path %s is longer than %zu bytes", path,
                 sizeof(sa.sun_path) - 1);
        return -1;
    }
    memcpy(sa.sun_path, path, strlen(path) + 1); /* the length was checked above */
    gid_t gid = (gid_t)-1;
    if (sock->group[0] && lookup_group(sock->group, &gid, err, errlen))
        return -1;
    if (clear_stale(path, err, errlen))
        return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(err, errlen, "socket: %s", strerror(errno));
        return -1;
    }
    /* Nobody may connect between bind and chmod: create it private first. */
    mode_t old = umask(0177);
    int rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
    umask(old);
    if (rc != 0) {
        snprintf(err, errlen, "bind %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    memcpy(s->path, sa.sun_path, sizeof(s->path));
    if ((gid != (gid_t)-1 && chown(path, (uid_t)-1, gid) != 0) ||
        chmod(path, (mode_t)sock->mode) != 0 || listen(fd, LISTEN_BACKLOG) != 0) {
        snprintf(err, errlen, "setting up %s: %s", path, strerror(errno));
        close(fd);
        unlink(path);
        s->path[0] = '\0';
        return -1;
    }
    KD_INFO("listening on %s (mode %04o%s%s)", path, sock->mode, sock->group[0] ? ", group " : "",
            sock->group);
    return fd;
}

/* A socket passed by systemd (socket activation). */
static int systemd_socket(char *err, size_t errlen)
{
    int n = sd_listen_fds(1);
    if (n <= 0)
        return -1;
    int fd = SD_LISTEN_FDS_START;
    if (n > 1)
        KD_WARN("systemd passed %d sockets; using the first", n);
    if (sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) <= 0) {
        snprintf(err, errlen, "the socket systemd passed is not a listening Unix stream socket");
        return -2;
    }
    /* Accepting must never block the loop. */
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0 ||
        fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) {
        snprintf(err, errlen, "the socket systemd passed: fcntl: %s", strerror(errno));
        return -2;
    }
    KD_INFO("listening on the socket passed by systemd");
    return fd;
}

int kd_server_listen(kd_server *s, uv_loop_t *loop, const kd_server_socket *sock,
                     kd_accept_cb accept_cb, void *ctx, char *err, size_t errlen)
{
    memset(s, 0, sizeof(*s));
    s->on_accept = accept_cb;
    s->ctx = ctx;
    s->fd = systemd_socket(err, errlen);
    if (s->fd == -2)
        return -1;
    s->from_systemd = s->fd >= 0;
    if (!s->from_systemd && (s->fd = create_socket(s, sock, err, errlen)) < 0)
        return -1;
    int rc = uv_poll_init(loop, &s->poll, s->fd);
    if (rc == 0) {
        s->poll_open = true;
        s->poll.data = s;
        rc = uv_poll_start(&s->poll, UV_READABLE, on_readable);
    }
    if (rc != 0) {
        snprintf(err, errlen, "polling the listening socket: %s", uv_strerror(rc));
        kd_server_close(s);
        return -1;
    }
    return 0;
}

void kd_server_tick(kd_server *s)
{
    if (s->paused && s->poll_open) {
        s->paused = false;
        uv_poll_start(&s->poll, UV_READABLE, on_readable);
    }
}

void kd_server_close(kd_server *s)
{
    if (s->path[0]) {
        unlink(s->path);
        s->path[0] = '\0';
    }
    /* uv_close stops the polling at once, so the descriptor may go now. */
    if (s->poll_open) {
        s->poll_open = false;
        uv_close((uv_handle_t *)&s->poll, NULL);
    }
    if (s->fd >= 0) {
        close(s->fd);
        s->fd = -1;
    }
}
