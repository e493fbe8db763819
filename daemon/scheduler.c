/*
 * scheduler.c - see scheduler.h.
 *
 * Invariant: a job is runnable (in a group's runnable list or the host list)
 * iff it is QUEUED and blocked == 0, i.e. it heads the FIFO of every slot
 * it names and is not gated.  Only the removal of a FIFO head, or lifting
 * a job's gate, can unblock a job.
 */
#include "scheduler.h"

#include <stdlib.h>
#include <string.h>

#include "kdaproto.h"

int kd_sched_init(kd_sched *s, uint32_t nslots)
{
    memset(s, 0, sizeof(*s));
    s->fifo = calloc(nslots ? nslots : 1, sizeof(*s->fifo));
    if (!s->fifo)
        return KP_E_NO_MEMORY;
    s->nslots = nslots;
    return KP_OK;
}

void kd_sched_destroy(kd_sched *s)
{
    free(s->fifo);
    free(s->scratch);
    free(s->skip);
    memset(s, 0, sizeof(*s));
}

/* ---------------------------------------------------------------------- */
/* Runnable lists                                                         */
/* ---------------------------------------------------------------------- */

static void ring_insert(kd_sched *s, kd_sched_group *g)
{
    if (g->in_ring)
        return;
    g->in_ring = true;
    if (!s->ring) {
        g->prev = g->next = g;
        s->ring = g;
        return;
    }
    /* Join just before the group that picks next: a newcomer waits a full
     * turn behind those already waiting, never jumping ahead of them. */
    g->next = s->ring;
    g->prev = s->ring->prev;
    g->prev->next = g;
    s->ring->prev = g;
}

static void ring_remove(kd_sched *s, kd_sched_group *g)
{
    if (!g->in_ring)
        return;
    g->in_ring = false;
    if (g->next == g) {
        s->ring = NULL;
    } else {
        g->prev->next = g->next;
        g->next->prev = g->prev;
        if (s->ring == g)
            s->ring = g->next;
    }
    g->prev = g->next = NULL;
}

/* Inserts in arrival order: usually at the tail. */
static void list_insert_ordered(kd_job **head, kd_job **tail, kd_job *j)
{
    kd_job *after = *tail;
    while (after && after->order > j->order)
        after = after->prev;
    j->prev = after;
    j->next = after ? after->next : *head;
    if (j->next)
        j->next->prev = j;
    else
        *tail = j;
    if (after)
        after->next = j;
    else
        *head = j;
}

static void list_remove(kd_job **head, kd_job **tail, kd_job *j)
{
    if (j->prev)
        j->prev->next = j->next;
    else
        *head = j->next;
    if (j->next)
        j->next->prev = j->prev;
    else
        *tail = j->prev;
    j->prev = j->next = NULL;
}

static void add_cost(kd_cost_sum *sum, const kd_job_cost *c)
{
    sum->tokens += c->tokens;
    sum->seqs += c->seqs;
    sum->stage_in += c->stage_in;
    sum->stage_out += c->stage_out;
}

static void sub_cost(kd_cost_sum *sum, const kd_job_cost *c)
{
    sum->tokens -= c->tokens;
    sum->seqs -= c->seqs;
    sum->stage_in -= c->stage_in;
    sum->stage_out -= c->stage_out;
}

/* A gated job now heads all its FIFOs (only its gate blocks it). */
static void add_waiting_head(kd_sched *s, kd_job *j)
{
    list_insert_ordered(&s->gated_head, &s->gated_tail, j);
    j->waiting_head = true;
}

static void drop_waiting_head(kd_sched *s, kd_job *j)
{
    if (!j->waiting_head)
        return;
    list_remove(&s->gated_head, &s->gated_tail, j);
    j->waiting_head = false;
}

static void make_runnable(kd_sched *s, kd_job *j)
{
    if (j->host) {
        list_insert_ordered(&s->host_head, &s->host_tail, j);
        return;
    }
    list_insert_ordered(&j->group->rhead, &j->group->rtail, j);
    ring_insert(s, j->group);
    add_cost(&s->runnable, &j->cost);
}

/* Takes a runnable job off its list (it is about to run or be dropped). */
static void take_runnable(kd_sched *s, kd_job *j)
{
    if (j->host) {
        list_remove(&s->host_head, &s->host_tail, j);
        return;
    }
    kd_sched_group *g = j->group;
    list_remove(&g->rhead, &g->rtail, j);
    if (!g->rhead)
        ring_remove(s, g);
    sub_cost(&s->runnable, &j->cost);
}

/* ---------------------------------------------------------------------- */
/* FIFOs                                                                  */
/* ---------------------------------------------------------------------- */

int kd_sched_push(kd_sched *s, kd_job *j)
{
    j->nodes = calloc(j->nslots, sizeof(*j->nodes));
    if (!j->nodes)
        return KP_E_NO_MEMORY;
    j->order = s->next_order++;
    j->blocked = j->gated;
    j->state = KD_JOB_QUEUED;
    j->waiting_head = false;
    j->prev = j->next = NULL;
    for (uint32_t i = 0; i < j->nslots; i++) {
        kd_fifo *f = &s->fifo[j->slots[i]];
        kd_job_node *n = &j->nodes[i];
        n->job = j;
        n->slot = j->slots[i];
        n->prev = f->tail;
        n->next = NULL;
        if (f->tail) {
            f->tail->next = n;
            j->blocked++;
        } else {
            f->head = n;
        }
        f->tail = n;
        f->count++;
    }
    s->queued++;
    if (j->blocked == 0)
        make_runnable(s, j);
    else if (j->gated && j->blocked == 1 && !j->host)
        add_waiting_head(s, j);
    return KP_OK;
}

/* Removes a job from every FIFO; the new heads may become runnable. */
static void leave_fifos(kd_sched *s, kd_job *j)
{
    for (uint32_t i = 0; i < j->nslots; i++) {
        kd_job_node *n = &j->nodes[i];
        kd_fifo *f = &s->fifo[n->slot];
        bool was_head = f->head == n;
        if (n->prev)
            n->prev->next = n->next;
        else
            f->head = n->next;
        if (n->next)
            n->next->prev = n->prev;
        else
            f->tail = n->prev;
        f->count--;
        if (was_head && f->head) {
            kd_job *next = f->head->job;
            if (--next->blocked == 0 && next->state == KD_JOB_QUEUED)
                make_runnable(s, next);
            else if (next->blocked == 1 && next->gated && !next->host &&
                     next->state == KD_JOB_QUEUED)
                add_waiting_head(s, next);
        }
    }
    free(j->nodes);
    j->nodes = NULL;
    j->state = KD_JOB_IDLE;
}

void kd_sched_ungate(kd_sched *s, kd_job *j)
{
    if (!j->gated || j->state != KD_JOB_QUEUED)
        return;
    j->gated = false;
    drop_waiting_head(s, j);
    if (--j->blocked == 0)
        make_runnable(s, j);
}

void kd_sched_pass_gated(kd_sched *s, kd_job *j)
{
    drop_waiting_head(s, j);
}

void kd_sched_start_gated(kd_sched *s, kd_job *j)
{
    drop_waiting_head(s, j);
    j->gated = false;
    j->blocked = 0;
    j->state = KD_JOB_RUNNING;
    s->queued--;
    s->running++;
}

void kd_sched_done(kd_sched *s, kd_job *j)
{
    s->running--;
    leave_fifos(s, j);
}

void kd_sched_cancel(kd_sched *s, kd_job *j)
{
    drop_waiting_head(s, j);
    if (j->blocked == 0)
        take_runnable(s, j);
    s->queued--;
    leave_fifos(s, j);
}

static void start(kd_sched *s, kd_job *j)
{
    take_runnable(s, j);
    j->state = KD_JOB_RUNNING;
    s->queued--;
    s->running++;
}

kd_job *kd_sched_next_host(kd_sched *s)
{
    kd_job *j = s->host_head;
    if (j)
        start(s, j);
    return j;
}

/* ---------------------------------------------------------------------- */
/* Batch formation                                                        */
/* ---------------------------------------------------------------------- */

static bool fits(const kd_job_cost *sum, const kd_job_cost *c, const kd_sched_limits *lim)
{
    return (uint64_t)sum->tokens + c->tokens <= lim->max_tokens &&
           (uint64_t)sum->seqs + c->seqs <= lim->max_seqs &&
           sum->stage_in + c->stage_in <= lim->max_stage_in &&
           sum->stage_out + c->stage_out <= lim->max_stage_out;
}

/* Copies the ring, starting at the group that picks first, into scratch. */
static size_t snapshot_ring(kd_sched *s)
{
    size_t n = 0;
    kd_sched_group *g = s->ring;
    do {
        if (n == s->scratch_cap) {
            size_t cap = s->scratch_cap ? 2 * s->scratch_cap : 64;
            kd_sched_group **groups = realloc(s->scratch, cap * sizeof(*groups));
            if (!groups)
                return n; /* the groups left out simply wait for the next batch */
            s->scratch = groups;
            bool *skip = realloc(s->skip, cap * sizeof(*skip));
            if (!skip)
                return n;
            s->skip = skip;
            s->scratch_cap = cap;
        }
        s->scratch[n++] = g;
        g = g->next;
    } while (g != s->ring);
    return n;
}

size_t kd_sched_form(kd_sched *s, const kd_sched_limits *lim, kd_job **out, size_t max)
{
    if (!s->ring || max == 0)
        return 0;
    kd_sched_group *first = s->ring;
    size_t ngroups = snapshot_ring(s);
    if (ngroups == 0)
        return 0;
    memset(s->skip, 0, ngroups * sizeof(*s->skip));
    kd_job_cost sum = {0, 0, 0, 0};
    size_t n = 0;
    bool progress = true;
    /* Rounds: each group offers its oldest runnable job once per round.  A
     * group whose oldest job does not fit sits the batch out, so its later
     * jobs never overtake it. */
    while (progress && n < max) {
        progress = false;
        for (size_t i = 0; i < ngroups && n < max; i++) {
            kd_job *j = s->skip[i] ? NULL : s->scratch[i]->rhead;
            if (!j || (n > 0 && !fits(&sum, &j->cost, lim))) {
                s->skip[i] = true;
                continue;
            }
            start(s, j);
            out[n++] = j;
            sum.tokens += j->cost.tokens;
            sum.seqs += j->cost.seqs;
            sum.stage_in += j->cost.stage_in;
            sum.stage_out += j->cost.stage_out;
            progress = true;
        }
    }
    /* The next batch starts one group further on. */
    if (s->ring && first->in_ring && s->ring == first)
        s->ring = first->next;
    return n;
}
