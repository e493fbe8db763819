/*
 * safetensors.h - read and write safetensors files.
 *
 * Format: an 8-byte little-endian header length n, n bytes of JSON header
 * (tensor name -> {"dtype", "shape", "data_offsets": [begin, end)}, plus an
 * optional "__metadata__" map of string -> string), then the data section.
 *
 * The reader trusts nothing: every length, shape product and offset is
 * checked (overflow-safe) against the bytes present, so a truncated or
 * hostile file is an error with a message, never a crash.  Used by the golden
 * tests, kdactl and the daemon's layer loader.
 */
#ifndef KDA_SAFETENSORS_H
#define KDA_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ST_MAX_DIMS 8
#define ST_MAX_HEADER_BYTES (16u << 20)    /* json-c builds the whole tree: ~40x the header in RAM; ours are ~2 KB */
#define ST_ERRMSG_MAX 256

typedef enum st_dtype {
    ST_BF16, ST_F16, ST_F32, ST_F64, ST_I8, ST_U8, ST_I16, ST_I32, ST_I64, ST_BOOL,
} st_dtype;

typedef struct st_tensor {
    const char *name;
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data;       /* points into the file's bytes; aligned only as the file is */
    size_t nbytes;
} st_tensor;

typedef struct st_file st_file;

/* Parses a file's bytes.  The buffer must outlive the st_file (it is not copied). */
int st_parse(const void *buf, size_t len, st_file **out, char *err, size_t errlen);
/* Maps and parses a file; st_close unmaps it. */
int st_open(const char *path, st_file **out, char *err, size_t errlen);
void st_close(st_file *f);

size_t st_count(const st_file *f);
const st_tensor *st_at(const st_file *f, size_t i);
const st_tensor *st_get(const st_file *f, const char *name);   /* NULL if absent */
const char *st_meta(const st_file *f, const char *key);        /* NULL if absent */
size_t st_meta_count(const st_file *f);
int st_meta_at(const st_file *f, size_t i, const char **key, const char **value);

/*
 * Looks up a tensor and checks its dtype and shape in one call: want_shape
 * entries of -1 match any size.  Returns NULL and fills err on mismatch.
 */
const st_tensor *st_expect(const st_file *f, const char *name, st_dtype dtype, int ndim,
                           const int64_t *want_shape, char *err, size_t errlen);

const char *st_dtype_name(st_dtype t);
size_t st_dtype_size(st_dtype t);

/* Writer: collects tensors (by reference; they must outlive st_writer_write) and metadata. */
typedef struct st_writer st_writer;
st_writer *st_writer_new(void);
int st_writer_add(st_writer *w, const char *name, st_dtype dtype, int ndim, const int64_t *shape,
                  const void *data);
int st_writer_meta(st_writer *w, const char *key, const char *value);
/* Writes atomically (temp file + rename); data stored widest dtype first, 8-byte aligned. */
int st_writer_write(st_writer *w, const char *path, char *err, size_t errlen);
/* Serialises into a malloc'd buffer (for tests and in-memory use). */
int st_writer_serialize(st_writer *w, void **buf, size_t *len, char *err, size_t errlen);
void st_writer_free(st_writer *w);

#ifdef __cplusplus
}
#endif

#endif /* KDA_SAFETENSORS_H */
