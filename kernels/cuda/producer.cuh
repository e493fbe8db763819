/*
 * producer.cuh - warpgroup 0: loads chunks and prepares everything of a
 * chunk that does not depend on the state, one chunk ahead of the consumers.
 *
 * Per chunk of C = 32 tokens of one (sequence, head), with c the gate prefix
 * sum at the chunk's middle token (per key dim) so every exponent below stays
 * within e^+-80 (KDA.md, "Range"):
 *
 *   A  norms    1/|q_t|, 1/|k_t| (one warp per 8 tokens), b_t = sigmoid(beta_t)
 *   B  gates    thread d: G_t = sum_{s<=t} lower_bound * sigmoid(e^A_log (g_sd + dt_bias_d))
 *               kdc = k^ e^(G-c), qdc = scale q^ e^(G-c), kic = k^ e^(c-G),
 *               Kr^T[d][t] = k^ e^(G_last - G_t), e^G_last, e^c
 *   C  L, Mqk   [kdc; qdc] . kic^T by wgmma (64 x 32 x 128); L = strictly_lower(b_i .),
 *               Mqk = lower_incl(.)
 *   D  inverse  (I + L)^-1 in fp32: two 16 x 16 diagonal blocks by forward
 *               substitution, then the off-diagonal block -C^-1 L21 A^-1
 *
 * Loads of chunk n+1 (cp.async into a RawStage) are in flight while chunk n
 * is prepared; the prepared operands go to PrepStage n % 3 for the consumers.
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

/* The chunk the producer is loading or preparing. */
struct ProducerChunk {
    int32_t seq = -1, head = 0;
    int64_t len = 0;             /* tokens of the sequence */
    int32_t t0 = 0, ntok = 0;    /* chunk start and real tokens in it */
    uint32_t flags = 0;          /* CHUNK_* */
    const uint16_t *q = nullptr, *k = nullptr, *g = nullptr, *beta = nullptr;
    const kda_layer *layer = nullptr;
};

/* Per-chunk scalars loaded with the chunk, one chunk ahead of their use. */
struct ProducerPrefetch {
    float beta;          /* thread t < 32: beta logit of token t */
    float dt_bias;       /* thread d: dt_bias[head][d] */
    float a_log, lower_bound, scale;
};

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
    ch.g = s.g;
    ch.beta = s.beta;
    ch.layer = s.layer;
    ch.t0 = 0;
    ch.ntok = int32_t(ch.len < C ? ch.len : C);
    ch.flags = CHUNK_FIRST | (ch.len <= C ? CHUNK_LAST : 0u);
}

/* Issues the chunk's q, k, g loads (rows past its end are zero-filled) and its scalars. */
__device__ __forceinline__ ProducerPrefetch producer_load(const ProducerChunk &ch, RawStage &raw,
                                                          const kda_fwd_params &p, int tid)
{
    const int64_t stride = int64_t(p.heads) * D;   /* elements between tokens */
    /* 32 rows x 16 segments of 16 bytes per tensor: 4 segments per thread */
#pragma unroll
    for (int n = 0; n < 4; n++) {
        const int seg = tid + WG_THREADS * n, t = seg >> 4, part = seg & 15;
        const bool real = t < ch.ntok;
        const int64_t off = real ? (ch.t0 + t) * stride + int64_t(ch.head) * D + part * 8 : 0;
        const void *dummy = p.seqs;   /* any valid global address; nothing is read from it */
        const uint32_t bytes = real ? 16u : 0u;
        cp_async_16(raw.q + t * D + part * 8, real ? ch.q + off : dummy, bytes);
        cp_async_16(raw.k + t * D + part * 8, real ? ch.k + off : dummy, bytes);
        cp_async_16(raw.g + t * D + part * 8, real ? ch.g + off : dummy, bytes);
    }
    ProducerPrefetch pre;
    pre.beta = tid < ch.ntok ? bf16_to_f32(ch.beta[(ch.t0 + tid) * int64_t(p.heads) + ch.head]) : 0.0f;
    if (ch.layer) {
        pre.dt_bias = ch.layer->dt_bias[ch.head * D + tid];
        pre.a_log = ch.layer->A_log[ch.head];
        pre.lower_bound = ch.layer->lower_bound;
        pre.scale = ch.layer->scale;
    } else {   /* a zero-length item (KDA_SEQ_ZERO_STATE only): no layer, nothing to compute */
        pre.dt_bias = pre.a_log = pre.scale = 0.0f;
        pre.lower_bound = -1.0f;
    }
    return pre;
}

/* Phase A: q/k inverse norms (warp w: tokens 8w..8w+7) and b = sigmoid(beta). */
__device__ __forceinline__ void prepare_norms(const ProducerChunk &ch, const ProducerPrefetch &pre,
                                              const RawStage &raw, PrepStage &st, ProducerScratch &scr,
                                              int tid)
{
    const int warp = tid >> 5, lane = tid & 31;
#pragma unroll
    for (int tt = 0; tt < 8; tt++) {
        const int t = warp * 8 + tt;
        const uint2 qw = *reinterpret_cast<const uint2 *>(raw.q + t * D + lane * 4);
        const uint2 kw = *reinterpret_cast<const uint2 *>(raw.k + t * D + lane * 4);
        float sq = 0.0f, sk = 0.0f;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const uint32_t qe = e ? qw.y : qw.x, ke = e ? kw.y : kw.x;
            const float q0 = __uint_as_float(qe << 16), q1 = __uint_as_float(qe & 0xffff0000u);
            const float k0 = __uint_as_float(ke << 16), k1 = __uint_as_float(ke & 0xffff0000u);
            sq += q0 * q0 + q1 * q1;
            sk += k0 * k0 + k1 * k1;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            sq += __shfl_xor_sync(0xffffffffu, sq, off);
            sk += __shfl_xor_sync(0xffffffffu, sk, off);
        }
        if (lane == 0) {
            scr.inv_norm_q[t] = rsqrtf(sq + KDA_NORM_EPS);
            scr.inv_norm_k[t] = rsqrtf(sk + KDA_NORM_EPS);
        }
    }
    if (warp == 0)
        st.beta[lane] = lane < ch.ntok ? 1.0f / (1.0f + __expf(-pre.beta)) : 0.0f;
    if (tid == 0)
        st.hdr = ChunkHeader{ch.seq, ch.head, ch.t0, ch.ntok, ch.flags};
}

/*
 * Phase B: gates and the decayed, centred q/k operands; thread d owns key dim
 * d.  Tokens go in groups of 8 (one 16-byte chunk of a Kr^T row, and a
 * compile-time swizzle phase); the prefix sums wait in shared memory between
 * the two passes.
 */
__device__ __forceinline__ void prepare_gates(const ProducerChunk &ch, const ProducerPrefetch &pre,
                                              const RawStage &raw, PrepStage &st, ProducerScratch &scr,
                                              int d)
{
    const float exp_a = expf(pre.a_log);
    const float lb2 = pre.lower_bound * LOG2E;       /* gate increments in log2 units */
    float acc = 0.0f, mid = 0.0f;
#pragma unroll 1
    for (int t8 = 0; t8 < C; t8 += 8) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int t = t8 + e;
            const float x = exp_a * (bf16_to_f32(raw.g[t * D + d]) + pre.dt_bias);
            const float sig = fast_rcp(1.0f + fast_exp2(-x * LOG2E));
            acc += t < ch.ntok ? lb2 * sig : 0.0f;   /* padding tokens leave G unchanged */
            scr.gate[t][d] = acc;
            if (t == C / 2 - 1)
                mid = acc;
        }
    }
    const float last = acc;
    st.gam_last[d] = fast_exp2(last);
    st.gam_mid[d] = fast_exp2(mid);
    const float decay_last_mid = fast_exp2(last - mid);

#pragma unroll 1
    for (int t8 = 0; t8 < C; t8 += 8) {
        uint32_t kr[4];                              /* Kr^T[d][t8..t8+7] as bf16 pairs */
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int t = t8 + e;
            const float up = fast_exp2(scr.gate[t][d] - mid), down = fast_rcp(up);   /* e^(G-c), e^(c-G) */
            const float kn = bf16_to_f32(raw.k[t * D + d]) * scr.inv_norm_k[t];
            const float qn = bf16_to_f32(raw.q[t * D + d]) * scr.inv_norm_q[t] * pre.scale;
            *st.kq.at(t, d) = f32_to_bf16(kn * up);
            *st.kq.at(C + t, d) = f32_to_bf16(qn * up);
            *scr.kic.at(t, d) = f32_to_bf16(kn * down);
            const float krv = kn * down * decay_last_mid;
            if (e & 1)
                kr[e / 2] = pack_bf16x2(__uint_as_float(kr[e / 2]), krv);
            else
                kr[e / 2] = __float_as_uint(krv);
        }
        *reinterpret_cast<uint4 *>(st.krm.at(d, t8)) = make_uint4(kr[0], kr[1], kr[2], kr[3]);
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
    const int row = 16 * (warp & 1) + g;
#pragma unroll
    for (int nt = 0; nt < C / 8; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = row + (e >= 2 ? 8 : 0), j = 8 * nt + 2 * t4 + (e & 1);
            const float val = lm[4 * nt + e];
            if (is_mqk)
                *st.krm.at(D + i, j) = f32_to_bf16(j <= i ? val : 0.0f);
            else
                scr.lmat[i][j] = j < i ? st.beta[i] * val : 0.0f;
        }
    }
}

/* Phase D: (I + L)^-1 into the stage's bf16 tile (zero above the diagonal). */
__device__ __forceinline__ void prepare_inverse(PrepStage &st, ProducerScratch &scr, int tid)
{
    constexpr int H = C / 2;
    const int warp = tid >> 5, lane = tid & 31;
    if (warp == 0) {   /* lanes 0-15: columns of A^-1 (rows 0..15); lanes 16-31: of C^-1 (16..31) */
        const int off = (lane >> 4) * H, j = lane & (H - 1);
        float x[H];
#pragma unroll
        for (int m = 0; m < H; m++)
            x[m] = m == j ? 1.0f : 0.0f;
#pragma unroll
        for (int i = 1; i < H; i++) {
            float s = x[i];
#pragma unroll
            for (int m = 0; m < i; m++)
                s -= scr.lmat[off + i][off + m] * x[m];
            x[i] = s;
        }
#pragma unroll
        for (int m = 0; m < H; m++)
            scr.inv[off + m][off + j] = x[m];
    }
    named_barrier_sync(BAR_PRODUCER, WG_THREADS);

    const int i = tid >> 3, j0 = (tid & 7) * 2;      /* 128 threads x 2 entries of a 16 x 16 block */
#pragma unroll
    for (int e = 0; e < 2; e++) {                    /* X = L21 . A^-1 */
        float s = 0.0f;
#pragma unroll
        for (int m = 0; m < H; m++)
            s += scr.lmat[H + i][m] * scr.inv[m][j0 + e];
        scr.x[i][j0 + e] = s;
    }
    named_barrier_sync(BAR_PRODUCER, WG_THREADS);
#pragma unroll
    for (int e = 0; e < 2; e++) {                    /* INV21 = -C^-1 . X */
        float s = 0.0f;
#pragma unroll
        for (int m = 0; m < H; m++)
            s += scr.inv[H + i][H + m] * scr.x[m][j0 + e];
        scr.inv[H + i][j0 + e] = -s;
    }
    named_barrier_sync(BAR_PRODUCER, WG_THREADS);

    const int r = tid >> 2, c0 = (tid & 3) * 8;      /* one 16-byte chunk of row r per thread */
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
    ProducerChunk next;
    producer_advance(next, p, nitems, sm.scratch, tid);
    ProducerPrefetch next_pre{};
    if (!(next.flags & CHUNK_END))
        next_pre = producer_load(next, sm.raw[0], p, tid);
    cp_async_commit();

    for (uint32_t n = 0;; n++) {
        const ProducerChunk cur = next;
        const ProducerPrefetch pre = next_pre;
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
        producer_advance(next, p, nitems, sm.scratch, tid);
        if (!(next.flags & CHUNK_END))
            next_pre = producer_load(next, sm.raw[(n + 1) % RAW_STAGES], p, tid);
        cp_async_commit();
        PROF_MARK(PROF_P_FETCH);
        cp_async_wait<1>();                          /* this chunk's loads (not the next's) */
        named_barrier_sync(BAR_PRODUCER, WG_THREADS);
        PROF_MARK(PROF_P_LOADWAIT);

        mbar_wait(empty, empty_parity);              /* the consumers are done with this stage */
        fence_proxy_async();
        PROF_MARK(PROF_P_EMPTYWAIT);
        const RawStage &raw = sm.raw[n % RAW_STAGES];
        prepare_norms(cur, pre, raw, st, sm.scratch, tid);
        named_barrier_sync(BAR_PRODUCER, WG_THREADS);
        PROF_MARK(PROF_P_NORMS);
        prepare_gates(cur, pre, raw, st, sm.scratch, tid);
        fence_proxy_async();                         /* kq, kic feed the wgmma below */
        named_barrier_sync(BAR_PRODUCER, WG_THREADS);
        PROF_MARK(PROF_P_GATES);
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
