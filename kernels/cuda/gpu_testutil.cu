/*
 * gpu_testutil.cu - device-side random fills, the float64 oracle and error
 * reductions used by the CUDA tests and the kernel benchmark.
 */
#include "gpu_testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

namespace {

constexpr int D = KDA_HEAD_DIM;

__device__ uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ float normal_at(uint64_t seed, size_t i)
{
    const uint64_t a = mix64(seed * 0x632be59bd9b4e019ull + 2 * i), b = mix64(a ^ (2 * i + 1));
    const float u1 = (float(a >> 40) + 0.5f) * 0x1.0p-24f, u2 = float(b >> 40) * 0x1.0p-24f;
    return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__device__ uint16_t to_bf16(float f)
{
    uint32_t u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

__device__ double from_bf16(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

__global__ void fill_normal_bf16_kernel(uint16_t *x, size_t n, uint64_t seed, float mean, float sd)
{
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        x[i] = to_bf16(mean + sd * normal_at(seed, i));
}

__global__ void fill_normal_f32_kernel(float *x, size_t n, uint64_t seed, float sd)
{
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        x[i] = sd * normal_at(seed, i);
}

__global__ void fill_uniform_f32_kernel(float *x, size_t n, uint64_t seed, float lo, float hi)
{
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        x[i] = lo + (hi - lo) * float(mix64(seed * 0x2545f4914f6cdd1dull + i) >> 40) * 0x1.0p-24f;
}

__device__ double block_sum_128(double x, double *red)
{
    for (int off = 16; off > 0; off >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, off);
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = x;
    __syncthreads();
    const double total = red[0] + red[1] + red[2] + red[3];
    __syncthreads();
    return total;
}

/*
 * The token loop of docs/kda.md in float64, one block of 128 threads per
 * (sequence, head).  The state lives in shared memory K-major (thread v owns
 * column v, so its 128 reads per pass are bank-conflict free).
 */
__global__ void __launch_bounds__(128) oracle_kernel(const kda_seq *seqs, int32_t heads, const void *before,
                                                     int before_bf16, const uint16_t *out_base, double *out_ref,
                                                     double *state_ref)
{
    extern __shared__ double sm[];
    double *S = sm, *qh = S + D * D, *kh = qh + D, *av = kh + D, *red = av + D;
    const int n = blockIdx.x / heads, h = blockIdx.x % heads, v = threadIdx.x;
    const kda_seq s = seqs[n];
    const bool zero = s.flags & KDA_SEQ_ZERO_STATE;
    const int64_t slot_base = (s.slot * heads + h) * int64_t(D * D);
    for (int k = 0; k < D; k++) {
        const int64_t at = slot_base + int64_t(v) * D + k;
        S[k * D + v] = zero ? 0.0 : before_bf16 ? from_bf16(static_cast<const uint16_t *>(before)[at])
                                                : double(static_cast<const float *>(before)[at]);
    }
    if (s.len > 0) {
        const double exp_a = exp(double(s.layer->A_log[h])), dtb = s.layer->dt_bias[h * D + v];
        const double lb = s.layer->lower_bound, scale = s.layer->scale;
        const int64_t out_off = s.out - out_base;
        for (int64_t t = 0; t < s.len; t++) {
            const int64_t row = (t * heads + h) * D;
            const double qv = from_bf16(s.q[row + v]), kv = from_bf16(s.k[row + v]);
            const double gv = from_bf16(s.g[row + v]), vv = from_bf16(s.v[row + v]);
            const double sq = block_sum_128(qv * qv, red), sk = block_sum_128(kv * kv, red);
            qh[v] = qv / sqrt(sq + double(KDA_NORM_EPS));
            kh[v] = kv / sqrt(sk + double(KDA_NORM_EPS));
            av[v] = exp(lb / (1.0 + exp(-exp_a * (gv + dtb))));
            const double b = 1.0 / (1.0 + exp(-from_bf16(s.beta[t * heads + h])));
            __syncthreads();
            double acc = 0.0;
            for (int k = 0; k < D; k++) {
                const double x = S[k * D + v] * av[k];
                S[k * D + v] = x;
                acc += x * kh[k];
            }
            const double u = b * (vv - acc);
            double o = 0.0;
            for (int k = 0; k < D; k++) {
                const double x = S[k * D + v] + u * kh[k];
                S[k * D + v] = x;
                o += x * qh[k];
            }
            out_ref[out_off + row + v] = scale * o;
            __syncthreads();
        }
    }
    double *dst = state_ref + (int64_t(n) * heads + h) * D * D + int64_t(v) * D;
    for (int k = 0; k < D; k++)
        dst[k] = S[k * D + v];
}

__global__ void err_bf16_kernel(const uint16_t *x, const double *ref, size_t n, double *sums)
{
    double num = 0.0, den = 0.0;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        const double r = ref[i], d = from_bf16(x[i]) - r;
        num += d * d;
        den += r * r;
    }
    atomicAdd(&sums[0], num);
    atomicAdd(&sums[1], den);
}

__global__ void err_slots_kernel(const void *pool, int bf16, int64_t slot_elems, const int64_t *slots, int32_t nseqs,
                                 const double *ref, double *sums)
{
    double num = 0.0, den = 0.0;
    const size_t total = size_t(nseqs) * slot_elems;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
        const int64_t n = int64_t(i / slot_elems), e = int64_t(i % slot_elems);
        const int64_t at = slots[n] * slot_elems + e;
        const double x = bf16 ? from_bf16(static_cast<const uint16_t *>(pool)[at])
                              : double(static_cast<const float *>(pool)[at]);
        const double r = ref[i], d = x - r;
        num += d * d;
        den += r * r;
    }
    atomicAdd(&sums[0], num);
    atomicAdd(&sums[1], den);
}

double finish_rel_rms(double *sums_dev)
{
    double sums[2];
    GPU_CHECK(cudaMemcpy(sums, sums_dev, sizeof sums, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaFree(sums_dev));
    return sums[1] > 0 ? sqrt(sums[0] / sums[1]) : sqrt(sums[0]);
}

double *new_sums()
{
    double *sums;
    GPU_CHECK(cudaMalloc(&sums, 2 * sizeof(double)));
    GPU_CHECK(cudaMemset(sums, 0, 2 * sizeof(double)));
    return sums;
}

}  // namespace

void gpu_fill_normal_bf16(uint16_t *x, size_t n, uint64_t seed, float mean, float stddev)
{
    fill_normal_bf16_kernel<<<1024, 256>>>(x, n, seed, mean, stddev);
    GPU_CHECK(cudaGetLastError());
}

void gpu_fill_normal_state(void *x, kda_dtype dtype, size_t n, uint64_t seed, float stddev)
{
    if (dtype == KDA_DTYPE_F32)
        fill_normal_f32_kernel<<<1024, 256>>>(static_cast<float *>(x), n, seed, stddev);
    else
        fill_normal_bf16_kernel<<<1024, 256>>>(static_cast<uint16_t *>(x), n, seed, 0.0f, stddev);
    GPU_CHECK(cudaGetLastError());
}

void gpu_fill_uniform_f32(float *x, size_t n, uint64_t seed, float lo, float hi)
{
    fill_uniform_f32_kernel<<<256, 256>>>(x, n, seed, lo, hi);
    GPU_CHECK(cudaGetLastError());
}

kda_pool gpu_make_pool(int32_t heads, int64_t slots, kda_dtype dtype, uint64_t seed)
{
    kda_pool p = {nullptr, dtype, heads, slots};
    const size_t n = size_t(slots) * kda_slot_elems(heads);
    GPU_CHECK(cudaMalloc(&p.state, n * kda_dtype_size(dtype)));
    gpu_fill_normal_state(p.state, dtype, n, seed, 0.25f);
    return p;
}

size_t gpu_pool_bytes(const kda_pool &p)
{
    return size_t(p.slots) * kda_slot_elems(p.heads) * kda_dtype_size(p.dtype);
}

kda_pool gpu_clone_pool(const kda_pool &p)
{
    kda_pool c = p;
    GPU_CHECK(cudaMalloc(&c.state, gpu_pool_bytes(p)));
    GPU_CHECK(cudaMemcpy(c.state, p.state, gpu_pool_bytes(p), cudaMemcpyDeviceToDevice));
    return c;
}

void gpu_upload_table(const kda_seq *seqs, int32_t n, kda_seq **seqs_dev, int32_t **n_dev)
{
    GPU_CHECK(cudaMalloc(seqs_dev, sizeof(kda_seq) * (n > 0 ? n : 1)));
    GPU_CHECK(cudaMemcpy(*seqs_dev, seqs, sizeof(kda_seq) * n, cudaMemcpyHostToDevice));
    GPU_CHECK(cudaMalloc(n_dev, sizeof(int32_t)));
    GPU_CHECK(cudaMemcpy(*n_dev, &n, sizeof(int32_t), cudaMemcpyHostToDevice));
}

void gpu_oracle(const kda_seq *seqs_dev, int32_t nseqs, const kda_pool *before, const uint16_t *out_base,
                double *out_ref, double *state_ref)
{
    if (nseqs == 0)
        return;
    const size_t smem = sizeof(double) * (D * D + 3 * D + 4);
    GPU_CHECK(cudaFuncSetAttribute(oracle_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    oracle_kernel<<<nseqs * before->heads, 128, smem>>>(seqs_dev, before->heads, before->state,
                                                         before->dtype == KDA_DTYPE_BF16, out_base, out_ref,
                                                         state_ref);
    GPU_CHECK(cudaGetLastError());
}

double gpu_rel_rms_bf16(const uint16_t *x, const double *ref, size_t n)
{
    double *sums = new_sums();
    err_bf16_kernel<<<512, 256>>>(x, ref, n, sums);
    GPU_CHECK(cudaGetLastError());
    return finish_rel_rms(sums);
}

double gpu_rel_rms_slots(const kda_pool *pool, const int64_t *slots_host, int32_t nseqs, const double *state_ref)
{
    int64_t *slots;
    GPU_CHECK(cudaMalloc(&slots, sizeof(int64_t) * (nseqs + 1)));
    GPU_CHECK(cudaMemcpy(slots, slots_host, sizeof(int64_t) * nseqs, cudaMemcpyHostToDevice));
    double *sums = new_sums();
    err_slots_kernel<<<512, 256>>>(pool->state, pool->dtype == KDA_DTYPE_BF16, kda_slot_elems(pool->heads), slots,
                                   nseqs, state_ref, sums);
    GPU_CHECK(cudaGetLastError());
    const double r = finish_rel_rms(sums);
    GPU_CHECK(cudaFree(slots));
    return r;
}
