/*
 * hold.h - holding the next batch back while the device is busy
 * (batching.hold_while_busy, hold_fill_percent, hold_max_us).
 *
 * A batch formed while another one executes on the device only queues
 * behind it there.  Formed when the device is about to idle instead, it
 * takes in everything that arrived meanwhile: fewer, larger launches, which
 * use the device better (without this, 8 closed-loop clients on the H200
 * formed batches of 2-3 requests: 78% of the bare kernel's throughput,
 * bench/RESULTS.md).  So the next batch is held back while
 *   - hold_while_busy is on,
 *   - a batch executes on the device (launched and not finished: a batch
 *     still staging its inputs, or copying its outputs out on the host,
 *     does not count, so the next one's staging still overlaps it),
 *   - the runnable work fills less than hold_fill_percent of each batch
 *     limit (tokens, sequences, staging bytes each way), and
 *   - less than hold_max_us have passed since the hold began;
 * that is, it goes when the device finishes, when it is big enough, or when
 * the bound on the latency holding adds runs out, whichever comes first.
 *
 * Gathering (batching.gather_us, gather_wave_percent) holds a batch on an
 * idle device too, briefly, when it would fill the device's last wave
 * poorly and more work is on its way.  The device runs wave_chains
 * (sequence, head) chains at once (its SMs), each chain start to end; a
 * batch of c chains takes ceil(c / wave_chains) rounds, so 3 requests of 96
 * heads (288 chains) on 132 SMs take as long as 4 (384 chains).  Closed-loop
 * clients, each waiting for its answer before sending again, otherwise
 * settle into such batches (8 clients on the H200 ran at 75% of the bare
 * kernel's throughput, bench/RESULTS.md).  So a batch on an idle device is
 * held while
 *   - gather_us is not 0 and the backend has waves (wave_chains > 0),
 *   - its chains would use less than gather_wave_percent of the rounds they
 *     take (chains / (rounds x wave_chains); up to paired_chains chains run
 *     on two SMs each, using 2 x chains of them),
 *   - some connection is awaited: it had a prefill answered lately and has
 *     nothing in flight, so its next request is likely on its way, and
 *   - less than gather_us have passed since the gathering began.
 * A lone client is never awaited while its own request waits, so it never
 * waits for itself.
 *
 * Pure logic: no I/O, no clock (the caller passes the time).  engine.c asks
 * before forming each batch and wakes itself at the deadline.
 */
#ifndef KDAD_HOLD_H
#define KDAD_HOLD_H

#include <stdbool.h>
#include <stdint.h>

#include "scheduler.h"

typedef struct kd_hold_policy {
    bool enabled;                 /* batching.hold_while_busy */
    uint32_t fill_percent;        /* batching.hold_fill_percent, 1..100 */
    uint32_t max_us;              /* batching.hold_max_us, >= 1 */
    uint32_t gather_us;           /* batching.gather_us, 0: no gathering */
    uint32_t gather_wave_percent; /* batching.gather_wave_percent, 1..100 */
} kd_hold_policy;

/* What the daemon sees when it asks. */
typedef struct kd_hold_view {
    bool busy;                     /* a batch executes on the device */
    const kd_cost_sum *runnable;   /* the runnable device work (kd_sched.runnable) */
    const kd_sched_limits *lim;    /* the limits of one batch */
    uint32_t chains_per_seq;       /* the pool's heads */
    uint32_t wave_chains;          /* chains the device runs at once; 0: no waves */
    uint32_t paired_chains;        /* up to this many run on two SMs each */
    bool awaited;                  /* some connection's next request is likely on its way */
    uint64_t now_ns;               /* a monotonic clock in nanoseconds */
} kd_hold_view;

typedef struct kd_hold {
    bool holding;      /* the next batch is being held */
    bool gathering;    /* ... on an idle device, for its waves */
    uint64_t since_ns; /* since when */
} kd_hold;

typedef enum kd_hold_verdict {
    KD_HOLD_GO = 0,       /* form the next batch now (ends any hold) */
    KD_HOLD_BEGIN,        /* hold it while the device is busy: a hold begins */
    KD_HOLD_GATHER_BEGIN, /* hold it on an idle device: a gathering begins */
    KD_HOLD_KEEP,         /* hold it: the hold or the gathering goes on */
} kd_hold_verdict;

/* Whether the next batch is formed now. */
kd_hold_verdict kd_hold_next(kd_hold *h, const kd_hold_policy *p, const kd_hold_view *v);

/* Whether the runnable work would keep less than gather_wave_percent of the
 * SMs busy (the daemon asks before looking for awaited connections). */
bool kd_hold_poor_wave(const kd_hold_policy *p, const kd_hold_view *v);

/* The percentage of the device's SMs that c chains keep busy over the rounds they take. */
uint32_t kd_wave_percent(uint64_t chains, uint32_t wave_chains, uint32_t paired_chains);

/* When the hold or gathering in place ends at the latest (h->holding). */
static inline uint64_t kd_hold_deadline(const kd_hold *h, const kd_hold_policy *p)
{
    return h->since_ns + (uint64_t)(h->gathering ? p->gather_us : p->max_us) * 1000u;
}

#endif /* KDAD_HOLD_H */
