/*
 * prefill.c - the prefill method: its encoders and decoders, and the region
 * bounds walk the daemon runs once it knows its regions' sizes.
 *
 * The decoder does every check the frame and the session allow before the
 * daemon touches anything (PROTOCOL.md §prefill, "Checked on arrival"), so a
 * request the daemon queues is well-formed as a whole: the all-or-nothing
 * rule starts here.  Sizes are computed overflow-safe (kp_token_tensor_bytes
 * saturates; sums use __builtin_add_overflow).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"

static const char *const prefill_fields[] = {"layer", "seqs", "ready", "done", NULL};
static const char *const sem_fields[] = {"region", "offset", "value", NULL};
static const char *const seq_fields[] = {"slot", "expect_pos", "len", "fresh", "q", "k", "v",
                                         "g", "beta", "out", NULL};
static const char *const seq_result_fields[] = {"pos", "out", NULL};
static const char *const result_fields[] = {"seqs", "queue_us", "run_us", "device_us",
                                            "kernel_us", NULL};

uint64_t prefill_tensor_bytes(kp_prefill_tensor t, uint32_t len, uint32_t heads)
{
    return t == KP_TENSOR_BETA ? kp_beta_bytes(len, heads) : kp_token_tensor_bytes(len, heads);
}

/* "len 12 x 96 heads x 128 x 2 bytes bf16": how size errors explain a tensor
 * (its arguments are len and heads). */
#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)
#define TOKEN_TENSOR_SHAPE "len %u x %u heads x " STRINGIFY(KP_HEAD_DIM) " x 2 bytes bf16"
#define BETA_SHAPE "len %u x %u heads x 2 bytes bf16"

/* ---------------------------------------------------------------------- */
/* Params                                                                 */
/* ---------------------------------------------------------------------- */

/* Tensor t's key: kp_prefill_tensor_name's, spelt out so that each is a literal of known
 * length (enc_str of the name instead measured 2.3k more instructions per 6-sequence
 * request: a strlen and a memcpy call per key). */
static void enc_tensor_key(kp_writer *w, int t)
{
    switch (t) {
    case KP_TENSOR_Q: enc_key(w, "q"); break;
    case KP_TENSOR_K: enc_key(w, "k"); break;
    case KP_TENSOR_V: enc_key(w, "v"); break;
    case KP_TENSOR_G: enc_key(w, "g"); break;
    case KP_TENSOR_BETA: enc_key(w, "beta"); break;
    default: enc_key(w, "out"); break;
    }
}

int kp_prefill_params_encode(kp_writer *w, uint32_t id, const kp_prefill_params *p,
                             kp_error *err)
{
    int rc = enc_need_str(p->layer, "layer", err);
    if (rc)
        return rc;
    if (p->nseqs == 0)
        return kp_fail(err, KP_E_INVALID_PARAMS, "seqs: at least one sequence is needed");
    for (uint32_t i = 0; i < p->nseqs; i++) {
        const kp_prefill_seq *q = &p->seqs[i];
        for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
            bool absent = q->tensors[t].kind == KP_REF_ABSENT;
            if (q->len == 0 && !absent)
                return kp_fail(err, KP_E_INVALID_PARAMS, "seqs[%u].%s: must be absent when "
                               "len is 0", i, kp_prefill_tensor_name(t));
            if (q->len > 0 && absent && t != KP_TENSOR_OUT)
                return kp_fail(err, KP_E_INVALID_PARAMS, "seqs[%u].%s: required", i,
                               kp_prefill_tensor_name(t));
        }
        if (q->out.kind == KP_REF_INLINE)
            return kp_fail(err, KP_E_INVALID_PARAMS, "seqs[%u].out: must be a region reference",
                           i);
    }

    const kp_sem *sems[2] = {&p->ready, &p->done};
    for (int i = 0; i < 2; i++) {
        const kp_sem *m = sems[i];
        if (m->present && (m->region == 0 || m->offset % KP_SEM_ALIGN || m->value == 0 ||
                           m->value > KP_SEM_VALUE_MAX))
            return kp_fail(err, KP_E_INVALID_PARAMS, "%s: needs a region >= 1, an offset that "
                           "is a multiple of %u and a value in [1, 2^62 - 1]",
                           i ? "done" : "ready", KP_SEM_ALIGN);
    }

    enc_request(w, id, KP_METHOD_PREFILL, 2 + p->ready.present + p->done.present);
    enc_kv_str(w, "layer", p->layer);
    for (int i = 0; i < 2; i++) {
        if (!sems[i]->present)
            continue;
        if (i)
            enc_key(w, "done");
        else
            enc_key(w, "ready");
        enc_map(w, 3);
        enc_kv_u64(w, "region", sems[i]->region);
        enc_kv_u64(w, "offset", sems[i]->offset);
        enc_kv_u64(w, "value", sems[i]->value);
    }
    enc_key(w, "seqs");
    enc_array(w, p->nseqs);
    for (uint32_t i = 0; i < p->nseqs; i++) {
        const kp_prefill_seq *q = &p->seqs[i];
        uint32_t ntensors = 0;
        for (int t = 0; t < KP_PREFILL_TENSORS; t++)
            ntensors += q->tensors[t].kind != KP_REF_ABSENT;
        enc_map(w, 2 + q->has_expect_pos + q->fresh + ntensors);
        enc_kv_u64(w, "slot", q->slot);
        if (q->has_expect_pos)
            enc_kv_u64(w, "expect_pos", q->expect_pos);
        enc_kv_u64(w, "len", q->len);
        if (q->fresh)
            enc_kv_bool(w, "fresh", true);
        for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
            if (q->tensors[t].kind != KP_REF_ABSENT) {
                enc_tensor_key(w, t);
                enc_ref(w, &q->tensors[t]);
            }
        }
    }
    return enc_finish(w, err);
}

static int decode_seq(kp_msg *msg, const kp_session *s, const msgpack_object *obj, uint32_t i,
                      kp_prefill_seq *q, prefill_totals *sum, kp_error *err)
{
    char path[DEC_PATH_MAX];
    dec_fields f;
    bool present;
    uint32_t heads = s->geometry.heads;
    kp_field_name(path, sizeof(path), "seqs", i, NULL);
    memset(q, 0, sizeof(*q));
    int rc = dec_open(&f, msg, obj, path, seq_fields, DEC_STRICT, KP_E_INVALID_PARAMS, err);
    if (rc || (rc = dec_u64(&f, "slot", 0, UINT64_MAX, &q->slot, NULL, err)) ||
        (rc = dec_u64(&f, "expect_pos", 0, UINT64_MAX, &q->expect_pos, &q->has_expect_pos,
                      err)) ||
        (rc = dec_u32(&f, "len", 0, s->limits.max_batch_tokens, &q->len, NULL, err)) ||
        (rc = dec_bool(&f, "fresh", &q->fresh, &present, err)))
        return rc;
    if (q->fresh && q->has_expect_pos)
        return kp_fail(err, KP_E_INVALID_PARAMS, "%s.expect_pos: not allowed with fresh (a "
                       "fresh sequence starts at position 0 whatever the slot held)", path);

    for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
        const char *name = kp_prefill_tensor_name(t);
        if (q->len == 0) {
            const msgpack_object *o = dec_get(&f, name);
            if (o && o->type != MSGPACK_OBJECT_NIL)
                return kp_fail(err, KP_E_INVALID_PARAMS, "%s.%s: must be absent when len is 0",
                               path, name);
            continue;
        }
        uint64_t nbytes = prefill_tensor_bytes(t, q->len, heads);
        bool is_out = t == KP_TENSOR_OUT;
        if ((rc = dec_ref(&f, name, nbytes, !is_out, true, &q->tensors[t],
                          is_out ? &present : NULL, err,
                          t == KP_TENSOR_BETA ? BETA_SHAPE : TOKEN_TENSOR_SHAPE, q->len, heads)))
            return rc;
        if (q->tensors[t].kind == KP_REF_INLINE)
            sum->inline_in += nbytes; /* <= the frame size: cannot overflow */
    }
    prefill_count_seq(sum, q, heads);
    return KP_OK;
}

void prefill_count_seq(prefill_totals *sum, const kp_prefill_seq *q, uint32_t heads)
{
    if (q->len > 0 && q->out.kind == KP_REF_ABSENT &&
        __builtin_add_overflow(sum->inline_out, kp_token_tensor_bytes(q->len, heads),
                               &sum->inline_out))
        sum->inline_out = UINT64_MAX;
    sum->tokens += q->len; /* <= nseqs * 2^32: cannot overflow */
}

typedef struct slot_at {
    uint64_t slot;
    uint32_t seq;
} slot_at;

static int slot_at_cmp(const void *a, const void *b)
{
    const slot_at *x = a, *y = b;
    if (x->slot != y->slot)
        return x->slot < y->slot ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/*
 * qsort for the few, mostly ordered, entries of one request (tensors come in
 * sequence order, usually at rising offsets): insertion sort is linear on
 * those, where glibc's qsort allocates and sorts by merging.
 */
static void sort_small(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *))
{
    enum { SMALL = 64, MAX_ENTRY = 64 };
    if (n > SMALL || size > MAX_ENTRY) {
        qsort(base, n, size, cmp);
        return;
    }
    uint8_t *v = base, tmp[MAX_ENTRY];
    for (size_t i = 1; i < n; i++) {
        size_t j = i;
        if (cmp(v + (j - 1) * size, v + i * size) <= 0)
            continue;
        memcpy(tmp, v + i * size, size);
        while (j > 0 && cmp(v + (j - 1) * size, tmp) > 0) {
            memcpy(v + j * size, v + (j - 1) * size, size);
            j--;
        }
        memcpy(v + j * size, tmp, size);
    }
}

/* The kernel updates each slot in place, once per launch: a slot named twice
 * in one request would race with itself. */
static int check_distinct_slots(kp_msg *msg, const kp_prefill_params *p, kp_error *err)
{
    slot_at *v = dec_alloc(msg, p->nseqs, sizeof(*v), err);
    if (!v)
        return err ? err->code : KP_E_NO_MEMORY;
    for (uint32_t i = 0; i < p->nseqs; i++)
        v[i] = (slot_at){p->seqs[i].slot, i};
    sort_small(v, p->nseqs, sizeof(*v), slot_at_cmp);
    for (uint32_t i = 1; i < p->nseqs; i++) {
        if (v[i].slot == v[i - 1].slot)
            return kp_fail(err, KP_E_INVALID_PARAMS, "seqs[%u].slot: slot 0x%llx is also named "
                           "by seqs[%u]; a slot appears once per request", v[i].seq,
                           (unsigned long long)v[i].slot, v[i - 1].seq);
    }
    return KP_OK;
}

/* A byte range of a region that one tensor of the request uses. */
typedef struct range {
    uint32_t region;
    uint64_t start, end;
    uint32_t seq;
    kp_prefill_tensor tensor;
} range;

static int range_cmp(const void *a, const void *b)
{
    const range *x = a, *y = b;
    if (x->region != y->region)
        return x->region < y->region ? -1 : 1;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    return 0;
}

static int overlap_error(const range *a, const range *b, kp_error *err)
{
    return kp_fail(err, KP_E_INVALID_PARAMS, "seqs[%u].%s overlaps seqs[%u].%s in region %u: "
                   "an output may not share bytes with any other tensor of the request", a->seq,
                   kp_prefill_tensor_name(a->tensor), b->seq, kp_prefill_tensor_name(b->tensor),
                   a->region);
}

/*
 * Outputs must not overlap anything else of the request (inputs may share
 * bytes with each other: q == k is legal).  The outputs, sorted by (region,
 * start), must not overlap each other; then, their ends rising with their
 * starts, an input overlaps some output iff it overlaps the last output of
 * its region that starts before the input ends (a binary search).  Requests
 * have few outputs: this sorts those alone.
 */
static int check_out_overlaps(kp_msg *msg, const kp_prefill_params *p, kp_error *err)
{
    uint32_t nout = 0;
    for (uint32_t i = 0; i < p->nseqs; i++)
        nout += p->seqs[i].tensors[KP_TENSOR_OUT].kind == KP_REF_REGION;
    if (nout == 0)
        return KP_OK;
    range *outs = dec_alloc(msg, nout, sizeof(*outs), err);
    if (!outs)
        return err ? err->code : KP_E_NO_MEMORY;
    nout = 0;
    for (uint32_t i = 0; i < p->nseqs; i++) {
        const kp_ref *r = &p->seqs[i].tensors[KP_TENSOR_OUT];
        if (r->kind == KP_REF_REGION) /* offset + nbytes was overflow-checked on decode */
            outs[nout++] = (range){r->region, r->offset, r->offset + r->nbytes, i, KP_TENSOR_OUT};
    }
    sort_small(outs, nout, sizeof(*outs), range_cmp);
    for (uint32_t i = 1; i < nout; i++) {
        if (outs[i].region == outs[i - 1].region && outs[i].start < outs[i - 1].end)
            return overlap_error(&outs[i], &outs[i - 1], err);
    }
    for (uint32_t i = 0; i < p->nseqs; i++) {
        for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
            const kp_ref *r = &p->seqs[i].tensors[t];
            if (t == KP_TENSOR_OUT || r->kind != KP_REF_REGION)
                continue;
            range in = {r->region, r->offset, r->offset + r->nbytes, i, t};
            uint32_t lo = 0, hi = nout; /* first output at or after (region, in.end) */
            while (lo < hi) {
                uint32_t mid = lo + (hi - lo) / 2;
                const range *o = &outs[mid];
                if (o->region < in.region || (o->region == in.region && o->start < in.end))
                    lo = mid + 1;
                else
                    hi = mid;
            }
            const range *o = lo > 0 ? &outs[lo - 1] : NULL;
            if (o && o->region == in.region && o->end > in.start)
                return overlap_error(o, &in, err);
        }
    }
    return KP_OK;
}

/* A semaphore field: {"region" >= 1, "offset" a multiple of 8, "value" in [1, 2^62 - 1]}. */
static int decode_sem(kp_msg *msg, const dec_fields *pf, const char *name, kp_sem *m,
                      kp_error *err)
{
    const msgpack_object *o;
    dec_fields f;
    int rc = dec_map(pf, name, &o, &m->present, err);
    if (rc || !m->present)
        return rc;
    if ((rc = dec_open(&f, msg, o, name, sem_fields, DEC_STRICT, KP_E_INVALID_PARAMS, err)) ||
        (rc = dec_u32(&f, "region", 1, UINT32_MAX, &m->region, NULL, err)) ||
        (rc = dec_u64(&f, "offset", 0, UINT64_MAX - 7, &m->offset, NULL, err)) ||
        (rc = dec_u64(&f, "value", 1, KP_SEM_VALUE_MAX, &m->value, NULL, err)))
        return rc;
    if (m->offset % KP_SEM_ALIGN)
        return kp_fail(err, KP_E_INVALID_PARAMS, "%s.offset: %llu is not a multiple of %u",
                       name, (unsigned long long)m->offset, KP_SEM_ALIGN);
    return KP_OK;
}

int kp_prefill_params_decode(kp_msg *msg, const kp_session *s, kp_prefill_params *p,
                             kp_error *err)
{
    dec_fields f;
    const msgpack_object *arr;
    uint32_t n;
    const kp_limits *lim = &s->limits;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, prefill_fields, err);
    if (rc || (rc = dec_str(&f, "layer", 1, KP_NAME_MAX, &p->layer, NULL, err)) ||
        (rc = dec_array(&f, "seqs", lim->max_seqs_per_request, false, &arr, &n, NULL, err)) ||
        (rc = decode_sem(msg, &f, "ready", &p->ready, err)) ||
        (rc = decode_sem(msg, &f, "done", &p->done, err)))
        return rc;
    kp_prefill_seq *seqs = dec_alloc(msg, n, sizeof(*seqs), err);
    if (!seqs)
        return err ? err->code : KP_E_NO_MEMORY;
    prefill_totals sum = {0, 0, 0};
    for (uint32_t i = 0; i < n; i++) {
        if ((rc = decode_seq(msg, s, &arr[i], i, &seqs[i], &sum, err)))
            return rc;
    }
    p->seqs = seqs;
    p->nseqs = n;
    return prefill_check_whole(msg, lim, p, &sum, err);
}

int prefill_check_whole(kp_msg *msg, const kp_limits *lim, const kp_prefill_params *p,
                        const prefill_totals *sum, kp_error *err)
{
    int rc;
    if (sum->tokens > lim->max_batch_tokens)
        return kp_fail(err, KP_E_LIMIT_EXCEEDED, "seqs: %llu tokens in total exceed "
                       "max_batch_tokens %u (a request runs in one launch)",
                       (unsigned long long)sum->tokens, lim->max_batch_tokens);
    if (sum->inline_in > lim->max_inline_bytes)
        return kp_fail(err, KP_E_LIMIT_EXCEEDED, "seqs: %llu inline tensor bytes exceed "
                       "max_inline_bytes %llu; use regions", (unsigned long long)sum->inline_in,
                       (unsigned long long)lim->max_inline_bytes);
    if (sum->inline_out > lim->max_inline_bytes)
        return kp_fail(err, KP_E_LIMIT_EXCEEDED, "seqs: the inline output of %llu bytes would "
                       "exceed max_inline_bytes %llu; name out regions",
                       (unsigned long long)sum->inline_out,
                       (unsigned long long)lim->max_inline_bytes);
    if ((rc = check_distinct_slots(msg, p, err)))
        return rc;
    return check_out_overlaps(msg, p, err);
}

int kp_prefill_check_regions(const kp_prefill_params *p, kp_region_size_fn region_size,
                             void *ctx, kp_error *err)
{
    for (uint32_t i = 0; i < p->nseqs; i++) {
        for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
            const kp_ref *r = &p->seqs[i].tensors[t];
            if (r->kind != KP_REF_REGION)
                continue;
            uint64_t size;
            bool known = region_size(ctx, r->region, &size) == KP_OK;
            if (known && kp_ref_check_bounds(r, size, NULL, NULL) == KP_OK)
                continue; /* the field's name is only formatted for an error */
            char field[DEC_PATH_MAX];
            kp_field_name(field, sizeof(field), "seqs", i, kp_prefill_tensor_name(t));
            if (!known)
                return kp_fail(err, KP_E_REGION_INVALID, "%s: region %u is not registered on "
                               "this connection", field, r->region);
            int rc = kp_ref_check_bounds(r, size, field, err);
            if (rc)
                return rc;
        }
    }
    return KP_OK;
}

/* ---------------------------------------------------------------------- */
/* Result                                                                 */
/* ---------------------------------------------------------------------- */

int kp_prefill_result_encode(kp_writer *w, uint32_t id, const kp_prefill_result *r,
                             kp_error *err)
{
    for (uint32_t i = 0; i < r->nseqs; i++) {
        if (r->seqs[i].out.kind == KP_REF_REGION)
            return kp_fail(err, KP_E_INVALID_PARAMS, "seqs[%u].out: a result carries output "
                           "inline or not at all", i);
    }
    enc_result(w, id, r->timed ? 5 : 3);
    enc_key(w, "seqs");
    enc_array(w, r->nseqs);
    for (uint32_t i = 0; i < r->nseqs; i++) {
        const kp_prefill_seq_result *q = &r->seqs[i];
        bool has_out = q->out.kind == KP_REF_INLINE;
        enc_map(w, 1 + has_out);
        enc_kv_u64(w, "pos", q->pos);
        if (has_out)
            enc_kv_ref(w, "out", &q->out);
    }
    enc_timings(w, r->queue_us, r->run_us, r->timed, r->device_us, r->kernel_us);
    return enc_finish(w, err);
}

int kp_prefill_result_decode(kp_msg *msg, const kp_session *s, const kp_prefill_params *req,
                             kp_prefill_result *r, kp_error *err)
{
    dec_fields f;
    const msgpack_object *arr;
    uint32_t n;
    memset(r, 0, sizeof(*r));
    int rc = dec_result(&f, msg, result_fields, err);
    if (rc || (rc = dec_array(&f, "seqs", req->nseqs, false, &arr, &n, NULL, err)) ||
        (rc = dec_timings(&f, &r->queue_us, &r->run_us, &r->timed, &r->device_us, &r->kernel_us,
                          err)))
        return rc;
    if (n != req->nseqs)
        return kp_fail(err, KP_E_PROTOCOL, "seqs: %u results for %u sequences", n, req->nseqs);
    kp_prefill_seq_result *seqs = dec_alloc(msg, n, sizeof(*seqs), err);
    if (!seqs)
        return err ? err->code : KP_E_NO_MEMORY;
    for (uint32_t i = 0; i < n; i++) {
        const kp_prefill_seq *q = &req->seqs[i];
        char path[DEC_PATH_MAX];
        dec_fields sf;
        bool has_out;
        kp_field_name(path, sizeof(path), "seqs", i, NULL);
        if ((rc = dec_open(&sf, msg, &arr[i], path, seq_result_fields, DEC_LENIENT,
                           KP_E_PROTOCOL, err)) ||
            (rc = dec_u64(&sf, "pos", 0, UINT64_MAX, &seqs[i].pos, NULL, err)) ||
            (rc = dec_ref(&sf, "out", kp_token_tensor_bytes(q->len, s->geometry.heads), true,
                          false, &seqs[i].out, &has_out, err, TOKEN_TENSOR_SHAPE, q->len,
                          s->geometry.heads)))
            return rc;
        bool want_out = q->len > 0 && q->out.kind == KP_REF_ABSENT;
        if (has_out != want_out)
            return kp_fail(err, KP_E_PROTOCOL, "%s.out: %s", path,
                           want_out ? "missing: the request asked for inline output"
                                    : "unexpected: the request named an out region or had len 0");
    }
    r->seqs = seqs;
    r->nseqs = n;
    return KP_OK;
}
