/*
 * split.h - long chains cut into segments that run at once (split.cu).
 *
 * With few chains (sequences x heads well below the SMs) the fused kernel's
 * time is one chain's length.  The state is affine in a segment's tokens
 * (docs/kernel.md, "Splitting a chain"), so a launch can run as:
 *
 *   plan   descriptors of every segment (device, from the caller's table)
 *   pass 1 the fused kernel on each segment but a sequence's last, twice:
 *          from a zero state with its values (final state R) and from the
 *          identity with zero values (final state M); no outputs
 *   scan   per (sequence, head, 8 state rows): S_0 from the pool, then
 *          S_{j+1} = S_j M_j + R_j, each segment's initial state to scratch
 *   pass 3 the fused kernel on every segment from its initial state, with
 *          its outputs; a sequence's last segment writes the pool slot
 *
 * The host chooses the number of segments per sequence (segs) from max_seqs,
 * heads and the SM count only, so a captured graph replays any batch of its
 * bucket; each sequence's actual cut (at most segs pieces of at least
 * min_tokens, whole chunks) is chosen on the device from its length.
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

/*
 * Writes pass 1's descriptors to table[0, 2U) and pass 3's to table[2U, 3U),
 * U = max_seqs x segs, and their counts (2U, U) to counts[0], counts[1].
 * p: the caller's batch (seqs, nseqs, heads).
 */
cudaError_t kda_split_plan(const kda_fwd_params &p, kda_seq *table, int32_t *counts, int32_t max_seqs, int32_t segs,
                           int32_t min_tokens, cudaStream_t stream);

/* The scan: reads the pool (p.state) and scratch slots R (u), M (U + u), writes S_in (2U + u). */
cudaError_t kda_split_scan(const kda_fwd_params &p, float *scratch, int32_t max_seqs, int32_t segs,
                           int32_t min_tokens, cudaStream_t stream);
