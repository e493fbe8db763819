/*
 * access.c - see access.h.
 */
#define _GNU_SOURCE /* struct ucred, SO_PEERGROUPS */
#include "access.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "log.h"

#define PEER_GROUPS_INLINE 64 /* most users are in fewer groups: no allocation */

int kd_peer_read(int fd, kd_peer *p)
{
    struct ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
        return -1;
    *p = (kd_peer){cred.pid, cred.uid, cred.gid};
    return 0;
}

static bool listed(const uint32_t *v, uint32_t n, uint32_t id)
{
    for (uint32_t i = 0; i < n; i++) {
        if (v[i] == id)
            return true;
    }
    return false;
}

/* Whether one of the peer's supplementary groups is in allowed_gids; *ngroups
 * is how many it has (0 when they cannot be read). */
static bool group_listed(const kd_config *cfg, int fd, uint32_t *ngroups)
{
    gid_t inline_groups[PEER_GROUPS_INLINE], *groups = inline_groups;
    socklen_t len = sizeof(inline_groups);
    int rc = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
    if (rc != 0 && errno == ERANGE && (groups = malloc(len)) != NULL)
        rc = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
    bool found = false;
    *ngroups = 0;
    if (rc == 0) {
        *ngroups = (uint32_t)(len / sizeof(gid_t));
        for (uint32_t i = 0; i < *ngroups && !found; i++)
            found = listed(cfg->allowed_gids, cfg->nallowed_gids, groups[i]);
    } else {
        KD_WARN("SO_PEERGROUPS: %s; the peer's supplementary groups do not count",
                groups ? strerror(errno) : "out of memory");
    }
    if (groups != inline_groups)
        free(groups);
    return found;
}

bool kd_access_allowed(const kd_config *cfg, int fd, const kd_peer *p, char *why, size_t len)
{
    if (cfg->nallowed_uids == 0 && cfg->nallowed_gids == 0)
        return true;
    if (listed(cfg->allowed_uids, cfg->nallowed_uids, p->uid) ||
        listed(cfg->allowed_gids, cfg->nallowed_gids, p->gid))
        return true;
    uint32_t ngroups = 0;
    if (cfg->nallowed_gids && group_listed(cfg, fd, &ngroups))
        return true;
    snprintf(why, len, "uid %u (gid %u, %u supplementary groups) may not use this daemon: "
             "neither is in its access.allowed_uids / allowed_gids", (unsigned)p->uid,
             (unsigned)p->gid, ngroups);
    return false;
}
