/*
 * writer.c - outgoing frames: kp_writer (a msgpack_vrefbuffer whose iovec list
 * is the whole frame, prefix included) and the enc_* packing helpers the
 * message encoders use.
 *
 * Zero copy: small pieces (headers, keys, numbers, strings) are copied into
 * the vrefbuffer's chunks (gathered in the writer's `pending` bytes first:
 * the vrefbuffer's append costs more than most pieces' memcpy); tensor
 * payloads of WRITER_REF_MIN bytes or more
 * are appended as references, so they travel from the caller's memory to
 * the socket by writev without an intermediate copy.  Strings are always
 * copied, even long ones: an error message often lives on the caller's stack.
 */
#include <arpa/inet.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"

/* Payloads at least this long are referenced instead of copied: below it an
 * extra iovec costs more than the memcpy. */
#define WRITER_REF_MIN 512
/* Size of the vrefbuffer's copy chunks. */
#define WRITER_CHUNK 8192

void writer_flush(kp_writer *w)
{
    if (w->npending && msgpack_vrefbuffer_append_copy(&w->vbuf, (const char *)w->pending,
                                                      w->npending) != 0)
        w->failed = true;
    w->npending = 0;
}

/* msgpack_packer callback: every packed piece is copied (small ones into the
 * pending bytes, larger ones straight into the vrefbuffer, after them). */
static int writer_copy(void *data, const char *buf, size_t len)
{
    kp_writer *w = data;
    if (len <= sizeof(w->pending)) {
        memcpy(writer_room(w, len), buf, len);
    } else {
        writer_flush(w);
        if (msgpack_vrefbuffer_append_copy(&w->vbuf, buf, len) != 0)
            w->failed = true;
        w->body_bytes += len;
    }
    return w->failed ? -1 : 0;
}

/* An unsigned integer in its shortest msgpack form (big-endian payload). */
void enc_u64(kp_writer *w, uint64_t v)
{
    uint8_t *at;
    if (v <= 0x7f) {
        *writer_room(w, 1) = (uint8_t)v;
    } else if (v <= UINT8_MAX) {
        at = writer_room(w, 2);
        at[0] = 0xcc;
        at[1] = (uint8_t)v;
    } else if (v <= UINT16_MAX) {
        uint16_t be = __builtin_bswap16((uint16_t)v);
        at = writer_room(w, 3);
        at[0] = 0xcd;
        memcpy(at + 1, &be, sizeof(be));
    } else if (v <= UINT32_MAX) {
        uint32_t be = __builtin_bswap32((uint32_t)v);
        at = writer_room(w, 5);
        at[0] = 0xce;
        memcpy(at + 1, &be, sizeof(be));
    } else {
        uint64_t be = __builtin_bswap64(v);
        at = writer_room(w, 9);
        at[0] = 0xcf;
        memcpy(at + 1, &be, sizeof(be));
    }
}

int kp_writer_init(kp_writer *w, uint64_t max_frame)
{
    memset(w, 0, sizeof(*w));
    if (!msgpack_vrefbuffer_init(&w->vbuf, WRITER_REF_MIN, WRITER_CHUNK))
        return KP_E_NO_MEMORY;
    msgpack_packer_init(&w->pk, w, writer_copy);
    w->max_frame = max_frame;
    return KP_OK;
}

void kp_writer_close(kp_writer *w)
{
    msgpack_vrefbuffer_destroy(&w->vbuf);
    memset(w, 0, sizeof(*w));
}

void kp_writer_set_max_frame(kp_writer *w, uint64_t max_frame)
{
    w->max_frame = max_frame;
}

const struct iovec *kp_writer_iov(const kp_writer *w, size_t *iovcnt)
{
    *iovcnt = msgpack_vrefbuffer_veclen(&w->vbuf);
    return msgpack_vrefbuffer_vec(&w->vbuf);
}

uint64_t kp_writer_frame_bytes(const kp_writer *w)
{
    return KP_FRAME_HEADER_BYTES + w->body_bytes;
}

int kp_writer_flatten(const kp_writer *w, uint8_t **frame, size_t *len, kp_error *err)
{
    size_t n;
    const struct iovec *iov = kp_writer_iov(w, &n);
    size_t total = (size_t)kp_writer_frame_bytes(w);
    uint8_t *buf = malloc(total);
    if (!buf)
        return kp_fail(err, KP_E_NO_MEMORY, "cannot allocate %zu bytes to flatten a frame",
                       total);
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(buf + at, iov[i].iov_base, iov[i].iov_len);
        at += iov[i].iov_len;
    }
    *frame = buf;
    *len = total;
    return KP_OK;
}

/* Empties the writer and reserves the 4-byte prefix, patched by enc_finish. */
static void writer_begin(kp_writer *w)
{
    msgpack_vrefbuffer_clear(&w->vbuf);
    w->failed = false;
    w->body_bytes = 0;
    memset(w->pending, 0, KP_FRAME_HEADER_BYTES);
    w->npending = KP_FRAME_HEADER_BYTES;
}

int enc_finish(kp_writer *w, kp_error *err)
{
    writer_flush(w);
    if (w->failed)
        return kp_fail(err, KP_E_NO_MEMORY, "out of memory while encoding a frame");
    if (w->body_bytes > w->max_frame)
        return kp_fail(err, KP_E_FRAME_TOO_LARGE,
                       "encoded frame of %llu bytes exceeds the peer's cap of %llu bytes",
                       (unsigned long long)w->body_bytes, (unsigned long long)w->max_frame);
    /* The prefix was the first copy into a cleared buffer, so it opens iov[0]
     * (later copies only extend that iovec). */
    uint32_t be = htonl((uint32_t)w->body_bytes);
    memcpy(msgpack_vrefbuffer_vec(&w->vbuf)[0].iov_base, &be, sizeof(be));
    return KP_OK;
}

void enc_request(kp_writer *w, uint32_t id, kp_method m, uint32_t nfields)
{
    writer_begin(w);
    enc_array(w, 4);
    enc_u64(w, KP_MSG_REQUEST);
    enc_u64(w, id);
    enc_str(w, kp_method_name(m));
    enc_map(w, nfields);
}

void enc_result(kp_writer *w, uint32_t id, uint32_t nfields)
{
    writer_begin(w);
    enc_array(w, 4);
    enc_u64(w, KP_MSG_RESPONSE);
    enc_u64(w, id);
    enc_nil(w);
    enc_map(w, nfields);
}

void enc_str(kp_writer *w, const char *s)
{
    size_t n = strlen(s);
    if (n < 32) { /* names, and most values */
        enc_fixstr(w, s, n);
        return;
    }
    msgpack_pack_str(&w->pk, n);
    msgpack_pack_str_body(&w->pk, s, n);
}

void enc_int(kp_writer *w, int64_t v)
{
    msgpack_pack_int64(&w->pk, v);
}

void enc_bool(kp_writer *w, bool v)
{
    *writer_room(w, 1) = v ? 0xc3 : 0xc2;
}

void enc_float(kp_writer *w, float v)
{
    msgpack_pack_float(&w->pk, v);
}

void enc_nil(kp_writer *w)
{
    *writer_room(w, 1) = 0xc0;
}

/* Containers of fewer than 16 entries take a one-byte header (fixmap 0x80, fixarray 0x90)
 * straight into the pending bytes; larger ones go through the packer. */
void enc_map(kp_writer *w, uint32_t n)
{
    if (n < 16)
        *writer_room(w, 1) = (uint8_t)(0x80 | n);
    else
        msgpack_pack_map(&w->pk, n);
}

void enc_array(kp_writer *w, uint32_t n)
{
    if (n < 16)
        *writer_room(w, 1) = (uint8_t)(0x90 | n);
    else
        msgpack_pack_array(&w->pk, n);
}

void enc_bin(kp_writer *w, const void *data, uint64_t n)
{
    msgpack_pack_bin(&w->pk, (size_t)n);
    if (n < WRITER_REF_MIN) {
        msgpack_pack_bin_body(&w->pk, data, (size_t)n);
        return;
    }
    writer_flush(w);
    if (msgpack_vrefbuffer_append_ref(&w->vbuf, data, (size_t)n) != 0) {
        w->failed = true;
        return;
    }
    w->body_bytes += n;
}

void enc_ref(kp_writer *w, const kp_ref *ref)
{
    if (ref->kind == KP_REF_INLINE) {
        enc_bin(w, ref->data, ref->nbytes);
        return;
    }
    enc_map(w, 2);
    enc_kv_u64(w, "region", ref->region);
    enc_kv_u64(w, "offset", ref->offset);
}

void enc_handles(kp_writer *w, const uint64_t *v, uint32_t n)
{
    enc_array(w, n);
    for (uint32_t i = 0; i < n; i++)
        enc_u64(w, v[i]);
}

void enc_error_object(kp_writer *w, const kp_error *e)
{
    enc_map(w, 4);
    enc_kv_int(w, "code", e->code);
    enc_kv_str(w, "name", kp_code_name(e->code));
    enc_kv_str(w, "message", e->message[0] ? e->message : kp_code_message(e->code));
    enc_kv_bool(w, "retryable", kp_code_retryable(e->code));
}

void enc_timings(kp_writer *w, uint64_t queue_us, uint64_t run_us, bool timed,
                 uint64_t device_us, uint64_t kernel_us)
{
    enc_kv_u64(w, "queue_us", queue_us);
    enc_kv_u64(w, "run_us", run_us);
    if (timed) {
        enc_kv_u64(w, "device_us", device_us);
        enc_kv_u64(w, "kernel_us", kernel_us);
    }
}

int enc_need_str(const char *s, const char *field, kp_error *err)
{
    if (!s)
        return kp_fail(err, KP_E_INVALID_PARAMS, "%s: required string is NULL", field);
    return KP_OK;
}

int kp_error_response_encode(kp_writer *w, uint32_t id, const kp_error *e, kp_error *err)
{
    if (e->code >= 0)
        return kp_fail(err, KP_E_INTERNAL, "error response with non-error code %d", e->code);
    writer_begin(w);
    enc_array(w, 4);
    enc_u64(w, KP_MSG_RESPONSE);
    enc_u64(w, id);
    enc_error_object(w, e);
    enc_nil(w);
    return enc_finish(w, err);
}

int kp_goodbye_encode(kp_writer *w, const kp_error *e, kp_error *err)
{
    if (e->code >= 0)
        return kp_fail(err, KP_E_INTERNAL, "goodbye with non-error code %d", e->code);
    writer_begin(w);
    enc_array(w, 3);
    enc_u64(w, KP_MSG_NOTIFICATION);
    enc_str(w, KP_NOTIFY_GOODBYE);
    enc_error_object(w, e);
    return enc_finish(w, err);
}

int kp_empty_result_encode(kp_writer *w, uint32_t id, kp_error *err)
{
    enc_result(w, id, 0);
    return enc_finish(w, err);
}
