/*
 * sem.h - the ready words of stream-ordered prefills (PROTOCOL.md
 * §Stream-ordered requests): admitted requests whose job stays gated in the
 * scheduler until a word in the client's memory reaches a value.
 *
 * The loop polls the words itself, so an unready request holds back nothing
 * but the slots it names: it never enters a batch's streams (a device-side
 * wait there would stall every batch queued behind it); the engine may queue
 * it on a lane of its own behind one (engine.h), and the set still tells when
 * the word came, or that it did not in time.  Reading a host word is one load; the set checks
 * every word on each turn of the loop (a uv_check handle), keeps the loop
 * awake (a uv_idle handle) for `spin_us` after a wait began or a word was
 * reached (a stream that is moving writes its next word soon: a layer loop
 * keeps the loop awake from layer to layer), and otherwise wakes on a timer
 * whose period grows with that quiet time (1 ms, up to 16 ms).  A wait
 * older than `timeout_ms` fails.
 *
 * Calls nothing above it: the owner (the engine) learns through callbacks.
 */
#ifndef KDAD_SEM_H
#define KDAD_SEM_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "backend.h"

typedef struct kd_ready_set kd_ready_set;

/* One request waiting for its ready word; lives in the request. */
typedef struct kd_ready_wait {
    kd_sem_word word;
    uint64_t since_ns;       /* uv_hrtime() when it began to wait */
    void *owner;             /* the request */
    kd_batch *launched;      /* its batch, already queued behind a device-side wait for the
                                word (engine.h), or NULL */
    kd_ready_set *set;       /* NULL when not waiting */
    struct kd_ready_wait *prev, *next;
} kd_ready_wait;

struct kd_ready_set {
    kd_backend *backend;     /* reads device words */
    uint32_t spin_us;        /* keep the loop awake this long after a wait begins or ends */
    uint32_t timeout_ms;     /* then fail it after this long */
    /* reached: the word is at its value; timed_out: the wait is over without
     * it (err says why).  The wait has left the set when they are called. */
    void (*reached)(void *ctx, kd_ready_wait *w);
    void (*timed_out)(void *ctx, kd_ready_wait *w, const kp_error *err);
    void *ctx;
    kd_ready_wait *head, *tail; /* oldest first */
    uint32_t count;
    uint64_t active_ns;      /* a wait last began or was reached (uv_hrtime) */
    uv_check_t check;
    uv_idle_t idle;
    uv_timer_t timer;
    bool polling;            /* kd_ready_poll is on the stack */
};

void kd_ready_init(kd_ready_set *s, uv_loop_t *loop, kd_backend *backend,
                   void (*reached)(void *ctx, kd_ready_wait *w),
                   void (*timed_out)(void *ctx, kd_ready_wait *w, const kp_error *err),
                   void *ctx);
void kd_ready_close(kd_ready_set *s);
/* New limits (a reload): they apply to the waits already there too. */
void kd_ready_configure(kd_ready_set *s, uint32_t spin_us, uint32_t timeout_ms);

/* Whether w's word is at its value now; if not, w joins the set (0).  A
 * word that cannot be read fails at once (a kp_code, with e). */
int kd_ready_begin(kd_ready_set *s, kd_ready_wait *w, bool *reached, kp_error *e);
/* Takes w out of its set (no-op when it is not waiting). */
void kd_ready_cancel(kd_ready_wait *w);
/* Checks every word now. */
void kd_ready_poll(kd_ready_set *s);

#endif /* KDAD_SEM_H */
