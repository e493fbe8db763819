/*
 * gpu_testutil.h - GPU helpers for the CUDA backend's tests and benchmark:
 * random fills done on the device, a float64 oracle (the token loop of
 * docs/kda.md, one block per (sequence, head)), and error reductions.
 */
#pragma once

#include <algorithm>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <vector>

#include "kda.h"

#define GPU_CHECK(call)                                                                            \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* x[i] = bf16(mean + stddev * N(0,1)), from a counter-based hash of (seed, i). */
void gpu_fill_normal_bf16(uint16_t *x, size_t n, uint64_t seed, float mean, float stddev);
/* x[i] = mean + stddev * N(0,1) in the pool's dtype (element count n). */
void gpu_fill_normal_state(void *x, kda_dtype dtype, size_t n, uint64_t seed, float stddev);
void gpu_fill_uniform_f32(float *x, size_t n, uint64_t seed, float lo, float hi);

/* A pool of `slots` states in `dtype`, filled with N(0, 0.25^2) from seed; its size in bytes;
 * a device copy of it (the caller cudaFrees each pool's state). */
kda_pool gpu_make_pool(int32_t heads, int64_t slots, kda_dtype dtype, uint64_t seed);
size_t gpu_pool_bytes(const kda_pool &p);
kda_pool gpu_clone_pool(const kda_pool &p);

/* A batch's descriptor table and its live count, copied to device memory as kda_cuda_prefill
 * reads them (the caller cudaFrees both). */
void gpu_upload_table(const kda_seq *seqs, int32_t n, kda_seq **seqs_dev, int32_t **n_dev);

/*
 * float64 oracle of a batch.  seqs_dev: the descriptors the backend ran
 * (read for lengths, tensors, layer, slot, flags); before: the pool as it
 * was before the backend ran.  Writes out_ref at the same element offsets
 * (relative to out_base) as each sequence's out, and the final state of
 * sequence n to state_ref[n] ([H][D][D], V-major).
 */
void gpu_oracle(const kda_seq *seqs_dev, int32_t nseqs, const kda_pool *before, const uint16_t *out_base,
                double *out_ref, double *state_ref);

/* sqrt(sum (x - ref)^2 / sum ref^2) over n elements; NaN anywhere gives NaN. */
double gpu_rel_rms_bf16(const uint16_t *x, const double *ref, size_t n);
/* The same over the slots named by the batch: pool slot seqs[n].slot against state_ref[n]. */
double gpu_rel_rms_slots(const kda_pool *pool, const int64_t *slots_host, int32_t nseqs,
                         const double *state_ref);

/*
 * The benchmarks' timing: three untimed launch() calls, then `reps` timed
 * ones on the default stream with CUDA events, each after writing
 * flush_bytes of `flush` (which evicts the L2); the median, in ms.
 */
template <typename Launch>
float gpu_median_ms(Launch launch, int reps, void *flush, size_t flush_bytes)
{
    for (int i = 0; i < 3; i++)
        launch();
    cudaEvent_t start, stop;
    GPU_CHECK(cudaEventCreate(&start));
    GPU_CHECK(cudaEventCreate(&stop));
    std::vector<float> times;
    for (int r = 0; r < reps; r++) {
        GPU_CHECK(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
        GPU_CHECK(cudaEventRecord(start));
        launch();
        GPU_CHECK(cudaEventRecord(stop));
        GPU_CHECK(cudaEventSynchronize(stop));
        float ms;
        GPU_CHECK(cudaEventElapsedTime(&ms, start, stop));
        times.push_back(ms);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
}
