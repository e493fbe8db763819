/*
 * kda_decode_sm90.h - host entry of the decode-step kernel below the C API
 * (kda_cuda_step), for the kernel's benchmark.
 */
#pragma once

#include <cuda_runtime.h>

#include "kda.h"

/* Enqueues the step kernel with `warps` warps per CTA: 8 (one CTA per (sequence, head)) or 4
   (two); kda_cuda_step's checks are the caller's. */
cudaError_t kda_step_launch(const kda_pool *pool, const kda_step *step_dev, int32_t max_seqs, int warps,
                            cudaStream_t stream);
