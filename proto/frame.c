/*
 * frame.c - framing: the resumable frame reader (bytes -> frame bodies) and
 * the bounded pre-validation scanner that runs before msgpack-c unpacks a
 * body.
 *
 * Why the scanner exists: msgpack-c allocates count * sizeof(msgpack_object)
 * as soon as it reads an array or map header, before it has seen a single
 * element, so the 5 bytes dd ff ff ff ff ask it for ~96 GB (msgpack-c issue
 * 1013).  The scanner walks the bytes without allocating and refuses any
 * count that the bytes left could not possibly hold (every object takes at
 * least one byte), so msgpack-c's allocations stay proportional to the frame,
 * and KP_MAX_OBJECTS bounds them absolutely.
 */
#include <stdlib.h>
#include <string.h>

#include "kdaproto.h"

/* First body allocation; the buffer then doubles as bytes arrive, so a
 * header alone never makes the reader allocate the cap. */
#define READER_FIRST_CHUNK (64u << 10)

/* ---------------------------------------------------------------------- */
/* Frame reader                                                           */
/* ---------------------------------------------------------------------- */

void kp_reader_init(kp_reader *r, uint64_t max_frame)
{
    memset(r, 0, sizeof(*r));
    r->max_frame = max_frame;
}

void kp_reader_set_max_frame(kp_reader *r, uint64_t max_frame)
{
    r->max_frame = max_frame;
}

void kp_reader_close(kp_reader *r)
{
    free(r->body);
    r->body = NULL;
    r->body_cap = r->body_have = r->body_len = 0;
    r->header_have = 0;
}

static int reader_die(kp_reader *r, kp_error *err)
{
    if (err)
        *err = r->failure;
    return r->failure.code;
}

/* The header was accepted (so body_len >= 1) and the whole body arrived. */
static bool reader_frame_complete(const kp_reader *r)
{
    return !r->failure.code && r->header_have == KP_FRAME_HEADER_BYTES &&
           r->body_have == r->body_len;
}

/* Grows the body buffer towards body_len; records NO_MEMORY on failure. */
static bool reader_grow(kp_reader *r)
{
    uint64_t cap = r->body_cap ? r->body_cap * 2 : READER_FIRST_CHUNK;
    if (cap > r->body_len)
        cap = r->body_len;
    uint8_t *body = realloc(r->body, cap);
    if (!body) {
        kp_fail(&r->failure, KP_E_NO_MEMORY, "frame of %llu bytes: cannot allocate %llu bytes",
                (unsigned long long)r->body_len, (unsigned long long)cap);
        return false;
    }
    r->body = body;
    r->body_cap = cap;
    return true;
}

size_t kp_reader_space(kp_reader *r, uint8_t **buf)
{
    *buf = NULL;
    if (r->failure.code)
        return 0;
    if (r->header_have < KP_FRAME_HEADER_BYTES) {
        *buf = r->header + r->header_have;
        return KP_FRAME_HEADER_BYTES - r->header_have;
    }
    if (r->body_have == r->body_len)
        return 0; /* complete: kp_reader_take first */
    if (r->body_have == r->body_cap && !reader_grow(r))
        return 0;
    *buf = r->body + r->body_have;
    uint64_t space = r->body_cap - r->body_have;
    return space > SIZE_MAX ? SIZE_MAX : (size_t)space;
}

/* The header is complete: check the announced length before anything else. */
static int reader_parse_header(kp_reader *r)
{
    const uint8_t *h = r->header;
    uint64_t len = (uint64_t)h[0] << 24 | (uint64_t)h[1] << 16 | (uint64_t)h[2] << 8 | h[3];
    if (len == 0)
        return kp_fail(&r->failure, KP_E_PROTOCOL,
                       "empty frame: a frame holds exactly one msgpack object");
    if (len > r->max_frame)
        return kp_fail(&r->failure, KP_E_FRAME_TOO_LARGE,
                       "frame of %llu bytes exceeds the cap of %llu bytes",
                       (unsigned long long)len, (unsigned long long)r->max_frame);
    r->body_len = len;
    r->body_have = 0;
    return KP_OK;
}

int kp_reader_commit(kp_reader *r, size_t n, kp_error *err)
{
    if (r->failure.code)
        return reader_die(r, err);
    if (r->header_have < KP_FRAME_HEADER_BYTES) {
        if (n > KP_FRAME_HEADER_BYTES - r->header_have) {
            kp_fail(&r->failure, KP_E_INTERNAL, "commit of %zu bytes overruns the frame header",
                    n);
            return reader_die(r, err);
        }
        r->header_have += (uint32_t)n;
        if (r->header_have < KP_FRAME_HEADER_BYTES)
            return KP_READ_MORE;
        if (reader_parse_header(r) != KP_OK)
            return reader_die(r, err);
        return KP_READ_MORE;
    }
    if (n > r->body_cap - r->body_have) {
        kp_fail(&r->failure, KP_E_INTERNAL, "commit of %zu bytes overruns the space given", n);
        return reader_die(r, err);
    }
    r->body_have += n;
    return r->body_have == r->body_len ? KP_READ_FRAME : KP_READ_MORE;
}

int kp_reader_feed(kp_reader *r, const uint8_t **data, size_t *len, kp_error *err)
{
    for (;;) {
        if (reader_frame_complete(r))
            return KP_READ_FRAME;
        uint8_t *buf;
        size_t space = kp_reader_space(r, &buf);
        if (!buf)
            return reader_die(r, err);
        if (*len == 0)
            return KP_READ_MORE;
        size_t n = space < *len ? space : *len;
        memcpy(buf, *data, n);
        *data += n;
        *len -= n;
        int rc = kp_reader_commit(r, n, err);
        if (rc != KP_READ_MORE)
            return rc;
    }
}

uint8_t *kp_reader_take(kp_reader *r, size_t *len)
{
    if (!reader_frame_complete(r)) {
        *len = 0;
        return NULL;
    }
    uint8_t *body = r->body;
    *len = (size_t)r->body_len;
    r->body = NULL;
    r->body_cap = r->body_have = r->body_len = 0;
    r->header_have = 0;
    r->frames++;
    return body;
}

/* ---------------------------------------------------------------------- */
/* Pre-validation scanner                                                 */
/* ---------------------------------------------------------------------- */

/* The shape of one msgpack value, read from its first bytes. */
typedef struct scan_item {
    size_t header;       /* bytes of the type byte and its length field */
    bool sized;          /* str/bin: the length field counts payload bytes */
    bool container;      /* array or map: the length field (or fix bits) counts entries */
    bool map;            /* a map: 2 objects per entry */
    uint64_t fix_length; /* length carried in the type byte (fixstr, fixarray, fixmap) */
} scan_item;

static uint64_t read_be(const uint8_t *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

/* Classifies the value whose type byte is b.  Returns false for bytes the
 * protocol never uses: the reserved 0xc1 and the ext family. */
static bool scan_classify(uint8_t b, scan_item *it)
{
    memset(it, 0, sizeof(*it));
    it->header = 1;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
        return true; /* fixint, nil, bool */
    if (b <= 0x8f) { /* fixmap */
        it->container = it->map = true;
        it->fix_length = b & 0x0f;
        return true;
    }
    if (b <= 0x9f) { /* fixarray */
        it->container = true;
        it->fix_length = b & 0x0f;
        return true;
    }
    if (b <= 0xbf) { /* fixstr */
        it->sized = true;
        it->fix_length = b & 0x1f;
        return true;
    }
    switch (b) {
    case 0xc4: case 0xd9: it->header = 2; it->sized = true; return true; /* bin8, str8 */
    case 0xc5: case 0xda: it->header = 3; it->sized = true; return true; /* bin16, str16 */
    case 0xc6: case 0xdb: it->header = 5; it->sized = true; return true; /* bin32, str32 */
    case 0xca: it->header = 5; return true;                              /* float32 */
    case 0xcb: it->header = 9; return true;                              /* float64 */
    case 0xcc: case 0xd0: it->header = 2; return true;                   /* (u)int8 */
    case 0xcd: case 0xd1: it->header = 3; return true;                   /* (u)int16 */
    case 0xce: case 0xd2: it->header = 5; return true;                   /* (u)int32 */
    case 0xcf: case 0xd3: it->header = 9; return true;                   /* (u)int64 */
    case 0xdc: it->header = 3; it->container = true; return true;        /* array16 */
    case 0xdd: it->header = 5; it->container = true; return true;        /* array32 */
    case 0xde: it->header = 3; it->container = it->map = true; return true; /* map16 */
    case 0xdf: it->header = 5; it->container = it->map = true; return true; /* map32 */
    default: return false; /* 0xc1, ext 0xc7-0xc9, fixext 0xd4-0xd8 */
    }
}

/*
 * Invariant of the walk: `promised` (objects announced and not read yet) never
 * exceeds `left` (bytes not read yet), because every object takes at least one
 * byte.  A count that would break it is refused before msgpack-c could
 * allocate for it.
 */
int kp_frame_check(const uint8_t *body, size_t len, uint64_t max_frame, kp_error *err)
{
    const int bad = KP_E_PROTOCOL;
    if (len == 0)
        return kp_fail(err, bad, "empty frame: a frame holds exactly one msgpack object");
    if (len > max_frame)
        return kp_fail(err, KP_E_FRAME_TOO_LARGE,
                       "frame of %zu bytes exceeds the cap of %llu bytes", len,
                       (unsigned long long)max_frame);

    /* remaining[d]: objects still to read in the container open at depth d
     * (depth 0 is the frame itself, which holds one object). */
    uint64_t remaining[KP_MAX_DEPTH + 1];
    int depth = 0;
    remaining[0] = 1;
    uint64_t promised = 1;
    uint64_t objects = 1; /* objects announced so far */
    size_t pos = 0;
    size_t left = len;

    while (depth >= 0) {
        if (remaining[depth] == 0) {
            depth--;
            continue;
        }
        remaining[depth]--;
        promised--;

        size_t at = pos;
        scan_item it;
        if (!scan_classify(body[at], &it))
            return kp_fail(err, bad, "byte 0x%02x at offset %zu: %s", body[at], at,
                           body[at] == 0xc1 ? "reserved msgpack type"
                                            : "ext types are not used by this protocol");
        if (it.header > left)
            return kp_fail(err, bad, "truncated frame: the value at offset %zu needs %zu "
                           "header bytes, %zu left", at, it.header, left);
        uint64_t length = it.header > 1 ? read_be(body + at + 1, it.header - 1) : it.fix_length;
        pos += it.header;
        left -= it.header;

        if (it.sized) {
            if (length > left)
                return kp_fail(err, bad, "str/bin at offset %zu claims %llu bytes, only %zu "
                               "left", at, (unsigned long long)length, left);
            pos += (size_t)length;
            left -= (size_t)length;
        }
        if (promised > left)
            return kp_fail(err, bad, "truncated frame: it ends at offset %zu with %llu values "
                           "still missing", len, (unsigned long long)promised);
        if (!it.container)
            continue;

        if (depth + 1 > KP_MAX_DEPTH)
            return kp_fail(err, bad, "container at offset %zu nests deeper than %d levels", at,
                           KP_MAX_DEPTH);
        uint64_t elements = it.map ? 2 * length : length;
        if (elements > left - promised)
            return kp_fail(err, bad, "%s at offset %zu announces %llu objects, but only %llu "
                           "bytes are left for them", it.map ? "map" : "array", at,
                           (unsigned long long)elements,
                           (unsigned long long)(left - promised));
        objects += elements;
        if (objects > KP_MAX_OBJECTS)
            return kp_fail(err, bad, "frame holds more than %u msgpack objects",
                           KP_MAX_OBJECTS);
        if (elements == 0)
            continue;
        remaining[++depth] = elements;
        promised += elements;
    }
    if (pos != len)
        return kp_fail(err, bad, "trailing bytes: the object ends at offset %zu of a %zu-byte "
                       "frame", pos, len);
    return KP_OK;
}
