/*
 * server.h - the listening socket: created by kdad (a Unix stream socket at
 * the configured path, with its mode and group), or taken over from systemd
 * when socket activation passes one (LISTEN_FDS, sd_listen_fds).  Each
 * accepted socket (non-blocking) goes to the accept callback, which owns it.
 */
#ifndef KDAD_SERVER_H
#define KDAD_SERVER_H

#include <stdbool.h>

#include <uv.h>

/* A new connection's socket: the callback's to keep or close. */
typedef void (*kd_accept_cb)(void *ctx, int fd);

/* Where to listen when systemd passes no socket. */
typedef struct kd_server_socket {
    const char *path;
    unsigned mode;          /* permission bits of the socket file */
    const char *group;      /* its group (a name or a number), or "" */
} kd_server_socket;

typedef struct kd_server {
    kd_accept_cb on_accept;
    void *ctx;
    int fd;                 /* -1 when not listening */
    uv_poll_t poll;
    bool poll_open;         /* the poll handle is initialised (and must be closed) */
    bool paused;            /* out of descriptors: accepting resumes on the next tick */
    bool from_systemd;
    char path[108];         /* sun_path of a socket we created ("" otherwise) */
} kd_server;

/* Listens on loop (see above).  0, or -1 with err. */
int kd_server_listen(kd_server *s, uv_loop_t *loop, const kd_server_socket *sock,
                     kd_accept_cb on_accept, void *ctx, char *err, size_t errlen);
/* Stops accepting, closes the socket and removes the file we created. */
void kd_server_close(kd_server *s);
/* Resumes accepting after a pause for lack of descriptors (housekeeping tick). */
void kd_server_tick(kd_server *s);

#endif /* KDAD_SERVER_H */
