/*
 * prefill_read.c - the one-pass readers of prefill frames, the hot paths of
 * both sides: a whole request [0, id, "prefill", {layer, seqs}] (the
 * daemon's) or a whole result [1, id, nil, {seqs, queue_us, ...}] (the
 * client's) read straight from its bytes, without pre-validation scan,
 * msgpack object tree or field tables.
 *
 * Each is an accelerator, not a second decoder with its own verdicts: it
 * accepts a frame only when kp_msg_decode + kp_prefill_params_decode (or
 * kp_prefill_result_decode) would accept it and fill the same values
 * (tests/test_proto_prefill.c holds them to that on every refused edit and
 * on random and mutated frames), and declines everything else, including
 * valid frames it does not bother with (signed-integer encodings of
 * non-negative numbers, keys it does not know, say).  A declined frame
 * takes the general path, whose errors name the field.
 *
 * Bounds it keeps without the scanner: every read checks the bytes left;
 * nothing is allocated before the count it sizes is checked against a limit
 * (seqs against max_seqs_per_request); nesting is fixed (5 levels) and the
 * objects of a frame it accepts are at most 45 per sequence, as the
 * general path's KP_MAX_OBJECTS reasoning assumes.
 */
#include <string.h>

#include "codec.h"

typedef struct reader {
    const uint8_t *p, *end;
} reader;

static bool take_be(reader *r, size_t n, uint64_t *v)
{
    if ((size_t)(r->end - r->p) < n)
        return false;
    uint64_t x = 0;
    for (size_t i = 0; i < n; i++)
        x = x << 8 | r->p[i];
    r->p += n;
    *v = x;
    return true;
}

static bool take_type(reader *r, uint8_t *b)
{
    if (r->p == r->end)
        return false;
    *b = *r->p++;
    return true;
}

/* nil, consumed if it is next */
static bool take_nil(reader *r)
{
    if (r->p == r->end || *r->p != 0xc0)
        return false;
    r->p++;
    return true;
}

/* An unsigned integer (positive fixint, uint8..uint64). */
static bool take_uint(reader *r, uint64_t *v)
{
    uint8_t b;
    if (!take_type(r, &b))
        return false;
    if (b <= 0x7f) {
        *v = b;
        return true;
    }
    return b >= 0xcc && b <= 0xcf && take_be(r, (size_t)1 << (b - 0xcc), v);
}

static bool take_bool(reader *r, bool *v)
{
    uint8_t b;
    if (!take_type(r, &b) || (b != 0xc2 && b != 0xc3))
        return false;
    *v = b == 0xc3;
    return true;
}

/* The count of a map (fix 0x80, 16-bit 0xde, 32-bit 0xdf) or an array
 * (0x90, 0xdc, 0xdd) header. */
static bool take_count(reader *r, uint8_t fix, uint8_t wide, uint32_t *n)
{
    uint8_t b;
    uint64_t v;
    if (!take_type(r, &b))
        return false;
    if ((b & 0xf0) == fix) {
        *n = b & 0x0f;
        return true;
    }
    if ((b != wide && b != wide + 1) || !take_be(r, b == wide ? 2 : 4, &v))
        return false;
    *n = (uint32_t)v;
    return true;
}

static bool take_map(reader *r, uint32_t *n) { return take_count(r, 0x80, 0xde, n); }
static bool take_array(reader *r, uint32_t *n) { return take_count(r, 0x90, 0xdc, n); }

/* A str (fixstr, str8/16/32) or a bin (bin8/16/32): its bytes, referenced. */
static bool take_bytes(reader *r, bool bin, const uint8_t **ptr, uint32_t *n)
{
    uint8_t b;
    uint64_t v;
    if (!take_type(r, &b))
        return false;
    if (!bin && (b & 0xe0) == 0xa0) {
        v = b & 0x1f;
    } else {
        const uint8_t first = bin ? 0xc4 : 0xd9; /* the 8-bit form; 16 and 32 follow */
        if (b < first || b > first + 2 || !take_be(r, (size_t)1 << (b - first), &v))
            return false;
    }
    if ((uint64_t)(r->end - r->p) < v)
        return false;
    *ptr = r->p;
    *n = (uint32_t)v;
    r->p += v;
    return true;
}

/* The known keys of a map, with their lengths. */
typedef struct known_key {
    const char *name;
    uint32_t len;
} known_key;
#define KEY(s) {s, sizeof(s) - 1}
#define NKEYS(keys) ((int)(sizeof(keys) / sizeof((keys)[0])))

/* The next key of a map: its index among the count keys, read for the
 * first time (marked in *seen); -1 for anything else, and for keys not sent
 * as fixstr (every encoder does; the general path takes the rest).
 * Encoders write keys in the lists' order: the search starts after the
 * previous key (*next). */
static int take_key(reader *r, const known_key *keys, int count, uint32_t *seen, int *next)
{
    if (r->p == r->end || (*r->p & 0xe0) != 0xa0)
        return -1;
    const uint32_t n = *r->p & 0x1f;
    const uint8_t *k = r->p + 1;
    if ((size_t)(r->end - k) < n)
        return -1;
    r->p = k + n;
    for (int tries = 0, i = *next; tries < count; tries++, i = i + 1 < count ? i + 1 : 0) {
        if (keys[i].len != n)
            continue;
        uint32_t same = 0;
        while (same < n && (uint8_t)keys[i].name[same] == k[same])
            same++;
        if (same < n)
            continue;
        if (*seen & 1u << i)
            return -1;
        *seen |= 1u << i;
        *next = i + 1 < count ? i + 1 : 0;
        return i;
    }
    return -1;
}

static const known_key ref_keys[] = {KEY("region"), KEY("offset")};

/* The bytes of a literal (a key with its fixstr header), consumed if they are next: the
 * compiler compares a short constant length without a call. */
#define take_literal(r, lit) take_exact((r), (lit), sizeof(lit) - 1)
static inline bool take_exact(reader *r, const char *bytes, size_t n)
{
    if ((size_t)(r->end - r->p) < n || memcmp(r->p, bytes, n) != 0)
        return false;
    r->p += n;
    return true;
}

/* A tensor reference as sent: a bin (nbytes its size, checked later against
 * the sequence's shape) or {region >= 1, offset}. */
static bool read_ref(reader *r, kp_ref *out)
{
    if (r->p < r->end && *r->p >= 0xc4 && *r->p <= 0xc6) {
        const uint8_t *data;
        uint32_t n;
        if (!take_bytes(r, true, &data, &n))
            return false;
        *out = kp_ref_inline(data, n);
        return true;
    }
    uint64_t region = 0, offset = 0;
    uint32_t n, seen = 0;
    int next = 0;
    if (!take_map(r, &n) || n > NKEYS(ref_keys))
        return false;
    const uint8_t *fields = r->p;
    if (n == 2 && take_literal(r, "\xa6region") && take_uint(r, &region) &&
        take_literal(r, "\xa6offset") && take_uint(r, &offset)) {
        seen = 3; /* as every encoder writes it */
    } else {
        r->p = fields;
        for (uint32_t i = 0; i < n; i++) {
            int key = take_key(r, ref_keys, NKEYS(ref_keys), &seen, &next);
            if (key < 0 || !take_uint(r, key == 0 ? &region : &offset))
                return false;
        }
    }
    if (seen != 3 || region < 1 || region > UINT32_MAX)
        return false;
    *out = kp_ref_region((uint32_t)region, offset, 0);
    return true;
}

enum { F_SLOT, F_EXPECT_POS, F_LEN, F_FRESH, F_TENSORS }; /* then the six tensors */
static const known_key seq_keys[] = {KEY("slot"), KEY("expect_pos"), KEY("len"), KEY("fresh"),
                                     KEY("q"), KEY("k"), KEY("v"), KEY("g"), KEY("beta"),
                                     KEY("out")};

/* One sequence map, fields in any order; its references are checked
 * against len once the map is read. */
static bool read_seq(reader *r, const kp_session *s, kp_prefill_seq *q, prefill_totals *sum)
{
    uint64_t len = 0;
    uint32_t n, seen = 0;
    int next = 0;
    memset(q, 0, sizeof(*q));
    if (!take_map(r, &n) || n > NKEYS(seq_keys))
        return false;
    for (uint32_t i = 0; i < n; i++) {
        int key = take_key(r, seq_keys, NKEYS(seq_keys), &seen, &next);
        bool ok = key >= 0;
        switch (key) {
        case -1: break;
        case F_SLOT: ok = take_uint(r, &q->slot); break;
        case F_LEN: ok = take_uint(r, &len); break;
        case F_EXPECT_POS:
            q->has_expect_pos = !take_nil(r);
            ok = !q->has_expect_pos || take_uint(r, &q->expect_pos);
            break;
        case F_FRESH: ok = take_nil(r) || take_bool(r, &q->fresh); break;
        default: ok = take_nil(r) || read_ref(r, &q->tensors[key - F_TENSORS]); break;
        }
        if (!ok)
            return false;
    }
    const uint32_t heads = s->geometry.heads;
    if (!(seen & 1u << F_SLOT) || !(seen & 1u << F_LEN) || len > s->limits.max_batch_tokens ||
        (q->fresh && q->has_expect_pos))
        return false;
    q->len = (uint32_t)len;
    for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
        kp_ref *ref = &q->tensors[t];
        if (q->len == 0 || ref->kind == KP_REF_ABSENT) {
            if (ref->kind != KP_REF_ABSENT || (q->len > 0 && t != KP_TENSOR_OUT))
                return false; /* present on len 0, or a required input missing */
            continue;
        }
        uint64_t nbytes = prefill_tensor_bytes(t, q->len, heads), end;
        if (ref->kind == KP_REF_INLINE) {
            if (t == KP_TENSOR_OUT || ref->nbytes != nbytes)
                return false;
            sum->inline_in += nbytes;
        } else {
            if (ref->offset % KP_TENSOR_ALIGN || __builtin_add_overflow(ref->offset, nbytes, &end))
                return false;
            ref->nbytes = nbytes;
        }
    }
    prefill_count_seq(sum, q, heads);
    return true;
}

/* A frame's envelope up to its id: [kind, id, ... (4 elements). */
static bool take_envelope(reader *r, kp_msg_kind kind, uint64_t *id)
{
    uint32_t n;
    uint64_t type;
    return take_array(r, &n) && n == 4 && take_uint(r, &type) && type == kind &&
           take_uint(r, id) && *id <= UINT32_MAX;
}

static const known_key params_keys[] = {KEY("layer"), KEY("seqs")};

static bool read_params(reader *r, kp_msg *msg, const kp_session *s, kp_prefill_params *p,
                        prefill_totals *sum)
{
    uint32_t nkeys, seen = 0;
    int next = 0;
    if (!take_map(r, &nkeys) || nkeys > NKEYS(params_keys))
        return false;
    for (uint32_t k = 0; k < nkeys; k++) {
        int key = take_key(r, params_keys, NKEYS(params_keys), &seen, &next);
        if (key < 0)
            return false;
        if (key == 0) {
            const uint8_t *name;
            uint32_t n;
            char *layer;
            if (!take_bytes(r, false, &name, &n) || n < 1 || n > KP_NAME_MAX ||
                memchr(name, '\0', n) || !(layer = dec_alloc(msg, (size_t)n + 1, 1, NULL)))
                return false;
            memcpy(layer, name, n);
            layer[n] = '\0';
            p->layer = layer;
            continue;
        }
        uint32_t n;
        kp_prefill_seq *seqs;
        if (!take_array(r, &n) || n < 1 || n > s->limits.max_seqs_per_request ||
            !(seqs = dec_alloc(msg, n, sizeof(*seqs), NULL)))
            return false;
        for (uint32_t i = 0; i < n; i++) {
            if (!read_seq(r, s, &seqs[i], sum))
                return false;
        }
        p->seqs = seqs;
        p->nseqs = n;
    }
    return seen == 3;
}

bool kp_prefill_request_read(kp_msg *msg, const void *body, size_t len, uint64_t max_frame,
                             const kp_session *s, kp_prefill_params *p)
{
    reader r = {body, (const uint8_t *)body + len};
    uint64_t id;
    const uint8_t *method;
    uint32_t method_len;
    prefill_totals sum = {0, 0, 0};
    kp_msg_close(msg);
    memset(p, 0, sizeof(*p));
    if (len == 0 || len > max_frame || !take_envelope(&r, KP_MSG_REQUEST, &id) ||
        !take_bytes(&r, false, &method, &method_len) || method_len != 7 ||
        memcmp(method, "prefill", 7) != 0)
        return false;
    msg->unpacked.zone = msgpack_zone_new(MSGPACK_ZONE_CHUNK_SIZE);
    if (!msg->unpacked.zone || !read_params(&r, msg, s, p, &sum) || r.p != r.end ||
        prefill_check_whole(msg, &s->limits, p, &sum, NULL) != KP_OK) {
        kp_msg_close(msg);
        memset(p, 0, sizeof(*p));
        return false;
    }
    msg->kind = KP_MSG_REQUEST;
    msg->has_id = true;
    msg->id = (uint32_t)id;
    msg->method = KP_METHOD_PREFILL;
    msg->name = kp_method_name(KP_METHOD_PREFILL);
    return true;
}

static const known_key result_keys[] = {KEY("seqs"), KEY("queue_us"), KEY("run_us"),
                                        KEY("device_us"), KEY("kernel_us")};

/* The result's seqs: one {"pos": u} per sequence of the request. */
static bool read_positions(reader *r, uint32_t nseqs, uint64_t *pos)
{
    uint32_t n, nkeys;
    if (!take_array(r, &n) || n != nseqs)
        return false;
    for (uint32_t i = 0; i < n; i++) {
        if (!take_map(r, &nkeys) || nkeys != 1 || !take_literal(r, "\xa3pos") ||
            !take_uint(r, &pos[i]))
            return false;
    }
    return true;
}

bool kp_response_peek_id(const void *body, size_t len, uint32_t *id)
{
    reader r = {body, (const uint8_t *)body + len};
    uint64_t v;
    if (!take_envelope(&r, KP_MSG_RESPONSE, &v))
        return false;
    *id = (uint32_t)v;
    return true;
}

bool kp_prefill_result_read(const void *body, size_t len, uint64_t max_frame,
                            const kp_prefill_params *req, uint64_t *pos, kp_prefill_result *res)
{
    reader r = {body, (const uint8_t *)body + len};
    uint32_t nkeys, seen = 0;
    uint64_t id;
    int next = 0;
    memset(res, 0, sizeof(*res));
    for (uint32_t i = 0; i < req->nseqs; i++) {
        if (req->seqs[i].len > 0 && req->seqs[i].out.kind == KP_REF_ABSENT)
            return false; /* its output comes inline */
    }
    if (len == 0 || len > max_frame || !take_envelope(&r, KP_MSG_RESPONSE, &id) ||
        !take_nil(&r) || !take_map(&r, &nkeys) || nkeys > NKEYS(result_keys))
        return false;
    uint64_t *value[] = {NULL, &res->queue_us, &res->run_us, &res->device_us, &res->kernel_us};
    for (uint32_t k = 0; k < nkeys; k++) {
        int key = take_key(&r, result_keys, NKEYS(result_keys), &seen, &next);
        bool ok = key == 0 ? read_positions(&r, req->nseqs, pos)
                           : key > 0 && take_uint(&r, value[key]);
        if (!ok)
            return false;
    }
    if ((seen & 7) != 7 || r.p != r.end)
        return false; /* seqs, queue_us and run_us are required */
    res->nseqs = req->nseqs;
    res->timed = seen & 1u << 3;
    return true;
}
