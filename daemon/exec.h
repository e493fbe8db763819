/*
 * exec.h - the requests that run in slot order: prefill, step, slot.free,
 * slot.reset, slot.fork, slot.read, slot.write (PROTOCOL.md §Ordering and
 * atomicity).
 *
 * Each goes through three steps:
 *   admit    (on arrival)   everything the request and the session can tell
 *            is checked (decode, layer, handles, ownership, regions and
 *            bounds, queue limit); then the request holds what it names (a
 *            layer reference, region references) and joins the scheduler.
 *   prepare  (when its batch forms)  run-time checks against what earlier
 *            requests left (status, expect_pos), all before any effect; then
 *            its sequences and slot operations go into the batch.
 *   finish   (the batch is done)  pool bookkeeping and the response.
 * slot.free and slot.reset are host jobs: bookkeeping only, run as soon as
 * they head their slots' FIFOs.
 *
 * The engine (engine.h) calls each step; exec.c answers through client.h
 * and calls nothing above it.
 */
#ifndef KDAD_EXEC_H
#define KDAD_EXEC_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "client.h"
#include "sem.h"

/* Admits a prefill, step or slot operation into the scheduler.  On failure
 * (returned, with e) the caller answers r; what it took goes with the
 * answer (r's release hook). */
int kd_exec_admit(kd_req *r, kp_error *e);

/* The ready-word wait of an admitted prefill that has one (it was admitted
 * gated: kd_sched_ungate once the word is reached), else NULL. */
kd_ready_wait *kd_exec_ready_wait(kd_req *r);

/* Whether a gated prefill (heading its slots' FIFOs) can be prepared now and
 * launched behind a device-side wait for its ready word: its tensors are all
 * in device memory (nothing to stage or copy, so a launch called off leaves
 * no trace), its ready word has a device address, and its run-time checks
 * pass already (they cannot change while it heads its FIFOs). */
bool kd_exec_launch_early(kd_req *r);

typedef enum kd_prepare {
    KD_PREPARE_BATCHED = 0, /* it added work to the batch: finish after the backend */
    KD_PREPARE_DONE,        /* it completed without device work, and was answered */
    KD_PREPARE_FAILED,      /* a run-time check failed, and it was answered */
} kd_prepare;

/* Prepares a RUNNING device job for batch b (sized for it by the engine). */
kd_prepare kd_exec_prepare(kd_req *r, kd_batch *b);
/* Answers a prepared request after its batch (any status; NULL: it needed
 * no device work). */
void kd_exec_finish(kd_req *r, const kd_batch *b);
/* Runs a host job (slot.free, slot.reset) and answers it. */
void kd_exec_host(kd_req *r);

#endif /* KDAD_EXEC_H */
