/*
 * codec.h - private helpers of the kda_proto library, shared by its files:
 * typed field access over decoded msgpack maps (dec_*), and packing helpers
 * over kp_writer (enc_*).  Not installed; daemon and client use kdaproto.h.
 *
 * Decoding contract: every dec_* getter names the offending field in its
 * error, as "path.field" ("seqs[2].len") or "field" at the top level, so a
 * client can tell which part of its request was refused.
 */
#ifndef KDA_PROTO_CODEC_H
#define KDA_PROTO_CODEC_H

#include <string.h>

#include "kdaproto.h"

/* Longest field path we name in messages ("seqs[4095].beta" and the like). */
#define DEC_PATH_MAX 64
/* Most fields one message map has (stats' result is the largest). */
#define DEC_FIELDS_MAX 24

/* Requests reject unknown keys; results skip them (§Versioning). */
typedef enum dec_mode {
    DEC_STRICT = 0,
    DEC_LENIENT = 1,
} dec_mode;

/* The known fields of one map, located once so getters are lookups. */
typedef struct dec_fields {
    kp_msg *msg;                                /* owner of the zone for copies */
    const char *path;                           /* "" at the top level, else "seqs[2]" etc. */
    const struct dec_fields *parent;            /* or: the map is field `pname` of parent, */
    const char *pname;                          /* its path formatted only for an error */
    const char *const *names;                   /* known keys, NULL-terminated */
    int code;                                   /* error code of this map's failures */
    const msgpack_object *vals[DEC_FIELDS_MAX]; /* value per known key, or NULL */
} dec_fields;

/* Opens obj as a map of the given known keys (a NULL-terminated list of at
 * most DEC_FIELDS_MAX): keys must be strings, none twice; unknown keys are an
 * error in DEC_STRICT mode.  path prefixes field names in errors and must
 * outlive f.  code is KP_E_INVALID_PARAMS for requests, KP_E_PROTOCOL for
 * results. */
int dec_open(dec_fields *f, kp_msg *msg, const msgpack_object *obj, const char *path,
             const char *const *names, dec_mode mode, int code, kp_error *err);

/* The value of a known key, or NULL when absent. */
const msgpack_object *dec_get(const dec_fields *f, const char *name);

/* Writes "path.name" (or "name") into buf, truncated to size.  No printf:
 * request decoding names every field it reads. */
void dec_path(const dec_fields *f, const char *name, char *buf, size_t size);

/*
 * Typed getters.  `present` NULL means the field is required; otherwise
 * *present tells whether it was there, and the output is left untouched when
 * it was not (so callers set defaults first).  Range failures and type
 * failures return f's error code (KP_E_INVALID_PARAMS for requests,
 * KP_E_PROTOCOL for results).
 */
int dec_u64(const dec_fields *f, const char *name, uint64_t min, uint64_t max, uint64_t *out,
            bool *present, kp_error *err);
int dec_u32(const dec_fields *f, const char *name, uint32_t min, uint32_t max, uint32_t *out,
            bool *present, kp_error *err);
int dec_bool(const dec_fields *f, const char *name, bool *out, bool *present, kp_error *err);
/* Accepts float32, float64 and integers; the value must be finite as a float. */
int dec_float(const dec_fields *f, const char *name, float *out, bool *present, kp_error *err);
/* Copies a str into the zone, NUL-terminated; rejects embedded NULs and
 * lengths outside [min_len, max_len]. */
int dec_str(const dec_fields *f, const char *name, size_t min_len, size_t max_len,
            const char **out, bool *present, kp_error *err);
/* A str that must be one of choices (NULL-terminated); *out is its index. */
int dec_enum(const dec_fields *f, const char *name, const char *const *choices, int *out,
             bool *present, kp_error *err);
/* A bin of exactly nbytes bytes, referenced in place.  shape_fmt and its
 * arguments explain nbytes in the size error ("%u heads x 4 bytes f32"); they
 * are formatted only when that error is reported. */
int dec_bin(const dec_fields *f, const char *name, uint64_t nbytes, const void **out,
            bool *present, kp_error *err, const char *shape_fmt, ...)
    __attribute__((format(printf, 7, 8)));
/* A tensor reference of nbytes bytes: an inline bin when allow_inline, a
 * region map {region >= 1, offset multiple of KP_TENSOR_ALIGN} when
 * allow_region; ABSENT when missing and present != NULL.  shape_fmt as for
 * dec_bin. */
int dec_ref(const dec_fields *f, const char *name, uint64_t nbytes, bool allow_inline,
            bool allow_region, kp_ref *out, bool *present, kp_error *err, const char *shape_fmt,
            ...) __attribute__((format(printf, 9, 10)));
/* An array of u64 handles, 1..max entries, no value twice, copied into the zone. */
int dec_handles(const dec_fields *f, const char *name, uint32_t max, kp_slot_list *out,
                bool *present, kp_error *err);
/* A bin of 1..max_units entries of `unit` bytes each (its length a multiple of unit),
 * referenced in place: *out and *units. */
int dec_bin_units(const dec_fields *f, const char *name, uint32_t unit, uint32_t max_units,
                  const void **out, uint32_t *units, bool *present, kp_error *err);
/* An array value: *arr and *n, with 1 <= n <= max unless allow_empty. */
int dec_array(const dec_fields *f, const char *name, uint32_t max, bool allow_empty,
              const msgpack_object **arr, uint32_t *n, bool *present, kp_error *err);
/* A map value (for nested maps of results). */
int dec_map(const dec_fields *f, const char *name, const msgpack_object **out, bool *present,
            kp_error *err);

/* enc_timings' fields; *timed says whether device_us came (both optional). */
int dec_timings(const dec_fields *f, uint64_t *queue_us, uint64_t *run_us, bool *timed,
                uint64_t *device_us, uint64_t *kernel_us, kp_error *err);
/* Zone allocation for decoded arrays (n * size, overflow-checked). */
void *dec_alloc(kp_msg *msg, size_t n, size_t size, kp_error *err);
/* Copies a msgpack str (not NUL-terminated) into the zone as a C string. */
int dec_copy_str(kp_msg *msg, const msgpack_object *o, const char *field, size_t max_len,
                 int code, const char **out, kp_error *err);

/* Opens params of a request (strict, INVALID_PARAMS) or a success result
 * (lenient, PROTOCOL).  Both check the message kind. */
int dec_params(dec_fields *f, kp_msg *msg, const char *const *names, kp_error *err);
int dec_result(dec_fields *f, kp_msg *msg, const char *const *names, kp_error *err);

/* ---------------------------------------------------------------------- */
/* prefill (prefill.c), shared with its one-pass reader (prefill_read.c)  */
/* ---------------------------------------------------------------------- */

/* Running totals over a request's sequences, checked against the limits. */
typedef struct prefill_totals {
    uint64_t tokens;
    uint64_t inline_in;  /* inline tensor bytes in the request */
    uint64_t inline_out; /* inline output bytes the result will carry */
} prefill_totals;

/* Bytes of tensor t of a sequence of len tokens (saturating). */
uint64_t prefill_tensor_bytes(kp_prefill_tensor t, uint32_t len, uint32_t heads);
/* Adds a decoded sequence's tokens and inline output to sum (its inline
 * inputs are added as they are decoded). */
void prefill_count_seq(prefill_totals *sum, const kp_prefill_seq *q, uint32_t heads);
/* The checks on the request as a whole, once every sequence decoded: totals
 * against the limits, distinct slots, outputs overlapping nothing else.
 * Scratch space comes from msg's zone. */
int prefill_check_whole(kp_msg *msg, const kp_limits *lim, const kp_prefill_params *p,
                        const prefill_totals *sum, kp_error *err);

/* ---------------------------------------------------------------------- */
/* Encoding                                                               */
/* ---------------------------------------------------------------------- */

/* Starts a frame [0, id, method, {nfields ...}] / [1, id, nil, {nfields ...}]. */
void enc_request(kp_writer *w, uint32_t id, kp_method m, uint32_t nfields);
void enc_result(kp_writer *w, uint32_t id, uint32_t nfields);
/* Completes the frame: writes the length prefix, checks allocation failures
 * and the peer's cap (KP_E_NO_MEMORY, KP_E_FRAME_TOO_LARGE). */
int enc_finish(kp_writer *w, kp_error *err);

/* Moves the writer's pending bytes into its buffer (writer_room does when they are full). */
void writer_flush(kp_writer *w);

/* Room for n (<= KP_WRITER_PENDING) bytes at the end of the pending bytes,
 * which the caller fills: the common small pieces skip the packer's
 * callback and its copy. */
static inline uint8_t *writer_room(kp_writer *w, size_t n)
{
    if (w->npending + n > sizeof(w->pending))
        writer_flush(w);
    uint8_t *at = w->pending + w->npending;
    w->npending += n;
    w->body_bytes += n;
    return at;
}

/* A string of n < 32 bytes (a fixstr), header and body in one piece. */
static inline void enc_fixstr(kp_writer *w, const char *s, size_t n)
{
    uint8_t *at = writer_room(w, n + 1);
    at[0] = (uint8_t)(0xa0 | n);
    memcpy(at + 1, s, n);
}

/* A map key: a string literal (shorter than 32 bytes, as every key of the
 * protocol: a longer one does not compile), so its length is known where it
 * is written. */
#define enc_key(w, key) \
    enc_fixstr((w), "" key, sizeof(key) - 1 + 0 * sizeof(char[sizeof(key) <= 32 ? 1 : -1]))

void enc_str(kp_writer *w, const char *s);
void enc_u64(kp_writer *w, uint64_t v); /* the shortest form */
void enc_int(kp_writer *w, int64_t v);
void enc_bool(kp_writer *w, bool v);
void enc_float(kp_writer *w, float v);
void enc_nil(kp_writer *w);
void enc_map(kp_writer *w, uint32_t n);
void enc_array(kp_writer *w, uint32_t n);
void enc_bin(kp_writer *w, const void *data, uint64_t n);  /* referenced when large */
/* A tensor reference: an inline bin or a region map. */
void enc_ref(kp_writer *w, const kp_ref *ref);
void enc_handles(kp_writer *w, const uint64_t *v, uint32_t n);
/* key + value pairs (literal keys, as enc_key) */
#define enc_kv_u64(w, key, v) (enc_key(w, key), enc_u64((w), (v)))
#define enc_kv_int(w, key, v) (enc_key(w, key), enc_int((w), (v)))
#define enc_kv_bool(w, key, v) (enc_key(w, key), enc_bool((w), (v)))
#define enc_kv_float(w, key, v) (enc_key(w, key), enc_float((w), (v)))
#define enc_kv_str(w, key, s) (enc_key(w, key), enc_str((w), (s)))
#define enc_kv_nil(w, key) (enc_key(w, key), enc_nil(w))
#define enc_kv_ref(w, key, ref) (enc_key(w, key), enc_ref((w), (ref)))
#define enc_kv_handles(w, key, v, n) (enc_key(w, key), enc_handles((w), (v), (n)))
/* The error object {code, name, message, retryable}. */
void enc_error_object(kp_writer *w, const kp_error *e);
/* A prefill's or step's timings: queue_us and run_us, then device_us and kernel_us when
 * timed (four or two map entries). */
void enc_timings(kp_writer *w, uint64_t queue_us, uint64_t run_us, bool timed,
                 uint64_t device_us, uint64_t kernel_us);

/* Checks an encoder input before packing: a string that must be set. */
int enc_need_str(const char *s, const char *field, kp_error *err);

#endif /* KDA_PROTO_CODEC_H */
