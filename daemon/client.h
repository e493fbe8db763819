/*
 * client.h - what a client has and holds: its connection (conn.h), its
 * session, its requests in flight and their accounting (the connection's
 * backpressure, its uid's unanswered bytes), its regions and slots, and
 * the clean-up of all of it when the client goes.
 *
 * A request's life: kd_req_new (a frame arrived) -> kd_req_track (it is in
 * flight: counted, charged to its uid, reading paused at the limits) -> one
 * answer (kd_req_reply / kd_req_fail, or kd_req_drop when its client is
 * gone), which also frees it.  What a method took for a request (exec.c's
 * state, a region.release wait) it lets go of in its release hook, which
 * the answer calls.
 *
 * A client lives as long as its connection or its last request, whichever
 * ends later: requests on the device when the client closes finish, and
 * their answers are discarded.
 *
 * Calls nothing above it: the engine and the dispatcher call in.
 */
#ifndef KDAD_CLIENT_H
#define KDAD_CLIENT_H

#include <stdbool.h>
#include <stdint.h>

#include "access.h"
#include "conn.h"
#include "kdaproto.h"
#include "region.h"
#include "scheduler.h"

typedef struct kd_daemon kd_daemon;
typedef struct kd_client kd_client;
typedef struct kd_req kd_req;
typedef struct kd_exec kd_exec;

struct kd_req {
    kd_client *client;
    uint32_t id;
    kp_method method;
    uint64_t arrival_ns;   /* the frame completed (uv_hrtime) */
    uint8_t *body;         /* the frame body: inline tensors point into it */
    size_t body_len;
    kp_msg msg;
    bool prefill_read;          /* a prefill whose params were read on arrival: */
    kp_prefill_params prefill;  /* (kp_prefill_request_read; msg's zone holds them) */
    int fd;                /* descriptor claimed for this frame, or -1 */
    bool tracked;          /* in its client's list (kd_req_track) */
    kd_req *prev, *next;   /* the client's unanswered requests, arrival order */
    kd_job job;            /* prefill and slot operations: the scheduler's view */
    kd_exec *exec;         /* exec.c's state of an admitted request */
    kd_region *releasing;  /* region.release: the region whose memory we wait for */
    void (*release)(kd_req *r); /* lets go of what its method took, or NULL */
};

struct kd_client {
    kd_daemon *d;
    kd_conn *conn;             /* NULL once its socket is closed */
    uint64_t serial;           /* >= 1, unique per daemon start (slot owner key) */
    kd_peer peer;
    bool uid_counted;          /* counts toward its uid's connections (quota.h) */
    bool closing;

    kp_session session;        /* geometry and limits from our hello result */
    bool hello_done;

    kd_req *req_head, *req_tail; /* unanswered requests, arrival order */
    uint32_t inflight;
    uint64_t inflight_bytes;
    uint64_t last_prefill_ns;  /* uv_hrtime() of its last prefill answer (hold.h, gathering) */

    bool partial_held;         /* reading stopped: its uid's frames still arriving are too many */
    bool output_held;          /* reading stopped: its uid's unread output is too much */

    kd_regions regions;
    kd_region *ring_region;    /* the region holding its frame ring (one reference) */
    kd_sched_group group;      /* fairness in batch formation */

    uint32_t refs;             /* 1 while the connection lives, +1 per request */
    kd_client *prev, *next;    /* the daemon's clients */
};

/*
 * Adopts an accepted socket of peer: checks the access lists (access.h), the
 * connection limit and its uid's connection quota (quota.h), refusing with a
 * goodbye, and starts reading.  NULL only without memory (the fd is closed).
 */
kd_client *kd_client_new(kd_daemon *d, int fd, const kd_peer *peer);
/* The connection began to close: drops the requests that have not reached
 * the device, releases the regions and (unless slots persist) the slots,
 * and counts the reason.  The caller pumps the engine (dropped work may
 * have unblocked other work). */
void kd_client_closed(kd_client *cl, kd_disconnect reason);
/* The connection is gone: cl lives on while requests remain. */
void kd_client_conn_freed(kd_client *cl);
/* The transport's accounting: bytes held for cl's frame still arriving, and
 * its unread output, both counted for its uid (quota.h).  Beyond the
 * bounds cl stops reading; it reads again once they are met. */
void kd_client_partial(kd_client *cl, int64_t delta);
void kd_client_output(kd_client *cl, int64_t delta);

/* Keeps cl alive across calls that may answer its last request. */
void kd_client_ref(kd_client *cl);
void kd_client_unref(kd_client *cl);

/* The owner key of this client's slots: the client itself, or its uid when
 * slots persist. */
uint64_t kd_client_owner(const kd_client *cl);
/* Whether a request with this id is unanswered. */
bool kd_client_id_in_flight(const kd_client *cl, uint32_t id);
/* The limits in force for cl (its session's after hello). */
const kp_limits *kd_client_limits(const kd_client *cl);

/* The retire-idle-slot rule: a retiring slot returns to the pool once no
 * job names it any more. */
void kd_slot_settle(kd_daemon *d, uint32_t slot);
/* A job left the scheduler: settles every slot it named. */
void kd_job_left(kd_daemon *d, const kd_job *job);

/* A request for a frame body (taken: freed with the request), not yet in
 * flight; NULL without memory (then the body is freed). */
kd_req *kd_req_new(kd_client *cl, uint8_t *body, size_t len, uint64_t arrival_ns);
/* Frees a request that never went in flight. */
void kd_req_discard(kd_req *r);
/* Puts r in flight: counted on its client and charged to its uid.  Returns
 * the quota's verdict (then answer r with e: it holds nothing). */
int kd_req_track(kd_req *r, kp_error *e);

/* A frame for r's response, or NULL after answering r (with NO_MEMORY, or
 * silently when its client is closing). */
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
/* Frees r without an answer (its client is closing); a queued job leaves
 * the scheduler. */
void kd_req_drop(kd_req *r);

#endif /* KDAD_CLIENT_H */
