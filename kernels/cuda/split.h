/*
 * split.h - long chains cut into segments that run at once (split.cu).
 *
 * With few chains (sequences x heads well below the SMs) the fused kernel's
 * time is one chain's length.  The state is affine in a segment's tokens
 * (docs/kernel.md, "Splitting a chain"), so a launch can run as:
 *
 *   plan    descriptors of every segment (device, from the caller's table)
 *   pass 1  the fused kernel on each segment twice: from a zero state with
 *           its values (final state R, outputs o0 into the output buffer) and
 *           from the identity with zero values (final state M, outputs qeff
 *           into the outputs scratch)
 *   scan    per (sequence, head, 8 state rows): S_0 from the pool, then
 *           S_{j+1} = S_j M_j + R_j, each segment's initial state to scratch
 *           and a sequence's final state to its pool slot
 *   correct o = o0 + qeff . S_j^T for every token of segment j, in place
 *   pass 3  the fused kernel from S_j, with its outputs, on the segments
 *           whose qeff does not fit the outputs scratch (recomputed instead);
 *           such a last segment writes the pool slot (pass 1 skips its R, M)
 *
 * The host chooses the number of segments per sequence (segs) from max_seqs,
 * heads and the SM count only, so a captured graph replays any batch of its
 * bucket; each sequence's actual cut (at most segs pieces of at least
 * min_tokens, whole chunks) and which segments are corrected are chosen on
 * the device from the lengths.
 */
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>

#include "params.h"

/* The most segments one sequence is cut into (the scan is serial over them). */
constexpr int KDA_SPLIT_MAX_SEGS = 16;
/*
 * Segments per sequence for a batch of max_seqs x heads chains on sm_count
 * SMs: pass 1 runs two chains per segment and head, one CTA each, so
 * 2 x max_seqs x heads x segs <= sm_count.  0 when fewer than min_segs fit.
 */
int kda_split_segments(int sm_count, int32_t max_seqs, int32_t heads, int min_segs);

/* Scratch the split path needs on a device of sm_count SMs: fp32 D x D states, descriptors. */
size_t kda_split_scratch_states(int sm_count);
size_t kda_split_table_entries(int sm_count);

/* How a batch is cut (the host's choice; the device cuts each sequence from its length). */
struct kda_split_args {
    int32_t max_seqs, segs, min_tokens;
    uint16_t *qeff;          /* the outputs scratch: [tokens][heads][D] bf16, sequences back to back */
    int64_t qeff_elems;      /* its size in values; segments past it are recomputed in pass 3 */
};

/* The correction kernel's shared-memory attribute; once per device (kda_cuda_create). */
cudaError_t kda_split_set_attributes();

/*
 * Writes pass 1's descriptors to table[0, 2U) and pass 3's to table[2U, 3U),
 * U = max_seqs x segs, and their counts (2U, U) to counts[0], counts[1].
 * p: the caller's batch (seqs, nseqs, heads).
 */
cudaError_t kda_split_plan(const kda_fwd_params &p, const kda_split_args &a, kda_seq *table, int32_t *counts,
                           cudaStream_t stream);

/* The scan: reads the pool (p.state) and scratch slots R (u), M (U + u), writes S_in (2U + u) and corrected
   sequences' final states to the pool. */
cudaError_t kda_split_scan(const kda_fwd_params &p, const kda_split_args &a, float *scratch, cudaStream_t stream);

/* The correction: for each segment pass 1 ran with outputs (table), o = o0 + qeff . S_in^T in place. */
cudaError_t kda_split_correct(const kda_fwd_params &p, const kda_split_args &a, const kda_seq *table,
                              const float *scratch, int sm_count, cudaStream_t stream);
