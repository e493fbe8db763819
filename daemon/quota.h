/*
 * quota.h - what each uid holds across all its connections, against the
 * per-uid quotas: open connections (clients.max_connections_per_uid) and
 * request frame bytes not answered yet (clients.max_inflight_bytes_per_uid), and
 * those bytes of all uids together (clients.max_inflight_bytes_total).
 *
 * The per-connection and per-owner quotas live with what they count: slots
 * in pool.c (limits.max_slots_per_client, per owner), regions in region.c
 * (limits.max_regions_per_client, per connection); a connection's own
 * unanswered bytes (limits.max_inflight_bytes) pause its reading (client.c).
 * The per-uid quotas bound what one user gets by opening many connections.
 *
 * A uid's entry lives while it has a connection open or bytes charged.  Few
 * uids use a daemon at once: a linear table.
 */
#ifndef KDAD_QUOTA_H
#define KDAD_QUOTA_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "kdaproto.h"

typedef struct kd_uid_use {
    uid_t uid;
    uint32_t connections;     /* open (not closing) */
    uint64_t inflight_bytes;  /* request frames charged and not refunded, partial ones too */
    uint64_t partial_bytes;   /* of which frames still arriving */
    uint64_t output_bytes;    /* responses queued and not read yet */
    uint64_t region_bytes;    /* regions mapped */
} kd_uid_use;

typedef struct kd_quota {
    kd_uid_use *v;
    uint32_t n, cap;
    uint64_t inflight_bytes;  /* all uids together */
    uint64_t partial_bytes;
    uint64_t output_bytes;
    uint64_t region_bytes;
    uint64_t peak_inflight_bytes, peak_partial_bytes, peak_output_bytes, peak_region_bytes;
} kd_quota;

void kd_quota_init(kd_quota *q);
void kd_quota_destroy(kd_quota *q);

/* What uid holds now (zeros when nothing). */
kd_uid_use kd_quota_use(const kd_quota *q, uid_t uid);

/* A new connection of uid: KP_OK (counted), KP_E_QUOTA_EXCEEDED when uid has
 * `max` open already, KP_E_NO_MEMORY. */
int kd_quota_connect(kd_quota *q, uid_t uid, uint32_t max, kp_error *err);
/* A counted connection of uid starts closing. */
void kd_quota_disconnect(kd_quota *q, uid_t uid);

/*
 * Charges a request frame of `bytes` to uid, which has a connection open.
 * The charge always stands (kd_quota_refund gives it back when the request
 * is answered); KP_E_BUSY (retryable: answers give the bytes back) says that
 * uid's unanswered frames now exceed `max_uid`, or all uids' together exceed
 * `max_total`, and the request must be refused.
 */
int kd_quota_charge(kd_quota *q, uid_t uid, uint64_t bytes, uint64_t max_uid, uint64_t max_total,
                    kp_error *err);
void kd_quota_refund(kd_quota *q, uid_t uid, uint64_t bytes);

/* Bytes of a frame still arriving changed by delta: counted in the uid's
 * in-flight bytes (so that its requests meet BUSY the same way) and as its
 * partial bytes. */
void kd_quota_partial(kd_quota *q, uid_t uid, int64_t delta);
/* Unread output of uid changed by delta. */
void kd_quota_output(kd_quota *q, uid_t uid, int64_t delta);
/* Whether uid's output is within both bounds. */
bool kd_quota_output_ok(const kd_quota *q, uid_t uid, uint64_t max_uid, uint64_t max_total);
/* A region of bytes to map for uid: KP_OK (counted) or QUOTA_EXCEEDED with
 * err when that would take the uid beyond max_uid. */
int kd_quota_map(kd_quota *q, uid_t uid, uint64_t bytes, uint64_t max_uid, kp_error *err);
void kd_quota_unmap(kd_quota *q, uid_t uid, uint64_t bytes);

#endif /* KDAD_QUOTA_H */
