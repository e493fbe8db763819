/*
 * exec.h - the requests that run in slot order: prefill, slot.free,
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
 */
#ifndef KDAD_EXEC_H
#define KDAD_EXEC_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "dispatch.h"

/* One batch on its way through the backend, with the requests it serves. */
typedef struct kd_run {
    kd_batch batch;
    kd_req **reqs;
    uint32_t nreqs;
    uint32_t seqs_cap, ops_cap;
    struct kd_run *next;  /* the daemon's runs in flight */
} kd_run;

/* Admits a prefill or slot operation; on failure it is answered here. */
void kd_exec_admit(kd_req *r);

typedef enum kd_prepare {
    KD_PREPARE_BATCHED = 0, /* it added work to the batch: finish after the backend */
    KD_PREPARE_DONE,        /* it completed without device work, and was answered */
    KD_PREPARE_FAILED,      /* a run-time check failed, and it was answered */
} kd_prepare;

/* Prepares a RUNNING device job for run's batch. */
kd_prepare kd_exec_prepare(kd_req *r, kd_run *run);
/* Answers a prepared request after its batch (any status). */
void kd_exec_finish(kd_req *r, const kd_batch *b);
/* Runs a host job (slot.free, slot.reset) and answers it. */
void kd_exec_host(kd_req *r);
/* Answers a request that never ran (drain timeout) with e. */
void kd_exec_abandon(kd_req *r, const kp_error *e);
/* Releases what an admitted request holds (layer, regions, a slot it
 * allocated); part of freeing the request. */
void kd_exec_release(kd_req *r);

#endif /* KDAD_EXEC_H */
