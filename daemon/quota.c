/*
 * quota.c - see quota.h.
 */
#include "quota.h"

#include <stdlib.h>
#include <string.h>

void kd_quota_init(kd_quota *q)
{
    memset(q, 0, sizeof(*q));
}

void kd_quota_destroy(kd_quota *q)
{
    free(q->v);
    memset(q, 0, sizeof(*q));
}

static kd_uid_use *find(const kd_quota *q, uid_t uid)
{
    for (uint32_t i = 0; i < q->n; i++) {
        if (q->v[i].uid == uid)
            return &q->v[i];
    }
    return NULL;
}

/* Drops an entry that holds nothing any more. */
static void prune(kd_quota *q, kd_uid_use *u)
{
    if (u->connections == 0 && u->inflight_bytes == 0 && u->output_bytes == 0 &&
        u->region_bytes == 0)
        *u = q->v[--q->n];
}

kd_uid_use kd_quota_use(const kd_quota *q, uid_t uid)
{
    const kd_uid_use *u = find(q, uid);
    return u ? *u : (kd_uid_use){.uid = uid};
}

int kd_quota_connect(kd_quota *q, uid_t uid, uint32_t max, kp_error *err)
{
    kd_uid_use *u = find(q, uid);
    if (u && u->connections >= max)
        return kp_fail(err, KP_E_QUOTA_EXCEEDED, "uid %u has %u connections open, the most "
                       "clients.max_connections_per_uid allows", (unsigned)uid, u->connections);
    if (!u) {
        if (q->n == q->cap) {
            uint32_t cap = q->cap ? 2 * q->cap : 8;
            kd_uid_use *v = realloc(q->v, cap * sizeof(*v));
            if (!v)
                return kp_fail(err, KP_E_NO_MEMORY, "no memory for the per-uid quota table");
            q->v = v;
            q->cap = cap;
        }
        u = &q->v[q->n++];
        *u = (kd_uid_use){.uid = uid};
    }
    u->connections++;
    return KP_OK;
}

void kd_quota_disconnect(kd_quota *q, uid_t uid)
{
    kd_uid_use *u = find(q, uid);
    if (!u || u->connections == 0)
        return; /* not counted: nothing to give back */
    u->connections--;
    prune(q, u);
}

int kd_quota_charge(kd_quota *q, uid_t uid, uint64_t bytes, uint64_t max_uid, uint64_t max_total,
                    kp_error *err)
{
    kd_uid_use *u = find(q, uid);
    if (!u)
        return kp_fail(err, KP_E_INTERNAL, "uid %u charged without a connection",
                       (unsigned)uid);
    u->inflight_bytes += bytes;
    q->inflight_bytes += bytes;
    if (q->inflight_bytes > q->peak_inflight_bytes)
        q->peak_inflight_bytes = q->inflight_bytes;
    if (u->inflight_bytes > max_uid)
        return kp_fail(err, KP_E_BUSY, "uid %u would hold %llu bytes of unanswered "
                       "requests, above clients.max_inflight_bytes_per_uid %llu; wait for "
                       "responses", (unsigned)uid, (unsigned long long)u->inflight_bytes,
                       (unsigned long long)max_uid);
    if (q->inflight_bytes > max_total)
        return kp_fail(err, KP_E_BUSY, "the daemon would hold %llu bytes of unanswered "
                       "requests, above clients.max_inflight_bytes_total %llu; retry later",
                       (unsigned long long)q->inflight_bytes, (unsigned long long)max_total);
    return KP_OK;
}

void kd_quota_refund(kd_quota *q, uid_t uid, uint64_t bytes)
{
    kd_uid_use *u = find(q, uid);
    if (!u)
        return;
    const uint64_t back = bytes < u->inflight_bytes ? bytes : u->inflight_bytes;
    u->inflight_bytes -= back;
    q->inflight_bytes -= back;
    prune(q, u);
}

/* Adds delta to *v, clamped at 0. */
static void move(uint64_t *v, int64_t delta)
{
    if (delta >= 0)
        *v += (uint64_t)delta;
    else
        *v -= (uint64_t)-delta < *v ? (uint64_t)-delta : *v;
}

void kd_quota_partial(kd_quota *q, uid_t uid, int64_t delta)
{
    kd_uid_use *u = find(q, uid);
    if (!u)
        return; /* a refused connection: it reads nothing */
    move(&u->partial_bytes, delta);
    move(&q->partial_bytes, delta);
    if (q->partial_bytes > q->peak_partial_bytes)
        q->peak_partial_bytes = q->partial_bytes;
    move(&u->inflight_bytes, delta);
    move(&q->inflight_bytes, delta);
    if (q->inflight_bytes > q->peak_inflight_bytes)
        q->peak_inflight_bytes = q->inflight_bytes;
    prune(q, u);
}

void kd_quota_output(kd_quota *q, uid_t uid, int64_t delta)
{
    kd_uid_use *u = find(q, uid);
    if (!u)
        return;
    move(&u->output_bytes, delta);
    move(&q->output_bytes, delta);
    if (q->output_bytes > q->peak_output_bytes)
        q->peak_output_bytes = q->output_bytes;
    prune(q, u);
}

bool kd_quota_output_ok(const kd_quota *q, uid_t uid, uint64_t max_uid, uint64_t max_total)
{
    const kd_uid_use *u = find(q, uid);
    return q->output_bytes <= max_total && (!u || u->output_bytes <= max_uid);
}

int kd_quota_map(kd_quota *q, uid_t uid, uint64_t bytes, uint64_t max_uid, kp_error *err)
{
    kd_uid_use *u = find(q, uid);
    if (!u)
        return kp_fail(err, KP_E_INTERNAL, "uid %u maps a region without a connection",
                       (unsigned)uid);
    if (bytes > max_uid || u->region_bytes > max_uid - bytes)
        return kp_fail(err, KP_E_QUOTA_EXCEEDED, "size: %llu bytes would take uid %u to %llu "
                       "bytes of mapped regions, above clients.max_region_bytes_per_uid %llu",
                       (unsigned long long)bytes, (unsigned)uid,
                       (unsigned long long)(u->region_bytes + bytes),
                       (unsigned long long)max_uid);
    u->region_bytes += bytes;
    q->region_bytes += bytes;
    if (q->region_bytes > q->peak_region_bytes)
        q->peak_region_bytes = q->region_bytes;
    return KP_OK;
}

void kd_quota_unmap(kd_quota *q, uid_t uid, uint64_t bytes)
{
    kd_uid_use *u = find(q, uid);
    if (!u)
        return;
    move(&u->region_bytes, -(int64_t)bytes);
    move(&q->region_bytes, -(int64_t)bytes);
    prune(q, u);
}
