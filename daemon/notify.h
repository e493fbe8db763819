/*
 * notify.h - the systemd service-manager protocol (sd_notify): READY with a
 * STATUS, RELOADING, STOPPING, and the watchdog.  Without NOTIFY_SOCKET
 * (not started by systemd) every call does nothing.
 *
 * The watchdog pings (WATCHDOG=1) only while kdad makes progress: the ping
 * timer runs on the event loop, so a blocked loop stops the pings; and it
 * asks `progress` each time, which says no while a batch has been running
 * for longer than the watchdog interval without any batch finishing (a hung
 * device).  systemd then kills and restarts the daemon (WatchdogSec=).
 */
#ifndef KDAD_NOTIFY_H
#define KDAD_NOTIFY_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

void kd_notify_ready(const char *status);
void kd_notify_reloading(void);
void kd_notify_stopping(void);

typedef bool (*kd_progress_fn)(void *arg, uint64_t interval_ns);

typedef struct kd_watchdog {
    uv_timer_t timer;
    uint64_t interval_us;    /* WATCHDOG_USEC; 0: the watchdog is off */
    kd_progress_fn progress;
    void *arg;
} kd_watchdog;

/* Starts pinging at half the interval systemd asked for, if it asked. */
void kd_watchdog_start(kd_watchdog *w, uv_loop_t *loop, kd_progress_fn progress, void *arg);
/* Stops and closes the timer handle (the loop must run once more). */
void kd_watchdog_close(kd_watchdog *w);

#endif /* KDAD_NOTIFY_H */
