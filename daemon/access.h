/*
 * access.h - who may talk to kdad.
 *
 * The kernel reports the peer of a connected Unix socket: SO_PEERCRED gives
 * its pid, uid and primary gid, SO_PEERGROUPS its supplementary groups, both
 * as they were when it called connect() (no race with a process that
 * changes identity or exits, unlike reading /proc/PID/status).  A peer may
 * use the daemon when both access lists are empty, when its uid is in
 * access.allowed_uids, or when its primary gid or one of its supplementary
 * groups is in access.allowed_gids.  The socket file's mode and group (set by
 * kdad.socket or socket.mode / socket.group) decide who can connect at all;
 * these lists narrow that further.
 */
#ifndef KDAD_ACCESS_H
#define KDAD_ACCESS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "config.h"

/* The peer, from SO_PEERCRED at accept time. */
typedef struct kd_peer {
    pid_t pid;
    uid_t uid;
    gid_t gid;
} kd_peer;

/* The credentials of the peer of a connected Unix socket: 0, or -1 with errno. */
int kd_peer_read(int fd, kd_peer *p);

/*
 * Whether the peer of fd (credentials p) may use the daemon under cfg's
 * access lists.  Its supplementary groups are read from fd only when the
 * uid and the primary gid do not decide; if they cannot be read, none
 * count.  On a refusal, why (len bytes) holds a sentence naming the peer
 * for the log and the client's goodbye.
 */
bool kd_access_allowed(const kd_config *cfg, int fd, const kd_peer *p, char *why, size_t len);

#endif /* KDAD_ACCESS_H */
