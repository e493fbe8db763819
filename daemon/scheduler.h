/*
 * scheduler.h - continuous batching: per-slot FIFOs and batch formation
 * (DESIGN.md §The data path, PROTOCOL.md §Ordering and atomicity).
 *
 * A job is one admitted request that names slots.  It joins the FIFO of
 * every slot it names, in arrival order, and becomes runnable when it heads
 * all of them: so requests on one slot run one at a time in arrival order,
 * and two runnable jobs never share a slot (each FIFO has one head).  A job
 * stays at the head of its FIFOs while it runs and leaves them when done,
 * which makes the next one runnable.
 *
 * Host jobs (slot.free, slot.reset: bookkeeping only) are handed out one by
 * one as they become runnable.  Device jobs are handed out in batches by
 * kd_sched_form, which fills one launch up to the limits and stays fair:
 * connections (groups) take turns, one job per turn, and the group that
 * picks first rotates from batch to batch, so no client can starve another.
 * The first job of a batch is always taken, so a job larger than the
 * current limits (after a reload lowered them) still runs.
 *
 * Pure data structure: no I/O, no backend, no clock.
 */
#ifndef KDAD_SCHEDULER_H
#define KDAD_SCHEDULER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kd_job kd_job;

/* What a job costs in a batch. */
typedef struct kd_job_cost {
    uint32_t tokens;    /* prefill tokens */
    uint32_t seqs;      /* prefill sequences, or 1 for a slot operation */
    uint64_t stage_in;  /* bytes the backend must stage towards the device */
    uint64_t stage_out; /* bytes the backend must stage back */
} kd_job_cost;

/* The summed cost of many jobs (64 bits: the queue can hold more than a batch). */
typedef struct kd_cost_sum {
    uint64_t tokens, seqs, stage_in, stage_out;
} kd_cost_sum;

/* Limits of one batch (the first job is taken regardless). */
typedef struct kd_sched_limits {
    uint32_t max_tokens;
    uint32_t max_seqs;
    uint64_t max_stage_in;
    uint64_t max_stage_out;
} kd_sched_limits;

/* A fairness group: the jobs of one connection.  Zero-initialise it. */
typedef struct kd_sched_group {
    kd_job *rhead, *rtail;             /* runnable device jobs, arrival order */
    struct kd_sched_group *prev, *next; /* ring of groups with runnable jobs */
    bool in_ring;
} kd_sched_group;

/* A job's place in one slot's FIFO. */
typedef struct kd_job_node {
    kd_job *job;
    struct kd_job_node *prev, *next;
    uint32_t slot;
} kd_job_node;

typedef enum kd_job_state {
    KD_JOB_IDLE = 0, /* not in the scheduler */
    KD_JOB_QUEUED,   /* waiting: blocked, or runnable and not handed out */
    KD_JOB_RUNNING,  /* handed out; still heads its FIFOs until kd_sched_done */
} kd_job_state;

struct kd_job {
    /* Set by the caller before kd_sched_push. */
    kd_sched_group *group;
    const uint32_t *slots; /* distinct slot indices */
    uint32_t nslots;       /* >= 1 */
    kd_job_cost cost;
    bool host;             /* a host job: no backend work */
    bool gated;            /* not runnable before kd_sched_ungate, even at its FIFOs' heads
                              (a prefill waiting for its ready word); it still holds its
                              place in them */
    /* Private to the scheduler. */
    kd_job_node *nodes;
    uint32_t blocked;      /* FIFOs this job does not head yet, +1 while gated */
    uint64_t order;        /* arrival order */
    kd_job_state state;
    bool waiting_head;     /* in the scheduler's list of gated jobs heading their FIFOs */
    kd_job *prev, *next;   /* in the group's runnable list, the host list, or that list */
};

typedef struct kd_fifo {
    kd_job_node *head, *tail;
    uint32_t count; /* jobs queued or running on the slot */
} kd_fifo;

typedef struct kd_sched {
    kd_fifo *fifo;          /* one per slot */
    uint32_t nslots;
    kd_sched_group *ring;   /* the group that picks first in the next batch */
    kd_job *host_head, *host_tail;
    kd_job *gated_head, *gated_tail; /* gated QUEUED jobs that head all their FIFOs, in
                                        arrival order (their slots are theirs alone) */
    uint64_t next_order;
    uint32_t queued;        /* jobs in KD_JOB_QUEUED */
    uint32_t running;       /* jobs in KD_JOB_RUNNING */
    kd_cost_sum runnable;   /* the runnable device jobs together: what the next batch may take */
    kd_sched_group **scratch; /* kd_sched_form's snapshot of the ring */
    bool *skip;
    size_t scratch_cap;
} kd_sched;

int kd_sched_init(kd_sched *s, uint32_t nslots); /* 0 or KP_E_NO_MEMORY */
void kd_sched_destroy(kd_sched *s);              /* the scheduler must hold no job */

/* Queues a job behind everything already queued on its slots.  0 or KP_E_NO_MEMORY. */
int kd_sched_push(kd_sched *s, kd_job *job);

/* Hands out one runnable host job (now RUNNING), or NULL. */
kd_job *kd_sched_next_host(kd_sched *s);

/* Hands out a batch of runnable device jobs (now RUNNING) into out[0..n),
 * n <= max; returns n (0 when nothing is runnable). */
size_t kd_sched_form(kd_sched *s, const kd_sched_limits *lim, kd_job **out, size_t max);

/* Lets a gated QUEUED job run once it heads its FIFOs. */
void kd_sched_ungate(kd_sched *s, kd_job *job);

/* The oldest gated QUEUED job that heads all its FIFOs (nothing ahead of it on
 * its slots), or NULL: one that may be launched before its gate lifts. */
static inline kd_job *kd_sched_gated_head(const kd_sched *s)
{
    return s->gated_head;
}
/* Takes it off that list and leaves it gated (it waits on the host). */
void kd_sched_pass_gated(kd_sched *s, kd_job *job);
/* Hands it out (now RUNNING, its gate lifted): launched ahead of its gate. */
void kd_sched_start_gated(kd_sched *s, kd_job *job);

/* A RUNNING job finished (successfully or not): it leaves its FIFOs. */
void kd_sched_done(kd_sched *s, kd_job *job);
/* A QUEUED job is dropped (its connection closed, or the daemon drains). */
void kd_sched_cancel(kd_sched *s, kd_job *job);

/* Jobs queued or running on a slot. */
static inline uint32_t kd_sched_slot_jobs(const kd_sched *s, uint32_t slot)
{
    return s->fifo[slot].count;
}

#endif /* KDAD_SCHEDULER_H */
