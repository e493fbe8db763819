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
    memset(p, 0, sizeof(*p));
}

static kd_owner_count *owner_find(const kd_pool *p, uint64_t owner)
{
    for (uint32_t i = 0; i < p->nowners; i++) {
        if (p->owners[i].owner == owner)
            return &p->owners[i];
    }
    return NULL;
}

uint32_t kd_pool_owned(const kd_pool *p, uint64_t owner)
{
    const kd_owner_count *o = owner_find(p, owner);
    return o ? o->count : 0;
}

/* Adds delta to owner's count, dropping owners that reach 0. */
static int owner_add(kd_pool *p, uint64_t owner, int64_t delta)
{
    kd_owner_count *o = owner_find(p, owner);
    if (!o) {
        if (p->nowners == p->owners_cap) {
            uint32_t cap = p->owners_cap ? 2 * p->owners_cap : 16;
            kd_owner_count *grown = realloc(p->owners, cap * sizeof(*grown));
            if (!grown)
                return KP_E_NO_MEMORY;
            p->owners = grown;
            p->owners_cap = cap;
        }
        o = &p->owners[p->nowners++];
        *o = (kd_owner_count){owner, 0};
    }
    o->count = (uint32_t)((int64_t)o->count + delta);
    if (o->count == 0)
        *o = p->owners[--p->nowners];
    return KP_OK;
}

int kd_pool_alloc(kd_pool *p, uint64_t owner, uint32_t quota, uint32_t count, bool zero,
                  uint64_t *handles, kp_error *err)
{
    uint32_t held = kd_pool_owned(p, owner);
    if ((uint64_t)held + count > quota)
        return kp_fail(err, KP_E_QUOTA_EXCEEDED, "count: %u more slots would exceed "
                       "max_slots_per_client %u (%u held)", count, quota, held);
    if (count > p->nfree)
        return kp_fail(err, KP_E_POOL_FULL, "count: %u slots asked, %u of %u free", count,
                       p->nfree, p->nslots);
    if (owner_add(p, owner, count) != KP_OK)
        return kp_fail(err, KP_E_NO_MEMORY, "no memory for the slot owner table");
    for (uint32_t i = 0; i < count; i++) {
        uint32_t index = p->free_list[--p->nfree];
        kd_slot *s = &p->slots[index];
        s->state = zero ? KD_SLOT_READY : KD_SLOT_EMPTY;
        s->zero = zero;
        s->pos = 0;
        s->owner = owner;
        handles[i] = kd_pool_handle(p, index);
    }
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
    /* Cannot fail: the owner holds this slot, so its entry exists. */
    owner_add(p, s->owner, -1);
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
