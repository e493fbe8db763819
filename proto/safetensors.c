/*
 * safetensors.c - safetensors reader (st_parse/st_open) and writer (st_writer_*).
 *
 * The reader parses the JSON header with json-c and keeps the parsed tree for
 * the life of the st_file: tensor names and metadata strings point into it,
 * tensor data points into the caller's buffer or the file mapping.  Every
 * number in the header is checked before it is used, so hostile input yields
 * -1 and a message in err, never a crash, an out-of-bounds pointer or a huge
 * allocation (beyond what json-c needs for a header of at most
 * ST_MAX_HEADER_BYTES).
 *
 * The writer keeps references to the caller's tensors and lays them out the
 * way the golden files are laid out: widest dtype first, header padded with
 * spaces so that the data section starts at a multiple of 8.
 */
#define _GNU_SOURCE /* mkostemp */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <json-c/json.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define METADATA_KEY "__metadata__"
#define SHAPE_STR_MAX (ST_MAX_DIMS * 22 + 16) /* 8 x ", -9223372036854775808" + "[, ...]" */

struct st_meta_pair {
    const char *key, *value;
};

struct st_file {
    json_object *root;              /* owns every name and metadata string */
    st_tensor *tensors;             /* in header order */
    size_t ntensors;
    const st_tensor **by_name;      /* sorted by name, for st_get */
    struct st_meta_pair *meta;      /* in header order */
    size_t nmeta;
    void *map;                      /* st_open's mapping, or NULL */
    size_t maplen;
};

static const struct {
    const char *name;
    size_t size;
} dtypes[] = {
    [ST_BF16] = {"BF16", 2}, [ST_F16] = {"F16", 2}, [ST_F32] = {"F32", 4}, [ST_F64] = {"F64", 8},
    [ST_I8] = {"I8", 1},     [ST_U8] = {"U8", 1},   [ST_I16] = {"I16", 2}, [ST_I32] = {"I32", 4},
    [ST_I64] = {"I64", 8},   [ST_BOOL] = {"BOOL", 1},
};
#define NDTYPES (sizeof dtypes / sizeof dtypes[0])

/* Formats a message into err (if any) and returns -1. */
__attribute__((format(printf, 3, 4))) static int fail(char *err, size_t errlen, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

const char *st_dtype_name(st_dtype t)
{
    return (unsigned)t < NDTYPES ? dtypes[t].name : "?";
}

size_t st_dtype_size(st_dtype t)
{
    return (unsigned)t < NDTYPES ? dtypes[t].size : 0;
}

/* Renders a shape as "[2, 3]"; entries of -1 print as "*" when wildcards is set. */
static const char *shape_str(char buf[SHAPE_STR_MAX], const int64_t *shape, int ndim, int wildcards)
{
    size_t at = 0;
    buf[at++] = '[';
    for (int i = 0; i < ndim && i < ST_MAX_DIMS; i++) {
        int w = wildcards && shape[i] == -1
                    ? snprintf(buf + at, SHAPE_STR_MAX - at, "%s*", i ? ", " : "")
                    : snprintf(buf + at, SHAPE_STR_MAX - at, "%s%lld", i ? ", " : "", (long long)shape[i]);
        at += (size_t)w;
    }
    if (ndim > ST_MAX_DIMS)
        at += (size_t)snprintf(buf + at, SHAPE_STR_MAX - at, ", ...");
    snprintf(buf + at, SHAPE_STR_MAX - at, "]");
    return buf;
}

/* Number of bytes of a tensor; -1 if a dimension is negative or the size overflows 64 bits. */
static int shape_bytes(st_dtype dtype, int ndim, const int64_t *shape, uint64_t *bytes)
{
    uint64_t n = st_dtype_size(dtype);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0 || __builtin_mul_overflow(n, (uint64_t)shape[i], &n))
            return -1;
    *bytes = n;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Reader                                                                   */

/* Members of every object in the tree (json-c's view, after duplicate keys collapsed). */
static size_t count_members(json_object *o)
{
    size_t n = 0;
    if (json_object_is_type(o, json_type_object)) {
        json_object_object_foreach(o, k, v) {
            (void)k;
            n += 1 + count_members(v);
        }
    } else if (json_object_is_type(o, json_type_array)) {
        for (size_t i = 0; i < json_object_array_length(o); i++)
            n += count_members(json_object_array_get_idx(o, i));
    }
    return n;
}

/* Decodes the JSON string token s[0, n) (quotes included); NULL if it is not one. */
static json_object *decode_string(const char *s, size_t n)
{
    json_tokener *tok = json_tokener_new();
    if (!tok)
        return NULL;
    json_object *o = json_tokener_parse_ex(tok, s, (int)n);
    json_tokener_free(tok);
    if (o && !json_object_is_type(o, json_type_string)) {
        json_object_put(o);
        return NULL;
    }
    return o;
}

/*
 * Second pass over a header known to repeat a key: tracks the keys of each
 * open object and names the first repeat, with the tensor it belongs to.
 */
static int name_duplicate(const char *s, size_t n, char *err, size_t errlen)
{
    json_object *seen[JSON_TOKENER_DEFAULT_DEPTH + 1] = {0};   /* per open container; NULL for arrays */
    int depth = 0, rc = fail(err, errlen, "header has a duplicate key");
    size_t str_at = 0, str_end = 0, top_at = 0, top_end = 0;    /* last string token, last top-level key */
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '"') {
            str_at = i;
            for (i++; i < n && s[i] != '"'; i++)
                if (s[i] == '\\')
                    i++;
            str_end = i + 1;
        } else if (c == '{' || c == '[') {
            if (depth == JSON_TOKENER_DEFAULT_DEPTH + 1)
                break;
            seen[depth++] = c == '{' ? json_object_new_object() : NULL;
        } else if ((c == '}' || c == ']') && depth > 0) {
            json_object_put(seen[--depth]);
            seen[depth] = NULL;
        } else if (c == ':' && depth > 0 && seen[depth - 1]) {
            json_object *key = decode_string(s + str_at, str_end - str_at);
            if (!key)
                break;
            const char *k = json_object_get_string(key);
            if (json_object_object_get_ex(seen[depth - 1], k, NULL)) {
                json_object *top = depth > 1 ? decode_string(s + top_at, top_end - top_at) : NULL;
                const char *t = top ? json_object_get_string(top) : "?";
                if (depth == 1 && strcmp(k, METADATA_KEY) == 0)
                    rc = fail(err, errlen, "duplicate key '" METADATA_KEY "' in header");
                else if (depth == 1)
                    rc = fail(err, errlen, "duplicate tensor name '%s' in header", k);
                else if (depth == 2 && strcmp(t, METADATA_KEY) == 0)
                    rc = fail(err, errlen, "duplicate metadata key '%s' in header", k);
                else
                    rc = fail(err, errlen, "tensor '%s': duplicate key '%s' in header", t, k);
                json_object_put(top);
                json_object_put(key);
                break;
            }
            json_object_object_add(seen[depth - 1], k, NULL);
            json_object_put(key);
            if (depth == 1) {
                top_at = str_at;
                top_end = str_end;
            }
        }
    }
    while (depth > 0)
        json_object_put(seen[--depth]);
    return rc;
}

/*
 * json-c silently keeps the last of duplicate keys, so duplicates are found
 * lexically: in JSON that json-c accepted, every ':' outside a string ends one
 * object member's key, and there must be as many as json-c kept.
 */
static int check_duplicate_keys(const char *s, size_t n, json_object *root, char *err, size_t errlen)
{
    size_t colons = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '"') {
            for (i++; i < n && s[i] != '"'; i++)
                if (s[i] == '\\')
                    i++;
        } else if (s[i] == '\'') {   /* json-c accepts 'strings' even in strict mode; JSON does not */
            return fail(err, errlen, "header is not valid JSON: single-quoted string at byte %zu", i);
        } else if (s[i] == ':') {
            colons++;
        }
    }
    return colons == count_members(root) ? 0 : name_duplicate(s, n, err, errlen);
}

/* Reads a non-negative JSON integer; what names it in messages (e.g. "shape[1]"). */
static int get_u64(json_object *v, const char *tensor, const char *what, uint64_t *out, char *err,
                   size_t errlen)
{
    if (!json_object_is_type(v, json_type_int))
        return fail(err, errlen, "tensor '%s': %s is %s, not an integer", tensor, what,
                    json_type_to_name(json_object_get_type(v)));
    int64_t s = json_object_get_int64(v);
    if (s < 0)
        return fail(err, errlen, "tensor '%s': %s is negative (%lld)", tensor, what, (long long)s);
    *out = json_object_get_uint64(v);
    return 0;
}

/* Checks one header entry against the data section and fills t; *begin gets its offset. */
static int parse_tensor(const char *name, json_object *entry, const unsigned char *data, size_t datalen,
                        st_tensor *t, uint64_t *begin, char *err, size_t errlen)
{
    char sbuf[SHAPE_STR_MAX], what[32];
    json_object *dtype = NULL, *shape = NULL, *offsets = NULL;

    t->name = name;
    if (!json_object_is_type(entry, json_type_object))
        return fail(err, errlen, "tensor '%s': entry is %s, not an object", name,
                    json_type_to_name(json_object_get_type(entry)));
    json_object_object_foreach(entry, field, v) {
        if (strcmp(field, "dtype") == 0)
            dtype = v;
        else if (strcmp(field, "shape") == 0)
            shape = v;
        else if (strcmp(field, "data_offsets") == 0)
            offsets = v;
        else
            return fail(err, errlen, "tensor '%s': unexpected field '%s'", name, field);
    }
    if (!dtype || !shape || !offsets)
        return fail(err, errlen, "tensor '%s': missing field '%s'", name,
                    !dtype ? "dtype" : !shape ? "shape" : "data_offsets");

    if (!json_object_is_type(dtype, json_type_string))
        return fail(err, errlen, "tensor '%s': dtype is %s, not a string", name,
                    json_type_to_name(json_object_get_type(dtype)));
    const char *dname = json_object_get_string(dtype);
    size_t d = 0;
    while (d < NDTYPES && (strcmp(dname, dtypes[d].name) != 0 ||
                           (size_t)json_object_get_string_len(dtype) != strlen(dname)))
        d++;
    if (d == NDTYPES)
        return fail(err, errlen, "tensor '%s': unknown dtype '%s'", name, dname);
    t->dtype = (st_dtype)d;

    if (!json_object_is_type(shape, json_type_array))
        return fail(err, errlen, "tensor '%s': shape is %s, not an array", name,
                    json_type_to_name(json_object_get_type(shape)));
    size_t ndim = json_object_array_length(shape);
    if (ndim > ST_MAX_DIMS)
        return fail(err, errlen, "tensor '%s': shape has %zu dims, more than %d", name, ndim, ST_MAX_DIMS);
    t->ndim = (int)ndim;
    for (size_t i = 0; i < ndim; i++) {
        uint64_t dim;
        snprintf(what, sizeof what, "shape[%zu]", i);
        if (get_u64(json_object_array_get_idx(shape, i), name, what, &dim, err, errlen) != 0)
            return -1;
        if (dim > INT64_MAX)
            return fail(err, errlen, "tensor '%s': shape[%zu] = %llu overflows int64", name, i,
                        (unsigned long long)dim);
        t->shape[i] = (int64_t)dim;
    }
    uint64_t bytes;
    if (shape_bytes(t->dtype, t->ndim, t->shape, &bytes) != 0)
        return fail(err, errlen, "tensor '%s': %s shape %s overflows 64 bits of bytes", name, dname,
                    shape_str(sbuf, t->shape, t->ndim, 0));

    uint64_t b, e;
    if (!json_object_is_type(offsets, json_type_array) || json_object_array_length(offsets) != 2)
        return fail(err, errlen, "tensor '%s': data_offsets is not a [begin, end] pair", name);
    if (get_u64(json_object_array_get_idx(offsets, 0), name, "data_offsets[0]", &b, err, errlen) != 0 ||
        get_u64(json_object_array_get_idx(offsets, 1), name, "data_offsets[1]", &e, err, errlen) != 0)
        return -1;
    if (b > e)
        return fail(err, errlen, "tensor '%s': data_offsets [%llu, %llu) begin after they end", name,
                    (unsigned long long)b, (unsigned long long)e);
    if (e > datalen)
        return fail(err, errlen, "tensor '%s': data_offsets [%llu, %llu) exceed the %zu-byte data section",
                    name, (unsigned long long)b, (unsigned long long)e, datalen);
    if (e - b != bytes)
        return fail(err, errlen, "tensor '%s': data_offsets [%llu, %llu) hold %llu bytes, but %s %s needs %llu",
                    name, (unsigned long long)b, (unsigned long long)e, (unsigned long long)(e - b), dname,
                    shape_str(sbuf, t->shape, t->ndim, 0), (unsigned long long)bytes);
    t->data = data + b;
    t->nbytes = (size_t)bytes;
    *begin = b;
    return 0;
}

static int parse_metadata(st_file *f, json_object *meta, char *err, size_t errlen)
{
    if (!json_object_is_type(meta, json_type_object))
        return fail(err, errlen, METADATA_KEY " is %s, not an object",
                    json_type_to_name(json_object_get_type(meta)));
    f->meta = calloc((size_t)json_object_object_length(meta) + 1, sizeof *f->meta);
    if (!f->meta)
        return fail(err, errlen, "out of memory");
    json_object_object_foreach(meta, key, v) {
        if (!json_object_is_type(v, json_type_string))
            return fail(err, errlen, "metadata '%s' is %s, not a string", key,
                        json_type_to_name(json_object_get_type(v)));
        f->meta[f->nmeta].key = key;
        f->meta[f->nmeta++].value = json_object_get_string(v);
    }
    return 0;
}

struct range {
    uint64_t begin, end;
    size_t idx;
};

static int cmp_range(const void *a, const void *b)
{
    const struct range *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

static int cmp_by_name(const void *a, const void *b)
{
    return strcmp((*(const st_tensor *const *)a)->name, (*(const st_tensor *const *)b)->name);
}

/* Rejects two non-empty tensors sharing a byte (ranges[] is sorted in place). */
static int check_overlaps(const st_file *f, struct range *r, size_t n, char *err, size_t errlen)
{
    qsort(r, n, sizeof *r, cmp_range);
    const struct range *widest = NULL;   /* the earlier non-empty range reaching furthest */
    for (size_t i = 0; i < n; i++) {
        if (r[i].begin == r[i].end)
            continue;
        if (widest && r[i].begin < widest->end)
            return fail(err, errlen, "tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap",
                        f->tensors[widest->idx].name, (unsigned long long)widest->begin,
                        (unsigned long long)widest->end, f->tensors[r[i].idx].name,
                        (unsigned long long)r[i].begin, (unsigned long long)r[i].end);
        if (!widest || r[i].end > widest->end)
            widest = &r[i];
    }
    return 0;
}

/* Parses and checks the n-byte header hdr; the data section follows it. */
static int parse_header(st_file *f, const char *hdr, size_t n, size_t datalen, char *err, size_t errlen)
{
    const unsigned char *data = (const unsigned char *)hdr + n;
    json_tokener *tok = json_tokener_new();
    if (!tok)
        return fail(err, errlen, "out of memory");
    json_tokener_set_flags(tok, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
    f->root = json_tokener_parse_ex(tok, hdr, (int)n);   /* n <= ST_MAX_HEADER_BYTES < INT_MAX */
    enum json_tokener_error jerr = json_tokener_get_error(tok);
    size_t end = json_tokener_get_parse_end(tok);
    if (jerr == json_tokener_continue) {   /* json-c waits for more input: tell it there is none */
        f->root = json_tokener_parse_ex(tok, "", 1);
        jerr = json_tokener_get_error(tok);
        end = n;
    }
    json_tokener_free(tok);
    if (jerr != json_tokener_success)
        return fail(err, errlen, "header is not valid JSON: %s at byte %zu", json_tokener_error_desc(jerr), end);
    if (end != n)
        return fail(err, errlen, "header is not valid JSON: unexpected byte 0x%02x at byte %zu of %zu",
                    (unsigned char)hdr[end], end, n);
    if (!json_object_is_type(f->root, json_type_object))
        return fail(err, errlen, "header is a JSON %s, not an object",
                    json_type_to_name(json_object_get_type(f->root)));
    if (check_duplicate_keys(hdr, n, f->root, err, errlen) != 0)
        return -1;

    size_t nkeys = (size_t)json_object_object_length(f->root);
    f->tensors = calloc(nkeys + 1, sizeof *f->tensors);
    struct range *ranges = calloc(nkeys + 1, sizeof *ranges);
    if (!f->tensors || !ranges) {
        free(ranges);
        return fail(err, errlen, "out of memory");
    }
    int rc = 0;
    json_object_object_foreach(f->root, name, v) {
        if (strcmp(name, METADATA_KEY) == 0) {
            rc = parse_metadata(f, v, err, errlen);
        } else {
            size_t i = f->ntensors++;
            ranges[i].idx = i;
            rc = parse_tensor(name, v, data, datalen, &f->tensors[i], &ranges[i].begin, err, errlen);
            ranges[i].end = ranges[i].begin + f->tensors[i].nbytes;
        }
        if (rc != 0)
            break;
    }
    if (rc == 0)
        rc = check_overlaps(f, ranges, f->ntensors, err, errlen);
    free(ranges);
    if (rc != 0)
        return -1;

    f->by_name = malloc((f->ntensors + 1) * sizeof *f->by_name);
    if (!f->by_name)
        return fail(err, errlen, "out of memory");
    for (size_t i = 0; i < f->ntensors; i++)
        f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, f->ntensors, sizeof *f->by_name, cmp_by_name);
    return 0;
}

int st_parse(const void *buf, size_t len, st_file **out, char *err, size_t errlen)
{
    const unsigned char *p = buf;
    *out = NULL;
    if (len == 0)
        return fail(err, errlen, "empty file");
    if (len < 8)
        return fail(err, errlen, "file is %zu bytes, too short for the 8-byte header length", len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | p[i];
    if (n > ST_MAX_HEADER_BYTES)
        return fail(err, errlen, "header length %llu exceeds the %u-byte limit", (unsigned long long)n,
                    ST_MAX_HEADER_BYTES);
    if (n > len - 8)
        return fail(err, errlen, "header length %llu exceeds the %zu bytes after the length field",
                    (unsigned long long)n, len - 8);

    st_file *f = calloc(1, sizeof *f);
    if (!f)
        return fail(err, errlen, "out of memory");
    if (parse_header(f, (const char *)p + 8, (size_t)n, len - 8 - (size_t)n, err, errlen) != 0) {
        st_close(f);
        return -1;
    }
    *out = f;
    return 0;
}

int st_open(const char *path, st_file **out, char *err, size_t errlen)
{
    struct stat sb;
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return fail(err, errlen, "%s: %s", path, strerror(errno));
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return fail(err, errlen, "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return fail(err, errlen, "%s: not a regular file", path);
    }
    if (sb.st_size < 8) {
        close(fd);
        if (sb.st_size == 0)
            return fail(err, errlen, "%s: empty file", path);
        return fail(err, errlen, "%s: file is %lld bytes, too short for the 8-byte header length", path,
                    (long long)sb.st_size);
    }
    size_t len = (size_t)sb.st_size;
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED)
        return fail(err, errlen, "%s: mmap: %s", path, strerror(e));

    char msg[ST_ERRMSG_MAX];
    if (st_parse(map, len, out, msg, sizeof msg) != 0) {
        munmap(map, len);
        return fail(err, errlen, "%s: %s", path, msg);
    }
    (*out)->map = map;
    (*out)->maplen = len;
    return 0;
}

void st_close(st_file *f)
{
    if (!f)
        return;
    if (f->map)
        munmap(f->map, f->maplen);
    json_object_put(f->root);
    free(f->tensors);
    free(f->by_name);
    free(f->meta);
    free(f);
}

size_t st_count(const st_file *f)
{
    return f->ntensors;
}

const st_tensor *st_at(const st_file *f, size_t i)
{
    return i < f->ntensors ? &f->tensors[i] : NULL;
}

const st_tensor *st_get(const st_file *f, const char *name)
{
    st_tensor key = {.name = name};
    const st_tensor *kp = &key;
    const st_tensor **hit = bsearch(&kp, f->by_name, f->ntensors, sizeof *f->by_name, cmp_by_name);
    return hit ? *hit : NULL;
}

const char *st_meta(const st_file *f, const char *key)
{
    for (size_t i = 0; i < f->nmeta; i++)
        if (strcmp(f->meta[i].key, key) == 0)
            return f->meta[i].value;
    return NULL;
}

size_t st_meta_count(const st_file *f)
{
    return f->nmeta;
}

/* The i-th metadata pair in header order; -1 if i is out of range. */
int st_meta_at(const st_file *f, size_t i, const char **key, const char **value)
{
    if (i >= f->nmeta)
        return -1;
    *key = f->meta[i].key;
    *value = f->meta[i].value;
    return 0;
}

const st_tensor *st_expect(const st_file *f, const char *name, st_dtype dtype, int ndim,
                           const int64_t *want_shape, char *err, size_t errlen)
{
    char have[SHAPE_STR_MAX], want[SHAPE_STR_MAX];
    const st_tensor *t = st_get(f, name);
    if (!t) {
        fail(err, errlen, "tensor '%s' not found", name);
        return NULL;
    }
    if (t->dtype != dtype) {
        fail(err, errlen, "tensor '%s' is %s, expected %s", name, st_dtype_name(t->dtype), st_dtype_name(dtype));
        return NULL;
    }
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        ok = want_shape[i] == -1 || want_shape[i] == t->shape[i];
    if (!ok) {
        fail(err, errlen, "tensor '%s' has shape %s (%d dims), expected %s (%d dims)", name,
             shape_str(have, t->shape, t->ndim, 0), t->ndim, shape_str(want, want_shape, ndim, 1), ndim);
        return NULL;
    }
    return t;
}

/* ------------------------------------------------------------------------ */
/* Writer                                                                   */

struct wtensor {
    char *name;
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data;
    size_t nbytes;
    size_t offset;      /* in the data section; set by layout() */
};

struct st_writer {
    struct wtensor *t;
    size_t nt, capt;
    size_t *order;      /* indices into t in data order; set by assign_offsets() */
    char **meta;        /* key, value, key, value, ... */
    size_t nmeta, capmeta;
    char err[ST_ERRMSG_MAX];   /* the first failed add/meta; write and serialize then fail with it */
};

/* Strict UTF-8 (no overlongs, surrogates or code points above U+10FFFF). */
static int utf8_valid(const char *str)
{
    const unsigned char *s = (const unsigned char *)str;
    while (*s) {
        unsigned c = *s++, lo = 0x80, hi = 0xbf;   /* allowed range of the first continuation byte */
        int more;
        if (c < 0x80) {
            continue;
        } else if (c >= 0xc2 && c <= 0xdf) {
            more = 1;
        } else if (c >= 0xe0 && c <= 0xef) {
            more = 2;
            lo = c == 0xe0 ? 0xa0 : 0x80;   /* overlong */
            hi = c == 0xed ? 0x9f : 0xbf;   /* surrogates */
        } else if (c >= 0xf0 && c <= 0xf4) {
            more = 3;
            lo = c == 0xf0 ? 0x90 : 0x80;   /* overlong */
            hi = c == 0xf4 ? 0x8f : 0xbf;   /* above U+10FFFF */
        } else {
            return 0;
        }
        if (*s < lo || *s > hi)
            return 0;
        for (s++; --more > 0; s++)
            if (*s < 0x80 || *s > 0xbf)
                return 0;
    }
    return 1;
}

/* Records an add/meta failure (the first one sticks) and returns -1 with errno set. */
__attribute__((format(printf, 3, 4))) static int writer_fail(st_writer *w, int errnum, const char *fmt, ...)
{
    if (!w->err[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(w->err, sizeof w->err, fmt, ap);
        va_end(ap);
    }
    errno = errnum;
    return -1;
}

st_writer *st_writer_new(void)
{
    return calloc(1, sizeof(st_writer));
}

void st_writer_free(st_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->nt; i++)
        free(w->t[i].name);
    for (size_t i = 0; i < 2 * w->nmeta; i++)
        free(w->meta[i]);
    free(w->t);
    free(w->order);
    free(w->meta);
    free(w);
}

/* Fails (errno EINVAL/EEXIST/ENOMEM) on a bad name, dtype or shape; see writer_fail. */
int st_writer_add(st_writer *w, const char *name, st_dtype dtype, int ndim, const int64_t *shape,
                  const void *data)
{
    char sbuf[SHAPE_STR_MAX];
    uint64_t bytes;
    if (!name || !name[0])
        return writer_fail(w, EINVAL, "tensor name is empty");
    if (strcmp(name, METADATA_KEY) == 0 || !utf8_valid(name))
        return writer_fail(w, EINVAL, "'%s' is not a valid tensor name", name);
    for (size_t i = 0; i < w->nt; i++)
        if (strcmp(w->t[i].name, name) == 0)
            return writer_fail(w, EEXIST, "duplicate tensor name '%s'", name);
    if ((unsigned)dtype >= NDTYPES)
        return writer_fail(w, EINVAL, "tensor '%s': invalid dtype %d", name, (int)dtype);
    if (ndim < 0 || ndim > ST_MAX_DIMS)
        return writer_fail(w, EINVAL, "tensor '%s': ndim %d is not in 0..%d", name, ndim, ST_MAX_DIMS);
    if (ndim > 0 && !shape)
        return writer_fail(w, EINVAL, "tensor '%s': shape is NULL", name);
    if (shape_bytes(dtype, ndim, shape, &bytes) != 0 || bytes > SIZE_MAX)
        return writer_fail(w, EINVAL, "tensor '%s': shape %s is negative or overflows", name,
                           shape_str(sbuf, shape, ndim, 0));
    if (bytes > 0 && !data)
        return writer_fail(w, EINVAL, "tensor '%s': data is NULL", name);
    if (w->nt == w->capt) {
        size_t cap = w->capt ? 2 * w->capt : 16;
        struct wtensor *t = realloc(w->t, cap * sizeof *t);
        if (!t)
            return writer_fail(w, ENOMEM, "out of memory");
        w->t = t;
        w->capt = cap;
    }
    struct wtensor *t = &w->t[w->nt];
    *t = (struct wtensor){.dtype = dtype, .ndim = ndim, .data = data, .nbytes = (size_t)bytes};
    if (ndim > 0)
        memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    if (!(t->name = strdup(name)))
        return writer_fail(w, ENOMEM, "out of memory");
    w->nt++;
    return 0;
}

/* Fails (errno EINVAL/EEXIST/ENOMEM) on a NULL, non-UTF-8 or repeated key; see writer_fail. */
int st_writer_meta(st_writer *w, const char *key, const char *value)
{
    if (!key || !value || !utf8_valid(key) || !utf8_valid(value))
        return writer_fail(w, EINVAL, "metadata '%s': key and value must be UTF-8 strings", key ? key : "(null)");
    for (size_t i = 0; i < w->nmeta; i++)
        if (strcmp(w->meta[2 * i], key) == 0)
            return writer_fail(w, EEXIST, "duplicate metadata key '%s'", key);
    if (w->nmeta == w->capmeta) {
        size_t cap = w->capmeta ? 2 * w->capmeta : 8;
        char **m = realloc(w->meta, 2 * cap * sizeof *m);
        if (!m)
            return writer_fail(w, ENOMEM, "out of memory");
        w->meta = m;
        w->capmeta = cap;
    }
    char *k = strdup(key), *v = strdup(value);
    if (!k || !v) {
        free(k);
        free(v);
        return writer_fail(w, ENOMEM, "out of memory");
    }
    w->meta[2 * w->nmeta] = k;
    w->meta[2 * w->nmeta + 1] = v;
    w->nmeta++;
    return 0;
}

/* json_object_object_add that takes ownership of val even on failure; -1 if val is NULL. */
static int put(json_object *obj, const char *key, json_object *val)
{
    if (!val)
        return -1;
    if (json_object_object_add(obj, key, val) != 0) {
        json_object_put(val);
        return -1;
    }
    return 0;
}

static int push(json_object *arr, json_object *val)
{
    if (!val)
        return -1;
    if (json_object_array_add(arr, val) != 0) {
        json_object_put(val);
        return -1;
    }
    return 0;
}

/* One tensor's header entry, or NULL when out of memory. */
static json_object *tensor_entry(const struct wtensor *t)
{
    json_object *e = json_object_new_object(), *shape = json_object_new_array(),
                *offs = json_object_new_array();
    int rc = e && shape && offs ? 0 : -1;
    for (int i = 0; rc == 0 && i < t->ndim; i++)
        rc = push(shape, json_object_new_int64(t->shape[i]));
    if (rc == 0)
        rc = push(offs, json_object_new_uint64(t->offset)) | push(offs, json_object_new_uint64(t->offset + t->nbytes));
    if (rc == 0)
        rc = put(e, "dtype", json_object_new_string(st_dtype_name(t->dtype)));
    if (rc == 0) {
        rc = put(e, "shape", shape);
        shape = NULL;
    }
    if (rc == 0) {
        rc = put(e, "data_offsets", offs);
        offs = NULL;
    }
    json_object_put(shape);
    json_object_put(offs);
    if (rc != 0) {
        json_object_put(e);
        return NULL;
    }
    return e;
}

/*
 * Assigns data offsets widest dtype first (add order within a width; every
 * tensor then starts at a multiple of its element size) into w->t[].offset
 * and the tensors' data order into w->order; *datalen gets the total.
 */
static int assign_offsets(st_writer *w, size_t *datalen, char *err, size_t errlen)
{
    size_t *order = realloc(w->order, (w->nt + 1) * sizeof *order);
    if (!order)
        return fail(err, errlen, "out of memory");
    w->order = order;
    size_t off = 0, k = 0;
    for (size_t width = 8; width > 0; width /= 2)
        for (size_t i = 0; i < w->nt; i++)
            if (st_dtype_size(w->t[i].dtype) == width) {
                w->t[i].offset = off;
                if (__builtin_add_overflow(off, w->t[i].nbytes, &off))
                    return fail(err, errlen, "tensors total more than SIZE_MAX bytes");
                order[k++] = i;
            }
    *datalen = off;
    return 0;
}

/*
 * Lays the tensors out (assign_offsets) and renders the length field plus the
 * JSON header, space-padded to a multiple of 8, into *hdr (malloc'd, *hdrlen
 * bytes).  Fails with the first add/meta error if there was one.
 */
static int layout(st_writer *w, unsigned char **hdr, size_t *hdrlen, size_t *datalen, char *err, size_t errlen)
{
    if (w->err[0])
        return fail(err, errlen, "%s", w->err);
    if (assign_offsets(w, datalen, err, errlen) != 0)
        return -1;

    json_object *root = json_object_new_object(), *meta = NULL;
    int rc = root ? 0 : -1;
    if (rc == 0 && w->nmeta > 0) {
        meta = json_object_new_object();
        for (size_t i = 0; meta && rc == 0 && i < w->nmeta; i++)
            rc = put(meta, w->meta[2 * i], json_object_new_string(w->meta[2 * i + 1]));
        if (rc == 0)
            rc = put(root, METADATA_KEY, meta);
        else
            json_object_put(meta);
    }
    for (size_t i = 0; rc == 0 && i < w->nt; i++)
        rc = put(root, w->t[i].name, tensor_entry(&w->t[i]));
    size_t jlen = 0;
    const char *js = rc == 0 ? json_object_to_json_string_length(
                                   root, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE, &jlen)
                             : NULL;
    if (!js) {
        json_object_put(root);
        return fail(err, errlen, "out of memory");
    }
    size_t padded = (jlen + 7) & ~(size_t)7;
    if (padded > ST_MAX_HEADER_BYTES) {
        json_object_put(root);
        return fail(err, errlen, "header of %zu bytes exceeds the %u-byte limit", padded, ST_MAX_HEADER_BYTES);
    }
    *hdrlen = 8 + padded;
    *hdr = malloc(*hdrlen);
    if (!*hdr) {
        json_object_put(root);
        return fail(err, errlen, "out of memory");
    }
    for (int i = 0; i < 8; i++)
        (*hdr)[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    memcpy(*hdr + 8, js, jlen);
    memset(*hdr + 8 + jlen, ' ', padded - jlen);
    json_object_put(root);
    return 0;
}

int st_writer_serialize(st_writer *w, void **buf, size_t *len, char *err, size_t errlen)
{
    unsigned char *hdr, *out;
    size_t hdrlen, datalen, total;
    *buf = NULL;
    *len = 0;
    if (layout(w, &hdr, &hdrlen, &datalen, err, errlen) != 0)
        return -1;
    if (__builtin_add_overflow(hdrlen, datalen, &total) || !(out = malloc(total))) {
        free(hdr);
        return fail(err, errlen, "out of memory for a file of %zu + %zu bytes", hdrlen, datalen);
    }
    memcpy(out, hdr, hdrlen);
    for (size_t i = 0; i < w->nt; i++)
        if (w->t[i].nbytes)
            memcpy(out + hdrlen + w->t[i].offset, w->t[i].data, w->t[i].nbytes);
    free(hdr);
    *buf = out;
    *len = total;
    return 0;
}

/* write(2) until all n bytes are out. */
static int write_all(int fd, const void *p, size_t n)
{
    const unsigned char *c = p;
    while (n > 0) {
        ssize_t k = write(fd, c, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            if (k == 0)
                errno = EIO;
            return -1;
        }
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Writes header and data to the new file fd, then fixes its mode, fsyncs and closes it. */
static int fill_file(st_writer *w, int fd, const char *tmp, const unsigned char *hdr, size_t hdrlen, char *err,
                     size_t errlen)
{
    const char *step = "write";
    int ok = write_all(fd, hdr, hdrlen) == 0;
    for (size_t i = 0; ok && i < w->nt; i++)
        ok = write_all(fd, w->t[w->order[i]].data, w->t[w->order[i]].nbytes) == 0;
    /* mkstemp creates 0600; use the usual 0644 (reading the umask is not thread-safe) */
    if (ok && !(ok = fchmod(fd, 0644) == 0))
        step = "fchmod";
    if (ok && !(ok = fsync(fd) == 0))
        step = "fsync";
    int e = errno;
    if (close(fd) != 0 && ok) {
        ok = 0;
        step = "close";
        e = errno;
    }
    return ok ? 0 : fail(err, errlen, "%s: %s: %s", tmp, step, strerror(e));
}

/* Best-effort fsync of the directory holding path, so that the rename is durable. */
static void sync_parent_dir(const char *path)
{
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
    if (!dir)
        return;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
    free(dir);
}

int st_writer_write(st_writer *w, const char *path, char *err, size_t errlen)
{
    static const char suffix[] = ".tmp.XXXXXX";
    unsigned char *hdr;
    size_t hdrlen, datalen, plen = strlen(path);
    if (layout(w, &hdr, &hdrlen, &datalen, err, errlen) != 0)
        return -1;
    char *tmp = malloc(plen + sizeof suffix);
    int rc = tmp ? 0 : fail(err, errlen, "out of memory");
    if (rc == 0) {
        memcpy(tmp, path, plen);
        memcpy(tmp + plen, suffix, sizeof suffix);
        int fd = mkostemp(tmp, O_CLOEXEC);
        if (fd < 0)
            rc = fail(err, errlen, "%s: %s", tmp, strerror(errno));
        else if ((rc = fill_file(w, fd, tmp, hdr, hdrlen, err, errlen)) == 0 && rename(tmp, path) != 0)
            rc = fail(err, errlen, "rename %s to %s: %s", tmp, path, strerror(errno));
        if (fd >= 0 && rc != 0)
            unlink(tmp);
    }
    if (rc == 0)
        sync_parent_dir(path);
    free(tmp);
    free(hdr);
    return rc;
}
