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

uint32_t kd_wave_percent(uint64_t chains, uint32_t wave_chains, uint32_t paired_chains)
{
    if (wave_chains == 0 || chains == 0)
        return 100;
    if (chains <= paired_chains && 2 * chains <= wave_chains)
        return (uint32_t)(200 * chains / wave_chains);
    uint64_t rounds = (chains + wave_chains - 1) / wave_chains;
    return (uint32_t)(100 * chains / (rounds * wave_chains));
}

bool kd_hold_poor_wave(const kd_hold_policy *p, const kd_hold_view *v)
{
    uint64_t chains = v->runnable->seqs * v->chains_per_seq;
    return v->wave_chains &&
           kd_wave_percent(chains, v->wave_chains, v->paired_chains) < p->gather_wave_percent;
}

/* Whether a batch of the runnable work should wait on an idle device for more (hold.h). */
static bool worth_gathering(const kd_hold_policy *p, const kd_hold_view *v)
{
    return p->gather_us && v->awaited && kd_hold_poor_wave(p, v);
}

static kd_hold_verdict begin(kd_hold *h, bool gathering, uint64_t now_ns)
{
    h->holding = true;
    h->gathering = gathering;
    h->since_ns = now_ns;
    return gathering ? KD_HOLD_GATHER_BEGIN : KD_HOLD_BEGIN;
}

kd_hold_verdict kd_hold_next(kd_hold *h, const kd_hold_policy *p, const kd_hold_view *v)
{
    const kd_cost_sum *r = v->runnable;
    const kd_sched_limits *lim = v->lim;
    bool big = fills(r->tokens, lim->max_tokens, p->fill_percent) ||
               fills(r->seqs, lim->max_seqs, p->fill_percent) ||
               fills(r->stage_in, lim->max_stage_in, p->fill_percent) ||
               fills(r->stage_out, lim->max_stage_out, p->fill_percent);
    /* Held while the device is busy, or gathered on an idle one: */
    bool want = r->seqs > 0 && !big && (v->busy ? p->enabled : worth_gathering(p, v));
    if (!want) {
        h->holding = h->gathering = false;
        return KD_HOLD_GO;
    }
    /* The device finishing ends a hold and may begin a gathering (and the
     * other way round): each has its own bound. */
    if (!h->holding || h->gathering == v->busy)
        return begin(h, !v->busy, v->now_ns);
    if (v->now_ns >= kd_hold_deadline(h, p)) {
        h->holding = h->gathering = false;
        return KD_HOLD_GO;
    }
    return KD_HOLD_KEEP;
}
