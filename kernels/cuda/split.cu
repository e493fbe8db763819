/*
 * split.cu - the split path's plan and scan kernels (split.h).
 *
 * Scratch slots (fp32 [slot][heads][D][D], kda_fwd_params.scratch), for
 * sequence i of the table and its segment j, u = i * segs + j, U = max_seqs * segs:
 *   u        R_j  the segment's final state from a zero state
 *   U + u    M_j  its final state from the identity with zero values
 *   2U + u   S_j  its initial state (the scan's output; pass 3 loads it)
 */
#include "split.h"

#include "ptx.cuh"
#include "smem.cuh"

namespace kda {

/* How sequence `len` is cut: nseg pieces of seg_len tokens (whole chunks; the last may be short). */
__device__ __forceinline__ void split_shape(int64_t len, int32_t segs, int32_t min_tokens, int32_t &nseg,
                                            int64_t &seg_len)
{
    int64_t n = len / min_tokens;
    n = n < 1 ? 1 : n > segs ? segs : n;
    const int64_t chunks = (len + C - 1) / C;
    seg_len = ((chunks + n - 1) / n) * C;
    nseg = seg_len > 0 ? int32_t((len + seg_len - 1) / seg_len) : 1;
}

/* One thread per sequence of the table (max_seqs of them). */
__global__ void split_plan_kernel(const kda_fwd_params p, kda_seq *table, int32_t *counts, int32_t max_seqs,
                                  int32_t segs, int32_t min_tokens)
{
    const int32_t i = int32_t(blockIdx.x * blockDim.x + threadIdx.x), U = max_seqs * segs;
    if (i == 0) {
        counts[0] = 2 * U;
        counts[1] = U;
    }
    if (i >= max_seqs)
        return;
    kda_seq *r_runs = table, *m_runs = table + U, *runs = table + 2 * U;
    const kda_seq none = {};
    if (i >= *p.nseqs) {
        for (int32_t j = 0; j < segs; j++)
            r_runs[i * segs + j] = m_runs[i * segs + j] = runs[i * segs + j] = none;
        return;
    }
    const kda_seq desc = p.seqs[i];
    int32_t nseg;
    int64_t seg_len;
    split_shape(desc.len, segs, min_tokens, nseg, seg_len);
    const int64_t stride = int64_t(p.heads) * D;
    for (int32_t j = 0; j < segs; j++) {
        const int32_t u = i * segs + j;
        kda_seq seg = none, r = none, m = none;
        if (nseg == 1 && j == 0) {
            seg = desc;                           /* not cut: runs as given, pool slot to pool slot */
        } else if (j < nseg) {
            const int64_t t0 = j * seg_len, left = desc.len - t0;
            seg = desc;
            seg.q += t0 * stride;
            seg.k += t0 * stride;
            seg.v += t0 * stride;
            seg.g += t0 * stride;
            seg.out += t0 * stride;
            seg.beta += t0 * p.heads;
            seg.len = left < seg_len ? left : seg_len;
            seg.flags = KDA_SEQ_LOAD_SCRATCH | (j + 1 < nseg ? KDA_SEQ_STORE_SCRATCH : 0u);
            seg.reserved = uint32_t(2 * U + u);
            if (j + 1 < nseg) {                   /* the last segment's R and M are not needed */
                r = seg;
                r.out = nullptr;
                r.flags = KDA_SEQ_ZERO_STATE | KDA_SEQ_STORE_SCRATCH;
                r.reserved = uint32_t(u);
                m = r;
                m.flags = KDA_SEQ_IDENTITY_STATE | KDA_SEQ_STORE_SCRATCH;
                m.reserved = uint32_t(U + u);
            }
        }
        r_runs[u] = r;
        m_runs[u] = m;
        runs[u] = seg;
    }
}

constexpr int SCAN_ROWS = 8;   /* state rows per CTA of the scan; a thread per column */

/*
 * Block (sequence, head, 8 rows): the rows of S_0 (pool, or zeros), then
 * S_{j+1} = S_j M_j + R_j row by row (the rows of S are independent), each
 * S_j stored to its scratch slot.  fp32 throughout.
 */
__global__ void __launch_bounds__(D) split_scan_kernel(const kda_fwd_params p, float *scratch, int32_t max_seqs,
                                                       int32_t segs, int32_t min_tokens)
{
    __shared__ float rows[SCAN_ROWS][D];
    constexpr int BLOCKS = D / SCAN_ROWS;
    const int32_t i = int32_t(blockIdx.x) / (p.heads * BLOCKS), h = int32_t(blockIdx.x / BLOCKS) % p.heads;
    const int r0 = int(blockIdx.x % BLOCKS) * SCAN_ROWS, c = int(threadIdx.x), U = max_seqs * segs;
    if (i >= *p.nseqs)
        return;
    const kda_seq desc = p.seqs[i];
    int32_t nseg;
    int64_t seg_len;
    split_shape(desc.len, segs, min_tokens, nseg, seg_len);
    if (nseg == 1)
        return;
    const int64_t head_elems = int64_t(D) * D;
    const auto slot_at = [&](int64_t slot) { return scratch + (slot * p.heads + h) * head_elems; };
    float s[SCAN_ROWS];
    const int64_t pool_at = (desc.slot * p.heads + h) * head_elems;
#pragma unroll
    for (int r = 0; r < SCAN_ROWS; r++) {
        const int64_t at = pool_at + int64_t(r0 + r) * D + c;
        s[r] = desc.flags & KDA_SEQ_ZERO_STATE ? 0.0f
             : p.state_is_bf16 ? bf16_lo(static_cast<const uint16_t *>(p.state)[at])
                               : static_cast<const float *>(p.state)[at];
    }
    const int32_t u0 = i * segs;
    for (int32_t j = 0;; j++) {
        float *out = slot_at(2 * U + u0 + j) + int64_t(r0) * D + c;
#pragma unroll
        for (int r = 0; r < SCAN_ROWS; r++)
            out[r * D] = s[r];
        if (j + 1 == nseg)
            break;
        __syncthreads();                           /* the previous step's reads of `rows` are done */
#pragma unroll
        for (int r = 0; r < SCAN_ROWS; r++)
            rows[r][c] = s[r];
        __syncthreads();
        const float *m = slot_at(U + u0 + j) + c, *rr = slot_at(u0 + j) + int64_t(r0) * D + c;
#pragma unroll
        for (int r = 0; r < SCAN_ROWS; r++)
            s[r] = rr[r * D];
#pragma unroll 8
        for (int k = 0; k < D; k++) {
            const float mk = m[k * D];
#pragma unroll
            for (int r = 0; r < SCAN_ROWS; r++)
                s[r] = fmaf(rows[r][k], mk, s[r]);
        }
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

cudaError_t kda_split_plan(const kda_fwd_params &p, kda_seq *table, int32_t *counts, int32_t max_seqs, int32_t segs,
                           int32_t min_tokens, cudaStream_t stream)
{
    kda::split_plan_kernel<<<(max_seqs + 63) / 64, 64, 0, stream>>>(p, table, counts, max_seqs, segs, min_tokens);
    return cudaGetLastError();
}

cudaError_t kda_split_scan(const kda_fwd_params &p, float *scratch, int32_t max_seqs, int32_t segs,
                           int32_t min_tokens, cudaStream_t stream)
{
    const int blocks = max_seqs * p.heads * (kda::D / kda::SCAN_ROWS);
    kda::split_scan_kernel<<<blocks, kda::D, 0, stream>>>(p, scratch, max_seqs, segs, min_tokens);
    return cudaGetLastError();
}
