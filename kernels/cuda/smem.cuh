/*
 * smem.cuh - the fused kernel's shared memory: tile shapes, the 128- and
 * 64-byte swizzled operand layouts, the pipeline stages and their barriers.
 *
 *   PrepStage x 2   chunk operands the producers prepare for the consumers
 *   RawStage  x 3   q, k, g, v of a chunk as loaded by cp.async, with
 *                   the chunk's header and layer weights
 *   ProducerScratch the producers' private working set
 *   full/empty      one mbarrier pair per PrepStage
 */
#pragma once

#include <stdint.h>

namespace kda {

constexpr int D = 128;              /* head dimension (K = V = 128) */
constexpr int C = 32;               /* tokens per chunk */
constexpr int PREP_STAGES = 2;      /* prepared chunks in flight: one consumed while one is prepared */
constexpr int RAW_STAGES = 3;       /* chunk loads in flight: issued two chunks ahead */

/* Warpgroup roles: WG0 and WG1 prepare each chunk together, WG2 and WG3 each own 64 state rows. */
constexpr int WG_THREADS = 128;
constexpr int PRODUCER_WGS = 2;
constexpr int CONSUMER_WGS = 2;
constexpr int PRODUCER_THREADS = WG_THREADS * PRODUCER_WGS;
constexpr int THREADS = WG_THREADS * (PRODUCER_WGS + CONSUMER_WGS);
constexpr int ROWS_PER_CONSUMER = D / CONSUMER_WGS;

/*
 * Register budgets (setmaxnreg): 512 threads launch with 128 registers each
 * (all 65,536 of the SM's), which the roles then split 80 / 176.  Each
 * consumer thread holds the fp32 state (64) and output (16) accumulators,
 * the [P | O1] accumulator (32), the bf16 A fragments of the state (32), U
 * (16) and the chunk's V values (8); a producer thread one key-dim pair of
 * an 8-token quarter chunk, or a 32-register wgmma accumulator.
 */
constexpr int LAUNCH_REGS = 65536 / THREADS;
constexpr uint32_t PRODUCER_REGS = 80;
constexpr uint32_t CONSUMER_REGS = 176;
static_assert(PRODUCER_REGS * PRODUCER_THREADS + CONSUMER_REGS * WG_THREADS * CONSUMER_WGS == LAUNCH_REGS * THREADS,
              "register budgets exceed the launch allocation");

enum NamedBarrier : uint32_t {
    BAR_ALL = 0,        /* __syncthreads */
    BAR_PRODUCERS = 1,  /* the two producer warpgroups */
    BAR_CONSUMER = 2,   /* + consumer index: one consumer warpgroup */
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

/*
 * K-major bf16 operand tile of ROWS x 32 in the 64-byte swizzle layout, for
 * the K = 32 operands (INV, [Kr | Mqk^T]): one 64-byte row per row, 8-row
 * atoms of 512 bytes; within a row, 16-byte chunk c sits at chunk
 * c ^ ((row / 2) % 4).  Half the bytes of a 64-column SW128 tile.
 */
template <int ROWS>
struct alignas(512) Sw64Tile {
    static_assert(ROWS % 8 == 0, "SW64 tiles are whole 8-row atoms");
    static constexpr int COLS = 32;
    uint16_t data[ROWS * COLS];

    __host__ __device__ __forceinline__ static uint32_t offset(int row, int col)
    {
        const uint32_t byte = uint32_t(col) * 2;    /* byte within the 64-byte row */
        const uint32_t swizzled = (byte & 0x0f) | ((byte & 0x30) ^ (((uint32_t(row) >> 1) & 3) << 4));
        return uint32_t(row) * 64 + swizzled;
    }
    __device__ __forceinline__ uint16_t *at(int row, int col)
    {
        return reinterpret_cast<uint16_t *>(reinterpret_cast<char *>(data) + offset(row, col));
    }
    /* Start of the 16-column K slice `ks` (0 or 1): what a descriptor points at. */
    __device__ __forceinline__ const void *kslice(int ks) const
    {
        return reinterpret_cast<const char *>(data) + ks * 32;
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

/*
 * The tiles are built from the raw (unnormalised) q and k: the L2 norms come
 * from the diagonal of the same wgmma that forms L and Mqk, and are applied
 * as per-token factors (n_t = 1 / |k_t|, m_t = 1 / |q_t|):
 *   L^  = diag(b n^2) strictly_lower(kd ki^T) = diag(n) L diag(1/n), so the solve
 *         with (I + L^)^-1 gives n U from the input n Uin = b n V - b n^2 P
 *         (P = S kd^T from the raw kd), and n U is what Kr and Mqk (raw k) need
 *   O   = scale m (O1 + (n U) Mqk^T)
 */
struct alignas(1024) PrepStage {
    Sw128Tile<2 * C, D> kq;      /* [64 x 128]: rows 0..31 kd = k e^(G-c), rows 32..63 qd = q e^(G-c) */
    Sw64Tile<D + C> krm;         /* [160 x 32]: rows 0..127 Kr^T[d][j] = k_j e^(G_last-G_j), 128..159 Mqk[i][j] */
    Sw64Tile<C> inv;             /* [32 x 32]: (I + L^)^-1 */
    Sw128Tile<C, D> v;           /* [32 x 128]: the chunk's values, read by ldmatrix.trans; 0 past the end;
                                    then the chunk's outputs on their way to global memory */
    float bn[C];                 /* b n: scales V in Uin; 0 past the chunk's last token */
    float bn2[C];                /* b n^2: scales P in Uin; 0 past the chunk's last token */
    float out_scale[C];          /* scale m: the output's factor */
    float gam_last[D];           /* e^(G_last): the state's decay over the chunk, per key dim */
    float gam_mid[D];            /* e^c, c = G at the chunk's middle: undoes the centring in S . kd */
    ChunkHeader hdr;
};

/* A chunk as planned by the producers' thread 0, and its loaded per-token and per-head values. */
struct ChunkInfo {
    ChunkHeader hdr;
    float exp_a;                 /* e^A_log of the head */
    float lb2;                   /* lower_bound in log2 units */
    float scale;
    const uint16_t *src[4];      /* q, k, g, v at the chunk's first token and this head */
    const uint16_t *beta_src;    /* beta at the chunk's first token and this head */
    const float *dt_bias_src;    /* the head's dt_bias row */
    float beta[C];               /* sigmoid(beta); 0 past the chunk's last token (stored one chunk later) */
    float dt_bias[D];            /* the head's dt_bias */
};

struct alignas(128) RawStage {
    uint16_t q[C * D];           /* [32 x 128] bf16, row-major; rows past the end are stale */
    uint16_t k[C * D];
    uint16_t g[C * D];
    uint16_t v[C * D];
    ChunkInfo info;
};

/* The producers' position in the work: the chunk they plan next. */
struct LoadCursor {
    const uint16_t *q, *k, *v, *g, *beta;
    const float *dt_bias;        /* the head's row, or null (a zero-length item) */
    int64_t len;
    int32_t seq, head;           /* seq < 0: no more work */
    int32_t t0;                  /* first token of the next chunk */
    float exp_a, lb2, scale;
};

struct alignas(1024) ProducerScratch {
    Sw128Tile<2 * C, D> kiq;     /* [64 x 128]: rows 0..31 ki = k e^(c-G), rows 32..63 q e^(c-G) */
    union {                      /* lifetimes do not overlap: the gates, then L and the inverse */
        float2 quarter_total[4][D / 2];   /* per key-dim pair: the gate sum over each quarter chunk */
        float lmat[C][C + 2];    /* strictly lower diag(b n^2) kd ki^T, fp32 (rows padded, 8-byte aligned) */
    };
    float inv[C][C + 1];         /* (I + L^)^-1 under construction, fp32 */
    float x[C / 2][C / 2 + 1];   /* L21 . A^-1 while merging diagonal blocks of the inverse */
    LoadCursor cursor;
};

struct SharedStorage {
    PrepStage prep[PREP_STAGES];
    RawStage raw[RAW_STAGES];
    ProducerScratch scratch;
    uint64_t loaded[RAW_STAGES]; /* copies -> producers: raw stage filled (128 cp.async arrivals, WG1) */
    uint64_t full[PREP_STAGES];  /* producers -> consumers: stage prepared (256 arrivals) */
    uint64_t empty[PREP_STAGES]; /* consumers -> producer: stage consumed (256 arrivals) */
};

constexpr size_t SMEM_BYTES = sizeof(SharedStorage) + 1024;   /* + alignment slack of the dynamic base */
static_assert(SMEM_BYTES <= 232448, "shared memory exceeds the sm_90 per-block opt-in limit");

}  // namespace kda
