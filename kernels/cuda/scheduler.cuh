/*
 * scheduler.cuh - the varlen work scheduler of the persistent grid.
 *
 * A work item is one (sequence, head) chain: item = seq * heads + head over
 * the descriptor table, handed out from one device counter, so CTAs that
 * finish early take more items (the host sorts sequences longest first).
 * The last CTA to finish resets the counters, so a launch needs no memset
 * and a captured graph replays as is.  (Paired chains take their items
 * statically instead: producer.cuh, plan_paired.)
 */
#pragma once

#include "kda.h"
#include "params.h"

namespace kda {

/* An item has work when its sequence has tokens, or none but KDA_SEQ_ZERO_STATE (which still zeroes its slot). */
__device__ __forceinline__ bool seq_has_work(const kda_seq &s) { return s.len > 0 || (s.flags & KDA_SEQ_ZERO_STATE); }

/* Takes the next item that has work.  One thread calls this. */
__device__ __forceinline__ bool sched_fetch(const kda_fwd_params &p, uint32_t nitems, int32_t &seq,
                                            int32_t &head)
{
    for (;;) {
        const uint32_t item = atomicAdd(&p.sched->next_item, 1u);
        if (item >= nitems)
            return false;
        seq = int32_t(item / uint32_t(p.heads));
        head = int32_t(item % uint32_t(p.heads));
        if (seq_has_work(p.seqs[seq]))
            return true;
    }
}

/* Called by thread 0 once the whole CTA is done with its items. */
__device__ __forceinline__ void sched_finish(const kda_fwd_params &p)
{
    __threadfence();
    const uint32_t finished = atomicAdd(&p.sched->ctas_done, 1u) + 1;
    if (finished == gridDim.x) {   /* every CTA has stopped fetching: reset for the next launch */
        atomicExch(&p.sched->next_item, 0u);
        atomicExch(&p.sched->ctas_done, 0u);
    }
}

}  // namespace kda
