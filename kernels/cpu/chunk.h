/*
 * chunk.h - one (sequence, head) chain of the chunked KDA algorithm on the CPU.
 *
 * Internal to the CPU backend.  A worker owns one cpu_scratch and runs whole
 * chains with it: the state is loaded from the pool slot into a K-major fp32
 * working copy, advanced chunk by chunk (docs/kda.md, "Chunks"), and stored
 * back once at the end, so the slot is updated in place.
 */
#ifndef KDA_CPU_CHUNK_H
#define KDA_CPU_CHUNK_H

#include "kda.h"

enum {
    CPU_D = KDA_HEAD_DIM,
    CPU_CHUNK = 16,   /* C: |G| <= 16 * 5 = 80 nats, so exp(+-G) stays finite in fp32 */
};

/* Per-worker scratch; every row is 512 bytes, so each array stays 64-byte aligned. */
typedef struct cpu_scratch {
    float S[CPU_D][CPU_D];          /* state, K-major: S[k][v] = pool (v, k) */
    float A[2 * CPU_CHUNK][CPU_D];  /* rows 0..C-1: kd = k^ Gam; rows C..2C-1: qd = scale q^ Gam */
    float P[2 * CPU_CHUNK][CPU_D];  /* A . S: rows 0..C-1 P = kd S, rows C..2C-1 O1 = qd S */
    float ki[CPU_CHUNK][CPU_D];     /* k^ / Gam */
    float kr[CPU_CHUNK][CPU_D];     /* k^ GamC / Gam */
    float qn[CPU_CHUNK][CPU_D];     /* q^, then reused */
    float kn[CPU_CHUNK][CPU_D];     /* k^ */
    float G[CPU_CHUNK][CPU_D];      /* inclusive prefix sums of log a */
    float U[CPU_CHUNK][CPU_D];      /* the chunk's corrected values (I + L)^-1 diag(b) (V - P) */
    float Vv[CPU_CHUNK][CPU_D];     /* v as fp32 */
    float L[CPU_CHUNK][CPU_CHUNK];  /* strictly lower: b_i kd_i . ki_j */
    float M[CPU_CHUNK][CPU_CHUNK];  /* lower incl. diagonal: qd_i . ki_j */
    float gamC[CPU_D];              /* exp(G_{C-1}) */
    float dt_bias[CPU_D];           /* this head's gate bias */
    float b[CPU_CHUNK];             /* sigmoid(beta) */
} __attribute__((aligned(64))) cpu_scratch;

/* Runs head `head` of sequence `seq` (len > 0) against the pool, in place. */
void cpu_chain_run(cpu_scratch *ws, const kda_pool *pool, const kda_seq *seq, int32_t head);

/* Zeroes one slot (all heads). */
void cpu_slot_zero(const kda_pool *pool, int64_t slot);

#endif /* KDA_CPU_CHUNK_H */
