/*
 * producer.cuh - warpgroup 0: loads chunks and prepares everything of a
 * chunk that does not depend on the state, one chunk ahead of the consumers.
 *
 * Per chunk of C = 32 tokens of one (sequence, head), with c the gate prefix
 * sum at the chunk's middle token (per key dim) so every exponent below stays
 * within e^+-80 (KDA.md, "Range"):
 *
 *   A  norms    1/|q_t|, 1/|k_t|: two threads per row; b_t = sigmoid(beta_t)
 *   B  gates    thread (key-dim pair, half chunk): G_t = sum_{s<=t} lower_bound *
 *               sigmoid(e^A_log (g_sd + dt_bias_d)), kept relative to the half's
 *               start; then kdc = k^ e^(G-c), qdc = scale q^ e^(G-c),
 *               kic = k^ e^(c-G), Kr^T[d][t] = k^ e^(G_last - G_t), e^G_last, e^c,
 *               and the values copied into the consumers' swizzled tile
 *   C  L, Mqk   [kdc; qdc] . kic^T by wgmma (64 x 32 x 128); L = strictly_lower(b_i .),
 *               Mqk = lower_incl(.)
 *   D  inverse  (I + L)^-1 in fp32: two 16 x 16 diagonal blocks by forward
 *               substitution, then the off-diagonal block -C^-1 L21 A^-1
 *
 * Centring on the middle token splits the chunk cleanly: in the second half
 * G_t - c is the half's own prefix sum, in the first half it is the prefix
 * sum minus the half's total, so the halves need only each other's totals.
 *
 * Loads of chunks n+1 and n+2 (bulk copies into RawStages) are in flight
 * while chunk n is prepared; the prepared operands go to PrepStage n % 2.
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
constexpr int HALF = C / 2;          /* tokens per half chunk */
constexpr int PAIRS = D / 2;         /* key-dim pairs */

/* The work item the producer is on and a chunk of it; the layer's weights are cached per item. */
struct ProducerChunk {
    int32_t seq = -1, head = 0;
    int64_t len = 0;                 /* tokens of the sequence */
    int32_t t0 = 0, ntok = 0;        /* chunk start and real tokens in it */
    uint32_t flags = 0;              /* CHUNK_* */
    const uint16_t *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;
    float2 dt_bias = {0.0f, 0.0f};   /* this thread's key-dim pair */
    float exp_a = 0.0f, lb2 = 0.0f, scale = 0.0f;   /* e^A_log, lower_bound in log2 units, scale */
};

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

/* Moves `ch` to the chunk after it: the next chunk of its item, or a new item. */
__device__ __forceinline__ void producer_advance(ProducerChunk &ch, const kda_fwd_params &p,
                                                 uint32_t nitems, ProducerScratch &scr, int tid)
{
    if (ch.seq >= 0 && ch.t0 + C < ch.len) {
        ch.t0 += C;
        ch.ntok = int32_t(ch.len - ch.t0 < C ? ch.len - ch.t0 : C);
        ch.flags = ch.t0 + C >= ch.len ? CHUNK_LAST : 0u;
        return;
    }
    named_barrier_sync(BAR_PRODUCER, WG_THREADS);   /* everyone has read the previous item */
    if (tid == 0) {
        int32_t seq = -1, head = -1;
        if (!sched_fetch(p, nitems, seq, head))
            seq = head = -1;
        scr.item[0] = seq;
        scr.item[1] = head;
    }
    named_barrier_sync(BAR_PRODUCER, WG_THREADS);
    ch.seq = scr.item[0];
    ch.head = scr.item[1];
    if (ch.seq < 0) {
        ch.flags = CHUNK_END;
        return;
    }
    const kda_seq &s = p.seqs[ch.seq];
    ch.len = s.len;
    ch.q = s.q;
    ch.k = s.k;
    ch.v = s.v;
    ch.g = s.g;
    ch.beta = s.beta;
    ch.t0 = 0;
    ch.ntok = int32_t(ch.len < C ? ch.len : C);
    ch.flags = CHUNK_FIRST | (ch.len <= C ? CHUNK_LAST : 0u);
    if (const kda_layer *layer = s.layer) {
        const int d = 2 * (tid & (PAIRS - 1));
        ch.dt_bias = make_float2(layer->dt_bias[ch.head * D + d], layer->dt_bias[ch.head * D + d + 1]);
        ch.exp_a = expf(layer->A_log[ch.head]);
        ch.lb2 = layer->lower_bound * LOG2E;
        ch.scale = layer->scale;
    } else {   /* a zero-length item (KDA_SEQ_ZERO_STATE only): no layer, nothing to compute */
        ch.dt_bias = make_float2(0.0f, 0.0f);
        ch.exp_a = ch.lb2 = ch.scale = 0.0f;
    }
}

/*
 * Warp 0 starts the chunk's loads: one bulk copy per token row of q, k, g and
 * v (256 bytes each, the rows of one head are H * 256 bytes apart), counted
 * on `loaded`.  Rows past the chunk's end are zeroed by all threads (a
 * partial chunk: once per work item).  Returns the raw bf16 beta of token
 * tid, converted only when the chunk is prepared.
 */
__device__ __forceinline__ uint32_t producer_load(const ProducerChunk &ch, RawStage &raw, uint64_t *loaded,
                                                  const kda_fwd_params &p, int tid)
{
    constexpr uint32_t ROW_BYTES = D * 2;
    const int64_t stride = int64_t(p.heads) * D;   /* elements between tokens */
    if (tid < 32) {
        fence_proxy_async();                       /* earlier generic reads of this stage come first */
        if (tid == 0)
            mbar_arrive_expect_tx(loaded, uint32_t(ch.ntok) * 4 * ROW_BYTES);
        __syncwarp();
        if (tid < ch.ntok) {
            const int64_t off = (ch.t0 + tid) * stride + int64_t(ch.head) * D;
            bulk_copy_g2s(raw.q + tid * D, ch.q + off, ROW_BYTES, loaded);
            bulk_copy_g2s(raw.k + tid * D, ch.k + off, ROW_BYTES, loaded);
            bulk_copy_g2s(raw.g + tid * D, ch.g + off, ROW_BYTES, loaded);
            bulk_copy_g2s(raw.v + tid * D, ch.v + off, ROW_BYTES, loaded);
        }
    }
    if (ch.ntok < C) {                             /* zero rows ntok..31: padding tokens change nothing */
        const uint4 zero = make_uint4(0, 0, 0, 0);
        for (int seg = ch.ntok * 16 + tid; seg < C * 16; seg += WG_THREADS) {
            reinterpret_cast<uint4 *>(raw.q)[seg] = zero;
            reinterpret_cast<uint4 *>(raw.k)[seg] = zero;
            reinterpret_cast<uint4 *>(raw.g)[seg] = zero;
            reinterpret_cast<uint4 *>(raw.v)[seg] = zero;
        }
    }
    return tid < ch.ntok ? ch.beta[(ch.t0 + tid) * int64_t(p.heads) + ch.head] : 0u;
}

/*
 * Phases A and B for one chunk.  A: inverse norms (two threads per row,
 * 16-byte loads rotated across the row so a quarter-warp hits distinct banks)
 * and b = sigmoid(beta).  B: each thread owns a key-dim pair over a half
 * chunk; its gate prefix sums stay in registers between the pass that sums
 * the gates and the pass that builds the decayed, centred q/k operands, the
 * pair's two rows of Kr^T and the chunk's decay factors.  Finally the values
 * are copied into the consumers' swizzled tile.
 */
__device__ __forceinline__ void prepare_operands(const ProducerChunk &ch, uint32_t beta, const RawStage &raw,
                                                 PrepStage &st, ProducerScratch &scr, int tid)
{
    {
        const int r = tid >> 1, part = tid & 1;    /* rows 0..31: q, 32..63: k */
        const uint16_t *row = (r < C ? raw.q + r * D : raw.k + (r - C) * D) + part * 64;
        float ss = 0.0f;
#pragma unroll
        for (int c = 0; c < 8; c++) {
            const uint4 w = *reinterpret_cast<const uint4 *>(row + ((c + r + 4 * part) & 7) * 8);
            for (uint32_t x : {w.x, w.y, w.z, w.w})
                ss += bf16_lo(x) * bf16_lo(x) + bf16_hi(x) * bf16_hi(x);
        }
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);
        if (part == 0)
            (r < C ? scr.inv_norm_q[r] : scr.inv_norm_k[r - C]) = rsqrtf(ss + KDA_NORM_EPS);
    }
    if (tid < C)
        st.beta[tid] = tid < ch.ntok ? 1.0f / (1.0f + __expf(-bf16_lo(beta))) : 0.0f;
    if (tid == 0)
        st.hdr = ChunkHeader{ch.seq, ch.head, ch.t0, ch.ntok, ch.flags};

    const int pair = tid & (PAIRS - 1), half = tid / PAIRS, t_begin = half * HALF, d = 2 * pair;
    const uint16_t *__restrict__ graw = raw.g;
    float2 G[HALF];                                /* gate prefix sums within the half, log2 units */
    float2 acc = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int t8 = 0; t8 < HALF; t8 += 8) {         /* load 8 tokens' gates, then compute */
        uint32_t gw[8];
#pragma unroll
        for (int e = 0; e < 8; e++)
            gw[e] = *reinterpret_cast<const uint32_t *>(graw + (t_begin + t8 + e) * D + d);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float x0 = ch.exp_a * (bf16_lo(gw[e]) + ch.dt_bias.x);
            const float x1 = ch.exp_a * (bf16_hi(gw[e]) + ch.dt_bias.y);
            const float s0 = fast_rcp(1.0f + fast_exp2(-x0 * LOG2E)), s1 = fast_rcp(1.0f + fast_exp2(-x1 * LOG2E));
            if (t_begin + t8 + e < ch.ntok) {      /* padding tokens leave G unchanged */
                acc.x += ch.lb2 * s0;
                acc.y += ch.lb2 * s1;
            }
            G[t8 + e] = acc;
        }
    }
    scr.half_total[half][pair] = acc;
    named_barrier_sync(BAR_PRODUCER, WG_THREADS);  /* half totals and norms are in */

    const float2 other = scr.half_total[half ^ 1][pair];
    const float2 mid = half ? other : acc;         /* G at the middle token */
    const float2 tail = half ? acc : other;        /* G_last - G_mid */
    const float2 shift = half ? make_float2(0.0f, 0.0f) : mid;   /* G_t - c = G[t] - shift */
    if (half == 0) {
        st.gam_mid[d] = fast_exp2(mid.x);
        st.gam_mid[d + 1] = fast_exp2(mid.y);
    } else {
        st.gam_last[d] = fast_exp2(mid.x + tail.x);
        st.gam_last[d + 1] = fast_exp2(mid.y + tail.y);
    }
    const float2 decay_tail = make_float2(fast_exp2(tail.x), fast_exp2(tail.y));   /* e^(G_last - c) */

    const uint16_t *__restrict__ kraw = raw.k;
    const uint16_t *__restrict__ qraw = raw.q;
#pragma unroll
    for (int t8 = 0; t8 < HALF; t8 += 8) {         /* 8 tokens: one 16-byte chunk of each Kr^T row */
        const int tb = t_begin + t8;
        uint32_t kw[8], qw[8];                     /* load the 8 tokens' inputs first ... */
        float ik[8], iq[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            kw[e] = *reinterpret_cast<const uint32_t *>(kraw + (tb + e) * D + d);
            qw[e] = *reinterpret_cast<const uint32_t *>(qraw + (tb + e) * D + d);
            ik[e] = scr.inv_norm_k[tb + e];
            iq[e] = scr.inv_norm_q[tb + e] * ch.scale;
        }
        uint32_t kd[8], qd[8], ki[8], kr[2][4];    /* ... compute ... */
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float2 g = G[t8 + e];
            const float up0 = fast_exp2(g.x - shift.x), up1 = fast_exp2(g.y - shift.y);   /* e^(G-c) */
            const float dn0 = fast_rcp(up0), dn1 = fast_rcp(up1);                          /* e^(c-G) */
            const float k0 = bf16_lo(kw[e]) * ik[e], k1 = bf16_hi(kw[e]) * ik[e];
            const float q0 = bf16_lo(qw[e]) * iq[e], q1 = bf16_hi(qw[e]) * iq[e];
            kd[e] = pack_bf16x2(k0 * up0, k1 * up1);
            qd[e] = pack_bf16x2(q0 * up0, q1 * up1);
            ki[e] = pack_bf16x2(k0 * dn0, k1 * dn1);
            const float kr0 = k0 * dn0 * decay_tail.x, kr1 = k1 * dn1 * decay_tail.y;
            if (e & 1) {
                kr[0][e / 2] = pack_bf16x2(__uint_as_float(kr[0][e / 2]), kr0);
                kr[1][e / 2] = pack_bf16x2(__uint_as_float(kr[1][e / 2]), kr1);
            } else {
                kr[0][e / 2] = __float_as_uint(kr0);
                kr[1][e / 2] = __float_as_uint(kr1);
            }
        }
#pragma unroll
        for (int e = 0; e < 8; e++) {              /* ... then store */
            *reinterpret_cast<uint32_t *>(st.kq.at(tb + e, d)) = kd[e];
            *reinterpret_cast<uint32_t *>(st.kq.at(C + tb + e, d)) = qd[e];
            *reinterpret_cast<uint32_t *>(scr.kic.at(tb + e, d)) = ki[e];
        }
#pragma unroll
        for (int r = 0; r < 2; r++)
            *reinterpret_cast<uint4 *>(st.krm.at(d + r, tb)) = make_uint4(kr[r][0], kr[r][1], kr[r][2], kr[r][3]);
    }

#pragma unroll
    for (int n = 0; n < 4; n++) {                  /* values: row-major raw -> swizzled tile */
        const int seg = tid + WG_THREADS * n, t = seg >> 4, part = seg & 15;
        *reinterpret_cast<uint4 *>(st.v.at(t, part * 8)) = *reinterpret_cast<const uint4 *>(raw.v + t * D + part * 8);
    }
}

/* Phase C: [kdc; qdc] . kic^T on the tensor cores; warps 0-1 hold L rows, warps 2-3 Mqk rows. */
__device__ __forceinline__ void prepare_lmqk(PrepStage &st, ProducerScratch &scr, int tid)
{
    float lm[16];
#pragma unroll
    for (int i = 0; i < 16; i++)
        lm[i] = 0.0f;
    fence_operands(lm);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++)
        wgmma_m64n32k16_ss(lm, sw128_desc(st.kq.kslice(ks)), sw128_desc(scr.kic.kslice(ks)), ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(lm);

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const bool is_mqk = warp >= 2;
#pragma unroll
    for (int nt = 0; nt < C / 8; nt++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {              /* rows g and g + 8 of the warp's 16 */
            const int i = 16 * (warp & 1) + g + 8 * h, j = 8 * nt + 2 * t4;
            const float v0 = lm[4 * nt + 2 * h], v1 = lm[4 * nt + 2 * h + 1];
            if (is_mqk) {
                *reinterpret_cast<uint32_t *>(st.krm.at(D + i, j)) =
                    pack_bf16x2(j <= i ? v0 : 0.0f, j + 1 <= i ? v1 : 0.0f);
            } else {
                const float b = st.beta[i];
                *reinterpret_cast<float2 *>(&scr.lmat[i][j]) =
                    make_float2(j < i ? b * v0 : 0.0f, j + 1 < i ? b * v1 : 0.0f);
            }
        }
    }
}

/*
 * Merges every pair of N x N diagonal blocks of the inverse into one 2N x 2N
 * block: [[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]] with
 * B = L[r1.., r0..].  A^-1 and C^-1 are lower triangular, so the sums skip
 * their upper triangles (never written).
 */
template <int N>
__device__ __forceinline__ void merge_inverse_blocks(ProducerScratch &scr, int tid)
{
    constexpr int NPAIRS = C / (2 * N), OUTS = NPAIRS * N * N / WG_THREADS;   /* outputs per thread */
    static_assert(OUTS * WG_THREADS == NPAIRS * N * N, "block merge must split evenly");
#pragma unroll
    for (int e = 0; e < OUTS; e++) {               /* X = B . A^-1 */
        const int o = tid * OUTS + e, pr = o / (N * N), i = (o % (N * N)) / N, j = o % N, r0 = 2 * N * pr;
        float s = 0.0f;
#pragma unroll
        for (int m = 0; m < N; m++)
            if (m >= j)
                s += scr.lmat[r0 + N + i][r0 + m] * scr.inv[r0 + m][r0 + j];
        scr.x[pr * N + i][j] = s;
    }
    named_barrier_sync(BAR_PRODUCER, WG_THREADS);
#pragma unroll
    for (int e = 0; e < OUTS; e++) {               /* -C^-1 . X */
        const int o = tid * OUTS + e, pr = o / (N * N), i = (o % (N * N)) / N, j = o % N, r0 = 2 * N * pr;
        float s = 0.0f;
#pragma unroll
        for (int m = 0; m < N; m++)
            if (m <= i)
                s += scr.inv[r0 + N + i][r0 + N + m] * scr.x[pr * N + m][j];
        scr.inv[r0 + N + i][r0 + j] = -s;
    }
    named_barrier_sync(BAR_PRODUCER, WG_THREADS);
}

/*
 * Phase D: (I + L)^-1 in fp32 into the stage's bf16 tile (zero above the
 * diagonal): each warp inverts one 8 x 8 diagonal block by forward
 * substitution (lane j owns column j), then the blocks merge to 16 x 16 and
 * to 32 x 32.
 */
__device__ __forceinline__ void prepare_inverse(PrepStage &st, ProducerScratch &scr, int tid)
{
    constexpr int B = 8;
    const int warp = tid >> 5, lane = tid & 31;
    if (lane < B) {
        const int off = B * warp, j = lane;
        float x[B];
#pragma unroll
        for (int m = 0; m < B; m++)
            x[m] = m == j ? 1.0f : 0.0f;
#pragma unroll
        for (int m = 0; m < B - 1; m++)            /* right-looking: eliminate x[m] from later rows */
#pragma unroll
            for (int i = m + 1; i < B; i++)
                x[i] -= scr.lmat[off + i][off + m] * x[m];
#pragma unroll
        for (int m = 0; m < B; m++)
            scr.inv[off + m][off + j] = x[m];
    }
    named_barrier_sync(BAR_PRODUCER, WG_THREADS);
    merge_inverse_blocks<B>(scr, tid);
    merge_inverse_blocks<2 * B>(scr, tid);

    const int r = tid >> 2, c0 = (tid & 3) * 8;    /* one 16-byte chunk of row r per thread */
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int j = c0 + 2 * e;
        w[e] = pack_bf16x2(j <= r ? scr.inv[r][j] : 0.0f, j + 1 <= r ? scr.inv[r][j + 1] : 0.0f);
    }
    *reinterpret_cast<uint4 *>(st.inv.at(r, c0)) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void producer_main(SharedStorage &sm, const kda_fwd_params &p, int tid)
{
    const uint32_t nitems = uint32_t(*p.nseqs) * uint32_t(p.heads);
    PROF_START(tid == 0);
    /* ahead[0], ahead[1]: the next two chunks, whose loads are in flight */
    ProducerChunk ahead[2];
    uint32_t ahead_beta[2] = {0, 0};
    producer_advance(ahead[0], p, nitems, sm.scratch, tid);
    if (!(ahead[0].flags & CHUNK_END)) {
        ahead_beta[0] = producer_load(ahead[0], sm.raw[0], &sm.loaded[0], p, tid);
        ahead[1] = ahead[0];
        producer_advance(ahead[1], p, nitems, sm.scratch, tid);
        if (!(ahead[1].flags & CHUNK_END))
            ahead_beta[1] = producer_load(ahead[1], sm.raw[1], &sm.loaded[1], p, tid);
    } else {
        ahead[1] = ahead[0];
    }

    for (uint32_t n = 0;; n++) {
        const ProducerChunk cur = ahead[0];
        const uint32_t beta = ahead_beta[0];
        ahead[0] = ahead[1];
        ahead_beta[0] = ahead_beta[1];
        PrepStage &st = sm.prep[n % PREP_STAGES];
        uint64_t *full = &sm.full[n % PREP_STAGES], *empty = &sm.empty[n % PREP_STAGES];
        const uint32_t empty_parity = ((n / PREP_STAGES) & 1) ^ 1;

        if (cur.flags & CHUNK_END) {                 /* tell the consumers to stop */
            mbar_wait(empty, empty_parity);
            if (tid == 0)
                st.hdr = ChunkHeader{-1, -1, 0, 0, CHUNK_END};
            mbar_arrive(full);
            PROF_FLUSH(PROF_TOTAL);
            return;
        }
        if (!(ahead[1].flags & CHUNK_END)) {         /* start the loads of chunk n + 2 */
            producer_advance(ahead[1], p, nitems, sm.scratch, tid);
            if (!(ahead[1].flags & CHUNK_END))
                ahead_beta[1] = producer_load(ahead[1], sm.raw[(n + 2) % RAW_STAGES], &sm.loaded[(n + 2) % RAW_STAGES],
                                              p, tid);
        }
        PROF_MARK(PROF_P_FETCH);
        mbar_wait(&sm.loaded[n % RAW_STAGES], (n / RAW_STAGES) & 1);   /* this chunk's rows have landed */
        named_barrier_sync(BAR_PRODUCER, WG_THREADS);                 /* and its padding rows are zero */
        PROF_MARK(PROF_P_LOADWAIT);

        mbar_wait(empty, empty_parity);              /* the consumers are done with this stage */
        fence_proxy_async();
        PROF_MARK(PROF_P_EMPTYWAIT);
        prepare_operands(cur, beta, sm.raw[n % RAW_STAGES], st, sm.scratch, tid);
        fence_proxy_async();                         /* kq, kic feed the wgmma below */
        named_barrier_sync(BAR_PRODUCER, WG_THREADS);
        PROF_MARK(PROF_P_OPERANDS);
        prepare_lmqk(st, sm.scratch, tid);
        named_barrier_sync(BAR_PRODUCER, WG_THREADS);
        PROF_MARK(PROF_P_LMQK);
        prepare_inverse(st, sm.scratch, tid);
        fence_proxy_async();                         /* the stage's tiles feed the consumers' wgmma */
        mbar_arrive(full);
        PROF_MARK(PROF_P_INV);
    }
}

}  // namespace kda
