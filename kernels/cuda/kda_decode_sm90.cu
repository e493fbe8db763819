/*
 * kda_decode_sm90.cu - the decode-step kernel (kda.h, kda_step) and its C API
 * (kda_cuda_step, kda_cuda_step_check in kda_cuda.h).
 *
 * A step is many sequences of 1..16 tokens: its cost is reading and writing
 * each (sequence, head)'s 128 x 128 state, so the kernel is built to move
 * those bytes at the copy rate and do the recurrent form of KDA.md on them
 * while they sit in registers.
 *
 * Two CTAs of 4 warps per (sequence, head) (kda_cuda_step; or one of 8:
 * WARPS), blockIdx.x = (sequence * H + head) * (8 / WARPS) + part, so
 * neighbouring CTAs read neighbouring state.  Warp w (of the 8) owns the
 * state rows v = 16w .. 16w + 15; half-warp `half` of it owns the rows
 * 16w + 2i + half (i = 0..7), and each of its 16 lanes holds 8 keys of each
 * of those rows: 64 state values per thread, fp32 whatever the pool's dtype.
 * Keys per lane:
 *   fp32 pool: k = 4l..4l+3 and 64+4l..64+4l+3 (two 16-byte loads per row)
 *   bf16 pool: k = 8l..8l+7                    (one 16-byte load per row)
 * so each warp-wide load or store moves whole 256-byte pieces of rows.
 *
 * Per CTA: the state loads are issued first; the step's q, k, g, v rows of
 * this head for the sequence's tokens go to shared memory (cp.async)
 * meanwhile, and each token's k^, scale q^ and decay a are prepared there
 * once (the warps take tokens in turn).  Then per token, per warp:
 *   S = S diag(a);  sk = S k^  (a sum over the half-warp, reduced with a
 *   transposing butterfly: 8 shuffles give lane l the sum of row i = l / 2);
 *   u = b (v - sk), spread back through shared memory;  S += u k^T;
 *   o = scale S q^ (the same butterfly), stored as bf16 pairs; with
 *   step->states, the state after the token is stored there.
 * The slot is written once, after the last token.  Every input a CTA reads
 * is in device memory and read when it runs, so a launch captured in a CUDA
 * Graph replays with new steps.
 *
 * The registers hold one state per CTA, so on their own they keep too few
 * bytes in flight (a bf16 pool: at most 64 KiB per SM, and nothing of a
 * CTA's while it computes).  So each CTA also asks the L2 for the state and
 * token rows of the CTA half a wave after it (prefetch_item;
 * KDA_STEP_AHEAD_PERCENT): the HBM streams while CTAs compute, and a CTA's
 * own loads mostly hit the L2.
 */
#include "kda_decode_sm90.h"

#include <stdint.h>

#include "kda_cuda.h"

/* Warps per CTA kda_cuda_step launches with (bench_kernel --step-warps compares the other) */
static constexpr int STEP_WARPS = 4;

namespace kda_step_kernel {

constexpr int D = KDA_HEAD_DIM;
constexpr int MAXT = KDA_STEP_MAX_TOKENS;
constexpr unsigned FULL = 0xffffffffu;

/* A token's input rows (bf16 [128] each = 16 pieces of 16 bytes). */
struct __align__(16) TokenRows {
    uint4 q[16], k[16], g[16], v[16];
};

/* A token's prepared operands, fp32 [128] each: k^, scale q^, the decay a. */
struct __align__(16) TokenOps {
    float k[D], q[D], a[D];
};

struct __align__(16) Smem {
    TokenRows tok[MAXT];
    TokenOps ops[MAXT];
    float u[2][8][16];   /* per token parity and warp: u of the warp's 16 rows */
    float dt_bias[D];    /* this head's */
    float b[MAXT];       /* sigmoid(beta) */
};

__device__ __forceinline__ void cp_async_16(void *smem, const void *gmem)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))),
                 "l"(gmem)
                 : "memory");
}
__device__ __forceinline__ void cp_async_wait_all()
{
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}

/* Asks the L2 to fetch [gmem, gmem + bytes) (16-byte aligned, a multiple of 16); nothing waits for it. */
__device__ __forceinline__ void prefetch_l2(const void *gmem, uint32_t bytes)
{
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(gmem), "r"(bytes) : "memory");
}

__device__ __forceinline__ float bf16_lo(uint32_t x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t x) { return __uint_as_float(x & 0xffff0000u); }
/* Round to nearest even (finite values; NaN stays NaN). */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* 8 bf16 of a 128-element row at this lane's keys (see the layout above). */
template <bool BF16>
__device__ __forceinline__ void row8(const uint4 *row, int l, float x[8])
{
    uint32_t w[4];
    if (BF16) {
        const uint4 p = row[l];
        w[0] = p.x, w[1] = p.y, w[2] = p.z, w[3] = p.w;
    } else {
        const uint2 a = reinterpret_cast<const uint2 *>(row)[l], b = reinterpret_cast<const uint2 *>(row)[16 + l];
        w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y;
    }
    for (int j = 0; j < 4; j++) {
        x[2 * j] = bf16_lo(w[j]);
        x[2 * j + 1] = bf16_hi(w[j]);
    }
}

/* Sum over the 16 lanes of a half-warp. */
__device__ __forceinline__ float half_sum(float x)
{
    for (int m = 8; m > 0; m >>= 1)
        x += __shfl_xor_sync(FULL, x, m);
    return x;
}

/*
 * Transposing butterfly: p[i] are this lane's partial sums of rows i = 0..7;
 * returns the half-warp's full sum of row l / 2 (l = lane within the half).
 */
__device__ __forceinline__ float rows_sum(const float p[8], int l)
{
    const bool b3 = l & 8, b2 = l & 4, b1 = l & 2;
    float p4[4], p2[2];
    for (int j = 0; j < 4; j++)
        p4[j] = (b3 ? p[j + 4] : p[j]) + __shfl_xor_sync(FULL, b3 ? p[j] : p[j + 4], 8);
    for (int j = 0; j < 2; j++)
        p2[j] = (b2 ? p4[j + 2] : p4[j]) + __shfl_xor_sync(FULL, b2 ? p4[j] : p4[j + 2], 4);
    float s = (b1 ? p2[1] : p2[0]) + __shfl_xor_sync(FULL, b1 ? p2[0] : p2[1], 2);
    return s + __shfl_xor_sync(FULL, s, 1);
}

/* Offsets (in elements) of this lane's two 16-byte pieces (fp32) or one (bf16) within a state row. */
template <bool BF16>
__device__ __forceinline__ int key_offset(int l, int piece)
{
    return BF16 ? 8 * l : 4 * l + 64 * piece;
}

template <bool BF16>
__device__ __forceinline__ void load_state(const void *src, int row0, int l, float s[8][8])
{
    for (int i = 0; i < 8; i++) {
        const int r = row0 + 2 * i;
        if (BF16) {
            const uint4 p = __ldcs(reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(src) + r * D +
                                                                   key_offset<true>(l, 0)));
            const uint32_t w[4] = {p.x, p.y, p.z, p.w};
            for (int j = 0; j < 4; j++) {
                s[i][2 * j] = bf16_lo(w[j]);
                s[i][2 * j + 1] = bf16_hi(w[j]);
            }
        } else {
            for (int piece = 0; piece < 2; piece++) {
                const float4 p = __ldcs(reinterpret_cast<const float4 *>(static_cast<const float *>(src) + r * D +
                                                                         key_offset<false>(l, piece)));
                s[i][4 * piece] = p.x, s[i][4 * piece + 1] = p.y, s[i][4 * piece + 2] = p.z, s[i][4 * piece + 3] = p.w;
            }
        }
    }
}

template <bool BF16>
__device__ __forceinline__ void store_state(void *dst, int row0, int l, const float s[8][8])
{
    for (int i = 0; i < 8; i++) {
        const int r = row0 + 2 * i;
        if (BF16) {
            const uint4 p = make_uint4(pack_bf16(s[i][0], s[i][1]), pack_bf16(s[i][2], s[i][3]),
                                       pack_bf16(s[i][4], s[i][5]), pack_bf16(s[i][6], s[i][7]));
            __stcs(reinterpret_cast<uint4 *>(static_cast<uint16_t *>(dst) + r * D + key_offset<true>(l, 0)), p);
        } else {
            for (int piece = 0; piece < 2; piece++)
                __stcs(reinterpret_cast<float4 *>(static_cast<float *>(dst) + r * D + key_offset<false>(l, piece)),
                       make_float4(s[i][4 * piece], s[i][4 * piece + 1], s[i][4 * piece + 2], s[i][4 * piece + 3]));
        }
    }
}

/* This lane's 8 operands of a prepared [128] fp32 row (the keys of the layout above). */
template <bool BF16>
__device__ __forceinline__ void ops8(const float *row, int l, float x[8])
{
    const float4 a = *reinterpret_cast<const float4 *>(row + key_offset<BF16>(l, 0));
    const float4 b = *reinterpret_cast<const float4 *>(row + (BF16 ? 8 * l + 4 : key_offset<false>(l, 1)));
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

/*
 * u of the lane's own row (l / 2 of its half) to the warp through shared memory (one store; each
 * lane then loads the u of its rows, one load a row) rather than eight shuffles.  `buf` alternates
 * per token, so the loads of one token and the stores of the next never meet.
 */
__device__ __forceinline__ void put_u(float (*buf)[16], int warp_local, int half, int l, float u)
{
    if (!(l & 1))
        buf[warp_local][2 * (l >> 1) + half] = u;
    __syncwarp();
}

/* o of the lane's own row: bf16 pairs of rows (16w + l, 16w + l + 1) from the even lanes of half 0. */
__device__ __forceinline__ void store_out(uint16_t *out_row, int warp, int half, int l, float o)
{
    const float o_next = __shfl_down_sync(FULL, o, 16);
    if (half == 0 && !(l & 1))
        *reinterpret_cast<uint32_t *>(out_row + 16 * warp + l) = pack_bf16(o, o_next);
}

/*
 * The L2 prefetch of CTA `item`'s bytes (a CTA part of a wave after the caller): its slot's rows (one
 * contiguous piece: 16 * WARPS rows of 128) and, from the first part of a (sequence, head), the token
 * rows.  One warp issues it after its own loads; the state then reaches the later CTA from the L2,
 * so the HBM keeps streaming while CTAs compute, not only while their registers wait.
 */
template <bool BF16, int WARPS>
__device__ __forceinline__ void prefetch_item(const kda_step *step, const void *pool, int heads, int nseqs,
                                              unsigned item, int lane)
{
    constexpr int PARTS = 8 / WARPS;
    const int seq = item / PARTS / heads, head = item / PARTS % heads, part = item % PARTS;
    if (seq >= nseqs)
        return;
    const kda_step_seq sq = step->seqs[seq];
    if (sq.len < 1 || sq.len > MAXT)
        return;
    const size_t esize = BF16 ? 2 : 4, piece = size_t(16) * WARPS * D * esize;
    if (lane == 0 && !(sq.flags & KDA_SEQ_ZERO_STATE))
        prefetch_l2(static_cast<const char *>(pool) + (size_t(sq.slot) * heads + head) * D * D * esize + part * piece,
                    uint32_t(piece));
    for (int c = lane; part == 0 && c < 4 * sq.len; c += 32) {
        const int t = c >> 2, which = c & 3;
        const uint16_t *src = which == 0 ? step->q : which == 1 ? step->k : which == 2 ? step->g : step->v;
        prefetch_l2(src + (size_t(sq.start + t) * heads + head) * D, 2 * D);
    }
}

/* WARPS (4 or 8) warps per CTA: 8 / WARPS CTAs per (sequence, head), each holding 16 * WARPS state rows. */
template <bool BF16, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, 16 / WARPS)
    step_kernel(const kda_step *__restrict__ step, void *__restrict__ pool, int32_t heads, int32_t ahead)
{
    constexpr int THREADS = 32 * WARPS, PARTS = 8 / WARPS;
    __shared__ Smem sm;
    const int part = blockIdx.x % PARTS, seq = blockIdx.x / PARTS / heads, head = blockIdx.x / PARTS % heads;
    const int nseqs = step->nseqs;
    if (seq >= nseqs)
        return;
    const kda_step_seq sq = step->seqs[seq];
    const int len = sq.len;
    if (len < 1 || len > MAXT)   /* kda_cuda_step_check refuses these; never index past the buffers */
        return;
    const int lane = threadIdx.x & 31, wl = threadIdx.x >> 5, warp = part * WARPS + wl, half = lane >> 4, l = lane & 15;
    const int row0 = 16 * warp + half;
    const size_t head_elems = size_t(D) * D, esize = BF16 ? 2 : 4;
    char *slot = static_cast<char *>(pool) + (size_t(sq.slot) * heads + head) * head_elems * esize;

    /* the token rows of this head, 64 pieces of 16 bytes per token */
    for (int c = threadIdx.x; c < 64 * len; c += THREADS) {
        const int t = c >> 6, which = (c >> 4) & 3, piece = c & 15;
        const uint16_t *src = which == 0 ? step->q : which == 1 ? step->k : which == 2 ? step->g : step->v;
        uint4 *dst = which == 0 ? sm.tok[t].q : which == 1 ? sm.tok[t].k : which == 2 ? sm.tok[t].g : sm.tok[t].v;
        cp_async_16(dst + piece, src + (size_t(sq.start + t) * heads + head) * D + 8 * piece);
    }
    if (threadIdx.x < len) {
        const float beta = __uint_as_float(uint32_t(step->beta[size_t(sq.start + threadIdx.x) * heads + head]) << 16);
        sm.b[threadIdx.x] = 1.0f / (1.0f + __expf(-beta));
    }

    /* the state: issued now, used after the operands are prepared */
    float s[8][8];
    if (sq.flags & KDA_SEQ_ZERO_STATE) {
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < 8; j++)
                s[i][j] = 0.0f;
    } else {
        load_state<BF16>(slot, row0, l, s);
    }
    if (ahead > 0 && wl == WARPS - 1)
        prefetch_item<BF16, WARPS>(step, pool, heads, nseqs, blockIdx.x + unsigned(ahead), lane);

    const kda_layer *layer = step->layer;
    const float expA = __expf(layer->A_log[head]), lb = layer->lower_bound, scale = layer->scale;
    if (threadIdx.x < D)
        sm.dt_bias[threadIdx.x] = layer->dt_bias[head * D + threadIdx.x];
    cp_async_wait_all();
    __syncthreads();

    /* per token, once per CTA: k^, scale q^, a (warp wl takes tokens wl, wl + WARPS, ...; 4 keys a lane) */
    for (int t = wl; t < len; t += WARPS) {
        const uint2 kr = reinterpret_cast<const uint2 *>(sm.tok[t].k)[lane];
        const uint2 qr = reinterpret_cast<const uint2 *>(sm.tok[t].q)[lane];
        const uint2 gr = reinterpret_cast<const uint2 *>(sm.tok[t].g)[lane];
        const float k4[4] = {bf16_lo(kr.x), bf16_hi(kr.x), bf16_lo(kr.y), bf16_hi(kr.y)};
        const float q4[4] = {bf16_lo(qr.x), bf16_hi(qr.x), bf16_lo(qr.y), bf16_hi(qr.y)};
        const float g4[4] = {bf16_lo(gr.x), bf16_hi(gr.x), bf16_lo(gr.y), bf16_hi(gr.y)};
        float sk = 0.0f, sq2 = 0.0f;
        for (int j = 0; j < 4; j++) {
            sk = fmaf(k4[j], k4[j], sk);
            sq2 = fmaf(q4[j], q4[j], sq2);
        }
        for (int m = 16; m > 0; m >>= 1) {
            sk += __shfl_xor_sync(FULL, sk, m);
            sq2 += __shfl_xor_sync(FULL, sq2, m);
        }
        const float fk = 1.0f / sqrtf(sk + KDA_NORM_EPS), fq = scale / sqrtf(sq2 + KDA_NORM_EPS);
        float a4[4];
        for (int j = 0; j < 4; j++)
            a4[j] = __expf(lb / (1.0f + __expf(-expA * (g4[j] + sm.dt_bias[4 * lane + j]))));
        TokenOps &op = sm.ops[t];
        reinterpret_cast<float4 *>(op.k)[lane] = make_float4(k4[0] * fk, k4[1] * fk, k4[2] * fk, k4[3] * fk);
        reinterpret_cast<float4 *>(op.q)[lane] = make_float4(q4[0] * fq, q4[1] * fq, q4[2] * fq, q4[3] * fq);
        reinterpret_cast<float4 *>(op.a)[lane] = make_float4(a4[0], a4[1], a4[2], a4[3]);
    }
    __syncthreads();

    const int own = row0 + 2 * (l >> 1);   /* the row whose sums this lane holds after rows_sum */
    for (int t = 0; t < len; t++) {
        const TokenOps &op = sm.ops[t];
        const size_t tok_head = size_t(sq.start + t) * heads + head;
        float kk[8], a[8], p[8];
        ops8<BF16>(op.k, l, kk);
        ops8<BF16>(op.a, l, a);

        /* S = S diag(a); sk = S k^ */
        for (int i = 0; i < 8; i++) {
            p[i] = 0.0f;
            for (int j = 0; j < 8; j++) {
                s[i][j] *= a[j];
                p[i] = fmaf(s[i][j], kk[j], p[i]);
            }
        }
        const float sk = rows_sum(p, l);
        const float vv = __uint_as_float(uint32_t(reinterpret_cast<const uint16_t *>(sm.tok[t].v)[own]) << 16);
        float (*ubuf)[16] = sm.u[t & 1];
        put_u(ubuf, wl, half, l, sm.b[t] * (vv - sk));

        /* S += u k^T; o = scale S q^ (q prepared with the scale) */
        float qq[8];
        ops8<BF16>(op.q, l, qq);
        for (int i = 0; i < 8; i++) {
            const float ui = ubuf[wl][2 * i + half];
            p[i] = 0.0f;
            for (int j = 0; j < 8; j++) {
                s[i][j] = fmaf(ui, kk[j], s[i][j]);
                p[i] = fmaf(s[i][j], qq[j], p[i]);
            }
        }
        store_out(step->out + tok_head * D, warp, half, l, rows_sum(p, l));
        if (step->states)
            store_state<BF16>(static_cast<char *>(step->states) + tok_head * head_elems * esize, row0, l, s);
    }
    store_state<BF16>(slot, row0, l, s);
}

}  // namespace kda_step_kernel

extern "C" int kda_cuda_step_check(const kda_pool *pool, const kda_step *step, kda_error *err)
{
    int rc = kda_step_check(pool, step, err);
    if (rc != KDA_OK || step->nseqs == 0)
        return rc;
    const uintptr_t any = uintptr_t(step->q) | uintptr_t(step->k) | uintptr_t(step->v) | uintptr_t(step->g) |
                          uintptr_t(step->out) | uintptr_t(step->states);
    if (any & 15)
        return kda_fail(err, KDA_EINVAL, "step: q, k, v, g, out and states must be 16-byte aligned");
    if (int64_t(step->nseqs) * pool->heads * 2 > INT32_MAX)
        return kda_fail(err, KDA_EINVAL, "step: %d sequences x %d heads exceed the kernel's grid", step->nseqs,
                        pool->heads);
    return KDA_OK;
}

int32_t kda_step_ahead_ctas(int percent, int warps, int sm_count)
{
    return int32_t(int64_t(percent) * sm_count * (16 / warps) / 100);
}

cudaError_t kda_step_launch(const kda_pool *pool, const kda_step *step_dev, int32_t max_seqs, int warps,
                            int32_t ahead, cudaStream_t stream)
{
    using namespace kda_step_kernel;
    const unsigned seq_heads = unsigned(int64_t(max_seqs) * pool->heads);
    const bool bf16 = pool->dtype == KDA_DTYPE_BF16;
    if (warps == 4 && bf16)
        step_kernel<true, 4><<<2 * seq_heads, 128, 0, stream>>>(step_dev, pool->state, pool->heads, ahead);
    else if (warps == 4)
        step_kernel<false, 4><<<2 * seq_heads, 128, 0, stream>>>(step_dev, pool->state, pool->heads, ahead);
    else if (bf16)
        step_kernel<true, 8><<<seq_heads, 256, 0, stream>>>(step_dev, pool->state, pool->heads, ahead);
    else
        step_kernel<false, 8><<<seq_heads, 256, 0, stream>>>(step_dev, pool->state, pool->heads, ahead);
    return cudaGetLastError();
}

extern "C" int kda_cuda_step(kda_cuda *cuda, const kda_pool *pool, const kda_step *step_dev, int32_t max_seqs,
                             void *stream, kda_error *err)
{
    if (!cuda || !pool || !pool->state || !step_dev || max_seqs < 0)
        return kda_fail(err, KDA_EINVAL, "kda_cuda_step: missing pool, step or count");
    if (pool->heads < 1 || pool->heads > KDA_MAX_HEADS)
        return kda_fail(err, KDA_EINVAL, "pool heads %d is outside [1, %d]", pool->heads, KDA_MAX_HEADS);
    if (pool->dtype != KDA_DTYPE_BF16 && pool->dtype != KDA_DTYPE_F32)
        return kda_fail(err, KDA_EINVAL, "pool dtype %d is neither bf16 nor fp32", int(pool->dtype));
    if (int64_t(max_seqs) * pool->heads * 2 > INT32_MAX)
        return kda_fail(err, KDA_EINVAL, "kda_cuda_step: %d sequences x %d heads exceed the grid", max_seqs,
                        pool->heads);
    if (max_seqs == 0)
        return KDA_OK;
    const int32_t ahead = kda_step_ahead_ctas(KDA_STEP_AHEAD_PERCENT, STEP_WARPS, kda_cuda_sm_count(cuda));
    const cudaError_t e =
        kda_step_launch(pool, step_dev, max_seqs, STEP_WARPS, ahead, static_cast<cudaStream_t>(stream));
    return e == cudaSuccess ? KDA_OK : kda_fail(err, KDA_EDEVICE, "launching the step kernel: %s", cudaGetErrorString(e));
}
