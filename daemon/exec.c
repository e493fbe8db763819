/*
 * exec.c - see exec.h.
 *
 * Buffers are resolved at admission: an inline tensor is its bytes inside
 * the frame (used in place, or staged by the backend), a region reference
 * is the region's mapping plus the offset, after the bounds check.  The
 * request then holds a reference on every region it names, so a release
 * or a disconnect cannot unmap memory a batch still uses.
 */
#include "exec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "defaults.h"
#include "log.h"

struct kd_exec {
    kd_layer *layer;          /* prefill: the layer it admitted */
    kd_region **regions;      /* regions it references, once each */
    uint32_t nregions, regions_cap;
    uint32_t *slots;          /* pool indices the job names (the FIFO keys) */
    uint64_t bytes_in[KP_TRANSPORT_ID_COUNT];  /* tensor bytes, for the stats */
    uint64_t bytes_out[KP_TRANSPORT_ID_COUNT];
    bool has_ready;           /* prefill: gated until its ready word is reached */
    kd_ready_wait ready;
    bool has_done;            /* prefill: a done word */
    bool done_set;            /* the value is written, or its batch writes it */
    kd_sem_word done;
    union {
        struct {
            kp_prefill_params p;
            kd_buf (*buf)[KP_PREFILL_TENSORS]; /* per sequence: q k v g beta out */
            void **out;       /* inline outputs, allocated when the batch forms */
            uint64_t *pos;    /* positions after each sequence */
        } prefill;
        struct {
            bool allocated;   /* dst was allocated for this request and not handed out yet */
            uint64_t pos;
        } fork;
        struct {
            kp_dtype dtype;
            kd_buf out;       /* a region, or NULL host until the batch forms (inline) */
            void *inline_out;
            uint64_t pos;
            bool zeroes;      /* the batch clears the lazily zeroed slot first */
        } read;
        struct {
            kp_dtype dtype;
            uint64_t pos;
            kd_buf in;
        } write;
        struct {
            kp_step_params p;
            kd_buf buf[KP_STEP_TENSORS]; /* q k v g beta out states */
            kda_step_seq *seqs; /* pool indices, starts, lengths (flags when it forms) */
            uint64_t *pos;      /* positions after the step, u64 little-endian (the result) */
            void *out;          /* the inline output, allocated when the batch forms */
            bool chunked;       /* runs as prefill sequences (a length over
                                   KDA_STEP_CHOICE_TOKENS and no states asked) */
        } step;
    };
};

static kd_daemon *daemon_of(const kd_req *r)
{
    return r->client->d;
}

static void exec_release(kd_req *r);
static void exec_answering(kd_req *r);

/* ---------------------------------------------------------------------- */
/* Admission helpers                                                      */
/* ---------------------------------------------------------------------- */

/*
 * A request's field, named in error messages only: "seqs[3].q", or "src".
 * Admission checks every sequence's slot and tensors; formatting their names
 * up front was most of its cost.  So each check runs quietly first (no
 * kp_error), and once more with the name when it fails.
 */
typedef struct field_at {
    const char *array; /* NULL: member alone */
    uint32_t index;
    const char *member;
} field_at;

#define FIELD(name) ((field_at){NULL, 0, (name)})
#define SEQ_FIELD(i, member) ((field_at){"seqs", (i), (member)})

static const char *field_text(field_at f, char buf[KP_FIELD_NAME_MAX])
{
    return f.array ? kp_field_name(buf, KP_FIELD_NAME_MAX, f.array, f.index, f.member) : f.member;
}

static int resolve(kd_req *r, uint64_t handle, field_at f, uint32_t *index, kp_error *e)
{
    kd_pool *pool = &daemon_of(r)->pool;
    uint64_t owner = kd_client_owner(r->client);
    if (kd_pool_resolve(pool, handle, owner, NULL, index, NULL) == KP_OK)
        return KP_OK;
    char buf[KP_FIELD_NAME_MAX];
    return kd_pool_resolve(pool, handle, owner, field_text(f, buf), index, e);
}

static int transport_of(const kd_region *reg)
{
    return reg->kind == KD_REGION_CUDA ? KP_TRANSPORT_ID_CUDA_IPC : KP_TRANSPORT_ID_SHM;
}

/* The region of a reference, bounds-checked and referenced by the request (once). */
static int hold_region(kd_req *r, const kp_ref *ref, field_at f, kd_region **out, kp_error *e)
{
    kd_exec *x = r->exec;
    kd_region *reg = kd_region_find(&r->client->regions, ref->region);
    if (!reg || kp_ref_check_bounds(ref, reg->size, NULL, NULL) != KP_OK) {
        char buf[KP_FIELD_NAME_MAX];
        const char *field = field_text(f, buf);
        if (!reg)
            return kp_fail(e, KP_E_REGION_INVALID, "%s: region %u is not registered on this "
                           "connection", field, ref->region);
        return kp_ref_check_bounds(ref, reg->size, field, e);
    }
    bool known = false;
    for (uint32_t i = 0; i < x->nregions && !known; i++)
        known = x->regions[i] == reg;
    if (!known) {
        if (x->nregions == x->regions_cap) {
            uint32_t cap = x->regions_cap ? 2 * x->regions_cap : 4;
            kd_region **v = realloc(x->regions, cap * sizeof(*v));
            if (!v)
                return kp_fail(e, KP_E_NO_MEMORY, "no memory for region references");
            x->regions = v;
            x->regions_cap = cap;
        }
        x->regions[x->nregions++] = reg;
        kd_region_ref(reg);
    }
    *out = reg;
    return KP_OK;
}

/* Resolves a tensor reference to a buffer; region references are
 * bounds-checked and the region referenced by the request. */
static int use_ref(kd_req *r, const kp_ref *ref, field_at f, bool output, kd_buf *out,
                   kp_error *e)
{
    kd_exec *x = r->exec;
    if (ref->kind == KP_REF_INLINE) {
        *out = (kd_buf){(void *)ref->data, NULL};
        x->bytes_in[KP_TRANSPORT_ID_INLINE] += ref->nbytes;
        return KP_OK;
    }
    kd_region *reg;
    int rc = hold_region(r, ref, f, &reg, e);
    if (rc)
        return rc;
    *out = kd_region_buf(reg, ref->offset);
    if (output)
        x->bytes_out[transport_of(reg)] += ref->nbytes;
    else
        x->bytes_in[transport_of(reg)] += ref->nbytes;
    return KP_OK;
}

/* A semaphore word (8 bytes) of one of the client's regions, referenced by the request. */
static int use_word(kd_req *r, const kp_sem *m, const char *name, kd_sem_word *out,
                    kp_error *e)
{
    kd_region *reg;
    kp_ref ref = kp_ref_region(m->region, m->offset, sizeof(uint64_t));
    int rc = hold_region(r, &ref, FIELD(name), &reg, e);
    if (rc)
        return rc;
    *out = (kd_sem_word){kd_region_buf(reg, m->offset), m->value};
    return KP_OK;
}

/* Staging bytes the backend needs for `bytes` it moves through its staging
 * buffers (the same rounding as the cuda backend's; 0 on a backend that uses
 * host memory in place). */
static uint64_t stage_cost(const kd_req *r, uint64_t bytes)
{
    if (!daemon_of(r)->backend->info.stages_host)
        return 0;
    return (bytes + KD_STAGE_ALIGN - 1) / KD_STAGE_ALIGN * KD_STAGE_ALIGN;
}

/* A prefill tensor's staging: inline bytes (host memory only) are staged,
 * shared-memory tensors (host memory with a device alias) are copied into
 * device staging by the cuda backend, device memory (CUDA IPC) is used in place. */
static uint64_t tensor_stage_cost(const kd_req *r, kd_buf buf, uint64_t bytes)
{
    return buf.host ? stage_cost(r, bytes) : 0;
}

/* An output left out of the request comes back inline: the batch allocates
 * its buffer, which the cuda backend stages. */
static void inline_output(kd_req *r, uint64_t bytes, kd_job_cost *cost)
{
    r->exec->bytes_out[KP_TRANSPORT_ID_INLINE] += bytes;
    cost->stage_out += stage_cost(r, bytes);
}

/* A slot read or write: the cuda backend stages a pool-dtype copy of the
 * state unless it moves it directly between device memory and the pool. */
static uint64_t slot_stage_cost(const kd_req *r, kd_buf buf, kp_dtype dtype)
{
    const kd_backend *b = daemon_of(r)->backend;
    bool direct = buf.dev && (kda_dtype)dtype == b->pool.dtype;
    return direct ? 0 : stage_cost(r, kd_backend_slot_bytes(b));
}

/* A slot transfer that the device must convert between dtypes needs host
 * memory on the client's side. */
static int check_convertible(const kd_req *r, kd_buf buf, kp_dtype dtype, const char *field,
                             kp_error *e)
{
    if (!buf.host && (kda_dtype)dtype != daemon_of(r)->backend->pool.dtype)
        return kp_fail(e, KP_E_NOT_SUPPORTED, "%s: converting the state to %s in GPU memory is "
                       "not supported; use the pool's dtype (%s) or host memory", field,
                       kp_dtype_name(dtype), kp_dtype_name(daemon_of(r)->session.geometry.state_dtype));
    return KP_OK;
}

static uint32_t *alloc_slots(kd_exec *x, uint32_t n)
{
    x->slots = calloc(n ? n : 1, sizeof(*x->slots));
    return x->slots;
}

/* Hands the job to the scheduler (it runs no earlier than the next pump). */
static int enqueue(kd_req *r, uint32_t nslots, bool host, kd_job_cost cost, kp_error *e)
{
    r->job = (kd_job){.group = &r->client->group, .slots = r->exec->slots, .nslots = nslots,
                      .cost = cost, .host = host, .gated = r->exec->has_ready};
    if (kd_sched_push(&daemon_of(r)->sched, &r->job) != KP_OK)
        return kp_fail(e, KP_E_NO_MEMORY, "no memory to queue the request");
    return KP_OK;
}

/* ---------------------------------------------------------------------- */
/* Admission                                                              */
/* ---------------------------------------------------------------------- */

static int admit_prefill(kd_req *r, kd_job_cost *cost, uint32_t *nslots, kp_error *e)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    kp_prefill_params *p = &x->prefill.p;
    int rc;
    if (r->prefill_read)
        *p = r->prefill;
    else if ((rc = kp_prefill_params_decode(&r->msg, &r->client->session, p, e)))
        return rc;
    if ((p->ready.present || p->done.present) && !d->backend->info.sems)
        return kp_fail(e, KP_E_NOT_SUPPORTED, "%s: this daemon does not take semaphores (hello "
                       "announces \"" KP_FEATURE_PREFILL_SEMAPHORES "\" when it does)",
                       p->ready.present ? "ready" : "done");
    /* The done word first: every later admission error can then write its failure value. */
    if (p->done.present) {
        if ((rc = use_word(r, &p->done, "done", &x->done, e)))
            return rc;
        x->has_done = true;
    }
    if (p->ready.present) {
        if ((rc = use_word(r, &p->ready, "ready", &x->ready.word, e)))
            return rc;
        x->ready.owner = r;
        x->has_ready = true;
    }
    if ((rc = kd_layers_acquire(&d->layers, p->layer, r->client->peer.uid, &x->layer, e)))
        return rc;
    x->prefill.buf = calloc(p->nseqs, sizeof(*x->prefill.buf));
    x->prefill.out = calloc(p->nseqs, sizeof(*x->prefill.out));
    x->prefill.pos = calloc(p->nseqs, sizeof(*x->prefill.pos));
    if (!alloc_slots(x, p->nseqs) || !x->prefill.buf || !x->prefill.out || !x->prefill.pos)
        return kp_fail(e, KP_E_NO_MEMORY, "no memory for a prefill of %u sequences", p->nseqs);
    const uint32_t heads = r->client->session.geometry.heads;
    *cost = (kd_job_cost){0, p->nseqs, 0, 0};
    for (uint32_t i = 0; i < p->nseqs; i++) {
        const kp_prefill_seq *q = &p->seqs[i];
        if ((rc = resolve(r, q->slot, SEQ_FIELD(i, "slot"), &x->slots[i], e)))
            return rc;
        for (int t = 0; t < KP_PREFILL_TENSORS && q->len > 0; t++) {
            const kp_ref *ref = &q->tensors[t];
            kd_buf *buf = &x->prefill.buf[i][t];
            bool out = t == KP_TENSOR_OUT;
            if (ref->kind == KP_REF_ABSENT) {
                inline_output(r, kp_token_tensor_bytes(q->len, heads), cost);
                continue;
            }
            if ((rc = use_ref(r, ref, SEQ_FIELD(i, kp_prefill_tensor_name(t)), out, buf, e)))
                return rc;
            if (out)
                cost->stage_out += tensor_stage_cost(r, *buf, ref->nbytes);
            else
                cost->stage_in += tensor_stage_cost(r, *buf, ref->nbytes);
        }
        cost->tokens += q->len;
    }
    *nslots = p->nseqs;
    return KP_OK;
}

static int admit_slot_list(kd_req *r, uint32_t *nslots, kp_error *e)
{
    kp_slot_list p;
    int rc = r->method == KP_METHOD_SLOT_FREE
                 ? kp_slot_free_params_decode(&r->msg, &r->client->session, &p, e)
                 : kp_slot_reset_params_decode(&r->msg, &r->client->session, &p, e);
    if (rc)
        return rc;
    if (!alloc_slots(r->exec, p.nslots))
        return kp_fail(e, KP_E_NO_MEMORY, "no memory for %u slots", p.nslots);
    /* All handles are checked before any slot is touched. */
    for (uint32_t i = 0; i < p.nslots; i++) {
        if ((rc = resolve(r, p.slots[i], ((field_at){"slots", i, NULL}), &r->exec->slots[i], e)))
            return rc;
    }
    *nslots = p.nslots;
    return KP_OK;
}

static int admit_fork(kd_req *r, uint32_t *nslots, kp_error *e)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    kp_slot_fork_params p;
    int rc = kp_slot_fork_params_decode(&r->msg, &r->client->session, &p, e);
    if (rc)
        return rc;
    if (!alloc_slots(x, 2))
        return kp_fail(e, KP_E_NO_MEMORY, "no memory for a fork");
    if ((rc = resolve(r, p.src, FIELD("src"), &x->slots[0], e)))
        return rc;
    if (p.has_dst) {
        if ((rc = resolve(r, p.dst, FIELD("dst"), &x->slots[1], e)))
            return rc;
    } else {
        uint64_t handle;
        if ((rc = kd_pool_alloc(&d->pool, kd_client_owner(r->client), r->client->peer.uid,
                                &r->client->session.limits, 1, false, &handle, e)))
            return rc;
        x->slots[1] = kp_slot_index(handle);
        x->fork.allocated = true;
    }
    *nslots = 2;
    return KP_OK;
}

static int admit_read(kd_req *r, kd_job_cost *cost, uint32_t *nslots, kp_error *e)
{
    kd_exec *x = r->exec;
    kp_slot_read_params p;
    int rc = kp_slot_read_params_decode(&r->msg, &r->client->session, &p, e);
    if (rc)
        return rc;
    if (!alloc_slots(x, 1))
        return kp_fail(e, KP_E_NO_MEMORY, "no memory for a read");
    if ((rc = resolve(r, p.slot, FIELD("slot"), &x->slots[0], e)))
        return rc;
    x->read.dtype = p.dtype;
    uint64_t bytes = kp_state_bytes(r->client->session.geometry.heads, p.dtype);
    if (p.out.kind == KP_REF_REGION) {
        if ((rc = use_ref(r, &p.out, FIELD("out"), true, &x->read.out, e)) ||
            (rc = check_convertible(r, x->read.out, p.dtype, "out", e)))
            return rc;
    } else {
        x->bytes_out[KP_TRANSPORT_ID_INLINE] += bytes;
    }
    cost->stage_out = slot_stage_cost(r, x->read.out, p.dtype);
    *nslots = 1;
    return KP_OK;
}

static int admit_write(kd_req *r, kd_job_cost *cost, uint32_t *nslots, kp_error *e)
{
    kd_exec *x = r->exec;
    kp_slot_write_params p;
    int rc = kp_slot_write_params_decode(&r->msg, &r->client->session, &p, e);
    if (rc)
        return rc;
    if (!alloc_slots(x, 1))
        return kp_fail(e, KP_E_NO_MEMORY, "no memory for a write");
    if ((rc = resolve(r, p.slot, FIELD("slot"), &x->slots[0], e)) ||
        (rc = use_ref(r, &p.state, FIELD("state"), false, &x->write.in, e)) ||
        (rc = check_convertible(r, x->write.in, p.dtype, "state", e)))
        return rc;
    x->write.dtype = p.dtype;
    x->write.pos = p.pos;
    cost->stage_in = slot_stage_cost(r, x->write.in, p.dtype);
    *nslots = 1;
    return KP_OK;
}

/*
 * A step costs O(1) per request plus a few loads and stores per sequence:
 * its lists are bins read in place, its tensors are five references for the
 * whole step, and each handle is resolved once.
 */
static int admit_step(kd_req *r, kd_job_cost *cost, uint32_t *nslots, kp_error *e)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    kp_step_params *p = &x->step.p;
    int rc;
    if ((rc = kp_step_params_decode(&r->msg, &r->client->session, p, e)) ||
        (rc = kd_layers_acquire(&d->layers, p->layer, r->client->peer.uid, &x->layer, e)))
        return rc;
    x->step.seqs = malloc((size_t)p->nseqs * sizeof(*x->step.seqs));
    x->step.pos = malloc((size_t)p->nseqs * sizeof(*x->step.pos));
    if (!alloc_slots(x, p->nseqs) || !x->step.seqs || !x->step.pos)
        return kp_fail(e, KP_E_NO_MEMORY, "no memory for a step of %u sequences", p->nseqs);
    const uint32_t heads = r->client->session.geometry.heads;
    *cost = (kd_job_cost){p->tokens, p->nseqs, 0, 0};
    int32_t start = 0;
    bool longer = false;
    for (uint32_t i = 0; i < p->nseqs; i++) {
        if ((rc = resolve(r, kp_step_u64(p->slots, i), ((field_at){"slots", i, NULL}),
                          &x->slots[i], e)))
            return rc;
        x->step.seqs[i] = (kda_step_seq){.slot = x->slots[i], .start = start,
                                          .len = p->lens[i], .flags = 0};
        start += p->lens[i];
        longer |= p->lens[i] > KDA_STEP_CHOICE_TOKENS;
    }
    for (int t = 0; t < KP_STEP_TENSORS; t++) {
        const kp_ref *ref = &p->tensors[t];
        const bool out = t >= KP_STEP_OUT;
        if (ref->kind == KP_REF_ABSENT) {
            if (t == KP_STEP_OUT)
                inline_output(r, kp_token_tensor_bytes(p->tokens, heads), cost);
            continue;
        }
        if ((rc = use_ref(r, ref, FIELD(kp_step_tensor_name(t)), out, &x->step.buf[t], e)))
            return rc;
        /* The cuda backend stages inline inputs; region memory the kernel reads in place. */
        if (ref->kind == KP_REF_INLINE)
            cost->stage_in += stage_cost(r, ref->nbytes);
    }
    /* Past KDA_STEP_CHOICE_TOKENS tokens the chunked kernel is the faster one
     * (kda.h); only the step kernel keeps the states after every token. */
    x->step.chunked = longer && p->states.kind == KP_REF_ABSENT;
    *nslots = p->nseqs;
    return KP_OK;
}

int kd_exec_admit(kd_req *r, kp_error *e)
{
    kd_daemon *d = daemon_of(r);
    kd_job_cost cost = {0, 1, 0, 0};
    uint32_t nslots = 0;
    int rc;
    r->exec = calloc(1, sizeof(*r->exec));
    if (!r->exec)
        return kp_fail(e, KP_E_NO_MEMORY, "no memory for the request");
    r->release = exec_release;
    r->answering = exec_answering;
    switch (r->method) {
    case KP_METHOD_PREFILL: rc = admit_prefill(r, &cost, &nslots, e); break;
    case KP_METHOD_STEP: rc = admit_step(r, &cost, &nslots, e); break;
    case KP_METHOD_SLOT_FREE:
    case KP_METHOD_SLOT_RESET: rc = admit_slot_list(r, &nslots, e); break;
    case KP_METHOD_SLOT_FORK: rc = admit_fork(r, &nslots, e); break;
    case KP_METHOD_SLOT_READ: rc = admit_read(r, &cost, &nslots, e); break;
    case KP_METHOD_SLOT_WRITE: rc = admit_write(r, &cost, &nslots, e); break;
    default: rc = kp_fail(e, KP_E_INTERNAL, "%s is not a slot-ordered method", r->msg.name);
    }
    bool host = r->method == KP_METHOD_SLOT_FREE || r->method == KP_METHOD_SLOT_RESET;
    if (rc || (rc = enqueue(r, nslots, host, cost, e)))
        return rc;
    if (r->method == KP_METHOD_SLOT_FREE) {
        /* Later requests naming these handles fail at once (STALE_SLOT);
         * earlier ones still run; the slots return to the pool after them. */
        for (uint32_t i = 0; i < nslots; i++)
            kd_pool_retire(&d->pool, r->exec->slots[i]);
    }
    return KP_OK;
}

/* ---------------------------------------------------------------------- */
/* Completion helpers                                                     */
/* ---------------------------------------------------------------------- */

/* Takes a started job out of the scheduler (before the request is freed). */
static void job_done(kd_req *r)
{
    if (r->job.state != KD_JOB_RUNNING)
        return;
    kd_daemon *d = daemon_of(r);
    kd_sched_done(&d->sched, &r->job);
    kd_job_left(d, &r->job);
}

static void fail(kd_req *r, const kp_error *e)
{
    job_done(r);
    kd_req_fail(r, e);
}

static void reply_empty(kd_req *r)
{
    job_done(r);
    kd_req_reply_empty(r);
}

static void add_stats(kd_req *r)
{
    kd_stats *s = &daemon_of(r)->stats;
    for (int t = 0; t < KP_TRANSPORT_ID_COUNT; t++) {
        s->bytes_in[t] += r->exec->bytes_in[t];
        s->bytes_out[t] += r->exec->bytes_out[t];
    }
}

static kd_slot_op *add_op(kd_batch *b)
{
    return &b->ops[b->nops++];
}

static void *alloc_out(uint64_t bytes)
{
    /* 64: the cpu backend's vector stores and the cuda staging copies like it */
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* ---------------------------------------------------------------------- */
/* Prefill                                                                */
/* ---------------------------------------------------------------------- */

static void free_outputs(kd_exec *x)
{
    for (uint32_t i = 0; x->prefill.out && i < x->prefill.p.nseqs; i++) {
        free(x->prefill.out[i]);
        x->prefill.out[i] = NULL;
    }
}

static kd_prepare prepare_prefill(kd_req *r, kd_batch *b)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    const kp_prefill_params *p = &x->prefill.p;
    const uint32_t heads = r->client->session.geometry.heads;
    kp_error e;
    /* Every sequence is checked before anything happens: all or nothing. */
    for (uint32_t i = 0; i < p->nseqs; i++) {
        const kp_prefill_seq *q = &p->seqs[i];
        const kd_slot *s = kd_pool_slot(&d->pool, x->slots[i]);
        if (!q->fresh && kd_pool_check_ready(&d->pool, x->slots[i], NULL, NULL) != KP_OK) {
            char field[KP_FIELD_NAME_MAX];
            kd_pool_check_ready(&d->pool, x->slots[i], field_text(SEQ_FIELD(i, "slot"), field),
                                &e);
            fail(r, &e);
            return KD_PREPARE_FAILED;
        }
        if (q->has_expect_pos && s->pos != q->expect_pos) {
            kp_fail(&e, KP_E_POSITION_MISMATCH, "seqs[%u]: slot 0x%llx is at position %llu, "
                    "expect_pos %llu", i, (unsigned long long)q->slot,
                    (unsigned long long)s->pos, (unsigned long long)q->expect_pos);
            fail(r, &e);
            return KD_PREPARE_FAILED;
        }
        if (kd_pool_next_pos(&d->pool, x->slots[i], q->fresh, q->len, NULL, &x->prefill.pos[i],
                             NULL) != KP_OK) {
            char field[KP_FIELD_NAME_MAX];
            kd_pool_next_pos(&d->pool, x->slots[i], q->fresh, q->len,
                             field_text(SEQ_FIELD(i, "slot"), field), &x->prefill.pos[i], &e);
            fail(r, &e);
            return KD_PREPARE_FAILED;
        }
        if (q->len > 0 && q->out.kind == KP_REF_ABSENT) {
            uint64_t bytes = kp_token_tensor_bytes(q->len, heads);
            if (!(x->prefill.out[i] = alloc_out(bytes))) {
                free_outputs(x);
                kp_fail(&e, KP_E_NO_MEMORY, "no memory for %llu bytes of output",
                        (unsigned long long)bytes);
                fail(r, &e);
                return KD_PREPARE_FAILED;
            }
            x->prefill.buf[i][KP_TENSOR_OUT] = (kd_buf){x->prefill.out[i], NULL};
        }
    }
    bool work = false;
    for (uint32_t i = 0; i < p->nseqs; i++) {
        const kp_prefill_seq *q = &p->seqs[i];
        if (q->len == 0)
            continue;
        const kd_slot *s = kd_pool_slot(&d->pool, x->slots[i]);
        kd_batch_seq *bs = &b->seqs[b->nseqs++];
        memset(bs, 0, sizeof(*bs));
        for (int t = 0; t < 5; t++)
            bs->in[t] = x->prefill.buf[i][t];
        bs->out = x->prefill.buf[i][KP_TENSOR_OUT];
        bs->layer = x->layer->dev;
        bs->len = q->len;
        bs->slot = x->slots[i];
        bs->flags = q->fresh || s->zero ? KDA_SEQ_ZERO_STATE : 0;
        work = true;
    }
    if (!work) {
        kd_exec_finish(r, NULL);
        return KD_PREPARE_DONE;
    }
    if (x->has_done) { /* the backend stores it after the batch's outputs and states */
        b->dones[b->ndones++] = x->done;
        x->done_set = true;
    }
    return KD_PREPARE_BATCHED;
}

/* Device memory only (CUDA IPC, a VMM allocation): nothing to stage or copy. */
static bool on_device_only(kd_buf b)
{
    return b.dev && !b.host;
}

bool kd_exec_launch_early(kd_req *r)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    if (r->method != KP_METHOD_PREFILL || !x->has_ready || !x->ready.word.buf.dev)
        return false;
    const kp_prefill_params *p = &x->prefill.p;
    bool work = false;
    for (uint32_t i = 0; i < p->nseqs; i++) {
        const kp_prefill_seq *q = &p->seqs[i];
        uint64_t pos;
        /* prepare_prefill's run-time checks, without their answers: a request that would fail
         * them waits for its word and fails then, as on the host path */
        if ((!q->fresh && kd_pool_check_ready(&d->pool, x->slots[i], NULL, NULL) != KP_OK) ||
            (q->has_expect_pos && kd_pool_slot(&d->pool, x->slots[i])->pos != q->expect_pos) ||
            kd_pool_next_pos(&d->pool, x->slots[i], q->fresh, q->len, NULL, &pos, NULL) != KP_OK)
            return false;
        if (q->len == 0)
            continue;
        for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
            if (!on_device_only(x->prefill.buf[i][t]))
                return false;
        }
        work = true;
    }
    return work;
}

static void finish_prefill(kd_req *r, const kd_batch *b)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    const kp_prefill_params *p = &x->prefill.p;
    const uint32_t heads = r->client->session.geometry.heads;
    kp_error e;
    uint64_t tokens = 0;
    if (x->has_done && !x->done_set) { /* no device work: nothing to wait for */
        kd_backend_write_word(d->backend, x->done.buf, x->done.value);
        x->done_set = true;
    }
    for (uint32_t i = 0; i < p->nseqs; i++) {
        const kp_prefill_seq *q = &p->seqs[i];
        if (q->len > 0)
            kd_pool_set_ready(&d->pool, x->slots[i], x->prefill.pos[i], false);
        else if (q->fresh) /* a fresh empty sequence only resets: lazily */
            kd_pool_set_ready(&d->pool, x->slots[i], 0, true);
        tokens += q->len;
    }
    d->stats.seqs += p->nseqs;
    d->stats.tokens += tokens;
    r->client->last_prefill_ns = d->engine.last_prefill_ns = uv_hrtime();
    add_stats(r);
    job_done(r);

    kp_prefill_seq_result *seqs = calloc(p->nseqs, sizeof(*seqs));
    kd_out *o = seqs ? kd_req_frame(r) : NULL;
    if (!o) {
        if (!seqs) {
            kp_fail(&e, KP_E_NO_MEMORY, "no memory for the result");
            kd_req_fail(r, &e);
        }
        free(seqs);
        return;
    }
    for (uint32_t i = 0; i < p->nseqs; i++) {
        seqs[i].pos = x->prefill.pos[i];
        if (x->prefill.out[i])
            seqs[i].out = kp_ref_inline(x->prefill.out[i],
                                        kp_token_tensor_bytes(p->seqs[i].len, heads));
    }
    kp_prefill_result res = {.seqs = seqs, .nseqs = p->nseqs};
    if (b) {
        /* "launch": the batch staged, its enqueue starting */
        const kd_batch_timing *t = &b->t;
        res.queue_us = t->staged_ns > r->arrival_ns ? (t->staged_ns - r->arrival_ns) / 1000 : 0;
        res.run_us = t->done_ns > t->staged_ns ? (t->done_ns - t->staged_ns) / 1000 : 0;
        res.timed = true;
        res.device_us = t->device_ns / 1000;
        res.kernel_us = t->kernel_ns / 1000;
    }
    int rc = kp_prefill_result_encode(&o->w, r->id, &res, &e);
    free(seqs);
    /* The frame references the outputs: they now live as long as it. */
    for (uint32_t i = 0; rc == KP_OK && i < p->nseqs; i++) {
        void *out = x->prefill.out[i];
        x->prefill.out[i] = NULL;
        if (out && kd_out_keep(o, out) != KP_OK)
            rc = kp_fail(&e, KP_E_NO_MEMORY, "no memory to hold the output");
    }
    kd_req_reply(r, o, rc, &e);
}

/* ---------------------------------------------------------------------- */
/* Step                                                                   */
/* ---------------------------------------------------------------------- */

static kd_buf buf_at(kd_buf b, uint64_t off)
{
    return (kd_buf){b.host ? (uint8_t *)b.host + off : NULL, b.dev ? (uint8_t *)b.dev + off : NULL};
}

/* A step run by the chunked kernel: one prefill sequence per step sequence,
 * pointing into the packed tensors. */
static void add_chunked(kd_exec *x, kd_batch *b, uint32_t heads)
{
    const kp_step_params *p = &x->step.p;
    for (uint32_t i = 0; i < p->nseqs; i++) {
        const kda_step_seq *q = &x->step.seqs[i];
        const uint64_t tok = kp_token_tensor_bytes(1, heads), beta = kp_beta_bytes(1, heads);
        kd_batch_seq *bs = &b->seqs[b->nseqs++];
        for (int t = 0; t < 5; t++)
            bs->in[t] = buf_at(x->step.buf[t], (uint64_t)q->start * (t == KP_STEP_BETA ? beta : tok));
        bs->out = buf_at(x->step.buf[KP_STEP_OUT], (uint64_t)q->start * tok);
        bs->layer = x->layer->dev;
        bs->len = q->len;
        bs->slot = q->slot;
        bs->flags = q->flags;
    }
}

static kd_prepare prepare_step(kd_req *r, kd_batch *b)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    const kp_step_params *p = &x->step.p;
    const uint32_t heads = r->client->session.geometry.heads;
    kp_error e;
    /* Every sequence is checked before anything happens: all or nothing. */
    for (uint32_t i = 0; i < p->nseqs; i++) {
        const uint32_t slot = x->slots[i];
        const kd_slot *s = kd_pool_slot(&d->pool, slot);
        char field[KP_FIELD_NAME_MAX];
        if (kd_pool_check_ready(&d->pool, slot, NULL, NULL) != KP_OK) {
            kd_pool_check_ready(&d->pool, slot, kp_field_name(field, sizeof(field), "slots", i,
                                                             NULL), &e);
            fail(r, &e);
            return KD_PREPARE_FAILED;
        }
        if (p->expect_pos && s->pos != kp_step_u64(p->expect_pos, i)) {
            kp_fail(&e, KP_E_POSITION_MISMATCH, "slots[%u]: slot 0x%llx is at position %llu, "
                    "expect_pos %llu", i, (unsigned long long)kp_step_u64(p->slots, i),
                    (unsigned long long)s->pos, (unsigned long long)kp_step_u64(p->expect_pos, i));
            fail(r, &e);
            return KD_PREPARE_FAILED;
        }
        if (kd_pool_next_pos(&d->pool, slot, false, p->lens[i], NULL, &x->step.pos[i], NULL) !=
            KP_OK) {
            kd_pool_next_pos(&d->pool, slot, false, p->lens[i],
                             kp_field_name(field, sizeof(field), "slots", i, NULL),
                             &x->step.pos[i], &e);
            fail(r, &e);
            return KD_PREPARE_FAILED;
        }
        x->step.seqs[i].flags = s->zero ? KDA_SEQ_ZERO_STATE : 0;
    }
    if (p->out.kind == KP_REF_ABSENT) {
        uint64_t bytes = kp_token_tensor_bytes(p->tokens, heads);
        if (!(x->step.out = alloc_out(bytes))) {
            kp_fail(&e, KP_E_NO_MEMORY, "no memory for %llu bytes of output",
                    (unsigned long long)bytes);
            fail(r, &e);
            return KD_PREPARE_FAILED;
        }
        x->step.buf[KP_STEP_OUT] = (kd_buf){x->step.out, NULL};
    }
    if (x->step.chunked) {
        add_chunked(x, b, heads);
        return KD_PREPARE_BATCHED;
    }
    kd_batch_step *st = &b->steps[b->nsteps++];
    memset(st, 0, sizeof(*st));
    for (int t = 0; t < 5; t++)
        st->in[t] = x->step.buf[t];
    st->out = x->step.buf[KP_STEP_OUT];
    st->states = x->step.buf[KP_STEP_STATES];
    st->layer = x->layer->dev;
    st->seqs = x->step.seqs;
    st->nseqs = p->nseqs;
    st->tokens = p->tokens;
    return KD_PREPARE_BATCHED;
}

static void finish_step(kd_req *r, const kd_batch *b)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    const kp_step_params *p = &x->step.p;
    kp_error e;
    for (uint32_t i = 0; i < p->nseqs; i++)
        kd_pool_set_ready(&d->pool, x->slots[i], x->step.pos[i], false);
    d->stats.seqs += p->nseqs;
    d->stats.tokens += p->tokens;
    add_stats(r);
    job_done(r);
    kd_out *o = kd_req_frame(r);
    if (!o)
        return;
    kp_step_result res = {.nseqs = p->nseqs, .pos = x->step.pos};
    if (x->step.out)
        res.out = kp_ref_inline(x->step.out,
                                kp_token_tensor_bytes(p->tokens, r->client->session.geometry.heads));
    const kd_batch_timing *t = &b->t;
    res.queue_us = t->staged_ns > r->arrival_ns ? (t->staged_ns - r->arrival_ns) / 1000 : 0;
    res.run_us = t->done_ns > t->staged_ns ? (t->done_ns - t->staged_ns) / 1000 : 0;
    res.timed = true;
    res.device_us = t->device_ns / 1000;
    res.kernel_us = t->kernel_ns / 1000;
    int rc = kp_step_result_encode(&o->w, r->id, &res, &e);
    /* The frame references the positions and the output: they now live as long as it. */
    void *keep[2] = {x->step.pos, x->step.out};
    x->step.pos = NULL;
    x->step.out = NULL;
    for (int i = 0; i < 2; i++) {
        if (!keep[i])
            continue;
        if (rc == KP_OK && kd_out_keep(o, keep[i]) != KP_OK)
            rc = kp_fail(&e, KP_E_NO_MEMORY, "no memory to hold the result");
        else if (rc != KP_OK)
            free(keep[i]);
    }
    kd_req_reply(r, o, rc, &e);
}

/* ---------------------------------------------------------------------- */
/* Slot operations                                                        */
/* ---------------------------------------------------------------------- */

static kd_prepare prepare_fork(kd_req *r, kd_batch *b)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    kp_error e;
    uint32_t src = x->slots[0], dst = x->slots[1];
    if (kd_pool_check_ready(&d->pool, src, "src", &e) != KP_OK) {
        fail(r, &e);
        return KD_PREPARE_FAILED;
    }
    const kd_slot *s = kd_pool_slot(&d->pool, src);
    x->fork.pos = s->pos;
    if (s->zero) { /* the copy of a lazy zero state is a lazy zero state */
        kd_exec_finish(r, NULL);
        return KD_PREPARE_DONE;
    }
    *add_op(b) = (kd_slot_op){.kind = KD_OP_COPY, .slot = dst, .src = src};
    return KD_PREPARE_BATCHED;
}

static void finish_fork(kd_req *r)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    uint32_t src = x->slots[0], dst = x->slots[1];
    kd_pool_set_ready(&d->pool, dst, x->fork.pos, kd_pool_slot(&d->pool, src)->zero);
    x->fork.allocated = false; /* the client has it now */
    job_done(r);
    kp_slot_fork_result res = {kd_pool_handle(&d->pool, dst), x->fork.pos};
    kp_error e;
    kd_out *o = kd_req_frame(r);
    if (o)
        kd_req_reply(r, o, kp_slot_fork_result_encode(&o->w, r->id, &res, &e), &e);
}

static kd_prepare prepare_read(kd_req *r, kd_batch *b)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    kp_error e;
    uint32_t slot = x->slots[0];
    if (kd_pool_check_ready(&d->pool, slot, "slot", &e) != KP_OK) {
        fail(r, &e);
        return KD_PREPARE_FAILED;
    }
    const kd_slot *s = kd_pool_slot(&d->pool, slot);
    x->read.pos = s->pos;
    if (!x->read.out.host && !x->read.out.dev) {
        uint64_t bytes = kp_state_bytes(r->client->session.geometry.heads, x->read.dtype);
        if (!(x->read.inline_out = alloc_out(bytes))) {
            kp_fail(&e, KP_E_NO_MEMORY, "no memory for %llu bytes of state",
                    (unsigned long long)bytes);
            fail(r, &e);
            return KD_PREPARE_FAILED;
        }
        x->read.out = (kd_buf){x->read.inline_out, NULL};
    }
    x->read.zeroes = s->zero;
    if (s->zero) /* make the lazy zero state real first: the batch runs ops in order */
        *add_op(b) = (kd_slot_op){.kind = KD_OP_ZERO, .slot = slot};
    *add_op(b) = (kd_slot_op){.kind = KD_OP_READ, .slot = slot,
                                .dtype = (kda_dtype)x->read.dtype, .buf = x->read.out};
    return KD_PREPARE_BATCHED;
}

static void finish_read(kd_req *r)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    kp_error e;
    if (x->read.zeroes) /* the memory holds the zeros now */
        kd_pool_set_ready(&d->pool, x->slots[0], x->read.pos, false);
    add_stats(r);
    job_done(r);
    kp_slot_read_result res = {x->read.pos, x->read.dtype, {KP_REF_ABSENT, NULL, 0, 0, 0}};
    if (x->read.inline_out)
        res.state = kp_ref_inline(x->read.inline_out,
                                  kp_state_bytes(r->client->session.geometry.heads, x->read.dtype));
    kd_out *o = kd_req_frame(r);
    if (!o)
        return;
    int rc = kp_slot_read_result_encode(&o->w, r->id, &res, &e);
    void *state = x->read.inline_out;
    x->read.inline_out = NULL;
    if (rc == KP_OK && state && kd_out_keep(o, state) != KP_OK)
        rc = kp_fail(&e, KP_E_NO_MEMORY, "no memory to hold the state");
    else if (rc != KP_OK)
        free(state);
    kd_req_reply(r, o, rc, &e);
}

static kd_prepare prepare_write(kd_req *r, kd_batch *b)
{
    kd_exec *x = r->exec;
    *add_op(b) = (kd_slot_op){.kind = KD_OP_WRITE, .slot = x->slots[0],
                                .dtype = (kda_dtype)x->write.dtype, .buf = x->write.in};
    return KD_PREPARE_BATCHED;
}

/* ---------------------------------------------------------------------- */
/* Entry points                                                           */
/* ---------------------------------------------------------------------- */

kd_prepare kd_exec_prepare(kd_req *r, kd_batch *b)
{
    switch (r->method) {
    case KP_METHOD_PREFILL: return prepare_prefill(r, b);
    case KP_METHOD_STEP: return prepare_step(r, b);
    case KP_METHOD_SLOT_FORK: return prepare_fork(r, b);
    case KP_METHOD_SLOT_READ: return prepare_read(r, b);
    default: return prepare_write(r, b);
    }
}

void kd_exec_finish(kd_req *r, const kd_batch *b)
{
    kd_daemon *d = daemon_of(r);
    kp_error e;
    if (b && b->status != KD_BATCH_OK && r->exec->has_done)
        r->exec->done_set = false; /* the batch stored nothing: the answer writes the failure */
    if (b && b->status == KD_BATCH_FAILED) { /* nothing ran */
        kp_fail(&e, b->code, "%s", b->message);
        fail(r, &e);
        return;
    }
    if (b && (b->status == KD_BATCH_LOST || b->status == KD_BATCH_FATAL)) {
        /* The device failed while this request ran: its slots cannot be trusted. */
        for (uint32_t i = 0; i < r->job.nslots; i++)
            kd_pool_set_lost(&d->pool, r->exec->slots[i]);
        kp_fail(&e, KP_E_DEVICE_FAILED, "the device failed running this request; its slots "
                "are now lost: %s", b->message);
        fail(r, &e);
        return;
    }
    switch (r->method) {
    case KP_METHOD_PREFILL: finish_prefill(r, b); break;
    case KP_METHOD_STEP: finish_step(r, b); break;
    case KP_METHOD_SLOT_FORK: finish_fork(r); break;
    case KP_METHOD_SLOT_READ: finish_read(r); break;
    default:
        kd_pool_set_ready(&d->pool, r->exec->slots[0], r->exec->write.pos, false);
        add_stats(r);
        reply_empty(r);
        break;
    }
}

void kd_exec_host(kd_req *r)
{
    kd_daemon *d = daemon_of(r);
    if (r->method == KP_METHOD_SLOT_RESET) {
        for (uint32_t i = 0; i < r->job.nslots; i++)
            kd_pool_set_ready(&d->pool, r->exec->slots[i], 0, true);
    }
    /* slot.free: the retired slots go back to the pool as the job leaves. */
    reply_empty(r);
}

kd_ready_wait *kd_exec_ready_wait(kd_req *r)
{
    return r->exec && r->exec->has_ready ? &r->exec->ready : NULL;
}

/* The request's answering hook: a done word not written yet gets the
 * failure value, before the answer goes out (a failure, or a drop). */
static void exec_answering(kd_req *r)
{
    kd_exec *x = r->exec;
    if (x && x->has_done && !x->done_set) {
        kd_backend_write_word(daemon_of(r)->backend, x->done.buf,
                              x->done.value | KP_SEM_FAILED);
        x->done_set = true;
    }
}

/* The request's release hook: what admission took goes back. */
static void exec_release(kd_req *r)
{
    kd_daemon *d = daemon_of(r);
    kd_exec *x = r->exec;
    if (x->has_ready)
        kd_ready_cancel(&x->ready);
    if (x->layer)
        kd_layer_unref(&d->layers, x->layer);
    for (uint32_t i = 0; i < x->nregions; i++)
        kd_region_unref(x->regions[i]);
    free(x->regions);
    switch (r->method) {
    case KP_METHOD_PREFILL:
        free_outputs(x);
        free(x->prefill.buf);
        free(x->prefill.out);
        free(x->prefill.pos);
        break;
    case KP_METHOD_STEP:
        free(x->step.seqs);
        free(x->step.pos);
        free(x->step.out);
        break;
    case KP_METHOD_SLOT_FORK:
        if (x->fork.allocated) { /* a destination the client never saw */
            uint32_t dst = x->slots[1];
            kd_pool_retire(&d->pool, dst);
            kd_slot_settle(d, dst);
        }
        break;
    case KP_METHOD_SLOT_READ:
        free(x->read.inline_out);
        break;
    default:
        break;
    }
    free(x->slots);
    free(x);
    r->exec = NULL;
    r->release = NULL;
    r->answering = NULL;
}
