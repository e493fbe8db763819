/*
 * dispatch.h - requests: from a complete frame to an answer.
 *
 * kd_dispatch_frame decodes the envelope (proto/ kp_msg_decode runs the
 * bounded pre-validation first), takes a passed descriptor when the method
 * carries one, enforces the connection rules (hello first, no id reused in
 * flight, no notifications or responses from clients, draining) and routes
 * the method.  Methods that need no slot FIFO (hello, health, stats,
 * layer.*, region.*, slot.alloc, slot.info) are answered here at once;
 * prefill and the slot operations are admitted by exec.c and answered when
 * they have run.
 *
 * Every request is answered exactly once, with kd_req_reply or
 * kd_req_fail, which also keep the connection's in-flight accounting and
 * the statistics.  An error whose code closes the connection (KP_ERRORS)
 * is followed by a goodbye and the close.
 */
#ifndef KDAD_DISPATCH_H
#define KDAD_DISPATCH_H

#include <stdint.h>

#include "conn.h"
#include "kdaproto.h"
#include "scheduler.h"

typedef struct kd_exec kd_exec;

struct kd_req {
    kd_conn *conn;
    uint32_t id;
    kp_method method;
    uint64_t arrival_ns;   /* the frame completed (uv_hrtime) */
    uint8_t *body;         /* the frame body: inline tensors point into it */
    size_t body_len;
    kp_msg msg;
    bool prefill_read;          /* a prefill whose params were read on arrival: */
    kp_prefill_params prefill;  /* (kp_prefill_request_read; msg's zone holds them) */
    int fd;                /* descriptor claimed for this frame, or -1 */
    kd_req *prev, *next;   /* the connection's unanswered requests */
    kd_job job;            /* prefill and slot operations: the scheduler's view */
    kd_exec *exec;         /* exec.c's state of an admitted request */
    kd_region *releasing;  /* region.release: the region whose memory we wait for */
};

/* Handles one frame body (takes it: freed with the request). */
void kd_dispatch_frame(kd_conn *c, uint8_t *body, size_t len, uint64_t arrival_ns);

/* A frame for r's response, or NULL after answering r with NO_MEMORY. */
kd_out *kd_req_frame(kd_req *r);
/* Sends o, which a kp_*_result_encode call filled and returned encode_rc
 * for, as r's response, and frees r.  An encoding failure (a daemon bug)
 * answers INTERNAL instead. */
void kd_req_reply(kd_req *r, kd_out *o, int encode_rc, const kp_error *encode_err);
/* Answers r with the empty result {} and frees r. */
void kd_req_reply_empty(kd_req *r);
/* Sends e as r's error response and frees r; closes the connection after a
 * goodbye when e's code says so. */
void kd_req_fail(kd_req *r, const kp_error *e);
/* Frees r without an answer (its connection is closing). */
void kd_req_drop(kd_req *r);

#endif /* KDAD_DISPATCH_H */
