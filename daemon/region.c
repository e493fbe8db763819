/*
 * region.c - see region.h.
 *
 * Why the seal: a mapping of a file that its owner later truncates raises
 * SIGBUS on access, which would kill the daemon for every client.  A memfd
 * sealed with F_SEAL_SHRINK can never become shorter than it is now, so
 * after checking its size once, every access inside [0, size) stays valid.
 */
#define _GNU_SOURCE /* F_GET_SEALS */
#include "region.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

void kd_regions_init(kd_regions *rs, kd_quota *quota, uid_t uid)
{
    memset(rs, 0, sizeof(*rs));
    rs->next_id = 1;
    rs->quota = quota;
    rs->uid = uid;
}

/* Counts size mapped bytes, or refuses them (nothing is counted then). */
static int quota(kd_regions *rs, const kd_region_limits *lim, uint64_t size, kp_error *err)
{
    if (rs->count >= lim->max_regions)
        return kp_fail(err, KP_E_QUOTA_EXCEEDED, "this connection holds max_regions_per_client "
                       "%u regions", lim->max_regions);
    if (rs->next_id == 0) /* 2^32 - 1 registrations on one connection */
        return kp_fail(err, KP_E_QUOTA_EXCEEDED, "region ids of this connection are used up");
    if (size > lim->max_bytes || rs->bytes > lim->max_bytes - size)
        return kp_fail(err, KP_E_QUOTA_EXCEEDED, "size: %llu bytes would take this connection "
                       "to %llu bytes of mapped regions, above "
                       "clients.max_region_bytes_per_connection %llu",
                       (unsigned long long)size, (unsigned long long)(rs->bytes + size),
                       (unsigned long long)lim->max_bytes);
    int rc = kd_quota_map(rs->quota, rs->uid, size, lim->max_uid_bytes, err);
    if (rc == KP_OK)
        rs->bytes += size;
    return rc;
}

static void unquota(kd_regions *rs, uint64_t size)
{
    rs->bytes -= size;
    kd_quota_unmap(rs->quota, rs->uid, size);
}

static int add(kd_regions *rs, kd_region *r, kd_region **out)
{
    r->owner = rs;
    r->id = rs->next_id++;
    r->refs = 1;
    r->next = rs->head;
    rs->head = r;
    rs->count++;
    *out = r;
    return KP_OK;
}

int kd_region_register_shm(kd_regions *rs, kd_backend *b, int fd, uint64_t size,
                           const kd_region_limits *lim, kd_region **out, kp_error *err)
{
    int rc = quota(rs, lim, size, err);
    bool counted = rc == KP_OK;
    struct stat st;
    int seals;
    void *map = MAP_FAILED;
    kd_region *r = NULL;
    if (rc)
        goto fail;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        rc = kp_fail(err, KP_E_REGION_INVALID, "the descriptor is not a memfd or regular file");
        goto fail;
    }
    seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
        rc = kp_fail(err, KP_E_REGION_INVALID, "the memfd is not sealed with F_SEAL_SHRINK "
                     "(create it with MFD_ALLOW_SEALING and add the seal after ftruncate)");
        goto fail;
    }
    if ((uint64_t)st.st_size < size || size > SIZE_MAX) {
        rc = kp_fail(err, KP_E_REGION_INVALID, "size: %llu bytes, but the memfd holds %lld",
                     (unsigned long long)size, (long long)st.st_size);
        goto fail;
    }
    map = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        rc = kp_fail(err, KP_E_REGION_INVALID, "cannot map the memfd read-write: %s",
                     strerror(errno));
        goto fail;
    }
    r = calloc(1, sizeof(*r));
    if (!r) {
        rc = kp_fail(err, KP_E_NO_MEMORY, "no memory for a region");
        goto fail;
    }
    *r = (kd_region){.kind = KD_REGION_SHM, .host = map, .size = size, .backend = b};
    if (b->ops->pin_host &&
        (rc = b->ops->pin_host(b, map, size, (void **)&r->dev, &r->handle, err)) != KP_OK)
        goto fail;
    close(fd);
    return add(rs, r, out);
fail:
    free(r);
    if (map != MAP_FAILED)
        munmap(map, (size_t)size);
    if (counted)
        unquota(rs, size);
    close(fd);
    return rc;
}

int kd_region_register_cuda(kd_regions *rs, kd_backend *b, const kp_region_register_cuda_params *p,
                            int fd, const kd_region_limits *lim, kd_region **out, kp_error *err)
{
    int rc;
    bool counted = false;
    kd_region *r = NULL;
    if (!b->ops->open_cuda) {
        rc = kp_fail(err, KP_E_NOT_SUPPORTED, "CUDA regions need the cuda backend; this "
                     "daemon runs the %s backend", b->info.name);
        goto fail;
    }
    if ((rc = quota(rs, lim, p->size, err)))
        goto fail;
    counted = true;
    if (!(r = calloc(1, sizeof(*r)))) {
        rc = kp_fail(err, KP_E_NO_MEMORY, "no memory for a region");
        goto fail;
    }
    *r = (kd_region){.kind = KD_REGION_CUDA, .size = p->size, .backend = b};
    rc = b->ops->open_cuda(b, p, fd, (void **)&r->dev, &r->handle, err);
    fd = -1; /* the backend has closed it */
    if (rc != KP_OK)
        goto fail;
    return add(rs, r, out);
fail:
    free(r);
    if (counted)
        unquota(rs, p->size);
    if (fd >= 0)
        close(fd);
    return rc;
}

kd_region *kd_region_find(const kd_regions *rs, uint32_t id)
{
    for (kd_region *r = rs->head; r; r = r->next) {
        if (r->id == id)
            return r;
    }
    return NULL;
}

static void destroy(kd_region *r)
{
    kd_backend *b = r->backend;
    if (r->kind == KD_REGION_SHM) {
        if (b->ops->unpin_host && r->handle)
            b->ops->unpin_host(b, r->handle);
        munmap(r->host, (size_t)r->size);
    } else {
        b->ops->close_cuda(b, r->handle);
    }
    unquota(r->owner, r->size);
    kd_region_gone_cb gone = r->gone;
    void *arg = r->gone_arg;
    free(r);
    if (gone)
        gone(arg);
}

void kd_region_ref(kd_region *r)
{
    r->refs++;
}

void kd_region_unref(kd_region *r)
{
    if (--r->refs == 0)
        destroy(r);
}

/* Unlinks a region from the connection's list (the id becomes unknown). */
static void unlink_region(kd_regions *rs, kd_region *r)
{
    for (kd_region **p = &rs->head; *p; p = &(*p)->next) {
        if (*p == r) {
            *p = r->next;
            break;
        }
    }
    r->next = NULL;
    rs->count--;
}

void kd_region_release(kd_regions *rs, kd_region *r, kd_region_gone_cb gone, void *arg)
{
    unlink_region(rs, r);
    r->gone = gone;
    r->gone_arg = arg;
    kd_region_unref(r);
}

void kd_regions_release_all(kd_regions *rs)
{
    while (rs->head)
        kd_region_release(rs, rs->head, NULL, NULL);
}

kd_buf kd_region_buf(const kd_region *r, uint64_t offset)
{
    kd_buf b = {NULL, NULL};
    if (r->host)
        b.host = r->host + offset;
    if (r->dev)
        b.dev = r->dev + offset;
    return b;
}
