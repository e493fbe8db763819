/*
 * step.h - one (sequence, head) of a decode step on the CPU (step.c).
 *
 * Internal to the CPU backend; uses the worker's cpu_scratch state buffer.
 */
#ifndef KDA_CPU_STEP_H
#define KDA_CPU_STEP_H

#include "chunk.h"

/* Runs head `head` of step->seqs[seq] against the pool, in place. */
void cpu_step_run(cpu_scratch *ws, const kda_pool *pool, const kda_step *step, int32_t seq,
                  int32_t head);

#endif /* KDA_CPU_STEP_H */
