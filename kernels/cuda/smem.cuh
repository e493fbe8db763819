/*
 * smem.cuh - the fused kernel's shared memory: tile shapes, the 128-byte
 * swizzled operand layout, the pipeline stages and their barriers.
 *
 *   PrepStage x 2   chunk operands the producer prepares for the consumers
 *   RawStage  x 3   q, k, g, v of a chunk as loaded by the copy engine
 *   ProducerScratch the producer's private working set
 *   full/empty      one mbarrier pair per PrepStage
 */
#pragma once

#include <stdint.h>

namespace kda {

constexpr int D = 128;              /* head dimension (K = V = 128) */
constexpr int C = 32;               /* tokens per chunk */
constexpr int PREP_STAGES = 2;      /* prepared chunks in flight: one consumed while one is prepared */
constexpr int RAW_STAGES = 3;       /* chunk loads in flight: issued two chunks ahead */

/* Warpgroup roles: WG0 prepares chunks, WG1 and WG2 each own 64 state rows. */
constexpr int WG_THREADS = 128;
constexpr int CONSUMER_WGS = 2;
constexpr int THREADS = WG_THREADS * (1 + CONSUMER_WGS);
constexpr int ROWS_PER_CONSUMER = D / CONSUMER_WGS;

/*
 * Register budgets (setmaxnreg): 384 threads launch with 168 registers each
 * (64,512 of the SM's 65,536), which the roles then split 152 / 176 / 176
 * (the smallest budgets ptxas compiles without spills).  Each consumer
 * thread holds the fp32 state (64) and output (16) accumulators, the
 * [P | O1] accumulator (32), the bf16 A fragments of the state (32), U (16)
 * and the chunk's V values (16); the producer its chunk cursor, a 16-register
 * wgmma accumulator and one 8-token group of a chunk at a time.
 */
constexpr uint32_t PRODUCER_REGS = 152;
constexpr uint32_t CONSUMER_REGS = 176;
static_assert(PRODUCER_REGS * WG_THREADS + CONSUMER_REGS * WG_THREADS * CONSUMER_WGS == 168 * THREADS,
              "register budgets exceed the launch allocation");

enum NamedBarrier : uint32_t {
    BAR_ALL = 0,        /* __syncthreads */
    BAR_PRODUCER = 1,   /* the producer warpgroup */
};

/*
 * K-major bf16 operand tile of ROWS x COLS in the 128-byte swizzle layout
 * wgmma reads: COLS/64 column blocks, each ROWS rows of 128 bytes; within a
 * row, 16-byte chunk c sits at chunk c ^ (row % 8).  Tiles start on 1024-byte
 * boundaries so the swizzle pattern is anchored where wgmma expects it.
 */
template <int ROWS, int COLS>
struct alignas(1024) Sw128Tile {
    static_assert(ROWS % 8 == 0 && COLS % 64 == 0, "SW128 tiles are whole 8 x 64 atoms");
    uint16_t data[ROWS * COLS];

    /*
     * Byte offset of element (row, col).  Written on the byte offset within
     * the 128-byte row: nvcc 13.0 miscompiled the equivalent
     * ((col >> 3) ^ (row & 7)) << 4 | (col & 7) << 1 when col was a constant
     * odd number (it dropped the >> 3); test_wgmma_layout checks this form.
     */
    __host__ __device__ __forceinline__ static uint32_t offset(int row, int col)
    {
        const uint32_t byte = uint32_t(col) * 2;    /* byte within the row's 64-column block */
        const uint32_t swizzled = (byte & 0x0f) | ((byte & 0x70) ^ ((uint32_t(row) & 7) << 4));
        return (byte >> 7) * ROWS * 128 + uint32_t(row) * 128 + swizzled;
    }
    __device__ __forceinline__ uint16_t *at(int row, int col)
    {
        return reinterpret_cast<uint16_t *>(reinterpret_cast<char *>(data) + offset(row, col));
    }
    /* Start of the 16-column K slice `ks` for rows [row0, row0 + 8n): what a descriptor points at. */
    __device__ __forceinline__ const void *kslice(int ks, int row0 = 0) const
    {
        return reinterpret_cast<const char *>(data) + (ks >> 2) * ROWS * 128 + row0 * 128 + (ks & 3) * 32;
    }
};

/* What the producer tells the consumers about a chunk. */
struct ChunkHeader {
    int32_t seq;        /* index into the descriptor table */
    int32_t head;
    int32_t t0;         /* first token of the chunk within its sequence */
    int32_t ntok;       /* real tokens in the chunk, 0..C (0: a zero-state-only item) */
    uint32_t flags;     /* CHUNK_* */
};
enum : uint32_t {
    CHUNK_FIRST = 1u,   /* first chunk of a work item: load the state */
    CHUNK_LAST = 2u,    /* last chunk: store the state */
    CHUNK_END = 4u,     /* no more work: consumers exit */
};

struct alignas(1024) PrepStage {
    Sw128Tile<2 * C, D> kq;      /* [64 x 128]: rows 0..31 k^ e^(G-c), rows 32..63 scale q^ e^(G-c) */
    Sw128Tile<D + C, 64> krm;    /* [160 x 64], cols 0..31: rows 0..127 Kr^T[d][j], 128..159 Mqk[i][j] */
    Sw128Tile<C, 64> inv;        /* [32 x 64], cols 0..31: (I + L)^-1 */
    Sw128Tile<C, D> v;           /* [32 x 128]: the chunk's values, read by ldmatrix.trans */
    float beta[C];               /* sigmoid(beta); 0 past the chunk's last token */
    float gam_last[D];           /* e^(G_last): the state's decay over the chunk, per key dim */
    float gam_mid[D];            /* e^c, c = G at the chunk's middle: undoes the centring in S . kdc */
    ChunkHeader hdr;
};

struct alignas(128) RawStage {
    uint16_t q[C * D];           /* [32 x 128] bf16, row-major; rows past the end zero-filled */
    uint16_t k[C * D];
    uint16_t g[C * D];
    uint16_t v[C * D];
};

struct alignas(1024) ProducerScratch {
    Sw128Tile<C, D> kic;         /* [32 x 128]: k^ e^(c-G), the B operand of L and Mqk */
    float2 half_total[2][D / 2]; /* per key-dim pair: the gate sum over each half of the chunk */
    float lmat[C][C + 2];        /* strictly lower diag(b) kd ki^T, fp32 (rows padded, 8-byte aligned) */
    float inv[C][C + 1];         /* (I + L)^-1 under construction, fp32 */
    float x[C / 2][C / 2 + 1];   /* L21 . A^-1 while merging diagonal blocks of the inverse */
    float inv_norm_q[C];
    float inv_norm_k[C];
    int32_t item[2];             /* scheduler broadcast: (seq, head) or (-1, -1) */
};

struct SharedStorage {
    PrepStage prep[PREP_STAGES];
    RawStage raw[RAW_STAGES];
    ProducerScratch scratch;
    uint64_t loaded[RAW_STAGES]; /* bulk copies -> producer: raw stage filled (1 arrival + bytes) */
    uint64_t full[PREP_STAGES];  /* producer -> consumers: stage prepared (128 arrivals) */
    uint64_t empty[PREP_STAGES]; /* consumers -> producer: stage consumed (256 arrivals) */
};

constexpr size_t SMEM_BYTES = sizeof(SharedStorage) + 1024;   /* + alignment slack of the dynamic base */
static_assert(SMEM_BYTES <= 232448, "shared memory exceeds the sm_90 per-block opt-in limit");

}  // namespace kda
