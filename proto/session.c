/*
 * session.c - what every message is checked against: the method table,
 * dtypes, tensor sizes, the limits announced by hello (named defaults and
 * their consistency rules) and region bounds.  All size arithmetic that can
 * overflow goes through __builtin_*_overflow.
 */
#include <string.h>

#include "kdaproto.h"

static const char *const method_names[KP_METHOD_COUNT] = {
    [KP_METHOD_UNKNOWN] = NULL,
#define KP_METHOD_NAME(id, wire) [KP_METHOD_##id] = wire,
    KP_METHODS(KP_METHOD_NAME)
#undef KP_METHOD_NAME
};

const char *kp_method_name(kp_method m)
{
    if ((int)m <= KP_METHOD_UNKNOWN || m >= KP_METHOD_COUNT)
        return NULL;
    return method_names[m];
}

kp_method kp_method_lookup(const char *name, size_t len)
{
    for (int m = KP_METHOD_UNKNOWN + 1; m < KP_METHOD_COUNT; m++) {
        if (strlen(method_names[m]) == len && memcmp(method_names[m], name, len) == 0)
            return (kp_method)m;
    }
    return KP_METHOD_UNKNOWN;
}

const char *kp_dtype_name(kp_dtype t)
{
    return t == KP_DTYPE_F32 ? "f32" : "bf16";
}

size_t kp_dtype_size(kp_dtype t)
{
    return t == KP_DTYPE_F32 ? 4 : 2;
}

/* a * b, or UINT64_MAX when it overflows: a saturated size fails every
 * later comparison against a limit or a received length. */
static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

uint64_t kp_state_bytes(uint32_t heads, kp_dtype dtype)
{
    return mul_sat(mul_sat(heads, (uint64_t)KP_HEAD_DIM * KP_HEAD_DIM), kp_dtype_size(dtype));
}

uint64_t kp_token_tensor_bytes(uint32_t len, uint32_t heads)
{
    return mul_sat(mul_sat(len, heads), (uint64_t)KP_HEAD_DIM * 2);
}

uint64_t kp_beta_bytes(uint32_t len, uint32_t heads)
{
    return mul_sat(mul_sat(len, heads), 2);
}

const char *kp_prefill_tensor_name(kp_prefill_tensor t)
{
    static const char *const names[KP_PREFILL_TENSORS] = {"q", "k", "v", "g", "beta", "out"};
    return (unsigned)t < KP_PREFILL_TENSORS ? names[t] : "?";
}

void kp_limits_default(kp_limits *l)
{
    l->max_frame_bytes = KP_DEFAULT_MAX_FRAME_BYTES;
    l->max_inline_bytes = KP_DEFAULT_MAX_INLINE_BYTES;
    l->max_batch_tokens = KP_DEFAULT_MAX_BATCH_TOKENS;
    l->max_batch_seqs = KP_DEFAULT_MAX_BATCH_SEQS;
    l->max_seqs_per_request = KP_DEFAULT_MAX_SEQS_PER_REQUEST;
    l->max_slots_per_client = KP_DEFAULT_MAX_SLOTS_PER_CLIENT;
    l->max_regions_per_client = KP_DEFAULT_MAX_REGIONS_PER_CLIENT;
    l->max_inflight_requests = KP_DEFAULT_MAX_INFLIGHT_REQUESTS;
    l->max_inflight_bytes = KP_DEFAULT_MAX_INFLIGHT_BYTES;
    l->max_layers = KP_DEFAULT_MAX_LAYERS;
    l->max_layers_per_uid = KP_DEFAULT_MAX_LAYERS_PER_UID;
    l->max_slots_per_uid = 0; /* the pool's size: the daemon knows it */
}

int kp_limits_check(const kp_limits *l, kp_error *err)
{
    const int bad = KP_E_INVALID_PARAMS;
    if (l->max_frame_bytes < KP_HELLO_MAX_FRAME_BYTES ||
        l->max_frame_bytes > KP_MAX_FRAME_BYTES_CEILING)
        return kp_fail(err, bad, "max_frame_bytes: %llu is outside [%u, %u]",
                       (unsigned long long)l->max_frame_bytes, KP_HELLO_MAX_FRAME_BYTES,
                       KP_MAX_FRAME_BYTES_CEILING);
    if (l->max_inline_bytes == 0 || l->max_inline_bytes > l->max_frame_bytes)
        return kp_fail(err, bad, "max_inline_bytes: %llu must be in [1, max_frame_bytes %llu]",
                       (unsigned long long)l->max_inline_bytes,
                       (unsigned long long)l->max_frame_bytes);
    if (l->max_batch_tokens == 0)
        return kp_fail(err, bad, "max_batch_tokens: must be at least 1");
    if (l->max_batch_seqs == 0)
        return kp_fail(err, bad, "max_batch_seqs: must be at least 1");
    if (l->max_seqs_per_request == 0 || l->max_seqs_per_request > l->max_batch_seqs ||
        l->max_seqs_per_request > KP_MAX_SEQS_PER_REQUEST_CEILING)
        return kp_fail(err, bad,
                       "max_seqs_per_request: %u must be in [1, min(max_batch_seqs %u, %u)]",
                       l->max_seqs_per_request, l->max_batch_seqs,
                       KP_MAX_SEQS_PER_REQUEST_CEILING);
    if (l->max_slots_per_client == 0 || l->max_slots_per_client > KP_MAX_SLOTS_PER_CLIENT_CEILING)
        return kp_fail(err, bad, "max_slots_per_client: %u is outside [1, %u]",
                       l->max_slots_per_client, KP_MAX_SLOTS_PER_CLIENT_CEILING);
    if (l->max_inflight_requests == 0)
        return kp_fail(err, bad, "max_inflight_requests: must be at least 1");
    if (l->max_inflight_bytes < l->max_frame_bytes)
        return kp_fail(err, bad,
                       "max_inflight_bytes: %llu is below max_frame_bytes %llu, so a "
                       "maximal request could never be admitted",
                       (unsigned long long)l->max_inflight_bytes,
                       (unsigned long long)l->max_frame_bytes);
    return KP_OK;
}

size_t kp_strlcpy(char *dst, const char *src, size_t size)
{
    if (size == 0)
        return 0;
    size_t n = strnlen(src, size - 1);
    memcpy(dst, src, n);
    dst[n] = '\0';
    return n;
}

const char *kp_field_name(char *buf, size_t size, const char *array, uint32_t index,
                          const char *member)
{
    if (size == 0)
        return buf;
    char digits[10]; /* index, least significant first */
    int nd = 0;
    do
        digits[nd++] = (char)('0' + index % 10);
    while ((index /= 10) != 0);
    char *p = buf, *end = buf + size - 1; /* the last byte is the terminator's */
    for (const char *s = array; *s && p < end; s++)
        *p++ = *s;
    if (p < end)
        *p++ = '[';
    while (nd > 0 && p < end)
        *p++ = digits[--nd];
    if (p < end)
        *p++ = ']';
    if (member && p < end)
        *p++ = '.';
    for (const char *s = member; s && *s && p < end; s++)
        *p++ = *s;
    *p = '\0';
    return buf;
}

void kp_session_from_hello(kp_session *s, const kp_hello_result *r)
{
    s->geometry = r->geometry;
    s->limits = r->limits;
}

int kp_ref_check_bounds(const kp_ref *ref, uint64_t region_size, const char *field,
                        kp_error *err)
{
    if (ref->kind != KP_REF_REGION)
        return KP_OK;
    uint64_t end;
    if (__builtin_add_overflow(ref->offset, ref->nbytes, &end) || end > region_size)
        return kp_fail(err, KP_E_REGION_BOUNDS,
                       "%s: bytes [%llu, %llu + %llu) reach outside region %u of %llu bytes",
                       field, (unsigned long long)ref->offset, (unsigned long long)ref->offset,
                       (unsigned long long)ref->nbytes, ref->region,
                       (unsigned long long)region_size);
    return KP_OK;
}
