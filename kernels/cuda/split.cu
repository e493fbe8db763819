/*
 * split.cu - the split path's plan, scan and correction kernels (split.h).
 *
 * Scratch slots (fp32 [slot][heads][D][D], kda_fwd_params.scratch), for
 * sequence i of the table and its segment j, u = i * segs + j, U = max_seqs * segs:
 *   u        R_j  the segment's final state from a zero state
 *   U + u    M_j  its final state from the identity with zero values
 *   2U + u   S_j  its initial state (the scan's output; the correction and pass 3 read it)
 * The outputs scratch holds qeff (the identity run's outputs) of sequence i's
 * tokens from the sum of the lengths before it, in the outputs' layout.
 */
#include "split.h"

#include <mma.h>

#include "ptx.cuh"
#include "smem.cuh"

namespace kda {

/* How sequence i is cut: nseg pieces of seg_len tokens (whole chunks; the last may be short); `before`: the
   tokens of the sequences before it (where its qeff starts in the outputs scratch). */
struct Cut {
    int32_t nseg;
    int64_t seg_len, before;
};

/* Whether the qeff of tokens [0, end) of a sequence fits the outputs scratch: corrected, not recomputed. */
__device__ __forceinline__ bool fits(const kda_split_args &a, int64_t before, int64_t end, int32_t heads)
{
    return (before + end) * heads * D <= a.qeff_elems;
}

__device__ __forceinline__ Cut split_cut(const kda_fwd_params &p, const kda_split_args &a, int32_t i)
{
    Cut c{1, 0, 0};
    for (int32_t j = 0; j < i; j++)
        c.before += p.seqs[j].len;
    const int64_t len = p.seqs[i].len;
    int64_t n = len / a.min_tokens;
    n = n < 1 ? 1 : n > a.segs ? a.segs : n;
    const int64_t chunks = (len + C - 1) / C;
    c.seg_len = ((chunks + n - 1) / n) * C;
    c.nseg = c.seg_len > 0 ? int32_t((len + c.seg_len - 1) / c.seg_len) : 1;
    return c;
}

/* One thread per sequence of the table (max_seqs of them). */
__global__ void split_plan_kernel(const kda_fwd_params p, const kda_split_args a, kda_seq *table, int32_t *counts)
{
    const int32_t i = int32_t(blockIdx.x * blockDim.x + threadIdx.x), segs = a.segs, U = a.max_seqs * segs;
    if (i == 0) {
        counts[0] = 2 * U;
        counts[1] = U;
    }
    if (i >= a.max_seqs)
        return;
    kda_seq *r_runs = table, *m_runs = table + U, *runs = table + 2 * U;
    const kda_seq none = {};
    if (i >= *p.nseqs) {
        for (int32_t j = 0; j < segs; j++)
            r_runs[i * segs + j] = m_runs[i * segs + j] = runs[i * segs + j] = none;
        return;
    }
    const kda_seq desc = p.seqs[i];
    const Cut cut = split_cut(p, a, i);
    const int64_t stride = int64_t(p.heads) * D;
    for (int32_t j = 0; j < segs; j++) {
        const int32_t u = i * segs + j;
        kda_seq seg = none, r = none, m = none;
        if (cut.nseg == 1 && j == 0) {
            seg = desc;                           /* not cut: runs as given, pool slot to pool slot */
        } else if (j < cut.nseg) {
            const int64_t t0 = j * cut.seg_len, left = desc.len - t0;
            const bool last = j + 1 == cut.nseg;
            seg = desc;
            seg.q += t0 * stride;
            seg.k += t0 * stride;
            seg.v += t0 * stride;
            seg.g += t0 * stride;
            seg.out += t0 * stride;
            seg.beta += t0 * p.heads;
            seg.len = left < cut.seg_len ? left : cut.seg_len;
            seg.flags = KDA_SEQ_LOAD_SCRATCH | (last ? 0u : KDA_SEQ_STORE_SCRATCH);
            seg.reserved = uint32_t(2 * U + u);
            const bool corrected = fits(a, cut.before, t0 + seg.len, p.heads);
            if (!last || corrected) {             /* a recomputed last segment needs no R and M */
                r = seg;
                r.out = corrected ? seg.out : nullptr;                       /* o0, corrected in place */
                r.flags = KDA_SEQ_ZERO_STATE | KDA_SEQ_STORE_SCRATCH;
                r.reserved = uint32_t(u);
                m = r;
                m.out = corrected ? a.qeff + (cut.before + t0) * stride : nullptr;   /* qeff */
                m.flags = KDA_SEQ_IDENTITY_STATE | KDA_SEQ_STORE_SCRATCH;
                m.reserved = uint32_t(U + u);
            }
            if (corrected)
                seg = none;
        }
        r_runs[u] = r;
        m_runs[u] = m;
        runs[u] = seg;
    }
}

constexpr int SCAN_ROWS = 8;     /* state rows per CTA of the scan; a thread per column */
constexpr int SCAN_MROWS = 64;   /* rows of M staged in shared memory at once */

/*
 * Block (sequence, head, 8 rows): the rows of S_0 (pool, or zeros), then
 * S_{j+1} = S_j M_j + R_j row by row (the rows of S are independent), each
 * S_j stored to its scratch slot and, when the last segment is corrected
 * (not recomputed by pass 3), S_nseg to the pool slot.  fp32 throughout.
 */
__global__ void __launch_bounds__(D) split_scan_kernel(const kda_fwd_params p, const kda_split_args a, float *scratch)
{
    __shared__ float rows[SCAN_ROWS][D];
    __shared__ __align__(16) float mp[SCAN_MROWS][D];
    constexpr int BLOCKS = D / SCAN_ROWS;
    const int32_t i = int32_t(blockIdx.x) / (p.heads * BLOCKS), h = int32_t(blockIdx.x / BLOCKS) % p.heads;
    const int r0 = int(blockIdx.x % BLOCKS) * SCAN_ROWS, c = int(threadIdx.x), U = a.max_seqs * a.segs;
    if (i >= *p.nseqs)
        return;
    const kda_seq desc = p.seqs[i];
    const Cut cut = split_cut(p, a, i);
    if (cut.nseg == 1)
        return;
    const bool to_pool = fits(a, cut.before, desc.len, p.heads);
    const int64_t head_elems = int64_t(D) * D;
    const auto slot_at = [&](int64_t slot) { return scratch + (slot * p.heads + h) * head_elems; };
    float s[SCAN_ROWS];
    const int64_t pool_at = (desc.slot * p.heads + h) * head_elems + int64_t(r0) * D + c;
#pragma unroll
    for (int r = 0; r < SCAN_ROWS; r++) {
        const int64_t at = pool_at + int64_t(r) * D;
        s[r] = desc.flags & KDA_SEQ_ZERO_STATE ? 0.0f
             : p.state_is_bf16 ? bf16_lo(static_cast<const uint16_t *>(p.state)[at])
                               : static_cast<const float *>(p.state)[at];
    }
    const int32_t u0 = i * a.segs;
    for (int32_t j = 0;; j++) {
        float *out = slot_at(2 * U + u0 + j) + int64_t(r0) * D + c;
#pragma unroll
        for (int r = 0; r < SCAN_ROWS; r++)
            out[r * D] = s[r];
        if (j + 1 == cut.nseg && !to_pool)
            break;
        __syncthreads();                           /* the previous step's reads of `rows` are done */
#pragma unroll
        for (int r = 0; r < SCAN_ROWS; r++)
            rows[r][c] = s[r];
        __syncthreads();
        const float *m = slot_at(U + u0 + j), *rr = slot_at(u0 + j) + int64_t(r0) * D + c;
#pragma unroll
        for (int r = 0; r < SCAN_ROWS; r++)
            s[r] = rr[r * D];
        for (int k0 = 0; k0 < D; k0 += SCAN_MROWS) {     /* M in two pieces, each thread's loads in flight at once */
            float4 x[SCAN_MROWS / 4];
#pragma unroll
            for (int q = 0; q < SCAN_MROWS / 4; q++)
                x[q] = reinterpret_cast<const float4 *>(m + int64_t(k0) * D)[q * D + c];
            __syncthreads();                       /* the previous piece's reads of `mp` are done */
#pragma unroll
            for (int q = 0; q < SCAN_MROWS / 4; q++)
                reinterpret_cast<float4 *>(&mp[0][0])[q * D + c] = x[q];
            __syncthreads();
#pragma unroll 16
            for (int k = 0; k < SCAN_MROWS; k++) {
                const float mk = mp[k][c];
#pragma unroll
                for (int r = 0; r < SCAN_ROWS; r++)
                    s[r] = fmaf(rows[r][k0 + k], mk, s[r]);
            }
        }
        if (j + 1 == cut.nseg) {                   /* the sequence's final state */
#pragma unroll
            for (int r = 0; r < SCAN_ROWS; r++) {
                const int64_t at = pool_at + int64_t(r) * D;
                if (p.state_is_bf16)
                    static_cast<uint16_t *>(p.state)[at] = uint16_t(pack_bf16x2(s[r], 0.0f));
                else
                    static_cast<float *>(p.state)[at] = s[r];
            }
            break;
        }
    }
}

/*
 * The correction: block (x, segment u x heads + h) takes the segment's 64-token tiles x, x + gridDim.x, ...;
 * warp w the tile's tokens 16w .. 16w + 15.  o (16 x 128) = o0 + qeff (16 x 128) . S_in^T by bf16 tensor-core
 * products with fp32 sums (S_in as bf16, as the fused kernel's state operand), 64 state rows at a time.
 * Memory-bound: each warp loads its next tile's qeff and o0 rows while it computes the current one.
 */
constexpr int CORR_TOKENS = 64, CORR_WARPS = CORR_TOKENS / 16, CORR_LD = D + 8, ACC_LD = 64 + 4;   /* padded rows */
struct CorrWarp {
    uint16_t a[16][CORR_LD];      /* qeff rows, bf16 */
    float acc[16][ACC_LD];        /* the product's 64 columns in turn */
};
struct CorrSmem {
    uint16_t s[D][CORR_LD];       /* S_in[v][k], bf16: the B operand, column-major */
    CorrWarp warp[CORR_WARPS];
};

/* A warp's 16 tokens in registers: qeff row 2i + lane / 16 at columns 8 (lane % 16) (q[i]); o0 row
   lane / 8 + 4i at columns 64 half + 8 (lane % 8) (o[4 half + i]).  Rows past the segment read as zero. */
struct CorrRows {
    uint4 q[8], o[8];
};
__device__ __forceinline__ void corr_load(CorrRows &x, const uint16_t *qeff, const uint16_t *out, int64_t t0,
                                          int64_t rows, int64_t stride, int lane)
{
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int row = 2 * i + (lane >> 4);
        x.q[i] = row < rows ? *reinterpret_cast<const uint4 *>(qeff + (t0 + row) * stride + (lane & 15) * 8)
                            : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int row = (lane >> 3) + 4 * (i % 4);
        x.o[i] = row < rows ? *reinterpret_cast<const uint4 *>(out + (t0 + row) * stride + 64 * (i / 4) + (lane & 7) * 8)
                            : make_uint4(0, 0, 0, 0);
    }
}

__global__ void __launch_bounds__(32 * CORR_WARPS, 2) split_correct_kernel(const kda_fwd_params p, int32_t units,
                                                                           const kda_seq *table, const float *scratch)
{
    using namespace nvcuda;
    extern __shared__ __align__(128) unsigned char corr_smem[];
    CorrSmem &sm = *reinterpret_cast<CorrSmem *>(corr_smem);
    const int32_t u = int32_t(blockIdx.y) / p.heads, h = int32_t(blockIdx.y) % p.heads;
    const kda_seq r = table[u], m = table[units + u];
    if (!r.out || r.len <= 0)                     /* not corrected (recomputed, not cut, or unused) */
        return;
    const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
    const int64_t stride = int64_t(p.heads) * D, step = int64_t(gridDim.x) * CORR_TOKENS;
    uint16_t *out = r.out + int64_t(h) * D;
    const uint16_t *qeff = m.out + int64_t(h) * D;
    const auto rows_at = [&](int64_t t0) { return r.len - t0 < 16 ? r.len - t0 : int64_t(16); };
    int64_t t0 = int64_t(blockIdx.x) * CORR_TOKENS + 16 * warp;
    CorrRows cur, next;
    if (t0 < r.len)
        corr_load(cur, qeff, out, t0, rows_at(t0), stride, lane);
    const float *s_in = scratch + (int64_t(2 * units + u) * p.heads + h) * int64_t(D * D);
    for (int i = int(threadIdx.x); i < D * D / 4; i += blockDim.x) {
        const float4 x = reinterpret_cast<const float4 *>(s_in)[i];
        const int v = i / (D / 4), k = (i % (D / 4)) * 4;
        *reinterpret_cast<uint2 *>(&sm.s[v][k]) = make_uint2(pack_bf16x2(x.x, x.y), pack_bf16x2(x.z, x.w));
    }
    __syncthreads();
    CorrWarp &w = sm.warp[warp];
    for (; t0 < r.len; t0 += step) {
        const int64_t rows = rows_at(t0);
#pragma unroll
        for (int i = 0; i < 8; i++)
            *reinterpret_cast<uint4 *>(&w.a[2 * i + (lane >> 4)][(lane & 15) * 8]) = cur.q[i];
        __syncwarp();
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[D / 16];
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++)
            wmma::load_matrix_sync(fa[ks], reinterpret_cast<const __nv_bfloat16 *>(&w.a[0][16 * ks]), CORR_LD);
        if (t0 + step < r.len)
            corr_load(next, qeff, out, t0 + step, rows_at(t0 + step), stride, lane);
#pragma unroll
        for (int half = 0; half < 2; half++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc[4];
#pragma unroll
            for (int n = 0; n < 4; n++)
                wmma::fill_fragment(fc[n], 0.0f);
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++) {
#pragma unroll
                for (int n = 0; n < 4; n++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
                    wmma::load_matrix_sync(fb, reinterpret_cast<const __nv_bfloat16 *>(&sm.s[64 * half + 16 * n][16 * ks]),
                                           CORR_LD);
                    wmma::mma_sync(fc[n], fa[ks], fb, fc[n]);
                }
            }
#pragma unroll
            for (int n = 0; n < 4; n++)
                wmma::store_matrix_sync(&w.acc[0][16 * n], fc[n], ACC_LD, wmma::mem_row_major);
            __syncwarp();
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = (lane >> 3) + 4 * i, col = (lane & 7) * 8;
                if (row < rows) {
                    const uint4 x = cur.o[4 * half + i];
                    const float *c = &w.acc[row][col];
                    *reinterpret_cast<uint4 *>(out + (t0 + row) * stride + 64 * half + col) =
                        make_uint4(pack_bf16x2(bf16_lo(x.x) + c[0], bf16_hi(x.x) + c[1]),
                                   pack_bf16x2(bf16_lo(x.y) + c[2], bf16_hi(x.y) + c[3]),
                                   pack_bf16x2(bf16_lo(x.z) + c[4], bf16_hi(x.z) + c[5]),
                                   pack_bf16x2(bf16_lo(x.w) + c[6], bf16_hi(x.w) + c[7]));
                }
            }
            __syncwarp();                         /* acc (and, after the last half, a) free for the next use */
        }
        cur = next;
    }
}

}  // namespace kda

int kda_split_segments(int sm_count, int32_t max_seqs, int32_t heads, int min_segs)
{
    const int64_t chains = int64_t(max_seqs) * heads;
    if (chains < 1)
        return 0;
    int64_t segs = sm_count / (2 * chains);
    segs = segs > KDA_SPLIT_MAX_SEGS ? KDA_SPLIT_MAX_SEGS : segs;
    return segs >= min_segs ? int(segs) : 0;
}

/* max_seqs x heads x segs <= sm_count / 2 (kda_split_segments), three states or descriptors each. */
size_t kda_split_scratch_states(int sm_count) { return 3 * size_t(sm_count / 2); }
size_t kda_split_table_entries(int sm_count) { return 3 * size_t(sm_count / 2); }

cudaError_t kda_split_set_attributes()
{
    return cudaFuncSetAttribute(kda::split_correct_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                int(sizeof(kda::CorrSmem)));
}

cudaError_t kda_split_plan(const kda_fwd_params &p, const kda_split_args &a, kda_seq *table, int32_t *counts,
                           cudaStream_t stream)
{
    kda::split_plan_kernel<<<(a.max_seqs + 63) / 64, 64, 0, stream>>>(p, a, table, counts);
    return cudaGetLastError();
}

cudaError_t kda_split_scan(const kda_fwd_params &p, const kda_split_args &a, float *scratch, cudaStream_t stream)
{
    const int blocks = a.max_seqs * p.heads * (kda::D / kda::SCAN_ROWS);
    kda::split_scan_kernel<<<blocks, kda::D, 0, stream>>>(p, a, scratch);
    return cudaGetLastError();
}

cudaError_t kda_split_correct(const kda_fwd_params &p, const kda_split_args &a, const kda_seq *table,
                              const float *scratch, int sm_count, cudaStream_t stream)
{
    /* About four blocks per SM over the segments and heads (each loads its S_in once) */
    const int units = a.max_seqs * a.segs, items = units * p.heads, per = (4 * sm_count + items - 1) / items;
    kda::split_correct_kernel<<<dim3(per, items), 32 * kda::CORR_WARPS, sizeof(kda::CorrSmem), stream>>>(
        p, units, table, scratch);
    return cudaGetLastError();
}
