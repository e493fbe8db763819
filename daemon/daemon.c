/*
 * daemon.c - see daemon.h.
 */
#include "daemon.h"

#include <errno.h>
#include <malloc.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "defaults.h"
#include "dispatch.h"
#include "log.h"

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
/* Wiring: the transport's handlers, accepting, the engine's reports      */
/* ---------------------------------------------------------------------- */

static kd_daemon *daemon_of(const kd_conn *c)
{
    return ((kd_client *)c->data)->d;
}

/* Work happened: the heap is trimmed once the daemon has been idle a while
 * (on_housekeeping). */
static void note_work(kd_daemon *d)
{
    d->last_work_ms = uv_now(d->loop);
    d->trim_due = true;
}

static void on_frame(kd_conn *c, uint8_t *body, size_t len, uint64_t arrival_ns)
{
    note_work(daemon_of(c));
    kd_dispatch_frame(c->data, body, len, arrival_ns);
}

static void on_conn_error(kd_conn *c, const kp_error *e)
{
    kd_stats_error(&daemon_of(c)->stats, e->code);
}

static void on_conn_close(kd_conn *c, kd_disconnect reason)
{
    kd_daemon *d = daemon_of(c);
    kd_client_closed(c->data, reason);
    kd_engine_pump(&d->engine); /* dropped requests may have unblocked others */
}

static void on_conn_free(kd_conn *c)
{
    kd_daemon *d = daemon_of(c);
    kd_client_conn_freed(c->data);
    if (d->stopping && !d->net.conns)
        close_handles(d);
}

static void on_partial(kd_conn *c, int64_t delta)
{
    kd_client_partial(c->data, delta);
}

static void on_output(kd_conn *c, int64_t delta)
{
    kd_client_output(c->data, delta);
}

static const kd_conn_handlers conn_handlers = {on_frame,   on_conn_error, on_conn_close,
                                               on_conn_free, on_partial,  on_output};

static void on_accept(void *ctx, int fd)
{
    kd_peer peer;
    if (kd_peer_read(fd, &peer) != 0) {
        KD_WARN("SO_PEERCRED: %s; connection dropped", strerror(errno));
        close(fd);
        return;
    }
    kd_client_new(ctx, fd, &peer);
}

static kd_transport_limits transport_limits(const kd_config *cfg)
{
    return (kd_transport_limits){
        .output_hard = cfg->output_hard_limit,
        .output_soft = cfg->output_soft_limit,
        .output_soft_ns = (uint64_t)cfg->output_soft_seconds * 1000000000ull,
        .close_flush_ns = (uint64_t)KD_CLOSE_FLUSH_MS * 1000000ull,
        .read_budget = KD_READ_BUDGET_BYTES,
        .write_budget = KD_WRITE_BUDGET_BYTES,
        .read_buffer = KD_READ_BUFFER_BYTES,
        .frame_stall_ns = (uint64_t)cfg->frame_stall_seconds * 1000000000ull,
        .output_stall_ns = (uint64_t)cfg->output_stall_seconds * 1000000000ull,
        .spin_us = cfg->spin_us,
    };
}

static void on_engine_fatal(void *ctx, const char *why)
{
    kd_daemon_fatal(ctx, why);
}

static void on_engine_settled(void *ctx)
{
    note_work(ctx);
    maybe_finish_drain(ctx);
}

/* ---------------------------------------------------------------------- */
/* Gauges, metrics, watchdog, housekeeping                                */
/* ---------------------------------------------------------------------- */

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
    kd_dispatch_gauges(d, &g);
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
    return kd_engine_progressing(&d->engine, interval_ns);
}

/* The heap's free memory back to the system once nothing has happened for
 * KD_IDLE_TRIM_MS: glibc keeps what a burst of large frames freed in its
 * arenas (the main one and every thread's), so without this the daemon's RSS
 * stays at the burst's peak.  Once per idle spell, on the loop: the walk over
 * the arenas took 0.8-4.9 ms after a burst (docs/daemon.md, Giving memory
 * back), time in which a new request waits. */
static void trim_when_idle(kd_daemon *d)
{
    if (!d->trim_due || d->sched.queued || d->backend->inflight ||
        uv_now(d->loop) - d->last_work_ms < KD_IDLE_TRIM_MS)
        return;
    d->trim_due = false;
    uint64_t t0 = uv_hrtime();
    int released = malloc_trim(0);
    KD_DEBUG("idle: malloc_trim %s in %llu us", released ? "gave memory back" : "found none",
             (unsigned long long)((uv_hrtime() - t0) / 1000));
}

static void on_housekeeping(uv_timer_t *t)
{
    kd_daemon *d = t->data;
    uint64_t now = uv_hrtime();
    kd_transport_housekeeping(&d->net, now);
    kd_server_tick(&d->server);
    trim_when_idle(d);
    if (d->draining && !d->stopping && now > d->drain_deadline && d->sched.queued) {
        kp_error e;
        kp_fail(&e, KP_E_SHUTTING_DOWN, "the daemon is shutting down: drain_timeout_ms passed "
                "before this request reached the device");
        KD_WARN("drain timeout: answering %u waiting requests SHUTTING_DOWN", d->sched.queued);
        kd_engine_abandon_queued(&d->engine, &e);
        maybe_finish_drain(d);
    }
}

/* ---------------------------------------------------------------------- */
/* Drain, fatal, stop                                                     */
/* ---------------------------------------------------------------------- */

static void maybe_finish_drain(kd_daemon *d)
{
    if (!d->draining || d->stopping || d->engine.pumping)
        return;
    if (d->sched.queued || d->sched.running || d->engine.runs)
        return;
    d->stopping = true;
    kp_error e;
    if (d->fatal)
        kp_fail(&e, KP_E_DEVICE_FAILED, "the device failed; the daemon exits and restarts with "
                "an empty pool");
    else
        kp_fail(&e, KP_E_SHUTTING_DOWN, "the daemon is shutting down");
    KD_NOTICE("%s: closing %u connections", d->fatal ? "device failure" : "drained", d->net.nopen);
    for (kd_conn *c = d->net.conns, *next; c; c = next) {
        next = c->next;
        kd_conn_close(c, d->fatal ? KD_DISC_DEVICE_FAILED : KD_DISC_SHUTDOWN, &e);
    }
    if (!d->net.conns)
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
    kd_engine_pump(&d->engine); /* a gathered batch goes now: no new work is coming (hold.h) */
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
    kd_engine_abandon_queued(&d->engine, &e);
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
    kd_transport_close(&d->net);
    kd_engine_close(&d->engine);
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
        {"cuda_split_scratch", nc->cuda_split_scratch != old->cuda_split_scratch},
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
    SWAP(cuda_split_scratch);
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
    d->net.lim = transport_limits(&d->cfg);
    start_metrics(d);
    KD_NOTICE("reloaded: log level %s, %u layers", kd_log_level_name(d->cfg.log_level),
              d->layers.n);
    kd_notify_ready("serving");
    kd_engine_pump(&d->engine); /* the batch limits may have changed */
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

/* libuv starts its worker threads with the first work queued, and aborts
 * the process when it cannot: so they start now, before any client can
 * press on the machine's memory. */
static void warm_up(uv_work_t *w)
{
    (void)w;
}

static void warmed_up(uv_work_t *w, int status)
{
    (void)w;
    (void)status;
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
        .gated_lanes = d->cfg.ready_on_device,
        .split_scratch_bytes = d->cfg.cuda_split_scratch,
    };
    int rc = kd_backend_create(loop, &bc, kd_engine_batch_done, kd_engine_device_idle, &d->engine,
                               &d->backend, err, errlen);
    if (rc != KP_OK)
        return rc == KP_E_NOT_SUPPORTED ? KD_EXIT_UNAVAILABLE : KD_EXIT_FAILURE;
    d->backend->steps_done = kd_engine_steps_done;
    if (kd_pool_init(&d->pool, d->cfg.slots, (uint32_t)random_u64()) != KP_OK ||
        kd_sched_init(&d->sched, d->cfg.slots) != KP_OK) {
        snprintf(err, errlen, "no memory for the bookkeeping of %u slots", d->cfg.slots);
        return KD_EXIT_FAILURE;
    }
    kd_layers_init(&d->layers, d->backend, d->cfg.heads, random_u64());
    if (kd_layers_sync_config(&d->layers, &d->cfg, err, errlen) != 0)
        return KD_EXIT_USAGE;
    const kp_memory m = kd_backend_memory(d->backend);
    const double mib = 1024.0 * 1024.0;
    KD_INFO("memory (%s): %.1f MiB = pool %.1f + staging %.1f + scratch %.1f + kernel %.1f + "
            "lanes %.1f + layers %.1f",
            d->backend->info.has_gpu ? "device" : "host", m.total / mib, m.pool / mib,
            m.staging / mib, m.scratch / mib, m.kernel / mib, m.lanes / mib, m.layers / mib);
    kd_log_set_level(d->cfg.log_level);

    uv_queue_work(loop, &d->warm, warm_up, warmed_up);
    kd_transport_limits tl = transport_limits(&d->cfg);
    kd_transport_init(&d->net, loop, &conn_handlers, &tl);
    kd_engine_init(&d->engine, d, on_engine_fatal, on_engine_settled, d);
    uv_timer_init(loop, &d->housekeeping);
    uv_timer_init(loop, &d->metrics);
    d->housekeeping.data = d->metrics.data = d;
    uv_timer_start(&d->housekeeping, on_housekeeping, KD_HOUSEKEEPING_MS, KD_HOUSEKEEPING_MS);
    start_metrics(d);
    return KD_EXIT_OK;
}

int kd_daemon_listen(kd_daemon *d, char *err, size_t errlen)
{
    char path[4096];
    kd_config_socket_path(&d->cfg, path, sizeof(path));
    kd_server_socket sock = {path, d->cfg.socket_mode, d->cfg.socket_group};
    return kd_server_listen(&d->server, d->loop, &sock, on_accept, d, err, errlen) == 0
               ? KD_EXIT_OK
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
    kd_engine_destroy(&d->engine);
    kd_config_free(&d->cfg);
}
