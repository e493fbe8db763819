/*
 * kda_cpu.h - the CPU backend: the chunked KDA algorithm in fp32.
 *
 * bf16 in and out, state fp32 between chunks (rounded once at the end for a
 * bf16 pool), threaded over (sequence, head) work items on a persistent
 * thread pool.  Serves as kdad's backend on machines without a GPU.
 */
#ifndef KDA_CPU_H
#define KDA_CPU_H

#include "kda.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kda_cpu kda_cpu;

/* Starts a backend with nthreads workers (0: one per online CPU). */
int kda_cpu_create(int nthreads, kda_cpu **out, kda_error *err);
void kda_cpu_destroy(kda_cpu *cpu);
int kda_cpu_threads(const kda_cpu *cpu);

/*
 * Runs one batch (kda.h) and returns when it is done.  Every argument is
 * checked (kda_batch_check, kda_layer_check) before anything is written.
 * Not reentrant: one call at a time per kda_cpu.
 */
int kda_cpu_prefill(kda_cpu *cpu, const kda_pool *pool, const kda_seq *seqs, int64_t nseqs,
                    kda_error *err);

/*
 * Runs one decode step (kda.h, kda_step) and returns when it is done:
 * kda_step_check and kda_layer_check before anything is written.  The state
 * stays fp32 across the step's tokens and is rounded once at its end for a
 * bf16 pool (each kept per-token state is rounded on its own).  Not
 * reentrant, as kda_cpu_prefill.
 */
int kda_cpu_step(kda_cpu *cpu, const kda_pool *pool, const kda_step *step, kda_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KDA_CPU_H */
