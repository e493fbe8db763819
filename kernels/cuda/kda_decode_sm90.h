/*
 * kda_decode_sm90.h - host entry of the decode-step kernel below the C API
 * (kda_cuda_step), for the kernel's benchmark.
 */
#pragma once

#include <cuda_runtime.h>

#include "kda.h"

/* How far ahead, in percent of a wave (the CTAs resident at once), the CTA lies whose state and token
   rows a CTA of kda_cuda_step prefetches into the L2 (bench_kernel --step-ahead compares others). */
#define KDA_STEP_AHEAD_PERCENT 50

/* CTAs in `percent` % of a wave of step CTAs of `warps` warps: sm_count x 16 / warps at the launch
   bounds' occupancy. */
int32_t kda_step_ahead_ctas(int percent, int warps, int sm_count);

/* Enqueues the step kernel with `warps` warps per CTA: 8 (one CTA per (sequence, head)) or 4
   (two), each CTA prefetching the bytes of the CTA `ahead` CTAs after it (0: none); kda_cuda_step's
   checks are the caller's. */
cudaError_t kda_step_launch(const kda_pool *pool, const kda_step *step_dev, int32_t max_seqs, int warps,
                            int32_t ahead, cudaStream_t stream);
