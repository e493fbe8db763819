/*
 * engine.h - a batch's life: admission hands work to the engine, which
 * forms batches from the scheduler, holds them back while that pays,
 * launches them on the backend, and completes them.
 *
 * Whenever the backend can take another batch (one at a time on cpu, two on
 * cuda so batch k+1 is prepared while batch k runs), the engine forms one
 * from every runnable job within the batch limits (scheduler.h), exec.c
 * prepares each job (run-time checks, descriptors, slot operations), and
 * the backend gets the batch.  On an idle device a lone request is launched
 * at once; while a batch executes there, a small next batch is held back
 * until the device finishes, it fills up, or its deadline passes (hold.h).
 * Host jobs (slot.free, slot.reset) run as soon as they are runnable.  The
 * requests that added decode steps to a batch are answered when the backend
 * reports the steps done, which may come before the rest of the batch
 * (kd_engine_steps_done); the others when the batch is done.
 *
 * The engine pumps itself: after admitting work, when the backend reports a
 * batch done or the device idle, and at a held batch's deadline.  Others
 * call kd_engine_pump only when they changed what can run (a client's work
 * dropped, a reload's limits).  A prefill with a ready word stays gated in
 * the scheduler until the word reaches its value (sem.h): then it can run,
 * or after batching.ready_timeout_ms it fails.  With batching.ready_on_device,
 * one whose tensors are all in device memory is launched as soon as it heads
 * its slots' FIFOs, on a backend lane behind a device-side wait for its word
 * (backend.h, submit_gated); the word's outcome then goes to the backend.  It
 * tells its owner about a device failure
 * (on_fatal) and, after every pump, that its work may have run out
 * (on_settled: a drain may be over).
 */
#ifndef KDAD_ENGINE_H
#define KDAD_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "backend.h"
#include "client.h"
#include "hold.h"
#include "sem.h"

typedef struct kd_run kd_run;

typedef struct kd_engine {
    kd_daemon *d;
    void (*on_fatal)(void *ctx, const char *why);
    void (*on_settled)(void *ctx);
    void *ctx;
    kd_run *runs;              /* batches in flight */
    uint32_t nruns;            /* their number */
    uint32_t gated_waiting;    /* of those, gated launches whose ready words are not reached
                                  yet (they make no progress to watch for) */
    kd_hold hold;              /* the next batch, held while the device is busy or gathered */
    kd_ready_set ready;        /* admitted prefills waiting for their ready words */
    uint64_t last_prefill_ns;  /* uv_hrtime() of the last prefill answered, any client */
    uv_timer_t hold_timer;     /* its deadline, for a sleeping loop */
    uv_check_t hold_check;     /* its deadline, on every turn of an awake loop */
    kd_job **form_scratch;     /* kd_sched_form's output */
    size_t form_cap;
    bool pumping;              /* kd_engine_pump is on the stack */
    bool pump_again;           /* something changed while it was */
    uint64_t progress_ns;      /* a batch last completed, or started on an idle device (watchdog) */
} kd_engine;

void kd_engine_init(kd_engine *e, kd_daemon *d, void (*on_fatal)(void *ctx, const char *why),
                    void (*on_settled)(void *ctx), void *ctx);
/* Closes its loop handles. */
void kd_engine_close(kd_engine *e);
/* Frees what is left once the loop has stopped. */
void kd_engine_destroy(kd_engine *e);

/* Whether the work in flight has moved within the last interval_ns (the
 * watchdog): a batch completed or started lately, or every run in flight is a
 * gated launch still waiting for its client's word. */
bool kd_engine_progressing(const kd_engine *e, uint64_t interval_ns);

/* A prefill or slot operation arrived: admitted and queued, or answered. */
void kd_engine_admit(kd_engine *e, kd_req *r);
/* Forms and submits batches while the backend has room; runs host jobs. */
void kd_engine_pump(kd_engine *e);
/* Answers every request still waiting for the device with err. */
void kd_engine_abandon_queued(kd_engine *e, const kp_error *err);

/* The backend's callbacks (ctx: the engine). */
void kd_engine_batch_done(void *ctx, kd_batch *batch);
void kd_engine_steps_done(void *ctx, kd_batch *batch);
void kd_engine_device_idle(void *ctx);

#endif /* KDAD_ENGINE_H */
