/*
 * pool.c - see pool.h.
 */
#include "pool.h"

#include <stdlib.h>
#include <string.h>

int kd_pool_init(kd_pool *p, uint32_t nslots, uint32_t first_gen)
{
    memset(p, 0, sizeof(*p));
    p->slots = calloc(nslots, sizeof(*p->slots));
    p->free_list = malloc(nslots * sizeof(*p->free_list));
    if (!p->slots || !p->free_list) {
        kd_pool_destroy(p);
        return KP_E_NO_MEMORY;
    }
    p->nslots = nslots;
    if (first_gen == 0)
        first_gen = 1;
    /* Stack order: index 0 is handed out first, which keeps logs readable. */
    for (uint32_t i = 0; i < nslots; i++) {
        p->slots[i].gen = first_gen;
        p->free_list[i] = nslots - 1 - i;
    }
    p->nfree = nslots;
    return KP_OK;
}

void kd_pool_destroy(kd_pool *p)
{
    free(p->slots);
    free(p->free_list);
    free(p->owners);
    free(p->uids);
    memset(p, 0, sizeof(*p));
}

/* A table of counts by key (owners, uids): few entries, a linear search. */
typedef struct count_table {
    kd_owner_count **v;
    uint32_t *n, *cap;
} count_table;

static count_table owners_of(kd_pool *p)
{
    return (count_table){&p->owners, &p->nowners, &p->owners_cap};
}

static count_table uids_of(kd_pool *p)
{
    return (count_table){&p->uids, &p->nuids, &p->uids_cap};
}

static uint32_t count_of(const kd_owner_count *v, uint32_t n, uint64_t key)
{
    for (uint32_t i = 0; i < n; i++) {
        if (v[i].owner == key)
            return v[i].count;
    }
    return 0;
}

uint32_t kd_pool_owned(const kd_pool *p, uint64_t owner)
{
    return count_of(p->owners, p->nowners, owner);
}

uint32_t kd_pool_uid_holds(const kd_pool *p, uint32_t uid)
{
    return count_of(p->uids, p->nuids, uid);
}

/* Makes room for one more entry (so that count_add of a new key cannot fail). */
static int count_reserve(count_table t)
{
    if (*t.n < *t.cap)
        return KP_OK;
    uint32_t cap = *t.cap ? 2 * *t.cap : 16;
    kd_owner_count *grown = realloc(*t.v, cap * sizeof(*grown));
    if (!grown)
        return KP_E_NO_MEMORY;
    *t.v = grown;
    *t.cap = cap;
    return KP_OK;
}

/* Adds delta to key's count, dropping keys that reach 0 (room reserved). */
static void count_add(count_table t, uint64_t key, int64_t delta)
{
    kd_owner_count *o = NULL;
    for (uint32_t i = 0; i < *t.n && !o; i++) {
        if ((*t.v)[i].owner == key)
            o = &(*t.v)[i];
    }
    if (!o) {
        o = &(*t.v)[(*t.n)++];
        *o = (kd_owner_count){key, 0};
    }
    o->count = (uint32_t)((int64_t)o->count + delta);
    if (o->count == 0)
        *o = (*t.v)[--*t.n];
}

int kd_pool_alloc(kd_pool *p, uint64_t owner, uint32_t uid, const kp_limits *lim,
                  uint32_t count, bool zero, uint64_t *handles, kp_error *err)
{
    uint32_t held = kd_pool_owned(p, owner), uid_held = kd_pool_uid_holds(p, uid);
    if ((uint64_t)held + count > lim->max_slots_per_client)
        return kp_fail(err, KP_E_QUOTA_EXCEEDED, "count: %u more slots would exceed "
                       "max_slots_per_client %u (%u held)", count, lim->max_slots_per_client,
                       held);
    /* A full pool first: it is retryable, and with the default per-uid bound
     * (the whole pool) the uid's bound is only ever passed when it is full. */
    if (count > p->nfree)
        return kp_fail(err, KP_E_POOL_FULL, "count: %u slots asked, %u of %u free", count,
                       p->nfree, p->nslots);
    if (lim->max_slots_per_uid && (uint64_t)uid_held + count > lim->max_slots_per_uid)
        return kp_fail(err, KP_E_QUOTA_EXCEEDED, "count: %u more slots would exceed "
                       "max_slots_per_uid %u (uid %u holds %u)", count, lim->max_slots_per_uid,
                       (unsigned)uid, uid_held);
    if (count_reserve(owners_of(p)) != KP_OK || count_reserve(uids_of(p)) != KP_OK)
        return kp_fail(err, KP_E_NO_MEMORY, "no memory for the slot owner table");
    count_add(owners_of(p), owner, count);
    count_add(uids_of(p), uid, count);
    for (uint32_t i = 0; i < count; i++) {
        uint32_t index = p->free_list[--p->nfree];
        kd_slot *s = &p->slots[index];
        s->state = zero ? KD_SLOT_READY : KD_SLOT_EMPTY;
        s->zero = zero;
        s->pos = 0;
        s->owner = owner;
        s->uid = uid;
        handles[i] = kd_pool_handle(p, index);
    }
    return KP_OK;
}

uint32_t kd_pool_quota_left(const kd_pool *p, uint64_t owner, uint32_t uid,
                            const kp_limits *lim)
{
    uint32_t held = kd_pool_owned(p, owner), uid_held = kd_pool_uid_holds(p, uid);
    uint32_t left = held < lim->max_slots_per_client ? lim->max_slots_per_client - held : 0;
    if (lim->max_slots_per_uid) {
        uint32_t uid_left = uid_held < lim->max_slots_per_uid ? lim->max_slots_per_uid - uid_held
                                                              : 0;
        left = uid_left < left ? uid_left : left;
    }
    return left;
}

int kd_pool_next_pos(const kd_pool *p, uint32_t index, bool fresh, uint64_t len,
                     const char *field, uint64_t *pos, kp_error *err)
{
    uint64_t from = fresh ? 0 : p->slots[index].pos;
    if (len > UINT64_MAX - from)
        return kp_fail(err, KP_E_LIMIT_EXCEEDED, "%s: slot 0x%llx is at position %llu: %llu "
                       "more tokens would pass the last position, 2^64 - 1",
                       field, (unsigned long long)kd_pool_handle(p, index),
                       (unsigned long long)from, (unsigned long long)len);
    *pos = from + len;
    return KP_OK;
}

int kd_pool_resolve(const kd_pool *p, uint64_t handle, uint64_t owner, const char *field,
                    uint32_t *index, kp_error *err)
{
    uint32_t i = kp_slot_index(handle);
    if (i >= p->nslots)
        return kp_fail(err, KP_E_UNKNOWN_SLOT, "%s: slot index %u of handle 0x%llx is outside "
                       "the pool of %u slots", field, i, (unsigned long long)handle, p->nslots);
    const kd_slot *s = &p->slots[i];
    if (kp_slot_generation(handle) != s->gen || s->state == KD_SLOT_FREE || s->retiring)
        return kp_fail(err, KP_E_STALE_SLOT, "%s: handle 0x%llx is stale: slot %u was freed",
                       field, (unsigned long long)handle, i);
    if (s->owner != owner)
        return kp_fail(err, KP_E_PERMISSION_DENIED, "%s: slot 0x%llx belongs to another "
                       "client", field, (unsigned long long)handle);
    *index = i;
    return KP_OK;
}

void kd_pool_retire(kd_pool *p, uint32_t index)
{
    kd_slot *s = &p->slots[index];
    /* The owner and the uid hold this slot, so their entries exist. */
    count_add(owners_of(p), s->owner, -1);
    count_add(uids_of(p), s->uid, -1);
    s->retiring = true;
    s->gen = s->gen + 1 ? s->gen + 1 : 1;
    s->owner = 0;
}

void kd_pool_release(kd_pool *p, uint32_t index)
{
    kd_slot *s = &p->slots[index];
    if (s->state == KD_SLOT_LOST)
        p->nlost--;
    s->state = KD_SLOT_FREE;
    s->retiring = false;
    s->zero = false;
    s->pos = 0;
    p->free_list[p->nfree++] = index;
}

int kd_pool_check_ready(const kd_pool *p, uint32_t index, const char *field, kp_error *err)
{
    const kd_slot *s = &p->slots[index];
    if (s->state == KD_SLOT_READY)
        return KP_OK;
    return kp_fail(err, KP_E_STATE_LOST, "%s: slot 0x%llx is %s: it has no valid state to read",
                   field, (unsigned long long)kd_pool_handle(p, index),
                   s->state == KD_SLOT_EMPTY ? "empty (allocated without zero, never written)"
                                             : "lost (a device failure hit it)");
}

void kd_pool_set_ready(kd_pool *p, uint32_t index, uint64_t pos, bool zero)
{
    kd_slot *s = &p->slots[index];
    if (s->state == KD_SLOT_LOST)
        p->nlost--;
    s->state = KD_SLOT_READY;
    s->pos = pos;
    s->zero = zero;
}

void kd_pool_set_lost(kd_pool *p, uint32_t index)
{
    kd_slot *s = &p->slots[index];
    if (s->state != KD_SLOT_LOST)
        p->nlost++;
    s->state = KD_SLOT_LOST;
    s->zero = false;
}

kp_slot_status kd_pool_status(const kd_pool *p, uint32_t index)
{
    switch (p->slots[index].state) {
    case KD_SLOT_EMPTY: return KP_SLOT_EMPTY;
    case KD_SLOT_LOST: return KP_SLOT_LOST;
    default: return KP_SLOT_READY;
    }
}
