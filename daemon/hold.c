/*
 * hold.c - see hold.h.
 */
#include "hold.h"

/* Whether v is at least pct percent of limit (doubles: limit may be
 * UINT64_MAX, for a backend that stages nothing). */
static bool fills(uint64_t v, uint64_t limit, uint32_t pct)
{
    return (double)v * 100.0 >= (double)limit * pct;
}

kd_hold_verdict kd_hold_next(kd_hold *h, const kd_hold_policy *p, bool busy,
                             const kd_cost_sum *runnable, const kd_sched_limits *lim,
                             uint64_t now_ns)
{
    bool big = fills(runnable->tokens, lim->max_tokens, p->fill_percent) ||
               fills(runnable->seqs, lim->max_seqs, p->fill_percent) ||
               fills(runnable->stage_in, lim->max_stage_in, p->fill_percent) ||
               fills(runnable->stage_out, lim->max_stage_out, p->fill_percent);
    if (!p->enabled || !busy || runnable->seqs == 0 || big ||
        (h->holding && now_ns >= kd_hold_deadline(h, p))) {
        h->holding = false;
        return KD_HOLD_GO;
    }
    if (h->holding)
        return KD_HOLD_KEEP;
    h->holding = true;
    h->since_ns = now_ns;
    return KD_HOLD_BEGIN;
}
