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
 * Pure logic: no I/O, no clock (the caller passes the time).  daemon.c asks
 * before forming each batch and wakes itself at the deadline.
 */
#ifndef KDAD_HOLD_H
#define KDAD_HOLD_H

#include <stdbool.h>
#include <stdint.h>

#include "sched.h"

typedef struct kd_hold_policy {
    bool enabled;          /* batching.hold_while_busy */
    uint32_t fill_percent; /* batching.hold_fill_percent, 1..100 */
    uint32_t max_us;       /* batching.hold_max_us, >= 1 */
} kd_hold_policy;

typedef struct kd_hold {
    bool holding;      /* the next batch is being held */
    uint64_t since_ns; /* since when */
} kd_hold;

typedef enum kd_hold_verdict {
    KD_HOLD_GO = 0, /* form the next batch now (ends any hold) */
    KD_HOLD_BEGIN,  /* hold it: a hold begins */
    KD_HOLD_KEEP,   /* hold it: the hold goes on */
} kd_hold_verdict;

/*
 * Whether the next batch is formed now.  busy: a batch executes on the
 * device; runnable: the runnable device work (kd_sched.runnable); lim: the
 * limits of one batch; now_ns: a monotonic clock in nanoseconds.
 */
kd_hold_verdict kd_hold_next(kd_hold *h, const kd_hold_policy *p, bool busy,
                             const kd_cost_sum *runnable, const kd_sched_limits *lim,
                             uint64_t now_ns);

/* When the hold in place ends at the latest (h->holding). */
static inline uint64_t kd_hold_deadline(const kd_hold *h, const kd_hold_policy *p)
{
    return h->since_ns + (uint64_t)p->max_us * 1000u;
}

#endif /* KDAD_HOLD_H */
