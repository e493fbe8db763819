/*
 * producer.cuh - warpgroups 0 and 1: load chunks and prepare, together,
 * everything of a chunk that does not depend on the state, one chunk ahead
 * of the consumers.
 *
 * Per chunk of C = 32 tokens of one (sequence, head), with c the gate prefix
 * sum at the chunk's middle token (per key dim) so every exponent below stays
 * within e^+-80 (KDA.md, "Range").  Producer thread p (0..255) owns key-dim
 * pair p % 64 over quarter chunk p / 64 (8 tokens):
 *
 *   loads    thread 0 plans chunk n + 2 (plan_chunk); once that is visible,
 *            WG1 starts its copies (issue_copies) while WG0 runs the wgmma below
 *   gates    G_t = sum_{s<=t} lower_bound * sigmoid(e^A_log (g_sd + dt_bias_d)),
 *            within the thread's quarter, in log2 units, in registers
 *   tiles    kd = k e^(G-c), qd = q e^(G-c), ki = k e^(c-G), qi = q e^(c-G),
 *            Kr^T[d][t] = k e^(G_last - G_t), e^G_last, e^c  (raw q, k: no norms yet)
 *   L, Mqk   WG0: [kd; qd] . [ki; qi]^T by wgmma (64 x 64 x 128).  Its diagonal
 *            is |k_t|^2 and |q_t|^2 (the gates cancel), which gives the norms;
 *            L^ = diag(b n^2) strictly_lower(kd ki^T), Mqk = lower_incl(qd ki^T).
 *            WG1 meanwhile copies the values into the consumers' tile.
 *   inverse  (I + L^)^-1 in fp32: 8 x 8 diagonal blocks by forward
 *            substitution, merged to 16 x 16 and 32 x 32
 *
 * smem.cuh (PrepStage) gives the algebra that lets the norms come last.
 * Centring on the middle token splits the chunk cleanly: G_t - c is the
 * thread's own prefix sum plus a sum of whole quarter totals.
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
constexpr int QUARTER = C / 4;       /* tokens per producer thread */
constexpr int PAIRS = D / 2;         /* key-dim pairs */

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
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

__device__ __forceinline__ void producer_sync() { named_barrier_sync(BAR_PRODUCERS, PRODUCER_THREADS); }

/*
 * Thread 0: takes the cursor's next chunk (a new work item when the current
 * one is done) and records in `raw` its header, layer scalars and where its
 * rows start; with no work left the header says CHUNK_END.  The copies are
 * started by WG1 (issue_copies) once this is visible.
 */
__device__ __forceinline__ void plan_chunk(ProducerScratch &scr, const kda_fwd_params &p, uint32_t nitems,
                                           RawStage &raw)
{
    LoadCursor cur = scr.cursor;                   /* in registers: the stores below alias nothing it holds */
    const bool next_item = cur.seq >= 0 && cur.t0 > 0 && cur.t0 >= cur.len;
    if (next_item) {                               /* the item is done: take the next */
        int32_t seq, head;
        if (sched_fetch(p, nitems, seq, head)) {
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
        } else {
            cur.seq = -1;
        }
    }
    ChunkInfo &info = raw.info;
    if (cur.seq < 0) {
        info.hdr = ChunkHeader{-1, -1, 0, 0, CHUNK_END};
        scr.cursor.seq = -1;
        return;
    }
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
    cur.t0 += C;
    if (next_item)
        scr.cursor = cur;
    else
        scr.cursor.t0 = cur.t0;
}

/*
 * One producer warpgroup: copy the planned chunk's q, k, g and v rows (16
 * bytes per thread and copy, consecutive threads along a row; rows of one
 * head are H * 256 bytes apart) and the head's dt_bias into `raw` with
 * cp.async, each thread's copies counted on `loaded` by one arrival when they
 * complete.  Rows past the chunk's end are not loaded (the preparation masks
 * them).  Returns the raw bf16 beta logit of token `tid` (threads 0-31).
 */
__device__ __forceinline__ uint32_t issue_copies(RawStage &raw, uint64_t *loaded, const kda_fwd_params &p, int tid)
{
    tid = per_chunk(tid);
    const ChunkInfo &info = raw.info;
    const int ntok = info.hdr.ntok;
    const int64_t stride = int64_t(p.heads) * D;   /* elements between tokens */
    const int seg = tid % 16, row0 = tid / 16;     /* 16 threads per 256-byte row, 8 rows per pass */
    uint16_t *const dst[4] = {raw.q, raw.k, raw.g, raw.v};
#pragma unroll
    for (int tensor = 0; tensor < 4; tensor++)
#pragma unroll
        for (int pass = 0; pass < C / 8; pass++) {
            const int row = row0 + 8 * pass;
            if (row < ntok)
                cp_async_16(dst[tensor] + row * D + seg * 8, info.src[tensor] + row * stride + seg * 8);
        }
    if (ntok > 0)
        cp_async_4(&raw.info.dt_bias[tid], info.dt_bias_src + tid);
    cp_async_mbar_arrive(loaded);
    return tid < ntok ? info.beta_src[tid * int64_t(p.heads)] : 0u;
}

/* WG1's first warp: sigmoid of the beta logits issue_copies returned, into their stage (0 past the chunk's end). */
__device__ __forceinline__ void store_beta(RawStage &raw, uint32_t beta, int lane)
{
    raw.info.beta[lane] = lane < raw.info.hdr.ntok ? sigmoid(bf16_lo(beta)) : 0.0f;
}

/*
 * Gates and tiles.  The thread's gate prefix sums stay in registers between
 * the pass that sums the gates and the pass that builds the decayed q/k
 * operands, the pair's two rows of Kr^T and the chunk's decay factors.
 * Tokens past the chunk's end (stale rows of the raw stage) become zeros.
 */
__device__ __forceinline__ void prepare_tiles(const RawStage &raw, PrepStage &st, ProducerScratch &scr, int ptid)
{
    ptid = per_chunk(ptid);
    const ChunkInfo &info = raw.info;
    const int ntok = info.hdr.ntok;
    const int pair = ptid % PAIRS, quarter = ptid / PAIRS, t_begin = quarter * QUARTER, d = 2 * pair;
    const float exp_a = info.exp_a, lb2 = info.lb2;
    const float2 dt_bias = *reinterpret_cast<const float2 *>(&info.dt_bias[d]);

    float2 G[QUARTER];                             /* gate prefix sums within the quarter, log2 units */
    float2 acc = make_float2(0.0f, 0.0f);
    {
        uint32_t gw[QUARTER];
#pragma unroll
        for (int e = 0; e < QUARTER; e++)
            gw[e] = *reinterpret_cast<const uint32_t *>(raw.g + (t_begin + e) * D + d);
#pragma unroll
        for (int e = 0; e < QUARTER; e++) {
            const float s0 = sigmoid(exp_a * (bf16_lo(gw[e]) + dt_bias.x));
            const float s1 = sigmoid(exp_a * (bf16_hi(gw[e]) + dt_bias.y));
            if (t_begin + e < ntok) {              /* padding tokens leave G unchanged */
                acc.x += lb2 * s0;
                acc.y += lb2 * s1;
            }
            G[e] = acc;
        }
    }
    scr.quarter_total[quarter][pair] = acc;
    producer_sync();                               /* quarter totals are in */

    float2 tot[4];
#pragma unroll
    for (int q = 0; q < 4; q++)
        tot[q] = scr.quarter_total[q][pair];
    const float2 mid = make_float2(tot[0].x + tot[1].x, tot[0].y + tot[1].y);    /* c: G at the middle token */
    const float2 tail = make_float2(tot[2].x + tot[3].x, tot[2].y + tot[3].y);   /* G_last - c */
    /* G_t - c = G[t] + shift: the quarters before the thread's, minus c */
    const float2 shift = quarter == 0 ? make_float2(-mid.x, -mid.y)
                       : quarter == 1 ? make_float2(-tot[1].x, -tot[1].y)
                       : quarter == 2 ? make_float2(0.0f, 0.0f)
                                      : tot[2];
    if (quarter == 0) {
        st.gam_mid[d] = fast_exp2(mid.x);
        st.gam_mid[d + 1] = fast_exp2(mid.y);
    } else if (quarter == 3) {
        st.gam_last[d] = fast_exp2(mid.x + tail.x);
        st.gam_last[d + 1] = fast_exp2(mid.y + tail.y);
    }
    const float2 decay_tail = make_float2(fast_exp2(tail.x), fast_exp2(tail.y));   /* e^(G_last - c) */

    uint32_t kr[2][QUARTER / 2];                   /* the pair's two Kr^T rows over the quarter */
#pragma unroll
    for (int t4 = 0; t4 < QUARTER; t4 += 4) {      /* 4 tokens: load, compute, store */
        uint32_t kw[4], qw[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int t = t_begin + t4 + e;
            kw[e] = t < ntok ? *reinterpret_cast<const uint32_t *>(raw.k + t * D + d) : 0u;
            qw[e] = t < ntok ? *reinterpret_cast<const uint32_t *>(raw.q + t * D + d) : 0u;
        }
        uint32_t kd[4], qd[4], ki[4], qi[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float2 g = G[t4 + e];
            const float up0 = fast_exp2(g.x + shift.x), up1 = fast_exp2(g.y + shift.y);   /* e^(G-c) */
            const float dn0 = fast_rcp(up0), dn1 = fast_rcp(up1);                          /* e^(c-G) */
            const float k0 = bf16_lo(kw[e]), k1 = bf16_hi(kw[e]), q0 = bf16_lo(qw[e]), q1 = bf16_hi(qw[e]);
            kd[e] = pack_bf16x2(k0 * up0, k1 * up1);
            qd[e] = pack_bf16x2(q0 * up0, q1 * up1);
            ki[e] = pack_bf16x2(k0 * dn0, k1 * dn1);
            qi[e] = pack_bf16x2(q0 * dn0, q1 * dn1);
            const float kr0 = k0 * dn0 * decay_tail.x, kr1 = k1 * dn1 * decay_tail.y;
            const int w = (t4 + e) / 2;
            if (e & 1) {
                kr[0][w] = pack_bf16x2(__uint_as_float(kr[0][w]), kr0);
                kr[1][w] = pack_bf16x2(__uint_as_float(kr[1][w]), kr1);
            } else {
                kr[0][w] = __float_as_uint(kr0);
                kr[1][w] = __float_as_uint(kr1);
            }
        }
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int t = t_begin + t4 + e;
            *reinterpret_cast<uint32_t *>(st.kq.at(t, d)) = kd[e];
            *reinterpret_cast<uint32_t *>(st.kq.at(C + t, d)) = qd[e];
            *reinterpret_cast<uint32_t *>(scr.kiq.at(t, d)) = ki[e];
            *reinterpret_cast<uint32_t *>(scr.kiq.at(C + t, d)) = qi[e];
        }
    }
    /* Kr^T rows d and d + 1, one 16-byte store each; odd groups of four pairs store row d + 1
       first, so a warp's stores cover all eight bank groups of the swizzle */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = r ^ ((pair >> 2) & 1);
        *reinterpret_cast<uint4 *>(st.krm.at(d + row, t_begin)) =
            row ? make_uint4(kr[1][0], kr[1][1], kr[1][2], kr[1][3]) : make_uint4(kr[0][0], kr[0][1], kr[0][2], kr[0][3]);
    }
}

/*
 * WG0: [kd; qd] . [ki; qi]^T on the tensor cores.  Warp w holds rows 16w + g
 * and 16w + g + 8 (g = lane / 4): warps 0-1 rows of L, warps 2-3 rows of Mqk.
 * The diagonal element of row r sits in n-tile r / 8, column g of the tile,
 * with lane 4g + g / 2 of the row's quad; a quad shuffle hands it to all four.
 */
__device__ __forceinline__ void prepare_lmqk(const RawStage &raw, PrepStage &st, ProducerScratch &scr, int tid)
{
    tid = per_chunk(tid);
    float lm[32];
#pragma unroll
    for (int i = 0; i < 32; i++)
        lm[i] = 0.0f;
    fence_operands(lm);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++)
        wgmma_m64n64k16_ss(lm, sw128_desc(st.kq.kslice(ks)), sw128_desc(scr.kiq.kslice(ks)), ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(lm);

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const bool is_mqk = warp >= 2;
#pragma unroll
    for (int h = 0; h < 2; h++) {                  /* rows g and g + 8 of the warp's 16 */
        float diag = 0.0f;                         /* selp: a plain ?: here became local-memory indexing */
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
            diag = select_f32(nt == 2 * warp + h, select_f32(g & 1, lm[4 * nt + 2 * h + 1], lm[4 * nt + 2 * h]), diag);
        const float sq = __shfl_sync(0xffffffffu, diag, (lane & ~3) | (g >> 1));
        const float n = rsqrtf(sq + KDA_NORM_EPS);   /* 1 / |k_t| or 1 / |q_t| */
        const int i = 16 * (warp & 1) + g + 8 * h;   /* token of the row */
        if (is_mqk) {
            if (t4 == 0)
                st.out_scale[i] = raw.info.scale * n;
#pragma unroll
            for (int nt = 0; nt < C / 8; nt++) {
                const int j = 8 * nt + 2 * t4;
                const float v0 = lm[4 * nt + 2 * h], v1 = lm[4 * nt + 2 * h + 1];
                *reinterpret_cast<uint32_t *>(st.krm.at(D + i, j)) = pack_bf16x2(j <= i ? v0 : 0.0f, j + 1 <= i ? v1 : 0.0f);
            }
        } else {
            const float b = raw.info.beta[i], bn = b * n, bn2 = bn * n;
            if (t4 == 0) {
                st.bn[i] = bn;
                st.bn2[i] = bn2;
            }
#pragma unroll
            for (int nt = 0; nt < C / 8; nt++) {
                const int j = 8 * nt + 2 * t4;
                const float v0 = lm[4 * nt + 2 * h], v1 = lm[4 * nt + 2 * h + 1];
                *reinterpret_cast<float2 *>(&scr.lmat[i][j]) = make_float2(j < i ? bn2 * v0 : 0.0f, j + 1 < i ? bn2 * v1 : 0.0f);
            }
        }
    }
}

/* WG1 while WG0 runs prepare_lmqk: the values, row-major raw -> the consumers' swizzled tile. */
__device__ __forceinline__ void prepare_values(const RawStage &raw, PrepStage &st, int tid)
{
    tid = per_chunk(tid);
    const int ntok = raw.info.hdr.ntok;
#pragma unroll
    for (int n = 0; n < 4; n++) {
        const int seg = tid + WG_THREADS * n, t = seg >> 4, part = seg & 15;
        const uint4 v = t < ntok ? *reinterpret_cast<const uint4 *>(raw.v + t * D + part * 8) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4 *>(st.v.at(t, part * 8)) = v;
    }
}

/*
 * Merges every pair of N x N diagonal blocks of the inverse into one 2N x 2N
 * block: [[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]] with
 * B = L[r1.., r0..].  A^-1 and C^-1 are lower triangular, so the sums skip
 * their upper triangles (never written).  One output per thread.
 */
template <int N>
__device__ __forceinline__ void merge_inverse_blocks(ProducerScratch &scr, int ptid)
{
    constexpr int OUTS = C / (2 * N) * N * N;
    static_assert(OUTS <= PRODUCER_THREADS, "one output per thread");
    const int pr = ptid / (N * N), i = (ptid % (N * N)) / N, j = ptid % N, r0 = 2 * N * pr;
    if (ptid < OUTS) {                             /* X = B . A^-1 */
        float s = 0.0f;
#pragma unroll
        for (int m = 0; m < N; m++)
            if (m >= j)
                s += scr.lmat[r0 + N + i][r0 + m] * scr.inv[r0 + m][r0 + j];
        scr.x[pr * N + i][j] = s;
    }
    producer_sync();
    if (ptid < OUTS) {                             /* -C^-1 . X */
        float s = 0.0f;
#pragma unroll
        for (int m = 0; m < N; m++)
            if (m <= i)
                s += scr.inv[r0 + N + i][r0 + N + m] * scr.x[pr * N + m][j];
        scr.inv[r0 + N + i][r0 + j] = -s;
    }
    producer_sync();
}

/*
 * (I + L^)^-1 in fp32 into the stage's bf16 tile (zero above the diagonal):
 * warps 0-3 each invert one 8 x 8 diagonal block by forward substitution
 * (lane j owns column j), then the blocks merge to 16 x 16 and to 32 x 32.
 */
__device__ __forceinline__ void prepare_inverse(PrepStage &st, ProducerScratch &scr, int ptid)
{
    ptid = per_chunk(ptid);
    constexpr int B = 8;
    const int warp = ptid >> 5, lane = ptid & 31;
    if (warp < C / B && lane < B) {
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
    producer_sync();
    merge_inverse_blocks<B>(scr, ptid);
    merge_inverse_blocks<2 * B>(scr, ptid);

    const int r = ptid >> 3, c0 = (ptid & 7) * 4;  /* four elements of row r per thread */
    uint32_t w[2];
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int j = c0 + 2 * e;
        w[e] = pack_bf16x2(j <= r ? scr.inv[r][j] : 0.0f, j + 1 <= r ? scr.inv[r][j + 1] : 0.0f);
    }
    *reinterpret_cast<uint2 *>(st.inv.at(r, c0)) = make_uint2(w[0], w[1]);
}

__device__ __forceinline__ void producer_main(SharedStorage &sm, const kda_fwd_params &p, int ptid)
{
    const uint32_t nitems = uint32_t(*p.nseqs) * uint32_t(p.heads);
    const int wg = ptid / WG_THREADS, tid = ptid % WG_THREADS;
    PROF_START(ptid == 0);

    /* Loads run two chunks ahead; WG1's first warp holds the beta logits of chunks n and n + 1, stored
       into their stage when the chunk is prepared, so their loads have 1.5 chunks to land. */
    if (ptid == 0) {                               /* an empty cursor: the first plan fetches an item */
        sm.scratch.cursor.seq = 0;
        sm.scratch.cursor.t0 = 1;
        sm.scratch.cursor.len = 0;
    }
    uint32_t beta[2] = {0u, 0u};
#pragma unroll
    for (int s = 0; s < 2; s++) {
        if (ptid == 0)
            plan_chunk(sm.scratch, p, nitems, sm.raw[s]);
        producer_sync();
        if (wg == 1)
            beta[s] = issue_copies(sm.raw[s], &sm.loaded[s], p, tid);
    }

    for (uint32_t n = 0;; n++) {
        RawStage &raw = sm.raw[n % RAW_STAGES], &ahead = sm.raw[(n + 2) % RAW_STAGES];
        PrepStage &st = sm.prep[n % PREP_STAGES];
        uint64_t *full = &sm.full[n % PREP_STAGES], *empty = &sm.empty[n % PREP_STAGES];
        const uint32_t empty_parity = ((n / PREP_STAGES) & 1) ^ 1;

        if (wg == 1 && tid < 32)                   /* chunk n's betas */
            store_beta(raw, beta[0], tid);
        beta[0] = beta[1];
        if (ptid == 0)                             /* chunk n + 2's plan */
            plan_chunk(sm.scratch, p, nitems, ahead);
        PROF_MARK(PROF_P_FETCH);
        mbar_wait(&sm.loaded[n % RAW_STAGES], (n / RAW_STAGES) & 1);   /* this chunk's rows have landed */
        PROF_MARK(PROF_P_LOADWAIT);
        mbar_wait(empty, empty_parity);            /* the consumers are done with this stage */
        fence_proxy_async();
        PROF_MARK(PROF_P_EMPTYWAIT);
        const ChunkHeader hdr = raw.info.hdr;
        if (hdr.flags & CHUNK_END) {               /* tell the consumers to stop */
            if (ptid == 0)
                st.hdr = hdr;
            mbar_arrive(full);
            PROF_FLUSH(PROF_TOTAL);
            return;
        }

        prepare_tiles(raw, st, sm.scratch, ptid);
        fence_proxy_async();                       /* kd, qd, ki, qi feed the wgmma below */
        producer_sync();                           /* (and chunk n + 2's plan is visible) */
        PROF_MARK(PROF_P_OPERANDS);
        if (wg == 0) {
            prepare_lmqk(raw, st, sm.scratch, tid);
        } else {                                   /* meanwhile: the values, and chunk n + 2's loads */
            prepare_values(raw, st, tid);
            if (tid == 0)
                st.hdr = hdr;
            beta[1] = issue_copies(ahead, &sm.loaded[(n + 2) % RAW_STAGES], p, tid);
        }
        producer_sync();
        PROF_MARK(PROF_P_LMQK);
        prepare_inverse(st, sm.scratch, ptid);
        fence_proxy_async();                       /* the stage's tiles feed the consumers' wgmma */
        mbar_arrive(full);
        PROF_MARK(PROF_P_INV);
    }
}

}  // namespace kda
