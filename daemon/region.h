/*
 * region.h - client memory registered once and then named by requests
 * (PROTOCOL.md §Regions): host shared memory (a sealed memfd, mapped here)
 * and CUDA device memory (an IPC handle, opened by the cuda backend).
 *
 * Regions belong to the connection that registered them.  Each is
 * reference-counted: 1 while registered, +1 per admitted request that names
 * it.  Releasing (region.release, or the connection closing) makes the id
 * unknown at once; the memory is unmapped when the last request using it is
 * done, and only then does a pending region.release get its answer.
 */
#ifndef KDAD_REGION_H
#define KDAD_REGION_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "kdaproto.h"
#include "quota.h"

typedef enum kd_region_kind {
    KD_REGION_SHM = 0,
    KD_REGION_CUDA = 1,
} kd_region_kind;

typedef struct kd_region kd_region;
typedef struct kd_regions kd_regions;

/* Called once a released region is gone (region.release answers then). */
typedef void (*kd_region_gone_cb)(void *arg);

struct kd_region {
    uint32_t id;             /* >= 1, unique within the connection, never reused */
    kd_region_kind kind;
    uint8_t *host;           /* SHM: the mapping; CUDA: NULL */
    uint8_t *dev;            /* device address: CUDA memory, or the pinned alias of SHM; or NULL */
    uint64_t size;
    void *handle;            /* the backend's pin or IPC handle */
    kd_backend *backend;
    uint32_t refs;
    kd_region_gone_cb gone;
    void *gone_arg;
    kd_region *next;         /* the connection's list */
    kd_regions *owner;       /* its mapped bytes are counted there until it is gone */
};

/* A connection's regions. */
struct kd_regions {
    kd_region *head;
    uint32_t count;          /* registered (not released) */
    uint32_t next_id;
    uint64_t bytes;          /* mapped: registered, or released and still in use */
    kd_quota *quota;         /* where the uid's mapped bytes are counted */
    uid_t uid;
};

/* What one connection may map. */
typedef struct kd_region_limits {
    uint32_t max_regions;    /* limits.max_regions_per_client */
    uint64_t max_bytes;      /* clients.max_region_bytes_per_connection */
    uint64_t max_uid_bytes;  /* clients.max_region_bytes_per_uid */
} kd_region_limits;

void kd_regions_init(kd_regions *rs, kd_quota *quota, uid_t uid);

/*
 * Registers a memfd: it must carry F_SEAL_SHRINK and hold at least `size`
 * bytes (else KP_E_REGION_INVALID); it is mapped read-write and pinned by the
 * backend.  The fd is always closed, on success too.  KP_E_QUOTA_EXCEEDED
 * beyond the limits (checked before anything is mapped: a sparse memfd
 * counts at the size registered).
 */
int kd_region_register_shm(kd_regions *rs, kd_backend *b, int fd, uint64_t size,
                           const kd_region_limits *lim, kd_region **out, kp_error *err);
/* Opens CUDA memory through the backend (KP_E_NOT_SUPPORTED without one):
 * an IPC handle (fd -1), or the VMM allocation behind fd (handle_type
 * posix_fd), which it closes in every case. */
int kd_region_register_cuda(kd_regions *rs, kd_backend *b, const kp_region_register_cuda_params *p,
                            int fd, const kd_region_limits *lim, kd_region **out, kp_error *err);

/* A registered (not released) region, or NULL. */
kd_region *kd_region_find(const kd_regions *rs, uint32_t id);

/* Releases a region: gone(arg) runs when its memory is unmapped (maybe now). */
void kd_region_release(kd_regions *rs, kd_region *r, kd_region_gone_cb gone, void *arg);
/* Releases every region (the connection closed); no callbacks. */
void kd_regions_release_all(kd_regions *rs);

void kd_region_ref(kd_region *r);
void kd_region_unref(kd_region *r);

/* Resolves a REGION reference (already bounds-checked) to a buffer. */
kd_buf kd_region_buf(const kd_region *r, uint64_t offset);

#endif /* KDAD_REGION_H */
