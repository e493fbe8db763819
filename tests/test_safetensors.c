/*
 * test_safetensors.c - cmocka tests for proto/safetensors.c: writer/reader
 * round trips (in memory and through a file), st_expect, hostile headers
 * (each error must name what is wrong), every truncation of a valid file,
 * random mutations, and the golden-vector files in KDAD_GOLDEN_DIR.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "safetensors.h"

#ifndef KDAD_GOLDEN_DIR
#error "KDAD_GOLDEN_DIR must name the golden-vector folder"
#endif

/* Fails the test unless the error text contains needle. */
#define assert_mentions(err, needle)                                                            \
    do {                                                                                         \
        if (!strstr((err), (needle)))                                                            \
            fail_msg("error \"%s\" does not mention \"%s\"", (err), (needle));                   \
    } while (0)

static uint64_t read_le64(const unsigned char *p)
{
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | p[i];
    return n;
}

static void write_le64(unsigned char *p, uint64_t n)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(n >> (8 * i));
}

/* A file of exactly the right size (so ASan sees any over-read): length field, json, datalen zero bytes. */
static unsigned char *make_file(const char *json, size_t datalen, size_t *len)
{
    size_t n = strlen(json);
    *len = 8 + n + datalen;
    unsigned char *buf = calloc(1, *len);
    assert_non_null(buf);
    write_le64(buf, n);
    memcpy(buf + 8, json, n);
    return buf;
}

/* Parses json + datalen zero bytes and asserts that it fails with an error mentioning needle. */
static void expect_reject(const char *json, size_t datalen, const char *needle)
{
    size_t len;
    unsigned char *buf = make_file(json, datalen, &len);
    char err[ST_ERRMSG_MAX] = "";
    st_file *f = (st_file *)buf;   /* must be reset to NULL */
    if (st_parse(buf, len, &f, err, sizeof err) == 0)
        fail_msg("header accepted, expected an error about \"%s\": %s", needle, json);
    assert_null(f);
    assert_mentions(err, needle);
    free(buf);
}

/* Parses json + datalen zero bytes and asserts that it is accepted. */
static st_file *expect_accept(const char *json, size_t datalen, unsigned char **buf)
{
    size_t len;
    char err[ST_ERRMSG_MAX] = "";
    st_file *f = NULL;
    *buf = make_file(json, datalen, &len);
    if (st_parse(*buf, len, &f, err, sizeof err) != 0)
        fail_msg("header rejected: %s: %s", err, json);
    return f;
}

/* Serialises w (which must succeed) and parses the result back. */
static st_file *serialize_and_parse(st_writer *w, void **buf, size_t *len)
{
    char err[ST_ERRMSG_MAX] = "";
    st_file *f = NULL;
    if (st_writer_serialize(w, buf, len, err, sizeof err) != 0)
        fail_msg("serialize: %s", err);
    if (st_parse(*buf, *len, &f, err, sizeof err) != 0)
        fail_msg("parse of serialized file: %s", err);
    return f;
}

/* Offset of t's data in the data section of the file in buf. */
static size_t data_offset(const void *buf, const st_tensor *t)
{
    const unsigned char *b = buf;
    return (size_t)((const unsigned char *)t->data - (b + 8 + read_le64(b)));
}

static void test_dtype_names_and_sizes(void **state)
{
    static const struct {
        st_dtype t;
        const char *name;
        size_t size;
    } want[] = {
        {ST_BF16, "BF16", 2}, {ST_F16, "F16", 2}, {ST_F32, "F32", 4}, {ST_F64, "F64", 8}, {ST_I8, "I8", 1},
        {ST_U8, "U8", 1},     {ST_I16, "I16", 2}, {ST_I32, "I32", 4}, {ST_I64, "I64", 8}, {ST_BOOL, "BOOL", 1},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        assert_string_equal(st_dtype_name(want[i].t), want[i].name);
        assert_int_equal(st_dtype_size(want[i].t), want[i].size);
    }
    assert_string_equal(st_dtype_name((st_dtype)99), "?");
    assert_int_equal(st_dtype_size((st_dtype)99), 0);
    st_close(NULL);
    st_writer_free(NULL);
}

/* BF16 [2,3,4], F32 [3], I64 [5], BF16 [3] + two metadata keys, added in that order. */
struct sample {
    uint16_t q[24];
    float scale[3];
    int64_t idx[5];
    uint16_t k[3];
};

static st_writer *sample_writer(struct sample *s)
{
    for (int i = 0; i < 24; i++)
        s->q[i] = (uint16_t)(0x3f80 + 7 * i);
    s->scale[0] = 0.5f, s->scale[1] = -1.25f, s->scale[2] = 3e38f;
    s->idx[0] = 0, s->idx[1] = -1, s->idx[2] = INT64_MAX, s->idx[3] = INT64_MIN, s->idx[4] = 42;
    s->k[0] = 1, s->k[1] = 0xffff, s->k[2] = 0x8000;
    static const int64_t qshape[] = {2, 3, 4}, sshape[] = {3}, ishape[] = {5}, kshape[] = {3};
    st_writer *w = st_writer_new();
    assert_non_null(w);
    assert_int_equal(st_writer_add(w, "q", ST_BF16, 3, qshape, s->q), 0);
    assert_int_equal(st_writer_add(w, "scale", ST_F32, 1, sshape, s->scale), 0);
    assert_int_equal(st_writer_add(w, "idx", ST_I64, 1, ishape, s->idx), 0);
    assert_int_equal(st_writer_add(w, "k", ST_BF16, 1, kshape, s->k), 0);
    assert_int_equal(st_writer_meta(w, "case", "round trip"), 0);
    assert_int_equal(st_writer_meta(w, "note", "caf\xc3\xa9 \"quoted\" a/b {\"x\": [1]}"), 0);
    return w;
}

static void test_roundtrip_in_memory(void **state)
{
    struct sample s;
    st_writer *w = sample_writer(&s);
    void *buf;
    size_t len;
    st_file *f = serialize_and_parse(w, &buf, &len);
    const unsigned char *b = buf;

    /* layout: header padded with spaces so the data section starts at a multiple of 8 */
    uint64_t n = read_le64(b);
    assert_int_equal((8 + n) % 8, 0);
    assert_int_equal(len, 8 + n + sizeof s.q + sizeof s.scale + sizeof s.idx + sizeof s.k);
    assert_memory_equal(b + 8, "{\"__metadata__\":{", 17);
    const unsigned char *p = b + 8 + n - 1;   /* the JSON ends in '}', then space padding */
    while (*p == ' ')
        p--;
    assert_int_equal(*p, '}');
    assert_true(b + 8 + n - 1 - p < 8);

    /* header order is add order */
    static const char *names[] = {"q", "scale", "idx", "k"};
    assert_int_equal(st_count(f), 4);
    for (size_t i = 0; i < 4; i++)
        assert_string_equal(st_at(f, i)->name, names[i]);
    assert_null(st_at(f, 4));

    /* data order is widest first, stable within a width: idx, scale, q, k */
    const st_tensor *q = st_get(f, "q"), *sc = st_get(f, "scale"), *idx = st_get(f, "idx"), *k = st_get(f, "k");
    assert_non_null(q);
    assert_non_null(sc);
    assert_non_null(idx);
    assert_non_null(k);
    assert_null(st_get(f, "nope"));
    assert_int_equal(data_offset(buf, idx), 0);
    assert_int_equal(data_offset(buf, sc), 40);
    assert_int_equal(data_offset(buf, q), 52);
    assert_int_equal(data_offset(buf, k), 100);
    assert_int_equal((uintptr_t)idx->data % 8, 0);   /* malloc'd buffer: 8-aligned section => aligned I64 */
    assert_int_equal((uintptr_t)sc->data % 4, 0);

    /* values and shapes */
    assert_int_equal(q->dtype, ST_BF16);
    assert_int_equal(q->ndim, 3);
    assert_int_equal(q->shape[0], 2);
    assert_int_equal(q->shape[1], 3);
    assert_int_equal(q->shape[2], 4);
    assert_int_equal(q->nbytes, sizeof s.q);
    assert_memory_equal(q->data, s.q, sizeof s.q);
    assert_int_equal(sc->dtype, ST_F32);
    assert_int_equal(sc->ndim, 1);
    assert_int_equal(sc->shape[0], 3);
    assert_memory_equal(sc->data, s.scale, sizeof s.scale);
    assert_int_equal(idx->dtype, ST_I64);
    assert_int_equal(idx->shape[0], 5);
    int64_t got[5];
    memcpy(got, idx->data, sizeof got);
    assert_true(got[1] == -1 && got[2] == INT64_MAX && got[3] == INT64_MIN && got[4] == 42);
    assert_memory_equal(k->data, s.k, sizeof s.k);

    /* metadata, in order */
    const char *key, *value;
    assert_int_equal(st_meta_count(f), 2);
    assert_int_equal(st_meta_at(f, 0, &key, &value), 0);
    assert_string_equal(key, "case");
    assert_string_equal(value, "round trip");
    assert_int_equal(st_meta_at(f, 1, &key, &value), 0);
    assert_string_equal(key, "note");
    assert_string_equal(value, "caf\xc3\xa9 \"quoted\" a/b {\"x\": [1]}");
    assert_int_equal(st_meta_at(f, 2, &key, &value), -1);
    assert_string_equal(st_meta(f, "case"), "round trip");
    assert_null(st_meta(f, "missing"));

    st_close(f);
    free(buf);
    st_writer_free(w);
}

static void test_roundtrip_all_dtypes_scalar_empty(void **state)
{
    /* every dtype, in an order that mixes widths; plus a scalar and a zero-size tensor */
    static const st_dtype order[] = {ST_U8, ST_BF16, ST_F64, ST_BOOL, ST_F32, ST_I16, ST_I64, ST_I8, ST_I32, ST_F16};
    /* 8-byte: t2 0, t6 24, scalar 48; 4-byte: t4 56, t8 68, empty 80; 2-byte: t1 80, t5 86, t9 92; 1-byte: t0 98, ... */
    static const size_t want_off[] = {98, 80, 0, 101, 56, 86, 24, 104, 68, 92};
    unsigned char data[10][24];
    char names[10][16];
    const int64_t shape3[] = {3}, none[1] = {0}, empty[] = {0, 5};
    st_writer *w = st_writer_new();
    for (int i = 0; i < 10; i++) {
        for (int j = 0; j < 24; j++)
            data[i][j] = (unsigned char)(16 * i + j);
        snprintf(names[i], sizeof names[i], "t%d", i);
        assert_int_equal(st_writer_add(w, names[i], order[i], 1, shape3, data[i]), 0);
    }
    double scalar = 2.5;
    assert_int_equal(st_writer_add(w, "scalar", ST_F64, 0, none, &scalar), 0);
    assert_int_equal(st_writer_add(w, "empty", ST_F32, 2, empty, NULL), 0);

    void *buf;
    size_t len;
    st_file *f = serialize_and_parse(w, &buf, &len);
    assert_int_equal(st_count(f), 12);
    assert_int_equal(st_meta_count(f), 0);
    for (int i = 0; i < 10; i++) {
        const st_tensor *t = st_at(f, (size_t)i);
        assert_string_equal(t->name, names[i]);
        assert_int_equal(t->dtype, order[i]);
        assert_int_equal(t->nbytes, 3 * st_dtype_size(order[i]));
        assert_memory_equal(t->data, data[i], t->nbytes);
        size_t off = data_offset(buf, t);
        if (off != want_off[i])
            fail_msg("%s (%s) at data offset %zu, want %zu", t->name, st_dtype_name(t->dtype), off, want_off[i]);
        assert_int_equal(off % st_dtype_size(order[i]), 0);
    }
    const st_tensor *s = st_get(f, "scalar");
    assert_int_equal(s->ndim, 0);
    assert_int_equal(s->nbytes, 8);
    assert_int_equal(data_offset(buf, s), 48);
    assert_memory_equal(s->data, &scalar, 8);
    assert_int_equal(len, 8 + read_le64(buf) + 107);
    const st_tensor *e = st_get(f, "empty");
    assert_int_equal(e->ndim, 2);
    assert_int_equal(e->shape[1], 5);
    assert_int_equal(e->nbytes, 0);
    st_close(f);
    free(buf);
    st_writer_free(w);

    /* no tensors, no metadata: "{}" padded to 8 bytes */
    w = st_writer_new();
    f = serialize_and_parse(w, &buf, &len);
    assert_int_equal(len, 16);
    assert_memory_equal((char *)buf + 8, "{}      ", 8);
    assert_int_equal(st_count(f), 0);
    assert_null(st_get(f, "q"));
    st_close(f);
    free(buf);
    st_writer_free(w);
}

/* A fresh temporary directory (caller removes it). */
static void make_tmpdir(char *dir, size_t size)
{
    const char *base = getenv("TMPDIR");
    snprintf(dir, size, "%s/test_safetensors.XXXXXX", base && *base ? base : "/tmp");
    assert_non_null(mkdtemp(dir));
}

/* Names of the entries in dir other than . and .., joined by spaces. */
static void list_dir(const char *dir, char *out, size_t size)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    out[0] = 0;
    for (struct dirent *de; (de = readdir(d));)
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
            snprintf(out + strlen(out), size - strlen(out), "%s%s", out[0] ? " " : "", de->d_name);
    closedir(d);
}

static void write_bytes(const char *path, const void *p, size_t n)
{
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(p, 1, n, fp), n);
    assert_int_equal(fclose(fp), 0);
}

static void test_write_and_open_file(void **state)
{
    char dir[256], path[320], listing[512], err[ST_ERRMSG_MAX] = "";
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/out.safetensors", dir);

    struct sample s;
    st_writer *w = sample_writer(&s);
    if (st_writer_write(w, path, err, sizeof err) != 0)
        fail_msg("write: %s", err);
    list_dir(dir, listing, sizeof listing);
    assert_string_equal(listing, "out.safetensors");   /* no temp file left behind */
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0644);

    /* the file holds exactly what serialize produces */
    void *mem;
    size_t len;
    assert_int_equal(st_writer_serialize(w, &mem, &len, err, sizeof err), 0);
    assert_int_equal((size_t)sb.st_size, len);
    st_file *f = NULL;
    if (st_open(path, &f, err, sizeof err) != 0)
        fail_msg("open: %s", err);
    assert_int_equal(st_count(f), 4);
    const st_tensor *q = st_expect(f, "q", ST_BF16, 3, (const int64_t[]){2, 3, 4}, err, sizeof err);
    assert_non_null(q);
    assert_memory_equal(q->data, s.q, sizeof s.q);
    assert_memory_equal(st_get(f, "idx")->data, s.idx, sizeof s.idx);
    assert_string_equal(st_meta(f, "case"), "round trip");
    st_close(f);
    free(mem);
    st_writer_free(w);

    /* overwriting replaces the file atomically */
    w = st_writer_new();
    const int32_t v[2] = {7, -7};
    assert_int_equal(st_writer_add(w, "v", ST_I32, 1, (const int64_t[]){2}, v), 0);
    assert_int_equal(st_writer_write(w, path, err, sizeof err), 0);
    assert_int_equal(st_open(path, &f, err, sizeof err), 0);
    assert_int_equal(st_count(f), 1);
    assert_null(st_get(f, "q"));
    assert_memory_equal(st_get(f, "v")->data, v, sizeof v);
    st_close(f);
    list_dir(dir, listing, sizeof listing);
    assert_string_equal(listing, "out.safetensors");

    /* a missing directory is an error naming the path */
    char bad[400];
    snprintf(bad, sizeof bad, "%s/no_such_dir/x.safetensors", dir);
    assert_int_equal(st_writer_write(w, bad, err, sizeof err), -1);
    assert_mentions(err, "no_such_dir/x.safetensors.tmp.");
    assert_mentions(err, "No such file");
    st_writer_free(w);

    assert_int_equal(unlink(path), 0);
    assert_int_equal(rmdir(dir), 0);
}

static void test_open_errors(void **state)
{
    char dir[256], path[320], err[ST_ERRMSG_MAX];
    st_file *f = NULL;
    make_tmpdir(dir, sizeof dir);

    snprintf(path, sizeof path, "%s/missing.safetensors", dir);
    assert_int_equal(st_open(path, &f, err, sizeof err), -1);
    assert_null(f);
    assert_mentions(err, "missing.safetensors");
    assert_mentions(err, "No such file");

    assert_int_equal(st_open(dir, &f, err, sizeof err), -1);
    assert_mentions(err, "not a regular file");

    snprintf(path, sizeof path, "%s/x.safetensors", dir);
    write_bytes(path, "", 0);
    assert_int_equal(st_open(path, &f, err, sizeof err), -1);
    assert_mentions(err, "empty file");

    write_bytes(path, "\x02\0\0\0\0", 5);
    assert_int_equal(st_open(path, &f, err, sizeof err), -1);
    assert_mentions(err, "5 bytes, too short");

    /* parse errors are prefixed with the path */
    size_t len;
    unsigned char *buf = make_file("[1]", 0, &len);
    write_bytes(path, buf, len);
    assert_int_equal(st_open(path, &f, err, sizeof err), -1);
    assert_mentions(err, "x.safetensors: header is a JSON array, not an object");
    assert_null(f);
    free(buf);

    /* err may be NULL */
    assert_int_equal(st_open(path, &f, NULL, 0), -1);

    assert_int_equal(unlink(path), 0);
    assert_int_equal(rmdir(dir), 0);
}

static void test_expect(void **state)
{
    char err[ST_ERRMSG_MAX];
    unsigned char *buf;
    st_file *f = expect_accept("{\"q\":{\"dtype\":\"BF16\",\"shape\":[4,2,128],\"data_offsets\":[0,2048]},"
                               "\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[2048,2052]}}",
                               2052, &buf);
    const st_tensor *q = st_get(f, "q");
    assert_ptr_equal(st_expect(f, "q", ST_BF16, 3, (const int64_t[]){4, 2, 128}, err, sizeof err), q);
    assert_ptr_equal(st_expect(f, "q", ST_BF16, 3, (const int64_t[]){-1, -1, 128}, err, sizeof err), q);
    assert_ptr_equal(st_expect(f, "q", ST_BF16, 3, (const int64_t[]){-1, -1, -1}, err, sizeof err), q);
    assert_non_null(st_expect(f, "s", ST_F32, 0, NULL, err, sizeof err));

    assert_null(st_expect(f, "nope", ST_BF16, 3, (const int64_t[]){4, 2, 128}, err, sizeof err));
    assert_string_equal(err, "tensor 'nope' not found");

    assert_null(st_expect(f, "q", ST_F32, 3, (const int64_t[]){4, 2, 128}, err, sizeof err));
    assert_string_equal(err, "tensor 'q' is BF16, expected F32");

    assert_null(st_expect(f, "q", ST_BF16, 2, (const int64_t[]){4, 256}, err, sizeof err));
    assert_string_equal(err, "tensor 'q' has shape [4, 2, 128] (3 dims), expected [4, 256] (2 dims)");

    assert_null(st_expect(f, "q", ST_BF16, 3, (const int64_t[]){-1, 3, 128}, err, sizeof err));
    assert_string_equal(err, "tensor 'q' has shape [4, 2, 128] (3 dims), expected [*, 3, 128] (3 dims)");

    assert_null(st_expect(f, "s", ST_F32, 1, (const int64_t[]){1}, err, sizeof err));
    assert_mentions(err, "tensor 's' has shape [] (0 dims)");

    assert_null(st_expect(f, "q", ST_I8, 3, (const int64_t[]){4, 2, 128}, NULL, 0));
    st_close(f);
    free(buf);
}

/* A writer rejects the add, and serialize then fails with a message mentioning needle. */
static void expect_add_rejected(const char *name, st_dtype dtype, int ndim, const int64_t *shape,
                                const void *data, int want_errno, const char *needle)
{
    char err[ST_ERRMSG_MAX] = "";
    void *buf = (void *)1;
    size_t len = 1;
    st_writer *w = st_writer_new();
    errno = 0;
    assert_int_equal(st_writer_add(w, name, dtype, ndim, shape, data), -1);
    assert_int_equal(errno, want_errno);
    assert_int_equal(st_writer_add(w, "fine", ST_U8, 0, NULL, "x"), 0);   /* the failure sticks */
    assert_int_equal(st_writer_serialize(w, &buf, &len, err, sizeof err), -1);
    assert_null(buf);
    assert_int_equal(len, 0);
    assert_mentions(err, needle);
    st_writer_free(w);
}

static void test_writer_rejects(void **state)
{
    const int64_t ok[] = {2, 2}, neg[] = {2, -1}, big[] = {4294967296LL, 4294967296LL, 16};
    const int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    const char data[64] = {0};
    expect_add_rejected("q", (st_dtype)10, 2, ok, data, EINVAL, "tensor 'q': invalid dtype 10");
    expect_add_rejected("q", (st_dtype)-1, 2, ok, data, EINVAL, "invalid dtype -1");
    expect_add_rejected("q", ST_F32, 9, nine, data, EINVAL, "tensor 'q': ndim 9 is not in 0..8");
    expect_add_rejected("q", ST_F32, -1, ok, data, EINVAL, "ndim -1 is not in 0..8");
    expect_add_rejected("q", ST_F32, 2, NULL, data, EINVAL, "tensor 'q': shape is NULL");
    expect_add_rejected("q", ST_F32, 2, neg, data, EINVAL, "shape [2, -1] is negative or overflows");
    expect_add_rejected("q", ST_U8, 3, big, data, EINVAL, "shape [4294967296, 4294967296, 16] is negative or overflows");
    expect_add_rejected("q", ST_F32, 2, ok, NULL, EINVAL, "tensor 'q': data is NULL");
    expect_add_rejected("", ST_F32, 2, ok, data, EINVAL, "tensor name is empty");
    expect_add_rejected(NULL, ST_F32, 2, ok, data, EINVAL, "tensor name is empty");
    expect_add_rejected("__metadata__", ST_F32, 2, ok, data, EINVAL, "'__metadata__' is not a valid tensor name");
    expect_add_rejected("bad\xff", ST_F32, 2, ok, data, EINVAL, "is not a valid tensor name");
    expect_add_rejected("bad\xed\xa0\x80", ST_F32, 2, ok, data, EINVAL, "is not a valid tensor name");

    char err[ST_ERRMSG_MAX];
    void *buf;
    size_t len;
    st_writer *w = st_writer_new();
    assert_int_equal(st_writer_add(w, "q", ST_F32, 2, ok, data), 0);
    errno = 0;
    assert_int_equal(st_writer_add(w, "q", ST_I8, 2, ok, data), -1);
    assert_int_equal(errno, EEXIST);
    assert_int_equal(st_writer_serialize(w, &buf, &len, err, sizeof err), -1);
    assert_string_equal(err, "duplicate tensor name 'q'");
    assert_int_equal(st_writer_write(w, "/nonexistent/never-written", err, sizeof err), -1);
    assert_string_equal(err, "duplicate tensor name 'q'");
    st_writer_free(w);

    w = st_writer_new();
    assert_int_equal(st_writer_meta(w, "case", "a"), 0);
    assert_int_equal(st_writer_meta(w, "case", "b"), -1);
    assert_int_equal(st_writer_meta(w, "k", NULL), -1);
    assert_int_equal(st_writer_meta(w, "k", "\xc0\x80"), -1);   /* overlong NUL */
    assert_int_equal(st_writer_serialize(w, &buf, &len, err, sizeof err), -1);
    assert_string_equal(err, "duplicate metadata key 'case'");
    st_writer_free(w);
}

/* Every prefix of a valid file fails with the error its length calls for; the whole file parses. */
static void test_truncated_at_every_length(void **state)
{
    struct sample s;
    st_writer *w = sample_writer(&s);
    char err[ST_ERRMSG_MAX];
    void *full;
    size_t len;
    assert_int_equal(st_writer_serialize(w, &full, &len, err, sizeof err), 0);
    uint64_t n = read_le64(full);
    for (size_t cut = 0; cut <= len; cut++) {
        unsigned char *p = malloc(cut ? cut : 1);   /* exact size: ASan flags any over-read */
        memcpy(p, full, cut);
        st_file *f = (st_file *)p;
        err[0] = 0;
        int rc = st_parse(p, cut, &f, err, sizeof err);
        if (cut == len) {
            if (rc != 0)
                fail_msg("full file rejected: %s", err);
            assert_int_equal(st_count(f), 4);
            st_close(f);
        } else {
            if (rc != -1)
                fail_msg("prefix of %zu of %zu bytes accepted", cut, len);
            assert_null(f);
            const char *want = cut == 0 ? "empty file"
                               : cut < 8 ? "too short for the 8-byte header length"
                               : cut < 8 + n ? "exceeds the"
                                             : "data_offsets [";
            assert_mentions(err, want);
            if (cut >= 8 + n)
                assert_mentions(err, "-byte data section");
        }
        free(p);
    }

    /* the same on disk, through st_open, at a few lengths */
    char dir[256], path[320];
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/cut.safetensors", dir);
    const size_t cuts[] = {0, 1, 7, 8, 9, 8 + n - 1, 8 + n, len - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        st_file *f = NULL;
        write_bytes(path, full, cuts[i]);
        assert_int_equal(st_open(path, &f, err, sizeof err), -1);
        assert_null(f);
        assert_mentions(err, "cut.safetensors: ");
    }
    assert_int_equal(unlink(path), 0);
    assert_int_equal(rmdir(dir), 0);
    free(full);
    st_writer_free(w);
}

static void test_header_length_beyond_file(void **state)
{
    char err[ST_ERRMSG_MAX];
    st_file *f = NULL;
    size_t len;
    unsigned char *buf = make_file("{}", 0, &len);
    write_le64(buf, 3);   /* one byte more than there is */
    assert_int_equal(st_parse(buf, len, &f, err, sizeof err), -1);
    assert_string_equal(err, "header length 3 exceeds the 2 bytes after the length field");

    write_le64(buf, 1ull << 63);
    assert_int_equal(st_parse(buf, len, &f, err, sizeof err), -1);
    assert_string_equal(err, "header length 9223372036854775808 exceeds the 16777216-byte limit");

    write_le64(buf, UINT64_MAX);
    assert_int_equal(st_parse(buf, len, &f, err, sizeof err), -1);
    assert_mentions(err, "header length 18446744073709551615 exceeds the 16777216-byte limit");

    write_le64(buf, ST_MAX_HEADER_BYTES + 1ull);
    assert_int_equal(st_parse(buf, len, &f, err, sizeof err), -1);
    assert_mentions(err, "header length 16777217 exceeds the 16777216-byte limit");
    assert_null(f);
    free(buf);
}

static void test_header_not_json(void **state)
{
    expect_reject("", 0, "header is not valid JSON: unexpected end of data at byte 0");
    expect_reject("        ", 0, "header is not valid JSON: unexpected end of data at byte 8");
    expect_reject("{not json}", 0, "header is not valid JSON: quoted object property name expected at byte 1");
    expect_reject("{\"q\":", 0, "header is not valid JSON: unexpected end of data at byte 5");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]", 8, "unexpected end of data");
    expect_reject("{\"q\":{}} x", 0, "header is not valid JSON");
    expect_reject("{} {}", 0, "header is not valid JSON");
    expect_reject("{\"a\":1,}", 0, "header is not valid JSON");
    expect_reject("{'q':{}}", 0, "header is not valid JSON: single-quoted string at byte 1");
    expect_reject("{\"__metadata__\":{\"a\":'b'}}", 0, "header is not valid JSON");
    expect_reject("{\"__metadata__\":{\"a\":\"\xff\"}}", 0, "header is not valid JSON: invalid utf-8");
    expect_reject("[]", 0, "header is a JSON array, not an object");
    expect_reject("\"q\"", 0, "header is a JSON string, not an object");
    expect_reject("null", 0, "header is a JSON null, not an object");
    expect_reject("12345678", 0, "header is a JSON int, not an object");

    /* a NUL inside the header, after a complete object */
    size_t len;
    char err[ST_ERRMSG_MAX];
    st_file *f = NULL;
    unsigned char *buf = make_file("{}xx  ", 0, &len);
    buf[10] = 0;
    assert_int_equal(st_parse(buf, len, &f, err, sizeof err), -1);
    assert_string_equal(err, "header is not valid JSON: unexpected byte 0x00 at byte 2 of 6");
    free(buf);

    /* nesting deeper than json-c's limit is an error, not a stack overflow */
    char deep[2 * 5000 + 32];
    strcpy(deep, "{\"__metadata__\":");
    for (int i = 0; i < 5000; i++)
        strcat(deep, "[");
    for (int i = 0; i < 5000; i++)
        strcat(deep, "]");
    strcat(deep, "}");
    expect_reject(deep, 0, "header is not valid JSON");
}

static void test_shape_overflow(void **state)
{
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,0]}}", 0,
                  "tensor 'q': U8 shape [4294967296, 4294967296, 16] overflows 64 bits");
    /* the element count fits, the byte count does not */
    expect_reject("{\"q\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,0]}}", 0,
                  "tensor 'q': F32 shape [4611686018427387904] overflows");
    /* a dimension beyond int64 (even with a zero elsewhere) */
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[0,18446744073709551615],\"data_offsets\":[0,0]}}", 0,
                  "tensor 'q': shape[1] = 18446744073709551615 overflows int64");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[0,99999999999999999999999],\"data_offsets\":[0,0]}}", 0,
                  "overflows int64");
}

static void test_offsets_past_end(void **state)
{
    expect_reject("{\"q\":{\"dtype\":\"BF16\",\"shape\":[50],\"data_offsets\":[0,100]}}", 64,
                  "tensor 'q': data_offsets [0, 100) exceed the 64-byte data section");
    expect_reject("{\"q\":{\"dtype\":\"BF16\",\"shape\":[0],"
                  "\"data_offsets\":[18446744073709551615,18446744073709551615]}}",
                  64, "tensor 'q': data_offsets [18446744073709551615, 18446744073709551615) exceed the 64-byte");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[65,65]}}", 64, "exceed the 64-byte");
    /* exactly to the end is fine */
    unsigned char *buf;
    st_file *f = expect_accept("{\"q\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[64,64]},"
                               "\"k\":{\"dtype\":\"U8\",\"shape\":[64],\"data_offsets\":[0,64]}}",
                               64, &buf);
    assert_int_equal(st_get(f, "k")->nbytes, 64);
    st_close(f);
    free(buf);
}

static void test_offsets_mismatch_shape(void **state)
{
    expect_reject("{\"q\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,12]}}", 64,
                  "tensor 'q': data_offsets [0, 12) hold 12 bytes, but F32 [4] needs 16");
    expect_reject("{\"q\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[8,24]}}", 64,
                  "hold 16 bytes, but BF16 [2, 3] needs 12");
    expect_reject("{\"q\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[0,0]}}", 64,
                  "hold 0 bytes, but F64 [] needs 8");
    expect_reject("{\"q\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[16,0]}}", 64,
                  "tensor 'q': data_offsets [16, 0) begin after they end");
}

static void test_overlapping_tensors(void **state)
{
    expect_reject("{\"a\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]},"
                  "\"b\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[8,24]}}",
                  64, "tensors 'a' [0, 16) and 'b' [8, 24) overlap");
    /* listed out of order, identical ranges, one inside a wider earlier one */
    expect_reject("{\"b\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[8,24]},"
                  "\"a\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]}}",
                  64, "tensors 'a' [0, 16) and 'b' [8, 24) overlap");
    expect_reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"b\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}",
                  64, "tensors 'a' [0, 8) and 'b' [0, 8) overlap");
    expect_reject("{\"a\":{\"dtype\":\"U8\",\"shape\":[40],\"data_offsets\":[0,40]},"
                  "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[8,12]},"
                  "\"c\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[20,24]}}",
                  64, "tensors 'a' [0, 40) and 'b' [8, 12) overlap");
    /* empty tensors overlap nothing; adjacent ranges and gaps are fine */
    unsigned char *buf;
    st_file *f = expect_accept("{\"a\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]},"
                               "\"z\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[8,8]},"
                               "\"b\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[16,32]},"
                               "\"c\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[40,48]}}",
                               64, &buf);
    assert_int_equal(st_count(f), 4);
    assert_string_equal(st_at(f, 1)->name, "z");
    st_close(f);
    free(buf);
}

static void test_duplicate_keys(void **state)
{
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                  "\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                  8, "duplicate tensor name 'q' in header");
    /* the same name spelled differently */
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                  "\"\\u0071\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                  8, "duplicate tensor name 'q' in header");
    expect_reject("{\"__metadata__\":{\"case\":\"a\",\"x\":\"y\",\"case\":\"b\"}}", 0,
                  "duplicate metadata key 'case' in header");
    expect_reject("{\"__metadata__\":{},\"__metadata__\":{}}", 0, "duplicate key '__metadata__' in header");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"dtype\":\"I8\",\"data_offsets\":[0,1]}}", 8,
                  "tensor 'q': duplicate key 'dtype' in header");
    /* colons, quotes and braces inside strings are not members */
    unsigned char *buf;
    st_file *f = expect_accept("{\"__metadata__\":{\"a:b\":\"c\\\":{\\\"d\\\\\",\"e\":\"}:\"},"
                               "\"q:\\\"\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
                               8, &buf);
    assert_string_equal(st_meta(f, "a:b"), "c\":{\"d\\");
    assert_string_equal(st_meta(f, "e"), "}:");
    assert_non_null(st_get(f, "q:\""));
    st_close(f);
    free(buf);
}

static void test_metadata_values(void **state)
{
    expect_reject("{\"__metadata__\":{\"case\":1}}", 0, "metadata 'case' is int, not a string");
    expect_reject("{\"__metadata__\":{\"a\":\"b\",\"case\":null}}", 0, "metadata 'case' is null, not a string");
    expect_reject("{\"__metadata__\":{\"case\":[\"x\"]}}", 0, "metadata 'case' is array, not a string");
    expect_reject("{\"__metadata__\":{\"case\":{\"x\":\"y\"}}}", 0, "metadata 'case' is object, not a string");
    expect_reject("{\"__metadata__\":[\"case\"]}", 0, "__metadata__ is array, not an object");
    expect_reject("{\"__metadata__\":\"case\"}", 0, "__metadata__ is string, not an object");
}

static void test_unknown_dtype(void **state)
{
    expect_reject("{\"q\":{\"dtype\":\"F8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 8,
                  "tensor 'q': unknown dtype 'F8'");
    expect_reject("{\"q\":{\"dtype\":\"bf16\",\"shape\":[1],\"data_offsets\":[0,2]}}", 8, "unknown dtype 'bf16'");
    expect_reject("{\"q\":{\"dtype\":\"BF16\\u0000\",\"shape\":[1],\"data_offsets\":[0,2]}}", 8, "unknown dtype");
    expect_reject("{\"q\":{\"dtype\":\"\",\"shape\":[1],\"data_offsets\":[0,2]}}", 8, "unknown dtype ''");
    expect_reject("{\"q\":{\"dtype\":2,\"shape\":[1],\"data_offsets\":[0,2]}}", 8,
                  "tensor 'q': dtype is int, not a string");
}

static void test_bad_dims(void **state)
{
    expect_reject("{\"q\":{\"dtype\":\"F32\",\"shape\":[-1,4],\"data_offsets\":[0,16]}}", 64,
                  "tensor 'q': shape[0] is negative (-1)");
    expect_reject("{\"q\":{\"dtype\":\"F32\",\"shape\":[4,-9223372036854775808],\"data_offsets\":[0,16]}}", 64,
                  "tensor 'q': shape[1] is negative (-9223372036854775808)");
    expect_reject("{\"q\":{\"dtype\":\"F32\",\"shape\":[4,-99999999999999999999],\"data_offsets\":[0,16]}}", 64,
                  "shape[1] is negative");
    expect_reject("{\"q\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 64,
                  "tensor 'q': shape[0] is double, not an integer");
    expect_reject("{\"q\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 64,
                  "shape[0] is string, not an integer");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 64,
                  "tensor 'q': shape has 9 dims, more than 8");
    unsigned char *buf;
    st_file *f = expect_accept("{\"q\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,2],\"data_offsets\":[0,2]}}", 8, &buf);
    assert_int_equal(st_get(f, "q")->ndim, 8);
    assert_int_equal(st_get(f, "q")->shape[7], 2);
    st_close(f);
    free(buf);
}

static void test_missing_or_odd_fields(void **state)
{
    expect_reject("{\"q\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 8, "tensor 'q': missing field 'dtype'");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 8, "tensor 'q': missing field 'shape'");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1]}}", 8, "tensor 'q': missing field 'data_offsets'");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"extra\":0}}", 8,
                  "tensor 'q': unexpected field 'extra'");
    expect_reject("{\"q\":5}", 8, "tensor 'q': entry is int, not an object");
    expect_reject("{\"q\":[\"U8\",[1],[0,1]]}", 8, "tensor 'q': entry is array, not an object");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":1,\"data_offsets\":[0,1]}}", 8,
                  "tensor 'q': shape is int, not an array");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 8,
                  "tensor 'q': data_offsets is not a [begin, end] pair");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", 8,
                  "data_offsets is not a [begin, end] pair");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":{\"0\":1}}}", 8,
                  "data_offsets is not a [begin, end] pair");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1.0]}}", 8,
                  "tensor 'q': data_offsets[1] is double, not an integer");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,0]}}", 8,
                  "tensor 'q': data_offsets[0] is negative (-1)");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[null,1]}}", 8,
                  "data_offsets[0] is null, not an integer");
    expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[NaN],\"data_offsets\":[0,1]}}", 8, "not an integer");
}

/* Random byte mutations of a valid file: each parses cleanly or fails with a message, never crashes. */
static void test_random_mutations(void **state)
{
    struct sample s;
    st_writer *w = sample_writer(&s);
    char err[ST_ERRMSG_MAX];
    void *orig;
    size_t len;
    assert_int_equal(st_writer_serialize(w, &orig, &len, err, sizeof err), 0);
    size_t hdr_end = 8 + read_le64(orig);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    int accepted = 0, rejected = 0;
    static const char interesting[] = "{}[]\":,\\-0123456789 eE.ntf'\x00\xff";
    for (int iter = 0; iter < 20000; iter++) {
        size_t cut = len;
        unsigned char *p = malloc(len);
        memcpy(p, orig, len);
        int edits = 1 + (int)(x % 4);
        for (int e = 0; e < edits; e++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            size_t at = (x >> 8) % (x & 1 ? 8 : hdr_end);   /* mostly in the header, sometimes the length */
            p[at] = x & 2 ? (unsigned char)(x >> 32) : (unsigned char)interesting[(x >> 32) % (sizeof interesting - 1)];
        }
        if (x & 4)
            cut = (size_t)((x >> 16) % (len + 1));   /* and sometimes truncate too */
        st_file *f = NULL;
        err[0] = 0;
        if (st_parse(p, cut, &f, err, sizeof err) == 0) {
            accepted++;
            const unsigned char *data = p + 8 + read_le64(p);
            for (size_t i = 0; i < st_count(f); i++) {
                const st_tensor *t = st_at(f, i);
                uint64_t want = st_dtype_size(t->dtype);
                for (int d = 0; d < t->ndim; d++)
                    want *= (uint64_t)t->shape[d];
                assert_int_equal(t->nbytes, want);
                assert_true((const unsigned char *)t->data >= data);
                assert_true((const unsigned char *)t->data + t->nbytes <= p + cut);
                assert_ptr_equal(st_get(f, t->name), t);
            }
            st_close(f);
        } else {
            rejected++;
            assert_null(f);
            assert_true(err[0] != 0);
        }
        free(p);
    }
    assert_true(rejected > 1000);   /* the mutations do reach the checks */
    print_message("mutations: %d accepted, %d rejected\n", accepted, rejected);
    free(orig);
    st_writer_free(w);
}

/* Reads a whole file into memory. */
static void *slurp(const char *path, size_t *len)
{
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, 0, SEEK_END), 0);
    long n = ftell(fp);
    assert_true(n >= 0);
    rewind(fp);
    void *buf = malloc((size_t)n + 1);
    assert_int_equal(fread(buf, 1, (size_t)n, fp), (size_t)n);
    fclose(fp);
    *len = (size_t)n;
    return buf;
}

/*
 * Every golden file opens, has q as BF16 [*, *, 128] and a 'case' in its
 * metadata, and survives a trip through the writer with its data section
 * reproduced byte for byte (the golden files use the writer's layout).
 */
static void test_golden_files(void **state)
{
    char path[4096], err[ST_ERRMSG_MAX];
    DIR *d = opendir(KDAD_GOLDEN_DIR);
    if (!d)
        fail_msg("golden folder %s: %s (configure with -DKDAD_GOLDEN_DIR=...)", KDAD_GOLDEN_DIR, strerror(errno));
    int nfiles = 0;
    for (struct dirent *de; (de = readdir(d));) {
        size_t nl = strlen(de->d_name);
        if (nl <= 12 || strcmp(de->d_name + nl - 12, ".safetensors") != 0)
            continue;
        nfiles++;
        snprintf(path, sizeof path, "%s/%s", KDAD_GOLDEN_DIR, de->d_name);
        st_file *f = NULL;
        if (st_open(path, &f, err, sizeof err) != 0)
            fail_msg("%s", err);
        if (!st_expect(f, "q", ST_BF16, 3, (const int64_t[]){-1, -1, 128}, err, sizeof err))
            fail_msg("%s: %s", path, err);
        const char *c = st_meta(f, "case");
        if (!c || !*c)
            fail_msg("%s: no metadata key 'case'", path);

        /* rewrite: same tensors in header order, same metadata */
        st_writer *w = st_writer_new();
        for (size_t i = 0; i < st_count(f); i++) {
            const st_tensor *t = st_at(f, i);
            assert_int_equal(st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data), 0);
        }
        for (size_t i = 0; i < st_meta_count(f); i++) {
            const char *k, *v;
            assert_int_equal(st_meta_at(f, i, &k, &v), 0);
            assert_int_equal(st_writer_meta(w, k, v), 0);
        }
        void *mine;
        size_t mylen, glen;
        st_file *g = serialize_and_parse(w, &mine, &mylen);
        unsigned char *gold = slurp(path, &glen);
        uint64_t gn = read_le64(gold), mn = read_le64(mine);
        assert_int_equal((8 + gn) % 8, 0);
        assert_int_equal(glen - 8 - gn, mylen - 8 - mn);
        if (memcmp(gold + 8 + gn, (unsigned char *)mine + 8 + mn, glen - 8 - gn) != 0)
            fail_msg("%s: data section differs after a trip through the writer", path);
        assert_int_equal(st_count(g), st_count(f));
        assert_int_equal(st_meta_count(g), st_meta_count(f));
        assert_string_equal(st_meta(g, "case"), c);
        for (size_t i = 0; i < st_count(f); i++) {
            const st_tensor *a = st_at(f, i), *b = st_at(g, i);
            assert_string_equal(a->name, b->name);
            assert_int_equal(a->nbytes, b->nbytes);
            assert_int_equal(data_offset(mine, b) % st_dtype_size(b->dtype), 0);
        }
        st_close(g);
        free(gold);
        free(mine);
        st_writer_free(w);
        st_close(f);
    }
    closedir(d);
    if (nfiles == 0)
        fail_msg("no .safetensors files in golden folder %s", KDAD_GOLDEN_DIR);
    print_message("golden: %d files\n", nfiles);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_names_and_sizes),
        cmocka_unit_test(test_roundtrip_in_memory),
        cmocka_unit_test(test_roundtrip_all_dtypes_scalar_empty),
        cmocka_unit_test(test_write_and_open_file),
        cmocka_unit_test(test_open_errors),
        cmocka_unit_test(test_expect),
        cmocka_unit_test(test_writer_rejects),
        cmocka_unit_test(test_truncated_at_every_length),
        cmocka_unit_test(test_header_length_beyond_file),
        cmocka_unit_test(test_header_not_json),
        cmocka_unit_test(test_shape_overflow),
        cmocka_unit_test(test_offsets_past_end),
        cmocka_unit_test(test_offsets_mismatch_shape),
        cmocka_unit_test(test_overlapping_tensors),
        cmocka_unit_test(test_duplicate_keys),
        cmocka_unit_test(test_metadata_values),
        cmocka_unit_test(test_unknown_dtype),
        cmocka_unit_test(test_bad_dims),
        cmocka_unit_test(test_missing_or_odd_fields),
        cmocka_unit_test(test_random_mutations),
        cmocka_unit_test(test_golden_files),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
