/*
 * kda_fwd_sm90.cu - the fused KDA prefill kernel for Hopper (sm_90a).
 *
 * One persistent CTA per SM, four warpgroups:
 *   WG0, WG1 producers: load chunks (cp.async) and prepare, each on its
 *            own, the state-free operands of every other chunk (gates,
 *            decayed q/k, norms, L, Mqk, (I+L)^-1)
 *   WG2, WG3 consumers: the serial chain, each owning 64 fp32 state rows
 *            in registers, wgmma for every product
 * connected by a 3-stage ring of prepared chunks with full/empty mbarriers.
 * Work items are (sequence, head) chains from a device counter
 * (scheduler.cuh); the pool slot is read at an item's first chunk and
 * written after its last, so the update is in place.
 *
 * Paired chains, when the chains are at most the clusters the GPU runs at
 * once: a cluster of two CTAs per chain, three warpgroups each (WG0, WG1
 * producers, WG2 the consumer of the state half of the CTA's rank).  The
 * four producers prepare every fourth chunk each and bulk-copy each stage
 * into the peer CTA too, so a chunk costs what the consumers need rather
 * than what two producers can prepare.
 */
#include "kda_fwd_sm90.h"

#include "consumer.cuh"
#include "producer.cuh"
#include "scheduler.cuh"
#include "smem.cuh"

namespace kda {

template <bool PAIRED>
__global__ void __launch_bounds__(threads(PAIRED), 1) kda_fwd_kernel(const __grid_constant__ kda_fwd_params p)
{
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __trap();   /* built for another architecture: wgmma and setmaxnreg need sm_90a */
#else
    /* Aligned by an offset from the __shared__ array (not through an integer cast), so the
       compiler keeps every access in the shared space: 32-bit addresses, LDS/STS. */
    extern __shared__ uint8_t smem_raw[];
    SharedStorage &sm = *reinterpret_cast<SharedStorage *>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));

    if (threadIdx.x == 0) {
        for (int s = 0; s < PREP_STAGES; s++) {
            mbar_init(&sm.full[s], FULL_ARRIVALS);
            mbar_init(&sm.empty[s], EMPTY_ARRIVALS);
        }
        for (int w = 0; w < PRODUCER_WGS; w++) {
            mbar_init(&sm.loaded[w], WG_THREADS);
            mbar_init(&sm.plan_turn[w], 1);
        }
        if (PAIRED)
            fence_mbarrier_init_cluster();
    }
    if (PAIRED)
        cluster_sync();   /* the peer's barriers exist before anything arrives on them */
    else
        __syncthreads();

    const int wg = threadIdx.x / WG_THREADS;
    if (wg < PRODUCER_WGS) {
        setmaxnreg_dec<producer_regs(PAIRED)>();
        producer_main<PAIRED>(sm, p, wg, threadIdx.x % WG_THREADS);
    } else {
        setmaxnreg_inc<consumer_regs(PAIRED)>();
        consumer_main<PAIRED>(sm, p, PAIRED ? int(cluster_rank()) : wg - PRODUCER_WGS, threadIdx.x % WG_THREADS);
    }
    if (PAIRED) {
        cluster_sync();   /* neither CTA leaves while the other may still arrive on or copy into it */
    } else {
        __syncthreads();
        if (threadIdx.x == 0)
            sched_finish(p);
    }
#endif
}

}  // namespace kda

size_t kda_fwd_smem_bytes() { return kda::SMEM_BYTES; }

cudaError_t kda_fwd_set_attributes()
{
    cudaError_t e = cudaFuncSetAttribute(kda::kda_fwd_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(kda::SMEM_BYTES));
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kda::kda_fwd_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 int(kda::SMEM_BYTES));
    return e;
}

/* The launch of `clusters` paired-chain clusters (two CTAs each). */
static cudaLaunchConfig_t paired_config(int clusters, cudaStream_t stream, cudaLaunchAttribute *attr)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(2 * clusters);
    cfg.blockDim = dim3(kda::threads(true));
    cfg.dynamicSmemBytes = kda::SMEM_BYTES;
    cfg.stream = stream;
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = 2;
    attr->val.clusterDim.y = 1;
    attr->val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cfg;
}

cudaError_t kda_fwd_max_paired_clusters(int *clusters)
{
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = paired_config(1, nullptr, &attr);
    return cudaOccupancyMaxActiveClusters(clusters, kda::kda_fwd_kernel<true>, &cfg);
}

#ifdef KDA_PROFILE
cudaError_t kda_fwd_profile(unsigned long long *out, bool reset)
{
    cudaError_t e = cudaMemcpyFromSymbol(out, kda::g_profile, sizeof(unsigned long long) * kda::PROF_SLOTS);
    static const unsigned long long zeros[kda::PROF_SLOTS] = {};
    if (e == cudaSuccess && reset)
        e = cudaMemcpyToSymbol(kda::g_profile, zeros, sizeof zeros);
    return e;
}
#endif

cudaError_t kda_fwd_launch(const kda_fwd_params &p, int ctas, cudaStream_t stream)
{
    kda::kda_fwd_kernel<false><<<ctas, kda::threads(false), kda::SMEM_BYTES, stream>>>(p);
    return cudaGetLastError();
}

cudaError_t kda_fwd_launch_paired(const kda_fwd_params &p, int clusters, cudaStream_t stream)
{
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = paired_config(clusters, stream, &attr);
    return cudaLaunchKernelEx(&cfg, kda::kda_fwd_kernel<true>, p);
}
