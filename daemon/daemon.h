/*
 * daemon.h - the daemon object: everything the event loop owns, and its
 * lifecycle.
 *
 * Threads: one libuv loop thread owns every socket, the queues, the pool
 * bookkeeping and the layer registry.  The backends do their heavy host work
 * (the cpu prefill, staging copies) on libuv worker threads and report back
 * on the loop; the cuda backend learns of its device work's completion from
 * a thread that waits for each batch's event and wakes the loop.  Nothing
 * on the loop waits for a device.
 *
 * The rooms (docs/daemon.md, Architecture): server.c accepts, conn.c moves
 * bytes, client.c keeps what each client has in flight and holds,
 * dispatch.c turns frames into requests and answers the immediate methods,
 * engine.c runs batches, exec.c does each slot-ordered method's steps.
 * daemon.c wires them together (the transport's handlers, the accept
 * callback, the engine's reports) and keeps the lifecycle: init (config,
 * backend, pool, layers) -> listen -> run -> drain (SIGTERM/SIGINT: stop
 * accepting, finish admitted work, goodbye, exit 0) or fatal (device
 * failure: answer everything DEVICE_FAILED, exit non-zero); SIGHUP reloads
 * the configuration (kd_daemon_reload); the watchdog, metrics and
 * housekeeping timers.
 */
#ifndef KDAD_DAEMON_H
#define KDAD_DAEMON_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "backend.h"
#include "client.h"
#include "config.h"
#include "conn.h"
#include "engine.h"
#include "layer.h"
#include "notify.h"
#include "pool.h"
#include "quota.h"
#include "scheduler.h"
#include "server.h"
#include "stats.h"

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

    kd_transport net;          /* the clients' connections */
    kd_client *clients;        /* open and closing, and closed ones with requests left */
    uint32_t partial_held;     /* clients not reading: their uid's frames still arriving */
    uint32_t output_held;      /* clients not reading: their uid's unread output */
    uint64_t next_serial;
    kd_engine engine;

    bool draining;
    uint64_t drain_deadline;
    bool stopping;             /* connections closed; handles closing */
    bool fatal;
    int exit_code;

    bool signals_on;
    uv_signal_t sigterm, sigint, sighup;
    uv_timer_t housekeeping;
    uint64_t last_work_ms;     /* loop time of the last frame or engine pump */
    bool trim_due;             /* work since the heap was last trimmed */
    uv_timer_t metrics;
    bool metrics_writing;      /* a metrics file write is on a worker */
    bool watchdog_on;
    kd_watchdog watchdog;
    bool handles_closed;
    uv_work_t warm;            /* starts libuv's worker threads at start-up */
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

/* Frees everything once uv_run has returned. */
void kd_daemon_destroy(kd_daemon *d);

#endif /* KDAD_DAEMON_H */
