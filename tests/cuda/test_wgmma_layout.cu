/*
 * test_wgmma_layout.cu - checks, on the GPU, the four wgmma operand
 * configurations the fused kernel uses, with the kernel's own tile and
 * fragment helpers (smem.cuh, ptx.cuh, consumer.cuh):
 *
 *   rs_n64   D[64x64]   = A[64x128] (registers) . B (Sw128Tile<64,128>)   consumer step 1
 *   rs_n32   D[64x32]  += A[64x32]  (registers) . B (Sw64Tile<32>)        consumer steps 3, 4 (O)
 *   rs_n128  D[64x128] += A[64x32]  (registers) . B (Sw128Tile<32,128>, read N-major)
 *                                                                         consumer step 4 (S)
 *   ss_n32   D[64x32]   = A (Sw128Tile<64,128>) . B (Sw128Tile<32,128>)   producer L, Mqk, k norms
 *
 * against a float64 product of the same bf16 values; and the swizzled
 * addressing (Sw128Tile::offset, Sw64Tile::offset) as the kernel's loops
 * compute it, against a plain formula (nvcc 13.0 once miscompiled the SW128
 * one for constant odd columns).
 * Exits 77 without a GPU.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "consumer.cuh"
#include "ptx.cuh"
#include "smem.cuh"

using namespace kda;

#define CHECK(call)                                                                               \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

/* Row and column of accumulator element i (of a 64 x N tile) held by thread tid. */
__device__ __forceinline__ void acc_pos(int tid, int i, int &row, int &col)
{
    const int warp = tid >> 5, lane = tid & 31;
    row = 16 * warp + (lane >> 2) + ((i & 3) >= 2 ? 8 : 0);
    col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
}

/* Tile <- src[rows][cols] (row-major), zero-padded to the tile's ROWS x COLS. */
template <typename Tile>
__device__ void fill_tile(Tile &t, const uint16_t *src, int rows, int cols, int ROWS, int COLS)
{
    for (int idx = threadIdx.x; idx < ROWS * COLS; idx += blockDim.x) {
        const int r = idx / COLS, c = idx % COLS;
        *t.at(r, c) = (r < rows && c < cols) ? src[r * cols + c] : uint16_t(0);
    }
}

template <int ROWS>
__device__ void fill_tile(Sw64Tile<ROWS> &t, const uint16_t *src, int rows, int cols)
{
    fill_tile(t, src, rows, cols, ROWS, Sw64Tile<ROWS>::COLS);
}

template <int ROWS, int COLS>
__device__ void fill_tile(Sw128Tile<ROWS, COLS> &t, const uint16_t *src, int rows, int cols)
{
    fill_tile(t, src, rows, cols, ROWS, COLS);
}

struct alignas(1024) LayoutSmem {
    Sw128Tile<64, 128> a;      /* ss_n32 A, rs_n64 B */
    Sw128Tile<32, 128> b32k;   /* ss_n32 B, rs_n128 B (rows = K) */
    Sw64Tile<32> b32;
};

/* which: 0 rs_n64, 1 rs_n32, 2 rs_n128, 3 ss_n32.  A: [64 x K] row-major, B: [N x K] (B^T) row-major. */
__global__ void layout_kernel(int which, const uint16_t *A, const uint16_t *B, const float *Dinit, float *D)
{
    extern __shared__ uint8_t raw[];
    LayoutSmem &sm = *reinterpret_cast<LayoutSmem *>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    const int tid = threadIdx.x;
    int row, col;

    if (which == 0) {
        fill_tile(sm.a, B, 64, 128);
        fence_proxy_async();
        __syncthreads();
        float a_acc[64], d[32];
        for (int i = 0; i < 64; i++) {
            acc_pos(tid, i, row, col);
            a_acc[i] = __uint_as_float(uint32_t(A[row * 128 + col]) << 16);
        }
        uint32_t a[8][4];
        for (int ks = 0; ks < 8; ks++)
            acc_to_a(&a_acc[8 * ks], a[ks]);
        for (int i = 0; i < 32; i++)
            d[i] = 0.0f;
        fence_operands(d);
        wgmma_fence();
        for (int ks = 0; ks < 8; ks++)
            wgmma_m64n64k16_rs(d, a[ks], desc_advance(sw128_desc(sm.a.data), sm.a.kslice_offset(ks)), ks > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(d);
        for (int i = 0; i < 32; i++) {
            acc_pos(tid, i, row, col);
            D[row * 64 + col] = d[i];
        }
    } else if (which == 1 || which == 2) {
        const int N = which == 1 ? 32 : 128;
        if (which == 1) {
            fill_tile(sm.b32, B, 32, 32);
        } else {   /* B^T [128 x 32] stored with rows = K, as the producer stores ki */
            for (int idx = tid; idx < 32 * 128; idx += blockDim.x) {
                const int k = idx / 128, n = idx % 128;
                *sm.b32k.at(k, n) = B[n * 32 + k];
            }
        }
        fence_proxy_async();
        __syncthreads();
        float a_acc[16];
        for (int i = 0; i < 16; i++) {
            acc_pos(tid, i, row, col);
            a_acc[i] = __uint_as_float(uint32_t(A[row * 32 + col]) << 16);
        }
        uint32_t a[2][4];
        for (int ks = 0; ks < 2; ks++)
            acc_to_a(&a_acc[8 * ks], a[ks]);
        if (which == 1) {
            float d[16];
            for (int i = 0; i < 16; i++) {
                acc_pos(tid, i, row, col);
                d[i] = Dinit[row * N + col];
            }
            fence_operands(d);
            wgmma_fence();
            for (int ks = 0; ks < 2; ks++)
                wgmma_m64n32k16_rs(d, a[ks], desc_advance(sw64_desc(sm.b32.data), sm.b32.kslice_offset(ks)), 1);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(d);
            for (int i = 0; i < 16; i++) {
                acc_pos(tid, i, row, col);
                D[row * N + col] = d[i];
            }
        } else {
            float d[64];
            for (int i = 0; i < 64; i++) {
                acc_pos(tid, i, row, col);
                d[i] = Dinit[row * N + col];
            }
            fence_operands(d);
            wgmma_fence();
            const uint64_t desc = sw128_nmajor_desc(sm.b32k.data, sm.b32k.BLOCK_BYTES);
            for (int ks = 0; ks < 2; ks++)
                wgmma_m64n128k16_rs_nmajor(d, a[ks], desc_advance(desc, sm.b32k.nmajor_kslice_offset(ks)), 1);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(d);
            for (int i = 0; i < 64; i++) {
                acc_pos(tid, i, row, col);
                D[row * N + col] = d[i];
            }
        }
    } else {
        fill_tile(sm.a, A, 64, 128);
        fill_tile(sm.b32k, B, 32, 128);
        fence_proxy_async();
        __syncthreads();
        float d[16];
        for (int i = 0; i < 16; i++)
            d[i] = 0.0f;
        fence_operands(d);
        wgmma_fence();
        for (int ks = 0; ks < 8; ks++)
            wgmma_m64n32k16_ss(d, desc_advance(sw128_desc(sm.a.data), sm.a.kslice_offset(ks)),
                               desc_advance(sw128_desc(sm.b32k.data), sm.b32k.kslice_offset(ks)), ks > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(d);
        for (int i = 0; i < 16; i++) {
            acc_pos(tid, i, row, col);
            D[row * 32 + col] = d[i];
        }
    }
}

/* Offsets in the index patterns of the producer's scatters (prepare_lmqk, prepare_tiles). */
__global__ void offsets_kernel(uint32_t *out)
{
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int row = 16 * (warp & 1) + g;
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = row + (e >= 2 ? 8 : 0), j = 8 * nt + 2 * t4 + (e & 1);
            out[tid * 16 + nt * 4 + e] = Sw64Tile<32>::offset(i, j);
        }
    const int quarter = tid / 32, d = 4 * lane;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        const int t = 8 * quarter + e;
        out[2048 + t * 128 + tid % 32] = Sw128Tile<64, 128>::offset(t, d);
        out[2048 + (32 + t) * 128 + tid % 32] = Sw128Tile<64, 128>::offset(32 + t, d);
        out[2048 + 64 * 128 + t * 128 + tid % 32] = Sw128Tile<32, 128>::offset(t, d);
    }
}

static uint32_t reference_offset64(int row, int col)
{
    return uint32_t(row * 64 + (((col * 2) / 16) ^ ((row / 2) % 4)) * 16 + (col * 2) % 16);
}

static uint32_t reference_offset(int rows, int row, int col)
{
    return uint32_t((col / 64) * rows * 128 + row * 128 + (((col % 64) / 8) ^ (row % 8)) * 16 + (col % 8) * 2);
}

static int check_offsets()
{
    uint32_t *d, h[2048 + 96 * 128];
    CHECK(cudaMalloc(&d, sizeof h));
    offsets_kernel<<<1, 128>>>(d);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    cudaFree(d);
    int bad = 0;
    for (int tid = 0; tid < 128; tid++) {
        const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3, row = 16 * (warp & 1) + g;
        for (int nt = 0; nt < 4; nt++)
            for (int e = 0; e < 4; e++) {
                const int i = row + (e >= 2 ? 8 : 0), j = 8 * nt + 2 * t4 + (e & 1);
                bad += h[tid * 16 + nt * 4 + e] != reference_offset64(i, j);
            }
    }
    for (int t = 0; t < 64; t++)
        for (int lane = 0; lane < 32; lane++)
            bad += h[2048 + t * 128 + lane] != reference_offset(64, t, 4 * lane);
    for (int t = 0; t < 32; t++)
        for (int lane = 0; lane < 32; lane++)
            bad += h[2048 + 64 * 128 + t * 128 + lane] != reference_offset(32, t, 4 * lane);
    return bad;
}

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}
static double from_bf16(uint16_t h)
{
    uint32_t u = uint32_t(h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Runs one configuration; returns the relative max error against float64. */
static double run_case(int which, int N, int K, unsigned seed)
{
    srand(seed);
    uint16_t *hA = new uint16_t[64 * K], *hB = new uint16_t[N * K];
    float *hInit = new float[64 * N], *hD = new float[64 * N];
    for (int i = 0; i < 64 * K; i++)
        hA[i] = to_bf16(float(rand()) / RAND_MAX * 2.0f - 1.0f);
    for (int i = 0; i < N * K; i++)
        hB[i] = to_bf16(float(rand()) / RAND_MAX * 2.0f - 1.0f);
    for (int i = 0; i < 64 * N; i++)
        hInit[i] = which == 1 || which == 2 ? float(rand()) / RAND_MAX - 0.5f : 0.0f;
    uint16_t *dA, *dB;
    float *dInit, *dD;
    CHECK(cudaMalloc(&dA, 64 * K * 2));
    CHECK(cudaMalloc(&dB, N * K * 2));
    CHECK(cudaMalloc(&dInit, 64 * N * 4));
    CHECK(cudaMalloc(&dD, 64 * N * 4));
    CHECK(cudaMemcpy(dA, hA, 64 * K * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dB, hB, N * K * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dInit, hInit, 64 * N * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(dD, 0xff, 64 * N * 4));
    const size_t smem = sizeof(LayoutSmem) + 1024;
    CHECK(cudaFuncSetAttribute(layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    layout_kernel<<<1, 128, smem>>>(which, dA, dB, dInit, dD);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(hD, dD, 64 * N * 4, cudaMemcpyDeviceToHost));
    double max_err = 0, max_ref = 0;
    int bad_printed = 0;
    for (int m = 0; m < 64; m++)
        for (int n = 0; n < N; n++) {
            double ref = hInit[m * N + n];
            for (int k = 0; k < K; k++)
                ref += from_bf16(hA[m * K + k]) * from_bf16(hB[n * K + k]);
            const double err = fabs(ref - hD[m * N + n]);
            if (!(err <= 1e-3 * (1 + fabs(ref))) && bad_printed++ < 6)
                printf("    [%d][%d] got %g want %g\n", m, n, hD[m * N + n], ref);
            max_err = fmax(max_err, isnan(hD[m * N + n]) ? INFINITY : err);
            max_ref = fmax(max_ref, fabs(ref));
        }
    cudaFree(dA);
    cudaFree(dB);
    cudaFree(dInit);
    cudaFree(dD);
    delete[] hA;
    delete[] hB;
    delete[] hInit;
    delete[] hD;
    return max_err / max_ref;
}

int main()
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("SKIP: no CUDA device; the wgmma layout test needs an sm_90 GPU\n");
        return 77;
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major != 9) {
        printf("SKIP: %s is not Hopper (sm_90)\n", prop.name);
        return 77;
    }
    struct { const char *name; int which, N, K; } cases[] = {
        {"rs_n64  (step 1: S . [kd|qd]^T)", 0, 64, 128},
        {"rs_n32  (steps 3, 4: Uin^T . INV^T, O^T += U^T . Mqk^T)", 1, 32, 32},
        {"rs_n128 (step 4: S += U^T . ki, N-major)", 2, 128, 32},
        {"ss_n32  (producer: [kd;qd] . ki^T)", 3, 32, 128},
    };
    const int bad_offsets = check_offsets();
    printf("%-48s %d wrong offsets  %s\n", "swizzle addressing (kernel index patterns)", bad_offsets,
           bad_offsets ? "FAILED" : "ok");
    int failed = bad_offsets != 0;
    for (auto &c : cases) {
        const double err = run_case(c.which, c.N, c.K, 1234u + unsigned(c.which));
        const bool ok = err < 1e-5;
        printf("%-48s max rel err %.2e  %s\n", c.name, err, ok ? "ok" : "FAILED");
        failed += !ok;
    }
    return failed ? 1 : 0;
}
