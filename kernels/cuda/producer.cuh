/*
 * producer.cuh - warpgroups 0 and 1: each loads and prepares, on its own,
 * every other chunk: everything of a chunk that does not depend on the state.
 *
 * Warpgroup w prepares chunks w, w + 2, w + 4, ... of the CTA's sequence of
 * chunks, each into prepared stage n % 3.  The two run about a chunk apart,
 * so the latency of one's phases hides behind the other's work; they share
 * only the load cursor, which their thread 0s advance in turns.  Paired
 * chains (two CTAs of a cluster per chain, each holding half the state):
 * the four producer warpgroups of the pair prepare every fourth chunk each,
 * into stage n % 4, and each prepared stage is bulk-copied to the peer
 * CTA's same stage.
 *
 * Per chunk n (C = 32 tokens of one (sequence, head)), with c the gate prefix
 * sum at the chunk's middle token (per key dim) so every exponent below stays
 * within e^+-80 (docs/kda.md, "Chunks").  In the elementwise passes thread p
 * (0..127) of the warpgroup owns key dims 4 (p % 32) .. + 3 over quarter
 * chunk p / 32 (8 tokens):
 *
 *   plan     a thread of warp 1, in its turn and while warp 0 inverts, plans
 *            the chunk after the warpgroup's next one
 *   values   once the consumers free the stage: the chunk's values by cp.async
 *            straight into the stage's value tile
 *   gates    G_t = sum_{s<=t} lower_bound * sigmoid(e^A_log (g_sd + dt_bias_d)),
 *            within the thread's quarter, in log2 units, in registers
 *   tiles    kd = k e^(G-c), qd = q e^(G-c), ki = k e^(c-G), e^c,
 *            e^(G_last - c) (raw q, k: no norms yet), and |q_t|^2 by warp
 *            shuffles
 *   L, Mqk   [kd; qd] . ki^T by wgmma (64 x 32 x 128).  The diagonal of
 *            kd ki^T is |k_t|^2 (the gates cancel), which gives the k norms;
 *            L^ = diag(b n^2) strictly_lower(kd ki^T), Mqk = lower_incl(qd ki^T).
 *            While it runs, the raw rows of the warpgroup's next chunk are
 *            requested.
 *   inverse  (I + L^)^-1 in fp32: the two 16 x 16 diagonal blocks by forward
 *            substitution (one warp, a column per lane), then the block
 *            below them
 *
 * smem.cuh (PrepStage) gives the algebra that lets the norms come last and
 * the state update use ki.  Centring on the middle token splits the chunk
 * cleanly: G_t - c is the thread's own prefix sum plus a sum of whole
 * quarter totals.
 */
#pragma once

#include "kda.h"
#include "params.h"
#include "profile.cuh"
#include "ptx.cuh"
#include "scheduler.cuh"
#include "smem.cuh"

namespace kda {

constexpr float LOG2E = 1.4426950408889634f;
constexpr int QUARTER = C / 4;       /* tokens per producer thread (and per warp) */

__device__ __forceinline__ float sigmoid(float x) { return fast_rcp(1.0f + fast_exp2(-x * LOG2E)); }

/*
 * The thread index, hidden from the compiler: each phase derives its
 * addresses from it inside the chunk loop, instead of the compiler hoisting
 * every phase's per-thread addresses out of the loop, where together they
 * would hold more registers than the producers have.
 */
__device__ __forceinline__ int per_chunk(int tid)
{
    asm volatile("" : "+r"(tid));
    return tid;
}

/* One producer warpgroup's barrier. */
struct ProducerSync {
    uint32_t id;
    __device__ __forceinline__ void operator()() const { named_barrier_sync(id, WG_THREADS); }
};

/* Points `cur` at the first chunk of item (seq, head). */
__device__ __forceinline__ void load_item(const kda_fwd_params &p, int32_t seq, int32_t head, LoadCursor &cur)
{
    const kda_seq &s = p.seqs[seq];
    cur.q = s.q;
    cur.k = s.k;
    cur.v = s.v;
    cur.g = s.g;
    cur.beta = s.beta;
    cur.len = s.len;
    cur.seq = seq;
    cur.head = head;
    cur.t0 = 0;
    if (const kda_layer *layer = s.layer) {
        cur.dt_bias = layer->dt_bias + head * D;
        cur.exp_a = expf(layer->A_log[head]);
        cur.lb2 = layer->lower_bound * LOG2E;
        cur.scale = layer->scale;
    } else {   /* a zero-length item (KDA_SEQ_ZERO_STATE only): nothing to compute */
        cur.dt_bias = nullptr;
        cur.exp_a = cur.lb2 = cur.scale = 0.0f;
    }
}

/* Records in `info` the chunk of cur's item that starts at cur.t0: its header, layer scalars and rows. */
__device__ __forceinline__ void describe_chunk(const LoadCursor &cur, const kda_fwd_params &p, ChunkInfo &info)
{
    const int64_t left = cur.len - cur.t0, first = (cur.t0 * int64_t(p.heads) + cur.head) * D;
    info.hdr = ChunkHeader{cur.seq, cur.head, cur.t0, int32_t(left < C ? left : C),
                           (cur.t0 == 0 ? CHUNK_FIRST : 0u) | (left <= C ? CHUNK_LAST : 0u)};
    info.exp_a = cur.exp_a;
    info.lb2 = cur.lb2;
    info.scale = cur.scale;
    info.src[0] = cur.q + first;
    info.src[1] = cur.k + first;
    info.src[2] = cur.g + first;
    info.src[3] = cur.v + first;
    info.beta_src = cur.beta + cur.t0 * int64_t(p.heads) + cur.head;
    info.dt_bias_src = cur.dt_bias;
}

/*
 * Takes the cursor's next chunk (a new work item when the current one is
 * done) and records it in `info`; with no work left the header says
 * CHUNK_END (and stays so).
 */
__device__ __forceinline__ void plan_chunk(LoadCursor &cursor, const kda_fwd_params &p, uint32_t nitems,
                                           ChunkInfo &info)
{
    LoadCursor cur = cursor;                       /* in registers: the stores below alias nothing it holds */
    const bool next_item = cur.seq >= 0 && cur.t0 > 0 && cur.t0 >= cur.len;
    if (next_item) {                               /* the item is done: take the next */
        int32_t seq, head;
        if (sched_fetch(p, nitems, seq, head))
            load_item(p, seq, head, cur);
        else
            cur.seq = -1;
    }
    if (cur.seq < 0) {
        info.hdr = ChunkHeader{-1, -1, 0, 0, CHUNK_END};
        cursor.seq = -1;
        return;
    }
    describe_chunk(cur, p, info);
    cur.t0 += C;
    if (next_item)
        cursor = cur;
    else
        cursor.t0 = cur.t0;
}

/* Paired chains: moves `walk` to item `item` (past the last: seq < 0). */
__device__ __forceinline__ void walk_to(ChainWalk &walk, const kda_fwd_params &p, uint32_t nitems, uint32_t item)
{
    walk.item = item;
    walk.chunks = 0;
    walk.cur.seq = -1;
    if (item >= nitems)
        return;
    const int32_t seq = int32_t(item / uint32_t(p.heads)), head = int32_t(item % uint32_t(p.heads));
    const kda_seq &s = p.seqs[seq];
    load_item(p, seq, head, walk.cur);
    if (seq_has_work(s))
        walk.chunks = s.len > 0 ? int32_t((s.len + C - 1) / C) : 1;
}

/*
 * Paired chains: records in `info` chunk n of the cluster's sequence of
 * chunks (its items cluster, cluster + clusters, ..., in order), which every
 * producer warpgroup of both CTAs walks on its own: no shared cursor, no
 * counter.  Chunk n = the number of all chunks is the END chunk; later ones
 * are CHUNK_PAST_END.
 */
__device__ __forceinline__ void plan_paired(ChainWalk &walk, const kda_fwd_params &p, uint32_t nitems,
                                            uint32_t clusters, int32_t n, ChunkInfo &info)
{
    while (walk.cur.seq >= 0 && n >= walk.first + walk.chunks) {
        walk.first += walk.chunks;
        walk_to(walk, p, nitems, walk.item + clusters);
    }
    if (walk.cur.seq < 0) {
        info.hdr = ChunkHeader{-1, -1, 0, 0, CHUNK_END | (n > walk.first ? CHUNK_PAST_END : 0u)};
        return;
    }
    walk.cur.t0 = (n - walk.first) * C;
    describe_chunk(walk.cur, p, info);
}

/*
 * Thread 0 of warpgroup `wg`: its plan number j (0 = its first chunk), once
 * the other warpgroup has planned the chunk before; then hands the turn over.
 * Warpgroup 0's first plan goes first.
 */
__device__ __forceinline__ void plan_in_turn(SharedStorage &sm, const kda_fwd_params &p, uint32_t nitems,
                                             int wg, uint32_t j, ChunkInfo &info)
{
    const int32_t turns_before = int32_t(j) - 1 + wg;   /* the other's plans this one follows, less one */
    if (turns_before >= 0)
        mbar_wait(&sm.plan_turn[wg], uint32_t(turns_before) & 1);
    plan_chunk(sm.cursor, p, nitems, info);
    mbar_arrive(&sm.plan_turn[wg ^ 1]);
}

/*
 * The planned chunk's q, k and g rows into the warpgroup's raw rows, and the
 * head's dt_bias into `info`, with cp.async (16 bytes per thread and copy,
 * consecutive threads along a row; rows of one head are H * 256 bytes apart),
 * each thread's copies counted on `loaded` by one arrival when they complete.
 * Rows past the chunk's end are not loaded (the preparation masks them).
 * Returns the raw bf16 beta logit of token `tid` (threads 0-31).
 */
__device__ __forceinline__ uint32_t issue_row_copies(ProducerArea &area, ChunkInfo &info, uint64_t *loaded,
                                                     const kda_fwd_params &p, int tid)
{
    tid = per_chunk(tid);
    const int ntok = info.hdr.ntok;
    const int64_t stride = int64_t(p.heads) * D;   /* elements between tokens */
    const int seg = tid % 16, row0 = tid / 16;     /* 16 threads per 256-byte row, 8 rows per pass */
    const int64_t first = row0 * stride + seg * 8; /* this thread's first piece, in elements */
    uint16_t *const dst[3] = {area.q, area.k, area.g};
#pragma unroll
    for (int tensor = 0; tensor < 3; tensor++) {
        const uint16_t *src = info.src[tensor] + first;
#pragma unroll
        for (int pass = 0; pass < C / 8; pass++, src += 8 * stride)
            if (row0 + 8 * pass < ntok)
                cp_async_16(dst[tensor] + (row0 + 8 * pass) * D + seg * 8, src);
    }
    if (ntok > 0)
        cp_async_4(&info.dt_bias[tid], info.dt_bias_src + tid);
    cp_async_mbar_arrive(loaded);
    return tid < ntok ? info.beta_src[tid * int64_t(p.heads)] : 0u;
}

/*
 * The chunk's values straight into the stage's swizzled value tile (read by
 * the consumers' ldmatrix.trans one step later), counted on `full` by one
 * cp.async arrival per thread; rows past the chunk's end become zeros.
 */
__device__ __forceinline__ void issue_value_copies(PrepStage &st, const ChunkInfo &info, uint64_t *full,
                                                   const kda_fwd_params &p, int tid)
{
    tid = per_chunk(tid);
    const int ntok = info.hdr.ntok;
    const int64_t stride = int64_t(p.heads) * D;
    constexpr int ROWS_PER_PASS = WG_THREADS / 16;
    const int part = tid % 16, row0 = tid / 16;
    const uint16_t *src = info.src[3] + row0 * stride + part * 8;
#pragma unroll
    for (int pass = 0; pass < C / ROWS_PER_PASS; pass++, src += ROWS_PER_PASS * stride) {
        const int t = row0 + ROWS_PER_PASS * pass;
        if (t < ntok)
            cp_async_16(st.v.at(t, part * 8), src);
        else
            *reinterpret_cast<uint4 *>(st.v.at(t, part * 8)) = make_uint4(0, 0, 0, 0);
    }
    cp_async_mbar_arrive(full);
}

/* Warp 0: sigmoid of the beta logits issue_row_copies returned, into their chunk's info (0 past the end). */
__device__ __forceinline__ void store_beta(ChunkInfo &info, uint32_t beta, int lane)
{
    info.beta[lane] = lane < info.hdr.ntok ? sigmoid(bf16_lo(beta)) : 0.0f;
}

/*
 * scale / |q_t| for the warp's eight tokens from the lanes' parts (four dims
 * each): a transposing butterfly, in which each exchange halves the tokens a
 * lane still carries (9 shuffles instead of 8 x 5), leaves the sum of token
 * (lane / 4) % 8 in every lane; lanes 4i store token i.
 */
__device__ __forceinline__ void store_q_norms(const float (&part)[QUARTER], float scale, float *out_scale, int lane)
{
    float w[4], x[2];
    const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
#pragma unroll
    for (int i = 0; i < 4; i++)                    /* lanes with bit 4 keep tokens 4..7, the others 0..3 */
        w[i] = (b4 ? part[i + 4] : part[i]) + __shfl_xor_sync(0xffffffffu, b4 ? part[i] : part[i + 4], 16);
#pragma unroll
    for (int i = 0; i < 2; i++)
        x[i] = (b3 ? w[i + 2] : w[i]) + __shfl_xor_sync(0xffffffffu, b3 ? w[i] : w[i + 2], 8);
    float y = (b2 ? x[1] : x[0]) + __shfl_xor_sync(0xffffffffu, b2 ? x[0] : x[1], 4);
    y += __shfl_xor_sync(0xffffffffu, y, 2);
    y += __shfl_xor_sync(0xffffffffu, y, 1);
    if ((lane & 3) == 0)
        out_scale[lane >> 2] = scale * rsqrtf(y + KDA_NORM_EPS);
}

/*
 * Gates and tiles: thread = four key dims (lane) x one quarter chunk (warp),
 * so every load and store moves four elements.  The thread's gate prefix sums
 * stay in registers between the pass that sums the gates and the pass that
 * builds the decayed q/k operands and the chunk's decay factors.  Tokens past
 * the chunk's end (stale raw rows) become zeros.
 */
__device__ __forceinline__ void prepare_tiles(ProducerArea &area, const ChunkInfo &info, PrepStage &st, int tid,
                                              ProducerSync sync)
{
    tid = per_chunk(tid);
    const int ntok = info.hdr.ntok;
    const int quarter = tid / 32, t_begin = quarter * QUARTER, d = 4 * (tid % 32);
    /* sigmoid(e^A (g + dt_bias)) = 1 / (1 + 2^(g a + b)) with a = -e^A log2(e), b = a dt_bias */
    const float a = -info.exp_a * LOG2E, lb2 = info.lb2;
    const float4 dt = *reinterpret_cast<const float4 *>(&info.dt_bias[d]);
    const float b[4] = {a * dt.x, a * dt.y, a * dt.z, a * dt.w};

    float G[QUARTER][4];                           /* gate prefix sums within the quarter, log2 units */
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int e = 0; e < QUARTER; e++) {
        const uint2 gw = *reinterpret_cast<const uint2 *>(area.g + (t_begin + e) * D + d);
        const float g[4] = {bf16_lo(gw.x), bf16_hi(gw.x), bf16_lo(gw.y), bf16_hi(gw.y)};
        const bool real = t_begin + e < ntok;      /* padding tokens leave G unchanged */
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float sig = fast_rcp(1.0f + fast_exp2(fmaf(g[j], a, b[j])));
            acc[j] = real ? fmaf(lb2, sig, acc[j]) : acc[j];
            G[e][j] = acc[j];
        }
    }
    area.quarter_total[quarter][d / 4] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    sync();                                        /* quarter totals are in */

    float4 tot[4];
#pragma unroll
    for (int q = 0; q < 4; q++)
        tot[q] = area.quarter_total[q][d / 4];
    const float4 mid = make_float4(tot[0].x + tot[1].x, tot[0].y + tot[1].y, tot[0].z + tot[1].z, tot[0].w + tot[1].w);
    /* G_t - c = G[t] + shift: the quarters before the thread's, minus c (G after the second quarter) */
    const float4 shift = quarter == 0 ? make_float4(-mid.x, -mid.y, -mid.z, -mid.w)
                       : quarter == 1 ? make_float4(-tot[1].x, -tot[1].y, -tot[1].z, -tot[1].w)
                       : quarter == 2 ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                                      : tot[2];
    if (quarter == 0)
        *reinterpret_cast<float4 *>(&st.gam_mid[d]) =
            make_float4(fast_exp2(mid.x), fast_exp2(mid.y), fast_exp2(mid.z), fast_exp2(mid.w));
    else if (quarter == 3)
        *reinterpret_cast<float4 *>(&st.gam_tail[d]) =
            make_float4(fast_exp2(tot[2].x + tot[3].x), fast_exp2(tot[2].y + tot[3].y),
                        fast_exp2(tot[2].z + tot[3].z), fast_exp2(tot[2].w + tot[3].w));
    const float sh[4] = {shift.x, shift.y, shift.z, shift.w};
    float qq[QUARTER];                             /* this thread's part of |q_t|^2 (its four dims) */

#pragma unroll
    for (int e = 0; e < QUARTER; e++) {
        const int t = t_begin + e;
        const bool real = t < ntok;
        const uint2 kw = real ? *reinterpret_cast<const uint2 *>(area.k + t * D + d) : make_uint2(0, 0);
        const uint2 qw = real ? *reinterpret_cast<const uint2 *>(area.q + t * D + d) : make_uint2(0, 0);
        const float k[4] = {bf16_lo(kw.x), bf16_hi(kw.x), bf16_lo(kw.y), bf16_hi(kw.y)};
        const float q[4] = {bf16_lo(qw.x), bf16_hi(qw.x), bf16_lo(qw.y), bf16_hi(qw.y)};
        float up[4], dn[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            up[j] = fast_exp2(G[e][j] + sh[j]);    /* e^(G-c) */
            dn[j] = fast_rcp(up[j]);               /* e^(c-G) */
        }
        qq[e] = q[0] * q[0] + q[1] * q[1] + q[2] * q[2] + q[3] * q[3];
        *reinterpret_cast<uint2 *>(st.kq.at(t, d)) =
            make_uint2(pack_bf16x2(k[0] * up[0], k[1] * up[1]), pack_bf16x2(k[2] * up[2], k[3] * up[3]));
        *reinterpret_cast<uint2 *>(st.kq.at(C + t, d)) =
            make_uint2(pack_bf16x2(q[0] * up[0], q[1] * up[1]), pack_bf16x2(q[2] * up[2], q[3] * up[3]));
        *reinterpret_cast<uint2 *>(st.ki.at(t, d)) =
            make_uint2(pack_bf16x2(k[0] * dn[0], k[1] * dn[1]), pack_bf16x2(k[2] * dn[2], k[3] * dn[3]));
    }
    store_q_norms(qq, info.scale, st.out_scale + t_begin, tid % 32);
}

/*
 * [kd; qd] . ki^T on the tensor cores (64 x 32 x 128); `meanwhile` runs while
 * the wgmma does.  Warp w holds rows 16w + g and 16w + g + 8 (g = lane / 4):
 * warps 0-1 rows of L (k tokens), warps 2-3 rows of Mqk (q tokens).  Row r of
 * L has its diagonal element, |k_r|^2 (the gates cancel), in n-tile r / 8,
 * column g of the tile, with lane 4g + g / 2 of the row's quad; a quad
 * shuffle hands it to all four.
 */
template <typename Meanwhile>
__device__ __forceinline__ void prepare_lmqk(ProducerArea &area, const ChunkInfo &info, PrepStage &st, int tid,
                                             Meanwhile meanwhile)
{
    float lm[16];
#pragma unroll
    for (int i = 0; i < 16; i++)
        lm[i] = 0.0f;
    fence_operands(lm);
    wgmma_fence();
    const uint64_t kq_desc = sw128_desc(st.kq.data), ki_desc = sw128_desc(st.ki.data);
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++)
        wgmma_m64n32k16_ss(lm, desc_advance(kq_desc, st.kq.kslice_offset(ks)),
                           desc_advance(ki_desc, st.ki.kslice_offset(ks)), ks > 0);
    wgmma_commit();
    meanwhile();
    wgmma_wait<0>();
    fence_operands(lm);

    tid = per_chunk(tid);
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {                  /* rows g and g + 8 of the warp's 16 */
        const int i = 16 * (warp & 1) + g + 8 * h;   /* token of the row */
        if (warp >= 2) {
#pragma unroll
            for (int nt = 0; nt < C / 8; nt++) {
                const int j = 8 * nt + 2 * t4;
                const float v0 = lm[4 * nt + 2 * h], v1 = lm[4 * nt + 2 * h + 1];
                *reinterpret_cast<uint32_t *>(st.mqk.at(i, j)) = pack_bf16x2(j <= i ? v0 : 0.0f, j + 1 <= i ? v1 : 0.0f);
            }
        } else {
            float diag = 0.0f;                     /* selp: a plain ?: here became local-memory indexing */
#pragma unroll
            for (int nt = 0; nt < C / 8; nt++)
                diag = select_f32(nt == 2 * warp + h, select_f32(g & 1, lm[4 * nt + 2 * h + 1], lm[4 * nt + 2 * h]), diag);
            const float sq = __shfl_sync(0xffffffffu, diag, (lane & ~3) | (g >> 1));
            const float n = rsqrtf(sq + KDA_NORM_EPS);   /* 1 / |k_t| */
            const float b = info.beta[i], bn = b * n, bn2 = bn * n;
            if (t4 == 0) {
                st.bn[i] = bn;
                st.bn2[i] = bn2;
            }
#pragma unroll
            for (int nt = 0; nt < C / 8; nt++) {
                const int j = 8 * nt + 2 * t4;
                const float v0 = lm[4 * nt + 2 * h], v1 = lm[4 * nt + 2 * h + 1];
                area.lt[j][i] = j < i ? bn2 * v0 : 0.0f;
                area.lt[j + 1][i] = j + 1 < i ? bn2 * v1 : 0.0f;
            }
        }
    }
}

/*
 * (I + L^)^-1 in fp32 into the stage's bf16 tile (zero above the diagonal),
 * as [[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]] with 16 x 16
 * blocks.  Warp 0 inverts A and C by forward substitution, a column per
 * lane (lanes 0-15 the columns of A, 16-31 those of C): once x_m is final,
 * every later row takes its term, x_i -= L^[i][m] x_m, column m of L^ being
 * row m of lt, read four at a time.  Meanwhile the other warps run
 * `others`; then all four form -C^-1 (B A^-1).  (A warp solving all 32
 * columns alone took 496 FMAs per lane and held its SM partition for them;
 * 8 x 8 blocks merged twice took five barriers.)
 */
template <typename Meanwhile>
__device__ __forceinline__ void prepare_inverse(ProducerArea &area, PrepStage &st, int tid, ProducerSync sync,
                                                Meanwhile others)
{
    constexpr int H = C / 2;
    tid = per_chunk(tid);
    if (tid < 32) {
        const int j = tid, b = j & ~(H - 1);       /* column j of the block at rows and columns b.. */
        float x[H];
#pragma unroll
        for (int i = 0; i < H; i++)
            x[i] = b + i == j ? 1.0f : 0.0f;
#pragma unroll
        for (int m = 0; m < H - 1; m++) {
#pragma unroll
            for (int i4 = (m + 1) / 4 * 4; i4 < H; i4 += 4) {
                const float4 l = *reinterpret_cast<const float4 *>(&area.lt[b + m][b + i4]);
                const float li[4] = {l.x, l.y, l.z, l.w};
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (i4 + e > m)
                        x[i4 + e] = fmaf(-li[e], x[m], x[i4 + e]);
            }
        }
#pragma unroll
        for (int i = 0; i < H; i++)                /* rows above j are exact zeros */
            area.inv[b + i][j] = x[i];
    } else {
        others();
    }
    sync();

    const int i = tid / H, j = tid % H;            /* two elements each: rows i and i + 8 of the 16 x 16 products */
    float y[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {                  /* Y = B A^-1, B = L^[H.., ..H] */
        float s = 0.0f;
#pragma unroll
        for (int m = 0; m < H; m++)
            s = fmaf(area.lt[m][H + i + 8 * r], area.inv[m][j], s);   /* A^-1[m][j] = 0 for m < j */
        y[r] = s;
    }
#pragma unroll
    for (int r = 0; r < 2; r++)
        area.y[i + 8 * r][j] = y[r];
    sync();
#pragma unroll
    for (int r = 0; r < 2; r++) {                  /* -C^-1 Y */
        const int ii = i + 8 * r;
        float s = 0.0f;
#pragma unroll
        for (int m = 0; m < H; m++)
            s = fmaf(area.inv[H + ii][H + m], area.y[m][j], s);        /* C^-1[ii][m] = 0 for m > ii */
        y[r] = -s;
    }
#pragma unroll
    for (int r = 0; r < 2; r++)
        area.inv[H + i + 8 * r][j] = y[r];
    sync();

    const int row = tid >> 2, c0 = (tid & 3) * 8;  /* eight elements of row `row` per thread */
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int c = c0 + 2 * e;                  /* the upper right block was never written */
        w[e] = pack_bf16x2(c <= row ? area.inv[row][c] : 0.0f, c + 1 <= row ? area.inv[row][c + 1] : 0.0f);
    }
    *reinterpret_cast<uint4 *>(st.inv.at(row, c0)) = make_uint4(w[0], w[1], w[2], w[3]);
}

/*
 * Paired chains, thread 0 of the warpgroup that prepared stage `st`: once the
 * stage is complete here (its values landed too), one bulk copy of it (of its
 * header only, for the END chunk) into the same stage of the peer CTA,
 * counted on the peer's full barrier as a warpgroup preparing it there would
 * be: one arrival with the copy's bytes, then the other FULL_ARRIVALS - 1.
 * The local consumer may meanwhile write outputs into its own half of the
 * value tile; the peer reads only the other half.
 */
__device__ __forceinline__ void send_to_peer(PrepStage &st, uint64_t *full, uint32_t parity, bool header_only)
{
    mbar_wait(full, parity);
    fence_proxy_async();                           /* the warpgroup's stores, seen through the barrier, before
                                                      the copy engine reads them */
    const uint32_t peer = cluster_rank() ^ 1, bar = cluster_addr(full, peer);
    const void *src = header_only ? static_cast<const void *>(&st.hdr) : static_cast<const void *>(&st);
    const uint32_t bytes = header_only ? uint32_t(sizeof(ChunkHeader)) : STAGE_COPY_BYTES;
    mbar_arrive_expect_tx_cluster(bar, bytes);
    bulk_copy_to_cluster(cluster_addr(src, peer), src, bytes, bar);
    mbar_arrive_cluster(bar, FULL_ARRIVALS - 1);
}

/*
 * Producer warpgroup `wg` (thread `tid` of it), until the work runs out.  One
 * CTA per chain: chunks wg, wg + 2, ... of the CTA's sequence of chunks,
 * planned in turns from the shared cursor.  Paired chains: chunks
 * 2 rank + wg, + 4, ... of the cluster's sequence, each warpgroup planning
 * from its own walk, and every prepared stage also goes to the peer CTA.
 */
template <bool PAIRED>
__device__ __forceinline__ void producer_main(SharedStorage &sm, const kda_fwd_params &p, int wg, int tid)
{
    const uint32_t nitems = uint32_t(*p.nseqs) * uint32_t(p.heads);
    ProducerArea &area = sm.area[wg];
    const ProducerSync sync{BAR_PRODUCER + uint32_t(wg)};
    uint64_t *loaded = &sm.loaded[wg];
    constexpr uint32_t STRIDE = PAIRED ? 4 : 2;    /* chunks from one of the warpgroup's to its next */
    const uint32_t first_n = PAIRED ? 2 * cluster_rank() + uint32_t(wg) : uint32_t(wg);
    const auto plan = [&](uint32_t k, ChunkInfo &info) {   /* thread 0: the warpgroup's k-th chunk */
        if (PAIRED)
            plan_paired(sm.walk[wg], p, nitems, cluster_count(), int32_t(STRIDE * k + first_n), info);
        else
            plan_in_turn(sm, p, nitems, wg, k, info);
    };
    PROF_START(wg == 0 && tid == 0);

    /* The first two chunks planned (warpgroup 0 starts an empty cursor, so its plan fetches an item;
       a paired walk starts at the cluster's first item), the first requested.  Warp 0 holds the
       beta logits of the next chunk until it is prepared. */
    if (tid == 0) {
        if (PAIRED) {
            sm.walk[wg].first = 0;
            walk_to(sm.walk[wg], p, nitems, cluster_index());
        } else if (wg == 0) {
            sm.cursor.seq = 0;
            sm.cursor.t0 = 1;
            sm.cursor.len = 0;
        }
        plan(0, area.info[0]);
        plan(1, area.info[1]);
    }
    sync();
    uint32_t beta = issue_row_copies(area, area.info[0], loaded, p, tid);

    for (uint32_t k = 0;; k++) {
        const uint32_t n = STRIDE * k + first_n;   /* the chunk's number in the CTA's (cluster's) sequence */
        ChunkInfo &info = area.info[k % 3], &next = area.info[(k + 1) % 3], &after = area.info[(k + 2) % 3];
        const StageUse use = stage_use<PAIRED>(n);
        PrepStage &st = sm.prep[use.index];
        uint64_t *full = &sm.full[use.index], *empty = &sm.empty[use.index];
        const uint32_t phase = use.phase;
        if (PAIRED && (info.hdr.flags & CHUNK_PAST_END)) {   /* another warpgroup stops the consumers */
            PROF_FLUSH(PROF_TOTAL);
            return;
        }

        if (tid < 32)
            store_beta(info, beta, tid);
        PROF_MARK(PROF_P_FETCH);
        mbar_wait(loaded, k & 1);                  /* this chunk's rows have landed */
        PROF_MARK(PROF_P_LOADWAIT);
        mbar_wait<PAIRED>(empty, phase ^ 1);       /* the consumers (both CTAs') are done with the stage's
                                                      previous chunk, n - prep_stages(PAIRED) */
        fence_proxy_async();
        PROF_MARK(PROF_P_EMPTYWAIT);
        const ChunkHeader hdr = info.hdr;
        if (hdr.flags & CHUNK_END) {               /* tell the consumers to stop */
            if (tid == 0)
                st.hdr = hdr;
            cp_async_mbar_arrive(full);
            mbar_arrive(full);
            if (PAIRED && tid == 0)
                send_to_peer(st, full, phase, true);
            PROF_FLUSH(PROF_TOTAL);
            return;
        }

        issue_value_copies(st, info, full, p, tid);
        prepare_tiles(area, info, st, tid, sync);
        fence_proxy_async();                       /* kd, qd, ki feed the wgmma below */
        sync();                                    /* (and the raw rows are free, the next chunk's plan visible) */
        PROF_MARK(PROF_P_OPERANDS);
        prepare_lmqk(area, info, st, tid, [&] { beta = issue_row_copies(area, next, loaded, p, tid); });
        if (tid == 0)
            st.hdr = hdr;
        sync();
        PROF_MARK(PROF_P_LMQK);
        prepare_inverse(area, st, tid, sync, [&] {   /* planning, off the critical path: warp 1 waits here */
            if (tid == 32)
                plan(k + 2, after);
        });
        fence_proxy_async();                       /* the stage's tiles feed the consumers' wgmma */
        mbar_arrive(full);
        if (PAIRED && tid == 0)
            send_to_peer(st, full, phase, false);
        PROF_MARK(PROF_P_INV);
    }
}

}  // namespace kda
