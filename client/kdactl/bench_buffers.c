/*
 * bench_buffers.c - kdactl bench's tensors per transport (see bench_buffers.h).
 */
#include "bench_buffers.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "prefill_io.h"

static uint64_t align16(uint64_t x)
{
    return (x + 15) & ~(uint64_t)15;
}

/* N(0,1) values drawn for the first TENSOR_DRAWN of a tensor, repeated after that: the kernel's
 * time does not depend on the values, and drawing all of them (4 x 192 MiB at H = 96 x 8192
 * tokens) took ~7 s of every kdactl bench, most of a benchmark row's time on the GPU host. */
#define TENSOR_DRAWN ((size_t)2 << 20) /* values: 4 MiB, 170 tokens at H = 96 */

static void fill_tensor(uint16_t *x, size_t n, uint64_t seed)
{
    const size_t drawn = n < TENSOR_DRAWN ? n : TENSOR_DRAWN;
    random_bf16(x, drawn, seed);
    for (size_t at = drawn; at < n; at += drawn)
        memcpy(x + at, x, (n - at < drawn ? n - at : drawn) * sizeof(*x));
}

/* Packed (align BENCH_PACKED: token blocks are multiples of it already), or every sequence's
 * blocks padded to a multiple of align. */
static void layout(bench_layout *l, uint32_t heads, uint32_t seqs, uint32_t max_len, uint64_t max_total,
                   uint64_t align)
{
    const bool padded = align > BENCH_PACKED;
    uint64_t block = kdac_token_bytes(max_total, heads); /* a multiple of 256 */
    if (padded)
        block = bench_align(block + seqs * align, align);
    for (int t = 0; t < 4; t++)
        l->tensor[t] = t * block;
    l->beta = 4 * block;
    l->beta_stride = padded ? bench_align(kdac_beta_bytes(max_len, heads), align)
                            : align16(kdac_beta_bytes(max_len, heads));
    l->inputs = l->beta + seqs * l->beta_stride;
    l->out_block = block;
}

int bench_data_init(bench_data *d, bench_transport t, uint32_t heads, uint32_t seqs,
                    uint32_t max_len, uint64_t max_total, uint64_t align, uint32_t nout,
                    uint64_t seed, char *why, size_t size)
{
    memset(d, 0, sizeof(*d));
    d->shm.fd = -1;
    d->transport = t;
    d->heads = heads;
    d->seqs = seqs;
    d->max_len = max_len;
    layout(&d->lay, heads, seqs, max_len, max_total, align);
    d->image = malloc(d->lay.inputs);
    if (!d->image) {
        snprintf(why, size, "cannot allocate %llu bytes of inputs",
                 (unsigned long long)d->lay.inputs);
        return EXIT_INPUT;
    }
    for (int i = 0; i < 4; i++)
        fill_tensor((uint16_t *)(d->image + d->lay.tensor[i]), d->lay.out_block / 2,
                    seed * 16 + (uint64_t)i);
    for (uint32_t j = 0; j < seqs; j++)
        random_bf16((uint16_t *)(d->image + d->lay.beta + j * d->lay.beta_stride),
                    kdac_beta_bytes(max_len, heads) / 2, seed * 16 + 4 + j);
    if (t != BENCH_SHM)
        return EXIT_OK;
    kdac_error err;
    if (kdac_shm_create(&d->shm, d->lay.inputs + (uint64_t)nout * d->lay.out_block,
                        "kdactl-bench", &err)) {
        snprintf(why, size, "%s", err.message);
        return EXIT_INPUT;
    }
    memcpy(d->shm.base, d->image, d->lay.inputs);
    return EXIT_OK;
}

void bench_data_free(bench_data *d)
{
    if (d->shm.base)
        kdac_shm_close(&d->shm);
    free(d->image);
    d->image = NULL;
}

int bench_region_init(bench_region *r, const bench_data *d, kdac_client *c, uint32_t index,
                      uint32_t depth, kdac_error *err)
{
    memset(r, 0, sizeof(*r));
    if (d->transport == BENCH_INLINE)
        return EXIT_OK;
    if (d->transport == BENCH_SHM) {
        r->out_base = d->lay.inputs + (uint64_t)index * depth * d->lay.out_block;
        if (kdac_region_register_shm(c, d->shm.fd, d->shm.size, &r->region, err))
            return ctl_exit_code(err->code);
        return EXIT_OK;
    }
#ifdef KDACTL_WITH_CUDA
    const kdac_server_info *info = kdac_client_info(c);
    uint64_t bytes = d->lay.inputs + (uint64_t)depth * d->lay.out_block;
    uint8_t handle[KDAC_CUDA_IPC_HANDLE_BYTES];
    const bool vmm = d->transport == BENCH_CUDA_VMM;
    int fd = -1;
    if (bench_cuda_alloc(info->gpu_uuid, bytes, d->image, d->lay.inputs, vmm, &r->dev, handle, &fd,
                         err))
        return ctl_exit_code(err->code);
    r->out_base = d->lay.inputs;
    int rc = vmm ? kdac_region_register_cuda_fd(c, fd, bytes, NULL, &r->region, err)
                 : kdac_region_register_cuda(c, handle, bytes, NULL, &r->region, err);
    if (fd >= 0)
        close(fd); /* the daemon holds its own copy */
    if (rc) {
        bench_cuda_free(r->dev);
        r->dev = NULL;
        return ctl_exit_code(err->code);
    }
    return EXIT_OK;
#else
    (void)index;
    (void)depth;
    ctl_set_error(err, KDAC_E_NOT_SUPPORTED, "cuda-ipc: not supported: this kdactl was built "
                  "without CUDA");
    return EXIT_UNSUPPORTED;
#endif
}

void bench_region_free(bench_region *r, kdac_client *c)
{
    if (r->region)
        kdac_region_release(c, r->region, NULL);
#ifdef KDACTL_WITH_CUDA
    if (r->dev)
        bench_cuda_free(r->dev);
#endif
    memset(r, 0, sizeof(*r));
}

void bench_seq_tensors(const bench_data *d, const bench_region *r, uint32_t j, uint64_t at,
                       uint32_t slot, kdac_seq *s)
{
    const bench_layout *l = &d->lay;
    uint64_t beta = l->beta + j * l->beta_stride;
    kdac_tensor *in[4] = {&s->q, &s->k, &s->v, &s->g};
    if (d->transport == BENCH_INLINE) {
        for (int t = 0; t < 4; t++)
            *in[t] = kdac_tensor_inline(d->image + l->tensor[t] + at);
        s->beta = kdac_tensor_inline(d->image + beta);
        s->out = kdac_output_inline(NULL); /* returned inline, discarded */
        return;
    }
    for (int t = 0; t < 4; t++)
        *in[t] = kdac_tensor_region(r->region, l->tensor[t] + at);
    s->beta = kdac_tensor_region(r->region, beta);
    s->out = kdac_output_region(r->region, r->out_base + slot * l->out_block + at);
}
