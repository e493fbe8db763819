/*
 * kda_fwd_sm90.cu - the fused KDA prefill kernel for Hopper (sm_90a).
 *
 * One persistent CTA per SM, four warpgroups:
 *   WG0, WG1 producers: load chunks (cp.async) and prepare, together, the
 *            state-free operands of each chunk (gates, decayed q/k, norms,
 *            L, Mqk, (I+L)^-1)
 *   WG2, WG3 consumers: the serial chain, each owning 64 fp32 state rows
 *            in registers, wgmma for every product
 * connected by a 2-stage ring of prepared chunks with full/empty mbarriers.
 * Work items are (sequence, head) chains from a device counter
 * (scheduler.cuh); the pool slot is read at an item's first chunk and
 * written after its last, so the update is in place.
 */
#include "kda_fwd_sm90.h"

#include "consumer.cuh"
#include "producer.cuh"
#include "scheduler.cuh"
#include "smem.cuh"

namespace kda {

__global__ void __launch_bounds__(THREADS, 1) kda_fwd_kernel(const __grid_constant__ kda_fwd_params p)
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
            mbar_init(&sm.full[s], 2 * WG_THREADS);   /* a warpgroup's arrivals and its value copies' */
            mbar_init(&sm.empty[s], WG_THREADS * CONSUMER_WGS);
        }
        for (int w = 0; w < PRODUCER_WGS; w++) {
            mbar_init(&sm.loaded[w], WG_THREADS);
            mbar_init(&sm.plan_turn[w], 1);
        }
    }
    __syncthreads();

    const int wg = threadIdx.x / WG_THREADS;
    if (wg < PRODUCER_WGS) {
        setmaxnreg_dec<PRODUCER_REGS>();
        producer_main(sm, p, wg, threadIdx.x % WG_THREADS);
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        consumer_main(sm, p, wg - PRODUCER_WGS, threadIdx.x % WG_THREADS);
    }
    __syncthreads();
    if (threadIdx.x == 0)
        sched_finish(p);
#endif
}

}  // namespace kda

size_t kda_fwd_smem_bytes() { return kda::SMEM_BYTES; }
int kda_fwd_threads() { return kda::THREADS; }

cudaError_t kda_fwd_set_attributes()
{
    return cudaFuncSetAttribute(kda::kda_fwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                int(kda::SMEM_BYTES));
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

cudaError_t kda_fwd_launch(const kda_fwd_params &p, int grid, cudaStream_t stream)
{
    kda::kda_fwd_kernel<<<grid, kda::THREADS, kda::SMEM_BYTES, stream>>>(p);
    return cudaGetLastError();
}
