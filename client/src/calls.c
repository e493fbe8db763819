/*
 * calls.c - every method of the protocol as a client call: argument checks
 * (before any side effect, in a fixed order), the request's encoding through
 * the shared codec, and the decoder that turns its response into a
 * kdac_result.  Blocking forms are the *_send forms plus sync_wait; the
 * setup-time methods (stats, layer.*, region.*) are blocking only and
 * decode straight into the caller's outputs.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_int.h"

/* ---------------------------------------------------------------------- */
/* Shared steps                                                           */
/* ---------------------------------------------------------------------- */

/* Allocates request m with an id; NULL with err set when it cannot. */
static pending *start(kdac_client *c, kp_method m, kdac_cb cb, void *data, decode_fn decode,
                      kdac_error *err)
{
    pending *p = pending_new(c, m, cb, data, decode);
    if (!p) {
        kdac_fail(err, KDAC_E_NO_MEMORY, "cannot allocate a %s request", kp_method_name(m));
        return NULL;
    }
    p->id = client_next_id(c);
    return p;
}

/* After encoding: submit, or free and report the encoder's error. */
static int finish(kdac_client *c, pending *p, int rc, const kp_error *e, kdac_error *err)
{
    if (rc != KP_OK) {
        pending_free(c, p);
        return kdac_from_kp(err, e);
    }
    client_submit(c, p);
    return KDAC_OK;
}

/* Checks common to every *_send. */
static int check_send(kdac_client *c, kdac_cb cb, kdac_error *err)
{
    int rc = client_check_usable(c, false, err);
    if (rc)
        return rc;
    if (!cb)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "callback is NULL");
    return KDAC_OK;
}

static int sync_begin(kdac_client *c, sync_call *s, kdac_error *err)
{
    memset(s, 0, sizeof(*s));
    return client_check_usable(c, true, err);
}

static int empty_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res, kp_error *err)
{
    return kp_empty_result_decode(msg, err);
}

static int check_dtype(kdac_dtype dtype, kdac_error *err)
{
    if (dtype != KDAC_DTYPE_BF16 && dtype != KDAC_DTYPE_F32)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "dtype: %d is neither KDAC_DTYPE_BF16 "
                         "nor KDAC_DTYPE_F32", (int)dtype);
    return KDAC_OK;
}

/* An input tensor of nbytes as a codec reference. */
/* Tensor fields are named in errors only: seqs[seq].name, or name alone for
 * a field of the params (seq TOP_FIELD). */
#define TOP_FIELD UINT32_MAX

static const char *field_name(char buf[KP_FIELD_NAME_MAX], uint32_t seq, const char *name)
{
    return seq == TOP_FIELD ? name : kp_field_name(buf, KP_FIELD_NAME_MAX, "seqs", seq, name);
}

static int input_ref(const kdac_tensor *t, uint64_t nbytes, uint32_t seq, const char *name,
                     kp_ref *ref, kdac_error *err)
{
    char buf[KP_FIELD_NAME_MAX];
    if (t->region) {
        if (t->offset % KDAC_TENSOR_ALIGN)
            return kdac_fail(err, KDAC_E_INVALID_PARAMS, "%s: offset %llu is not a multiple "
                             "of %d", field_name(buf, seq, name), (unsigned long long)t->offset,
                             KDAC_TENSOR_ALIGN);
        *ref = kp_ref_region(t->region, t->offset, nbytes);
        return KDAC_OK;
    }
    if (!t->data)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "%s: neither data nor a region",
                         field_name(buf, seq, name));
    *ref = kp_ref_inline(t->data, nbytes);
    return KDAC_OK;
}

/* An output: a region reference, or ABSENT (inline in the result). */
static int output_ref(const kdac_output *o, uint64_t nbytes, uint32_t seq, const char *name,
                      kp_ref *ref, kdac_error *err)
{
    char buf[KP_FIELD_NAME_MAX];
    memset(ref, 0, sizeof(*ref));
    if (!o->region)
        return KDAC_OK;
    if (o->offset % KDAC_TENSOR_ALIGN)
        return kdac_fail(err, KDAC_E_INVALID_PARAMS, "%s: offset %llu is not a multiple of %d",
                         field_name(buf, seq, name), (unsigned long long)o->offset,
                         KDAC_TENSOR_ALIGN);
    *ref = kp_ref_region(o->region, o->offset, nbytes);
    return KDAC_OK;
}

static int check_slot_list(const uint64_t *slots, uint32_t n, kdac_error *err)
{
    if (n == 0)
        return kdac_fail(err, KDAC_E_INVALID_PARAMS, "slots: at least one handle is needed");
    if (!slots)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "slots is NULL");
    return KDAC_OK;
}

/* ---------------------------------------------------------------------- */
/* prefill                                                                */
/* ---------------------------------------------------------------------- */

/* The result's positions are in p->ctx.prefill.pos already. */
static void prefill_answer(const pending *p, const kp_prefill_result *r, kdac_result *res)
{
    res->u.prefill.nseqs = r->nseqs;
    res->u.prefill.pos = p->ctx.prefill.pos;
    res->u.prefill.queue_us = r->queue_us;
    res->u.prefill.run_us = r->run_us;
    res->u.prefill.device_us = r->device_us;
    res->u.prefill.kernel_us = r->kernel_us;
}

static int prefill_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res,
                          kp_error *err)
{
    kp_prefill_params req = {.layer = NULL, .seqs = p->ctx.prefill.seqs,
                             .nseqs = p->ctx.prefill.nseqs};
    kp_prefill_result r;
    int rc = kp_prefill_result_decode(msg, &c->session, &req, &r, err);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < r.nseqs; i++) {
        p->ctx.prefill.pos[i] = r.seqs[i].pos;
        void *dst = p->ctx.prefill.outs[i];
        if (r.seqs[i].out.kind == KP_REF_INLINE && dst)
            memcpy(dst, r.seqs[i].out.data, r.seqs[i].out.nbytes);
    }
    prefill_answer(p, &r, res);
    return KP_OK;
}

/* Results without inline output (outputs in regions): kp_prefill_result_read. */
static bool prefill_read(kdac_client *c, pending *p, const uint8_t *body, size_t len,
                         kdac_result *res)
{
    kp_prefill_params req = {.layer = NULL, .seqs = p->ctx.prefill.seqs,
                             .nseqs = p->ctx.prefill.nseqs};
    kp_prefill_result r;
    if (!kp_prefill_result_read(body, len, c->rd.max_frame, &req, p->ctx.prefill.pos, &r))
        return false;
    prefill_answer(p, &r, res);
    return true;
}

/* One sequence as the codec's; adds its tokens and inline bytes to the sums. */
static int prefill_seq(const kdac_client *c, const kdac_seq *s, uint32_t i, kp_prefill_seq *q,
                       void **out, uint64_t sums[3], kdac_error *err)
{
    uint32_t heads = c->info.heads;
    const kdac_tensor *in[5] = {&s->q, &s->k, &s->v, &s->g, &s->beta};
    if (s->flags & ~(KDAC_SEQ_FRESH | KDAC_SEQ_EXPECT_POS))
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "seqs[%u].flags: unknown bits 0x%x", i,
                         s->flags);
    if ((s->flags & KDAC_SEQ_FRESH) && (s->flags & KDAC_SEQ_EXPECT_POS))
        return kdac_fail(err, KDAC_E_INVALID_PARAMS, "seqs[%u]: KDAC_SEQ_FRESH and "
                         "KDAC_SEQ_EXPECT_POS exclude each other", i);
    memset(q, 0, sizeof(*q));
    q->slot = s->slot;
    q->len = s->len;
    q->fresh = s->flags & KDAC_SEQ_FRESH;
    q->has_expect_pos = s->flags & KDAC_SEQ_EXPECT_POS;
    q->expect_pos = s->expect_pos;
    *out = NULL;
    if (s->len == 0)
        return KDAC_OK;
    uint64_t tok = kp_token_tensor_bytes(s->len, heads);
    for (int t = KP_TENSOR_Q; t <= KP_TENSOR_BETA; t++) {
        uint64_t nbytes = t == KP_TENSOR_BETA ? kp_beta_bytes(s->len, heads) : tok;
        int rc = input_ref(in[t], nbytes, i, kp_prefill_tensor_name(t), &q->tensors[t], err);
        if (rc)
            return rc;
        if (q->tensors[t].kind == KP_REF_INLINE)
            sums[1] += nbytes;
    }
    int rc = output_ref(&s->out, tok, i, "out", &q->out, err);
    if (rc)
        return rc;
    if (q->out.kind == KP_REF_ABSENT) {
        sums[2] += tok;
        *out = s->out.data;
    }
    sums[0] += s->len;
    return KDAC_OK;
}

static bool has_feature(const kdac_client *c, const char *name)
{
    for (uint32_t i = 0; i < c->info.nfeatures; i++) {
        if (strcmp(c->info.features[i], name) == 0)
            return true;
    }
    return false;
}

static int check_sem(const kdac_sem *m, const char *name, kdac_error *err)
{
    if (m->region == 0 || m->offset % KP_SEM_ALIGN || m->value == 0 ||
        m->value > KDAC_SEM_VALUE_MAX)
        return kdac_fail(err, KDAC_E_INVALID_PARAMS, "%s: needs a region >= 1, an offset that "
                         "is a multiple of %u and a value in [1, 2^62 - 1]", name, KP_SEM_ALIGN);
    return KDAC_OK;
}

int client_prefill_check_sems(kdac_client *c, const kdac_sem *ready, const kdac_sem *done,
                              kdac_error *err)
{
    int rc;
    if (!ready && !done)
        return KDAC_OK;
    if (!c)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "client is NULL");
    if (!has_feature(c, KDAC_FEATURE_SEMAPHORES))
        return kdac_fail(err, KDAC_E_NOT_SUPPORTED, "the daemon does not take semaphores (no "
                         "\"" KDAC_FEATURE_SEMAPHORES "\" in hello)");
    if ((ready && (rc = check_sem(ready, "ready", err))) ||
        (done && (rc = check_sem(done, "done", err))))
        return rc;
    return KDAC_OK;
}

int kdac_prefill_send(kdac_client *c, const char *layer, const kdac_seq *seqs, uint32_t nseqs,
                      kdac_cb cb, void *data, kdac_error *err)
{
    return client_prefill_send(c, layer, seqs, nseqs, NULL, NULL, NULL, cb, data, err);
}

int kdac_prefill_send_sems(kdac_client *c, const char *layer, const kdac_seq *seqs,
                           uint32_t nseqs, const kdac_sem *ready, const kdac_sem *done,
                           kdac_cb cb, void *data, kdac_error *err)
{
    int rc = client_prefill_check_sems(c, ready, done, err);
    if (rc)
        return rc;
    return client_prefill_send(c, layer, seqs, nseqs, ready, done, NULL, cb, data, err);
}

static kp_sem wire_sem(const kdac_sem *m)
{
    kp_sem w = {false, 0, 0, 0};
    if (m)
        w = (kp_sem){true, m->region, m->offset, m->value};
    return w;
}

int client_prefill_send(kdac_client *c, const char *layer, const kdac_seq *seqs, uint32_t nseqs,
                        const kdac_sem *ready, const kdac_sem *done, void *ctx, kdac_cb cb,
                        void *data, kdac_error *err)
{
    int rc = check_send(c, cb, err);
    if (rc)
        return rc;
    if (!layer || !seqs)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "layer or seqs is NULL");
    const kdac_limits *lim = &c->info.limits;
    if (nseqs == 0 || nseqs > lim->max_seqs_per_request)
        return kdac_fail(err, KDAC_E_INVALID_PARAMS, "seqs: %u sequences, expected 1..%u "
                         "(max_seqs_per_request)", nseqs, lim->max_seqs_per_request);
    pending *p = start(c, KP_METHOD_PREFILL, cb, data, prefill_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    p->read = prefill_read;
    p->ctx.prefill.nseqs = nseqs;
    p->ctx.prefill.seqs = calloc(nseqs, sizeof(kp_prefill_seq));
    p->ctx.prefill.outs = calloc(nseqs, sizeof(void *));
    p->ctx.prefill.pos = calloc(nseqs, sizeof(uint64_t));
    if (!p->ctx.prefill.seqs || !p->ctx.prefill.outs || !p->ctx.prefill.pos) {
        pending_free(c, p);
        return kdac_fail(err, KDAC_E_NO_MEMORY, "cannot allocate %u sequences", nseqs);
    }
    uint64_t sums[3] = {0, 0, 0}; /* tokens, inline bytes in, inline bytes out */
    for (uint32_t i = 0; i < nseqs; i++) {
        rc = prefill_seq(c, &seqs[i], i, &p->ctx.prefill.seqs[i], &p->ctx.prefill.outs[i], sums,
                         err);
        if (rc) {
            pending_free(c, p);
            return rc;
        }
    }
    /* The daemon would refuse these too, but only after the whole frame
     * crossed the socket. */
    if (sums[0] > lim->max_batch_tokens)
        rc = kdac_fail(err, KDAC_E_LIMIT_EXCEEDED, "seqs: %llu tokens in total exceed "
                       "max_batch_tokens %u", (unsigned long long)sums[0], lim->max_batch_tokens);
    else if (sums[1] > lim->max_inline_bytes)
        rc = kdac_fail(err, KDAC_E_LIMIT_EXCEEDED, "seqs: %llu inline tensor bytes exceed "
                       "max_inline_bytes %llu; use regions", (unsigned long long)sums[1],
                       (unsigned long long)lim->max_inline_bytes);
    else if (sums[2] > lim->max_inline_bytes)
        rc = kdac_fail(err, KDAC_E_LIMIT_EXCEEDED, "seqs: the inline output of %llu bytes would "
                       "exceed max_inline_bytes %llu; name out regions",
                       (unsigned long long)sums[2], (unsigned long long)lim->max_inline_bytes);
    if (rc) {
        pending_free(c, p);
        return rc;
    }
    kp_prefill_params params = {.layer = layer, .seqs = p->ctx.prefill.seqs, .nseqs = nseqs,
                                .ready = wire_sem(ready), .done = wire_sem(done)};
    if (done) {
        p->has_done = true;
        p->done_host = done->host;
        p->done_dev = done->dev;
        p->done_ctx = ctx;
        p->done_value = done->value;
    }
    kp_error e;
    return finish(c, p, kp_prefill_params_encode(p->w, p->id, &params, &e), &e, err);
}

int kdac_prefill(kdac_client *c, const char *layer, const kdac_seq *seqs, uint32_t nseqs,
                 kdac_prefill_result *res, kdac_error *err)
{
    sync_call s;
    int rc;
    if ((rc = sync_begin(c, &s, err)) ||
        (rc = kdac_prefill_send(c, layer, seqs, nseqs, sync_cb, &s, err)) ||
        (rc = sync_wait(c, &s, err)))
        return rc;
    if (res)
        *res = s.res.u.prefill;
    return KDAC_OK;
}

/* ---------------------------------------------------------------------- */
/* step                                                                   */
/* ---------------------------------------------------------------------- */

static int step_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res, kp_error *err)
{
    kp_step_result r;
    int rc = kp_step_result_decode(msg, &c->session, &p->ctx.step.req, &r, err);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < r.nseqs; i++)
        p->ctx.step.pos[i] = kp_step_u64(r.pos, i);
    if (r.out.kind == KP_REF_INLINE && p->ctx.step.out)
        memcpy(p->ctx.step.out, r.out.data, r.out.nbytes);
    res->u.step = (kdac_step_result){r.nseqs, p->ctx.step.pos, r.queue_us, r.run_us, r.device_us,
                                     r.kernel_us};
    return KP_OK;
}

int kdac_step_send(kdac_client *c, const char *layer, const kdac_step_request *step, kdac_cb cb,
                   void *data, kdac_error *err)
{
    int rc = check_send(c, cb, err);
    if (rc)
        return rc;
    if (!layer || !step || !step->slots || !step->lens)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "layer, step, slots or lens is NULL");
    const kdac_limits *lim = &c->info.limits;
    const uint32_t n = step->nseqs, heads = c->info.heads;
    if (n == 0 || n > lim->max_seqs_per_request)
        return kdac_fail(err, KDAC_E_INVALID_PARAMS, "slots: %u sequences, expected 1..%u "
                         "(max_seqs_per_request)", n, lim->max_seqs_per_request);
    uint64_t tokens = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (step->lens[i] < 1 || step->lens[i] > KDAC_STEP_MAX_TOKENS)
            return kdac_fail(err, KDAC_E_INVALID_PARAMS, "lens[%u]: %u is outside [1, %d]", i,
                             step->lens[i], KDAC_STEP_MAX_TOKENS);
        tokens += step->lens[i];
    }
    if (tokens > lim->max_batch_tokens)
        return kdac_fail(err, KDAC_E_LIMIT_EXCEEDED, "lens: %llu tokens in total exceed "
                         "max_batch_tokens %u", (unsigned long long)tokens, lim->max_batch_tokens);
    if (step->states.data)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "states: a region only (the daemon "
                         "does not return states inline)");

    kp_step_params q = {.layer = layer, .nseqs = n, .tokens = (uint32_t)tokens};
    const kdac_tensor *in[5] = {&step->q, &step->k, &step->v, &step->g, &step->beta};
    const uint64_t tok = kp_token_tensor_bytes(q.tokens, heads);
    uint64_t inline_in = 0;
    for (int t = KP_STEP_Q; t <= KP_STEP_BETA; t++) {
        const uint64_t nbytes = t == KP_STEP_BETA ? kp_beta_bytes(q.tokens, heads) : tok;
        if ((rc = input_ref(in[t], nbytes, TOP_FIELD, kp_step_tensor_name(t), &q.tensors[t], err)))
            return rc;
        if (q.tensors[t].kind == KP_REF_INLINE)
            inline_in += nbytes;
    }
    if ((rc = output_ref(&step->out, tok, TOP_FIELD, "out", &q.out, err)) ||
        (rc = output_ref(&step->states, q.tokens * kp_state_bytes(heads, c->session.geometry.state_dtype),
                         TOP_FIELD, "states", &q.states, err)))
        return rc;
    if (inline_in > lim->max_inline_bytes)
        return kdac_fail(err, KDAC_E_LIMIT_EXCEEDED, "%llu inline tensor bytes exceed "
                         "max_inline_bytes %llu; use regions", (unsigned long long)inline_in,
                         (unsigned long long)lim->max_inline_bytes);
    if (q.out.kind == KP_REF_ABSENT && tok > lim->max_inline_bytes)
        return kdac_fail(err, KDAC_E_LIMIT_EXCEEDED, "the inline output of %llu bytes would "
                         "exceed max_inline_bytes %llu; name an out region",
                         (unsigned long long)tok, (unsigned long long)lim->max_inline_bytes);

    pending *p = start(c, KP_METHOD_STEP, cb, data, step_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    const size_t list_bytes = (size_t)n * (step->expect_pos ? 17 : 9);
    uint8_t *lists = malloc(list_bytes);
    p->ctx.step.lists = lists;
    p->ctx.step.pos = calloc(n, sizeof(uint64_t));
    if (!lists || !p->ctx.step.pos) {
        pending_free(c, p);
        return kdac_fail(err, KDAC_E_NO_MEMORY, "cannot allocate the lists of %u sequences", n);
    }
    memcpy(lists, step->slots, (size_t)n * 8);
    q.slots = lists;
    if (step->expect_pos) {
        memcpy(lists + (size_t)n * 8, step->expect_pos, (size_t)n * 8);
        q.expect_pos = lists + (size_t)n * 8;
    }
    memcpy(lists + list_bytes - n, step->lens, n);
    q.lens = lists + list_bytes - n;
    p->ctx.step.out = q.out.kind == KP_REF_ABSENT ? step->out.data : NULL;
    p->ctx.step.req = q;
    kp_error e;
    return finish(c, p, kp_step_params_encode(p->w, p->id, &q, &e), &e, err);
}

int kdac_step(kdac_client *c, const char *layer, const kdac_step_request *step, kdac_step_result *res,
              kdac_error *err)
{
    sync_call s;
    int rc;
    if ((rc = sync_begin(c, &s, err)) ||
        (rc = kdac_step_send(c, layer, step, sync_cb, &s, err)) ||
        (rc = sync_wait(c, &s, err)))
        return rc;
    if (res)
        *res = s.res.u.step;
    return KDAC_OK;
}

/* ---------------------------------------------------------------------- */
/* slot.alloc, slot.free, slot.reset                                      */
/* ---------------------------------------------------------------------- */

static int alloc_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res, kp_error *err)
{
    kp_slot_list r;
    int rc = kp_slot_alloc_result_decode(msg, &r, err);
    if (rc)
        return rc;
    if (r.nslots != p->ctx.alloc_count)
        return kp_fail(err, KP_E_PROTOCOL, "slots: %u handles for %u requested", r.nslots,
                       p->ctx.alloc_count);
    res->u.alloc.nslots = r.nslots;
    res->u.alloc.slots = r.slots;
    return KP_OK;
}

int kdac_slot_alloc_send(kdac_client *c, uint32_t count, unsigned flags, kdac_cb cb, void *data,
                         kdac_error *err)
{
    int rc = check_send(c, cb, err);
    if (rc)
        return rc;
    if (flags & ~KDAC_SLOT_ALLOC_EMPTY)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "flags: unknown bits 0x%x", flags);
    if (count == 0 || count > c->info.limits.max_slots_per_client)
        return kdac_fail(err, KDAC_E_INVALID_PARAMS, "count: %u is outside [1, %u] "
                         "(max_slots_per_client)", count, c->info.limits.max_slots_per_client);
    pending *p = start(c, KP_METHOD_SLOT_ALLOC, cb, data, alloc_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    p->ctx.alloc_count = count;
    kp_slot_alloc_params params = {count, !(flags & KDAC_SLOT_ALLOC_EMPTY)};
    kp_error e;
    return finish(c, p, kp_slot_alloc_params_encode(p->w, p->id, &params, &e), &e, err);
}

int kdac_slot_alloc(kdac_client *c, uint32_t count, unsigned flags, uint64_t *slots,
                    kdac_error *err)
{
    sync_call s;
    int rc = sync_begin(c, &s, err);
    if (rc)
        return rc;
    if (!slots)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "slots is NULL");
    if ((rc = kdac_slot_alloc_send(c, count, flags, sync_cb, &s, err)) ||
        (rc = sync_wait(c, &s, err)))
        return rc;
    memcpy(slots, s.res.u.alloc.slots, s.res.u.alloc.nslots * sizeof(uint64_t));
    return KDAC_OK;
}

/* slot.free and slot.reset share their params. */
static int slot_list_send(kdac_client *c, kp_method m, const uint64_t *slots, uint32_t n,
                          kdac_cb cb, void *data, kdac_error *err)
{
    int rc = check_send(c, cb, err);
    if (rc || (rc = check_slot_list(slots, n, err)))
        return rc;
    pending *p = start(c, m, cb, data, empty_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    kp_slot_list list = {slots, n};
    kp_error e;
    rc = m == KP_METHOD_SLOT_FREE ? kp_slot_free_params_encode(p->w, p->id, &list, &e)
                                  : kp_slot_reset_params_encode(p->w, p->id, &list, &e);
    return finish(c, p, rc, &e, err);
}

int kdac_slot_free_send(kdac_client *c, const uint64_t *slots, uint32_t n, kdac_cb cb,
                        void *data, kdac_error *err)
{
    return slot_list_send(c, KP_METHOD_SLOT_FREE, slots, n, cb, data, err);
}

int kdac_slot_reset_send(kdac_client *c, const uint64_t *slots, uint32_t n, kdac_cb cb,
                         void *data, kdac_error *err)
{
    return slot_list_send(c, KP_METHOD_SLOT_RESET, slots, n, cb, data, err);
}

int kdac_slot_free(kdac_client *c, const uint64_t *slots, uint32_t n, kdac_error *err)
{
    sync_call s;
    int rc;
    if ((rc = sync_begin(c, &s, err)) ||
        (rc = kdac_slot_free_send(c, slots, n, sync_cb, &s, err)))
        return rc;
    return sync_wait(c, &s, err);
}

int kdac_slot_reset(kdac_client *c, const uint64_t *slots, uint32_t n, kdac_error *err)
{
    sync_call s;
    int rc;
    if ((rc = sync_begin(c, &s, err)) ||
        (rc = kdac_slot_reset_send(c, slots, n, sync_cb, &s, err)))
        return rc;
    return sync_wait(c, &s, err);
}

/* ---------------------------------------------------------------------- */
/* slot.fork                                                              */
/* ---------------------------------------------------------------------- */

static int fork_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res, kp_error *err)
{
    kp_slot_fork_result r;
    int rc = kp_slot_fork_result_decode(msg, &r, err);
    if (rc)
        return rc;
    res->u.fork.slot = r.slot;
    res->u.fork.pos = r.pos;
    return KP_OK;
}

int kdac_slot_fork_send(kdac_client *c, uint64_t src, uint64_t dst, kdac_cb cb, void *data,
                        kdac_error *err)
{
    int rc = check_send(c, cb, err);
    if (rc)
        return rc;
    if (dst != 0 && dst == src)
        return kdac_fail(err, KDAC_E_INVALID_PARAMS, "dst: equals src");
    pending *p = start(c, KP_METHOD_SLOT_FORK, cb, data, fork_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    kp_slot_fork_params params = {src, dst != 0, dst};
    kp_error e;
    return finish(c, p, kp_slot_fork_params_encode(p->w, p->id, &params, &e), &e, err);
}

int kdac_slot_fork(kdac_client *c, uint64_t src, uint64_t dst, uint64_t *slot, uint64_t *pos,
                   kdac_error *err)
{
    sync_call s;
    int rc;
    if ((rc = sync_begin(c, &s, err)) ||
        (rc = kdac_slot_fork_send(c, src, dst, sync_cb, &s, err)) ||
        (rc = sync_wait(c, &s, err)))
        return rc;
    if (slot)
        *slot = s.res.u.fork.slot;
    if (pos)
        *pos = s.res.u.fork.pos;
    return KDAC_OK;
}

/* ---------------------------------------------------------------------- */
/* slot.read, slot.write                                                  */
/* ---------------------------------------------------------------------- */

static int read_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res, kp_error *err)
{
    kp_slot_read_result r;
    int rc = kp_slot_read_result_decode(msg, &c->session, &r, err);
    if (rc)
        return rc;
    if (r.dtype != p->ctx.read.dtype)
        return kp_fail(err, KP_E_PROTOCOL, "dtype: %s, but %s was asked for",
                       kp_dtype_name(r.dtype), kp_dtype_name(p->ctx.read.dtype));
    bool inline_wanted = p->ctx.read.dst != NULL;
    if ((r.state.kind == KP_REF_INLINE) != inline_wanted)
        return kp_fail(err, KP_E_PROTOCOL, "state: %s", inline_wanted
                       ? "missing: the request asked for it inline"
                       : "unexpected: the request named an out region");
    if (inline_wanted)
        memcpy(p->ctx.read.dst, r.state.data, r.state.nbytes);
    res->u.read.pos = r.pos;
    res->u.read.dtype = (kdac_dtype)r.dtype;
    return KP_OK;
}

int kdac_slot_read_send(kdac_client *c, uint64_t slot, kdac_dtype dtype, kdac_output out,
                        kdac_cb cb, void *data, kdac_error *err)
{
    int rc = check_send(c, cb, err);
    if (rc || (rc = check_dtype(dtype, err)))
        return rc;
    uint64_t nbytes = kp_state_bytes(c->info.heads, (kp_dtype)dtype);
    kp_slot_read_params params = {slot, true, (kp_dtype)dtype, {0}};
    if ((rc = output_ref(&out, nbytes, TOP_FIELD, "out", &params.out, err)))
        return rc;
    if (!out.region && !out.data)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "out: neither data nor a region");
    if (!out.region && nbytes > c->info.limits.max_inline_bytes)
        return kdac_fail(err, KDAC_E_LIMIT_EXCEEDED, "state: %llu bytes inline exceed "
                         "max_inline_bytes %llu; use a region", (unsigned long long)nbytes,
                         (unsigned long long)c->info.limits.max_inline_bytes);
    pending *p = start(c, KP_METHOD_SLOT_READ, cb, data, read_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    p->ctx.read.dst = out.region ? NULL : out.data;
    p->ctx.read.dtype = (kp_dtype)dtype;
    kp_error e;
    return finish(c, p, kp_slot_read_params_encode(p->w, p->id, &params, &e), &e, err);
}

int kdac_slot_read(kdac_client *c, uint64_t slot, kdac_dtype dtype, kdac_output out,
                   uint64_t *pos, kdac_error *err)
{
    sync_call s;
    int rc;
    if ((rc = sync_begin(c, &s, err)) ||
        (rc = kdac_slot_read_send(c, slot, dtype, out, sync_cb, &s, err)) ||
        (rc = sync_wait(c, &s, err)))
        return rc;
    if (pos)
        *pos = s.res.u.read.pos;
    return KDAC_OK;
}

int kdac_slot_write_send(kdac_client *c, uint64_t slot, uint64_t pos, kdac_dtype dtype,
                         kdac_tensor state, kdac_cb cb, void *data, kdac_error *err)
{
    int rc = check_send(c, cb, err);
    if (rc || (rc = check_dtype(dtype, err)))
        return rc;
    uint64_t nbytes = kp_state_bytes(c->info.heads, (kp_dtype)dtype);
    kp_slot_write_params params = {slot, pos, (kp_dtype)dtype, {0}};
    if ((rc = input_ref(&state, nbytes, TOP_FIELD, "state", &params.state, err)))
        return rc;
    if (!state.region && nbytes > c->info.limits.max_inline_bytes)
        return kdac_fail(err, KDAC_E_LIMIT_EXCEEDED, "state: %llu bytes inline exceed "
                         "max_inline_bytes %llu; use a region", (unsigned long long)nbytes,
                         (unsigned long long)c->info.limits.max_inline_bytes);
    pending *p = start(c, KP_METHOD_SLOT_WRITE, cb, data, empty_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    kp_error e;
    return finish(c, p, kp_slot_write_params_encode(p->w, p->id, &params, &e), &e, err);
}

int kdac_slot_write(kdac_client *c, uint64_t slot, uint64_t pos, kdac_dtype dtype,
                    kdac_tensor state, kdac_error *err)
{
    sync_call s;
    int rc;
    if ((rc = sync_begin(c, &s, err)) ||
        (rc = kdac_slot_write_send(c, slot, pos, dtype, state, sync_cb, &s, err)))
        return rc;
    return sync_wait(c, &s, err);
}

/* ---------------------------------------------------------------------- */
/* slot.info                                                              */
/* ---------------------------------------------------------------------- */

static int info_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res, kp_error *err)
{
    kp_slot_info_result r;
    int rc = kp_slot_info_result_decode(msg, &r, err);
    if (rc)
        return rc;
    kdac_slot_entry *v = NULL;
    if (r.nslots) {
        v = msgpack_zone_malloc(msg->unpacked.zone, r.nslots * sizeof(*v));
        if (!v)
            return kp_fail(err, KP_E_NO_MEMORY, "cannot allocate %u slot entries", r.nslots);
    }
    for (uint32_t i = 0; i < r.nslots; i++) {
        v[i].slot = r.slots[i].slot;
        v[i].pos = r.slots[i].pos;
        v[i].status = (kdac_slot_status)r.slots[i].status;
        v[i].queued = r.slots[i].queued;
    }
    res->u.info.nslots = r.nslots;
    res->u.info.slots = v;
    res->u.info.pool_free = r.pool_free;
    res->u.info.quota_left = r.quota_left;
    return KP_OK;
}

int kdac_slot_info_send(kdac_client *c, const uint64_t *slots, uint32_t n, kdac_cb cb,
                        void *data, kdac_error *err)
{
    int rc = check_send(c, cb, err);
    if (rc)
        return rc;
    if (n > 0 && !slots)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "slots is NULL");
    pending *p = start(c, KP_METHOD_SLOT_INFO, cb, data, info_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    kp_slot_info_params params = {n > 0, {slots, n}};
    kp_error e;
    return finish(c, p, kp_slot_info_params_encode(p->w, p->id, &params, &e), &e, err);
}

int kdac_slot_info(kdac_client *c, const uint64_t *slots, uint32_t n, kdac_slot_info_result *res,
                   kdac_error *err)
{
    sync_call s;
    int rc;
    if ((rc = sync_begin(c, &s, err)) ||
        (rc = kdac_slot_info_send(c, slots, n, sync_cb, &s, err)) ||
        (rc = sync_wait(c, &s, err)))
        return rc;
    if (res)
        *res = s.res.u.info;
    return KDAC_OK;
}

/* ---------------------------------------------------------------------- */
/* health, stats                                                          */
/* ---------------------------------------------------------------------- */

static int health_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res,
                         kp_error *err)
{
    kp_health_result r;
    int rc = kp_health_result_decode(msg, &r, err);
    if (rc)
        return rc;
    res->u.health.draining = r.status == KP_HEALTH_DRAINING;
    res->u.health.uptime_us = r.uptime_us;
    res->u.health.queued = r.queued;
    res->u.health.running = r.running;
    return KP_OK;
}

int kdac_health_send(kdac_client *c, kdac_cb cb, void *data, kdac_error *err)
{
    int rc = check_send(c, cb, err);
    if (rc)
        return rc;
    pending *p = start(c, KP_METHOD_HEALTH, cb, data, health_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    kp_error e;
    return finish(c, p, kp_health_params_encode(p->w, p->id, &e), &e, err);
}

int kdac_health(kdac_client *c, kdac_health_info *res, kdac_error *err)
{
    sync_call s;
    int rc;
    if ((rc = sync_begin(c, &s, err)) || (rc = kdac_health_send(c, sync_cb, &s, err)) ||
        (rc = sync_wait(c, &s, err)))
        return rc;
    if (res)
        *res = s.res.u.health;
    return KDAC_OK;
}

static uint32_t copy_counters(kdac_counter *dst, const kp_counter *src, uint32_t n)
{
    if (n > KDAC_STATS_MAX_COUNTERS)
        n = KDAC_STATS_MAX_COUNTERS;
    for (uint32_t i = 0; i < n; i++) {
        snprintf(dst[i].name, sizeof(dst[i].name), "%s", src[i].name);
        dst[i].value = src[i].value;
    }
    return n;
}

static kdac_held held_from_wire(const kp_held *h)
{
    return (kdac_held){h->inflight_bytes, h->partial_bytes, h->output_bytes, h->region_bytes};
}

/* The usage part of a stats answer into the caller's first size bytes of *out. */
static void copy_usage(const kdac_client *c, const kp_stats_result *r, kdac_usage_info *out,
                       size_t size)
{
    kdac_usage_info u;
    memset(&u, 0, sizeof(u));
    u.has_uid = r->has_uid;
    u.uid = r->uid;
    u.layers = r->uid_layers;
    u.slots = r->uid_slots;
    u.has_uid_held = r->has_uid_held;
    u.connections = r->uid_connections;
    u.held = held_from_wire(&r->uid_held);
    u.has_clients = r->has_clients;
    u.total = held_from_wire(&r->held);
    u.peak = held_from_wire(&r->held_peak);
    u.stalled = r->stalled;
    u.refused = r->refused;
    kdac_bounds_from_wire(&u.bounds, &r->bounds);
    u.bounds.max_layers_per_uid = c->info.bounds.max_layers_per_uid;
    u.bounds.max_slots_per_uid = c->info.bounds.max_slots_per_uid;
    u.has_memory = r->has_memory;
    u.memory = kdac_memory_from_wire(&r->memory);
    memcpy(out, &u, size < sizeof(u) ? size : sizeof(u));
}

static void copy_stats(const kp_stats_result *r, kdac_stats_info *s)
{
    memset(s, 0, sizeof(*s));
    s->uptime_us = r->uptime_us;
    s->connections = r->connections;
    s->connections_total = r->connections_total;
    s->requests = r->requests;
    s->batches = r->batches;
    s->batches_held = r->batches_held;
    s->batches_gathered = r->batches_gathered;
    s->seqs = r->seqs;
    s->tokens = r->tokens;
    s->latency_count = r->latency_count;
    s->latency_p50_us = r->latency_p50_us;
    s->latency_p90_us = r->latency_p90_us;
    s->latency_p99_us = r->latency_p99_us;
    s->latency_max_us = r->latency_max_us;
    s->latency_nbounds = r->latency_nbounds; /* <= KP_HIST_MAX_BUCKETS (checked on decode) */
    memcpy(s->latency_bounds_us, r->latency_bounds_us, r->latency_nbounds * sizeof(uint64_t));
    memcpy(s->latency_counts, r->latency_counts, (r->latency_nbounds + 1) * sizeof(uint64_t));
    s->slots_total = r->slots_total;
    s->slots_used = r->slots_used;
    s->slots_lost = r->slots_lost;
    s->layers = r->layers;
    s->regions = r->regions;
    s->rings = r->rings;
    s->ring_doorbells = r->ring_doorbells;
    s->nerrors = copy_counters(s->errors, r->errors, r->nerrors);
    s->ndisconnects = copy_counters(s->disconnects, r->disconnects, r->ndisconnects);
    memcpy(s->bytes_in, r->bytes_in, sizeof(s->bytes_in));
    memcpy(s->bytes_out, r->bytes_out, sizeof(s->bytes_out));
    s->batch_count = r->batch_count;
    s->batch_window = r->batch_window;
    s->nphases = r->nphases < KDAC_STATS_MAX_PHASES ? r->nphases : KDAC_STATS_MAX_PHASES;
    for (uint32_t i = 0; i < s->nphases; i++) {
        const kp_phase *ph = &r->phases[i];
        snprintf(s->phases[i].name, sizeof(s->phases[i].name), "%s", ph->name);
        s->phases[i].p50_us = ph->p50_us;
        s->phases[i].p90_us = ph->p90_us;
        s->phases[i].p99_us = ph->p99_us;
        s->phases[i].sum_us = ph->sum_us;
    }
}

static int stats_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res, kp_error *err)
{
    kp_stats_result r;
    int rc = kp_stats_result_decode(msg, &r, err);
    if (rc)
        return rc;
    if (p->ctx.stats.info)
        copy_stats(&r, p->ctx.stats.info);
    if (p->ctx.stats.usage)
        copy_usage(c, &r, p->ctx.stats.usage, p->ctx.stats.usage_size);
    return KP_OK;
}

int kdac_stats(kdac_client *c, kdac_stats_info *res, kdac_error *err)
{
    if (c && !res)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "res is NULL");
    return kdac_stats_usage(c, res, NULL, 0, err);
}

int kdac_stats_usage(kdac_client *c, kdac_stats_info *res, kdac_usage_info *usage,
                     size_t usage_size, kdac_error *err)
{
    sync_call s;
    int rc = sync_begin(c, &s, err);
    if (rc)
        return rc;
    if (!res && !usage)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "res and usage are NULL");
    pending *p = start(c, KP_METHOD_STATS, sync_cb, &s, stats_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    p->ctx.stats.info = res;
    p->ctx.stats.usage = usage;
    p->ctx.stats.usage_size = usage_size;
    kp_error e;
    if ((rc = finish(c, p, kp_stats_params_encode(p->w, p->id, &e), &e, err)))
        return rc;
    return sync_wait(c, &s, err);
}

static int prometheus_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res,
                             kp_error *err)
{
    kp_stats_result r;
    int rc = kp_stats_result_decode(msg, &r, err);
    if (rc)
        return rc;
    if (!r.prometheus)
        return kp_fail(err, KP_E_PROTOCOL, "prometheus: the daemon announced %s but sent no "
                       "text", KP_FEATURE_STATS_PROMETHEUS);
    if (!(*p->ctx.prometheus = strdup(r.prometheus)))
        return kp_fail(err, KP_E_NO_MEMORY, "no memory for the Prometheus text");
    return KP_OK;
}

int kdac_stats_prometheus(kdac_client *c, char **text, kdac_error *err)
{
    sync_call s;
    int rc = sync_begin(c, &s, err);
    if (rc)
        return rc;
    if (!text)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "text is NULL");
    *text = NULL;
    bool announced = false;
    for (uint32_t i = 0; i < c->info.nfeatures && !announced; i++)
        announced = strcmp(c->info.features[i], KP_FEATURE_STATS_PROMETHEUS) == 0;
    if (!announced)
        return kdac_fail(err, KDAC_E_NOT_SUPPORTED, "this daemon does not announce %s: it "
                         "cannot render its stats in the Prometheus format",
                         KP_FEATURE_STATS_PROMETHEUS);
    pending *p = start(c, KP_METHOD_STATS, sync_cb, &s, prometheus_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    p->ctx.prometheus = text;
    kp_error e;
    if ((rc = finish(c, p, kp_stats_params_encode2(p->w, p->id, KP_STATS_PROMETHEUS, &e), &e,
                     err)))
        return rc;
    return sync_wait(c, &s, err);
}

/* ---------------------------------------------------------------------- */
/* layer.register, layer.list, layer.drop                                 */
/* ---------------------------------------------------------------------- */

static int layer_register_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res,
                                 kp_error *err)
{
    kp_layer_register_result r;
    int rc = kp_layer_register_result_decode(msg, &r, err);
    if (rc == KP_OK && p->ctx.created)
        *p->ctx.created = r.created;
    return rc;
}

int kdac_layer_register(kdac_client *c, const kdac_layer *layer, bool *created, kdac_error *err)
{
    sync_call s;
    int rc = sync_begin(c, &s, err);
    if (rc)
        return rc;
    if (!layer || !layer->name || !layer->A_log || !layer->dt_bias)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "layer, its name or its weights are NULL");
    pending *p = start(c, KP_METHOD_LAYER_REGISTER, sync_cb, &s, layer_register_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    p->ctx.created = created;
    uint32_t heads = c->info.heads;
    kp_layer_register_params params = {
        layer->name, kp_ref_inline(layer->A_log, (uint64_t)heads * 4),
        kp_ref_inline(layer->dt_bias, (uint64_t)heads * KDAC_HEAD_DIM * 4), layer->lower_bound,
        layer->scale};
    kp_error e;
    if ((rc = finish(c, p, kp_layer_register_params_encode(p->w, p->id, &params, &e), &e, err)))
        return rc;
    return sync_wait(c, &s, err);
}

static int layer_list_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res,
                             kp_error *err)
{
    kp_layer_list_result r;
    int rc = kp_layer_list_result_decode(msg, &r, err);
    if (rc)
        return rc;
    uint32_t n = r.nlayers < p->ctx.layers.cap ? r.nlayers : p->ctx.layers.cap;
    for (uint32_t i = 0; i < n; i++) {
        kdac_layer_info *l = &p->ctx.layers.layers[i];
        snprintf(l->name, sizeof(l->name), "%s", r.layers[i].name);
        l->lower_bound = r.layers[i].lower_bound;
        l->scale = r.layers[i].scale;
        l->from_config = r.layers[i].source == KP_LAYER_SOURCE_CONFIG;
    }
    *p->ctx.layers.n = r.nlayers;
    return KP_OK;
}

int kdac_layer_list(kdac_client *c, kdac_layer_info *layers, uint32_t cap, uint32_t *n,
                    kdac_error *err)
{
    sync_call s;
    int rc = sync_begin(c, &s, err);
    if (rc)
        return rc;
    if (!n || (cap > 0 && !layers))
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "n is NULL, or layers is NULL with cap %u",
                         cap);
    pending *p = start(c, KP_METHOD_LAYER_LIST, sync_cb, &s, layer_list_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    p->ctx.layers.layers = layers;
    p->ctx.layers.cap = cap;
    p->ctx.layers.n = n;
    kp_error e;
    if ((rc = finish(c, p, kp_layer_list_params_encode(p->w, p->id, &e), &e, err)))
        return rc;
    return sync_wait(c, &s, err);
}

int kdac_layer_drop(kdac_client *c, const char *name, kdac_error *err)
{
    sync_call s;
    int rc = sync_begin(c, &s, err);
    if (rc)
        return rc;
    if (!name)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "name is NULL");
    pending *p = start(c, KP_METHOD_LAYER_DROP, sync_cb, &s, empty_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    kp_layer_drop_params params = {name};
    kp_error e;
    if ((rc = finish(c, p, kp_layer_drop_params_encode(p->w, p->id, &params, &e), &e, err)))
        return rc;
    return sync_wait(c, &s, err);
}

/* ---------------------------------------------------------------------- */
/* region.register_shm, region.register_cuda, region.release              */
/* ---------------------------------------------------------------------- */

static int region_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res,
                         kp_error *err)
{
    kp_region_register_result r;
    int rc = kp_region_register_result_decode(msg, &r, err);
    if (rc == KP_OK)
        *p->ctx.region = r.region;
    return rc;
}

/* The three registrations differ only in their params and descriptor. */
static int region_register(kdac_client *c, kp_method m, int fd,
                           const kp_region_register_cuda_params *cuda, uint64_t size,
                           uint32_t *region, kdac_error *err)
{
    sync_call s;
    int rc = sync_begin(c, &s, err);
    if (rc)
        return rc;
    if (!region)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "region is NULL");
    if (size == 0)
        return kdac_fail(err, KDAC_E_INVALID_PARAMS, "size: must be at least 1 byte");
    pending *p = start(c, m, sync_cb, &s, region_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    p->ctx.region = region;
    p->fd = fd;
    kp_error e;
    if (m == KP_METHOD_REGION_REGISTER_SHM) {
        kp_region_register_shm_params params = {size};
        rc = kp_region_register_shm_params_encode(p->w, p->id, &params, &e);
    } else {
        rc = kp_region_register_cuda_params_encode(p->w, p->id, cuda, &e);
    }
    if ((rc = finish(c, p, rc, &e, err)))
        return rc;
    return sync_wait(c, &s, err);
}

int kdac_region_register_shm(kdac_client *c, int fd, uint64_t size, uint32_t *region,
                             kdac_error *err)
{
    if (fd < 0)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "fd: %d is not a descriptor", fd);
    return region_register(c, KP_METHOD_REGION_REGISTER_SHM, fd, NULL, size, region, err);
}

/* The GPU a CUDA region names: the caller's, or the daemon's own. */
static int cuda_device(const kdac_client *c, const char *device, const char **out,
                       kdac_error *err)
{
    if (device) {
        *out = device;
        return KDAC_OK;
    }
    if (!c->info.has_gpu)
        return kdac_fail(err, KDAC_E_NOT_SUPPORTED, "the daemon reports no GPU (backend %s): "
                         "CUDA regions need its cuda backend", c->info.backend);
    *out = c->info.gpu_uuid;
    return KDAC_OK;
}

int kdac_region_register_cuda(kdac_client *c, const void *ipc_handle, uint64_t size,
                              const char *device, uint32_t *region, kdac_error *err)
{
    kp_region_register_cuda_params params = {size, NULL, KP_CUDA_HANDLE_IPC, ipc_handle};
    int rc = client_check_usable(c, true, err);
    if (rc || (rc = cuda_device(c, device, &params.device, err)))
        return rc;
    if (!ipc_handle)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "ipc_handle is NULL");
    return region_register(c, KP_METHOD_REGION_REGISTER_CUDA, -1, &params, size, region, err);
}

int kdac_region_register_cuda_fd(kdac_client *c, int fd, uint64_t size, const char *device,
                                 uint32_t *region, kdac_error *err)
{
    kp_region_register_cuda_params params = {size, NULL, KP_CUDA_HANDLE_POSIX_FD, NULL};
    int rc = client_check_usable(c, true, err);
    if (rc || (rc = cuda_device(c, device, &params.device, err)))
        return rc;
    if (fd < 0)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "fd: %d is not a descriptor", fd);
    return region_register(c, KP_METHOD_REGION_REGISTER_CUDA, fd, &params, size, region, err);
}

int kdac_region_release(kdac_client *c, uint32_t region, kdac_error *err)
{
    sync_call s;
    int rc = sync_begin(c, &s, err);
    if (rc)
        return rc;
    if (region == 0)
        return kdac_fail(err, KDAC_E_INVALID_PARAMS, "region: 0 is never a region id");
    pending *p = start(c, KP_METHOD_REGION_RELEASE, sync_cb, &s, empty_decode, err);
    if (!p)
        return err ? err->code : KDAC_E_NO_MEMORY;
    kp_region_release_params params = {region};
    kp_error e;
    if ((rc = finish(c, p, kp_region_release_params_encode(p->w, p->id, &params, &e), &e, err)))
        return rc;
    return sync_wait(c, &s, err);
}

/* ---------------------------------------------------------------------- */
/* ring.attach                                                            */
/* ---------------------------------------------------------------------- */

static int ring_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res, kp_error *err)
{
    int rc = kp_empty_result_decode(msg, err);
    if (rc == KP_OK)
        client_ring_start(c); /* before the reader looks at the next socket byte */
    return rc;
}

/* The frame ring (PROTOCOL.md §Frame ring): a memfd registered as a region
 * and named by ring.attach; io.c moves the bytes once the answer is in. */
int kdac_ring_attach(kdac_client *c, uint64_t bytes_per_direction, kdac_error *err)
{
    sync_call s;
    int rc = sync_begin(c, &s, err);
    if (rc)
        return rc;
    if (c->ring_shm.base)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "this connection has a frame ring already");
    if (c->inflight > 0)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "%u requests are in flight; attach the "
                         "ring before sending any", c->inflight);
    uint64_t size = bytes_per_direction ? bytes_per_direction : KP_RING_DEFAULT_SIZE;
    kp_error e;
    if (kp_ring_check_size(size, UINT64_MAX, &e) != KP_OK)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "bytes_per_direction: %s", e.message);

    kdac_shm shm;
    uint32_t region;
    if ((rc = kdac_shm_create(&shm, KP_RING_HEADER_BYTES + 2 * size, "kdac-ring", err)))
        return rc;
    if ((rc = kdac_region_register_shm(c, shm.fd, shm.size, &region, err))) {
        kdac_shm_close(&shm);
        return rc;
    }
    c->ring_shm = shm;
    kp_ring_init(&c->ring, shm.base, size, false, KP_RING_WANT_DATA);
    pending *p = start(c, KP_METHOD_RING_ATTACH, sync_cb, &s, ring_decode, err);
    kp_ring_attach_params params = {region, size};
    if (!p)
        rc = err ? err->code : KDAC_E_NO_MEMORY;
    else if (!(rc = finish(c, p, kp_ring_attach_params_encode(p->w, p->id, &params, &e), &e,
                           err)) &&
             (rc = sync_wait(c, &s, err)) == KDAC_OK)
        return KDAC_OK;
    if (rc == KDAC_E_UNKNOWN_METHOD)
        rc = kdac_fail(err, KDAC_E_NOT_SUPPORTED, "this daemon has no frame ring (ring.attach "
                       "is newer than it)");
    if (!c->failed)
        kdac_region_release(c, region, NULL);
    kdac_shm_close(&c->ring_shm);
    return rc;
}
