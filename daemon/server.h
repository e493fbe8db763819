/*
 * server.h - the listening socket: created by kdad (a Unix stream socket at
 * the configured path, with its mode and group), or taken over from systemd
 * when socket activation passes one (LISTEN_FDS, sd_listen_fds).  Accepted
 * connections carry their peer's credentials (SO_PEERCRED) to kd_conn_new,
 * which applies the access lists.
 */
#ifndef KDAD_SERVER_H
#define KDAD_SERVER_H

#include <stdbool.h>

#include <uv.h>

#include "config.h"

typedef struct kd_daemon kd_daemon;

typedef struct kd_server {
    kd_daemon *d;
    int fd;                 /* -1 when not listening */
    uv_poll_t poll;
    bool poll_open;         /* the poll handle is initialised (and must be closed) */
    bool paused;            /* out of descriptors: accepting resumes on the next tick */
    bool from_systemd;
    char path[108];         /* sun_path of a socket we created ("" otherwise) */
} kd_server;

/* Listens (see above).  0, or -1 with err. */
int kd_server_listen(kd_server *s, kd_daemon *d, const kd_config *cfg, char *err, size_t errlen);
/* Stops accepting, closes the socket and removes the file we created. */
void kd_server_close(kd_server *s);
/* Resumes accepting after a pause for lack of descriptors (housekeeping tick). */
void kd_server_tick(kd_server *s);

#endif /* KDAD_SERVER_H */
