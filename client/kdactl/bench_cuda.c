/*
 * bench_cuda.c - device memory for `kdactl bench --transport cuda-ipc`
 * (built only with CUDA): a cudaMalloc allocation on the daemon's GPU,
 * found by its UUID, filled with the benchmark's inputs, and the
 * cudaIpcMemHandle_t the daemon opens it with.
 */
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "bench_buffers.h"
#include "common.h"

_Static_assert(sizeof(cudaIpcMemHandle_t) == KDAC_CUDA_IPC_HANDLE_BYTES, "IPC handle size");

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
    return ctl_set_error(err, code, "cuda-ipc: %s: %s", what, cudaGetErrorString(e));
}

int bench_cuda_alloc(const char *gpu_uuid, uint64_t bytes, const void *image,
                     uint64_t image_bytes, void **dev, uint8_t handle[KDAC_CUDA_IPC_HANDLE_BYTES],
                     kdac_error *err)
{
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
        return ctl_set_error(err, KDAC_E_NOT_SUPPORTED, "cuda-ipc: the daemon's GPU %s is not "
                              "visible to this process", gpu_uuid);
    if ((e = cudaSetDevice(device)) != cudaSuccess)
        return cuda_fail(err, KDAC_E_SYSTEM, "cudaSetDevice", e);
    if ((e = cudaMalloc(dev, bytes)) != cudaSuccess)
        return cuda_fail(err, KDAC_E_SYSTEM, "cudaMalloc", e);
    cudaIpcMemHandle_t h;
    if ((e = cudaMemcpy(*dev, image, image_bytes, cudaMemcpyHostToDevice)) != cudaSuccess ||
        (e = cudaIpcGetMemHandle(&h, *dev)) != cudaSuccess) {
        cudaFree(*dev);
        *dev = NULL;
        return cuda_fail(err, KDAC_E_SYSTEM, "filling the device buffer", e);
    }
    /* cudaMemcpy is synchronous: the inputs are complete before any request
     * names them (PROTOCOL.md §Regions, synchronisation rule 1). */
    memcpy(handle, &h, sizeof(h));
    return KDAC_OK;
}

void bench_cuda_free(void *dev)
{
    cudaFree(dev);
}
