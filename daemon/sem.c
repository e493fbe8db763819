/*
 * sem.c - see sem.h.
 */
#include "sem.h"

#include <stddef.h>

#define MS_NS 1000000ull
#define TIMER_MAX_MS 16u /* the slowest period, for waits long past their spin */

enum { WAITING = 0, REACHED, TIMED_OUT, UNREADABLE };

static void link_tail(kd_ready_set *s, kd_ready_wait *w)
{
    w->set = s;
    w->next = NULL;
    w->prev = s->tail;
    if (s->tail)
        s->tail->next = w;
    else
        s->head = w;
    s->tail = w;
    s->count++;
}

static void unlink_wait(kd_ready_wait *w)
{
    kd_ready_set *s = w->set;
    if (w->prev)
        w->prev->next = w->next;
    else
        s->head = w->next;
    if (w->next)
        w->next->prev = w->prev;
    else
        s->tail = w->prev;
    w->prev = w->next = NULL;
    w->set = NULL;
    s->count--;
}

static void arm(kd_ready_set *s);

static void on_check(uv_check_t *h)
{
    kd_ready_poll(h->data);
}

static void on_idle(uv_idle_t *h)
{
    (void)h; /* its being active keeps the loop from sleeping; on_check polls */
}

static void on_timer(uv_timer_t *t)
{
    kd_ready_poll(t->data);
}

/* Spin while words are being written (a wait began or was reached lately);
 * else a timer whose period grows with the quiet time, so a forgotten word
 * costs ever fewer wake-ups. */
static void arm(kd_ready_set *s)
{
    if (s->count == 0) {
        uv_check_stop(&s->check);
        uv_idle_stop(&s->idle);
        uv_timer_stop(&s->timer);
        return;
    }
    uint64_t now = uv_hrtime();
    uint64_t age = now - s->active_ns;
    uv_check_start(&s->check, on_check);
    if (age < (uint64_t)s->spin_us * 1000u) {
        uv_idle_start(&s->idle, on_idle);
        uv_timer_stop(&s->timer);
        return;
    }
    uv_idle_stop(&s->idle);
    uint64_t ms = age / MS_NS / 16;
    if (ms < 1)
        ms = 1;
    if (ms > TIMER_MAX_MS)
        ms = TIMER_MAX_MS;
    /* Wake no later than the oldest wait's deadline. */
    uint64_t deadline = s->head->since_ns + (uint64_t)s->timeout_ms * MS_NS;
    uint64_t left = deadline > now ? (deadline - now + MS_NS - 1) / MS_NS : 0;
    if (left < ms)
        ms = left;
    uv_timer_start(&s->timer, on_timer, ms, 0);
}

/* Reads w's word: REACHED, WAITING, TIMED_OUT or UNREADABLE. */
static int look(kd_ready_set *s, kd_ready_wait *w, uint64_t now)
{
    uint64_t v;
    if (kd_backend_read_word(s->backend, w->word.buf, &v) != KP_OK)
        return UNREADABLE;
    if (v >= w->word.value)
        return REACHED;
    if (now - w->since_ns >= (uint64_t)s->timeout_ms * MS_NS)
        return TIMED_OUT;
    return WAITING;
}

static void report(kd_ready_set *s, kd_ready_wait *w, int verdict, uint64_t now)
{
    kp_error e;
    unlink_wait(w);
    if (verdict == REACHED) {
        s->active_ns = now;
        s->reached(s->ctx, w);
        return;
    }
    if (verdict == UNREADABLE)
        kp_fail(&e, KP_E_DEVICE_FAILED, "ready: the word could not be read");
    else
        kp_fail(&e, KP_E_READY_TIMEOUT, "ready: the word stayed below %llu for %llu ms "
                "(batching.ready_timeout_ms %u)", (unsigned long long)w->word.value,
                (unsigned long long)((now - w->since_ns) / MS_NS), s->timeout_ms);
    s->timed_out(s->ctx, w, &e);
}

void kd_ready_poll(kd_ready_set *s)
{
    if (s->polling || s->count == 0) {
        arm(s);
        return;
    }
    s->polling = true;
    uint64_t now = uv_hrtime();
    /* A callback may cancel other waits (a request answered, a client gone):
     * after each report the walk starts again from the oldest wait not yet
     * looked at in this poll, found by its age. */
    uint64_t looked_until = 0; /* waits with since_ns < this were looked at */
    bool again = true;
    while (again) {
        again = false;
        for (kd_ready_wait *w = s->head; w; w = w->next) {
            if (w->since_ns < looked_until)
                continue;
            looked_until = w->since_ns + 1;
            int v = look(s, w, now);
            if (v != WAITING) {
                report(s, w, v, now);
                again = true;
                break;
            }
        }
    }
    s->polling = false;
    arm(s);
}

int kd_ready_begin(kd_ready_set *s, kd_ready_wait *w, bool *reached, kp_error *e)
{
    uint64_t v;
    w->set = NULL;
    if (kd_backend_read_word(s->backend, w->word.buf, &v) != KP_OK)
        return kp_fail(e, KP_E_NOT_SUPPORTED, "ready: this daemon cannot read a word in this "
                       "region");
    *reached = v >= w->word.value;
    if (*reached)
        return KP_OK;
    /* Strictly increasing start times: the poll's walk tells waits apart by them. */
    uint64_t now = uv_hrtime();
    if (s->tail && now <= s->tail->since_ns)
        now = s->tail->since_ns + 1;
    w->since_ns = now;
    s->active_ns = now;
    link_tail(s, w);
    arm(s);
    return KP_OK;
}

void kd_ready_cancel(kd_ready_wait *w)
{
    kd_ready_set *s = w->set;
    if (!s)
        return;
    unlink_wait(w);
    if (!s->polling)
        arm(s);
}

void kd_ready_configure(kd_ready_set *s, uint32_t spin_us, uint32_t timeout_ms)
{
    s->spin_us = spin_us;
    s->timeout_ms = timeout_ms;
    if (s->count && !s->polling)
        arm(s);
}

void kd_ready_init(kd_ready_set *s, uv_loop_t *loop, kd_backend *backend,
                   void (*reached)(void *ctx, kd_ready_wait *w),
                   void (*timed_out)(void *ctx, kd_ready_wait *w, const kp_error *err),
                   void *ctx)
{
    s->backend = backend;
    s->reached = reached;
    s->timed_out = timed_out;
    s->ctx = ctx;
    s->head = s->tail = NULL;
    s->count = 0;
    s->polling = false;
    uv_check_init(loop, &s->check);
    uv_idle_init(loop, &s->idle);
    uv_timer_init(loop, &s->timer);
    s->check.data = s->idle.data = s->timer.data = s;
}

void kd_ready_close(kd_ready_set *s)
{
    uv_close((uv_handle_t *)&s->check, NULL);
    uv_close((uv_handle_t *)&s->idle, NULL);
    uv_close((uv_handle_t *)&s->timer, NULL);
}
