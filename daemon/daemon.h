/*
 * daemon.h - the daemon object: everything the event loop owns, and the
 * engine that moves work from the scheduler to the backend and back.
 *
 * Threads: one libuv loop thread owns every socket, the queues, the pool
 * bookkeeping and the layer registry.  The backends do their heavy host work
 * (the cpu prefill, staging copies) on libuv worker threads and report back
 * on the loop; the cuda backend learns of its device work's completion from
 * a thread that waits for each batch's event and wakes the loop.  Nothing
 * on the loop waits for a device.
 *
 * The engine (kd_daemon_pump): whenever the backend can take another batch
 * (one at a time on cpu, two on cuda so batch k+1 is prepared while batch k
 * runs), the scheduler forms one from every runnable job within the batch
 * limits, exec.c prepares each job (run-time checks, descriptors, slot
 * operations), and the backend gets the batch.  On an idle device a lone
 * request is launched at once; while a batch executes there, a small next
 * batch is held back until the device finishes, it fills up, or its
 * deadline passes (hold.h).  Host jobs (slot.free, slot.reset) run as soon
 * as they are runnable.
 *
 * Lifecycle: init (config, backend, pool, layers) -> listen -> run ->
 * drain (SIGTERM/SIGINT: stop accepting, finish admitted work, goodbye,
 * exit 0) or fatal (device failure: answer everything DEVICE_FAILED, exit
 * non-zero).  SIGHUP reloads the configuration (kd_daemon_reload).
 */
#ifndef KDAD_DAEMON_H
#define KDAD_DAEMON_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "backend.h"
#include "config.h"
#include "conn.h"
#include "hold.h"
#include "layer.h"
#include "notify.h"
#include "pool.h"
#include "quota.h"
#include "scheduler.h"
#include "server.h"
#include "stats.h"

typedef struct kd_run kd_run;

struct kd_daemon {
    uv_loop_t *loop;
    kd_config cfg;             /* in force (reload replaces it) */
    const char *config_path;   /* the file to reload, or NULL for the built-in default */
    kd_config_overrides ov;    /* command-line overrides, re-applied on reload */
    kp_session session;        /* geometry and limits that hello announces now */
    uint32_t start_max_batch_seqs; /* reload may lower max_batch_seqs, never raise it */
    uint64_t instance;         /* random per start (hello's "instance") */

    kd_backend *backend;
    kd_pool pool;
    kd_quota quota;            /* per-uid connections and unanswered bytes */
    kd_sched sched;
    kd_layers layers;
    kd_stats stats;
    kd_server server;

    kd_conn *conns;            /* open and closing connections */
    uint32_t nconns;           /* open (not closing) */
    uint32_t nrings;           /* connections on a frame ring (closing ones too), polled by spin */
    uint64_t next_serial;
    kd_conn *input_head;       /* connections with buffered input to process */
    uv_idle_t input_idle;
    uv_idle_t spin;            /* keeps the loop polling after an answer (batching.spin_us) */
    uint64_t spin_until_ns;

    kd_run *runs;              /* batches in flight */
    kd_hold hold;              /* the next batch, held while the device is busy or gathered */
    uint64_t last_prefill_ns;  /* uv_hrtime() of the last prefill answered, any connection */
    uv_timer_t hold_timer;     /* its deadline, for a sleeping loop */
    uv_check_t hold_check;     /* its deadline, on every turn of an awake loop */
    kd_job **form_scratch;     /* kd_sched_form's output */
    size_t form_cap;
    bool pumping;              /* kd_daemon_pump is on the stack */
    bool pump_again;           /* something changed while it was */
    uint64_t progress_ns;      /* a batch last completed, or started on an idle device (watchdog) */

    bool draining;
    uint64_t drain_deadline;
    bool stopping;             /* connections closed; handles closing */
    bool fatal;
    int exit_code;

    bool signals_on;
    uv_signal_t sigterm, sigint, sighup;
    uv_timer_t housekeeping;
    uv_timer_t metrics;
    bool metrics_writing;      /* a metrics file write is on a worker */
    bool watchdog_on;
    kd_watchdog watchdog;
    bool handles_closed;
};

/*
 * Creates the daemon on loop from a loaded config (taken over: freed by
 * kd_daemon_destroy, also on failure): backend, pool, scheduler, config
 * layers, timers.  Does not listen.  Returns 0, or a KD_EXIT_* code with err.
 */
int kd_daemon_init(kd_daemon *d, uv_loop_t *loop, kd_config *cfg, const char *config_path,
                   const kd_config_overrides *ov, char *err, size_t errlen);
/* Starts the listening socket (own or systemd's); 0 or KD_EXIT_FAILURE. */
int kd_daemon_listen(kd_daemon *d, char *err, size_t errlen);
/* Installs the SIGTERM, SIGINT and SIGHUP handlers. */
void kd_daemon_handle_signals(kd_daemon *d);
/* Tells systemd (if any) that kdad serves, and starts the watchdog. */
void kd_daemon_ready(kd_daemon *d);

/* Starts the drain (as SIGTERM does). */
void kd_daemon_drain(kd_daemon *d);
/* Re-reads the configuration (as SIGHUP does); 0 or -1 (logged, nothing changed). */
int kd_daemon_reload(kd_daemon *d);
/* A device failure: answers everything, closes every connection, exits non-zero. */
void kd_daemon_fatal(kd_daemon *d, const char *why);

/* Forms and submits batches while the backend has room; runs host jobs. */
void kd_daemon_pump(kd_daemon *d);
/* A job left the scheduler: releases retiring slots it named that are now idle. */
void kd_daemon_job_left(kd_daemon *d, const kd_job *job);
/* Keeps the loop polling, and the frame rings polled, for batching.spin_us
 * (after an answer, or a ring's doorbell). */
void kd_daemon_stay_awake(kd_daemon *d);
/* Whether the loop polls instead of sleeping now. */
bool kd_daemon_awake(const kd_daemon *d);
/* Queues a connection for input processing on the next loop turn. */
void kd_daemon_queue_input(kd_daemon *d, kd_conn *c);
/* A connection's memory was freed (the last one ends a drain). */
void kd_daemon_conn_freed(kd_daemon *d);
/* Gauges for stats and metrics. */
void kd_daemon_gauges(const kd_daemon *d, kd_stats_gauges *g);

/* Frees everything once uv_run has returned. */
void kd_daemon_destroy(kd_daemon *d);

#endif /* KDAD_DAEMON_H */
