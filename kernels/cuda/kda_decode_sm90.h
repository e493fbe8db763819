/*
 * kda_decode_sm90.h - host entry of the decode-step kernel below the C API
 * (kda_cuda_step), for the kernel's benchmark.
 */
#pragma once

#include <cuda_runtime.h>

#include "kda.h"

/* Waves of CTAs ahead whose state and token rows a CTA prefetches into the L2 (0: none) in kda_cuda_step
   (bench_kernel --step-ahead compares others). */
#define KDA_STEP_AHEAD_WAVES 1

/* Enqueues the step kernel with `warps` warps per CTA: 8 (one CTA per (sequence, head)) or 4
   (two), each CTA prefetching the bytes of the CTA `ahead_waves` waves after it (a wave: sm_count x
   16 / warps CTAs); kda_cuda_step's checks are the caller's. */
cudaError_t kda_step_launch(const kda_pool *pool, const kda_step *step_dev, int32_t max_seqs, int warps,
                            int ahead_waves, int sm_count, cudaStream_t stream);
