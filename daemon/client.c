/*
 * client.c - see client.h.
 */
#include "client.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"

/* ---------------------------------------------------------------------- */
/* Slots                                                                  */
/* ---------------------------------------------------------------------- */

void kd_slot_settle(kd_daemon *d, uint32_t slot)
{
    if (kd_pool_slot(&d->pool, slot)->retiring && kd_sched_slot_jobs(&d->sched, slot) == 0)
        kd_pool_release(&d->pool, slot);
}

void kd_job_left(kd_daemon *d, const kd_job *job)
{
    for (uint32_t i = 0; i < job->nslots; i++)
        kd_slot_settle(d, job->slots[i]);
}

uint64_t kd_client_owner(const kd_client *cl)
{
    /* Bit 63 keeps uid keys apart from client serials. */
    return cl->d->cfg.slots_persist ? (1ull << 63) | cl->peer.uid : cl->serial;
}

/* ---------------------------------------------------------------------- */
/* Lifetime                                                               */
/* ---------------------------------------------------------------------- */

void kd_client_ref(kd_client *cl)
{
    cl->refs++;
}

void kd_client_unref(kd_client *cl)
{
    if (--cl->refs > 0)
        return;
    kd_daemon *d = cl->d;
    if (cl->prev)
        cl->prev->next = cl->next;
    else
        d->clients = cl->next;
    if (cl->next)
        cl->next->prev = cl->prev;
    free(cl);
}

/* Whether a new client is served: KD_DISC_COUNT, or the reason it is
 * refused with the goodbye in e (the refusal is logged). */
static kd_disconnect admit(kd_client *cl, kp_error *e)
{
    kd_daemon *d = cl->d;
    char why[sizeof(e->message)];
    if (!kd_access_allowed(&d->cfg, cl->conn->fd, &cl->peer, why, sizeof(why))) {
        KD_NOTICE("conn %llu: pid %d refused: %s", (unsigned long long)cl->serial,
                  (int)cl->peer.pid, why);
        kp_fail(e, KP_E_PERMISSION_DENIED, "%s", why);
        return KD_DISC_PERMISSION;
    }
    if (d->net.nopen > d->cfg.max_connections) {
        KD_WARN("conn %llu: %u connections open, the limit is %u; refused",
                (unsigned long long)cl->serial, d->net.nopen - 1, d->cfg.max_connections);
        kp_fail(e, KP_E_BUSY, "too many connections (clients.max_connections %u)",
                d->cfg.max_connections);
        return KD_DISC_TOO_MANY;
    }
    if (kd_quota_connect(&d->quota, cl->peer.uid, d->cfg.max_connections_per_uid, e) != KP_OK) {
        KD_NOTICE("conn %llu: pid %d refused: %s", (unsigned long long)cl->serial,
                  (int)cl->peer.pid, e->message);
        return e->code == KP_E_QUOTA_EXCEEDED ? KD_DISC_QUOTA : KD_DISC_IO_ERROR;
    }
    cl->uid_counted = true;
    if (d->draining) {
        kp_fail(e, KP_E_SHUTTING_DOWN, "the daemon is shutting down");
        return KD_DISC_SHUTDOWN;
    }
    return KD_DISC_COUNT;
}

kd_client *kd_client_new(kd_daemon *d, int fd, const kd_peer *peer)
{
    kd_client *cl = calloc(1, sizeof(*cl));
    if (!cl) {
        KD_ERROR("no memory for a new connection; dropped");
        close(fd);
        return NULL;
    }
    cl->d = d;
    cl->serial = ++d->next_serial;
    cl->peer = *peer;
    cl->refs = 1;
    kd_regions_init(&cl->regions, &d->quota, peer->uid);
    cl->conn = kd_conn_new(&d->net, fd, cl->serial, cl);
    if (!cl->conn) {
        free(cl);
        return NULL;
    }
    cl->next = d->clients;
    if (d->clients)
        d->clients->prev = cl;
    d->clients = cl;
    d->stats.connections++;
    d->stats.connections_total++;
    KD_DEBUG("conn %llu: pid %d uid %u gid %u connected", (unsigned long long)cl->serial,
             (int)peer->pid, (unsigned)peer->uid, (unsigned)peer->gid);
    kp_error e;
    kd_disconnect refused = admit(cl, &e);
    if (refused != KD_DISC_COUNT)
        kd_conn_close(cl->conn, refused, &e);
    return cl;
}

static void set_held(bool *flag, uint32_t *count, bool held)
{
    if (*flag != held) {
        *flag = held;
        if (held)
            (*count)++;
        else
            (*count)--;
    }
}

void kd_client_closed(kd_client *cl, kd_disconnect reason)
{
    kd_daemon *d = cl->d;
    KD_DEBUG("conn %llu: closing (%s)", (unsigned long long)cl->serial,
             kd_disconnect_name(reason));
    cl->closing = true;
    set_held(&cl->partial_held, &d->partial_held, false);
    set_held(&cl->output_held, &d->output_held, false);
    d->stats.disconnects[reason]++;
    if (cl->uid_counted)
        kd_quota_disconnect(&d->quota, cl->peer.uid);
    kd_client_ref(cl);
    for (kd_req *r = cl->req_head, *next; r; r = next) {
        next = r->next;
        if (r->job.state != KD_JOB_RUNNING)
            kd_req_drop(r);
    }
    kd_regions_release_all(&cl->regions);
    if (!d->cfg.slots_persist) {
        uint64_t owner = kd_client_owner(cl);
        for (uint32_t i = 0; i < d->pool.nslots && kd_pool_owned(&d->pool, owner); i++) {
            kd_slot *s = kd_pool_slot(&d->pool, i);
            if (s->state == KD_SLOT_FREE || s->retiring || s->owner != owner)
                continue;
            kd_pool_retire(&d->pool, i);
            kd_slot_settle(d, i);
        }
    }
    kd_client_unref(cl);
}

void kd_client_conn_freed(kd_client *cl)
{
    cl->conn = NULL;
    cl->d->stats.connections--;
    /* The transport no longer touches the ring's memory. */
    if (cl->ring_region)
        kd_region_unref(cl->ring_region);
    cl->ring_region = NULL;
    kd_client_unref(cl);
}

/* ---------------------------------------------------------------------- */
/* Requests in flight                                                     */
/* ---------------------------------------------------------------------- */

const kp_limits *kd_client_limits(const kd_client *cl)
{
    return cl->hello_done ? &cl->session.limits : &cl->d->session.limits;
}

bool kd_client_id_in_flight(const kd_client *cl, uint32_t id)
{
    /* Linear: a client holds at most max_inflight_requests requests. */
    for (const kd_req *q = cl->req_head; q; q = q->next) {
        if (q->id == id)
            return true;
    }
    return false;
}

/* Backpressure: reading goes on only below both in-flight limits, and while
 * the uid's frames still arriving and its unread output are within bounds. */
static void steer(kd_client *cl)
{
    if (!cl->conn || cl->closing)
        return;
    const kp_limits *l = kd_client_limits(cl);
    if (cl->inflight < l->max_inflight_requests && cl->inflight_bytes < l->max_inflight_bytes &&
        !cl->partial_held && !cl->output_held)
        kd_conn_resume(cl->conn);
    else
        kd_conn_pause(cl->conn);
}

/* Whether cl holds the oldest frame in progress of its uid: that one is
 * always read on, so that the uid's frames cannot all wait for each other. */
static bool oldest_frame(const kd_client *cl)
{
    uint64_t mine = cl->conn->frame_start_ns;
    for (const kd_client *o = cl->d->clients; o; o = o->next) {
        if (o != cl && o->conn && !o->closing && o->peer.uid == cl->peer.uid &&
            o->conn->frame_start_ns && o->conn->frame_start_ns < mine)
            return false;
    }
    return true;
}

static bool partial_ok(const kd_client *cl)
{
    const kd_daemon *d = cl->d;
    kd_uid_use u = kd_quota_use(&d->quota, cl->peer.uid);
    return (u.partial_bytes <= d->cfg.max_inflight_bytes_per_uid &&
            d->quota.partial_bytes <= d->cfg.max_inflight_bytes_total) ||
           oldest_frame(cl);
}

/* Within the bounds, or cl has read all its own output: only the
 * connections that leave answers unread wait. */
static bool output_ok(const kd_client *cl)
{
    const kd_daemon *d = cl->d;
    return (cl->conn && cl->conn->out_bytes == 0) ||
           kd_quota_output_ok(&d->quota, cl->peer.uid, d->cfg.max_output_bytes_per_uid,
                              d->cfg.max_output_bytes_total);
}

/* Bytes went back: held clients whose bounds are met read again. */
static void review(kd_daemon *d)
{
    for (kd_client *o = d->clients; o && (d->partial_held || d->output_held); o = o->next) {
        if (!o->conn || o->closing)
            continue;
        bool changed = false;
        if (o->partial_held && partial_ok(o)) {
            set_held(&o->partial_held, &d->partial_held, false);
            changed = true;
        }
        if (o->output_held && output_ok(o)) {
            set_held(&o->output_held, &d->output_held, false);
            changed = true;
        }
        if (changed)
            steer(o);
    }
}

void kd_client_partial(kd_client *cl, int64_t delta)
{
    kd_daemon *d = cl->d;
    kd_quota_partial(&d->quota, cl->peer.uid, delta);
    if (delta < 0) {
        if (d->partial_held)
            review(d);
        return;
    }
    if (!cl->conn || cl->closing || cl->partial_held || partial_ok(cl))
        return;
    KD_INFO("conn %llu: frames still arriving from uid %u exceed "
            "clients.max_inflight_bytes_per_uid or _total; reading waits",
            (unsigned long long)cl->serial, (unsigned)cl->peer.uid);
    set_held(&cl->partial_held, &d->partial_held, true);
    steer(cl);
}

void kd_client_output(kd_client *cl, int64_t delta)
{
    kd_daemon *d = cl->d;
    kd_quota_output(&d->quota, cl->peer.uid, delta);
    if (delta < 0) {
        if (d->output_held)
            review(d);
        return;
    }
    if (!cl->conn || cl->closing || cl->output_held ||
        kd_quota_output_ok(&d->quota, cl->peer.uid, d->cfg.max_output_bytes_per_uid,
                           d->cfg.max_output_bytes_total))
        return;
    KD_INFO("conn %llu: unread output of uid %u exceeds clients.max_output_bytes_per_uid or "
            "_total; reading waits", (unsigned long long)cl->serial, (unsigned)cl->peer.uid);
    set_held(&cl->output_held, &d->output_held, true);
    steer(cl);
}


kd_req *kd_req_new(kd_client *cl, uint8_t *body, size_t len, uint64_t arrival_ns)
{
    kd_req *r = calloc(1, sizeof(*r));
    if (!r) {
        free(body);
        return NULL;
    }
    r->client = cl;
    r->body = body;
    r->body_len = len;
    r->arrival_ns = arrival_ns;
    r->fd = -1;
    kp_msg_init(&r->msg);
    return r;
}

void kd_req_discard(kd_req *r)
{
    if (r->fd >= 0)
        close(r->fd);
    kp_msg_close(&r->msg);
    free(r->body);
    free(r);
}

int kd_req_track(kd_req *r, kp_error *e)
{
    kd_client *cl = r->client;
    kd_daemon *d = cl->d;
    r->tracked = true;
    r->prev = cl->req_tail;
    if (cl->req_tail)
        cl->req_tail->next = r;
    else
        cl->req_head = r;
    cl->req_tail = r;
    cl->inflight++;
    cl->inflight_bytes += r->body_len;
    cl->refs++;
    steer(cl);
    /* The frame counts toward its uid's unanswered bytes in every case (the
     * answer gives them back). */
    return kd_quota_charge(&d->quota, cl->peer.uid, r->body_len,
                           d->cfg.max_inflight_bytes_per_uid, d->cfg.max_inflight_bytes_total, e);
}

/*
 * The last step of every request: it leaves the client's unanswered list
 * first (so nothing the send may trigger, such as a close on a broken pipe,
 * can drop it twice), then its response (if any) goes out, then it is freed.
 */
static void finish(kd_req *r, kd_out *o)
{
    kd_client *cl = r->client;
    kd_daemon *d = cl->d;
    if (r->prev)
        r->prev->next = r->next;
    else
        cl->req_head = r->next;
    if (r->next)
        r->next->prev = r->prev;
    else
        cl->req_tail = r->prev;
    r->prev = r->next = NULL;
    cl->inflight--;
    cl->inflight_bytes -= r->body_len;
    kd_quota_refund(&d->quota, cl->peer.uid, r->body_len);
    d->stats.requests++;
    if (o && cl->conn)
        kd_conn_send(cl->conn, o);
    else
        kd_out_free(o);
    if (r->release)
        r->release(r);
    kd_req_discard(r);
    if (!cl->closing)
        steer(cl);
    kd_client_unref(cl);
}

kd_out *kd_req_frame(kd_req *r)
{
    kd_client *cl = r->client;
    if (!cl->conn || cl->closing) { /* the answer would be discarded */
        finish(r, NULL);
        return NULL;
    }
    kd_out *o = kd_out_new(cl->conn);
    if (!o) {
        kp_error e;
        kp_fail(&e, KP_E_NO_MEMORY, "no memory for the response");
        kd_req_fail(r, &e);
    }
    return o;
}

void kd_req_reply_empty(kd_req *r)
{
    kp_error e;
    kd_out *o = kd_req_frame(r);
    if (o)
        kd_req_reply(r, o, kp_empty_result_encode(&o->w, r->id, &e), &e);
}

void kd_req_reply(kd_req *r, kd_out *o, int encode_rc, const kp_error *encode_err)
{
    kd_client *cl = r->client;
    if (encode_rc != KP_OK) {
        KD_ERROR("conn %llu: encoding the %s response failed: %s",
                 (unsigned long long)cl->serial, kp_method_name(r->method),
                 encode_err->message);
        kd_out_free(o);
        kp_error e;
        kp_fail(&e, KP_E_INTERNAL, "encoding the response failed: %s", encode_err->message);
        kd_req_fail(r, &e);
        return;
    }
    if (r->method == KP_METHOD_PREFILL)
        kd_stats_latency(&cl->d->stats, (uv_hrtime() - r->arrival_ns) / 1000);
    finish(r, o);
}

void kd_req_fail(kd_req *r, const kp_error *e)
{
    kd_client *cl = r->client;
    kd_stats_error(&cl->d->stats, e->code);
    KD_DEBUG("conn %llu: request %u (%s): %s: %s", (unsigned long long)cl->serial, r->id,
             r->msg.name ? r->msg.name : "?", kp_code_name(e->code), e->message);
    kd_out *o = cl->conn && !cl->closing ? kd_out_new(cl->conn) : NULL;
    kp_error enc;
    if (o && kp_error_response_encode(&o->w, r->id, e, &enc) != KP_OK) {
        kd_out_free(o);
        o = NULL;
    }
    bool closes = kp_code_closes(e->code);
    kd_client_ref(cl);
    finish(r, o);
    if (closes && cl->conn)
        kd_conn_close(cl->conn, e->code == KP_E_UNSUPPORTED_VERSION ? KD_DISC_VERSION
                                                                     : KD_DISC_PROTOCOL, e);
    kd_client_unref(cl);
}

void kd_req_drop(kd_req *r)
{
    if (r->job.state == KD_JOB_QUEUED) {
        kd_daemon *d = r->client->d;
        kd_sched_cancel(&d->sched, &r->job);
        kd_job_left(d, &r->job);
    }
    finish(r, NULL);
}
