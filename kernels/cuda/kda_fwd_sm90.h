/*
 * kda_fwd_sm90.h - host entry points of the fused kernel (kda_fwd_sm90.cu),
 * used by the backend (kda_cuda.cu) and the kernel's own tests.
 */
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>

#include "params.h"

size_t kda_fwd_smem_bytes();
int kda_fwd_threads();
/* Raises the kernel's dynamic shared-memory limit; once per device. */
cudaError_t kda_fwd_set_attributes();
/* Enqueues the kernel; grid = number of persistent CTAs. */
cudaError_t kda_fwd_launch(const kda_fwd_params &p, int grid, cudaStream_t stream);

#ifdef KDA_PROFILE
/* Per-phase cycle totals of CTA 0 (profile.cuh), optionally zeroed after reading. */
cudaError_t kda_fwd_profile(unsigned long long *out, bool reset);
#endif
