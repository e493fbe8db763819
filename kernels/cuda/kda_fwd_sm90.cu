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
 *
 * Twin chains, the split path's pass 1 (split.h): a cluster of two CTAs of
 * four warpgroups per segment and head, whose producers work as paired
 * chains' do; rank 0's consumers run the segment from zero with its values
 * (R), rank 1's from the identity with zero values (M).  The two runs share
 * every prepared operand, so the pair costs about one paired chain.
 */
#include "kda_fwd_sm90.h"

#include "consumer.cuh"
#include "producer.cuh"
#include "scheduler.cuh"
#include "smem.cuh"

namespace kda {

template <Layout L>
__global__ void __launch_bounds__(threads(half_state(L)), 1) kda_fwd_kernel(const __grid_constant__ kda_fwd_params p)
{
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __trap();   /* built for another architecture: wgmma and setmaxnreg need sm_90a */
#else
    constexpr bool CLUSTER = clustered(L), HALF = half_state(L);
    /* Aligned by an offset from the __shared__ array (not through an integer cast), so the
       compiler keeps every access in the shared space: 32-bit addresses, LDS/STS. */
    extern __shared__ uint8_t smem_raw[];
    SharedStorage &sm = *reinterpret_cast<SharedStorage *>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));

    if (threadIdx.x == 0) {
        for (int s = 0; s < PREP_STAGES; s++) {
            mbar_init(&sm.full[s], FULL_ARRIVALS);
            mbar_init(&sm.empty[s], empty_arrivals(L));
        }
        for (int w = 0; w < PRODUCER_WGS; w++) {
            mbar_init(&sm.loaded[w], WG_THREADS);
            mbar_init(&sm.plan_turn[w], 1);
        }
        if (CLUSTER)
            fence_mbarrier_init_cluster();
    }
    if (CLUSTER)
        cluster_sync();   /* the peer's barriers exist before anything arrives on them */
    else
        __syncthreads();

    const int wg = threadIdx.x / WG_THREADS;
    if (wg < PRODUCER_WGS) {
        setmaxnreg_dec<producer_regs(HALF)>();
        producer_main<CLUSTER, L == Layout::TWINS>(sm, p, wg, threadIdx.x % WG_THREADS);
    } else {
        setmaxnreg_inc<consumer_regs(HALF)>();
        consumer_main<L>(sm, p, HALF ? int(cluster_rank()) : wg - PRODUCER_WGS, threadIdx.x % WG_THREADS);
    }
    if (CLUSTER) {
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
    const void *const kernels[] = {reinterpret_cast<const void *>(kda::kda_fwd_kernel<kda::Layout::SOLO>),
                                   reinterpret_cast<const void *>(kda::kda_fwd_kernel<kda::Layout::PAIRED>),
                                   reinterpret_cast<const void *>(kda::kda_fwd_kernel<kda::Layout::TWINS>)};
    cudaError_t e = cudaSuccess;
    for (const void *kernel : kernels)
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kda::SMEM_BYTES));
    return e;
}

/* The launch of `clusters` clusters of two CTAs (paired or twin chains). */
static cudaLaunchConfig_t cluster_config(int clusters, int threads, cudaStream_t stream, cudaLaunchAttribute *attr)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(2 * clusters);
    cfg.blockDim = dim3(threads);
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
    const cudaLaunchConfig_t cfg = cluster_config(1, kda::threads(true), nullptr, &attr);
    return cudaOccupancyMaxActiveClusters(clusters, kda::kda_fwd_kernel<kda::Layout::PAIRED>, &cfg);
}

cudaError_t kda_fwd_max_twin_clusters(int *clusters)
{
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_config(1, kda::threads(false), nullptr, &attr);
    return cudaOccupancyMaxActiveClusters(clusters, kda::kda_fwd_kernel<kda::Layout::TWINS>, &cfg);
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
    kda::kda_fwd_kernel<kda::Layout::SOLO><<<ctas, kda::threads(false), kda::SMEM_BYTES, stream>>>(p);
    return cudaGetLastError();
}

cudaError_t kda_fwd_launch_paired(const kda_fwd_params &p, int clusters, cudaStream_t stream)
{
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_config(clusters, kda::threads(true), stream, &attr);
    return cudaLaunchKernelEx(&cfg, kda::kda_fwd_kernel<kda::Layout::PAIRED>, p);
}

cudaError_t kda_fwd_launch_twins(const kda_fwd_params &p, int clusters, cudaStream_t stream)
{
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_config(clusters, kda::threads(false), stream, &attr);
    return cudaLaunchKernelEx(&cfg, kda::kda_fwd_kernel<kda::Layout::TWINS>, p);
}
