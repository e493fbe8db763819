/*
 * progress.c - a one-line progress bar on stderr for long transfers and
 * benchmarks: drawn only on a terminal (never into pipes, logs or --json
 * output), at most ten times a second, and erased when done.
 */
#include <stdio.h>
#include <string.h>

#include "common.h"

#define PROGRESS_MIN_BYTES (32u << 20) /* smaller transfers end before a bar helps */
#define PROGRESS_WIDTH 30
#define PROGRESS_PERIOD_S 0.1

void progress_begin(progress *p, const ctl *g, const char *label, uint64_t total, bool bytes)
{
    p->on = g->progress && total > 0 && (!bytes || total >= PROGRESS_MIN_BYTES);
    p->label = label;
    p->bytes = bytes;
    p->total = total;
    p->send_total = 0;
    p->start = now_s();
    p->last = 0;
}

void progress_update(progress *p, uint64_t done)
{
    if (!p->on)
        return;
    double t = now_s();
    if (t - p->last < PROGRESS_PERIOD_S)
        return;
    p->last = t;
    if (done > p->total)
        done = p->total;
    double frac = (double)done / (double)p->total;
    char bar[PROGRESS_WIDTH + 1];
    int fill = (int)(frac * PROGRESS_WIDTH);
    for (int i = 0; i < PROGRESS_WIDTH; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[PROGRESS_WIDTH] = 0;
    char a[32], b[32], rate[32] = "";
    double elapsed = t - p->start;
    if (p->bytes) {
        format_bytes((double)done, a, sizeof(a));
        format_bytes((double)p->total, b, sizeof(b));
        if (elapsed > 0) {
            format_bytes(done / elapsed, rate, sizeof(rate));
            snprintf(rate + strlen(rate), sizeof(rate) - strlen(rate), "/s");
        }
    } else {
        snprintf(a, sizeof(a), "%llu", (unsigned long long)done);
        snprintf(b, sizeof(b), "%llu", (unsigned long long)p->total);
    }
    fprintf(stderr, "\r%s [%s] %3.0f%% %s/%s %s\033[K", p->label, bar, frac * 100, a, b, rate);
    fflush(stderr);
}

void progress_request(progress *p, uint64_t send_total)
{
    p->send_total = send_total;
}

void progress_io(progress *p, uint64_t sent, uint64_t received)
{
    if (p->send_total) {
        /* The phase: the request still leaving, the daemon working on it, the answer coming. */
        const char *label = sent < p->send_total ? "prefill send   "
                            : received == 0      ? "prefill run    "
                                                 : "prefill receive";
        if (label != p->label)
            p->last = 0; /* a new phase is drawn at once, however soon it follows the last */
        p->label = label;
    }
    progress_update(p, sent + received);
}

void progress_end(progress *p)
{
    if (p->on && p->last > 0) {
        fprintf(stderr, "\r\033[K");
        fflush(stderr);
    }
    p->on = false;
}
