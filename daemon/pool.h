/*
 * pool.h - the state pool's bookkeeping: which slots are in use, by whom,
 * at which position and in which status (PROTOCOL.md §Slots).
 *
 * The state memory itself ([slots][H][128][128]) belongs to the backend
 * (backend.h); this module only decides what may be done with a slot.  A
 * slot is named by a handle (generation << 32 | index); freeing bumps the
 * generation (skipping 0) so old handles fail with STALE_SLOT.
 *
 * Zeroing is lazy: slot.alloc with zero and slot.reset only set `zero`, and
 * whoever next reads the slot treats its memory as zeros (a prefill starts
 * from a zero state, a read or fork first clears the memory), so neither
 * costs a device operation.
 *
 * Owners are opaque 64-bit keys (a connection, or a uid when slots persist;
 * see kd_conn_owner in conn.h).  Each slot also records the uid it was
 * allocated for; the slots of each owner and of each uid are counted for
 * the quotas (limits.max_slots_per_client per owner, max_slots_per_uid per
 * uid: the second bounds a uid that opens many connections, and what a uid
 * keeps with slots_persist after they close).
 *
 * Positions never wrap: kd_pool_next_pos refuses a prefill that would carry
 * a slot past 2^64 - 1 tokens.
 */
#ifndef KDAD_POOL_H
#define KDAD_POOL_H

#include <stdbool.h>
#include <stdint.h>

#include "kdaproto.h"

typedef enum kd_slot_state {
    KD_SLOT_FREE = 0, /* on the free list */
    KD_SLOT_READY,    /* holds a state (possibly the lazy zero state) */
    KD_SLOT_EMPTY,    /* allocated with zero = false, never written */
    KD_SLOT_LOST,     /* a device failure hit a request on it */
} kd_slot_state;

typedef struct kd_slot {
    uint32_t gen;   /* current generation, never 0 */
    uint8_t state;  /* kd_slot_state */
    bool zero;      /* the memory must be read as zeros (lazy reset) */
    bool retiring;  /* freed: handles are stale, requests admitted before still run;
                       back on the free list once no request waits on it */
    uint64_t pos;   /* tokens consumed */
    uint64_t owner; /* owner key while allocated (0 once retiring) */
    uint32_t uid;   /* the uid it was allocated for (counted while owner is set) */
} kd_slot;

typedef struct kd_owner_count {
    uint64_t owner;
    uint32_t count;
} kd_owner_count;

typedef struct kd_pool {
    kd_slot *slots;
    uint32_t nslots;
    uint32_t *free_list; /* a stack of free indices */
    uint32_t nfree;
    uint32_t nlost;      /* allocated or retiring slots in KD_SLOT_LOST */
    kd_owner_count *owners; /* owners holding at least one slot (few: linear search) */
    uint32_t nowners, owners_cap;
    kd_owner_count *uids;   /* uids holding at least one slot (key: the uid) */
    uint32_t nuids, uids_cap;
} kd_pool;

/* first_gen: the generation every slot starts with (random per daemon
 * start, so handles of a previous instance are stale); 0 is replaced by 1. */
int kd_pool_init(kd_pool *p, uint32_t nslots, uint32_t first_gen);
void kd_pool_destroy(kd_pool *p);

static inline kd_slot *kd_pool_slot(kd_pool *p, uint32_t index) { return &p->slots[index]; }
static inline uint64_t kd_pool_handle(const kd_pool *p, uint32_t index)
{
    return kp_slot_handle(p->slots[index].gen, index);
}
static inline uint32_t kd_pool_used(const kd_pool *p) { return p->nslots - p->nfree; }

/* Slots `owner` holds now (retiring slots no longer count). */
uint32_t kd_pool_owned(const kd_pool *p, uint64_t owner);
/* Slots allocated for `uid` now, all its owners together. */
uint32_t kd_pool_uid_holds(const kd_pool *p, uint32_t uid);

/*
 * Allocates `count` slots for owner, a client of uid, all or nothing:
 * KP_E_QUOTA_EXCEEDED when owner would hold more than lim->max_slots_per_client,
 * else KP_E_POOL_FULL when too few are free, else KP_E_QUOTA_EXCEEDED when uid
 * would hold more than lim->max_slots_per_uid (0: no per-uid bound).  Each slot starts READY with a (lazy) zero state at
 * position 0, or EMPTY.
 */
int kd_pool_alloc(kd_pool *p, uint64_t owner, uint32_t uid, const kp_limits *lim,
                  uint32_t count, bool zero, uint64_t *handles, kp_error *err);
/* Of the slots owner may still allocate, what lim leaves (slot.info's quota_left). */
uint32_t kd_pool_quota_left(const kd_pool *p, uint64_t owner, uint32_t uid,
                            const kp_limits *lim);

/* Handle -> index, for `owner`: KP_E_UNKNOWN_SLOT, KP_E_STALE_SLOT (also for
 * free and retiring slots: their generation moved on), KP_E_PERMISSION_DENIED.  field names the handle
 * in the message ("seqs[2].slot"). */
int kd_pool_resolve(const kd_pool *p, uint64_t handle, uint64_t owner, const char *field,
                    uint32_t *index, kp_error *err);

/* Frees a slot for its owner: the handle turns stale and the quota is given
 * back now; status and position stay for the requests admitted before, and
 * the slot is reused only after kd_pool_release (once they are done). */
void kd_pool_retire(kd_pool *p, uint32_t index);
void kd_pool_release(kd_pool *p, uint32_t index);

/* The position after a prefill of len tokens on a slot (from 0 when fresh,
 * else from its position): KP_E_LIMIT_EXCEEDED when it would pass 2^64 - 1
 * (field names the sequence in the message). */
int kd_pool_next_pos(const kd_pool *p, uint32_t index, bool fresh, uint64_t len,
                     const char *field, uint64_t *pos, kp_error *err);

/* KP_E_STATE_LOST unless the slot is READY (what reading it needs). */
int kd_pool_check_ready(const kd_pool *p, uint32_t index, const char *field, kp_error *err);

/* Status changes of run-time operations (they keep nlost right). */
void kd_pool_set_ready(kd_pool *p, uint32_t index, uint64_t pos, bool zero);
void kd_pool_set_lost(kd_pool *p, uint32_t index);

/* kp_slot_status of an allocated slot (READY, EMPTY or LOST). */
kp_slot_status kd_pool_status(const kd_pool *p, uint32_t index);

#endif /* KDAD_POOL_H */
