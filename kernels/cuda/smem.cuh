/*
 * smem.cuh - the fused kernel's shared memory: tile shapes, the 128- and
 * 64-byte swizzled operand layouts, the pipeline stages and their barriers.
 *
 *   PrepStage x 4    chunk operands the producers prepare for the consumers
 *   ProducerArea x 2 one per producer warpgroup: the raw q, k, g rows of its
 *                    chunk (cp.async), the plans of its current and next
 *                    chunk, and its working set
 *   LoadCursor       where the producers are in the work (shared by both)
 *   ChainWalk x 2    paired chains: each producer warpgroup's own position
 *   mbarriers        full/empty per PrepStage, loaded and plan turn per
 *                    producer warpgroup
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace kda {

constexpr int D = 128;              /* head dimension (K = V = 128) */
constexpr int C = 32;               /* tokens per chunk */
/* Prepared chunks in flight: a producer warpgroup holds a stage while it prepares its chunk, so the
   four producers of paired chains need four stages to keep the consumers fed; one CTA per chain
   uses three (two prepared ahead).  Each producer then stays within one phase of its stage's empty
   barrier (paired: it waits for chunk n - 4; its previous wait, four chunks earlier, was for n - 8). */
constexpr int PREP_STAGES = 4;
constexpr int prep_stages(bool paired) { return paired ? 4 : 3; }

/* Where chunk n of a CTA's (cluster's) sequence goes in the ring, for producers and consumers alike:
   its stage, and the parity of the stage's full barrier phase that holds it (the empty barrier's
   phase before it has the other parity). */
struct StageUse {
    uint32_t index;
    uint32_t phase;
};
template <bool PAIRED>
__host__ __device__ __forceinline__ constexpr StageUse stage_use(uint32_t n)
{
    return StageUse{n % uint32_t(prep_stages(PAIRED)), (n / uint32_t(prep_stages(PAIRED))) & 1u};
}

/* The H200's (sm_90) limits the layout and the register budgets are sized for. */
constexpr size_t SM90_SMEM_PER_BLOCK = 232448;   /* opt-in dynamic shared memory per block */
constexpr int SM90_REGISTERS = 65536;            /* 32-bit registers per SM, all of them one block's */

/*
 * Warpgroup roles.  A chain's state is held by two consumer warpgroups of 64
 * rows each.  One CTA per chain: WG0 and WG1 prepare alternate chunks, WG2
 * and WG3 hold the state.  Paired chains (a cluster of two CTAs per chain,
 * when chains are at most half the SMs): in each CTA WG0 and WG1 prepare
 * every fourth chunk, for both CTAs, and WG2 holds the 64 state rows of the
 * CTA's rank.
 */
constexpr int WG_THREADS = 128;
constexpr int PRODUCER_WGS = 2;
constexpr int CHAIN_CONSUMER_WGS = 2;
constexpr int ROWS_PER_CONSUMER = D / CHAIN_CONSUMER_WGS;
constexpr int PRODUCER_THREADS = WG_THREADS * PRODUCER_WGS;
constexpr int consumer_wgs(bool paired) { return paired ? 1 : CHAIN_CONSUMER_WGS; }
constexpr int threads(bool paired) { return WG_THREADS * (PRODUCER_WGS + consumer_wgs(paired)); }

/*
 * Register budgets (setmaxnreg): 512 threads launch with 128 registers each
 * (all 65,536 of the SM's), which the roles then split 88 / 168.  Each
 * consumer thread holds the fp32 state (64) and output (16) accumulators,
 * the [P | O1] accumulator (32), the bf16 A fragments of the state (32), U
 * (16) and the chunk's V values (8); a producer thread the gate prefix sums
 * of four key dims over a quarter chunk (32), a 32-register wgmma
 * accumulator, or a column of a 16 x 16 inverse (16).  Paired chains launch
 * 384 threads with 168 registers and have room to spare: 104 / 240.
 */
constexpr uint32_t producer_regs(bool paired) { return paired ? 104 : 88; }
constexpr uint32_t consumer_regs(bool paired) { return paired ? 240 : 168; }
constexpr int launch_regs(bool paired) { return SM90_REGISTERS / threads(paired) / 8 * 8; }
constexpr bool regs_fit(bool paired)
{
    return producer_regs(paired) * PRODUCER_THREADS + consumer_regs(paired) * WG_THREADS * consumer_wgs(paired) <=
           uint32_t(launch_regs(paired) * threads(paired));
}
static_assert(regs_fit(false) && regs_fit(true), "register budgets exceed the launch allocation");

enum NamedBarrier : uint32_t {
    BAR_ALL = 0,        /* __syncthreads */
    BAR_PRODUCER = 1,   /* + producer index: one producer warpgroup */
    BAR_CONSUMER = 3,   /* + consumer index: one consumer warpgroup */
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
    /* Byte offset of the 16-column K slice `ks`: what desc_advance adds to the tile's descriptor. */
    __host__ __device__ __forceinline__ static constexpr uint32_t kslice_offset(int ks)
    {
        return uint32_t((ks >> 2) * ROWS * 128 + (ks & 3) * 32);
    }
    /* Read N-major (rows along K): the step between 64-column blocks, and K slice `ks` (16 rows). */
    static constexpr uint32_t BLOCK_BYTES = ROWS * 128;
    __host__ __device__ __forceinline__ static constexpr uint32_t nmajor_kslice_offset(int ks)
    {
        return uint32_t(ks * 16 * 128);
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
    /* Byte offset of the 16-column K slice `ks` (0 or 1): what desc_advance adds to the tile's descriptor. */
    __host__ __device__ __forceinline__ static constexpr uint32_t kslice_offset(int ks) { return uint32_t(ks * 32); }
};

/* What the producer tells the consumers about a chunk (16-byte aligned: paired chains bulk-copy it). */
struct alignas(16) ChunkHeader {
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
    CHUNK_PAST_END = 8u, /* paired chains: a chunk after the END one, which nobody waits for */
};

/*
 * The tiles are built from the raw (unnormalised) q and k, and the L2 norms
 * applied as per-token factors (n_t = 1 / |k_t| from the diagonal of the
 * wgmma that forms L and Mqk, m_t = 1 / |q_t| summed while the tiles are
 * built):
 *   L^  = diag(b n^2) strictly_lower(kd ki^T) = diag(n) L diag(1/n), so the solve
 *         with (I + L^)^-1 gives n U from the input n Uin = b n V - b n^2 P
 *         (P = S kd^T from the raw kd), and n U is what ki and Mqk (raw k) need
 *   O   = scale m (O1 + (n U) Mqk^T)
 * The state update needs no tile of its own: with c the centre of the chunk's
 * gates and tail = G_last - c,
 *   S_new = S e^G_last + U^T (k e^(G_last - G)) = (S e^c + U^T ki) e^tail,
 * so the consumers scale S by e^c before step 1 (whose operand is S e^c
 * anyway), accumulate U^T ki reading ki N-major, and scale by e^tail after.
 */
struct alignas(1024) PrepStage {
    Sw128Tile<2 * C, D> kq;      /* [64 x 128]: rows 0..31 kd = k e^(G-c), rows 32..63 qd = q e^(G-c) */
    Sw128Tile<C, D> ki;          /* [32 x 128]: ki = k e^(c-G) */
    Sw64Tile<C> mqk;             /* [32 x 32]: Mqk[i][j], zero above the diagonal */
    Sw64Tile<C> inv;             /* [32 x 32]: (I + L^)^-1 */
    Sw128Tile<C, D> v;           /* [32 x 128]: the chunk's values (cp.async straight from global memory),
                                    read by ldmatrix.trans; 0 past the end; then the chunk's outputs on
                                    their way to global memory */
    float bn[C];                 /* b n: scales V in Uin; 0 past the chunk's last token */
    float bn2[C];                /* b n^2: scales P in Uin; 0 past the chunk's last token */
    float out_scale[C];          /* scale m: the output's factor */
    float gam_mid[D];            /* e^c, c = G at the chunk's middle token, per key dim */
    float gam_tail[D];           /* e^(G_last - c) */
    ChunkHeader hdr;
};

/* A chunk as planned, and its loaded per-token and per-head values. */
struct ChunkInfo {
    ChunkHeader hdr;
    float exp_a;                 /* e^A_log of the head */
    float lb2;                   /* lower_bound in log2 units */
    float scale;
    const uint16_t *src[4];      /* q, k, g, v at the chunk's first token and this head */
    const uint16_t *beta_src;    /* beta at the chunk's first token and this head */
    const float *dt_bias_src;    /* the head's dt_bias row */
    float beta[C];               /* sigmoid(beta); 0 past the chunk's last token (stored when it is prepared) */
    float dt_bias[D];            /* the head's dt_bias */
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

/* Paired chains: one producer warpgroup's walk over its cluster's items (cluster, cluster + clusters, ...). */
struct ChainWalk {
    LoadCursor cur;              /* the item the walk is in (seq < 0: past the last) */
    uint32_t item;               /* its index, seq * heads + head */
    int32_t first;               /* the cluster's number of its first chunk (past the last: all chunks) */
    int32_t chunks;              /* its chunks: ceil(len / C), 1 for a zero-state-only item, 0 for none */
};

/* One producer warpgroup's own memory: it prepares every other (paired: every fourth) chunk. */
struct alignas(128) ProducerArea {
    uint16_t q[C * D];           /* [32 x 128] bf16, row-major, as loaded; rows past the end are stale */
    uint16_t k[C * D];
    uint16_t g[C * D];
    ChunkInfo info[3];           /* the chunk being prepared, the next one (its rows loading) and the one
                                    after (being planned), by the warpgroup's chunk count mod 3 */
    union {                      /* lifetimes do not overlap: the gates, then L and the inverse */
        float4 quarter_total[4][D / 4];   /* per 4 key dims: the gate sum over each quarter chunk */
        float lt[C][C + 4];      /* L^ transposed: lt[j][i] = L^[i][j] (strictly lower diag(b n^2) kd ki^T),
                                    fp32, rows padded and 16-byte aligned */
    };
    float inv[C][C + 1];         /* (I + L^)^-1 under construction, fp32 */
    float y[C / 2][C / 2 + 1];   /* B A^-1 (the lower left block of L^ times the upper left inverse) */
};

struct SharedStorage {
    PrepStage prep[PREP_STAGES];
    ProducerArea area[PRODUCER_WGS];
    LoadCursor cursor;
    ChainWalk walk[PRODUCER_WGS];
    uint64_t full[PREP_STAGES];  /* producer -> consumers: stage prepared and its values landed
                                    (128 arrivals and 128 cp.async arrivals of one warpgroup; paired
                                    chains, from the peer: 256 arrivals and the bulk copy's bytes) */
    uint64_t empty[PREP_STAGES]; /* consumers -> producers: stage consumed (256 arrivals: the chain's
                                    two consumer warpgroups, in both CTAs when paired) */
    uint64_t loaded[PRODUCER_WGS];    /* a warpgroup's raw rows landed (its 128 cp.async arrivals) */
    uint64_t plan_turn[PRODUCER_WGS]; /* this warpgroup may plan next (1 arrival, by the other) */
};

/* Arrivals per phase: full = a producer warpgroup's threads and their value copies; empty = the
   threads of the chain's two consumer warpgroups. */
constexpr uint32_t FULL_ARRIVALS = 2 * WG_THREADS;
constexpr uint32_t EMPTY_ARRIVALS = WG_THREADS * CHAIN_CONSUMER_WGS;
/* What paired chains copy of a prepared stage to the peer: everything up to the header. */
constexpr uint32_t STAGE_COPY_BYTES = uint32_t(offsetof(PrepStage, hdr) + sizeof(ChunkHeader));
static_assert(STAGE_COPY_BYTES % 16 == 0, "bulk copies move multiples of 16 bytes");

constexpr size_t SMEM_BYTES = sizeof(SharedStorage) + 1024;   /* + alignment slack of the dynamic base */
static_assert(SMEM_BYTES <= SM90_SMEM_PER_BLOCK, "shared memory exceeds the sm_90 per-block opt-in limit");

}  // namespace kda
