/*
 * kda_fwd_sm90.h - host entry points of the fused kernel (kda_fwd_sm90.cu),
 * used by the backend (kda_cuda.cu) and the kernel's own tests.
 */
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>

#include "params.h"

size_t kda_fwd_smem_bytes();
/* Raises the kernels' dynamic shared-memory limit; once per device. */
cudaError_t kda_fwd_set_attributes();
/* How many clusters of paired chains the device runs at once. */
cudaError_t kda_fwd_max_paired_clusters(int *clusters);
/* Enqueues the kernel with one CTA per chain: `ctas` persistent CTAs sharing the work. */
cudaError_t kda_fwd_launch(const kda_fwd_params &p, int ctas, cudaStream_t stream);
/* Enqueues the kernel with paired chains: `clusters` clusters of two CTAs, cluster c taking
   items c, c + clusters, ... */
cudaError_t kda_fwd_launch_paired(const kda_fwd_params &p, int clusters, cudaStream_t stream);

#ifdef KDA_PROFILE
/* Per-phase cycle totals of CTA 0 (profile.cuh), optionally zeroed after reading. */
cudaError_t kda_fwd_profile(unsigned long long *out, bool reset);
#endif
