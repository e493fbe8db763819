/*
 * ptx.cuh - thin wrappers over the sm_90a instructions the fused kernel uses:
 * mbarriers, cp.async, named barriers, proxy fences, setmaxnreg, wgmma and
 * its shared-memory descriptors, the cluster's shared-memory window (remote
 * arrivals, bulk copies to the peer CTA, cluster barriers), and a few
 * fast-math primitives.
 *
 * Each wrapper is one instruction (or a predicate set-up plus one); the
 * operand lists of the wgmma shapes are spelt out in full.
 */
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace kda {

__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/* ---- mbarrier (CTA scope) ---------------------------------------------- */

__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t arrivals)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals)
                 : "memory");
}

/* Arrive with release semantics: this thread's prior writes are visible to waiters. */
__device__ __forceinline__ void mbar_arrive(uint64_t *bar)
{
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.release.cta.shared::cta.b64 state, [%0];\n}\n" ::"r"(
                     smem_u32(bar))
                 : "memory");
}

/*
 * Tests the phase of the given parity, suspending the warp until it completes
 * or the time hint (ns) runs out: waiting warps then take no issue slots from
 * the warps doing the work.
 */
template <bool CLUSTER_SCOPE = false>
__device__ __forceinline__ bool mbar_try_wait(uint64_t *bar, uint32_t parity)
{
    constexpr uint32_t SUSPEND_HINT_NS = 1000000;
    uint32_t done;
    if (CLUSTER_SCOPE)
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2, %3;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_u32(bar)), "r"(parity), "r"(SUSPEND_HINT_NS)
                     : "memory");
    else
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2, %3;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_u32(bar)), "r"(parity), "r"(SUSPEND_HINT_NS)
                     : "memory");
    return done != 0;
}

/* Waits for the phase of the given parity to complete; CLUSTER_SCOPE when the
 * arrivals that complete it come from the other CTA of a cluster too.  With
 * KDA_DEBUG_HANG_TRAP a wait that never ends traps instead of hanging the GPU
 * (debug builds only). */
template <bool CLUSTER_SCOPE = false>
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity)
{
#ifdef KDA_DEBUG_HANG_TRAP
    uint64_t spins = 0;
    while (!mbar_try_wait<CLUSTER_SCOPE>(bar, parity))
        if (++spins == (1ull << 26))
            __trap();
#else
    while (!mbar_try_wait<CLUSTER_SCOPE>(bar, parity)) {
    }
#endif
}

/* ---- cp.async (global -> shared, per thread) --------------------------- */

/* 16 bytes, both addresses 16-byte aligned; cached in L2 only. */
__device__ __forceinline__ void cp_async_16(void *smem, const void *gmem)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}

/* 4 bytes, both addresses 4-byte aligned. */
__device__ __forceinline__ void cp_async_4(void *smem, const void *gmem)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}

/* One arrival on `bar` (counted in its init count) once this thread's cp.asyncs so far complete. */
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t *bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

/* ---- the cluster: the peer CTA's shared memory ---------------------------- */

__device__ __forceinline__ uint32_t cluster_rank()
{
    uint32_t r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ uint32_t cluster_index()
{
    uint32_t r;
    asm("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    return r;
}

__device__ __forceinline__ uint32_t cluster_count()
{
    uint32_t r;
    asm("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return r;
}

/* The address in the cluster's shared window of `p`'s counterpart in CTA `rank`. */
__device__ __forceinline__ uint32_t cluster_addr(const void *p, uint32_t rank)
{
    uint32_t r;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
    return r;
}

/* `count` arrivals, with release at cluster scope, on an mbarrier of the cluster (cluster_addr). */
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0], %1;" ::"r"(bar), "r"(count)
                 : "memory");
}

/* One arrival on an mbarrier of the cluster that also expects `bytes` of async copies. */
__device__ __forceinline__ void mbar_arrive_expect_tx_cluster(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.release.cluster.shared::cluster.b64 _, [%0], %1;" ::"r"(bar),
                 "r"(bytes)
                 : "memory");
}

/* Bulk copy of `bytes` (a multiple of 16, both ends 16-byte aligned) from this CTA's shared
   memory to the cluster address `dst`, completing as transactions on the cluster mbarrier `bar`
   (in the destination CTA). */
__device__ __forceinline__ void bulk_copy_to_cluster(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar)
{
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     dst),
                 "r"(smem_u32(src)), "r"(bytes), "r"(bar)
                 : "memory");
}

/* Makes mbarrier initialisations visible to the cluster (before the cluster barrier). */
__device__ __forceinline__ void fence_mbarrier_init_cluster()
{
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/* Every thread of both CTAs. */
__device__ __forceinline__ void cluster_sync()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

/* ---- barriers and fences ------------------------------------------------ */

__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* Orders this thread's generic-proxy shared-memory writes before later
 * async-proxy (wgmma, TMA) accesses, and vice versa. */
__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

template <uint32_t REGS>
__device__ __forceinline__ void setmaxnreg_inc()
{
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

template <uint32_t REGS>
__device__ __forceinline__ void setmaxnreg_dec()
{
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}

/* Four transposed 8 x 8 bf16 matrices; lane L gives the address of row L % 8 of matrix L / 8. */
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void *row)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row)));
}

/* Four 8 x 8 bf16 matrices from mma fragments, stored transposed; lane L gives the address of
   (stored) row L % 8 of matrix L / 8, and r[i] holds this thread's pair of matrix i. */
__device__ __forceinline__ void stmatrix_x4_trans(void *row, const uint32_t (&r)[4])
{
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_u32(row)),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

/* ---- fast math ---------------------------------------------------------- */

__device__ __forceinline__ float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float fast_rcp(float x)
{
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* c ? a : b as one selp, opaque to the compiler (which may otherwise turn a chain of
   selects over a register array into a local-memory index). */
__device__ __forceinline__ float select_f32(bool c, float a, float b)
{
    float y;
    asm("{\n.reg .pred p;\nsetp.ne.u32 p, %3, 0;\nselp.f32 %0, %1, %2, p;\n}\n"
        : "=f"(y)
        : "f"(a), "f"(b), "r"(uint32_t(c)));
    return y;
}

/* bf16 is the upper half of a float: the low and high bf16 of a 32-bit pair (or one bf16, as lo). */
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

/* Two floats to a bf16x2 register, lo in the low half (round to nearest even). */
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* ---- wgmma -------------------------------------------------------------- */

/*
 * Shared-memory matrix descriptor for a K-major operand in the 128-byte
 * swizzle layout: rows of 64 bf16 (128 bytes), 8-row atoms of 1024 bytes
 * (stride-dimension byte offset), leading-dimension offset unused (1).
 * `tile` may point inside an atom to select a 16-column K slice.
 */
__device__ __forceinline__ uint64_t sw128_desc(const void *tile)
{
    const uint64_t start = (smem_u32(tile) & 0x3FFFF) >> 4;
    const uint64_t lbo = 1, sbo = 1024 >> 4, swizzle_128b = 1;
    return start | (lbo << 16) | (sbo << 32) | (swizzle_128b << 62);
}

/* The same for the 64-byte swizzle: rows of 32 bf16 (64 bytes), 8-row atoms of 512 bytes. */
__device__ __forceinline__ uint64_t sw64_desc(const void *tile)
{
    const uint64_t start = (smem_u32(tile) & 0x3FFFF) >> 4;
    const uint64_t lbo = 1, sbo = 512 >> 4, swizzle_64b = 2;
    return start | (lbo << 16) | (sbo << 32) | (swizzle_64b << 62);
}

/*
 * The same swizzle read N-major (a B operand whose rows run along K and whose
 * 128-byte rows hold 64 consecutive N): the leading-dimension offset is then
 * the step between 64-column blocks (`block_bytes`), the stride offset the
 * step between 8-row groups along K (1024).
 */
__device__ __forceinline__ uint64_t sw128_nmajor_desc(const void *tile, uint32_t block_bytes)
{
    const uint64_t start = (smem_u32(tile) & 0x3FFFF) >> 4;
    const uint64_t lbo = block_bytes >> 4, sbo = 1024 >> 4, swizzle_128b = 1;
    return start | (lbo << 16) | (sbo << 32) | (swizzle_128b << 62);
}

/* A descriptor moved `bytes` (a multiple of 16) further into its tile: the start address is the
   low field, and shared memory (< 256 KB) never carries out of it, so one add does it. */
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

/* Keeps the compiler from moving accesses of an accumulator across wgmma issue/wait. */
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

/* D[64 x 32] (+)= A[64 x 16] (registers) . B[16 x 32] (shared memory, K-major; the swizzle is the descriptor's). */
__device__ __forceinline__ void wgmma_m64n32k16_rs(float (&d)[16], const uint32_t (&a)[4],
                                                  uint64_t b_desc, int accumulate)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}

/* D[64 x 64] (+)= A[64 x 16] (registers) . B[16 x 64] (shared memory, K-major SW128). */
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4],
                                                  uint64_t b_desc, int accumulate)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}

/* D[64 x 128] (+)= A[64 x 16] (registers) . B[16 x 128] (shared memory, N-major SW128). */
__device__ __forceinline__ void wgmma_m64n128k16_rs_nmajor(float (&d)[64], const uint32_t (&a)[4],
                                                          uint64_t b_desc, int accumulate)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}

/* D[64 x 32] (+)= A[64 x 16] . B[16 x 32], both in shared memory (K-major SW128). */
__device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[16], uint64_t a_desc, uint64_t b_desc,
                                                  int accumulate)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

}  // namespace kda
