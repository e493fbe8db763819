/*
 * consumer.cuh - warpgroups 2 and 3: the serial chain of one (sequence, head).
 *
 * Each consumer warpgroup owns 64 of the state's 128 V rows as an fp32 wgmma
 * accumulator, resident in registers for the whole sequence (paired chains:
 * the one consumer warpgroup of each CTA of the cluster owns the half of the
 * CTA's rank).  In the layout
 * of a 64 x N accumulator, warp w holds rows 16w + g and 16w + g + 8
 * (g = lane / 4) and, per 8-column tile n, columns 8n + 2(lane % 4) + {0, 1}.
 *
 * Per chunk (V-major state S[v][k], docs/kda.md, "Chunks"; the operands are
 * built from raw q and k, with the norms as per-token factors: smem.cuh):
 *   1  S = S diag(e^c), then [P | O1]^T = S . [kd | qd]^T
 *                                                     m64 n64 k128   A: state, registers
 *   2  Uin^T = b n V^T - b n^2 P^T                    registers
 *   3  U^T = Uin^T . INV^T                            m64 n32 k32    A: Uin^T, registers
 *   4  S = (S + U^T . ki) diag(e^tail)                m64 n128 k32   A: U^T, registers; ki N-major
 *      O^T = O1^T + U^T . Mqk^T                       m64 n32 k32
 * then O, times scale / |q_t|, is stored as bf16 (through the stage's value
 * tile, for whole-row stores), and after the item's last chunk S goes back
 * to its pool slot (in place: the slot is read once at the first chunk).
 */
#pragma once

#include "kda.h"
#include "params.h"
#include "profile.cuh"
#include "ptx.cuh"
#include "smem.cuh"

namespace kda {

/* One consumer thread's view: which state rows and columns its registers hold. */
struct ConsumerLane {
    int row0;   /* V rows row0 and row0 + 8 */
    int col;    /* within each 8-column tile: columns col, col + 1 */
};

/* Builds the A fragments (bf16) of one 16-column K slice from an fp32 accumulator. */
__device__ __forceinline__ void acc_to_a(const float *acc16x16, uint32_t (&a)[4])
{
    a[0] = pack_bf16x2(acc16x16[0], acc16x16[1]);
    a[1] = pack_bf16x2(acc16x16[2], acc16x16[3]);
    a[2] = pack_bf16x2(acc16x16[4], acc16x16[5]);
    a[3] = pack_bf16x2(acc16x16[6], acc16x16[7]);
}

/* S = S diag(f): this thread's 64 state values times the factors of their columns (key dims). */
__device__ __forceinline__ void scale_columns(float (&acc)[64], const float *f, ConsumerLane ln)
{
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
        const float2 s = *reinterpret_cast<const float2 *>(&f[8 * nt + ln.col]);
        acc[4 * nt + 0] *= s.x;
        acc[4 * nt + 1] *= s.y;
        acc[4 * nt + 2] *= s.x;
        acc[4 * nt + 3] *= s.y;
    }
}

/*
 * Where an item's state lives: the pool slot, or (split path, params.h) an fp32
 * scratch slot.  Element (v, k) of the head's state is at base + v * D + k.
 */
struct StateRef {
    void *base;
    bool bf16;
};
__device__ __forceinline__ StateRef state_ref(const kda_fwd_params &p, const kda_seq &desc, int head, bool scratch)
{
    if (scratch)
        return StateRef{p.scratch + (int64_t(desc.reserved) * p.heads + head) * int64_t(D * D), false};
    const int64_t at = (desc.slot * p.heads + head) * int64_t(D * D);
    return p.state_is_bf16 ? StateRef{static_cast<uint16_t *>(p.state) + at, true}
                           : StateRef{static_cast<float *>(p.state) + at, false};
}

/* Loads this thread's 64 values of the item's initial state: its slot, zeros, or the identity. */
__device__ __forceinline__ void load_state(float (&acc)[64], const kda_fwd_params &p, const kda_seq &desc, int head,
                                           ConsumerLane ln)
{
    const uint32_t flags = desc.flags;
    const StateRef s = state_ref(p, desc, head, flags & KDA_SEQ_LOAD_SCRATCH);
    const bool zero = flags & (KDA_SEQ_ZERO_STATE | KDA_SEQ_IDENTITY_STATE), identity = flags & KDA_SEQ_IDENTITY_STATE;
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int row = ln.row0 + 8 * half, col = 8 * nt + ln.col;
            const int64_t at = int64_t(row) * D + col;
            float2 v = make_float2(identity && row == col ? 1.0f : 0.0f, identity && row == col + 1 ? 1.0f : 0.0f);
            if (!zero) {
                if (s.bf16) {
                    const uint32_t w = *reinterpret_cast<const uint32_t *>(static_cast<const uint16_t *>(s.base) + at);
                    v = make_float2(bf16_lo(w), bf16_hi(w));
                } else {
                    v = *reinterpret_cast<const float2 *>(static_cast<const float *>(s.base) + at);
                }
            }
            acc[4 * nt + 2 * half] = v.x;
            acc[4 * nt + 2 * half + 1] = v.y;
        }
    }
}

__device__ __forceinline__ void store_state(const float (&acc)[64], const kda_fwd_params &p, const kda_seq &desc,
                                            int head, ConsumerLane ln)
{
    const StateRef s = state_ref(p, desc, head, desc.flags & KDA_SEQ_STORE_SCRATCH);
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int64_t at = int64_t(ln.row0 + 8 * half) * D + 8 * nt + ln.col;
            const float x = acc[4 * nt + 2 * half], y = acc[4 * nt + 2 * half + 1];
            if (s.bf16)
                *reinterpret_cast<uint32_t *>(static_cast<uint16_t *>(s.base) + at) = pack_bf16x2(x, y);
            else
                *reinterpret_cast<float2 *>(static_cast<float *>(s.base) + at) = make_float2(x, y);
        }
    }
}

/* Consumer of state half `wg` (V rows 64 wg ..), thread `tid` of it. */
template <bool PAIRED>
__device__ __forceinline__ void consumer_main(SharedStorage &sm, const kda_fwd_params &p, int wg, int tid)
{
    const int warp = tid >> 5, lane = tid & 31;
    const ConsumerLane ln{wg * ROWS_PER_CONSUMER + warp * 16 + (lane >> 2), 2 * (lane & 3)};
    const int64_t stride = int64_t(p.heads) * D;     /* elements between tokens */

    float acc[64];   /* S: n-tile nt = state columns (key dims) 8nt .. 8nt + 7 */
    float ot[16];    /* O^T: n-tile nt = output tokens 8nt .. 8nt + 7 */
    float pq[32];    /* [P^T | O1^T]: n-tiles 0..3 = P^T, 4..7 = O1^T */
    float u[16];     /* U^T */
    uint16_t *out = nullptr;   /* null: the item's outputs are not stored (split path) */
    uint32_t v_keep = ~0u;     /* 0: the values read as zeros (an identity item, split path) */
#pragma unroll
    for (int i = 0; i < 64; i++)
        acc[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++)
        ot[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i++)
        pq[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++)
        u[i] = 0.0f;

    PROF_START(wg == 0 && tid == 0);
    for (uint32_t n = 0;; n++) {
        const StageUse use = stage_use<PAIRED>(n);
        PrepStage &st = sm.prep[use.index];
        mbar_wait<PAIRED>(&sm.full[use.index], use.phase);
        PROF_MARK(PROF_C_FULLWAIT);
        const ChunkHeader hdr = st.hdr;
        if (hdr.flags & CHUNK_END)
            break;
        PROF_COUNT(PROF_CHUNKS);
        if (hdr.flags & CHUNK_FIRST) {
            const kda_seq &desc = p.seqs[hdr.seq];
            out = desc.out;
            v_keep = desc.flags & KDA_SEQ_IDENTITY_STATE ? 0u : ~0u;
            load_state(acc, p, desc, hdr.head, ln);
            PROF_MARK(PROF_C_STATE);
        }

        /* 1: S = S e^c, [P | O1]^T = S . [kd | qd]^T */
        scale_columns(acc, st.gam_mid, ln);
        uint32_t a1[D / 16][4];
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++)
            acc_to_a(&acc[8 * ks], a1[ks]);
        fence_operands(pq);
        wgmma_fence();
        const uint64_t kq_desc = sw128_desc(st.kq.data);
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++)
            wgmma_m64n64k16_rs(pq, a1[ks], desc_advance(kq_desc, st.kq.kslice_offset(ks)), ks > 0);
        wgmma_commit();
        /* V^T at this thread's (row, token) positions while step 1 runs: two ldmatrix.trans of the
           value tile give, per 8-token tile nt, bf16 pairs (tokens 2t, 2t+1) of rows row0 (.x), row0+8 (.y) */
        uint2 vt[C / 8];
#pragma unroll
        for (int call = 0; call < 2; call++) {
            const int mi = lane >> 3, nt = 2 * call + (mi >> 1), half = mi & 1;
            uint32_t r[4];
            ldmatrix_x4_trans(r, st.v.at(8 * nt + (lane & 7), ln.row0 - (lane >> 2) + 8 * half));
            vt[2 * call] = make_uint2(r[0] & v_keep, r[1] & v_keep);
            vt[2 * call + 1] = make_uint2(r[2] & v_keep, r[3] & v_keep);
        }
        wgmma_wait<0>();
        fence_operands(pq);
        PROF_MARK(PROF_C_STEP1);

        /* 2: Uin^T = b n V^T - b n^2 P^T */
#pragma unroll
        for (int nt = 0; nt < C / 8; nt++) {
            const float2 bn = *reinterpret_cast<const float2 *>(&st.bn[8 * nt + ln.col]);
            const float2 bn2 = *reinterpret_cast<const float2 *>(&st.bn2[8 * nt + ln.col]);
            pq[4 * nt + 0] = bn.x * bf16_lo(vt[nt].x) - bn2.x * pq[4 * nt + 0];
            pq[4 * nt + 1] = bn.y * bf16_hi(vt[nt].x) - bn2.y * pq[4 * nt + 1];
            pq[4 * nt + 2] = bn.x * bf16_lo(vt[nt].y) - bn2.x * pq[4 * nt + 2];
            pq[4 * nt + 3] = bn.y * bf16_hi(vt[nt].y) - bn2.y * pq[4 * nt + 3];
        }

        /* 3: U^T = Uin^T . INV^T */
        uint32_t a3[C / 16][4];
#pragma unroll
        for (int ks = 0; ks < C / 16; ks++)
            acc_to_a(&pq[8 * ks], a3[ks]);
        fence_operands(u);
        wgmma_fence();
        const uint64_t inv_desc = sw64_desc(st.inv.data);
#pragma unroll
        for (int ks = 0; ks < C / 16; ks++)
            wgmma_m64n32k16_rs(u, a3[ks], desc_advance(inv_desc, st.inv.kslice_offset(ks)), ks > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(u);
        PROF_MARK(PROF_C_STEP23);

        /* 4: S = (S + U^T . ki) e^tail, O^T = O1^T + U^T . Mqk^T */
#pragma unroll
        for (int i = 0; i < 16; i++)
            ot[i] = pq[16 + i];
        uint32_t a4[C / 16][4];
#pragma unroll
        for (int ks = 0; ks < C / 16; ks++)
            acc_to_a(&u[8 * ks], a4[ks]);
        fence_operands(acc);
        fence_operands(ot);
        wgmma_fence();
        const uint64_t ki_desc = sw128_nmajor_desc(st.ki.data, st.ki.BLOCK_BYTES), mqk_desc = sw64_desc(st.mqk.data);
#pragma unroll
        for (int ks = 0; ks < C / 16; ks++) {
            wgmma_m64n128k16_rs_nmajor(acc, a4[ks], desc_advance(ki_desc, st.ki.nmajor_kslice_offset(ks)), 1);
            wgmma_m64n32k16_rs(ot, a4[ks], desc_advance(mqk_desc, st.mqk.kslice_offset(ks)), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(acc);
        fence_operands(ot);
        scale_columns(acc, st.gam_tail, ln);
        PROF_MARK(PROF_C_STEP4);

        /* epilogue: O^T times scale / |q_t|, transposed by stmatrix into the value tile (whose rows
           are tokens, like the output's; each warpgroup reads only its own 64 columns of it), then
           stored by rows with 16-byte stores */
        uint32_t o[2][4];
#pragma unroll
        for (int nt = 0; nt < C / 8; nt++) {
            const float2 os = *reinterpret_cast<const float2 *>(&st.out_scale[8 * nt + ln.col]);
#pragma unroll
            for (int h = 0; h < 2; h++)            /* 8 x 8 matrix (nt, h): tokens 8nt.., rows 8h.. of the warp's 16 */
                o[nt / 2][2 * (nt % 2) + h] = pack_bf16x2(ot[4 * nt + 2 * h] * os.x, ot[4 * nt + 2 * h + 1] * os.y);
        }
#pragma unroll
        for (int call = 0; call < 2; call++) {
            const int m = 4 * call + (lane >> 3), nt = m / 2, h = m % 2;
            stmatrix_x4_trans(st.v.at(8 * nt + (lane & 7), ln.row0 - (lane >> 2) + 8 * h), o[call]);
        }
        named_barrier_sync(BAR_CONSUMER + wg, WG_THREADS);
        uint4 rows[2];
#pragma unroll
        for (int pass = 0; pass < 2; pass++)
            rows[pass] = *reinterpret_cast<const uint4 *>(st.v.at(tid / 8 + 16 * pass, wg * ROWS_PER_CONSUMER + (tid % 8) * 8));

        /* Every read of this stage is done: release it before the output stores, since an arrival
           with release at cluster scope waits for this thread's earlier stores to reach L2. */
        uint64_t *empty = &sm.empty[use.index];
        mbar_arrive(empty);
        if (PAIRED)                                 /* the peer's producers write into both CTAs' stage */
            mbar_arrive_cluster(cluster_addr(empty, cluster_rank() ^ 1), 1);
#pragma unroll
        for (int pass = 0; pass < 2; pass++) {
            const int i = tid / 8 + 16 * pass, col = wg * ROWS_PER_CONSUMER + (tid % 8) * 8;
            if (i < hdr.ntok && out)
                *reinterpret_cast<uint4 *>(out + (hdr.t0 + i) * stride + int64_t(hdr.head) * D + col) = rows[pass];
        }
        if (hdr.flags & CHUNK_LAST)
            store_state(acc, p, p.seqs[hdr.seq], hdr.head, ln);
        PROF_MARK(PROF_C_EPILOGUE);
    }
    PROF_FLUSH(PROF_TOTAL);
}

}  // namespace kda
