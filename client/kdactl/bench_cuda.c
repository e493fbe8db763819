/*
 * bench_cuda.c - device memory for `kdactl bench --transport cuda-ipc|cuda-vmm`
 * (built only with CUDA): an allocation on the daemon's GPU, found by its
 * UUID, filled with the benchmark's inputs, and what the daemon opens it
 * with: the cudaIpcMemHandle_t of a cudaMalloc allocation, or the POSIX fd
 * a VMM allocation (cuMemCreate) exports.  The driver's VMM calls are
 * reached through the runtime, so kdactl does not link libcuda.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "bench_buffers.h"
#include "common.h"

/* cudaMalloc sizes are rounded up to this, as PyTorch's caching allocator rounds its large
 * segments: the kernel ran 13-24% slower on a CUDA IPC allocation whose size was not a multiple
 * of 64 KiB, whatever the tensors' placement in it (bench/bench_ipc.cu, RESULTS.md). */
#define CUDA_ALLOC_ROUND ((uint64_t)2 << 20)

_Static_assert(sizeof(cudaIpcMemHandle_t) == KDAC_CUDA_IPC_HANDLE_BYTES, "IPC handle size");

/* The driver's VMM calls kdactl uses. */
typedef struct vmm_calls {
    CUresult (*create)(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                       unsigned long long flags);
    CUresult (*granularity)(size_t *g, const CUmemAllocationProp *prop, CUmemAllocationGranularity_flags o);
    CUresult (*reserve)(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags);
    CUresult (*map)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                    unsigned long long flags);
    CUresult (*set_access)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
    CUresult (*export)(void *os_handle, CUmemGenericAllocationHandle h, CUmemAllocationHandleType t,
                       unsigned long long flags);
    CUresult (*unmap)(CUdeviceptr ptr, size_t size);
    CUresult (*free_va)(CUdeviceptr ptr, size_t size);
    CUresult (*release)(CUmemGenericAllocationHandle h);
} vmm_calls;

/* One allocation: ptr from cudaMalloc, or a VMM allocation mapped at ptr (and the calls that
 * free it, found when it was made). */
typedef struct bench_cuda_mem {
    void *ptr;
    bool vmm;
    size_t mapped;
    CUmemGenericAllocationHandle alloc;
    vmm_calls calls;
} bench_cuda_mem;

static bool find_vmm_calls(vmm_calls *v)
{
    void **calls[] = {(void **)&v->create,  (void **)&v->granularity, (void **)&v->reserve,
                      (void **)&v->map,     (void **)&v->set_access,  (void **)&v->export,
                      (void **)&v->unmap,   (void **)&v->free_va,     (void **)&v->release};
    static const char *const names[] = {"cuMemCreate",    "cuMemGetAllocationGranularity",
                                        "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess",
                                        "cuMemExportToShareableHandle", "cuMemUnmap",
                                        "cuMemAddressFree", "cuMemRelease"};
    for (size_t i = 0; i < sizeof(calls) / sizeof(calls[0]); i++) {
        enum cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion(names[i], calls[i], 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            found != cudaDriverEntryPointSuccess)
            return false;
    }
    return true;
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi and kdad print it. */
static void uuid_text(const cudaUUID_t *u, char *buf, size_t size)
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(buf, size,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

static int cuda_fail(kdac_error *err, int code, const char *what, cudaError_t e)
{
    return ctl_set_error(err, code, "cuda: %s: %s", what, cudaGetErrorString(e));
}

static int driver_fail(kdac_error *err, const char *what, CUresult rc)
{
    return ctl_set_error(err, KDAC_E_SYSTEM, "cuda-vmm: %s: driver error %d", what, (int)rc);
}

/* A VMM allocation of at least `bytes` on `device`, mapped read-write here, exportable as a
 * POSIX fd; *fd is that export. */
static int alloc_vmm(int device, uint64_t bytes, bench_cuda_mem *m, int *fd, kdac_error *err)
{
    vmm_calls *v = &m->calls;
    if (!find_vmm_calls(v))
        return ctl_set_error(err, KDAC_E_NOT_SUPPORTED, "cuda-vmm: the driver lacks the VMM calls");
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t gran = 0;
    CUresult rc = v->granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (rc != CUDA_SUCCESS || gran == 0)
        return driver_fail(err, "cuMemGetAllocationGranularity", rc);
    m->mapped = (size_t)((bytes + gran - 1) / gran * gran);
    if ((rc = v->create(&m->alloc, m->mapped, &prop, 0)) != CUDA_SUCCESS)
        return driver_fail(err, "cuMemCreate", rc);
    CUdeviceptr ptr = 0;
    const CUmemAccessDesc access = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device},
                                    .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    const char *what = NULL;
    if ((rc = v->reserve(&ptr, m->mapped, gran, 0, 0)) != CUDA_SUCCESS)
        what = "cuMemAddressReserve";
    else if ((rc = v->map(ptr, m->mapped, 0, m->alloc, 0)) != CUDA_SUCCESS)
        what = "cuMemMap";
    else if ((rc = v->set_access(ptr, m->mapped, &access, 1)) != CUDA_SUCCESS)
        what = "cuMemSetAccess";
    else if ((rc = v->export(fd, m->alloc, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) != CUDA_SUCCESS)
        what = "cuMemExportToShareableHandle";
    if (what) {
        if (ptr) {
            v->unmap(ptr, m->mapped);
            v->free_va(ptr, m->mapped);
        }
        v->release(m->alloc);
        return driver_fail(err, what, rc);
    }
    m->ptr = (void *)(uintptr_t)ptr;
    m->vmm = true;
    return KDAC_OK;
}

int bench_cuda_alloc(const char *gpu_uuid, uint64_t bytes, const void *image, uint64_t image_bytes,
                     bool vmm, void **dev, uint8_t handle[KDAC_CUDA_IPC_HANDLE_BYTES], int *fd,
                     kdac_error *err)
{
    *fd = -1;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
        return cuda_fail(err, KDAC_E_NOT_SUPPORTED, "no CUDA device in this process", e);
    int device = -1;
    for (int i = 0; i < n && device < 0; i++) {
        struct cudaDeviceProp p;
        char text[64];
        if (cudaGetDeviceProperties(&p, i) != cudaSuccess)
            continue;
        uuid_text(&p.uuid, text, sizeof(text));
        if (strcmp(text, gpu_uuid) == 0)
            device = i;
    }
    if (device < 0)
        return ctl_set_error(err, KDAC_E_NOT_SUPPORTED, "cuda: the daemon's GPU %s is not "
                              "visible to this process", gpu_uuid);
    if ((e = cudaSetDevice(device)) != cudaSuccess)
        return cuda_fail(err, KDAC_E_SYSTEM, "cudaSetDevice", e);
    bench_cuda_mem *m = calloc(1, sizeof(*m));
    if (!m)
        return ctl_set_error(err, KDAC_E_SYSTEM, "out of memory");
    int rc = KDAC_OK;
    if (vmm) {
        rc = alloc_vmm(device, bytes, m, fd, err);
    } else if ((e = cudaMalloc(&m->ptr, bench_align(bytes, CUDA_ALLOC_ROUND))) != cudaSuccess) {
        rc = cuda_fail(err, KDAC_E_SYSTEM, "cudaMalloc", e);
    }
    if (rc) {
        free(m);
        return rc;
    }
    cudaIpcMemHandle_t h;
    if ((e = cudaMemcpy(m->ptr, image, image_bytes, cudaMemcpyHostToDevice)) != cudaSuccess ||
        (!vmm && (e = cudaIpcGetMemHandle(&h, m->ptr)) != cudaSuccess)) {
        bench_cuda_free(m);
        if (*fd >= 0)
            close(*fd);
        *fd = -1;
        return cuda_fail(err, KDAC_E_SYSTEM, "filling the device buffer", e);
    }
    /* cudaMemcpy is synchronous: the inputs are complete before any request
     * names them (PROTOCOL.md §Regions, synchronisation rule 1). */
    if (!vmm)
        memcpy(handle, &h, sizeof(h));
    *dev = m;
    return KDAC_OK;
}

void bench_cuda_free(void *dev)
{
    bench_cuda_mem *m = dev;
    if (!m)
        return;
    if (m->vmm) {
        CUdeviceptr ptr = (CUdeviceptr)(uintptr_t)m->ptr;
        m->calls.unmap(ptr, m->mapped);
        m->calls.free_va(ptr, m->mapped);
        m->calls.release(m->alloc);
    } else {
        cudaFree(m->ptr);
    }
    free(m);
}
