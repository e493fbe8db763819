/*
 * decode.c - incoming messages: kp_msg_decode (pre-validate, unpack, check
 * the msgpack-RPC envelope), the remote error decoders, and the dec_* typed
 * field getters every message decoder is written with.
 *
 * msgpack-c's msgpack_unpack_next references str and bin payloads inside the
 * input buffer instead of copying them (its template_callback_str/_bin store
 * the input pointer), so inline tensors decode to pointers into the frame
 * body at no cost; tests/test_proto_frame.c checks this.  Only the object
 * tree is allocated, from the kp_msg's zone, and kp_frame_check bounds it.
 */
#include <assert.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"

/* ---------------------------------------------------------------------- */
/* Envelope                                                               */
/* ---------------------------------------------------------------------- */

void kp_msg_init(kp_msg *msg)
{
    memset(msg, 0, sizeof(*msg));
    msgpack_unpacked_init(&msg->unpacked);
}

void kp_msg_close(kp_msg *msg)
{
    msgpack_unpacked_destroy(&msg->unpacked);
    kp_msg_init(msg);
}

static const char *type_name(const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "bool";
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return "unsigned integer";
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "negative integer";
    case MSGPACK_OBJECT_FLOAT32: return "float32";
    case MSGPACK_OBJECT_FLOAT64: return "float64";
    case MSGPACK_OBJECT_STR: return "str";
    case MSGPACK_OBJECT_ARRAY: return "array";
    case MSGPACK_OBJECT_MAP: return "map";
    case MSGPACK_OBJECT_BIN: return "bin";
    default: return "ext";
    }
}

static int envelope_id(kp_msg *msg, const msgpack_object *o, kp_error *err)
{
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER || o->via.u64 > UINT32_MAX)
        return kp_fail(err, KP_E_PROTOCOL, "message id: expected an unsigned 32-bit integer, "
                       "got %s", type_name(o));
    msg->id = (uint32_t)o->via.u64;
    msg->has_id = true;
    return KP_OK;
}

static int envelope_method(kp_msg *msg, const msgpack_object *o, kp_error *err)
{
    int rc = dec_copy_str(msg, o, "method", SIZE_MAX, KP_E_PROTOCOL, &msg->name, err);
    if (rc)
        return rc;
    msg->method = kp_method_lookup(o->via.str.ptr, o->via.str.size);
    return KP_OK;
}

static int envelope_params(kp_msg *msg, const msgpack_object *o, kp_error *err)
{
    if (o->type != MSGPACK_OBJECT_MAP)
        return kp_fail(err, KP_E_PROTOCOL, "params: expected a map, got %s", type_name(o));
    msg->params = o;
    return KP_OK;
}

int kp_msg_decode(kp_msg *msg, const void *body, size_t len, uint64_t max_frame, kp_error *err)
{
    kp_msg_close(msg);
    int rc = kp_frame_check(body, len, max_frame, err);
    if (rc)
        return rc;

    size_t off = 0;
    msgpack_unpack_return ur = msgpack_unpack_next(&msg->unpacked, body, len, &off);
    if (ur == MSGPACK_UNPACK_NOMEM_ERROR)
        return kp_fail(err, KP_E_NO_MEMORY, "out of memory unpacking a %zu-byte frame", len);
    if (ur != MSGPACK_UNPACK_SUCCESS || off != len)
        return kp_fail(err, KP_E_INTERNAL, "msgpack-c refused a frame that passed "
                       "pre-validation (status %d, %zu of %zu bytes)", (int)ur, off, len);

    const msgpack_object *root = &msg->unpacked.data;
    if (root->type != MSGPACK_OBJECT_ARRAY || root->via.array.size < 3)
        return kp_fail(err, KP_E_PROTOCOL, "message: expected an array [type, ...], got %s",
                       type_name(root));
    const msgpack_object *e = root->via.array.ptr;
    uint32_t n = root->via.array.size;
    if (e[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER || e[0].via.u64 > KP_MSG_NOTIFICATION)
        return kp_fail(err, KP_E_PROTOCOL, "message type: expected 0, 1 or 2");
    msg->kind = (kp_msg_kind)e[0].via.u64;

    switch (msg->kind) {
    case KP_MSG_REQUEST:
        if (n != 4)
            return kp_fail(err, KP_E_PROTOCOL, "request: expected 4 elements, got %u", n);
        if ((rc = envelope_id(msg, &e[1], err)) || (rc = envelope_method(msg, &e[2], err)))
            return rc;
        return envelope_params(msg, &e[3], err);
    case KP_MSG_RESPONSE:
        if (n != 4)
            return kp_fail(err, KP_E_PROTOCOL, "response: expected 4 elements, got %u", n);
        if ((rc = envelope_id(msg, &e[1], err)))
            return rc;
        if (e[2].type == MSGPACK_OBJECT_MAP && e[3].type == MSGPACK_OBJECT_NIL) {
            msg->error = &e[2];
            return KP_OK;
        }
        if (e[2].type == MSGPACK_OBJECT_NIL && e[3].type != MSGPACK_OBJECT_NIL) {
            msg->result = &e[3];
            return KP_OK;
        }
        return kp_fail(err, KP_E_PROTOCOL, "response: expected [1, id, nil, result] or "
                       "[1, id, error map, nil]");
    case KP_MSG_NOTIFICATION:
        if (n != 3)
            return kp_fail(err, KP_E_PROTOCOL, "notification: expected 3 elements, got %u", n);
        if ((rc = envelope_method(msg, &e[1], err)))
            return rc;
        return envelope_params(msg, &e[2], err);
    }
    return kp_fail(err, KP_E_INTERNAL, "unreachable message kind");
}

bool kp_msg_takes_fd(const kp_msg *msg)
{
    if (msg->kind != KP_MSG_REQUEST || !msg->params)
        return false;
    if (msg->method == KP_METHOD_REGION_REGISTER_SHM)
        return true;
    if (msg->method != KP_METHOD_REGION_REGISTER_CUDA)
        return false;
    static const char posix_fd[] = "posix_fd";
    const msgpack_object_map *map = &msg->params->via.map;
    for (uint32_t i = 0; i < map->size; i++) {
        const msgpack_object *k = &map->ptr[i].key, *v = &map->ptr[i].val;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == 11 &&
            memcmp(k->via.str.ptr, "handle_type", 11) == 0)
            return v->type == MSGPACK_OBJECT_STR && v->via.str.size == sizeof(posix_fd) - 1 &&
                   memcmp(v->via.str.ptr, posix_fd, sizeof(posix_fd) - 1) == 0;
    }
    return false;
}

/* ---------------------------------------------------------------------- */
/* Remote errors                                                          */
/* ---------------------------------------------------------------------- */

static int decode_error_object(kp_msg *msg, const msgpack_object *obj, kp_error *remote,
                               kp_error *err)
{
    static const char *const names[] = {"code", "name", "message", "retryable", NULL};
    dec_fields f;
    int rc = dec_open(&f, msg, obj, "error", names, DEC_LENIENT, KP_E_PROTOCOL, err);
    if (rc)
        return rc;
    const msgpack_object *code = dec_get(&f, "code");
    if (!code || code->type != MSGPACK_OBJECT_NEGATIVE_INTEGER || code->via.i64 < INT32_MIN)
        return kp_fail(err, KP_E_PROTOCOL, "error.code: expected a negative 32-bit integer");
    const char *name = NULL, *message = NULL;
    bool retryable = false;
    if ((rc = dec_str(&f, "name", 1, KP_NAME_MAX, &name, NULL, err)) ||
        (rc = dec_str(&f, "message", 0, SIZE_MAX, &message, NULL, err)) ||
        (rc = dec_bool(&f, "retryable", &retryable, NULL, err)))
        return rc;
    remote->code = (int)code->via.i64;
    remote->retryable = retryable;
    snprintf(remote->message, sizeof(remote->message), "%s", message);
    return KP_OK;
}

int kp_response_error_decode(kp_msg *msg, kp_error *remote, kp_error *err)
{
    if (msg->kind != KP_MSG_RESPONSE || !msg->error)
        return kp_fail(err, KP_E_INTERNAL, "not an error response");
    return decode_error_object(msg, msg->error, remote, err);
}

int kp_goodbye_decode(kp_msg *msg, kp_error *remote, kp_error *err)
{
    if (msg->kind != KP_MSG_NOTIFICATION || strcmp(msg->name, KP_NOTIFY_GOODBYE) != 0)
        return kp_fail(err, KP_E_PROTOCOL, "not a goodbye notification");
    return decode_error_object(msg, msg->params, remote, err);
}

int kp_empty_result_decode(kp_msg *msg, kp_error *err)
{
    static const char *const names[] = {NULL};
    dec_fields f;
    return dec_result(&f, msg, names, err);
}

/* ---------------------------------------------------------------------- */
/* Field access                                                           */
/* ---------------------------------------------------------------------- */

void *dec_alloc(kp_msg *msg, size_t n, size_t size, kp_error *err)
{
    size_t bytes;
    if (n == 0)
        n = 1; /* a valid pointer even for empty arrays */
    if (__builtin_mul_overflow(n, size, &bytes)) {
        kp_fail(err, KP_E_NO_MEMORY, "decoded array of %zu x %zu bytes overflows", n, size);
        return NULL;
    }
    void *p = msgpack_zone_malloc(msg->unpacked.zone, bytes);
    if (!p)
        kp_fail(err, KP_E_NO_MEMORY, "out of memory decoding %zu bytes", bytes);
    return p;
}

int dec_copy_str(kp_msg *msg, const msgpack_object *o, const char *field, size_t max_len,
                 int code, const char **out, kp_error *err)
{
    if (o->type != MSGPACK_OBJECT_STR)
        return kp_fail(err, code, "%s: expected a str, got %s", field, type_name(o));
    uint32_t n = o->via.str.size;
    if (n > max_len)
        return kp_fail(err, code, "%s: %u bytes, at most %zu allowed", field, n, max_len);
    char *s = dec_alloc(msg, (size_t)n + 1, 1, err);
    if (!s)
        return err ? err->code : KP_E_NO_MEMORY;
    if (n) /* msgpack-c gives an empty str a NULL pointer */
        memcpy(s, o->via.str.ptr, n);
    s[n] = '\0';
    *out = s;
    return KP_OK;
}

/* key (len bytes, not NUL-terminated, may hold NULs) spells name exactly. */
static bool name_is(const char *name, const char *key, uint32_t len)
{
    return strlen(name) == len && memcmp(name, key, len) == 0;
}

/* Entries of a NULL-terminated names list. */
static int names_count(const char *const *names)
{
    int count = 0;
    while (names[count])
        count++;
    return count;
}

/* The index of key in the `count` names, or -1.  Encoders write fields in
 * the order of their names lists, some left out: the search starts after
 * the previous key's name (`from`) and wraps around. */
static int find_name(const char *const *names, int count, int from, const char *key,
                     uint32_t len)
{
    for (int n = 0, i = from; n < count; n++, i = i + 1 < count ? i + 1 : 0) {
        if (name_is(names[i], key, len))
            return i;
    }
    return -1;
}

/* The map's own path into buf ("" at the top); its length. */
static size_t map_path(const dec_fields *f, char *buf, size_t size)
{
    if (!f->parent)
        return kp_strlcpy(buf, f->path, size);
    dec_path(f->parent, f->pname, buf, size);
    return strlen(buf);
}

/* What a map is called in messages: its path, or "params"/"result" at the top. */
static const char *map_label(const dec_fields *f, char *buf, size_t size)
{
    if (map_path(f, buf, size) == 0)
        kp_strlcpy(buf, f->code == KP_E_PROTOCOL ? "result" : "params", size);
    return buf;
}

/* dec_open's checks; f's path (or parent) is set. */
static int open_map(dec_fields *f, const msgpack_object *obj, dec_mode mode, kp_error *err)
{
    char label[DEC_PATH_MAX];
    int code = f->code;
    const char *const *names = f->names;
    if (obj->type != MSGPACK_OBJECT_MAP)
        return kp_fail(err, code, "%s: expected a map, got %s", map_label(f, label, sizeof(label)),
                       type_name(obj));
    const int count = names_count(names);
    int next = 0;
    for (uint32_t i = 0; i < obj->via.map.size; i++) {
        const msgpack_object *key = &obj->via.map.ptr[i].key;
        if (key->type != MSGPACK_OBJECT_STR)
            return kp_fail(err, code, "%s: keys must be str, got %s",
                           map_label(f, label, sizeof(label)), type_name(key));
        int at = find_name(names, count, next, key->via.str.ptr, key->via.str.size);
        int shown = key->via.str.size > 40 ? 40 : (int)key->via.str.size;
        if (at < 0) {
            if (mode == DEC_LENIENT)
                continue;
            return kp_fail(err, code, "%s: unknown field \"%.*s\"",
                           map_label(f, label, sizeof(label)), shown, key->via.str.ptr);
        }
        assert(at < DEC_FIELDS_MAX); /* a names list longer than vals[] is a codec bug */
        if (f->vals[at])
            return kp_fail(err, code, "%s: field \"%.*s\" appears twice",
                           map_label(f, label, sizeof(label)), shown, key->via.str.ptr);
        f->vals[at] = &obj->via.map.ptr[i].val;
        next = at + 1 < count ? at + 1 : 0;
    }
    return KP_OK;
}

int dec_open(dec_fields *f, kp_msg *msg, const msgpack_object *obj, const char *path,
             const char *const *names, dec_mode mode, int code, kp_error *err)
{
    memset(f, 0, sizeof(*f));
    f->msg = msg;
    f->path = path;
    f->names = names;
    f->code = code;
    return open_map(f, obj, mode, err);
}

/* dec_open of field `name` of parent: no path is built unless it fails. */
static int dec_open_field(dec_fields *f, const dec_fields *parent, const char *name,
                          const msgpack_object *obj, const char *const *names, kp_error *err)
{
    memset(f, 0, sizeof(*f));
    f->msg = parent->msg;
    f->parent = parent;
    f->pname = name;
    f->names = names;
    f->code = parent->code;
    return open_map(f, obj, DEC_STRICT, err);
}

const msgpack_object *dec_get(const dec_fields *f, const char *name)
{
    /* Decoders name fields with the literals of their names lists, which the
     * compiler merges: comparing pointers usually finds the field. */
    for (int i = 0; f->names[i]; i++) {
        if (f->names[i] == name)
            return f->vals[i];
    }
    for (int i = 0; f->names[i]; i++) {
        if (strcmp(f->names[i], name) == 0)
            return f->vals[i];
    }
    return NULL;
}

void dec_path(const dec_fields *f, const char *name, char *buf, size_t size)
{
    size_t at = map_path(f, buf, size);
    if (at)
        at += kp_strlcpy(buf + at, ".", size - at);
    kp_strlcpy(buf + at, name, size - at);
}

int dec_params(dec_fields *f, kp_msg *msg, const char *const *names, kp_error *err)
{
    if (msg->kind != KP_MSG_REQUEST || !msg->params)
        return kp_fail(err, KP_E_INTERNAL, "not a decoded request");
    return dec_open(f, msg, msg->params, "", names, DEC_STRICT, KP_E_INVALID_PARAMS, err);
}

int dec_result(dec_fields *f, kp_msg *msg, const char *const *names, kp_error *err)
{
    if (msg->kind != KP_MSG_RESPONSE || !msg->result)
        return kp_fail(err, KP_E_INTERNAL,
                       "not a successful response (use kp_response_error_decode)");
    return dec_open(f, msg, msg->result, "", names, DEC_LENIENT, KP_E_PROTOCOL, err);
}

/*
 * Finds a field for a getter.  Returns 1 with *o set when there is a value,
 * 0 when an optional field is absent (nil counts as absent), or a negative
 * code when a required field is missing.
 */
static int lookup(const dec_fields *f, const char *name, bool *present,
                  const msgpack_object **o, kp_error *err)
{
    *o = dec_get(f, name);
    if (*o && (*o)->type == MSGPACK_OBJECT_NIL && present)
        *o = NULL;
    if (present)
        *present = *o != NULL;
    if (*o)
        return 1;
    if (present)
        return 0;
    char path[DEC_PATH_MAX];
    dec_path(f, name, path, sizeof(path));
    return kp_fail(err, f->code, "%s: required field is missing", path);
}

static int wrong_type(const dec_fields *f, const char *name, const char *want,
                      const msgpack_object *o, kp_error *err)
{
    char path[DEC_PATH_MAX];
    dec_path(f, name, path, sizeof(path));
    return kp_fail(err, f->code, "%s: expected %s, got %s", path, want, type_name(o));
}

int dec_u64(const dec_fields *f, const char *name, uint64_t min, uint64_t max, uint64_t *out,
            bool *present, kp_error *err)
{
    const msgpack_object *o;
    int rc = lookup(f, name, present, &o, err);
    if (rc <= 0)
        return rc;
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return wrong_type(f, name, "an unsigned integer", o, err);
    if (o->via.u64 < min || o->via.u64 > max) {
        char path[DEC_PATH_MAX];
        dec_path(f, name, path, sizeof(path));
        return kp_fail(err, f->code, "%s: %llu is outside [%llu, %llu]", path,
                       (unsigned long long)o->via.u64, (unsigned long long)min,
                       (unsigned long long)max);
    }
    *out = o->via.u64;
    return KP_OK;
}

int dec_u32(const dec_fields *f, const char *name, uint32_t min, uint32_t max, uint32_t *out,
            bool *present, kp_error *err)
{
    uint64_t v = 0;
    bool here = false;
    int rc = dec_u64(f, name, min, max, &v, present ? &here : NULL, err);
    if (present)
        *present = here;
    if (rc == KP_OK && (!present || here))
        *out = (uint32_t)v;
    return rc;
}

int dec_bool(const dec_fields *f, const char *name, bool *out, bool *present, kp_error *err)
{
    const msgpack_object *o;
    int rc = lookup(f, name, present, &o, err);
    if (rc <= 0)
        return rc;
    if (o->type != MSGPACK_OBJECT_BOOLEAN)
        return wrong_type(f, name, "a bool", o, err);
    *out = o->via.boolean;
    return KP_OK;
}

int dec_float(const dec_fields *f, const char *name, float *out, bool *present, kp_error *err)
{
    const msgpack_object *o;
    int rc = lookup(f, name, present, &o, err);
    if (rc <= 0)
        return rc;
    double d;
    if (o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64)
        d = o->via.f64;
    else if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        d = (double)o->via.u64;
    else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        d = (double)o->via.i64;
    else
        return wrong_type(f, name, "a number", o, err);
    float v = (float)d;
    if (!isfinite(v)) {
        char path[DEC_PATH_MAX];
        dec_path(f, name, path, sizeof(path));
        return kp_fail(err, f->code, "%s: %g is not a finite float", path, d);
    }
    *out = v;
    return KP_OK;
}

int dec_str(const dec_fields *f, const char *name, size_t min_len, size_t max_len,
            const char **out, bool *present, kp_error *err)
{
    const msgpack_object *o;
    int rc = lookup(f, name, present, &o, err);
    if (rc <= 0)
        return rc;
    char path[DEC_PATH_MAX];
    dec_path(f, name, path, sizeof(path));
    if (o->type == MSGPACK_OBJECT_STR) {
        if (o->via.str.size < min_len)
            return kp_fail(err, f->code, "%s: %u bytes, at least %zu needed", path,
                           o->via.str.size, min_len);
        if (o->via.str.size && memchr(o->via.str.ptr, '\0', o->via.str.size))
            return kp_fail(err, f->code, "%s: contains a NUL byte", path);
    }
    return dec_copy_str(f->msg, o, path, max_len, f->code, out, err);
}

int dec_enum(const dec_fields *f, const char *name, const char *const *choices, int *out,
             bool *present, kp_error *err)
{
    const msgpack_object *o;
    int rc = lookup(f, name, present, &o, err);
    if (rc <= 0)
        return rc;
    if (o->type != MSGPACK_OBJECT_STR)
        return wrong_type(f, name, "a str", o, err);
    int at = find_name(choices, names_count(choices), 0, o->via.str.ptr, o->via.str.size);
    if (at >= 0) {
        *out = at;
        return KP_OK;
    }
    char path[DEC_PATH_MAX], list[128] = "";
    dec_path(f, name, path, sizeof(path));
    for (int i = 0; choices[i]; i++) {
        size_t used = strlen(list);
        snprintf(list + used, sizeof(list) - used, "%s\"%s\"", i ? ", " : "", choices[i]);
    }
    int shown = o->via.str.size > 40 ? 40 : (int)o->via.str.size;
    return kp_fail(err, f->code, "%s: \"%.*s\" is not one of %s", path, shown, o->via.str.ptr,
                   list);
}

/* The size error of a bin: "path: expected N bytes (shape), got M". */
static int bin_size_error(const dec_fields *f, const char *name, uint64_t nbytes, uint32_t got,
                          kp_error *err, const char *shape_fmt, va_list ap)
{
    char path[DEC_PATH_MAX], shape[96];
    dec_path(f, name, path, sizeof(path));
    vsnprintf(shape, sizeof(shape), shape_fmt, ap);
    return kp_fail(err, f->code, "%s: expected %llu bytes (%s), got %u", path,
                   (unsigned long long)nbytes, shape, got);
}

/* {"region": id, "offset": bytes} for a reference of nbytes bytes. */
static int dec_region_ref(const dec_fields *f, const char *name, const msgpack_object *o,
                          uint64_t nbytes, kp_ref *out, kp_error *err)
{
    static const char *const names[] = {"region", "offset", NULL};
    dec_fields rf;
    uint32_t region = 0;
    uint64_t offset = 0;
    int rc = dec_open_field(&rf, f, name, o, names, err);
    if (rc || (rc = dec_u32(&rf, "region", 1, UINT32_MAX, &region, NULL, err)) ||
        (rc = dec_u64(&rf, "offset", 0, UINT64_MAX, &offset, NULL, err)))
        return rc;
    uint64_t end;
    bool overflows = __builtin_add_overflow(offset, nbytes, &end);
    if (offset % KP_TENSOR_ALIGN || overflows) {
        char path[DEC_PATH_MAX];
        dec_path(f, name, path, sizeof(path));
        if (offset % KP_TENSOR_ALIGN)
            return kp_fail(err, f->code, "%s.offset: %llu is not a multiple of %d", path,
                           (unsigned long long)offset, KP_TENSOR_ALIGN);
        return kp_fail(err, KP_E_REGION_BOUNDS, "%s: offset %llu + %llu bytes overflows", path,
                       (unsigned long long)offset, (unsigned long long)nbytes);
    }
    *out = kp_ref_region(region, offset, nbytes);
    return KP_OK;
}

/* dec_path into a DEC_PATH_MAX buffer, returned (for error messages). */
static const char *field_path(const dec_fields *f, const char *name, char buf[DEC_PATH_MAX])
{
    dec_path(f, name, buf, DEC_PATH_MAX);
    return buf;
}

/* dec_ref with the shape's arguments in a va_list: dec_ref and dec_bin share it. */
static int vdec_ref(const dec_fields *f, const char *name, uint64_t nbytes, bool allow_inline,
                    bool allow_region, kp_ref *out, bool *present, kp_error *err,
                    const char *shape_fmt, va_list ap)
{
    const msgpack_object *o;
    memset(out, 0, sizeof(*out));
    int rc = lookup(f, name, present, &o, err);
    if (rc <= 0)
        return rc;
    char path[DEC_PATH_MAX];
    if (o->type == MSGPACK_OBJECT_BIN) {
        if (!allow_inline)
            return kp_fail(err, f->code, "%s: must be a region reference {region, offset}; "
                           "omit it to receive the data inline", field_path(f, name, path));
        if (o->via.bin.size != nbytes)
            return bin_size_error(f, name, nbytes, o->via.bin.size, err, shape_fmt, ap);
        *out = kp_ref_inline(o->via.bin.ptr, nbytes);
        return KP_OK;
    }
    if (o->type == MSGPACK_OBJECT_MAP) {
        if (!allow_region)
            return kp_fail(err, f->code, "%s: must be an inline bin", field_path(f, name, path));
        return dec_region_ref(f, name, o, nbytes, out, err);
    }
    return wrong_type(f, name, !allow_region ? "a bin" : allow_inline ? "a bin or a region map"
                                                                      : "a region map", o, err);
}

int dec_ref(const dec_fields *f, const char *name, uint64_t nbytes, bool allow_inline,
            bool allow_region, kp_ref *out, bool *present, kp_error *err, const char *shape_fmt,
            ...)
{
    va_list ap;
    va_start(ap, shape_fmt);
    int rc = vdec_ref(f, name, nbytes, allow_inline, allow_region, out, present, err, shape_fmt, ap);
    va_end(ap);
    return rc;
}

int dec_bin(const dec_fields *f, const char *name, uint64_t nbytes, const void **out,
            bool *present, kp_error *err, const char *shape_fmt, ...)
{
    kp_ref ref;
    va_list ap;
    va_start(ap, shape_fmt);
    int rc = vdec_ref(f, name, nbytes, true, false, &ref, present, err, shape_fmt, ap);
    va_end(ap);
    if (rc == KP_OK && ref.kind == KP_REF_INLINE)
        *out = ref.data;
    return rc;
}

int dec_bin_units(const dec_fields *f, const char *name, uint32_t unit, uint32_t max_units,
                  const void **out, uint32_t *units, bool *present, kp_error *err)
{
    const msgpack_object *o;
    int rc = lookup(f, name, present, &o, err);
    if (rc <= 0)
        return rc;
    if (o->type != MSGPACK_OBJECT_BIN)
        return wrong_type(f, name, "a bin", o, err);
    uint32_t size = o->via.bin.size;
    if (size == 0 || size % unit || size / unit > max_units) {
        char path[DEC_PATH_MAX];
        dec_path(f, name, path, sizeof(path));
        return kp_fail(err, f->code, "%s: %u bytes, expected 1..%u entries of %u bytes", path, size,
                       max_units, unit);
    }
    *out = o->via.bin.ptr;
    *units = size / unit;
    return KP_OK;
}

int dec_array(const dec_fields *f, const char *name, uint32_t max, bool allow_empty,
              const msgpack_object **arr, uint32_t *n, bool *present, kp_error *err)
{
    const msgpack_object *o;
    int rc = lookup(f, name, present, &o, err);
    if (rc <= 0)
        return rc;
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return wrong_type(f, name, "an array", o, err);
    uint32_t size = o->via.array.size;
    if (size > max || (size == 0 && !allow_empty)) {
        char path[DEC_PATH_MAX];
        dec_path(f, name, path, sizeof(path));
        return kp_fail(err, f->code, "%s: %u entries, expected %u..%u", path, size,
                       allow_empty ? 0 : 1, max);
    }
    *arr = o->via.array.ptr;
    *n = size;
    return KP_OK;
}

int dec_timings(const dec_fields *f, uint64_t *queue_us, uint64_t *run_us, bool *timed,
                uint64_t *device_us, uint64_t *kernel_us, kp_error *err)
{
    int rc;
    bool has_kernel; /* optional, as device_us (present: not required) */
    if ((rc = dec_u64(f, "queue_us", 0, UINT64_MAX, queue_us, NULL, err)) ||
        (rc = dec_u64(f, "run_us", 0, UINT64_MAX, run_us, NULL, err)) ||
        (rc = dec_u64(f, "device_us", 0, UINT64_MAX, device_us, timed, err)) ||
        (rc = dec_u64(f, "kernel_us", 0, UINT64_MAX, kernel_us, &has_kernel, err)))
        return rc;
    return KP_OK;
}

int dec_map(const dec_fields *f, const char *name, const msgpack_object **out, bool *present,
            kp_error *err)
{
    const msgpack_object *o;
    int rc = lookup(f, name, present, &o, err);
    if (rc <= 0)
        return rc;
    if (o->type != MSGPACK_OBJECT_MAP)
        return wrong_type(f, name, "a map", o, err);
    *out = o;
    return KP_OK;
}

typedef struct handle_at {
    uint64_t handle;
    uint32_t index;
} handle_at;

static int handle_cmp(const void *a, const void *b)
{
    const handle_at *x = a, *y = b;
    if (x->handle != y->handle)
        return x->handle < y->handle ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

int dec_handles(const dec_fields *f, const char *name, uint32_t max, kp_slot_list *out,
                bool *present, kp_error *err)
{
    const msgpack_object *arr;
    uint32_t n;
    int rc = dec_array(f, name, max, false, &arr, &n, present, err);
    if (rc || (present && !*present))
        return rc;
    char path[DEC_PATH_MAX];
    dec_path(f, name, path, sizeof(path));
    uint64_t *slots = dec_alloc(f->msg, n, sizeof(*slots), err);
    handle_at *sorted = dec_alloc(f->msg, n, sizeof(*sorted), err);
    if (!slots || !sorted)
        return err ? err->code : KP_E_NO_MEMORY;
    for (uint32_t i = 0; i < n; i++) {
        if (arr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return kp_fail(err, f->code, "%s[%u]: expected an unsigned integer (slot handle), "
                           "got %s", path, i, type_name(&arr[i]));
        slots[i] = arr[i].via.u64;
        sorted[i] = (handle_at){slots[i], i};
    }
    qsort(sorted, n, sizeof(*sorted), handle_cmp);
    for (uint32_t i = 1; i < n; i++) {
        if (sorted[i].handle == sorted[i - 1].handle)
            return kp_fail(err, f->code, "%s[%u]: slot 0x%llx is already named by %s[%u]", path,
                           sorted[i].index, (unsigned long long)sorted[i].handle, path,
                           sorted[i - 1].index);
    }
    out->slots = slots;
    out->nslots = n;
    return KP_OK;
}
