/*
 * kda_check.c - argument checks shared by every backend (kda.h).
 *
 * Backends call these before any side effect, so a bad batch is rejected
 * whole with one clear sentence and the pool is left untouched.
 */
#include "kda.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kda_fail(kda_error *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        err->code = code;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

const char *kda_status_name(int code)
{
    switch (code) {
    case KDA_OK: return "ok";
    case KDA_EINVAL: return "invalid argument";
    case KDA_ENOMEM: return "out of memory";
    case KDA_EDEVICE: return "device error";
    case KDA_ENOTSUP: return "not supported";
    default: return "unknown status";
    }
}

int kda_layer_check(const kda_layer *layer, kda_error *err)
{
    if (!layer)
        return kda_fail(err, KDA_EINVAL, "layer is NULL");
    if (!layer->A_log || !layer->dt_bias)
        return kda_fail(err, KDA_EINVAL, "layer weights A_log/dt_bias are NULL");
    if (!isfinite(layer->lower_bound) || layer->lower_bound < KDA_LOWER_BOUND_MIN ||
        layer->lower_bound >= 0.0f)
        return kda_fail(err, KDA_EINVAL, "lower_bound %g is outside [-5, 0)",
                        (double)layer->lower_bound);
    if (!isfinite(layer->scale))
        return kda_fail(err, KDA_EINVAL, "scale %g is not finite", (double)layer->scale);
    return KDA_OK;
}

/*
 * Duplicate-slot detection over n records of `stride` bytes whose slot is
 * the int64 at `base + i * stride`: a bitmap over the pool, or pairwise for
 * small batches.
 */
static int check_unique_slots(const kda_pool *pool, const void *base, size_t stride, int64_t n,
                              kda_error *err)
{
    enum { PAIRWISE_MAX = 32 };
#define SLOT_AT(i) (*(const int64_t *)((const char *)base + (size_t)(i) * stride))
    if (n <= PAIRWISE_MAX) {
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < i; j++)
                if (SLOT_AT(i) == SLOT_AT(j))
                    return kda_fail(err, KDA_EINVAL, "slot %lld is named by seqs[%lld] and seqs[%lld]",
                                    (long long)SLOT_AT(i), (long long)j, (long long)i);
        return KDA_OK;
    }
    uint8_t *seen = calloc((size_t)(pool->slots + 7) / 8, 1);
    if (!seen)
        return kda_fail(err, KDA_ENOMEM, "no memory to check %lld slots", (long long)n);
    int rc = KDA_OK;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = SLOT_AT(i);
        uint8_t bit = (uint8_t)(1u << (s & 7));
        if (seen[s >> 3] & bit) {
            rc = kda_fail(err, KDA_EINVAL, "slot %lld is named twice (again by seqs[%lld])",
                          (long long)s, (long long)i);
            break;
        }
        seen[s >> 3] |= bit;
    }
#undef SLOT_AT
    free(seen);
    return rc;
}

static int check_pool(const kda_pool *pool, kda_error *err)
{
    if (!pool)
        return kda_fail(err, KDA_EINVAL, "pool is NULL");
    if (pool->heads < 1 || pool->heads > KDA_MAX_HEADS)
        return kda_fail(err, KDA_EINVAL, "pool heads %d is outside [1, %d]", pool->heads,
                        KDA_MAX_HEADS);
    if (pool->dtype != KDA_DTYPE_BF16 && pool->dtype != KDA_DTYPE_F32)
        return kda_fail(err, KDA_EINVAL, "pool dtype %d is neither bf16 nor fp32", (int)pool->dtype);
    if (pool->slots < 1 || !pool->state)
        return kda_fail(err, KDA_EINVAL, "pool has no state memory (slots %lld)",
                        (long long)pool->slots);
    return KDA_OK;
}

int kda_batch_check(const kda_pool *pool, const kda_seq *seqs, int64_t nseqs, kda_error *err)
{
    int rc = check_pool(pool, err);
    if (rc != KDA_OK)
        return rc;
    if (nseqs < 0 || (nseqs > 0 && !seqs))
        return kda_fail(err, KDA_EINVAL, "batch of %lld sequences without descriptors",
                        (long long)nseqs);
    for (int64_t i = 0; i < nseqs; i++) {
        const kda_seq *s = &seqs[i];
        if (s->len < 0)
            return kda_fail(err, KDA_EINVAL, "seqs[%lld]: negative length %lld", (long long)i,
                            (long long)s->len);
        if (s->slot < 0 || s->slot >= pool->slots)
            return kda_fail(err, KDA_EINVAL, "seqs[%lld]: slot %lld is outside the pool [0, %lld)",
                            (long long)i, (long long)s->slot, (long long)pool->slots);
        if (s->flags & ~KDA_SEQ_ZERO_STATE || s->reserved)
            return kda_fail(err, KDA_EINVAL, "seqs[%lld]: unknown flags 0x%x", (long long)i,
                            s->flags);
        if (s->len > 0 && (!s->q || !s->k || !s->v || !s->g || !s->beta || !s->out || !s->layer))
            return kda_fail(err, KDA_EINVAL, "seqs[%lld]: a tensor or the layer is NULL",
                            (long long)i);
    }
    return check_unique_slots(pool, nseqs > 0 ? &seqs[0].slot : NULL, sizeof *seqs, nseqs, err);
}

int kda_seqs_from_packed(kda_seq *seqs, int64_t n, int32_t heads, const int64_t *cu_seqlens,
                         int64_t total_tokens, const int64_t *slots, const uint16_t *q,
                         const uint16_t *k, const uint16_t *v, const uint16_t *g,
                         const uint16_t *beta, uint16_t *out, const kda_layer *layer,
                         kda_error *err)
{
    if (n < 0 || !cu_seqlens || !slots)
        return kda_fail(err, KDA_EINVAL, "packed batch needs cu_seqlens and slots");
    if (cu_seqlens[0] != 0)
        return kda_fail(err, KDA_EINVAL, "cu_seqlens[0] is %lld, not 0", (long long)cu_seqlens[0]);
    if (cu_seqlens[n] != total_tokens)
        return kda_fail(err, KDA_EINVAL, "cu_seqlens[%lld] is %lld, not the %lld packed tokens",
                        (long long)n, (long long)cu_seqlens[n], (long long)total_tokens);
    for (int64_t i = 0; i < n; i++)
        if (cu_seqlens[i + 1] < cu_seqlens[i])
            return kda_fail(err, KDA_EINVAL, "cu_seqlens is not monotonic at %lld (%lld > %lld)",
                            (long long)i, (long long)cu_seqlens[i], (long long)cu_seqlens[i + 1]);
    const int64_t row = (int64_t)heads * KDA_HEAD_DIM;
    for (int64_t i = 0; i < n; i++) {
        int64_t t0 = cu_seqlens[i];
        seqs[i] = (kda_seq){
            .q = q + t0 * row, .k = k + t0 * row, .v = v + t0 * row, .g = g + t0 * row,
            .beta = beta + t0 * heads, .out = out + t0 * row, .layer = layer,
            .len = cu_seqlens[i + 1] - t0, .slot = slots[i],
        };
    }
    return KDA_OK;
}

int kda_step_seqs_fill(kda_step_seq *seqs, int32_t n, const int64_t *slots, const int32_t *lens,
                       int32_t *tokens, kda_error *err)
{
    if (n < 0 || (n > 0 && (!seqs || !slots || !lens)) || !tokens)
        return kda_fail(err, KDA_EINVAL, "step of %d sequences without lengths or slots", (int)n);
    int32_t t = 0;
    for (int32_t i = 0; i < n; i++) {
        if (lens[i] < 1 || lens[i] > KDA_STEP_MAX_TOKENS)
            return kda_fail(err, KDA_EINVAL, "seqs[%d]: %d tokens is outside [1, %d]", (int)i,
                            (int)lens[i], KDA_STEP_MAX_TOKENS);
        seqs[i] = (kda_step_seq){.slot = slots[i], .start = t, .len = (uint16_t)lens[i]};
        if (t > INT32_MAX - lens[i])
            return kda_fail(err, KDA_EINVAL, "step of more than %d tokens", INT32_MAX);
        t += lens[i];
    }
    *tokens = t;
    return KDA_OK;
}

int kda_step_check(const kda_pool *pool, const kda_step *step, kda_error *err)
{
    int rc = check_pool(pool, err);
    if (rc != KDA_OK)
        return rc;
    if (!step)
        return kda_fail(err, KDA_EINVAL, "step is NULL");
    if (step->nseqs < 0 || (step->nseqs > 0 && !step->seqs))
        return kda_fail(err, KDA_EINVAL, "step of %d sequences without descriptors", (int)step->nseqs);
    if (step->nseqs == 0)
        return KDA_OK;
    if (!step->q || !step->k || !step->v || !step->g || !step->beta || !step->out || !step->layer)
        return kda_fail(err, KDA_EINVAL, "step: a tensor or the layer is NULL");
    int64_t t = 0;
    for (int32_t i = 0; i < step->nseqs; i++) {
        const kda_step_seq *s = &step->seqs[i];
        if (s->len < 1 || s->len > KDA_STEP_MAX_TOKENS)
            return kda_fail(err, KDA_EINVAL, "seqs[%d]: %d tokens is outside [1, %d]", (int)i,
                            (int)s->len, KDA_STEP_MAX_TOKENS);
        if (s->start != t)
            return kda_fail(err, KDA_EINVAL, "seqs[%d]: starts at token %d, not %lld (sequences are back to back)",
                            (int)i, (int)s->start, (long long)t);
        if (s->slot < 0 || s->slot >= pool->slots)
            return kda_fail(err, KDA_EINVAL, "seqs[%d]: slot %lld is outside the pool [0, %lld)",
                            (int)i, (long long)s->slot, (long long)pool->slots);
        if (s->flags & ~KDA_SEQ_ZERO_STATE)
            return kda_fail(err, KDA_EINVAL, "seqs[%d]: unknown flags 0x%x", (int)i, s->flags);
        t += s->len;
    }
    if (t != step->tokens)
        return kda_fail(err, KDA_EINVAL, "step: the sequences hold %lld tokens, not %d", (long long)t,
                        (int)step->tokens);
    return check_unique_slots(pool, &step->seqs[0].slot, sizeof *step->seqs, step->nseqs, err);
}

int kda_batch_is_step(const kda_seq *seqs, int64_t nseqs)
{
    for (int64_t i = 0; i < nseqs; i++)
        if (seqs[i].len < 1 || seqs[i].len > KDA_STEP_CHOICE_TOKENS)
            return 0;
    return nseqs > 0;
}
