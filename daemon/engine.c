/*
 * engine.c - see engine.h.
 */
#include "engine.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#include "daemon.h"
#include "defaults.h"
#include "exec.h"
#include "log.h"

#define REQ_OF(j) ((kd_req *)((char *)(j) - offsetof(kd_req, job)))
#define RUN_OF(b) ((kd_run *)((char *)(b) - offsetof(kd_run, batch)))

/* One batch on its way through the backend, with the requests it serves: those
 * that added a decode step to it apart, since they may be answered first
 * (kd_engine_steps_done). */
struct kd_run {
    kd_batch batch;
    kd_req **reqs;
    uint32_t nreqs;
    kd_req **step_reqs;   /* not answered yet */
    uint32_t nstep_reqs;
    struct kd_run *next;  /* the engine's runs in flight */
};

static void free_run(kd_run *run)
{
    free(run->batch.seqs);
    free(run->batch.ops);
    free(run->batch.dones);
    free(run->batch.steps);
    free(run->reqs);
    free(run->step_reqs);
    free(run);
}

/* Answers every request of the run not answered yet. */
static void finish_run(kd_run *run, const kd_batch *b)
{
    for (uint32_t i = 0; i < run->nstep_reqs; i++)
        kd_exec_finish(run->step_reqs[i], b);
    run->nstep_reqs = 0;
    for (uint32_t i = 0; i < run->nreqs; i++)
        kd_exec_finish(run->reqs[i], b);
}

/* A run sized for the jobs just formed: every sequence of every job, at
 * most two operations per job (a lazy ZERO before a READ), a done word per job, and at most
 * one decode step per job.  The sequences are not zeroed: each one a job adds is written whole
 * (a 256-sequence decode step, which adds none, would clear 32 KiB for nothing). */
static kd_run *new_run(kd_job **jobs, size_t n)
{
    size_t seqs = 0;
    for (size_t i = 0; i < n; i++)
        seqs += jobs[i]->cost.seqs;
    kd_run *run = calloc(1, sizeof(*run));
    if (!run)
        return NULL;
    run->batch.seqs = malloc((seqs ? seqs : 1) * sizeof(*run->batch.seqs));
    run->batch.ops = calloc(2 * n, sizeof(*run->batch.ops));
    run->batch.dones = calloc(n, sizeof(*run->batch.dones));
    run->batch.steps = calloc(n, sizeof(*run->batch.steps));
    run->reqs = calloc(n, sizeof(*run->reqs));
    run->step_reqs = calloc(n, sizeof(*run->step_reqs));
    if (!run->batch.seqs || !run->batch.ops || !run->batch.dones || !run->batch.steps ||
        !run->reqs || !run->step_reqs) {
        free_run(run);
        return NULL;
    }
    return run;
}

static kd_sched_limits batch_limits(const kd_daemon *d)
{
    const kp_limits *l = &d->session.limits;
    return (kd_sched_limits){l->max_batch_tokens, l->max_batch_seqs,
                             d->backend->info.max_stage_in, d->backend->info.max_stage_out};
}

static void fatal(kd_engine *e, const char *why)
{
    e->on_fatal(e->ctx, why);
}

/* A batch the backend did not take: failed with its error, nothing ran. */
static void submit_failed(kd_batch *b, const kp_error *e)
{
    b->status = KD_BATCH_FAILED;
    b->code = e->code;
    snprintf(b->message, sizeof(b->message), "%.250s", e->message);
}

/* Forms one batch and hands it to the backend; false when nothing was runnable. */
static bool form_and_submit(kd_engine *en)
{
    kd_daemon *d = en->d;
    const kp_limits *l = &d->session.limits;
    size_t cap = l->max_batch_seqs ? l->max_batch_seqs : 1;
    if (cap > en->form_cap) {
        kd_job **v = realloc(en->form_scratch, cap * sizeof(*v));
        if (!v)
            return false; /* retried at the next pump */
        en->form_scratch = v;
        en->form_cap = cap;
    }
    kd_sched_limits lim = batch_limits(d);
    size_t n = kd_sched_form(&d->sched, &lim, en->form_scratch, cap);
    if (n == 0)
        return false;
    uint64_t formed = uv_hrtime();
    kp_error e;
    kd_run *run = new_run(en->form_scratch, n);
    if (!run) {
        kp_fail(&e, KP_E_NO_MEMORY, "no memory to form a batch");
        for (size_t i = 0; i < n; i++) {
            kd_req *r = REQ_OF(en->form_scratch[i]);
            kd_sched_done(&d->sched, &r->job);
            kd_job_left(d, &r->job);
            kd_req_fail(r, &e);
        }
        return true;
    }
    for (size_t i = 0; i < n; i++) {
        kd_req *r = REQ_OF(en->form_scratch[i]);
        uint32_t steps = run->batch.nsteps;
        if (kd_exec_prepare(r, &run->batch) != KD_PREPARE_BATCHED)
            continue;
        if (run->batch.nsteps > steps)
            run->step_reqs[run->nstep_reqs++] = r;
        else
            run->reqs[run->nreqs++] = r;
    }
    if (run->nreqs + run->nstep_reqs == 0) {
        free_run(run);
        return true;
    }
    run->batch.t.formed_ns = formed;
    if (d->backend->inflight == 0)
        en->progress_ns = uv_hrtime();
    if (kd_backend_submit(d->backend, &run->batch, &e) != KP_OK) {
        KD_ERROR("submitting a batch failed: %s", e.message);
        submit_failed(&run->batch, &e);
        finish_run(run, &run->batch);
        free_run(run);
        if (e.code == KP_E_DEVICE_FAILED)
            fatal(en, e.message);
        return true;
    }
    run->next = en->runs;
    en->runs = run;
    en->nruns++;
    d->stats.batches++;
    KD_DEBUG("batch: %u requests, %u sequences, %u steps, %u operations",
             run->nreqs + run->nstep_reqs, run->batch.nseqs, run->batch.nsteps, run->batch.nops);
    return true;
}

/*
 * Gated prefills that head their slots' FIFOs go to the device before their
 * ready words are written, while the backend has free lanes: each is prepared
 * as a batch of its own and queued on a lane behind a device-side wait for
 * its word (backend.h, submit_gated), so the GPU starts it the moment the
 * client's stream writes the word, with no host in between.  A lane is the
 * request's own (stream, launch table, graphs, kernel counters), so a word
 * written late holds back nobody else.  Those a lane cannot take (tensors in
 * host memory, a ready word without a device address, a run-time check that
 * fails, batching.ready_on_device off) wait on the host as before; those that
 * find every lane busy stay first in line for the next free one.
 */
static void launch_gated(kd_engine *en)
{
    kd_daemon *d = en->d;
    kd_backend *b = d->backend;
    kd_job *j;
    while (!d->fatal && b->gated_inflight < b->info.gated_lanes &&
           (j = kd_sched_gated_head(&d->sched))) {
        kd_req *r = REQ_OF(j);
        if (!d->cfg.ready_on_device || !kd_exec_launch_early(r)) {
            kd_sched_pass_gated(&d->sched, j);
            continue;
        }
        uint64_t formed = uv_hrtime();
        kp_error e;
        kd_sched_start_gated(&d->sched, j);
        kd_run *run = new_run(&j, 1);
        if (!run) {
            kp_fail(&e, KP_E_NO_MEMORY, "no memory to form a batch");
            kd_sched_done(&d->sched, j);
            kd_job_left(d, j);
            kd_req_fail(r, &e);
            continue;
        }
        if (kd_exec_prepare(r, &run->batch) != KD_PREPARE_BATCHED) {
            free_run(run); /* answered */
            continue;
        }
        run->reqs[run->nreqs++] = r;
        run->batch.t.formed_ns = formed;
        kd_ready_wait *w = kd_exec_ready_wait(r);
        if (kd_backend_submit_gated(b, &run->batch, &w->word, &e) != KP_OK) {
            KD_ERROR("submitting a gated batch failed: %s", e.message);
            submit_failed(&run->batch, &e);
            kd_exec_finish(r, &run->batch);
            free_run(run);
            if (e.code == KP_E_DEVICE_FAILED)
                fatal(en, e.message);
            continue;
        }
        w->launched = &run->batch;
        run->next = en->runs;
        en->runs = run;
        en->nruns++;
        en->gated_waiting++;
        d->stats.batches++;
    }
}

static kd_hold_policy hold_policy(const kd_daemon *d)
{
    return (kd_hold_policy){d->cfg.hold_while_busy, d->cfg.hold_fill_percent, d->cfg.hold_max_us,
                            d->cfg.gather_us, d->cfg.gather_wave_percent};
}

/* Whether cl's next prefill is likely on its way (hold.h, gathering): it has
 * none waiting, and one running (to be answered) or answered within
 * KD_GATHER_RECENT_US. */
static bool awaited(const kd_client *cl, uint64_t now)
{
    if (cl->closing)
        return false;
    bool running = false;
    for (const kd_req *r = cl->req_head; r; r = r->next) {
        if (r->method != KP_METHOD_PREFILL)
            continue;
        const kd_ready_wait *w = kd_exec_ready_wait((kd_req *)r);
        if (r->job.state == KD_JOB_QUEUED || (w && w->launched && w->set))
            return false; /* waiting, on the host or behind a device-side wait */
        running |= r->job.state == KD_JOB_RUNNING;
    }
    return running || (cl->last_prefill_ns &&
                       now - cl->last_prefill_ns < (uint64_t)KD_GATHER_RECENT_US * 1000u);
}

static bool any_awaited(const kd_engine *en, uint64_t now)
{
    /* Without a job running or a prefill answered lately none can be: no walk
     * over a fleet of idle clients. */
    if (en->d->sched.running == 0 &&
        now - en->last_prefill_ns >= (uint64_t)KD_GATHER_RECENT_US * 1000u)
        return false;
    for (const kd_client *cl = en->d->clients; cl; cl = cl->next) {
        if (awaited(cl, now))
            return true;
    }
    return false;
}

/* Whether the next batch waits: for the device to finish, or for more work (hold.h). */
static bool hold_next(kd_engine *en)
{
    kd_daemon *d = en->d;
    kd_hold_policy p = hold_policy(d);
    kd_sched_limits lim = batch_limits(d);
    const kd_backend_info *bi = &d->backend->info;
    uint64_t now = uv_hrtime();
    bool busy = d->backend->on_device > 0;
    kd_hold_view v = {busy, &d->sched.runnable, &lim, d->session.geometry.heads, bi->wave_chains,
                      bi->paired_chains, false, now};
    /* Only where it matters (the walk over the clients is the costly part),
     * and not while draining: no new work is coming then. */
    if (!busy && p.gather_us && !d->draining && d->sched.runnable.seqs &&
        kd_hold_poor_wave(&p, &v))
        v.awaited = any_awaited(en, now);
    kd_hold_verdict verdict = kd_hold_next(&en->hold, &p, &v);
    if (verdict == KD_HOLD_BEGIN)
        d->stats.batches_held++;
    else if (verdict == KD_HOLD_GATHER_BEGIN)
        d->stats.batches_gathered++;
    return verdict != KD_HOLD_GO;
}

/*
 * A held batch's deadline (batching.hold_max_us, or gather_us).  The check
 * handle looks on every turn of the loop: to the microsecond while the loop
 * is awake (in poll mode it is, while cuda batches run).  The timer wakes a
 * sleeping loop; libuv counts it in whole milliseconds of a clock read once
 * per turn, so it may fire early: the pump then sets it again for what is
 * left.
 */
static void on_hold_check(uv_check_t *h)
{
    kd_engine *en = h->data;
    kd_hold_policy p = hold_policy(en->d);
    if (uv_hrtime() >= kd_hold_deadline(&en->hold, &p))
        kd_engine_pump(en);
}

static void on_hold_timer(uv_timer_t *t)
{
    kd_engine_pump(t->data);
}

static void arm_hold(kd_engine *en)
{
    if (!en->hold.holding || en->d->fatal) {
        uv_timer_stop(&en->hold_timer);
        uv_check_stop(&en->hold_check);
        return;
    }
    kd_hold_policy p = hold_policy(en->d);
    uint64_t now = uv_hrtime(), due = kd_hold_deadline(&en->hold, &p);
    uint64_t ms = due > now ? (due - now + 999999) / 1000000 : 0;
    uv_timer_start(&en->hold_timer, on_hold_timer, ms, 0);
    uv_check_start(&en->hold_check, on_hold_check);
}

void kd_engine_pump(kd_engine *en)
{
    kd_daemon *d = en->d;
    if (en->pumping) {
        en->pump_again = true;
        return;
    }
    en->pumping = true;
    do {
        en->pump_again = false;
        kd_job *j;
        while ((j = kd_sched_next_host(&d->sched)))
            kd_exec_host(REQ_OF(j));
        launch_gated(en);
        while (!d->fatal && d->backend->inflight < d->backend->info.depth && !hold_next(en) &&
               form_and_submit(en))
            ;
    } while (en->pump_again);
    en->pumping = false;
    arm_hold(en);
    en->on_settled(en->ctx);
}

/* A queued job leaves the scheduler unrun, and its request is answered with e. */
static void drop_queued(kd_engine *en, kd_req *r, const kp_error *e)
{
    kd_sched_cancel(&en->d->sched, &r->job);
    kd_job_left(en->d, &r->job);
    kd_req_fail(r, e);
}

static void on_ready_reached(void *ctx, kd_ready_wait *w)
{
    kd_engine *en = ctx;
    kd_req *r = w->owner;
    if (w->launched) { /* already on the device: its end is what remains to learn */
        en->gated_waiting--;
        en->progress_ns = uv_hrtime();
        kd_backend_gated_go(en->d->backend, w->launched);
        return;
    }
    kd_sched_ungate(&en->d->sched, &r->job);
    kd_engine_pump(en);
}

static void on_ready_timed_out(void *ctx, kd_ready_wait *w, const kp_error *e)
{
    kd_engine *en = ctx;
    if (w->launched) { /* called off on the device; its batch completes as failed */
        en->gated_waiting--;
        en->progress_ns = uv_hrtime();
        kd_backend_gated_cancel(en->d->backend, w->launched, e);
        return;
    }
    drop_queued(en, w->owner, e);
    kd_engine_pump(en); /* its slots' FIFOs moved on */
}

bool kd_engine_progressing(const kd_engine *en, uint64_t interval_ns)
{
    return en->nruns == en->gated_waiting || uv_hrtime() - en->progress_ns < interval_ns;
}

void kd_engine_admit(kd_engine *en, kd_req *r)
{
    kd_daemon *d = en->d;
    kp_error e;
    if (d->sched.queued >= d->cfg.max_queued_requests) {
        kp_fail(&e, KP_E_BUSY, "%u requests are waiting for the device "
                "(batching.max_queued_requests); retry later", d->sched.queued);
        kd_req_fail(r, &e);
        return;
    }
    if (kd_exec_admit(r, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    kd_ready_wait *w = kd_exec_ready_wait(r);
    if (w) {
        bool reached;
        kd_ready_configure(&en->ready, d->cfg.ready_spin_us, d->cfg.ready_timeout_ms);
        if (kd_ready_begin(&en->ready, w, &reached, &e) != KP_OK) {
            drop_queued(en, r, &e);
            return;
        }
        if (reached)
            kd_sched_ungate(&d->sched, &r->job);
        /* else gated: the pump may still launch it behind a device-side wait */
    }
    /* May run the request at once (and free r). */
    kd_engine_pump(en);
}

void kd_engine_abandon_queued(kd_engine *en, const kp_error *err)
{
    kd_daemon *d = en->d;
    for (kd_client *cl = d->clients, *cn; cl; cl = cn) {
        kd_client_ref(cl); /* answering its last request must not free it under us */
        for (kd_req *r = cl->req_head, *rn; r; r = rn) {
            rn = r->next;
            if (r->job.state != KD_JOB_QUEUED)
                continue;
            drop_queued(en, r, err);
        }
        cn = cl->next;
        kd_client_unref(cl);
    }
}

/* The device finished its last batch while that one still unstages. */
void kd_engine_device_idle(void *ctx)
{
    kd_engine_pump(ctx);
}

void kd_engine_batch_done(void *ctx, kd_batch *batch)
{
    kd_engine *en = ctx;
    kd_daemon *d = en->d;
    kd_run *run = RUN_OF(batch);
    for (kd_run **p = &en->runs; *p; p = &(*p)->next) {
        if (*p == run) {
            *p = run->next;
            break;
        }
    }
    en->nruns--;
    en->progress_ns = uv_hrtime();
    if (batch->status != KD_BATCH_OK)
        KD_ERROR("batch of %u requests failed (%d): %s", run->nreqs + run->nstep_reqs,
                 (int)batch->status, batch->message);
    /* Work that waited for a free buffer goes to the device before this
     * batch's responses are written, so the device does not idle meanwhile.
     * Its jobs still head their slots' FIFOs: nothing queued behind them on
     * the same slots can form yet. */
    if (batch->status == KD_BATCH_OK)
        kd_engine_pump(en);
    finish_run(run, batch);
    if (batch->status == KD_BATCH_OK) {
        batch->t.replied_ns = uv_hrtime();
        kd_stats_batch(&d->stats, &batch->t);
    }
    kd_transport_stay_awake(&d->net);
    bool is_fatal = batch->status == KD_BATCH_FATAL;
    char why[sizeof(batch->message)];
    snprintf(why, sizeof(why), "%s", batch->message);
    free_run(run);
    if (is_fatal)
        fatal(en, why);
    kd_engine_pump(en);
}

/* The batch's steps ran before the rest of it: their requests are answered now, with their own
 * timing; their slots' next requests may form (a later batch runs after all of this one). */
void kd_engine_steps_done(void *ctx, kd_batch *batch)
{
    kd_engine *en = ctx;
    kd_run *run = RUN_OF(batch);
    if (run->nstep_reqs == 0)
        return;
    kd_batch view = *batch;
    view.t = batch->steps_t;
    for (uint32_t i = 0; i < run->nstep_reqs; i++)
        kd_exec_finish(run->step_reqs[i], &view);
    run->nstep_reqs = 0;
    kd_transport_stay_awake(&en->d->net);
    kd_engine_pump(en);
}

void kd_engine_init(kd_engine *en, kd_daemon *d, void (*on_fatal)(void *ctx, const char *why),
                    void (*on_settled)(void *ctx), void *ctx)
{
    en->d = d;
    en->on_fatal = on_fatal;
    en->on_settled = on_settled;
    en->ctx = ctx;
    uv_timer_init(d->loop, &en->hold_timer);
    uv_check_init(d->loop, &en->hold_check);
    en->hold_timer.data = en->hold_check.data = en;
    kd_ready_init(&en->ready, d->loop, d->backend, on_ready_reached, on_ready_timed_out, en);
    kd_ready_configure(&en->ready, d->cfg.ready_spin_us, d->cfg.ready_timeout_ms);
}

void kd_engine_close(kd_engine *en)
{
    uv_close((uv_handle_t *)&en->hold_timer, NULL);
    uv_close((uv_handle_t *)&en->hold_check, NULL);
    kd_ready_close(&en->ready);
}

void kd_engine_destroy(kd_engine *en)
{
    free(en->form_scratch);
    en->form_scratch = NULL;
}
