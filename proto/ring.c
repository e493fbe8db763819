/*
 * ring.c - the frame ring (PROTOCOL.md §Frame ring): two byte streams in a
 * shared memory region, one per direction, each a single-producer,
 * single-consumer circular buffer with free-running 64-bit counters.
 *
 * Ordering: a producer copies its bytes, then publishes its head with a
 * release store; the consumer loads the head with acquire before copying
 * them out, and publishes its tail with release once it has.  Sleeping uses
 * the Dekker pattern: the sleeper stores its wants, fences, re-checks; the
 * producer publishes, fences, reads the wants.  One of the two always sees
 * the other's store, so no doorbell is lost.
 *
 * The peer's counters live in memory the peer can scribble on: they are
 * read once per call and checked before any byte is copied.
 */
#include <string.h>

#include "kdaproto.h"

_Static_assert(sizeof(kp_ring_side) == 64, "one cache line per side");
_Static_assert(sizeof(kp_ring_header) <= KP_RING_HEADER_BYTES, "the header fits its page");

int kp_ring_check_size(uint64_t size, uint64_t region_bytes, kp_error *err)
{
    if (size < KP_RING_MIN_SIZE || size > KP_RING_MAX_SIZE || (size & (size - 1)) != 0)
        return kp_fail(err, KP_E_INVALID_PARAMS, "size: %llu is not a power of two in "
                       "[%u, %llu]", (unsigned long long)size, KP_RING_MIN_SIZE,
                       (unsigned long long)KP_RING_MAX_SIZE);
    if (region_bytes < KP_RING_HEADER_BYTES || (region_bytes - KP_RING_HEADER_BYTES) / 2 < size)
        return kp_fail(err, KP_E_REGION_INVALID, "a ring of %llu bytes per direction needs "
                       "%llu bytes; the region has %llu", (unsigned long long)size,
                       (unsigned long long)(KP_RING_HEADER_BYTES + 2 * size),
                       (unsigned long long)region_bytes);
    return KP_OK;
}

void kp_ring_init(kp_ring *r, void *base, uint64_t size, bool daemon_side, uint32_t wants)
{
    kp_ring_header *h = base;
    uint8_t *to_daemon = (uint8_t *)base + KP_RING_HEADER_BYTES;
    uint8_t *to_client = to_daemon + size;
    r->mine = daemon_side ? &h->daemon : &h->client;
    r->peer = daemon_side ? &h->client : &h->daemon;
    r->in = daemon_side ? to_daemon : to_client;
    r->out = daemon_side ? to_client : to_daemon;
    r->size = size;
    r->head = r->tail = 0;
    __atomic_store_n(&r->mine->head, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&r->mine->tail, 0, __ATOMIC_RELAXED);
    kp_ring_set_wants(r, wants);
}

static int bad_counter(kp_error *err, const char *which, uint64_t value, uint64_t mine)
{
    return kp_fail(err, KP_E_PROTOCOL, "frame ring: the peer's %s counter %llu is impossible "
                   "against ours (%llu)", which, (unsigned long long)value,
                   (unsigned long long)mine);
}

int kp_ring_read(kp_ring *r, void *dst, size_t len, size_t *got, kp_error *err)
{
    *got = 0;
    uint64_t head = __atomic_load_n(&r->peer->head, __ATOMIC_ACQUIRE);
    uint64_t avail = head - r->tail; /* unsigned: a head behind our tail is huge */
    if (avail > r->size)
        return bad_counter(err, "head", head, r->tail);
    size_t n = avail < len ? (size_t)avail : len;
    if (n == 0)
        return KP_OK;
    uint64_t at = r->tail & (r->size - 1);
    size_t first = r->size - at < n ? (size_t)(r->size - at) : n;
    memcpy(dst, r->in + at, first);
    memcpy((uint8_t *)dst + first, r->in, n - first);
    r->tail += n;
    __atomic_store_n(&r->mine->tail, r->tail, __ATOMIC_RELEASE);
    *got = n;
    return KP_OK;
}

int kp_ring_writev(kp_ring *r, const struct iovec *iov, size_t n, size_t *put, kp_error *err)
{
    *put = 0;
    uint64_t tail = __atomic_load_n(&r->peer->tail, __ATOMIC_ACQUIRE);
    uint64_t used = r->head - tail;
    if (used > r->size)
        return bad_counter(err, "tail", tail, r->head);
    uint64_t room = r->size - used;
    uint64_t head = r->head;
    for (size_t i = 0; i < n && room > 0; i++) {
        const uint8_t *src = iov[i].iov_base;
        size_t left = iov[i].iov_len < room ? iov[i].iov_len : (size_t)room;
        room -= left;
        while (left > 0) {
            uint64_t at = head & (r->size - 1);
            size_t step = r->size - at < left ? (size_t)(r->size - at) : left;
            memcpy(r->out + at, src, step);
            src += step;
            head += step;
            left -= step;
        }
    }
    *put = (size_t)(head - r->head);
    r->head = head;
    __atomic_store_n(&r->mine->head, head, __ATOMIC_RELEASE);
    return KP_OK;
}

bool kp_ring_readable(const kp_ring *r)
{
    return __atomic_load_n(&r->peer->head, __ATOMIC_ACQUIRE) != r->tail;
}

bool kp_ring_writable(const kp_ring *r)
{
    return r->head - __atomic_load_n(&r->peer->tail, __ATOMIC_ACQUIRE) != r->size;
}

void kp_ring_set_wants(kp_ring *r, uint32_t wants)
{
    __atomic_store_n(&r->mine->wants, wants, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

bool kp_ring_peer_wants(const kp_ring *r, uint32_t what)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return (__atomic_load_n(&r->peer->wants, __ATOMIC_RELAXED) & what) != 0;
}
