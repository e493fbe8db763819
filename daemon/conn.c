/*
 * conn.c - see conn.h.
 */
#define _GNU_SOURCE /* MSG_CMSG_CLOEXEC */
#include "conn.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "daemon.h"
#include "dispatch.h"
#include "exec.h"
#include "log.h"

/* sendmsg takes at most IOV_MAX iovecs per call. */
#define SEND_IOV_MAX (IOV_MAX < 1024 ? IOV_MAX : 1024)
/* Sent frames a connection keeps for its next responses: their writers'
 * buffers are reused instead of allocated and freed per response (one per
 * request in flight, for the clients that keep one or two). */
#define SPARE_FRAMES 2

static void on_poll(uv_poll_t *h, int status, int events);
static void finish_close(kd_conn *c);

/* ---------------------------------------------------------------------- */
/* Lifetime                                                               */
/* ---------------------------------------------------------------------- */

void kd_conn_ref(kd_conn *c)
{
    c->refs++;
}

void kd_conn_unref(kd_conn *c)
{
    if (--c->refs > 0)
        return;
    kd_daemon *d = c->d;
    if (c->prev)
        c->prev->next = c->next;
    else
        d->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    free(c);
    kd_daemon_conn_freed(d);
}

uint64_t kd_conn_owner(const kd_conn *c)
{
    /* Bit 63 keeps uid keys apart from connection serials. */
    return c->d->cfg.slots_persist ? (1ull << 63) | c->peer.uid : c->serial;
}

static void set_events(kd_conn *c, int events)
{
    if (c->poll_closed || events == c->events)
        return;
    c->events = events;
    if (events)
        uv_poll_start(&c->poll, events, on_poll);
    else
        uv_poll_stop(&c->poll);
}

static const kp_limits *limits(const kd_conn *c)
{
    return c->hello_done ? &c->session.limits : &c->d->session.limits;
}

/* Backpressure: more frames are read only while these hold. */
static bool can_read(const kd_conn *c)
{
    const kp_limits *l = limits(c);
    return !c->closing && c->inflight < l->max_inflight_requests &&
           c->inflight_bytes < l->max_inflight_bytes;
}

static void update_events(kd_conn *c)
{
    if (c->ring_on) /* the socket carries doorbells: always read, never wait to write */
        set_events(c, c->closing ? 0 : UV_READABLE);
    else
        set_events(c, (can_read(c) ? UV_READABLE : 0) | (c->out_head ? UV_WRITABLE : 0));
}

/* Whether a new connection is served: KD_DISC_COUNT, or the reason it is
 * refused with the goodbye in e (the refusal is logged). */
static kd_disconnect admit(kd_conn *c, kp_error *e)
{
    kd_daemon *d = c->d;
    char why[sizeof(e->message)];
    if (!kd_access_allowed(&d->cfg, c->fd, &c->peer, why, sizeof(why))) {
        KD_NOTICE("conn %llu: pid %d refused: %s", (unsigned long long)c->serial,
                  (int)c->peer.pid, why);
        kp_fail(e, KP_E_PERMISSION_DENIED, "%s", why);
        return KD_DISC_PERMISSION;
    }
    if (d->nconns > d->cfg.max_connections) {
        KD_WARN("conn %llu: %u connections open, the limit is %u; refused",
                (unsigned long long)c->serial, d->nconns - 1, d->cfg.max_connections);
        kp_fail(e, KP_E_BUSY, "too many connections (clients.max_connections %u)",
                d->cfg.max_connections);
        return KD_DISC_TOO_MANY;
    }
    if (kd_quota_connect(&d->quota, c->peer.uid, d->cfg.max_connections_per_uid, e) != KP_OK) {
        KD_NOTICE("conn %llu: pid %d refused: %s", (unsigned long long)c->serial,
                  (int)c->peer.pid, e->message);
        return e->code == KP_E_QUOTA_EXCEEDED ? KD_DISC_QUOTA : KD_DISC_IO_ERROR;
    }
    c->uid_counted = true;
    if (d->draining) {
        kp_fail(e, KP_E_SHUTTING_DOWN, "the daemon is shutting down");
        return KD_DISC_SHUTDOWN;
    }
    return KD_DISC_COUNT;
}

kd_conn *kd_conn_new(kd_daemon *d, int fd, const kd_peer *peer)
{
    kd_conn *c = calloc(1, sizeof(*c));
    uint8_t *rbuf = malloc(KD_READ_BUFFER_BYTES);
    int rc = c && rbuf ? uv_poll_init(d->loop, &c->poll, fd) : UV_ENOMEM;
    if (rc != 0) {
        KD_ERROR("cannot set up a new connection (%s); dropped", uv_strerror(rc));
        free(c);
        free(rbuf);
        close(fd);
        return NULL;
    }
    c->d = d;
    c->serial = ++d->next_serial;
    c->fd = fd;
    c->poll.data = c;
    c->peer = *peer;
    c->rbuf = rbuf;
    c->refs = 1;
    kp_reader_init(&c->reader, KP_HELLO_MAX_FRAME_BYTES);
    kd_regions_init(&c->regions);
    c->next = d->conns;
    if (d->conns)
        d->conns->prev = c;
    d->conns = c;
    d->nconns++;
    d->stats.connections++;
    d->stats.connections_total++;
    KD_DEBUG("conn %llu: pid %d uid %u gid %u connected", (unsigned long long)c->serial,
             (int)peer->pid, (unsigned)peer->uid, (unsigned)peer->gid);

    kp_error e;
    kd_disconnect refused = admit(c, &e);
    if (refused != KD_DISC_COUNT)
        kd_conn_close(c, refused, &e);
    else
        update_events(c);
    return c;
}

/* Drops every unanswered request that has not reached the device. */
static void drop_waiting_requests(kd_conn *c)
{
    kd_req *r = c->req_head;
    while (r) {
        kd_req *next = r->next;
        if (r->job.state != KD_JOB_RUNNING)
            kd_req_drop(r);
        r = next;
    }
}

/* Frees the frames nobody has started to send (a partly sent one must be
 * finished, or the stream would be cut mid-frame). */
static void drop_unsent(kd_conn *c)
{
    kd_out **p = c->out_head && c->out_head->started ? &c->out_head->next : &c->out_head;
    while (*p) {
        kd_out *o = *p;
        *p = o->next;
        c->out_bytes -= o->bytes;
        kd_out_free(o);
    }
    c->out_tail = NULL;
    for (kd_out *o = c->out_head; o; o = o->next)
        c->out_tail = o;
}

static void enqueue(kd_conn *c, kd_out *o);

void kd_conn_close(kd_conn *c, kd_disconnect reason, const kp_error *goodbye)
{
    if (c->closing)
        return;
    kd_daemon *d = c->d;
    KD_DEBUG("conn %llu: closing (%s)", (unsigned long long)c->serial, kd_disconnect_name(reason));
    c->closing = true;
    d->nconns--;
    if (c->uid_counted)
        kd_quota_disconnect(&d->quota, c->peer.uid);
    d->stats.disconnects[reason]++;
    c->close_deadline = uv_hrtime() + (uint64_t)KD_CLOSE_FLUSH_MS * 1000000;

    drop_waiting_requests(c);
    kd_regions_release_all(&c->regions);
    if (!d->cfg.slots_persist) {
        uint64_t owner = kd_conn_owner(c);
        for (uint32_t i = 0; i < d->pool.nslots && kd_pool_owned(&d->pool, owner); i++) {
            kd_slot *s = kd_pool_slot(&d->pool, i);
            if (s->state == KD_SLOT_FREE || s->retiring || s->owner != owner)
                continue;
            kd_pool_retire(&d->pool, i);
            if (kd_sched_slot_jobs(&d->sched, i) == 0)
                kd_pool_release(&d->pool, i);
        }
    }
    for (uint32_t i = 0; i < c->nfds; i++)
        close(c->fds[i]);
    c->nfds = 0;
    kp_reader_close(&c->reader);
    if (goodbye && !c->poll_closed) {
        kd_out *o = kd_out_new(c);
        kp_error e;
        if (o && kp_goodbye_encode(&o->w, goodbye, &e) == KP_OK)
            enqueue(c, o); /* may finish the close when the socket takes it all */
        else
            kd_out_free(o);
    }
    if (!c->out_head)
        finish_close(c);
    else
        update_events(c);
    /* Dropped requests may have unblocked others. */
    kd_daemon_pump(d);
}

static void on_closed(uv_handle_t *h)
{
    kd_conn *c = h->data;
    close(c->fd);
    kd_out *frames[2] = {c->out_head, c->spare};
    for (int k = 0; k < 2; k++) {
        while (frames[k]) {
            kd_out *o = frames[k];
            frames[k] = o->next;
            kd_out_free(o);
        }
    }
    c->out_head = c->out_tail = c->spare = NULL;
    c->nspare = 0;
    c->out_bytes = 0;
    free(c->rbuf);
    c->rbuf = NULL;
    c->d->stats.connections--;
    if (c->ring_region)
        kd_region_unref(c->ring_region);
    c->d->nrings -= c->ring_on;
    c->ring_region = NULL;
    c->ring_on = false;
    kd_conn_unref(c);
}

static void finish_close(kd_conn *c)
{
    if (c->poll_closed)
        return;
    c->poll_closed = true;
    uv_close((uv_handle_t *)&c->poll, on_closed);
}

/* ---------------------------------------------------------------------- */
/* Output                                                                 */
/* ---------------------------------------------------------------------- */

kd_out *kd_out_new(kd_conn *c)
{
    uint64_t cap = c->hello_done ? c->session.limits.max_frame_bytes : KP_HELLO_MAX_FRAME_BYTES;
    kd_out *o = c->spare;
    if (o) {
        c->spare = o->next;
        c->nspare--;
        o->next = NULL;
        kp_writer_set_max_frame(&o->w, cap);
        return o;
    }
    o = calloc(1, sizeof(*o));
    if (!o || kp_writer_init(&o->w, cap) != KP_OK) {
        free(o);
        return NULL;
    }
    return o;
}

int kd_out_keep(kd_out *o, void *buf)
{
    if (o->nkeep == o->keep_cap) {
        uint32_t cap = o->keep_cap ? 2 * o->keep_cap : 4;
        void **keep = realloc(o->keep, cap * sizeof(*keep));
        if (!keep) {
            free(buf);
            return KP_E_NO_MEMORY;
        }
        o->keep = keep;
        o->keep_cap = cap;
    }
    o->keep[o->nkeep++] = buf;
    return KP_OK;
}

/* A sent frame: kept for the connection's next response while it has
 * room for spares, else freed. */
static void out_recycle(kd_conn *c, kd_out *o)
{
    if (c->nspare == SPARE_FRAMES || c->closing) {
        kd_out_free(o);
        return;
    }
    for (uint32_t i = 0; i < o->nkeep; i++)
        free(o->keep[i]);
    o->nkeep = 0;
    o->iov_index = o->iov_offset = 0;
    o->bytes = 0;
    o->started = false;
    o->next = c->spare;
    c->spare = o;
    c->nspare++;
}

void kd_out_free(kd_out *o)
{
    if (!o)
        return;
    kp_writer_close(&o->w);
    for (uint32_t i = 0; i < o->nkeep; i++)
        free(o->keep[i]);
    free(o->keep);
    free(o);
}

static void check_output_limits(kd_conn *c)
{
    const kd_config *cfg = &c->d->cfg;
    if (c->closing)
        return;
    if (c->out_bytes > cfg->output_hard_limit) {
        KD_NOTICE("conn %llu: %llu bytes of unread responses exceed the hard limit; closing",
                  (unsigned long long)c->serial, (unsigned long long)c->out_bytes);
        drop_unsent(c);
        kp_error e;
        kp_fail(&e, KP_E_BUSY, "unread responses exceed the daemon's output limit of %llu bytes",
                (unsigned long long)cfg->output_hard_limit);
        kd_conn_close(c, KD_DISC_OUTPUT_LIMIT, &e);
        return;
    }
    if (c->out_bytes > cfg->output_soft_limit) {
        if (!c->over_soft_since)
            c->over_soft_since = uv_hrtime();
    } else {
        c->over_soft_since = 0;
    }
}

/* The unsent part of the head frame as at most SEND_IOV_MAX iovecs. */
static size_t out_iov(const kd_out *o, struct iovec *v)
{
    size_t n, cnt = 0;
    const struct iovec *iov = kp_writer_iov(&o->w, &n);
    for (size_t i = o->iov_index; i < n && cnt < SEND_IOV_MAX; i++, cnt++) {
        v[cnt] = iov[i];
        if (i == o->iov_index) {
            v[cnt].iov_base = (uint8_t *)v[cnt].iov_base + o->iov_offset;
            v[cnt].iov_len -= o->iov_offset;
        }
    }
    return cnt;
}

/* Marks `sent` bytes of the head frame written; frees it when complete. */
static void out_advance(kd_conn *c, size_t sent)
{
    kd_out *o = c->out_head;
    size_t n;
    const struct iovec *iov = kp_writer_iov(&o->w, &n);
    o->started = true;
    c->out_bytes -= (uint64_t)sent;
    while (sent > 0 && o->iov_index < n) {
        size_t avail = iov[o->iov_index].iov_len - o->iov_offset;
        size_t step = sent < avail ? sent : avail;
        o->iov_offset += step;
        sent -= step;
        if (o->iov_offset == iov[o->iov_index].iov_len) {
            o->iov_index++;
            o->iov_offset = 0;
        }
    }
    if (o->iov_index == n) {
        c->out_head = o->next;
        if (!c->out_head)
            c->out_tail = NULL;
        out_recycle(c, o);
    }
}

/* One byte on the socket wakes a ring peer that sleeps on it.  A full socket
 * means a wake-up is pending already. */
static void ring_doorbell(kd_conn *c)
{
    static const uint8_t bell = 0;
    (void)send(c->fd, &bell, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    c->d->stats.ring_doorbells++;
}

/* Copies queued frames into the ring while they fit; false when the
 * client's counter was impossible (the connection is closed). */
static bool ring_write(kd_conn *c)
{
    while (c->out_head) {
        struct iovec v[SEND_IOV_MAX];
        size_t cnt = out_iov(c->out_head, v), put;
        kp_error e;
        if (kp_ring_writev(&c->ring, v, cnt, &put, &e) != KP_OK) {
            KD_DEBUG("conn %llu: %s", (unsigned long long)c->serial, e.message);
            drop_unsent(c);
            kd_conn_close(c, KD_DISC_PROTOCOL, NULL);
            finish_close(c);
            return false;
        }
        if (put == 0)
            break;
        out_advance(c, put);
    }
    return true;
}

/* Writes queued frames into the ring until it is full.  A sleeping loop
 * left with frames to write asks the client to ring when it makes room, and
 * looks once more. */
static void ring_flush(kd_conn *c)
{
    uint64_t before = c->ring.head;
    for (;;) {
        if (!ring_write(c))
            return; /* closed */
        if (!c->out_head || kd_daemon_awake(c->d))
            break;
        kd_conn_ring_sleep(c, true); /* publishes "ring me when there is room" */
        if (!kp_ring_writable(&c->ring))
            break;
    }
    if (c->ring.head != before && kp_ring_peer_wants(&c->ring, KP_RING_WANT_DATA))
        ring_doorbell(c);
    check_output_limits(c);
    /* Closing does not wait for the client to drain the ring: what fits of
     * the goodbye is there. */
    if (c->closing)
        finish_close(c);
}

/* The ring.attach answer has left on the socket: frames take the ring now. */
static void ring_start(kd_conn *c)
{
    c->ring_on = true;
    c->d->nrings++;
    kd_conn_ring_sleep(c, !kd_daemon_awake(c->d));
    update_events(c);
}

/* Writes queued frames until the socket is full or the budget is spent. */
static void flush(kd_conn *c)
{
    if (c->ring_on) {
        ring_flush(c);
        return;
    }
    uint64_t budget = KD_WRITE_BUDGET_BYTES;
    while (c->out_head && budget > 0) {
        struct iovec v[SEND_IOV_MAX];
        struct msghdr m = {.msg_iov = v, .msg_iovlen = out_iov(c->out_head, v)};
        ssize_t sent = sendmsg(c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent < 0) {
            if (errno == EAGAIN || errno == EINTR)
                break;
            KD_DEBUG("conn %llu: send: %s", (unsigned long long)c->serial, strerror(errno));
            drop_unsent(c);
            kd_conn_close(c, errno == EPIPE || errno == ECONNRESET ? KD_DISC_PEER_CLOSED
                                                                   : KD_DISC_IO_ERROR, NULL);
            finish_close(c);
            return;
        }
        budget = (uint64_t)sent >= budget ? 0 : budget - (uint64_t)sent;
        out_advance(c, (size_t)sent);
    }
    check_output_limits(c);
    if (c->closing && !c->out_head)
        finish_close(c);
    else if (c->ring_region && !c->out_head && !c->closing)
        ring_start(c);
    else
        update_events(c);
}

static void enqueue(kd_conn *c, kd_out *o)
{
    o->bytes = kp_writer_frame_bytes(&o->w);
    c->out_bytes += o->bytes;
    if (c->out_tail)
        c->out_tail->next = o;
    else
        c->out_head = o;
    c->out_tail = o;
    /* Try at once: most responses fit the socket buffer, and this saves a
     * loop turn of latency. */
    if (c->out_head == o)
        flush(c);
    else
        check_output_limits(c);
}

void kd_conn_send(kd_conn *c, kd_out *o)
{
    if (c->closing) {
        kd_out_free(o);
        return;
    }
    enqueue(c, o);
}

/* ---------------------------------------------------------------------- */
/* Input                                                                  */
/* ---------------------------------------------------------------------- */

static bool ring_drain_socket(kd_conn *c, bool may_close);

int kd_conn_take_fd(kd_conn *c)
{
    /* Over a ring the descriptor rides on a doorbell sent before the frame
     * (§Frame ring), which the loop may not have read yet. */
    if (c->nfds == 0 && c->ring_on)
        ring_drain_socket(c, false);
    if (c->nfds == 0)
        return -1;
    int fd = c->fds[0];
    memmove(c->fds, c->fds + 1, (c->nfds - 1) * sizeof(int));
    c->nfds--;
    return fd;
}

static void protocol_close(kd_conn *c, const kp_error *e)
{
    KD_DEBUG("conn %llu: %s: %s", (unsigned long long)c->serial, kp_code_name(e->code),
             e->message);
    kd_stats_error(&c->d->stats, e->code);
    kd_conn_close(c, e->code == KP_E_FRAME_TOO_LARGE ? KD_DISC_FRAME_TOO_LARGE : KD_DISC_PROTOCOL,
                  e);
}

/* Takes the descriptors of one recvmsg into the FIFO; false on a protocol
 * violation (then every descriptor of this message is closed). */
static bool collect_fds(kd_conn *c, struct msghdr *m, kp_error *e)
{
    bool ok = !(m->msg_flags & MSG_CTRUNC);
    if (!ok)
        kp_fail(e, KP_E_PROTOCOL, "file descriptors: control data truncated (more than %d "
                "descriptors in one message)", KP_MAX_PENDING_FDS);
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(m); cm; cm = CMSG_NXTHDR(m, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
            if (ok && c->nfds == KP_MAX_PENDING_FDS) {
                ok = false;
                kp_fail(e, KP_E_PROTOCOL, "file descriptors: more than %d sent and not claimed "
                        "by a frame", KP_MAX_PENDING_FDS);
            }
            if (ok)
                c->fds[c->nfds++] = fd;
            else
                close(fd);
        }
    }
    return ok;
}

/* recvmsg into buf; returns bytes, 0 at EOF, -1 with errno, or -2 after a
 * descriptor protocol violation (the connection is closing). */
static ssize_t receive(kd_conn *c, void *buf, size_t len)
{
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int) * KP_MAX_PENDING_FDS)];
    } control;
    struct iovec v = {buf, len};
    struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = control.buf,
                       .msg_controllen = sizeof(control.buf)};
    ssize_t n = recvmsg(c->fd, &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0)
        return -1;
    kp_error e;
    if (!collect_fds(c, &m, &e)) {
        protocol_close(c, &e);
        return -2;
    }
    return n;
}

/* Frame bytes from the ring, with receive()'s conventions (-1 and EAGAIN
 * when it is empty, -2 after a protocol violation). */
static ssize_t ring_receive(kd_conn *c, void *buf, size_t len)
{
    size_t got;
    kp_error e;
    if (kp_ring_read(&c->ring, buf, len, &got, &e) != KP_OK) {
        protocol_close(c, &e);
        return -2;
    }
    if (got == 0) {
        errno = EAGAIN;
        return -1;
    }
    return (ssize_t)got;
}

/*
 * Reads a ring connection's socket: doorbells, to be discarded, and passed
 * descriptors.  A bounded number of reads (a client ringing without pause
 * cannot hold the loop).  At EOF or an error the connection closes when
 * may_close (else the next poll finds it again); returns false then.
 */
static bool ring_drain_socket(kd_conn *c, bool may_close)
{
    uint8_t bells[256];
    for (int i = 0; i < 16; i++) {
        ssize_t n = receive(c, bells, sizeof(bells));
        if (n == -2)
            return false;
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return true;
        if (n <= 0) {
            if (may_close)
                kd_conn_close(c, n == 0 || errno == ECONNRESET ? KD_DISC_PEER_CLOSED
                                                               : KD_DISC_IO_ERROR, NULL);
            return false;
        }
    }
    return true;
}

static void deliver(kd_conn *c)
{
    size_t len;
    uint8_t *body = kp_reader_take(&c->reader, &len);
    kd_dispatch_frame(c, body, len, uv_hrtime());
}

/* Feeds buffered bytes to the reader while reading is allowed. */
static void process_buffered(kd_conn *c)
{
    kd_conn_ref(c); /* a frame may close the connection under us */
    while (c->rpos < c->rlen && can_read(c)) {
        const uint8_t *data = c->rbuf + c->rpos;
        size_t len = c->rlen - c->rpos;
        kp_error e;
        int rc = kp_reader_feed(&c->reader, &data, &len, &e);
        c->rpos = c->rlen - len;
        if (rc == KP_READ_FRAME)
            deliver(c);
        else if (rc < 0)
            protocol_close(c, &e);
    }
    kd_conn_unref(c);
}

static void read_some(kd_conn *c)
{
    uint64_t budget = KD_READ_BUDGET_BYTES;
    uint64_t ring_tail = c->ring.tail;
    kd_conn_ref(c);
    while (budget > 0 && can_read(c)) {
        if (c->rpos < c->rlen) {
            process_buffered(c);
            continue;
        }
        uint8_t *dst;
        size_t space = kp_reader_space(&c->reader, &dst);
        if (!dst) { /* a frame waits to be taken, or the reader died (out of memory) */
            kp_error e;
            int rc = kp_reader_commit(&c->reader, 0, &e);
            if (rc == KP_READ_FRAME)
                deliver(c);
            else
                protocol_close(c, &e);
            continue;
        }
        /* A large body goes straight into the frame; everything else through
         * the buffer, which also picks up the frames that follow. */
        bool direct = c->reader.header_have == KP_FRAME_HEADER_BYTES &&
                      space >= KD_READ_BUFFER_BYTES;
        ssize_t n = c->ring_on ? ring_receive(c, direct ? dst : c->rbuf,
                                              direct ? space : KD_READ_BUFFER_BYTES)
                    : direct ? receive(c, dst, space) : receive(c, c->rbuf, KD_READ_BUFFER_BYTES);
        if (n == -2)
            break;
        if (n < 0) {
            if (errno != EAGAIN && errno != EINTR)
                kd_conn_close(c, errno == ECONNRESET ? KD_DISC_PEER_CLOSED : KD_DISC_IO_ERROR,
                              NULL);
            break;
        }
        if (n == 0) {
            kd_conn_close(c, KD_DISC_PEER_CLOSED, NULL);
            break;
        }
        budget = (uint64_t)n >= budget ? 0 : budget - (uint64_t)n;
        if (!direct) {
            c->rpos = 0;
            c->rlen = (size_t)n;
            process_buffered(c);
            continue;
        }
        kp_error e;
        int rc = kp_reader_commit(&c->reader, (size_t)n, &e);
        if (rc == KP_READ_FRAME)
            deliver(c);
        else if (rc < 0)
            protocol_close(c, &e);
    }
    if (c->ring_on && !c->closing && c->ring.tail != ring_tail) {
        kd_daemon_stay_awake(c->d); /* a ring client at work: keep polling its ring */
        if (kp_ring_peer_wants(&c->ring, KP_RING_WANT_SPACE))
            ring_doorbell(c);
    }
    kd_conn_update(c);
    kd_conn_unref(c);
}

void kd_conn_update(kd_conn *c)
{
    if (c->closing)
        return;
    update_events(c);
    if ((c->rpos < c->rlen || (c->ring_on && kp_ring_readable(&c->ring))) && can_read(c))
        kd_daemon_queue_input(c->d, c);
}

void kd_conn_process_input(kd_conn *c)
{
    if (c->closing)
        return;
    if (c->ring_on) { /* reads the ring too, then updates */
        read_some(c);
        return;
    }
    kd_conn_ref(c);
    process_buffered(c);
    kd_conn_update(c);
    kd_conn_unref(c);
}

static void on_poll(uv_poll_t *h, int status, int events)
{
    kd_conn *c = h->data;
    if (status < 0) {
        kd_conn_close(c, KD_DISC_IO_ERROR, NULL);
        finish_close(c);
        return;
    }
    kd_conn_ref(c);
    if (c->ring_on) {
        /* A doorbell: the client wrote or read while this loop slept. */
        if (ring_drain_socket(c, true)) {
            kd_daemon_stay_awake(c->d);
            kd_conn_ring_poll(c);
        }
    } else {
        if (events & UV_WRITABLE)
            flush(c);
        if ((events & UV_READABLE) && !c->closing)
            read_some(c);
    }
    kd_conn_unref(c);
}

/* ---------------------------------------------------------------------- */
/* The frame ring                                                         */
/* ---------------------------------------------------------------------- */

int kd_conn_attach_ring(kd_conn *c, kd_region *reg, uint64_t size, kp_error *err)
{
    if (c->ring_region)
        return kp_fail(err, KP_E_INVALID_PARAMS, "this connection has a frame ring already");
    if (c->inflight != 1 || c->rpos != c->rlen || c->reader.header_have != 0 || c->out_head)
        return kp_fail(err, KP_E_INVALID_PARAMS, "ring.attach must be the only request in "
                       "flight, with nothing sent after it until its answer");
    kd_region_ref(reg);
    c->ring_region = reg;
    kp_ring_init(&c->ring, reg->host, size, true, KP_RING_WANT_DATA);
    return KP_OK;
}

void kd_conn_ring_poll(kd_conn *c)
{
    if (!c->ring_on || c->closing)
        return;
    kd_conn_ref(c);
    if (c->out_head && kp_ring_writable(&c->ring))
        ring_flush(c);
    if (!c->closing && can_read(c) && (c->rpos < c->rlen || kp_ring_readable(&c->ring)))
        read_some(c);
    kd_conn_unref(c);
}

bool kd_conn_ring_sleep(kd_conn *c, bool asleep)
{
    if (!c->ring_on || c->closing)
        return true;
    if (!asleep) {
        kp_ring_set_wants(&c->ring, 0);
        return true;
    }
    bool reading = can_read(c);
    kp_ring_set_wants(&c->ring, (reading ? KP_RING_WANT_DATA : 0) |
                                (c->out_head ? KP_RING_WANT_SPACE : 0));
    return !(reading && kp_ring_readable(&c->ring)) &&
           !(c->out_head && kp_ring_writable(&c->ring));
}

void kd_conn_housekeeping(kd_conn *c, uint64_t now)
{
    if (c->closing) {
        if (now >= c->close_deadline)
            finish_close(c);
        return;
    }
    const kd_config *cfg = &c->d->cfg;
    if (c->over_soft_since &&
        now - c->over_soft_since > (uint64_t)cfg->output_soft_seconds * 1000000000ull) {
        KD_NOTICE("conn %llu: unread responses above the soft limit for %u s; closing",
                  (unsigned long long)c->serial, cfg->output_soft_seconds);
        drop_unsent(c);
        kp_error e;
        kp_fail(&e, KP_E_BUSY, "unread responses stayed above %llu bytes for %u seconds",
                (unsigned long long)cfg->output_soft_limit, cfg->output_soft_seconds);
        kd_conn_close(c, KD_DISC_OUTPUT_LIMIT, &e);
    }
}
