/*
 * kda_cuda.cu - the CUDA backend's C API (kda_cuda.h): device checks, the
 * scheduler counters, batch checks and the launch of the fused kernel.
 */
#include "kda_cuda.h"

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kda_fwd_sm90.h"
#include "smem.cuh"
#include "split.h"

/* Split path (split.h): segments of at least this many tokens; ALWAYS cuts down to two chunks. */
static const int32_t SPLIT_MIN_TOKENS = 2048, SPLIT_MIN_TOKENS_ALWAYS = 64;
/* AUTO splits when at least three segments per sequence fit: pass 1 costs a chain of a third of the
   length at the one-CTA rate (~1.4x the paired rate) plus ~0.09 ms (the scan, the correction, the
   launches); with two it measured level with the whole chain paired (H32 x 8192). */
static const int SPLIT_MIN_SEGS = 3;

struct kda_cuda {
    int device;
    int sm_count;
    int paired_clusters;         /* clusters of paired chains that run at once */
    kda_cuda_pairing pairing;
    kda_cuda_split split;
    char name[256];
    kda_sched_counters *sched;   /* device memory, zeroed once; the kernel resets it */
    float *split_states;         /* device: the split path's scratch states (kda_split_scratch_states) */
    kda_seq *split_table;        /* device: its descriptors (kda_split_table_entries) */
    int32_t *split_counts;       /* device: their two counts */
    uint16_t *split_outputs;     /* device: the outputs scratch of the correction, NULL when none */
    int64_t split_output_alloc;  /* its size in bf16 values */
    int64_t split_output_elems;  /* how much of it the split path uses (kda_cuda_set_split_outputs) */
    uint64_t device_bytes;       /* all of the above in device memory */
};

static int cuda_fail(kda_error *err, cudaError_t e, const char *what)
{
    return kda_fail(err, KDA_EDEVICE, "%s: %s", what, cudaGetErrorString(e));
}

extern "C" int kda_cuda_create(int device, kda_cuda **out, kda_error *err)
{
    return kda_cuda_create_with_scratch(device, KDA_CUDA_SPLIT_SCRATCH_DEFAULT, out, err);
}

extern "C" int kda_cuda_create_with_scratch(int device, uint64_t split_scratch_bytes, kda_cuda **out,
                                            kda_error *err)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice || (e == cudaSuccess && count == 0))
        return kda_fail(err, KDA_ENOTSUP, "no GPU: %s",
                        e == cudaErrorInsufficientDriver
                            ? "no NVIDIA driver is loaded, or it is older than this CUDA runtime"
                            : "the NVIDIA driver sees no device");
    if (e != cudaSuccess)
        return cuda_fail(err, e, "cudaGetDeviceCount");
    if (device < 0 || device >= count)
        return kda_fail(err, KDA_ENOTSUP, "CUDA device %d does not exist (%d present)", device, count);
    cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, device)) != cudaSuccess)
        return cuda_fail(err, e, "cudaGetDeviceProperties");
    if (prop.major != 9)
        return kda_fail(err, KDA_ENOTSUP, "%s is sm_%d%d; the fused kernel needs Hopper (sm_90)",
                        prop.name, prop.major, prop.minor);
    if (prop.sharedMemPerBlockOptin < kda_fwd_smem_bytes())
        return kda_fail(err, KDA_ENOTSUP, "%s offers %zu bytes of shared memory per block; the kernel needs %zu",
                        prop.name, (size_t)prop.sharedMemPerBlockOptin, kda_fwd_smem_bytes());
    if ((e = cudaSetDevice(device)) != cudaSuccess)
        return cuda_fail(err, e, "cudaSetDevice");
    if ((e = kda_fwd_set_attributes()) != cudaSuccess || (e = kda_split_set_attributes()) != cudaSuccess)
        return cuda_fail(err, e, "cudaFuncSetAttribute");

    kda_cuda *cuda = static_cast<kda_cuda *>(calloc(1, sizeof *cuda));
    if (!cuda)
        return kda_fail(err, KDA_ENOMEM, "no memory for the CUDA backend");
    cuda->device = device;
    cuda->sm_count = prop.multiProcessorCount;
    if ((e = kda_fwd_max_paired_clusters(&cuda->paired_clusters)) != cudaSuccess) {
        free(cuda);
        return cuda_fail(err, e, "cudaOccupancyMaxActiveClusters");
    }
    snprintf(cuda->name, sizeof cuda->name, "%s", prop.name);
    cuda->split_output_alloc = cuda->split_output_elems = int64_t(split_scratch_bytes / sizeof(uint16_t));
    const size_t states = kda_split_scratch_states(cuda->sm_count), entries = kda_split_table_entries(cuda->sm_count);
    const size_t sizes[5] = {sizeof *cuda->sched, states * KDA_HEAD_DIM * KDA_HEAD_DIM * sizeof(float),
                             entries * sizeof(kda_seq), 2 * sizeof(int32_t),
                             size_t(cuda->split_output_alloc) * sizeof(uint16_t)};
    void **ptrs[5] = {(void **)&cuda->sched, (void **)&cuda->split_states, (void **)&cuda->split_table,
                      (void **)&cuda->split_counts, (void **)&cuda->split_outputs};
    e = cudaSuccess;
    for (int i = 0; i < 5 && e == cudaSuccess; i++) {
        if (sizes[i] && (e = cudaMalloc(ptrs[i], sizes[i])) == cudaSuccess)
            cuda->device_bytes += sizes[i];
    }
    if (e != cudaSuccess || (e = cudaMemset(cuda->sched, 0, sizeof *cuda->sched)) != cudaSuccess ||
        (e = cudaDeviceSynchronize()) != cudaSuccess) {
        kda_cuda_destroy(cuda);
        return kda_fail(err, KDA_EDEVICE, "allocating the scheduler counters and the split path's scratch "
                        "(%llu MiB of outputs): %s", (unsigned long long)(split_scratch_bytes >> 20),
                        cudaGetErrorString(e));
    }
    *out = cuda;
    return KDA_OK;
}

extern "C" void kda_cuda_destroy(kda_cuda *cuda)
{
    if (!cuda)
        return;
    cudaFree(cuda->sched);
    cudaFree(cuda->split_states);
    cudaFree(cuda->split_table);
    cudaFree(cuda->split_counts);
    cudaFree(cuda->split_outputs);
    free(cuda);
}

extern "C" const char *kda_cuda_device_name(const kda_cuda *cuda) { return cuda->name; }
extern "C" int kda_cuda_sm_count(const kda_cuda *cuda) { return cuda->sm_count; }
extern "C" int kda_cuda_paired_clusters(const kda_cuda *cuda) { return cuda->paired_clusters; }
extern "C" void kda_cuda_set_pairing(kda_cuda *cuda, kda_cuda_pairing pairing) { cuda->pairing = pairing; }
extern "C" void kda_cuda_set_split(kda_cuda *cuda, kda_cuda_split split) { cuda->split = split; }
extern "C" void kda_cuda_set_split_outputs(kda_cuda *cuda, int64_t elems)
{
    cuda->split_output_elems = elems < 0 || elems > cuda->split_output_alloc ? cuda->split_output_alloc : elems;
}
extern "C" uint64_t kda_cuda_device_bytes(const kda_cuda *cuda) { return cuda->device_bytes; }
extern "C" uint64_t kda_cuda_split_scratch_bytes(const kda_cuda *cuda)
{
    return uint64_t(cuda->split_output_alloc) * sizeof(uint16_t);
}

__global__ void store_word_kernel(unsigned long long *const *dst, const unsigned long long *src)
{
    unsigned long long *to = *(unsigned long long *const volatile *)dst;
    if (!to)
        return;
    __threadfence_system();
    const unsigned long long v = *(volatile const unsigned long long *)src;
    *(volatile unsigned long long *)to = v;
    __threadfence_system();
}

extern "C" int kda_cuda_store_word(uint64_t *const *dst, const uint64_t *src, void *stream, kda_error *err)
{
    if (!dst || !src || ((uintptr_t)dst | (uintptr_t)src) % 8)
        return kda_fail(err, KDA_EINVAL, "kda_cuda_store_word: NULL or unaligned word");
    store_word_kernel<<<1, 1, 0, (cudaStream_t)stream>>>((unsigned long long *const *)dst,
                                                          (const unsigned long long *)src);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? KDA_OK : cuda_fail(err, e, "kda_cuda_store_word");
}

extern "C" int kda_cuda_batch_check(const kda_pool *pool, const kda_seq *seqs, int64_t nseqs, kda_error *err)
{
    int rc = kda_batch_check(pool, seqs, nseqs, err);
    if (rc != KDA_OK)
        return rc;
    if ((int64_t)nseqs * pool->heads > UINT32_MAX)
        return kda_fail(err, KDA_EINVAL, "%lld sequences x %d heads exceed the kernel's work-item range",
                        (long long)nseqs, pool->heads);
    for (int64_t i = 0; i < nseqs; i++) {
        const kda_seq *s = &seqs[i];
        const uintptr_t any = (uintptr_t)s->q | (uintptr_t)s->k | (uintptr_t)s->v | (uintptr_t)s->g | (uintptr_t)s->out;
        if (s->len > 0 && (any & 15))
            return kda_fail(err, KDA_EINVAL, "seqs[%lld]: q, k, v, g and out must be 16-byte aligned", (long long)i);
        if (s->len > INT32_MAX - kda::C)
            return kda_fail(err, KDA_EINVAL, "seqs[%lld]: %lld tokens exceed the kernel's range",
                            (long long)i, (long long)s->len);
    }
    return KDA_OK;
}

/* The fused kernel over the first *p.nseqs of at most max_seqs descriptors: paired chains or one CTA each. */
static cudaError_t launch_fused(const kda_cuda *cuda, const kda_fwd_params &p, int32_t max_seqs, cudaStream_t s)
{
    const int64_t items = (int64_t)max_seqs * p.heads;
    const bool paired = cuda->paired_clusters > 0 && cuda->pairing != KDA_CUDA_PAIRING_OFF &&
                        (cuda->pairing == KDA_CUDA_PAIRING_ALWAYS || items <= cuda->paired_clusters);
    if (paired)
        return kda_fwd_launch_paired(p, items < cuda->paired_clusters ? (int)items : cuda->paired_clusters, s);
    return kda_fwd_launch(p, items < cuda->sm_count ? (int)items : cuda->sm_count, s);
}

extern "C" int kda_cuda_prefill(kda_cuda *cuda, const kda_pool *pool, const kda_seq *seqs_dev,
                                const int32_t *nseqs_dev, int32_t max_seqs, void *stream, kda_error *err)
{
    if (!cuda || !pool || !pool->state || !seqs_dev || !nseqs_dev || max_seqs < 0)
        return kda_fail(err, KDA_EINVAL, "kda_cuda_prefill: missing pool, descriptors or count");
    if (pool->heads < 1 || pool->heads > KDA_MAX_HEADS)
        return kda_fail(err, KDA_EINVAL, "pool heads %d is outside [1, %d]", pool->heads, KDA_MAX_HEADS);
    if (max_seqs == 0)
        return KDA_OK;
    kda_fwd_params p;
    p.seqs = seqs_dev;
    p.nseqs = nseqs_dev;
    p.state = pool->state;
    p.scratch = nullptr;
    p.heads = pool->heads;
    p.state_is_bf16 = pool->dtype == KDA_DTYPE_BF16;
    p.sched = cuda->sched;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool always = cuda->split == KDA_CUDA_SPLIT_ALWAYS;
    const int segs = cuda->split == KDA_CUDA_SPLIT_OFF ? 0
                   : kda_split_segments(cuda->sm_count, max_seqs, pool->heads, always ? 2 : SPLIT_MIN_SEGS);
    cudaError_t e;
    if (segs == 0) {
        e = launch_fused(cuda, p, max_seqs, s);
    } else {   /* split.h: plan, pass 1, scan, correction, pass 3 */
        kda_split_args a;
        a.max_seqs = max_seqs;
        a.segs = segs;
        a.min_tokens = always ? SPLIT_MIN_TOKENS_ALWAYS : SPLIT_MIN_TOKENS;
        a.qeff = cuda->split_outputs;
        a.qeff_elems = cuda->split_output_elems;
        const int32_t units = max_seqs * segs;
        kda_fwd_params pass = p;
        pass.scratch = cuda->split_states;
        e = kda_split_plan(p, a, cuda->split_table, cuda->split_counts, s);
        if (e == cudaSuccess) {
            pass.seqs = cuda->split_table;
            pass.nseqs = cuda->split_counts;
            e = launch_fused(cuda, pass, 2 * units, s);
        }
        if (e == cudaSuccess)
            e = kda_split_scan(p, a, cuda->split_states, s);
        if (e == cudaSuccess)
            e = kda_split_correct(p, a, cuda->split_table, cuda->split_states, cuda->sm_count, s);
        if (e == cudaSuccess) {
            pass.seqs = cuda->split_table + 2 * units;
            pass.nseqs = cuda->split_counts + 1;
            e = launch_fused(cuda, pass, units, s);
        }
    }
    return e == cudaSuccess ? KDA_OK : cuda_fail(err, e, "launching the KDA kernel");
}
