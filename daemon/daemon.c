/*
 * daemon.c - see daemon.h.
 */
#include "daemon.h"

#include <errno.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "defaults.h"
#include "dispatch.h"
#include "exec.h"
#include "log.h"

#define REQ_OF(j) ((kd_req *)((char *)(j) - offsetof(kd_req, job)))
#define RUN_OF(b) ((kd_run *)((char *)(b) - offsetof(kd_run, batch)))

static void close_handles(kd_daemon *d);
static void maybe_finish_drain(kd_daemon *d);

static uint64_t random_u64(void)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof(v), 0) != (ssize_t)sizeof(v))
        v = uv_hrtime() ^ ((uint64_t)getpid() << 32); /* only differs per start anyway */
    return v;
}

/* ---------------------------------------------------------------------- */
/* The engine                                                             */
/* ---------------------------------------------------------------------- */

void kd_daemon_job_left(kd_daemon *d, const kd_job *job)
{
    for (uint32_t i = 0; i < job->nslots; i++) {
        uint32_t s = job->slots[i];
        if (kd_pool_slot(&d->pool, s)->retiring && kd_sched_slot_jobs(&d->sched, s) == 0)
            kd_pool_release(&d->pool, s);
    }
}

static void free_run(kd_run *run)
{
    free(run->batch.seqs);
    free(run->batch.ops);
    free(run->reqs);
    free(run);
}

/* A run sized for the jobs just formed: every sequence of every job, and at
 * most two operations per job (a lazy ZERO before a READ). */
static kd_run *new_run(kd_job **jobs, size_t n)
{
    size_t seqs = 0;
    for (size_t i = 0; i < n; i++)
        seqs += jobs[i]->cost.seqs;
    kd_run *run = calloc(1, sizeof(*run));
    if (!run)
        return NULL;
    run->batch.seqs = calloc(seqs ? seqs : 1, sizeof(*run->batch.seqs));
    run->batch.ops = calloc(2 * n, sizeof(*run->batch.ops));
    run->reqs = calloc(n, sizeof(*run->reqs));
    if (!run->batch.seqs || !run->batch.ops || !run->reqs) {
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

/* Forms one batch and hands it to the backend; false when nothing was runnable. */
static bool form_and_submit(kd_daemon *d)
{
    const kp_limits *l = &d->session.limits;
    size_t cap = l->max_batch_seqs ? l->max_batch_seqs : 1;
    if (cap > d->form_cap) {
        kd_job **v = realloc(d->form_scratch, cap * sizeof(*v));
        if (!v)
            return false; /* retried at the next pump */
        d->form_scratch = v;
        d->form_cap = cap;
    }
    kd_sched_limits lim = batch_limits(d);
    size_t n = kd_sched_form(&d->sched, &lim, d->form_scratch, cap);
    if (n == 0)
        return false;
    uint64_t formed = uv_hrtime();
    kp_error e;
    kd_run *run = new_run(d->form_scratch, n);
    if (!run) {
        kp_fail(&e, KP_E_NO_MEMORY, "no memory to form a batch");
        for (size_t i = 0; i < n; i++) {
            kd_req *r = REQ_OF(d->form_scratch[i]);
            kd_sched_done(&d->sched, &r->job);
            kd_daemon_job_left(d, &r->job);
            kd_req_fail(r, &e);
        }
        return true;
    }
    for (size_t i = 0; i < n; i++)
        kd_exec_prepare(REQ_OF(d->form_scratch[i]), run);
    if (run->nreqs == 0) {
        free_run(run);
        return true;
    }
    run->batch.t.formed_ns = formed;
    if (d->backend->inflight == 0)
        d->progress_ns = uv_hrtime();
    if (kd_backend_submit(d->backend, &run->batch, &e) != KP_OK) {
        KD_ERROR("submitting a batch failed: %s", e.message);
        run->batch.status = KD_BATCH_FAILED;
        run->batch.code = e.code;
        snprintf(run->batch.message, sizeof(run->batch.message), "%.250s", e.message);
        for (uint32_t i = 0; i < run->nreqs; i++)
            kd_exec_finish(run->reqs[i], &run->batch);
        free_run(run);
        if (e.code == KP_E_DEVICE_FAILED)
            kd_daemon_fatal(d, e.message);
        return true;
    }
    run->next = d->runs;
    d->runs = run;
    d->stats.batches++;
    KD_DEBUG("batch: %u requests, %u sequences, %u operations", run->nreqs, run->batch.nseqs,
             run->batch.nops);
    return true;
}

static kd_hold_policy hold_policy(const kd_daemon *d)
{
    return (kd_hold_policy){d->cfg.hold_while_busy, d->cfg.hold_fill_percent, d->cfg.hold_max_us,
                            d->cfg.gather_us, d->cfg.gather_wave_percent};
}

/* Whether c's next prefill is likely on its way (hold.h, gathering): it has
 * none waiting, and one running (to be answered) or answered within
 * KD_GATHER_RECENT_US. */
static bool awaited(const kd_conn *c, uint64_t now)
{
    if (c->closing)
        return false;
    bool running = false;
    for (const kd_req *r = c->req_head; r; r = r->next) {
        if (r->method != KP_METHOD_PREFILL)
            continue;
        if (r->job.state == KD_JOB_QUEUED)
            return false;
        running |= r->job.state == KD_JOB_RUNNING;
    }
    return running ||
           (c->last_prefill_ns && now - c->last_prefill_ns < (uint64_t)KD_GATHER_RECENT_US * 1000u);
}

static bool any_awaited(const kd_daemon *d, uint64_t now)
{
    /* Without a job running or a prefill answered lately none can be: no walk
     * over a fleet of idle connections. */
    if (d->sched.running == 0 &&
        now - d->last_prefill_ns >= (uint64_t)KD_GATHER_RECENT_US * 1000u)
        return false;
    for (const kd_conn *c = d->conns; c; c = c->next) {
        if (awaited(c, now))
            return true;
    }
    return false;
}

/* Whether the next batch waits: for the device to finish, or for more work (hold.h). */
static bool hold_next(kd_daemon *d)
{
    kd_hold_policy p = hold_policy(d);
    kd_sched_limits lim = batch_limits(d);
    const kd_backend_info *bi = &d->backend->info;
    uint64_t now = uv_hrtime();
    bool busy = d->backend->on_device > 0;
    kd_hold_view v = {busy, &d->sched.runnable, &lim, d->session.geometry.heads, bi->wave_chains,
                      bi->paired_chains, false, now};
    /* Only where it matters (the walk over the connections is the costly
     * part), and not while draining: no new work is coming then. */
    if (!busy && p.gather_us && !d->draining && d->sched.runnable.seqs &&
        kd_hold_poor_wave(&p, &v))
        v.awaited = any_awaited(d, now);
    kd_hold_verdict verdict = kd_hold_next(&d->hold, &p, &v);
    if (verdict == KD_HOLD_BEGIN)
        d->stats.batches_held++;
    else if (verdict == KD_HOLD_GATHER_BEGIN)
        d->stats.batches_gathered++;
    return verdict != KD_HOLD_GO;
}

/*
 * A held batch's deadline (batching.hold_max_us, or gather_us).  The check handle looks on
 * every turn of the loop: to the microsecond while the loop is awake (in
 * poll mode it is, while cuda batches run).  The timer wakes a sleeping
 * loop; libuv counts it in whole milliseconds of a clock read once per
 * turn, so it may fire early: the pump then sets it again for what is left.
 */
static void on_hold_check(uv_check_t *h)
{
    kd_daemon *d = h->data;
    kd_hold_policy p = hold_policy(d);
    if (uv_hrtime() >= kd_hold_deadline(&d->hold, &p))
        kd_daemon_pump(d);
}

static void on_hold_timer(uv_timer_t *t)
{
    kd_daemon_pump(t->data);
}

static void arm_hold(kd_daemon *d)
{
    if (!d->hold.holding || d->fatal) {
        uv_timer_stop(&d->hold_timer);
        uv_check_stop(&d->hold_check);
        return;
    }
    kd_hold_policy p = hold_policy(d);
    uint64_t now = uv_hrtime(), due = kd_hold_deadline(&d->hold, &p);
    uint64_t ms = due > now ? (due - now + 999999) / 1000000 : 0;
    uv_timer_start(&d->hold_timer, on_hold_timer, ms, 0);
    uv_check_start(&d->hold_check, on_hold_check);
}

void kd_daemon_pump(kd_daemon *d)
{
    if (d->pumping) {
        d->pump_again = true;
        return;
    }
    d->pumping = true;
    do {
        d->pump_again = false;
        kd_job *j;
        while ((j = kd_sched_next_host(&d->sched)))
            kd_exec_host(REQ_OF(j));
        while (!d->fatal && d->backend->inflight < d->backend->info.depth && !hold_next(d) &&
               form_and_submit(d))
            ;
    } while (d->pump_again);
    d->pumping = false;
    arm_hold(d);
    maybe_finish_drain(d);
}

/* The device finished its last batch while that one still unstages. */
static void on_device_idle(void *ctx)
{
    kd_daemon_pump(ctx);
}

/*
 * After answering a batch the loop polls for batching.spin_us instead of
 * sleeping in epoll: a client that sends its next request as soon as it has
 * the answer (a serving stack's next layer, a closed-loop benchmark) is read
 * at once instead of after a wake-up, which costs tens of microseconds on a
 * virtual machine.  Frame rings (conn.h) are read by this polling alone while
 * it lasts; before the loop sleeps, each ring learns what its connection
 * waits for, so that its client rings the doorbell.
 */
static void poll_rings(kd_daemon *d)
{
    if (d->nrings == 0)
        return;
    for (kd_conn *c = d->conns, *next; c; c = next) {
        kd_conn_ref(c);
        kd_conn_ring_poll(c);
        next = c->next;
        kd_conn_unref(c);
    }
}

/* Publishes every ring's wants; false (and awake again) if one has work. */
static bool rings_sleep(kd_daemon *d)
{
    if (d->nrings == 0)
        return true;
    bool quiet = true;
    for (kd_conn *c = d->conns; c; c = c->next)
        quiet = kd_conn_ring_sleep(c, true) && quiet;
    if (!quiet) {
        for (kd_conn *c = d->conns; c; c = c->next)
            kd_conn_ring_sleep(c, false);
    }
    return quiet;
}

static void on_spin(uv_idle_t *h)
{
    kd_daemon *d = h->data;
    poll_rings(d);
    if (uv_hrtime() >= d->spin_until_ns && rings_sleep(d))
        uv_idle_stop(h);
}

bool kd_daemon_awake(const kd_daemon *d)
{
    return uv_is_active((const uv_handle_t *)&d->spin);
}

void kd_daemon_stay_awake(kd_daemon *d)
{
    if (d->cfg.spin_us == 0 || d->stopping)
        return;
    d->spin_until_ns = uv_hrtime() + (uint64_t)d->cfg.spin_us * 1000u;
    if (kd_daemon_awake(d))
        return;
    for (kd_conn *c = d->conns; c && d->nrings; c = c->next)
        kd_conn_ring_sleep(c, false);
    uv_idle_start(&d->spin, on_spin);
}

static void on_batch_done(void *ctx, kd_batch *batch)
{
    kd_daemon *d = ctx;
    kd_run *run = RUN_OF(batch);
    for (kd_run **p = &d->runs; *p; p = &(*p)->next) {
        if (*p == run) {
            *p = run->next;
            break;
        }
    }
    d->progress_ns = uv_hrtime();
    if (batch->status != KD_BATCH_OK)
        KD_ERROR("batch of %u requests failed (%d): %s", run->nreqs, (int)batch->status,
                 batch->message);
    /* Work that waited for a free buffer goes to the device before this
     * batch's responses are written, so the device does not idle meanwhile.
     * Its jobs still head their slots' FIFOs: nothing queued behind them on
     * the same slots can form yet. */
    if (batch->status == KD_BATCH_OK)
        kd_daemon_pump(d);
    for (uint32_t i = 0; i < run->nreqs; i++)
        kd_exec_finish(run->reqs[i], batch);
    if (batch->status == KD_BATCH_OK) {
        batch->t.replied_ns = uv_hrtime();
        kd_stats_batch(&d->stats, &batch->t);
    }
    kd_daemon_stay_awake(d);
    bool fatal = batch->status == KD_BATCH_FATAL;
    char why[sizeof(batch->message)];
    snprintf(why, sizeof(why), "%s", batch->message);
    free_run(run);
    if (fatal)
        kd_daemon_fatal(d, why);
    kd_daemon_pump(d);
}

/* ---------------------------------------------------------------------- */
/* Input processing                                                       */
/* ---------------------------------------------------------------------- */

static void on_input_idle(uv_idle_t *h)
{
    kd_daemon *d = h->data;
    kd_conn *list = d->input_head;
    d->input_head = NULL;
    while (list) {
        kd_conn *c = list;
        list = c->input_next;
        c->input_queued = false;
        kd_conn_process_input(c);
        kd_conn_unref(c);
    }
    if (!d->input_head)
        uv_idle_stop(&d->input_idle);
}

void kd_daemon_queue_input(kd_daemon *d, kd_conn *c)
{
    if (c->input_queued)
        return;
    c->input_queued = true;
    kd_conn_ref(c);
    c->input_next = d->input_head;
    d->input_head = c;
    uv_idle_start(&d->input_idle, on_input_idle);
}

/* ---------------------------------------------------------------------- */
/* Gauges, metrics, watchdog, housekeeping                                */
/* ---------------------------------------------------------------------- */

void kd_daemon_gauges(const kd_daemon *d, kd_stats_gauges *g)
{
    memset(g, 0, sizeof(*g));
    g->slots_total = d->pool.nslots;
    g->slots_used = kd_pool_used(&d->pool);
    g->slots_lost = d->pool.nlost;
    g->layers = d->layers.n;
    for (const kd_conn *c = d->conns; c; c = c->next) {
        g->regions += c->regions.count;
        g->rings += c->ring_on && !c->closing;
    }
    g->queued = d->sched.queued;
    g->running = d->backend->inflight;
}

typedef struct metrics_job {
    uv_work_t work;
    kd_daemon *d;
    char *text;
    char *path;
    int err;
} metrics_job;

/* Worker thread: write to a temporary file and rename it over the old one,
 * so readers never see half a file. */
static void metrics_write(uv_work_t *w)
{
    metrics_job *m = w->data;
    size_t n = strlen(m->path) + 8;
    char *tmp = malloc(n);
    if (!tmp) {
        m->err = ENOMEM;
        return;
    }
    snprintf(tmp, n, "%s.tmp", m->path);
    FILE *f = fopen(tmp, "w");
    if (!f || fputs(m->text, f) == EOF || fclose(f) != 0 || rename(tmp, m->path) != 0)
        m->err = errno ? errno : EIO;
    if (m->err)
        unlink(tmp);
    free(tmp);
}

static void metrics_written(uv_work_t *w, int status)
{
    metrics_job *m = w->data;
    m->d->metrics_writing = false;
    if (m->err)
        KD_WARN("metrics: cannot write %s: %s", m->path, strerror(m->err));
    free(m->text);
    free(m->path);
    free(m);
}

static void on_metrics(uv_timer_t *t)
{
    kd_daemon *d = t->data;
    if (d->metrics_writing || !d->cfg.prometheus_file[0])
        return;
    kd_stats_gauges g;
    kd_daemon_gauges(d, &g);
    metrics_job *m = calloc(1, sizeof(*m));
    if (!m)
        return;
    m->d = d;
    m->work.data = m;
    m->text = kd_stats_prometheus(&d->stats, &g, uv_hrtime());
    m->path = strdup(d->cfg.prometheus_file);
    if (!m->text || !m->path || uv_queue_work(d->loop, &m->work, metrics_write, metrics_written)) {
        free(m->text);
        free(m->path);
        free(m);
        return;
    }
    d->metrics_writing = true;
}

static void start_metrics(kd_daemon *d)
{
    uv_timer_stop(&d->metrics);
    if (d->cfg.prometheus_file[0])
        uv_timer_start(&d->metrics, on_metrics, 0, d->cfg.metrics_interval_ms);
}

static bool watchdog_progress(void *arg, uint64_t interval_ns)
{
    kd_daemon *d = arg;
    return !d->runs || uv_hrtime() - d->progress_ns < interval_ns;
}

/* Answers every request still waiting for the device with e. */
static void abandon_queued(kd_daemon *d, const kp_error *e)
{
    for (kd_conn *c = d->conns, *cn; c; c = cn) {
        cn = c->next;
        kd_conn_ref(c);
        for (kd_req *r = c->req_head, *rn; r; r = rn) {
            rn = r->next;
            if (r->job.state == KD_JOB_QUEUED)
                kd_exec_abandon(r, e);
        }
        kd_conn_unref(c);
    }
}

static void on_housekeeping(uv_timer_t *t)
{
    kd_daemon *d = t->data;
    uint64_t now = uv_hrtime();
    for (kd_conn *c = d->conns, *next; c; c = next) {
        next = c->next;
        kd_conn_housekeeping(c, now);
    }
    kd_server_tick(&d->server);
    if (d->draining && !d->stopping && now > d->drain_deadline && d->sched.queued) {
        kp_error e;
        kp_fail(&e, KP_E_SHUTTING_DOWN, "the daemon is shutting down: drain_timeout_ms passed "
                "before this request reached the device");
        KD_WARN("drain timeout: answering %u waiting requests SHUTTING_DOWN", d->sched.queued);
        abandon_queued(d, &e);
        maybe_finish_drain(d);
    }
}

/* ---------------------------------------------------------------------- */
/* Drain, fatal, stop                                                     */
/* ---------------------------------------------------------------------- */

static void maybe_finish_drain(kd_daemon *d)
{
    if (!d->draining || d->stopping || d->pumping)
        return;
    if (d->sched.queued || d->sched.running || d->runs)
        return;
    d->stopping = true;
    kp_error e;
    if (d->fatal)
        kp_fail(&e, KP_E_DEVICE_FAILED, "the device failed; the daemon exits and restarts with "
                "an empty pool");
    else
        kp_fail(&e, KP_E_SHUTTING_DOWN, "the daemon is shutting down");
    KD_NOTICE("%s: closing %u connections", d->fatal ? "device failure" : "drained", d->nconns);
    for (kd_conn *c = d->conns, *next; c; c = next) {
        next = c->next;
        kd_conn_close(c, d->fatal ? KD_DISC_DEVICE_FAILED : KD_DISC_SHUTDOWN, &e);
    }
    if (!d->conns)
        close_handles(d);
}

void kd_daemon_conn_freed(kd_daemon *d)
{
    if (d->stopping && !d->conns)
        close_handles(d);
}

void kd_daemon_drain(kd_daemon *d)
{
    if (d->draining)
        return;
    d->draining = true;
    d->drain_deadline = uv_hrtime() + (uint64_t)d->cfg.drain_timeout_ms * 1000000;
    KD_NOTICE("draining: %u requests waiting, %u batches running", d->sched.queued,
              d->backend->inflight);
    kd_notify_stopping();
    kd_server_close(&d->server);
    kd_daemon_pump(d); /* a gathered batch goes now: no new work is coming (hold.h) */
}

void kd_daemon_fatal(kd_daemon *d, const char *why)
{
    if (d->fatal)
        return;
    d->fatal = true;
    d->exit_code = KD_EXIT_FAILURE;
    KD_ERROR("device failure: %s; failing all work and exiting", why);
    kp_error e;
    kp_fail(&e, KP_E_DEVICE_FAILED, "the device failed before this request ran: %s", why);
    abandon_queued(d, &e);
    if (!d->draining) {
        d->draining = true;
        d->drain_deadline = uv_hrtime();
        kd_notify_stopping();
        kd_server_close(&d->server);
    }
    maybe_finish_drain(d);
}

static void close_handles(kd_daemon *d)
{
    if (d->handles_closed)
        return;
    d->handles_closed = true;
    kd_server_close(&d->server);
    if (d->signals_on) {
        uv_close((uv_handle_t *)&d->sigterm, NULL);
        uv_close((uv_handle_t *)&d->sigint, NULL);
        uv_close((uv_handle_t *)&d->sighup, NULL);
    }
    uv_close((uv_handle_t *)&d->housekeeping, NULL);
    uv_close((uv_handle_t *)&d->metrics, NULL);
    uv_close((uv_handle_t *)&d->input_idle, NULL);
    uv_close((uv_handle_t *)&d->spin, NULL);
    uv_close((uv_handle_t *)&d->hold_timer, NULL);
    uv_close((uv_handle_t *)&d->hold_check, NULL);
    if (d->watchdog_on)
        kd_watchdog_close(&d->watchdog);
    kd_layers_destroy(&d->layers);
    kd_backend_destroy(d->backend);
    d->backend = NULL;
    KD_INFO("stopped");
}

/* ---------------------------------------------------------------------- */
/* Reload                                                                 */
/* ---------------------------------------------------------------------- */

static bool str_differs(const char *a, const char *b)
{
    return strcmp(a ? a : "", b ? b : "") != 0;
}

#define SWAP(field)                       \
    do {                                  \
        __typeof__(nc->field) t_ = nc->field; \
        nc->field = old->field;           \
        old->field = t_;                  \
    } while (0)

/* Keeps the values that only a restart can change, warning about each one
 * the new file changes. */
static void keep_restart_only(kd_config *nc, kd_config *old)
{
    const struct { const char *key; bool changed; } keys[] = {
        {"socket.path", str_differs(nc->socket_path, old->socket_path)},
        {"socket.mode", nc->socket_mode != old->socket_mode},
        {"socket.group", str_differs(nc->socket_group, old->socket_group)},
        {"backend", nc->backend != old->backend},
        {"device", str_differs(nc->device, old->device)},
        {"cuda_completion", nc->cuda_completion != old->cuda_completion},
        {"cpu_threads", nc->cpu_threads != old->cpu_threads},
        {"heads", nc->heads != old->heads},
        {"slots", nc->slots != old->slots},
        {"state_dtype", nc->state_dtype != old->state_dtype},
        {"slots_persist", nc->slots_persist != old->slots_persist},
        {"limits.max_frame_bytes", nc->limits.max_frame_bytes != old->limits.max_frame_bytes},
        {"limits.max_inline_bytes", nc->limits.max_inline_bytes != old->limits.max_inline_bytes},
        {"batching.graph_buckets",
         nc->ngraph_buckets != old->ngraph_buckets ||
             memcmp(nc->graph_buckets, old->graph_buckets,
                    nc->ngraph_buckets * sizeof(nc->graph_buckets[0])) != 0},
        {"transports.shm", nc->transport_shm != old->transport_shm},
        {"transports.cuda_ipc", nc->transport_cuda_ipc != old->transport_cuda_ipc},
    };
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        if (keys[i].changed)
            KD_WARN("reload: %s changed; it takes effect at the next restart", keys[i].key);
    }
    SWAP(socket_path);
    SWAP(socket_mode);
    SWAP(socket_group);
    SWAP(backend);
    SWAP(device);
    SWAP(cuda_completion);
    SWAP(cpu_threads);
    SWAP(heads);
    SWAP(slots);
    SWAP(state_dtype);
    SWAP(slots_persist);
    SWAP(limits.max_frame_bytes);
    SWAP(limits.max_inline_bytes);
    uint32_t buckets[KD_MAX_GRAPH_BUCKETS];
    memcpy(buckets, nc->graph_buckets, sizeof(buckets));
    memcpy(nc->graph_buckets, old->graph_buckets, sizeof(buckets));
    memcpy(old->graph_buckets, buckets, sizeof(buckets));
    SWAP(ngraph_buckets);
    SWAP(transport_shm);
    SWAP(transport_cuda_ipc);
}
#undef SWAP

int kd_daemon_reload(kd_daemon *d)
{
    char err[KD_CONFIG_ERR_MAX];
    kd_config nc;
    kd_notify_reloading();
    KD_NOTICE("reloading %s", d->config_path ? d->config_path : "the built-in configuration");
    int rc = kd_config_load(&nc, d->config_path, &d->ov, err, sizeof(err));
    if (rc == 0) {
        /* The limits as they will be: the restart-only ones keep their values. */
        kp_limits next = nc.limits;
        next.max_frame_bytes = d->cfg.limits.max_frame_bytes;
        next.max_inline_bytes = d->cfg.limits.max_inline_bytes;
        kp_error kerr;
        if (nc.limits.max_batch_seqs > d->start_max_batch_seqs) {
            snprintf(err, sizeof(err), "limits.max_batch_seqs: %u is above %u, the value at "
                     "start (the launch buffers are sized for it); restart to raise it",
                     nc.limits.max_batch_seqs, d->start_max_batch_seqs);
            rc = -1;
        } else if (kp_limits_check(&next, &kerr) != KP_OK) {
            snprintf(err, sizeof(err), "limits.%.480s", kerr.message);
            rc = -1;
        } else if (kd_layers_sync_config(&d->layers, &nc, err, sizeof(err)) != 0) {
            rc = -1;
        }
        if (rc != 0)
            kd_config_free(&nc);
    }
    if (rc != 0) {
        KD_ERROR("reload failed, the configuration in force stays: %s", err);
        kd_notify_ready("serving (the last reload failed)");
        return -1;
    }
    keep_restart_only(&nc, &d->cfg);
    kd_config_free(&d->cfg);
    d->cfg = nc;
    d->session.limits = d->cfg.limits;
    kd_log_set_level(d->cfg.log_level);
    start_metrics(d);
    KD_NOTICE("reloaded: log level %s, %u layers", kd_log_level_name(d->cfg.log_level),
              d->layers.n);
    kd_notify_ready("serving");
    kd_daemon_pump(d); /* the batch limits may have changed */
    return 0;
}

/* ---------------------------------------------------------------------- */
/* Signals                                                                */
/* ---------------------------------------------------------------------- */

static void on_signal(uv_signal_t *h, int signum)
{
    kd_daemon *d = h->data;
    if (signum == SIGHUP) {
        kd_daemon_reload(d);
        return;
    }
    if (d->draining) {
        KD_NOTICE("%s while draining: still finishing admitted work", strsignal(signum));
        return;
    }
    KD_NOTICE("%s: draining", strsignal(signum));
    kd_daemon_drain(d);
}

void kd_daemon_handle_signals(kd_daemon *d)
{
    uv_signal_init(d->loop, &d->sigterm);
    uv_signal_init(d->loop, &d->sigint);
    uv_signal_init(d->loop, &d->sighup);
    d->sigterm.data = d->sigint.data = d->sighup.data = d;
    uv_signal_start(&d->sigterm, on_signal, SIGTERM);
    uv_signal_start(&d->sigint, on_signal, SIGINT);
    uv_signal_start(&d->sighup, on_signal, SIGHUP);
    d->signals_on = true;
}

/* ---------------------------------------------------------------------- */
/* Start and end                                                          */
/* ---------------------------------------------------------------------- */

/* batching.graph_buckets, or powers of two up to (and covering) max_batch_seqs. */
static uint32_t buckets(const kd_config *cfg, uint32_t *out)
{
    if (cfg->ngraph_buckets) {
        memcpy(out, cfg->graph_buckets, cfg->ngraph_buckets * sizeof(*out));
        return cfg->ngraph_buckets;
    }
    uint32_t n = 0;
    for (uint64_t b = 1; n < KD_MAX_GRAPH_BUCKETS; b *= 2) {
        out[n++] = (uint32_t)b;
        if (b >= cfg->limits.max_batch_seqs)
            break;
    }
    return n;
}

int kd_daemon_init(kd_daemon *d, uv_loop_t *loop, kd_config *cfg, const char *config_path,
                   const kd_config_overrides *ov, char *err, size_t errlen)
{
    memset(d, 0, sizeof(*d));
    d->server.fd = -1;
    d->loop = loop;
    d->cfg = *cfg;
    memset(cfg, 0, sizeof(*cfg));
    d->config_path = config_path;
    if (ov)
        d->ov = *ov;
    d->instance = random_u64();
    kd_stats_init(&d->stats, uv_hrtime());
    kd_quota_init(&d->quota);
    d->session.geometry = (kp_geometry){d->cfg.heads, KP_HEAD_DIM, d->cfg.slots,
                                        d->cfg.state_dtype};
    d->session.limits = d->cfg.limits;
    d->start_max_batch_seqs = d->cfg.limits.max_batch_seqs;

    uint32_t bucket_list[KD_MAX_GRAPH_BUCKETS];
    kd_backend_config bc = {
        .kind = d->cfg.backend,
        .device = d->cfg.device,
        .completion = d->cfg.cuda_completion,
        .cpu_threads = d->cfg.cpu_threads,
        .heads = d->cfg.heads,
        .slots = d->cfg.slots,
        .dtype = (kda_dtype)d->cfg.state_dtype,
        .buckets = bucket_list,
        .nbuckets = buckets(&d->cfg, bucket_list),
        .max_inline_bytes = d->cfg.limits.max_inline_bytes,
    };
    int rc = kd_backend_create(loop, &bc, on_batch_done, on_device_idle, d, &d->backend, err,
                               errlen);
    if (rc != KP_OK)
        return rc == KP_E_NOT_SUPPORTED ? KD_EXIT_UNAVAILABLE : KD_EXIT_FAILURE;
    if (kd_pool_init(&d->pool, d->cfg.slots, (uint32_t)random_u64()) != KP_OK ||
        kd_sched_init(&d->sched, d->cfg.slots) != KP_OK) {
        snprintf(err, errlen, "no memory for the bookkeeping of %u slots", d->cfg.slots);
        return KD_EXIT_FAILURE;
    }
    kd_layers_init(&d->layers, d->backend, d->cfg.heads);
    if (kd_layers_sync_config(&d->layers, &d->cfg, err, errlen) != 0)
        return KD_EXIT_USAGE;
    kd_log_set_level(d->cfg.log_level);

    uv_timer_init(loop, &d->housekeeping);
    uv_timer_init(loop, &d->metrics);
    uv_idle_init(loop, &d->input_idle);
    uv_idle_init(loop, &d->spin);
    uv_timer_init(loop, &d->hold_timer);
    uv_check_init(loop, &d->hold_check);
    d->housekeeping.data = d->metrics.data = d->input_idle.data = d->spin.data = d;
    d->hold_timer.data = d->hold_check.data = d;
    uv_timer_start(&d->housekeeping, on_housekeeping, KD_HOUSEKEEPING_MS, KD_HOUSEKEEPING_MS);
    start_metrics(d);
    return KD_EXIT_OK;
}

int kd_daemon_listen(kd_daemon *d, char *err, size_t errlen)
{
    return kd_server_listen(&d->server, d, &d->cfg, err, errlen) == 0 ? KD_EXIT_OK
                                                                       : KD_EXIT_FAILURE;
}

void kd_daemon_ready(kd_daemon *d)
{
    const kd_backend_info *bi = &d->backend->info;
    char status[512];
    snprintf(status, sizeof(status), "serving: backend %s%s%s, %u heads, %u slots (%s)",
             bi->name, bi->has_gpu ? " on " : "", bi->has_gpu ? bi->gpu_name : "",
             d->cfg.heads, d->cfg.slots, kp_dtype_name(d->cfg.state_dtype));
    KD_NOTICE("%s", status);
    kd_notify_ready(status);
    kd_watchdog_start(&d->watchdog, d->loop, watchdog_progress, d);
    d->watchdog_on = true;
}

void kd_daemon_destroy(kd_daemon *d)
{
    /* Only reached without a loop run when init failed part-way. */
    if (!d->handles_closed) {
        kd_layers_destroy(&d->layers);
        kd_backend_destroy(d->backend);
    }
    kd_sched_destroy(&d->sched);
    kd_pool_destroy(&d->pool);
    kd_quota_destroy(&d->quota);
    free(d->form_scratch);
    kd_config_free(&d->cfg);
}
