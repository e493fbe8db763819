/*
 * step.c - the step method (PROTOCOL.md §step): decode steps of many short
 * sequences in one request.
 *
 * The per-sequence lists travel as bins (handles and positions u64
 * little-endian, lengths one byte each), so a request is a fixed handful of
 * msgpack objects whatever its size: decoding costs the same few map lookups
 * plus one pass over the lengths and one over the handles (distinct slots).
 */
#include <string.h>

#include "codec.h"

static const char *const step_fields[] = {"layer", "slots", "lens", "expect_pos", "q", "k", "v",
                                          "g", "beta", "out", "states", NULL};
static const char *const result_fields[] = {"pos", "out", "queue_us", "run_us", "device_us",
                                            "kernel_us", NULL};

const char *kp_step_tensor_name(kp_step_tensor t)
{
    static const char *const names[KP_STEP_TENSORS] = {"q", "k", "v", "g", "beta", "out", "states"};
    return (unsigned)t < KP_STEP_TENSORS ? names[t] : "?";
}

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

/* Bytes of tensor t for a step of `tokens` tokens (saturating). */
static uint64_t step_tensor_bytes(kp_step_tensor t, uint32_t tokens, const kp_geometry *g)
{
    switch (t) {
    case KP_STEP_BETA: return kp_beta_bytes(tokens, g->heads);
    case KP_STEP_STATES: return mul_sat(tokens, kp_state_bytes(g->heads, g->state_dtype));
    default: return kp_token_tensor_bytes(tokens, g->heads);
    }
}

#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)
#define TOKENS_SHAPE "%u tokens x %u heads x " STRINGIFY(KP_HEAD_DIM) " x 2 bytes bf16"
#define BETA_SHAPE "%u tokens x %u heads x 2 bytes bf16"
#define STATES_SHAPE "%u tokens x %u heads x " STRINGIFY(KP_HEAD_DIM) " x " STRINGIFY(KP_HEAD_DIM) \
                     " x %u bytes"

/* ---------------------------------------------------------------------- */
/* Params                                                                 */
/* ---------------------------------------------------------------------- */

static void enc_step_key(kp_writer *w, int t)
{
    switch (t) {
    case KP_STEP_Q: enc_key(w, "q"); break;
    case KP_STEP_K: enc_key(w, "k"); break;
    case KP_STEP_V: enc_key(w, "v"); break;
    case KP_STEP_G: enc_key(w, "g"); break;
    case KP_STEP_BETA: enc_key(w, "beta"); break;
    case KP_STEP_OUT: enc_key(w, "out"); break;
    default: enc_key(w, "states"); break;
    }
}

int kp_step_params_encode(kp_writer *w, uint32_t id, const kp_step_params *p, kp_error *err)
{
    int rc = enc_need_str(p->layer, "layer", err);
    if (rc)
        return rc;
    if (p->nseqs == 0 || !p->slots || !p->lens)
        return kp_fail(err, KP_E_INVALID_PARAMS, "slots: at least one sequence is needed");
    for (uint32_t i = 0; i < p->nseqs; i++)
        if (p->lens[i] < 1 || p->lens[i] > KP_STEP_MAX_TOKENS)
            return kp_fail(err, KP_E_INVALID_PARAMS, "lens[%u]: %u is outside [1, %u]", i,
                           p->lens[i], KP_STEP_MAX_TOKENS);
    uint32_t ntensors = 0;
    for (int t = 0; t < KP_STEP_TENSORS; t++) {
        const bool absent = p->tensors[t].kind == KP_REF_ABSENT;
        if (absent && t < KP_STEP_OUT)
            return kp_fail(err, KP_E_INVALID_PARAMS, "%s: required", kp_step_tensor_name(t));
        if (t >= KP_STEP_OUT && p->tensors[t].kind == KP_REF_INLINE)
            return kp_fail(err, KP_E_INVALID_PARAMS, "%s: must be a region reference",
                           kp_step_tensor_name(t));
        ntensors += !absent;
    }
    enc_request(w, id, KP_METHOD_STEP, 3 + (p->expect_pos != NULL) + ntensors);
    enc_kv_str(w, "layer", p->layer);
    enc_key(w, "slots");
    enc_bin(w, p->slots, (uint64_t)p->nseqs * 8);
    enc_key(w, "lens");
    enc_bin(w, p->lens, p->nseqs);
    if (p->expect_pos) {
        enc_key(w, "expect_pos");
        enc_bin(w, p->expect_pos, (uint64_t)p->nseqs * 8);
    }
    for (int t = 0; t < KP_STEP_TENSORS; t++) {
        if (p->tensors[t].kind != KP_REF_ABSENT) {
            enc_step_key(w, t);
            enc_ref(w, &p->tensors[t]);
        }
    }
    return enc_finish(w, err);
}

/*
 * The kernel updates each slot in place, once per step: a slot named twice
 * would race.  An open-addressing set of the entries' indices (+1; 0 is
 * empty) at most half full: a hash and a probe or two per slot, where a sort
 * of 256 handles cost ~2,000 comparisons through a callback.
 */
static int check_distinct_slots(kp_msg *msg, const kp_step_params *p, kp_error *err)
{
    unsigned bits = 1;
    while (((uint64_t)1 << bits) < 2 * (uint64_t)p->nseqs)
        bits++;
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    uint32_t *set = dec_alloc(msg, (size_t)mask + 1, sizeof(*set), err);
    if (!set)
        return err ? err->code : KP_E_NO_MEMORY;
    memset(set, 0, ((size_t)mask + 1) * sizeof(*set));
    for (uint32_t i = 0; i < p->nseqs; i++) {
        const uint64_t v = kp_step_u64(p->slots, i);
        for (uint64_t h = (v * 0x9e3779b97f4a7c15ull) >> (64 - bits);; h = (h + 1) & mask) {
            const uint32_t j = set[h];
            if (j == 0) {
                set[h] = i + 1;
                break;
            }
            if (kp_step_u64(p->slots, j - 1) == v)
                return kp_fail(err, KP_E_INVALID_PARAMS, "slots[%u]: slot 0x%llx is also named "
                               "by slots[%u]; a slot appears once per request", i,
                               (unsigned long long)v, j - 1);
        }
    }
    return KP_OK;
}

/* The outputs (out, states) may share no byte with any other tensor of the request in the same region. */
static int check_overlaps(const kp_step_params *p, kp_error *err)
{
    for (int o = KP_STEP_OUT; o < KP_STEP_TENSORS; o++) {
        const kp_ref *a = &p->tensors[o];
        if (a->kind != KP_REF_REGION)
            continue;
        for (int t = 0; t < KP_STEP_TENSORS; t++) {
            const kp_ref *b = &p->tensors[t];
            if (t == o || b->kind != KP_REF_REGION || b->region != a->region)
                continue;
            /* offset + nbytes were overflow-checked on decode */
            if (a->offset < b->offset + b->nbytes && b->offset < a->offset + a->nbytes)
                return kp_fail(err, KP_E_INVALID_PARAMS, "%s overlaps %s in region %u: an output "
                               "may not share bytes with any other tensor of the request",
                               kp_step_tensor_name(o), kp_step_tensor_name(t), a->region);
        }
    }
    return KP_OK;
}

int kp_step_params_decode(kp_msg *msg, const kp_session *s, kp_step_params *p, kp_error *err)
{
    dec_fields f;
    const kp_limits *lim = &s->limits;
    const kp_geometry *g = &s->geometry;
    const void *lens = NULL;
    uint32_t nlens = 0;
    bool has_pos;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, step_fields, err);
    if (rc || (rc = dec_str(&f, "layer", 1, KP_NAME_MAX, &p->layer, NULL, err)) ||
        (rc = dec_bin_units(&f, "slots", 8, lim->max_seqs_per_request, &p->slots, &p->nseqs, NULL,
                            err)) ||
        (rc = dec_bin_units(&f, "lens", 1, lim->max_seqs_per_request, &lens, &nlens, NULL, err)))
        return rc;
    if (nlens != p->nseqs)
        return kp_fail(err, KP_E_INVALID_PARAMS, "lens: %u entries for %u slots", nlens, p->nseqs);
    if ((rc = dec_bin(&f, "expect_pos", (uint64_t)p->nseqs * 8, &p->expect_pos, &has_pos, err,
                      "%u slots x 8 bytes u64", p->nseqs)))
        return rc;
    p->lens = lens;
    uint64_t tokens = 0;
    for (uint32_t i = 0; i < p->nseqs; i++) {
        if (p->lens[i] < 1 || p->lens[i] > KP_STEP_MAX_TOKENS)
            return kp_fail(err, KP_E_INVALID_PARAMS, "lens[%u]: %u is outside [1, %u]", i,
                           p->lens[i], KP_STEP_MAX_TOKENS);
        tokens += p->lens[i];
    }
    if (tokens > lim->max_batch_tokens)
        return kp_fail(err, KP_E_LIMIT_EXCEEDED, "lens: %llu tokens in total exceed "
                       "max_batch_tokens %u (a request runs in one launch)",
                       (unsigned long long)tokens, lim->max_batch_tokens);
    p->tokens = (uint32_t)tokens;

    uint64_t inline_in = 0;
    for (int t = 0; t < KP_STEP_TENSORS; t++) {
        const bool input = t < KP_STEP_OUT;
        const uint64_t nbytes = step_tensor_bytes(t, p->tokens, g);
        const char *name = kp_step_tensor_name(t);
        bool present;
        if (t == KP_STEP_STATES)
            rc = dec_ref(&f, name, nbytes, false, true, &p->tensors[t], &present, err, STATES_SHAPE,
                         p->tokens, g->heads, (unsigned)kp_dtype_size(g->state_dtype));
        else
            rc = dec_ref(&f, name, nbytes, input, true, &p->tensors[t], input ? NULL : &present, err,
                         t == KP_STEP_BETA ? BETA_SHAPE : TOKENS_SHAPE, p->tokens, g->heads);
        if (rc)
            return rc;
        if (p->tensors[t].kind == KP_REF_INLINE)
            inline_in += nbytes; /* <= the frame size: cannot overflow */
    }
    if (inline_in > lim->max_inline_bytes)
        return kp_fail(err, KP_E_LIMIT_EXCEEDED, "%llu inline tensor bytes exceed "
                       "max_inline_bytes %llu; use regions", (unsigned long long)inline_in,
                       (unsigned long long)lim->max_inline_bytes);
    if (p->out.kind == KP_REF_ABSENT && kp_token_tensor_bytes(p->tokens, g->heads) > lim->max_inline_bytes)
        return kp_fail(err, KP_E_LIMIT_EXCEEDED, "the inline output of %llu bytes would exceed "
                       "max_inline_bytes %llu; name an out region",
                       (unsigned long long)kp_token_tensor_bytes(p->tokens, g->heads),
                       (unsigned long long)lim->max_inline_bytes);
    if ((rc = check_distinct_slots(msg, p, err)))
        return rc;
    return check_overlaps(p, err);
}

int kp_step_check_regions(const kp_step_params *p, kp_region_size_fn region_size, void *ctx,
                          kp_error *err)
{
    for (int t = 0; t < KP_STEP_TENSORS; t++) {
        const kp_ref *r = &p->tensors[t];
        if (r->kind != KP_REF_REGION)
            continue;
        uint64_t size;
        if (region_size(ctx, r->region, &size) != KP_OK)
            return kp_fail(err, KP_E_REGION_INVALID, "%s: region %u is not registered on this "
                           "connection", kp_step_tensor_name(t), r->region);
        int rc = kp_ref_check_bounds(r, size, kp_step_tensor_name(t), err);
        if (rc)
            return rc;
    }
    return KP_OK;
}

/* ---------------------------------------------------------------------- */
/* Result                                                                 */
/* ---------------------------------------------------------------------- */

int kp_step_result_encode(kp_writer *w, uint32_t id, const kp_step_result *r, kp_error *err)
{
    if (r->nseqs == 0 || !r->pos)
        return kp_fail(err, KP_E_INVALID_PARAMS, "pos: one position per sequence is needed");
    if (r->out.kind == KP_REF_REGION)
        return kp_fail(err, KP_E_INVALID_PARAMS, "out: a result carries output inline or not at all");
    const bool has_out = r->out.kind == KP_REF_INLINE;
    enc_result(w, id, 3 + has_out + 2 * r->timed);
    enc_key(w, "pos");
    enc_bin(w, r->pos, (uint64_t)r->nseqs * 8);
    if (has_out)
        enc_kv_ref(w, "out", &r->out);
    enc_timings(w, r->queue_us, r->run_us, r->timed, r->device_us, r->kernel_us);
    return enc_finish(w, err);
}

int kp_step_result_decode(kp_msg *msg, const kp_session *s, const kp_step_params *req,
                          kp_step_result *r, kp_error *err)
{
    dec_fields f;
    bool has_out;
    memset(r, 0, sizeof(*r));
    int rc = dec_result(&f, msg, result_fields, err);
    if (rc || (rc = dec_bin(&f, "pos", (uint64_t)req->nseqs * 8, &r->pos, NULL, err,
                            "%u sequences x 8 bytes u64", req->nseqs)) ||
        (rc = dec_ref(&f, "out", kp_token_tensor_bytes(req->tokens, s->geometry.heads), true, false,
                      &r->out, &has_out, err, TOKENS_SHAPE, req->tokens, s->geometry.heads)) ||
        (rc = dec_timings(&f, &r->queue_us, &r->run_us, &r->timed, &r->device_us, &r->kernel_us,
                          err)))
        return rc;
    const bool want_out = req->out.kind == KP_REF_ABSENT;
    if (has_out != want_out)
        return kp_fail(err, KP_E_PROTOCOL, "out: %s", want_out
                       ? "missing: the request asked for inline output"
                       : "unexpected: the request named an out region");
    r->nseqs = req->nseqs;
    return KP_OK;
}
