/*
 * bench_buffers.h - where kdactl bench's tensors live, per transport:
 *
 *   inline    one host image of random inputs (N(0,1), a 4 MiB draw repeated
 *             through each tensor: bench_buffers.c), sent inline by every
 *             request (outputs come back inline and are discarded);
 *   shm       one sealed memfd holding the same inputs plus an output block
 *             per (client, in-flight request), registered by every client;
 *   cuda-ipc  per client, a device allocation (cudaMalloc) with the inputs
 *             and its output blocks, registered by its CUDA IPC handle
 *             (bench_cuda.c; not supported when kdactl is built without CUDA);
 *   cuda-vmm  the same in a VMM allocation (cuMemCreate), registered by the
 *             POSIX fd it exports.
 *
 * Layout of an image: q, k, v, g as [T][H][128], T the most tokens a request
 * holds (its sequences packed back to back from token 0, as a varlen batch
 * holds them), then S beta blocks of L * H bf16, each 16-byte aligned, then
 * the output blocks, each [T][H][128] and packed the same way.  With an
 * alignment A above BENCH_PACKED (kdactl bench --align), every sequence's
 * tensors, beta block and output start at a multiple of A from the region's
 * start instead (the blocks grow by the padding).
 */
#ifndef KDACTL_BENCH_BUFFERS_H
#define KDACTL_BENCH_BUFFERS_H

#include <stdbool.h>
#include <stdint.h>

#include "kdaclient.h"

#define BENCH_PACKED 256 /* the default alignment: token blocks are multiples of it already */

static inline uint64_t bench_align(uint64_t x, uint64_t a) /* a: a power of two */
{
    return (x + a - 1) & ~(a - 1);
}

typedef enum bench_transport { BENCH_INLINE, BENCH_SHM, BENCH_CUDA_IPC, BENCH_CUDA_VMM } bench_transport;

typedef struct bench_layout {
    uint64_t tensor[4];   /* q, k, v, g */
    uint64_t beta;        /* first beta block */
    uint64_t beta_stride; /* bytes between beta blocks */
    uint64_t inputs;      /* bytes of the inputs (aligned) */
    uint64_t out_block;   /* bytes of one request's outputs */
} bench_layout;

/* What all clients share. */
typedef struct bench_data {
    bench_transport transport;
    uint32_t heads, seqs, max_len;
    bench_layout lay;
    uint8_t *image; /* the inputs, host memory */
    kdac_shm shm;   /* shm: the image plus every output block */
} bench_data;

/* One client's registration. */
typedef struct bench_region {
    uint32_t region;   /* 0 for inline */
    uint64_t out_base; /* offset of this client's first output block */
    void *dev;         /* cuda-ipc, cuda-vmm: the device allocation (bench_cuda.c) */
} bench_region;

/* Fills random inputs for requests of `seqs` sequences of at most max_len
 * tokens and max_total tokens in all (each tensor a block of max_total
 * tokens, a request's sequences packed from its start, each at a multiple of
 * align); with shm, room for nout output blocks.  Returns 0, or an exit code
 * with why set. */
int bench_data_init(bench_data *d, bench_transport t, uint32_t heads, uint32_t seqs,
                    uint32_t max_len, uint64_t max_total, uint64_t align, uint32_t nout,
                    uint64_t seed, char *why, size_t size);
void bench_data_free(bench_data *d);

/* Registers what client `index` (with `depth` requests in flight) uses.
 * Returns 0, or an exit code with err set. */
int bench_region_init(bench_region *r, const bench_data *d, kdac_client *c, uint32_t index,
                      uint32_t depth, kdac_error *err);
void bench_region_free(bench_region *r, kdac_client *c);

/* The tensors of sequence j of a request in flight slot `slot` of a client, starting `at`
 * bytes into each of the request's token blocks (after the sequences before it). */
void bench_seq_tensors(const bench_data *d, const bench_region *r, uint32_t j, uint64_t at,
                       uint32_t slot, kdac_seq *s);

#ifdef KDACTL_WITH_CUDA
/* bench_cuda.c: a device allocation of `bytes` on the GPU whose UUID is
 * gpu_uuid, starting with a copy of image[0, image_bytes): cudaMalloc and
 * its IPC handle, or (vmm) cuMemCreate and the POSIX fd it exports (the
 * caller closes it).  Returns 0 or KDAC_E_NOT_SUPPORTED / KDAC_E_SYSTEM
 * with err set. */
int bench_cuda_alloc(const char *gpu_uuid, uint64_t bytes, const void *image, uint64_t image_bytes,
                     bool vmm, void **dev, uint8_t handle[KDAC_CUDA_IPC_HANDLE_BYTES], int *fd,
                     kdac_error *err);
void bench_cuda_free(void *dev);
#endif

#endif /* KDACTL_BENCH_BUFFERS_H */
