/*
 * conn.c - see conn.h.  Besides its own header it includes log.h only: the
 * transport logs why it closes a connection.
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

#include "log.h"

/* sendmsg takes at most IOV_MAX iovecs per call. */
#define SEND_IOV_MAX (IOV_MAX < 1024 ? IOV_MAX : 1024)
/* Sent frames a connection keeps for its next responses: their writers'
 * buffers are reused instead of allocated and freed per response (one per
 * request in flight, for the clients that keep one or two). */
#define SPARE_FRAMES 2

static void on_poll(uv_poll_t *h, int status, int events);
static void finish_close(kd_conn *c);
static void read_some(kd_conn *c);
static bool ring_sleep(kd_conn *c, bool asleep);

const char *kd_disconnect_name(kd_disconnect d)
{
    static const char *const names[] = {
#define KD_DISC_NAME(id, name) name,
        KD_DISCONNECTS(KD_DISC_NAME)
#undef KD_DISC_NAME
    };
    return (unsigned)d < KD_DISC_COUNT ? names[d] : "unknown";
}

/* ---------------------------------------------------------------------- */
/* Lifetime                                                               */
/* ---------------------------------------------------------------------- */

static void conn_ref(kd_conn *c)
{
    c->refs++;
}

static void conn_unref(kd_conn *c)
{
    if (--c->refs > 0)
        return;
    kd_transport *t = c->t;
    if (c->prev)
        c->prev->next = c->next;
    else
        t->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    t->nconns--;
    t->h.on_free(c);
    free(c);
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

/* Reports a change of the bytes held for the frame still arriving: those
 * received (the body buffer grows ahead of them, but pages not written yet
 * take no memory). */
static void account_partial(kd_conn *c)
{
    uint64_t held = !c->closing && c->reader.header_have == KP_FRAME_HEADER_BYTES
                        ? c->reader.body_have
                        : 0;
    if (c->reader.header_have == 0 && held == 0)
        c->frame_start_ns = 0;
    else if (!c->frame_start_ns)
        c->frame_start_ns = uv_hrtime();
    if (held == c->partial)
        return;
    int64_t delta = (int64_t)held - (int64_t)c->partial;
    c->partial = held;
    c->t->h.on_partial(c, delta);
}

/* Reports a change of the unread output. */
static void output_moved(kd_conn *c, int64_t delta)
{
    if (delta)
        c->t->h.on_output(c, delta);
}

static bool can_read(const kd_conn *c)
{
    return !c->closing && !c->paused;
}

static void update_events(kd_conn *c)
{
    if (c->ring_on) /* the socket carries doorbells: always read, never wait to write */
        set_events(c, c->closing ? 0 : UV_READABLE);
    else
        set_events(c, (can_read(c) ? UV_READABLE : 0) | (c->out_head ? UV_WRITABLE : 0));
}

kd_conn *kd_conn_new(kd_transport *t, int fd, uint64_t id, void *data)
{
    kd_conn *c = calloc(1, sizeof(*c));
    uint8_t *rbuf = malloc(t->lim.read_buffer);
    int rc = c && rbuf ? uv_poll_init(t->loop, &c->poll, fd) : UV_ENOMEM;
    if (rc != 0) {
        KD_ERROR("cannot set up a new connection (%s); dropped", uv_strerror(rc));
        free(c);
        free(rbuf);
        close(fd);
        return NULL;
    }
    c->t = t;
    c->id = id;
    c->data = data;
    c->fd = fd;
    c->poll.data = c;
    c->rbuf = rbuf;
    c->refs = 1;
    c->max_frame = KP_HELLO_MAX_FRAME_BYTES;
    c->last_read_ns = c->last_write_ns = uv_hrtime();
    kp_reader_init(&c->reader, KP_HELLO_MAX_FRAME_BYTES);
    c->next = t->conns;
    if (t->conns)
        t->conns->prev = c;
    t->conns = c;
    t->nconns++;
    t->nopen++;
    update_events(c);
    return c;
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
        output_moved(c, -(int64_t)o->bytes);
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
    kd_transport *t = c->t;
    c->closing = true;
    t->nopen--;
    c->close_deadline = uv_hrtime() + t->lim.close_flush_ns;
    for (uint32_t i = 0; i < c->nfds; i++)
        close(c->fds[i]);
    c->nfds = 0;
    kp_reader_close(&c->reader);
    account_partial(c); /* closing: back to 0 */
    conn_ref(c);
    t->h.on_close(c, reason);
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
    conn_unref(c);
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
    output_moved(c, -(int64_t)c->out_bytes);
    c->out_bytes = 0;
    free(c->rbuf);
    c->rbuf = NULL;
    c->t->nrings -= c->ring_on;
    c->ring_on = false;
    conn_unref(c);
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
    kd_out *o = c->spare;
    if (o) {
        c->spare = o->next;
        c->nspare--;
        o->next = NULL;
        kp_writer_set_max_frame(&o->w, c->max_frame);
        return o;
    }
    o = calloc(1, sizeof(*o));
    if (!o || kp_writer_init(&o->w, c->max_frame) != KP_OK) {
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

static void limit_close(kd_conn *c, kd_disconnect reason, const char *why)
{
    KD_NOTICE("conn %llu: %s; closing", (unsigned long long)c->id, why);
    drop_unsent(c);
    kp_error e;
    kp_fail(&e, KP_E_BUSY, "%s", why);
    kd_conn_close(c, reason, &e);
}

static void check_output_limits(kd_conn *c)
{
    const kd_transport_limits *l = &c->t->lim;
    if (c->closing)
        return;
    if (c->out_bytes > l->output_hard) {
        char why[160];
        snprintf(why, sizeof(why), "unread responses exceed the daemon's output limit of %llu "
                 "bytes", (unsigned long long)l->output_hard);
        limit_close(c, KD_DISC_OUTPUT_LIMIT, why);
        return;
    }
    if (c->out_bytes > l->output_soft) {
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
    c->last_write_ns = uv_hrtime();
    output_moved(c, -(int64_t)sent);
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
    c->t->ring_doorbells++;
}

/* The stream broke the protocol: the owner hears why, then it closes. */
static void protocol_close(kd_conn *c, const kp_error *e)
{
    KD_DEBUG("conn %llu: %s: %s", (unsigned long long)c->id, kp_code_name(e->code), e->message);
    c->t->h.on_error(c, e);
    kd_conn_close(c, e->code == KP_E_FRAME_TOO_LARGE ? KD_DISC_FRAME_TOO_LARGE : KD_DISC_PROTOCOL,
                  e);
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
            KD_DEBUG("conn %llu: %s", (unsigned long long)c->id, e.message);
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
        if (!c->out_head || kd_transport_awake(c->t))
            break;
        ring_sleep(c, true); /* publishes "ring me when there is room" */
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

/* The output queued before the ring was attached has left on the socket:
 * frames take the ring now. */
static void ring_start(kd_conn *c)
{
    c->ring_on = true;
    c->t->nrings++;
    ring_sleep(c, !kd_transport_awake(c->t));
    update_events(c);
}

/* Writes queued frames until the socket is full or the budget is spent. */
static void flush(kd_conn *c)
{
    if (c->ring_on) {
        ring_flush(c);
        return;
    }
    uint64_t budget = c->t->lim.write_budget;
    while (c->out_head && budget > 0) {
        struct iovec v[SEND_IOV_MAX];
        struct msghdr m = {.msg_iov = v, .msg_iovlen = out_iov(c->out_head, v)};
        ssize_t sent = sendmsg(c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent < 0) {
            if (errno == EAGAIN || errno == EINTR)
                break;
            KD_DEBUG("conn %llu: send: %s", (unsigned long long)c->id, strerror(errno));
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
    else if (c->ring_attached && !c->ring_on && !c->out_head && !c->closing)
        ring_start(c);
    else
        update_events(c);
}

static void enqueue(kd_conn *c, kd_out *o)
{
    o->bytes = kp_writer_frame_bytes(&o->w);
    if (!c->out_head)
        c->last_write_ns = uv_hrtime(); /* the stall clock starts with the output */
    c->out_bytes += o->bytes;
    output_moved(c, (int64_t)o->bytes);
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

void kd_conn_set_max_frame(kd_conn *c, uint64_t bytes)
{
    c->max_frame = bytes;
    kp_reader_set_max_frame(&c->reader, bytes);
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
    account_partial(c); /* the frame's bytes go to the request now */
    c->t->h.on_frame(c, body, len, uv_hrtime());
}

/* Acts on the reader's answer to new bytes: a whole frame, a broken one, or
 * part of one. */
static void after_read(kd_conn *c, int rc, const kp_error *e)
{
    if (rc == KP_READ_FRAME)
        deliver(c);
    else if (rc < 0)
        protocol_close(c, e);
    else
        account_partial(c);
}

/* Feeds buffered bytes to the reader while reading is allowed. */
static void process_buffered(kd_conn *c)
{
    conn_ref(c); /* a frame may close the connection under us */
    while (c->rpos < c->rlen && can_read(c)) {
        const uint8_t *data = c->rbuf + c->rpos;
        size_t len = c->rlen - c->rpos;
        kp_error e;
        int rc = kp_reader_feed(&c->reader, &data, &len, &e);
        c->rpos = c->rlen - len;
        after_read(c, rc, &e);
    }
    conn_unref(c);
}

static void on_input_idle(uv_idle_t *h);

/* Buffered input is processed on the next loop turn, not from within
 * whatever resumed the connection. */
static void queue_input(kd_conn *c)
{
    kd_transport *t = c->t;
    if (c->input_queued)
        return;
    c->input_queued = true;
    conn_ref(c);
    c->input_next = t->input_head;
    t->input_head = c;
    uv_idle_start(&t->input_idle, on_input_idle);
}

/* Re-evaluates the polled events, and queues input already buffered. */
static void update(kd_conn *c)
{
    if (c->closing)
        return;
    update_events(c);
    if ((c->rpos < c->rlen || (c->ring_on && kp_ring_readable(&c->ring))) && can_read(c))
        queue_input(c);
}

static void read_some(kd_conn *c)
{
    uint64_t budget = c->t->lim.read_budget;
    const size_t rbuf_len = c->t->lim.read_buffer;
    uint64_t ring_tail = c->ring.tail;
    conn_ref(c);
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
        bool direct = c->reader.header_have == KP_FRAME_HEADER_BYTES && space >= rbuf_len;
        ssize_t n = c->ring_on ? ring_receive(c, direct ? dst : c->rbuf, direct ? space : rbuf_len)
                    : direct   ? receive(c, dst, space)
                               : receive(c, c->rbuf, rbuf_len);
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
        c->last_read_ns = uv_hrtime();
        if (!direct) {
            c->rpos = 0;
            c->rlen = (size_t)n;
            process_buffered(c);
            continue;
        }
        kp_error e;
        int rc = kp_reader_commit(&c->reader, (size_t)n, &e);
        after_read(c, rc, &e);
    }
    if (c->ring_on && !c->closing && c->ring.tail != ring_tail) {
        kd_transport_stay_awake(c->t); /* a ring client at work: keep polling its ring */
        if (kp_ring_peer_wants(&c->ring, KP_RING_WANT_SPACE))
            ring_doorbell(c);
    }
    update(c);
    conn_unref(c);
}

void kd_conn_pause(kd_conn *c)
{
    if (c->paused)
        return;
    c->paused = true;
    update_events(c);
}

void kd_conn_resume(kd_conn *c)
{
    if (!c->paused)
        return;
    c->paused = false;
    c->last_read_ns = uv_hrtime(); /* the peer's stall clock starts again */
    update(c);
}

static void process_input(kd_conn *c)
{
    if (c->closing)
        return;
    if (c->ring_on) { /* reads the ring too, then updates */
        read_some(c);
        return;
    }
    conn_ref(c);
    process_buffered(c);
    update(c);
    conn_unref(c);
}

static void on_input_idle(uv_idle_t *h)
{
    kd_transport *t = h->data;
    kd_conn *list = t->input_head;
    t->input_head = NULL;
    while (list) {
        kd_conn *c = list;
        list = c->input_next;
        c->input_queued = false;
        process_input(c);
        conn_unref(c);
    }
    if (!t->input_head)
        uv_idle_stop(&t->input_idle);
}

static void ring_poll(kd_conn *c);

static void on_poll(uv_poll_t *h, int status, int events)
{
    kd_conn *c = h->data;
    if (status < 0) {
        kd_conn_close(c, KD_DISC_IO_ERROR, NULL);
        finish_close(c);
        return;
    }
    conn_ref(c);
    if (c->ring_on) {
        /* A doorbell: the client wrote or read while this loop slept. */
        if (ring_drain_socket(c, true)) {
            kd_transport_stay_awake(c->t);
            ring_poll(c);
        }
    } else {
        if (events & UV_WRITABLE)
            flush(c);
        if ((events & UV_READABLE) && !c->closing)
            read_some(c);
    }
    conn_unref(c);
}

/* ---------------------------------------------------------------------- */
/* The frame ring                                                         */
/* ---------------------------------------------------------------------- */

int kd_conn_attach_ring(kd_conn *c, void *mem, uint64_t size, kp_error *err)
{
    if (c->ring_attached)
        return kp_fail(err, KP_E_INVALID_PARAMS, "this connection has a frame ring already");
    if (c->rpos != c->rlen || c->reader.header_have != 0 || c->out_head)
        return kp_fail(err, KP_E_INVALID_PARAMS, "ring.attach must be the only request in "
                       "flight, with nothing sent after it until its answer");
    c->ring_attached = true;
    kp_ring_init(&c->ring, mem, size, true, KP_RING_WANT_DATA);
    return KP_OK;
}

/* The awake loop: reads what the ring holds and writes what fits. */
static void ring_poll(kd_conn *c)
{
    if (!c->ring_on || c->closing)
        return;
    conn_ref(c);
    if (c->out_head && kp_ring_writable(&c->ring))
        ring_flush(c);
    if (!c->closing && can_read(c) && (c->rpos < c->rlen || kp_ring_readable(&c->ring)))
        read_some(c);
    conn_unref(c);
}

/* Before the loop sleeps (asleep) or when it wakes: publishes what this
 * connection's ring waits for.  Going to sleep returns false when the ring
 * has work already (the loop stays awake). */
static bool ring_sleep(kd_conn *c, bool asleep)
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

/* ---------------------------------------------------------------------- */
/* The transport                                                          */
/* ---------------------------------------------------------------------- */

void kd_transport_init(kd_transport *t, uv_loop_t *loop, const kd_conn_handlers *h,
                       const kd_transport_limits *lim)
{
    memset(t, 0, sizeof(*t));
    t->loop = loop;
    t->h = *h;
    t->lim = *lim;
    uv_idle_init(loop, &t->input_idle);
    uv_idle_init(loop, &t->spin);
    t->input_idle.data = t->spin.data = t;
}

void kd_transport_close(kd_transport *t)
{
    if (t->stopped)
        return;
    t->stopped = true;
    uv_close((uv_handle_t *)&t->input_idle, NULL);
    uv_close((uv_handle_t *)&t->spin, NULL);
}

/*
 * After answering, the loop polls for spin_us instead of sleeping in epoll:
 * a client that sends its next request as soon as it has the answer (a
 * serving stack's next layer, a closed-loop benchmark) is read at once
 * instead of after a wake-up, which costs tens of microseconds on a virtual
 * machine.  Frame rings are read by this polling alone while it lasts;
 * before the loop sleeps, each ring learns what its connection waits for, so
 * that its client rings the doorbell.
 */
static void poll_rings(kd_transport *t)
{
    if (t->nrings == 0)
        return;
    for (kd_conn *c = t->conns, *next; c; c = next) {
        conn_ref(c);
        ring_poll(c);
        next = c->next;
        conn_unref(c);
    }
}

/* Publishes every ring's wants; false (and awake again) if one has work. */
static bool rings_sleep(kd_transport *t)
{
    if (t->nrings == 0)
        return true;
    bool quiet = true;
    for (kd_conn *c = t->conns; c; c = c->next)
        quiet = ring_sleep(c, true) && quiet;
    if (!quiet) {
        for (kd_conn *c = t->conns; c; c = c->next)
            ring_sleep(c, false);
    }
    return quiet;
}

static void on_spin(uv_idle_t *h)
{
    kd_transport *t = h->data;
    poll_rings(t);
    if (uv_hrtime() >= t->spin_until_ns && rings_sleep(t))
        uv_idle_stop(h);
}

bool kd_transport_awake(const kd_transport *t)
{
    return uv_is_active((const uv_handle_t *)&t->spin);
}

void kd_transport_stay_awake(kd_transport *t)
{
    if (t->lim.spin_us == 0 || t->stopped)
        return;
    t->spin_until_ns = uv_hrtime() + (uint64_t)t->lim.spin_us * 1000u;
    if (kd_transport_awake(t))
        return;
    for (kd_conn *c = t->conns; c && t->nrings; c = c->next)
        ring_sleep(c, false);
    uv_idle_start(&t->spin, on_spin);
}

void kd_transport_housekeeping(kd_transport *t, uint64_t now)
{
    for (kd_conn *c = t->conns, *next; c; c = next) {
        next = c->next;
        if (c->closing) {
            if (now >= c->close_deadline)
                finish_close(c);
            continue;
        }
        const kd_transport_limits *l = &t->lim;
        char why[160];
        if (c->reader.header_have > 0 && !c->paused && now - c->last_read_ns > l->frame_stall_ns) {
            snprintf(why, sizeof(why), "no byte of the frame begun for %llu seconds "
                     "(clients.frame_stall_seconds)",
                     (unsigned long long)(l->frame_stall_ns / 1000000000ull));
            limit_close(c, KD_DISC_STALLED, why);
            continue;
        }
        /* a peer still sending requests is alive, if slow to read */
        if (c->out_head && now - c->last_write_ns > l->output_stall_ns &&
            now - c->last_read_ns > l->output_stall_ns) {
            snprintf(why, sizeof(why), "no byte of the unread responses taken for %llu seconds "
                     "(clients.output_stall_seconds)",
                     (unsigned long long)(l->output_stall_ns / 1000000000ull));
            limit_close(c, KD_DISC_STALLED, why);
            continue;
        }
        if (c->over_soft_since && now - c->over_soft_since > l->output_soft_ns) {
            snprintf(why, sizeof(why), "unread responses stayed above %llu bytes for %llu "
                     "seconds", (unsigned long long)l->output_soft,
                     (unsigned long long)(l->output_soft_ns / 1000000000ull));
            limit_close(c, KD_DISC_OUTPUT_LIMIT, why);
        }
    }
}
