/*
 * split.cu - the split path's plan and scan kernels (split.h).
 *
 * Scratch slots (fp32 [slot][heads][D][D], kda_fwd_params.scratch), for
 * sequence i of the table and its segment j, u = i * segs + j, U = max_seqs * segs:
 *   u        R_j  the segment's final state from a zero state
 *   U + u    M_j  its final state from the identity with zero values
 *   2U + u   S_j  its initial state (S_1 from pass 1, the others from the
 *                 scan; pass 3 loads them)
 */
#include "split.h"

#include "smem.cuh"

namespace kda {

/* How sequence `len` is cut: nseg pieces of seg_len tokens (whole chunks; the last may be short). */
__device__ __forceinline__ void cut(int64_t len, kda_split_shape shape, int32_t &nseg, int64_t &seg_len)
{
    int64_t n = len / shape.min_tokens;
    n = n < shape.min_pieces ? 1 : n > shape.segs ? shape.segs : n;
    const int64_t chunks = (len + C - 1) / C;
    seg_len = ((chunks + n - 1) / n) * C;
    nseg = seg_len > 0 ? int32_t((len + seg_len - 1) / seg_len) : 1;
}

/*
 * One thread per sequence of the table (max_seqs of them).  Table regions
 * (U = max_seqs * segs, entry u = i * segs + j):
 *   [0, U)    pass 1: segment 0 from the sequence's real state
 *   [U, 2U)   pass 1: R runs of segments 1 .. nseg - 2
 *   [2U, 3U)  pass 1: M runs of the same
 *   [3U, 3U + max_seqs (segs - 1))
 *             pass 3: segments 1 .. nseg - 1 from their initial states, at
 *             i * (segs - 1) + j - 1 (dense, so that 8 heads x 8 segments
 *             stay within the paired clusters); a sequence not cut runs
 *             whole at j = 1, pool slot to pool slot
 */
__global__ void split_plan_kernel(const kda_fwd_params p, kda_seq *table, int32_t *counts, int32_t max_seqs,
                                  kda_split_shape shape)
{
    const int32_t segs = shape.segs;
    const int32_t i = int32_t(blockIdx.x * blockDim.x + threadIdx.x), U = max_seqs * segs;
    if (i == 0) {
        counts[0] = 3 * U;
        counts[1] = max_seqs * (segs - 1);
    }
    if (i >= max_seqs)
        return;
    kda_seq *first = table, *r_runs = table + U, *m_runs = table + 2 * U, *rest = table + 3 * U;
    const kda_seq none = {};
    const bool real = i < *p.nseqs;
    const kda_seq desc = real ? p.seqs[i] : none;
    int32_t nseg = 1;
    int64_t seg_len = 0;
    if (real)
        cut(desc.len, shape, nseg, seg_len);
    const int64_t stride = int64_t(p.heads) * D;
    const bool is_cut = nseg > 1;
    for (int32_t j = 0; j < segs; j++) {
        const int32_t u = i * segs + j;
        kda_seq seg = none, r = none, m = none;
        if (is_cut && j < nseg) {
            const int64_t t0 = j * seg_len, left = desc.len - t0;
            seg = desc;
            seg.q += t0 * stride;
            seg.k += t0 * stride;
            seg.v += t0 * stride;
            seg.g += t0 * stride;
            seg.out += t0 * stride;
            seg.beta += t0 * p.heads;
            seg.len = left < seg_len ? left : seg_len;
            if (j == 0) {                         /* from the real state; S_1 for the scan */
                seg.flags = (desc.flags & KDA_SEQ_ZERO_STATE) | KDA_SEQ_STORE_SCRATCH;
                seg.reserved = uint32_t(2 * U + u + 1);
            } else {
                seg.flags = KDA_SEQ_LOAD_SCRATCH | (j + 1 < nseg ? KDA_SEQ_STORE_SCRATCH : 0u);
                seg.reserved = uint32_t(2 * U + u);
            }
            if (j > 0 && j + 1 < nseg) {          /* the transition of each segment between */
                r = seg;
                r.out = nullptr;
                r.flags = KDA_SEQ_ZERO_STATE | KDA_SEQ_STORE_SCRATCH;
                r.reserved = uint32_t(u);
                m = r;
                m.flags = KDA_SEQ_IDENTITY_STATE | KDA_SEQ_STORE_SCRATCH;
                m.reserved = uint32_t(U + u);
            }
        } else if (real && !is_cut && j == 1) {
            seg = desc;                           /* not cut: whole, pool slot to pool slot, in pass 3 (paired) */
        }
        if (j == 0)
            first[u] = seg;
        else
            rest[i * (segs - 1) + j - 1] = seg;
        r_runs[u] = r;
        m_runs[u] = m;
    }
}

constexpr int SCAN_ROWS = 8;   /* state rows per CTA of the scan; a thread per column */

/*
 * Block (sequence, head, 8 rows): from S_1 (pass 1's segment 0),
 * S_{j+1} = S_j M_j + R_j row by row (the rows of S are independent), each
 * S_j stored to its scratch slot.  fp32 throughout.  Each step loads its
 * column of M_j at once (128 loads in flight), so a step costs about one
 * memory latency.
 */
__global__ void __launch_bounds__(D) split_scan_kernel(const kda_fwd_params p, float *scratch, int32_t max_seqs,
                                                       kda_split_shape shape)
{
    const int32_t segs = shape.segs;
    __shared__ float rows[SCAN_ROWS][D];
    constexpr int BLOCKS = D / SCAN_ROWS;
    const int32_t i = int32_t(blockIdx.x) / (p.heads * BLOCKS), h = int32_t(blockIdx.x / BLOCKS) % p.heads;
    const int r0 = int(blockIdx.x % BLOCKS) * SCAN_ROWS, c = int(threadIdx.x), U = max_seqs * segs;
    if (i >= *p.nseqs)
        return;
    int32_t nseg;
    int64_t seg_len;
    cut(p.seqs[i].len, shape, nseg, seg_len);
    if (nseg <= 2)
        return;
    const int64_t head_elems = int64_t(D) * D;
    const auto slot_at = [&](int64_t slot) { return scratch + (slot * p.heads + h) * head_elems + int64_t(r0) * D + c; };
    const int32_t u0 = i * segs;
    float s[SCAN_ROWS];
#pragma unroll
    for (int r = 0; r < SCAN_ROWS; r++)
        s[r] = slot_at(2 * U + u0 + 1)[r * D];
    for (int32_t j = 1; j + 1 < nseg; j++) {
        const float *m = slot_at(U + u0 + j) - int64_t(r0) * D, *rr = slot_at(u0 + j);
        float mc[D];
#pragma unroll
        for (int k = 0; k < D; k++)
            mc[k] = m[k * D];
        __syncthreads();                           /* the previous step's reads of `rows` are done */
#pragma unroll
        for (int r = 0; r < SCAN_ROWS; r++)
            rows[r][c] = s[r];
        __syncthreads();
#pragma unroll
        for (int r = 0; r < SCAN_ROWS; r++)
            s[r] = rr[r * D];
#pragma unroll
        for (int k = 0; k < D; k++)
#pragma unroll
            for (int r = 0; r < SCAN_ROWS; r++)
                s[r] = fmaf(rows[r][k], mc[k], s[r]);
        float *out = slot_at(2 * U + u0 + j + 1);
#pragma unroll
        for (int r = 0; r < SCAN_ROWS; r++)
            out[r * D] = s[r];
    }
}

}  // namespace kda

int kda_split_segments(int sm_count, int32_t max_seqs, int32_t heads, int min_segs)
{
    const int64_t chains = int64_t(max_seqs) * heads;
    if (chains < 1)
        return 0;
    const int64_t per_chain = sm_count / chains;     /* CTAs for each sequence and head */
    int64_t segs = (per_chain + 3) / 2;               /* pass 1 runs 2 segs - 3 chains of each */
    segs = segs > KDA_SPLIT_MAX_SEGS ? KDA_SPLIT_MAX_SEGS : segs;
    return per_chain >= 2 && segs >= min_segs ? int(segs) : 0;   /* then chains x segs <= sm_count */
}

/* max_seqs x heads x segs <= sm_count (kda_split_segments, segs >= 2): three states, four descriptors each. */
size_t kda_split_scratch_states(int sm_count) { return 3 * size_t(sm_count); }
size_t kda_split_table_entries(int sm_count) { return 4 * size_t(sm_count); }

cudaError_t kda_split_plan(const kda_fwd_params &p, kda_seq *table, int32_t *counts, int32_t max_seqs,
                           kda_split_shape shape, cudaStream_t stream)
{
    kda::split_plan_kernel<<<(max_seqs + 63) / 64, 64, 0, stream>>>(p, table, counts, max_seqs, shape);
    return cudaGetLastError();
}

cudaError_t kda_split_scan(const kda_fwd_params &p, float *scratch, int32_t max_seqs, kda_split_shape shape,
                           cudaStream_t stream)
{
    const int blocks = max_seqs * p.heads * (kda::D / kda::SCAN_ROWS);
    kda::split_scan_kernel<<<blocks, kda::D, 0, stream>>>(p, scratch, max_seqs, shape);
    return cudaGetLastError();
}
