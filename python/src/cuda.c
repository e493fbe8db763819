/*
 * cuda.c - device arrays as CUDA regions.
 *
 * A device pointer is resolved to the allocation holding it through the CUDA
 * driver (libcuda.so.1, opened with dlopen on first use, so the module needs
 * no CUDA at build or import time): its base, size and a process-wide unique
 * id.  The allocation is registered once per connection - by its IPC handle
 * (cudaMalloc, what PyTorch's caching allocator hands out) or, for a VMM
 * mapping (PyTorch's expandable segments), by the POSIX fd it exports - and
 * the registration is cached under that id.
 *
 * Registrations are given back (region.release) when the allocation goes:
 * a miss at addresses a cached allocation covered means that one was freed;
 * every miss also checks the cache for allocations no longer mapped; and
 * when the cache reaches max_regions_per_client less the client's own
 * reserve, the least recently used registration is evicted.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kdapy.h"

/* The driver API subset used here (cuda.h values, stable across CUDA 11-13). */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char bytes[16]; } CUuuid;
enum {
    ATTR_CONTEXT = 1,
    ATTR_MEMORY_TYPE = 2,
    ATTR_BUFFER_ID = 7,
    ATTR_DEVICE_ORDINAL = 9,
    ATTR_IS_LEGACY_IPC = 10,
    ATTR_RANGE_START = 11,
    ATTR_RANGE_SIZE = 12,
    ATTR_MAPPING_SIZE = 18,
    ATTR_MAPPING_BASE = 19,
    ATTR_MEMORY_BLOCK_ID = 20,
};
#define MEMORYTYPE_DEVICE 2
#define HANDLE_TYPE_POSIX_FD 1

static struct {
    bool tried, ok;
    char why[160];
    CUresult (*Init)(unsigned);
    CUresult (*PointerGetAttributes)(unsigned, int *, void **, CUdeviceptr);
    CUresult (*IpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
    CUresult (*MemRetainAllocationHandle)(CUmemGenericAllocationHandle *, void *);
    CUresult (*MemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int,
                                           unsigned long long);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle);
    CUresult (*DeviceGet)(int *, int);
    CUresult (*DeviceGetUuid)(CUuuid *, int);
    CUresult (*CtxSynchronize)(void);
    CUresult (*GetErrorName)(CUresult, const char **);
} cu;

static bool cu_load(void)
{
    if (cu.tried)
        return cu.ok;
    cu.tried = true;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(cu.why, sizeof(cu.why), "the CUDA driver (libcuda.so.1) cannot be loaded");
        return false;
    }
#define SYM(field, name)                                                               \
    if (!(*(void **)&cu.field = dlsym(h, name))) {                                     \
        snprintf(cu.why, sizeof(cu.why), "the CUDA driver lacks %s", name);            \
        return false;                                                                  \
    }
    SYM(Init, "cuInit");
    SYM(PointerGetAttributes, "cuPointerGetAttributes");
    SYM(IpcGetMemHandle, "cuIpcGetMemHandle");
    SYM(MemRetainAllocationHandle, "cuMemRetainAllocationHandle");
    SYM(MemExportToShareableHandle, "cuMemExportToShareableHandle");
    SYM(MemRelease, "cuMemRelease");
    SYM(DeviceGet, "cuDeviceGet");
    SYM(DeviceGetUuid, "cuDeviceGetUuid_v2");
    SYM(CtxSynchronize, "cuCtxSynchronize");
    SYM(GetErrorName, "cuGetErrorName");
#undef SYM
    if (cu.Init(0) != 0) {
        snprintf(cu.why, sizeof(cu.why), "cuInit failed: no usable CUDA device");
        return false;
    }
    cu.ok = true;
    return true;
}

static const char *cu_name(CUresult r)
{
    const char *s = NULL;
    if (cu.GetErrorName && cu.GetErrorName(r, &s) == 0 && s)
        return s;
    return "CUDA error";
}

static int local_error(int code, const char *fmt, const char *field, const char *detail)
{
    kdac_error e = {.code = code, .retryable = false};
    snprintf(e.message, sizeof(e.message), fmt, field, detail);
    kp_raise(&e);
    return -1;
}

int kp_cuda_sync(void)
{
    if (!cu_load())
        return local_error(KDAC_E_NOT_SUPPORTED, "%s%s", "", cu.why);
    CUresult r = cu.CtxSynchronize();
    if (r != 0)
        return local_error(KDAC_E_DEVICE_FAILED, "%scuCtxSynchronize: %s", "", cu_name(r));
    return 0;
}

static void entry_drop(ClientObject *self, uint32_t i)
{
    if (self->c)
        KP_NOGIL(kdac_region_release(self->c, self->cuda[i].region, NULL));
    self->cuda_released++;
    self->cuda[i] = self->cuda[--self->ncuda];
}

/* Is the allocation an entry names still mapped at its base, the same one? */
static bool entry_alive(const cuda_entry *e)
{
    unsigned long long id = 0;
    int attr = e->vmm ? ATTR_MEMORY_BLOCK_ID : ATTR_BUFFER_ID;
    void *data = &id;
    return cu.PointerGetAttributes(1, &attr, &data, e->base) == 0 && id == e->buffer_id;
}

int kp_cuda_sweep(ClientObject *self, bool all)
{
    int n = 0;
    if (!all && !cu.ok)
        return 0;
    for (uint32_t i = 0; i < self->ncuda;) {
        if (all || !entry_alive(&self->cuda[i])) {
            entry_drop(self, i);
            n++;
        } else {
            i++;
        }
    }
    return n;
}

void kp_cuda_forget_all(ClientObject *self, bool release)
{
    if (release)
        kp_cuda_sweep(self, true);
    PyMem_Free(self->cuda);
    self->cuda = NULL;
    self->ncuda = self->cuda_cap = 0;
}

static void format_uuid(char *out, size_t size, const CUuuid *u)
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, size, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
             b[13], b[14], b[15]);
}

/* Registers [base, base + size) of the allocation holding ptr. */
static int cuda_register(ClientObject *self, uint64_t ptr, uint64_t base, uint64_t size,
                         bool ipc, int ordinal, const char *field, uint32_t *region)
{
    char uuid[64];
    int dev;
    CUuuid u;
    CUresult r = cu.DeviceGet(&dev, ordinal);
    if (r == 0)
        r = cu.DeviceGetUuid(&u, dev);
    if (r != 0)
        return local_error(KDAC_E_REGION_INVALID, "%s: the CUDA device of the tensor: %s", field,
                           cu_name(r));
    format_uuid(uuid, sizeof(uuid), &u);
    const kdac_server_info *info = kdac_client_info(self->c);
    if (!(info->transports & KDAC_TRANSPORT_CUDA_IPC)) {
        return local_error(KDAC_E_NOT_SUPPORTED,
                           "%s: the daemon (backend %s) takes no CUDA regions; pass host arrays",
                           field, info->backend);
    }
    kdac_error err;
    int rc;
    if (ipc) {
        CUipcMemHandle h;
        r = cu.IpcGetMemHandle(&h, base);
        if (r != 0)
            return local_error(KDAC_E_REGION_INVALID, "%s: cuIpcGetMemHandle: %s", field,
                               cu_name(r));
        KP_NOGIL(rc = kdac_region_register_cuda(self->c, &h, size, uuid, region, &err));
    } else {
        CUmemGenericAllocationHandle h;
        r = cu.MemRetainAllocationHandle(&h, (void *)(uintptr_t)ptr);
        if (r != 0)
            return local_error(KDAC_E_REGION_INVALID,
                               "%s: neither a cudaMalloc allocation nor a VMM mapping (%s); "
                               "memory from cudaMallocAsync pools cannot be shared", field,
                               cu_name(r));
        int fd = -1;
        r = cu.MemExportToShareableHandle(&fd, h, HANDLE_TYPE_POSIX_FD, 0);
        cu.MemRelease(h);
        if (r != 0)
            return local_error(KDAC_E_REGION_INVALID,
                               "%s: the VMM allocation cannot be exported as a POSIX fd (%s); "
                               "create it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", field,
                               cu_name(r));
        KP_NOGIL(rc = kdac_region_register_cuda_fd(self->c, fd, size, uuid, region, &err));
        close(fd);
    }
    if (rc != 0) {
        kp_raise(&err);
        return -1;
    }
    self->cuda_registered++;
    return 0;
}

int kp_cuda_region(ClientObject *self, uint64_t ptr, uint64_t nbytes, const char *field,
                   uint32_t *region, uint64_t *offset)
{
    if (!cu_load())
        return local_error(KDAC_E_NOT_SUPPORTED, "%s: %s", field, cu.why);
    unsigned long long id = 0, start = 0;
    size_t size = 0;
    unsigned memtype = 0;
    int ordinal = -1, ipc = 0;
    int attrs[6] = {ATTR_BUFFER_ID, ATTR_RANGE_START, ATTR_RANGE_SIZE, ATTR_MEMORY_TYPE,
                    ATTR_DEVICE_ORDINAL, ATTR_IS_LEGACY_IPC};
    void *data[6] = {&id, &start, &size, &memtype, &ordinal, &ipc};
    CUresult r = cu.PointerGetAttributes(6, attrs, data, ptr);
    if (r != 0 || memtype != MEMORYTYPE_DEVICE) {
        char d[96];
        snprintf(d, sizeof(d), "%s", r != 0 ? cu_name(r) : "not device memory");
        return local_error(KDAC_E_INVALID_ARGUMENT, "%s: not a CUDA device allocation (%s)",
                           field, d);
    }
    if (!ipc) {
        /* A VMM mapping: the region is the physical allocation mapped here, and its
         * identity that allocation's (the same addresses may map another one later, as
         * expandable segments do when they shrink and grow). */
        unsigned long long mbase = 0, block = 0;
        size_t msize = 0;
        int a2[3] = {ATTR_MAPPING_BASE, ATTR_MAPPING_SIZE, ATTR_MEMORY_BLOCK_ID};
        void *d2[3] = {&mbase, &msize, &block};
        if (cu.PointerGetAttributes(3, a2, d2, ptr) != 0 || !msize || !block)
            return local_error(KDAC_E_NOT_SUPPORTED,
                               "%s: a VMM mapping, and this CUDA driver does not report %s "
                               "(CUDA 12.2 or later does)", field,
                               "its physical allocation");
        start = mbase;
        size = msize;
        id = block;
    }
    if (ptr + nbytes > start + size) {
        char d[128];
        snprintf(d, sizeof(d), "%llu bytes at offset %llu of a %zu-byte allocation",
                 (unsigned long long)nbytes, (unsigned long long)(ptr - start), size);
        return local_error(KDAC_E_INVALID_ARGUMENT,
                           "%s: the tensor reaches past its allocation (%s); a tensor spanning "
                           "two chunks of an expandable segment cannot be one region",
                           field, d);
    }
    if ((ptr - start) % KDAC_TENSOR_ALIGN) {
        char d[64];
        snprintf(d, sizeof(d), "%llu", (unsigned long long)(ptr - start));
        return local_error(KDAC_E_INVALID_ARGUMENT,
                           "%s: offset %s in its allocation is not a multiple of 16", field, d);
    }
    for (uint32_t i = 0; i < self->ncuda; i++) {
        cuda_entry *e = &self->cuda[i];
        if (e->buffer_id == id && e->base == start && e->vmm == !ipc) {
            e->last_use = self->use_clock;
            *region = e->region;
            *offset = ptr - start;
            return 0;
        }
    }
    /* A miss.  Cached allocations overlapping this one are gone; so are any
     * no longer mapped where they were. */
    for (uint32_t i = 0; i < self->ncuda;) {
        cuda_entry *e = &self->cuda[i];
        if (e->base < start + size && start < e->base + e->size)
            entry_drop(self, i);
        else
            i++;
    }
    kp_cuda_sweep(self, false);
    uint32_t reserve = KP_REGIONS_RESERVED + (self->words != NULL); /* + the words' page */
    uint32_t budget = self->max_regions > reserve + 1 ? self->max_regions - reserve : 1;
    while (self->ncuda >= budget) {
        /* the least recently used, but none the request being built names */
        uint32_t lru = UINT32_MAX;
        for (uint32_t i = 0; i < self->ncuda; i++)
            if (self->cuda[i].last_use != self->use_clock &&
                (lru == UINT32_MAX || self->cuda[i].last_use < self->cuda[lru].last_use))
                lru = i;
        if (lru == UINT32_MAX) {
            char d[32];
            snprintf(d, sizeof(d), "%u", budget);
            return local_error(KDAC_E_QUOTA_EXCEEDED,
                               "%s: the request's CUDA tensors lie in more than %s allocations "
                               "(max_regions_per_client less the client's reserve)", field, d);
        }
        entry_drop(self, lru);
    }
    if (self->ncuda == self->cuda_cap) {
        uint32_t cap = self->cuda_cap ? self->cuda_cap * 2 : 8;
        cuda_entry *n = PyMem_Realloc(self->cuda, cap * sizeof(*n));
        if (!n) {
            PyErr_NoMemory();
            return -1;
        }
        self->cuda = n;
        self->cuda_cap = cap;
    }
    uint32_t reg;
    if (cuda_register(self, ptr, start, size, ipc != 0, ordinal, field, &reg) != 0)
        return -1;
    self->cuda[self->ncuda++] = (cuda_entry){id, start, size, reg, self->use_clock, !ipc};
    *region = reg;
    *offset = ptr - start;
    return 0;
}
