/*
 * io.c - moving frames: the send queue (sendmsg of the writers' iovec lists,
 * straight from the callers' tensor memory, with SCM_RIGHTS on the first
 * byte of a frame that passes a descriptor), the receive side (kp_reader,
 * large bodies received in place), the same two over a frame ring once
 * ring.attach succeeded (calls.c; the socket then carries doorbells),
 * dispatch of responses to their requests by id, connection failure, and
 * the wait loop of blocking calls.
 *
 * Invariants:
 *   - a request is in the id table from submission to completion, and in the
 *     send queue until its last byte is written;
 *   - a request completes exactly once: by its response, by a connection
 *     failure, or by kdac_client_close;
 *   - once c->failed is set nothing is written or read any more.
 */
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "client_int.h"

/* ---------------------------------------------------------------------- */
/* Requests and the id table                                              */
/* ---------------------------------------------------------------------- */

pending *pending_new(kdac_client *c, kp_method m, kdac_cb cb, void *data, decode_fn decode)
{
    pending *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    uint64_t cap = c->hello_done ? c->session.limits.max_frame_bytes : KP_HELLO_MAX_FRAME_BYTES;
    if (c->spare_writer) {
        p->w = c->spare_writer;
        c->spare_writer = NULL;
        kp_writer_set_max_frame(p->w, cap);
    } else if (!(p->w = malloc(sizeof(*p->w))) || kp_writer_init(p->w, cap) != KP_OK) {
        free(p->w);
        free(p);
        return NULL;
    }
    p->method = m;
    p->cb = cb;
    p->data = data;
    p->decode = decode;
    p->fd = -1;
    return p;
}

/* A writer done with its frame: kept for the client's next request (its
 * buffers reused; the next encode clears it) unless one is kept already. */
static void writer_give_back(kdac_client *c, pending *p)
{
    if (!c->spare_writer) {
        c->spare_writer = p->w;
    } else {
        kp_writer_close(p->w);
        free(p->w);
    }
    p->w = NULL;
}

void pending_free(kdac_client *c, pending *p)
{
    if (!p)
        return;
    if (p->w)
        writer_give_back(c, p);
    if (p->method == KP_METHOD_PREFILL) {
        free(p->ctx.prefill.seqs);
        free(p->ctx.prefill.outs);
        free(p->ctx.prefill.pos);
    } else if (p->method == KP_METHOD_STEP) {
        free(p->ctx.step.lists);
        free(p->ctx.step.pos);
    }
    free(p);
}

static pending *table_find(kdac_client *c, uint32_t id)
{
    for (pending *p = c->table[id % CLIENT_HASH_BUCKETS]; p; p = p->hash_next) {
        if (p->id == id)
            return p;
    }
    return NULL;
}

static void table_remove(kdac_client *c, pending *p)
{
    pending **at = &c->table[p->id % CLIENT_HASH_BUCKETS];
    while (*at != p)
        at = &(*at)->hash_next;
    *at = p->hash_next;
    c->inflight--;
}

uint32_t client_next_id(kdac_client *c)
{
    /* Ids are unique among unanswered requests (PROTOCOL.md §Messages); 0 is
     * skipped so that it never names a request in logs. */
    do {
        c->next_id++;
    } while (c->next_id == 0 || table_find(c, c->next_id));
    return c->next_id;
}

/* Removes p from the send queue (a failure while it was still queued). */
static void sendq_remove(kdac_client *c, pending *p)
{
    pending *prev = NULL;
    for (pending *q = c->send_head; q; prev = q, q = q->send_next) {
        if (q != p)
            continue;
        if (prev)
            prev->send_next = q->send_next;
        else
            c->send_head = q->send_next;
        if (c->send_tail == q)
            c->send_tail = prev;
        c->send_queued -= q->unsent;
        return;
    }
}

/* Runs p's callback with status and frees p. */
static void complete(kdac_client *c, pending *p, const kdac_result *res, int status)
{
    table_remove(c, p);
    if (!p->sent)
        sendq_remove(c, p);
    if (status != KDAC_OK) /* whatever failed, a stream waiting on the done word goes on */
        client_sem_fail(p);
    c->cb_depth++;
    p->cb(c, p->data, res, status);
    c->cb_depth--;
    pending_free(c, p);
}

static void complete_error(kdac_client *c, pending *p, const kdac_error *e)
{
    kdac_result res;
    memset(&res, 0, sizeof(res));
    res.method = kp_method_name(p->method);
    res.error = *e;
    complete(c, p, &res, e->code);
}

void client_complete_all(kdac_client *c, const kdac_error *e)
{
    /* Callbacks may submit (and fail) new requests meanwhile: take one at a
     * time from the table until it is empty. */
    for (int b = 0; b < CLIENT_HASH_BUCKETS; b++) {
        while (c->table[b])
            complete_error(c, c->table[b], e);
    }
}

void client_fail(kdac_client *c, int code, const char *fmt, ...)
{
    if (c->failed)
        return;
    c->failed = true;
    c->failure.code = code;
    c->failure.retryable = kdac_err_retryable(code);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->failure.message, sizeof(c->failure.message), fmt, ap);
    va_end(ap);
    kdac_error e = c->failure;
    client_complete_all(c, &e);
}

int client_check_usable(kdac_client *c, bool blocking, kdac_error *err)
{
    if (!c)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "client is NULL");
    if (blocking && c->cb_depth > 0)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "a blocking call cannot run inside one of "
                         "the client's callbacks; use the *_send form");
    if (c->failed) {
        if (err)
            *err = c->failure;
        return c->failure.code;
    }
    return KDAC_OK;
}

/* ---------------------------------------------------------------------- */
/* Sending                                                                */
/* ---------------------------------------------------------------------- */

/* Marks `n` written bytes off the front of the queue. */
static void sendq_advance(kdac_client *c, size_t n)
{
    c->sent_bytes += n;
    c->send_queued -= n;
    while (n > 0) {
        pending *p = c->send_head;
        size_t iovcnt;
        const struct iovec *iov = kp_writer_iov(p->w, &iovcnt);
        size_t left = iov[p->iov_index].iov_len - p->iov_off;
        size_t take = n < left ? n : left;
        p->iov_off += take;
        p->unsent -= take;
        n -= take;
        if (p->iov_off == iov[p->iov_index].iov_len) {
            p->iov_index++;
            p->iov_off = 0;
        }
        if (p->unsent == 0) {
            /* The frame is in the socket: its writer (and its references to
             * the caller's tensors) is no longer needed. */
            writer_give_back(c, p);
            p->sent = true;
            c->send_head = p->send_next;
            if (!c->send_head)
                c->send_tail = NULL;
        }
    }
}

/*
 * The queue's next bytes as iovecs, from the head frame on.  A later frame
 * passing a descriptor is left for a call of its own (PROTOCOL.md §File
 * descriptors: the descriptor rides on the call whose data begins with the
 * frame's first byte, and that call carries no earlier frame).  *fd: the
 * head's descriptor when this is its frame's first byte, else -1.
 */
static int send_iov(kdac_client *c, struct iovec *iov, int *fd)
{
    int niov = 0;
    pending *head = c->send_head;
    *fd = (head->fd >= 0 && head->iov_index == 0 && head->iov_off == 0) ? head->fd : -1;
    for (pending *p = head; p && niov < CLIENT_SEND_IOVS; p = p->send_next) {
        if (p != head && p->fd >= 0)
            break;
        size_t cnt;
        const struct iovec *v = kp_writer_iov(p->w, &cnt);
        size_t i = p == head ? head->iov_index : 0;
        size_t off = p == head ? head->iov_off : 0;
        for (; i < cnt && niov < CLIENT_SEND_IOVS; i++, off = 0) {
            iov[niov].iov_base = (char *)v[i].iov_base + off;
            iov[niov].iov_len = v[i].iov_len - off;
            niov++;
        }
    }
    return niov;
}

/* sendmsg with a descriptor (fd >= 0) riding on it; bytes sent or -1. */
static ssize_t send_with_fd(kdac_client *c, struct iovec *iov, int niov, int fd)
{
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct msghdr mh;
    memset(&mh, 0, sizeof(mh));
    mh.msg_iov = iov;
    mh.msg_iovlen = (size_t)niov;
    if (fd >= 0) {
        memset(&ctl, 0, sizeof(ctl));
        mh.msg_control = ctl.buf;
        mh.msg_controllen = sizeof(ctl.buf);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    }
    return sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* One byte on the socket wakes a daemon that sleeps (§Frame ring).  A full
 * socket means a wake-up is pending already. */
static void ring_doorbell(kdac_client *c)
{
    static const uint8_t bell = 0;
    (void)send(c->fd, &bell, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

/* Copies as much of the queue into the ring as fits; 0 or an errno. */
static int ring_write(kdac_client *c)
{
    uint64_t before = c->ring.head;
    while (c->send_head && !c->failed) {
        struct iovec iov[CLIENT_SEND_IOVS];
        int fd;
        int niov = send_iov(c, iov, &fd);
        if (fd >= 0 && !c->send_head->fd_sent) {
            /* The descriptor goes ahead of its frame, on a doorbell. */
            struct iovec bell = {(void *)"", 1};
            if (send_with_fd(c, &bell, 1, fd) < 0)
                return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : errno;
            c->send_head->fd_sent = true;
        }
        size_t put;
        kp_error e;
        if (kp_ring_writev(&c->ring, iov, (size_t)niov, &put, &e) != KP_OK)
            return EPROTO;
        if (put == 0)
            break;
        sendq_advance(c, put);
    }
    if (c->ring.head != before && kp_ring_peer_wants(&c->ring, KP_RING_WANT_DATA))
        ring_doorbell(c);
    return 0;
}

/* Writes as much of the queue as the ring takes; 0 or an errno.  Left with
 * bytes to send, it asks the daemon to ring when it makes room (unless the
 * caller polls), and looks once more. */
static int ring_flush(kdac_client *c)
{
    for (;;) {
        int rc = ring_write(c);
        if (rc || !c->send_head || c->failed || c->ring_polling)
            return rc;
        kp_ring_set_wants(&c->ring, KP_RING_WANT_DATA | KP_RING_WANT_SPACE);
        if (!kp_ring_writable(&c->ring))
            return 0;
    }
}

/* Writes as much of the queue as the socket (or the ring) takes.  Returns 0
 * (done or would block) or an errno. */
static int flush(kdac_client *c)
{
    if (c->ring_on)
        return ring_flush(c);
    while (c->send_head && !c->failed) {
        struct iovec iov[CLIENT_SEND_IOVS];
        int fd;
        int niov = send_iov(c, iov, &fd);
        ssize_t n = send_with_fd(c, iov, niov, fd);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            return errno;
        }
        sendq_advance(c, (size_t)n);
    }
    return 0;
}

void client_submit(kdac_client *c, pending *p)
{
    p->hash_next = c->table[p->id % CLIENT_HASH_BUCKETS];
    c->table[p->id % CLIENT_HASH_BUCKETS] = p;
    c->inflight++;
    p->unsent = kp_writer_frame_bytes(p->w);
    c->send_queued += p->unsent;
    if (c->send_tail)
        c->send_tail->send_next = p;
    else
        c->send_head = p;
    c->send_tail = p;
    /* Write at once when the socket has room: no loop iteration is needed
     * for a request to leave.  A write error is reported by the read side,
     * which may still find the daemon's goodbye explaining it. */
    if (!c->write_errno)
        c->write_errno = flush(c);
}

/* ---------------------------------------------------------------------- */
/* Receiving                                                              */
/* ---------------------------------------------------------------------- */

/* A response: complete its request with the error or the decoded result. */
static void dispatch_response(kdac_client *c, kp_msg *msg)
{
    pending *p = table_find(c, msg->id);
    if (!p || !p->sent) {
        client_fail(c, KDAC_E_PROTOCOL, "the daemon answered request id %u, which %s", msg->id,
                    p ? "it has not fully received" : "is not in flight");
        return;
    }
    kdac_result res;
    memset(&res, 0, sizeof(res));
    res.method = kp_method_name(p->method);
    kp_error e;
    memset(&e, 0, sizeof(e));
    int rc;
    if (msg->error) {
        kp_error remote;
        rc = kp_response_error_decode(msg, &remote, &e);
        if (rc == KP_OK) {
            res.error.code = remote.code;
            res.error.retryable = remote.retryable;
            snprintf(res.error.message, sizeof(res.error.message), "%s", remote.message);
            complete(c, p, &res, remote.code);
            return;
        }
    } else {
        rc = p->decode(c, p, msg, &res, &e);
        if (rc == KP_OK) {
            complete(c, p, &res, KDAC_OK);
            return;
        }
    }
    /* The frame was well-formed but this result was not: fail this request
     * only, naming what was wrong. */
    kdac_error bad;
    kdac_fail(&bad, KDAC_E_PROTOCOL, "malformed %s result from the daemon: %s",
              kp_method_name(p->method), e.message);
    complete_error(c, p, &bad);
}

/* A result its request's reader takes straight from the frame body (no
 * msgpack object tree); false: dispatch it the general way. */
static bool dispatch_read(kdac_client *c, const uint8_t *body, size_t len)
{
    uint32_t id;
    pending *p;
    kdac_result res;
    if (!kp_response_peek_id(body, len, &id) || !(p = table_find(c, id)) || !p->sent || !p->read)
        return false;
    memset(&res, 0, sizeof(res));
    res.method = kp_method_name(p->method);
    if (!p->read(c, p, body, len, &res))
        return false;
    complete(c, p, &res, KDAC_OK);
    return true;
}

/* One complete frame body (malloc'd; freed here). */
static void dispatch(kdac_client *c, uint8_t *body, size_t len)
{
    kp_msg msg;
    kp_error e;
    if (dispatch_read(c, body, len)) {
        free(body);
        return;
    }
    kp_msg_init(&msg);
    int rc = kp_msg_decode(&msg, body, len, c->rd.max_frame, &e);
    if (rc != KP_OK) {
        client_fail(c, KDAC_E_PROTOCOL, "malformed frame from the daemon: %s", e.message);
    } else if (msg.kind == KP_MSG_RESPONSE) {
        dispatch_response(c, &msg);
    } else if (msg.kind == KP_MSG_NOTIFICATION && strcmp(msg.name, KP_NOTIFY_GOODBYE) == 0) {
        kp_error remote;
        if (kp_goodbye_decode(&msg, &remote, &e) != KP_OK)
            client_fail(c, KDAC_E_PROTOCOL, "malformed goodbye from the daemon: %s", e.message);
        else
            client_fail(c, remote.code, "the daemon closed the connection: %s", remote.message);
    } else if (msg.kind == KP_MSG_REQUEST) {
        client_fail(c, KDAC_E_PROTOCOL, "the daemon sent a request (\"%s\"); it only answers",
                    msg.name);
    }
    /* Other notifications are newer than this client: ignored (§Versioning). */
    kp_msg_close(&msg);
    free(body);
}

/* Takes and dispatches the frame the reader completed. */
static void take_frame(kdac_client *c)
{
    size_t len;
    uint8_t *body = kp_reader_take(&c->rd, &len);
    dispatch(c, body, len);
}

static void reader_failed(kdac_client *c, const kp_error *e)
{
    client_fail(c, e->code, "bad frame from the daemon: %s", e->message);
}

/* Frame bytes from the socket or the ring: bytes, or -1 with errno (EAGAIN:
 * nothing now), 0 when the socket is closed, -2 after a failure. */
static ssize_t receive(kdac_client *c, void *dst, size_t room)
{
    if (!c->ring_on)
        return recv(c->fd, dst, room, MSG_DONTWAIT);
    size_t got;
    kp_error e;
    if (kp_ring_read(&c->ring, dst, room, &got, &e) != KP_OK) {
        client_fail(c, KDAC_E_PROTOCOL, "%s", e.message);
        return -2;
    }
    if (got == 0) {
        errno = EAGAIN;
        return -1;
    }
    return (ssize_t)got;
}

/* Reads until the socket (or the ring) would block, the peer closes, or the
 * connection fails. */
static void read_frames(kdac_client *c)
{
    bool ring = c->ring_on;
    while (!c->failed) {
        kp_reader *r = &c->rd;
        bool direct = r->header_have == KP_FRAME_HEADER_BYTES &&
                      r->body_len - r->body_have >= CLIENT_STAGE_BYTES;
        uint8_t *dst = c->stage;
        size_t room = CLIENT_STAGE_BYTES;
        if (direct) {
            room = kp_reader_space(r, &dst);
            if (!dst) {
                kp_error e;
                kp_reader_commit(r, 0, &e);
                reader_failed(c, &e);
                return;
            }
        }
        ssize_t n = receive(c, dst, room);
        if (n == -2)
            return;
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            client_fail(c, KDAC_E_DISCONNECTED, "connection to the daemon lost: %s",
                        strerror(errno));
            return;
        }
        if (n == 0) {
            client_fail(c, KDAC_E_DISCONNECTED, "the daemon closed the connection%s",
                        c->inflight ? " with requests in flight" : "");
            return;
        }
        c->recv_bytes += (uint64_t)n;
        kp_error e;
        if (direct) {
            int rc = kp_reader_commit(r, (size_t)n, &e);
            if (rc < 0)
                reader_failed(c, &e);
            else if (rc == KP_READ_FRAME)
                take_frame(c);
            continue;
        }
        const uint8_t *p = c->stage;
        size_t left = (size_t)n;
        while (left > 0 && !c->failed) {
            int rc = kp_reader_feed(r, &p, &left, &e);
            if (rc < 0) {
                reader_failed(c, &e);
                return;
            }
            if (rc == KP_READ_FRAME)
                take_frame(c);
            /* ring.attach answered: what follows on the socket is doorbells */
            if (c->ring_on != ring)
                return;
        }
    }
}

/* A ring connection's socket: doorbells to discard; false once it failed
 * (closed by the daemon, which may have left a goodbye in the ring). */
static bool ring_drain_socket(kdac_client *c)
{
    for (int i = 0; i < 16; i++) {
        ssize_t n = recv(c->fd, c->stage, CLIENT_STAGE_BYTES, MSG_DONTWAIT);
        if (n > 0)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return true;
        int why = n < 0 ? errno : 0;
        read_frames(c); /* the goodbye, if the daemon wrote one */
        if (n == 0)
            client_fail(c, KDAC_E_DISCONNECTED, "the daemon closed the connection%s",
                        c->inflight ? " with requests in flight" : "");
        else
            client_fail(c, KDAC_E_DISCONNECTED, "connection to the daemon lost: %s",
                        strerror(why));
        return false;
    }
    return true;
}

/* A progress call over the ring: move bytes both ways, then (unless the
 * caller polls) tell the daemon what to ring for, and look once more in case
 * it made progress meanwhile. */
static void ring_progress(kdac_client *c)
{
    for (;;) {
        uint64_t tail = c->ring.tail;
        if (!c->write_errno)
            c->write_errno = flush(c);
        read_frames(c);
        /* Polling, nobody rings: the socket is read (for its closing) once
         * the caller sleeps again. */
        if (c->failed || (!c->ring_polling && !ring_drain_socket(c)))
            return;
        if (c->ring.tail != tail && kp_ring_peer_wants(&c->ring, KP_RING_WANT_SPACE))
            ring_doorbell(c);
        if (c->ring_polling)
            return;
        bool sending = c->send_head && !c->write_errno;
        kp_ring_set_wants(&c->ring, KP_RING_WANT_DATA | (sending ? KP_RING_WANT_SPACE : 0));
        if (!kp_ring_readable(&c->ring) && !(sending && kp_ring_writable(&c->ring)))
            return;
    }
}

void client_ring_start(kdac_client *c)
{
    c->ring_on = true;
}

int client_progress(kdac_client *c)
{
    if (c->failed)
        return c->failure.code;
    if (c->ring_on) {
        ring_progress(c);
    } else {
        if (!c->write_errno)
            c->write_errno = flush(c);
        read_frames(c);
        if (c->ring_on) /* the ring.attach answer arrived */
            ring_progress(c);
    }
    if (c->write_errno && !c->failed)
        client_fail(c, KDAC_E_DISCONNECTED, "cannot write to the daemon: %s",
                    strerror(c->write_errno));
    return c->failed ? c->failure.code : KDAC_OK;
}

int kdac_client_progress(kdac_client *c)
{
    if (!c)
        return KDAC_E_INVALID_ARGUMENT;
    if (c->cb_depth > 0)
        return KDAC_E_INVALID_ARGUMENT;
    return client_progress(c);
}

int kdac_client_fd(const kdac_client *c)
{
    return c ? c->fd : -1;
}

int kdac_client_events(const kdac_client *c)
{
    if (!c || c->failed)
        return 0;
    bool sending = c->send_head && !c->write_errno;
    /* Over the ring, doorbells announce room to write too; only a descriptor
     * waiting to go ahead of its frame needs the socket writable. */
    if (c->ring_on)
        sending = sending && c->send_head->fd >= 0 && !c->send_head->fd_sent;
    return KDAC_READABLE | (sending ? KDAC_WRITABLE : 0);
}

void kdac_client_io_status(const kdac_client *c, kdac_io_status *st)
{
    memset(st, 0, sizeof(*st));
    if (!c)
        return;
    st->inflight = c->inflight;
    st->send_queued = c->send_queued;
    st->sent_bytes = c->sent_bytes;
    st->recv_bytes = c->recv_bytes;
    if (c->rd.header_have == KP_FRAME_HEADER_BYTES) {
        st->frame_len = c->rd.body_len;
        st->frame_have = c->rd.body_have;
    }
}

/* ---------------------------------------------------------------------- */
/* Blocking calls                                                         */
/* ---------------------------------------------------------------------- */

/* Copies n bytes into the client's scratch (the arrays a blocking call
 * returns live there until the next call). */
static const void *scratch_put(kdac_client *c, size_t at, const void *src, size_t n)
{
    if (at + n > c->scratch_cap) {
        void *grown = realloc(c->scratch, at + n);
        if (!grown)
            return NULL;
        c->scratch = grown;
        c->scratch_cap = at + n;
    }
    memcpy((char *)c->scratch + at, src, n);
    return (char *)c->scratch + at;
}

void sync_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    sync_call *s = data;
    s->done = true;
    s->status = status;
    s->res = *res;
    if (status != KDAC_OK)
        return;
    /* Only one member of the union holds an array; rebase it. */
    const void **arr = NULL;
    size_t bytes = 0;
    if (strcmp(res->method, "prefill") == 0) {
        arr = (const void **)&s->res.u.prefill.pos;
        bytes = res->u.prefill.nseqs * sizeof(uint64_t);
    } else if (strcmp(res->method, "step") == 0) {
        arr = (const void **)&s->res.u.step.pos;
        bytes = res->u.step.nseqs * sizeof(uint64_t);
    } else if (strcmp(res->method, "slot.alloc") == 0) {
        arr = (const void **)&s->res.u.alloc.slots;
        bytes = res->u.alloc.nslots * sizeof(uint64_t);
    } else if (strcmp(res->method, "slot.info") == 0) {
        arr = (const void **)&s->res.u.info.slots;
        bytes = res->u.info.nslots * sizeof(kdac_slot_entry);
    }
    if (arr && bytes > 0 && !(*arr = scratch_put(c, 0, *arr, bytes))) {
        s->status = kdac_fail(&s->res.error, KDAC_E_NO_MEMORY,
                              "cannot allocate %zu bytes for the result", bytes);
    }
}

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static int64_t now_ms(void) { return now_us() / 1000; }

void kdac_client_set_polling(kdac_client *c, bool polling)
{
    if (!c)
        return;
    c->ring_polling = polling;
    if (polling && c->ring_on)
        kp_ring_set_wants(&c->ring, 0);
}

int kdac_client_set_spin(kdac_client *c, int spin_us, kdac_error *err)
{
    if (!c || spin_us < 0 || spin_us > 1000000)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "spin_us: %d is outside [0, 1000000]", spin_us);
    c->spin_us = spin_us;
    return KDAC_OK;
}

int sync_wait(kdac_client *c, sync_call *s, kdac_error *err)
{
    bool polling = c->ring_polling; /* the caller's kdac_client_set_polling */
    int64_t deadline = c->timeout_ms > 0 ? now_ms() + c->timeout_ms : -1;
    if (c->spin_us > 0) { /* read without sleeping first (kdac_client_set_spin), within the timeout */
        int64_t spin_end = now_us() + c->spin_us;
        if (deadline >= 0 && spin_end > deadline * 1000)
            spin_end = deadline * 1000;
        kdac_client_set_polling(c, true); /* the daemon need not ring meanwhile */
        do
            client_progress(c);
        while (!s->done && now_us() < spin_end);
    }
    c->ring_polling = false; /* this call may sleep below: the daemon must ring */
    for (;;) {
        client_progress(c);
        if (s->done)
            break;
        int timeout = -1;
        if (deadline >= 0) {
            int64_t left = deadline - now_ms();
            if (left <= 0) {
                client_fail(c, KDAC_E_TIMEOUT, "no answer from the daemon within %d ms; the "
                            "connection is closed", c->timeout_ms);
                continue; /* the failure completed s */
            }
            timeout = (int)left;
        }
        struct pollfd pfd = {c->fd, POLLIN, 0};
        if (kdac_client_events(c) & KDAC_WRITABLE)
            pfd.events |= POLLOUT;
        if (poll(&pfd, 1, timeout) < 0 && errno != EINTR) {
            client_fail(c, KDAC_E_SYSTEM, "poll: %s", strerror(errno));
        }
    }
    kdac_client_set_polling(c, polling);
    if (s->status != KDAC_OK && err)
        *err = s->res.error;
    return s->status;
}
