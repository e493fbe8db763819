/*
 * notify.c - see notify.h.
 */
#include "notify.h"

#include <systemd/sd-daemon.h>

#include "log.h"

void kd_notify_ready(const char *status)
{
    sd_notifyf(0, "READY=1\nSTATUS=%s", status);
}

void kd_notify_reloading(void)
{
    sd_notify(0, "RELOADING=1");
}

void kd_notify_stopping(void)
{
    sd_notify(0, "STOPPING=1\nSTATUS=draining");
}

static void on_ping(uv_timer_t *t)
{
    kd_watchdog *w = t->data;
    if (w->progress(w->arg, w->interval_us * 1000))
        sd_notify(0, "WATCHDOG=1");
    else
        KD_WARN("watchdog: no progress for %llu ms, not pinging",
                (unsigned long long)(w->interval_us / 1000));
}

void kd_watchdog_start(kd_watchdog *w, uv_loop_t *loop, kd_progress_fn progress, void *arg)
{
    uint64_t usec = 0;
    w->progress = progress;
    w->arg = arg;
    w->interval_us = sd_watchdog_enabled(0, &usec) > 0 ? usec : 0;
    uv_timer_init(loop, &w->timer);
    w->timer.data = w;
    if (w->interval_us == 0)
        return;
    uint64_t period_ms = w->interval_us / 2000;
    uv_timer_start(&w->timer, on_ping, 0, period_ms ? period_ms : 1);
    KD_INFO("watchdog: pinging every %llu ms", (unsigned long long)(period_ms ? period_ms : 1));
}

void kd_watchdog_close(kd_watchdog *w)
{
    uv_close((uv_handle_t *)&w->timer, NULL);
}
