/*
 * shm.c - host shared memory for regions: a memfd sized and sealed the way
 * the daemon requires (PROTOCOL.md §Regions: F_SEAL_SHRINK, so the file can
 * never shrink under the daemon's mapping), mapped read-write here.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client_int.h"

int kdac_shm_create(kdac_shm *shm, uint64_t size, const char *name, kdac_error *err)
{
    if (!shm)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "shm is NULL");
    memset(shm, 0, sizeof(*shm));
    shm->fd = -1;
    if (size == 0 || size > (uint64_t)INT64_MAX || size > SIZE_MAX)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "size: %llu bytes is not a mappable size",
                         (unsigned long long)size);
    int fd = memfd_create(name ? name : "kdac", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return kdac_fail(err, KDAC_E_SYSTEM, "memfd_create: %s", strerror(errno));
    const char *step = "ftruncate";
    if (ftruncate(fd, (off_t)size) != 0)
        goto fail;
    step = "fcntl(F_ADD_SEALS)";
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        goto fail;
    step = "mmap";
    void *base = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED)
        goto fail;
    shm->fd = fd;
    shm->base = base;
    shm->size = size;
    return KDAC_OK;
fail:;
    int e = errno;
    close(fd);
    return kdac_fail(err, KDAC_E_SYSTEM, "%s on a %llu-byte memfd: %s", step,
                     (unsigned long long)size, strerror(e));
}

void kdac_shm_close(kdac_shm *shm)
{
    if (!shm)
        return;
    if (shm->base)
        munmap(shm->base, (size_t)shm->size);
    if (shm->fd >= 0)
        close(shm->fd);
    shm->base = NULL;
    shm->fd = -1;
    shm->size = 0;
}
