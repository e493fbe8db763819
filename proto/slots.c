/*
 * slots.c - encoders and decoders of the slot methods: slot.alloc, slot.free,
 * slot.reset, slot.fork, slot.read, slot.write, slot.info (PROTOCOL.md
 * §Slots).  The codec checks what a frame and the session can tell (ranges,
 * duplicate handles, state sizes, the inline cap); whether a handle is live,
 * owned and at the right position is the daemon's pool to say.
 */
#include <stdio.h>
#include <string.h>

#include "codec.h"

static const char *const dtype_names[] = {"bf16", "f32", NULL};
static const char *const slot_status_names[] = {"ready", "empty", "lost", NULL};

/* "96 heads x 128 x 128 x 4 bytes f32": how size errors explain a state (its
 * arguments: heads, element bytes, dtype name). */
#define STATE_SHAPE "%u heads x %d x %d x %zu bytes %s"
#define STATE_SHAPE_ARGS(heads, dtype) \
    (heads), KP_HEAD_DIM, KP_HEAD_DIM, kp_dtype_size(dtype), kp_dtype_name(dtype)

static int check_inline_cap(const kp_session *s, const char *field, uint64_t nbytes,
                            kp_error *err)
{
    if (nbytes > s->limits.max_inline_bytes)
        return kp_fail(err, KP_E_LIMIT_EXCEEDED, "%s: %llu bytes inline exceed max_inline_bytes "
                       "%llu; use a region", field, (unsigned long long)nbytes,
                       (unsigned long long)s->limits.max_inline_bytes);
    return KP_OK;
}

/* ---------------------------------------------------------------------- */
/* slot.alloc                                                             */
/* ---------------------------------------------------------------------- */

static const char *const alloc_fields[] = {"count", "zero", NULL};
static const char *const slots_fields[] = {"slots", NULL};

int kp_slot_alloc_params_encode(kp_writer *w, uint32_t id, const kp_slot_alloc_params *p,
                                kp_error *err)
{
    enc_request(w, id, KP_METHOD_SLOT_ALLOC, 2);
    enc_kv_u64(w, "count", p->count);
    enc_kv_bool(w, "zero", p->zero);
    return enc_finish(w, err);
}

int kp_slot_alloc_params_decode(kp_msg *msg, const kp_session *s, kp_slot_alloc_params *p,
                                kp_error *err)
{
    dec_fields f;
    bool has_count, has_zero;
    p->count = 1;
    p->zero = true;
    int rc = dec_params(&f, msg, alloc_fields, err);
    if (rc || (rc = dec_u32(&f, "count", 1, s->limits.max_slots_per_client, &p->count,
                            &has_count, err)))
        return rc;
    return dec_bool(&f, "zero", &p->zero, &has_zero, err);
}

int kp_slot_alloc_result_encode(kp_writer *w, uint32_t id, const kp_slot_list *r, kp_error *err)
{
    enc_result(w, id, 1);
    enc_kv_handles(w, "slots", r->slots, r->nslots);
    return enc_finish(w, err);
}

int kp_slot_alloc_result_decode(kp_msg *msg, kp_slot_list *r, kp_error *err)
{
    dec_fields f;
    memset(r, 0, sizeof(*r));
    int rc = dec_result(&f, msg, slots_fields, err);
    if (rc)
        return rc;
    return dec_handles(&f, "slots", KP_MAX_SLOTS_PER_CLIENT_CEILING, r, NULL, err);
}

/* ---------------------------------------------------------------------- */
/* slot.free, slot.reset                                                  */
/* ---------------------------------------------------------------------- */

static int encode_slot_list(kp_writer *w, uint32_t id, kp_method m, const kp_slot_list *p,
                            kp_error *err)
{
    if (p->nslots == 0)
        return kp_fail(err, KP_E_INVALID_PARAMS, "slots: at least one handle is needed");
    enc_request(w, id, m, 1);
    enc_kv_handles(w, "slots", p->slots, p->nslots);
    return enc_finish(w, err);
}

static int decode_slot_list(kp_msg *msg, const kp_session *s, kp_slot_list *p, kp_error *err)
{
    dec_fields f;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, slots_fields, err);
    if (rc)
        return rc;
    return dec_handles(&f, "slots", s->limits.max_slots_per_client, p, NULL, err);
}

int kp_slot_free_params_encode(kp_writer *w, uint32_t id, const kp_slot_list *p, kp_error *err)
{
    return encode_slot_list(w, id, KP_METHOD_SLOT_FREE, p, err);
}

int kp_slot_free_params_decode(kp_msg *msg, const kp_session *s, kp_slot_list *p, kp_error *err)
{
    return decode_slot_list(msg, s, p, err);
}

int kp_slot_reset_params_encode(kp_writer *w, uint32_t id, const kp_slot_list *p, kp_error *err)
{
    return encode_slot_list(w, id, KP_METHOD_SLOT_RESET, p, err);
}

int kp_slot_reset_params_decode(kp_msg *msg, const kp_session *s, kp_slot_list *p, kp_error *err)
{
    return decode_slot_list(msg, s, p, err);
}

/* ---------------------------------------------------------------------- */
/* slot.fork                                                              */
/* ---------------------------------------------------------------------- */

static const char *const fork_fields[] = {"src", "dst", NULL};
static const char *const fork_result_fields[] = {"slot", "pos", NULL};

int kp_slot_fork_params_encode(kp_writer *w, uint32_t id, const kp_slot_fork_params *p,
                               kp_error *err)
{
    enc_request(w, id, KP_METHOD_SLOT_FORK, p->has_dst ? 2 : 1);
    enc_kv_u64(w, "src", p->src);
    if (p->has_dst)
        enc_kv_u64(w, "dst", p->dst);
    return enc_finish(w, err);
}

int kp_slot_fork_params_decode(kp_msg *msg, const kp_session *s, kp_slot_fork_params *p,
                               kp_error *err)
{
    dec_fields f;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, fork_fields, err);
    if (rc || (rc = dec_u64(&f, "src", 0, UINT64_MAX, &p->src, NULL, err)) ||
        (rc = dec_u64(&f, "dst", 0, UINT64_MAX, &p->dst, &p->has_dst, err)))
        return rc;
    if (p->has_dst && p->dst == p->src)
        return kp_fail(err, KP_E_INVALID_PARAMS, "dst: same slot as src (0x%llx)",
                       (unsigned long long)p->src);
    return KP_OK;
}

int kp_slot_fork_result_encode(kp_writer *w, uint32_t id, const kp_slot_fork_result *r,
                               kp_error *err)
{
    enc_result(w, id, 2);
    enc_kv_u64(w, "slot", r->slot);
    enc_kv_u64(w, "pos", r->pos);
    return enc_finish(w, err);
}

int kp_slot_fork_result_decode(kp_msg *msg, kp_slot_fork_result *r, kp_error *err)
{
    dec_fields f;
    int rc = dec_result(&f, msg, fork_result_fields, err);
    if (rc || (rc = dec_u64(&f, "slot", 0, UINT64_MAX, &r->slot, NULL, err)))
        return rc;
    return dec_u64(&f, "pos", 0, UINT64_MAX, &r->pos, NULL, err);
}

/* ---------------------------------------------------------------------- */
/* slot.read                                                              */
/* ---------------------------------------------------------------------- */

static const char *const read_fields[] = {"slot", "dtype", "out", NULL};
static const char *const read_result_fields[] = {"pos", "dtype", "state", NULL};

int kp_slot_read_params_encode(kp_writer *w, uint32_t id, const kp_slot_read_params *p,
                               kp_error *err)
{
    if (p->out.kind == KP_REF_INLINE)
        return kp_fail(err, KP_E_INVALID_PARAMS, "out: must be a region reference");
    bool has_out = p->out.kind == KP_REF_REGION;
    enc_request(w, id, KP_METHOD_SLOT_READ, 1 + p->has_dtype + has_out);
    enc_kv_u64(w, "slot", p->slot);
    if (p->has_dtype)
        enc_kv_str(w, "dtype", kp_dtype_name(p->dtype));
    if (has_out)
        enc_kv_ref(w, "out", &p->out);
    return enc_finish(w, err);
}

int kp_slot_read_params_decode(kp_msg *msg, const kp_session *s, kp_slot_read_params *p,
                               kp_error *err)
{
    dec_fields f;
    int dtype = s->geometry.state_dtype;
    bool has_out;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, read_fields, err);
    if (rc || (rc = dec_u64(&f, "slot", 0, UINT64_MAX, &p->slot, NULL, err)) ||
        (rc = dec_enum(&f, "dtype", dtype_names, &dtype, &p->has_dtype, err)))
        return rc;
    p->dtype = (kp_dtype)dtype;
    uint64_t nbytes = kp_state_bytes(s->geometry.heads, p->dtype);
    if ((rc = dec_ref(&f, "out", nbytes, false, true, &p->out, &has_out, err, STATE_SHAPE,
                      STATE_SHAPE_ARGS(s->geometry.heads, p->dtype))))
        return rc;
    if (!has_out)
        return check_inline_cap(s, "state", nbytes, err);
    return KP_OK;
}

int kp_slot_read_result_encode(kp_writer *w, uint32_t id, const kp_slot_read_result *r,
                               kp_error *err)
{
    if (r->state.kind == KP_REF_REGION)
        return kp_fail(err, KP_E_INVALID_PARAMS, "state: a result carries it inline or not at "
                       "all");
    bool has_state = r->state.kind == KP_REF_INLINE;
    enc_result(w, id, 2 + has_state);
    enc_kv_u64(w, "pos", r->pos);
    enc_kv_str(w, "dtype", kp_dtype_name(r->dtype));
    if (has_state)
        enc_kv_ref(w, "state", &r->state);
    return enc_finish(w, err);
}

int kp_slot_read_result_decode(kp_msg *msg, const kp_session *s, kp_slot_read_result *r,
                               kp_error *err)
{
    dec_fields f;
    int dtype;
    bool has_state;
    memset(r, 0, sizeof(*r));
    int rc = dec_result(&f, msg, read_result_fields, err);
    if (rc || (rc = dec_u64(&f, "pos", 0, UINT64_MAX, &r->pos, NULL, err)) ||
        (rc = dec_enum(&f, "dtype", dtype_names, &dtype, NULL, err)))
        return rc;
    r->dtype = (kp_dtype)dtype;
    return dec_ref(&f, "state", kp_state_bytes(s->geometry.heads, r->dtype), true, false,
                   &r->state, &has_state, err, STATE_SHAPE,
                   STATE_SHAPE_ARGS(s->geometry.heads, r->dtype));
}

/* ---------------------------------------------------------------------- */
/* slot.write                                                             */
/* ---------------------------------------------------------------------- */

static const char *const write_fields[] = {"slot", "pos", "dtype", "state", NULL};

int kp_slot_write_params_encode(kp_writer *w, uint32_t id, const kp_slot_write_params *p,
                                kp_error *err)
{
    if (p->state.kind == KP_REF_ABSENT)
        return kp_fail(err, KP_E_INVALID_PARAMS, "state: required");
    enc_request(w, id, KP_METHOD_SLOT_WRITE, 4);
    enc_kv_u64(w, "slot", p->slot);
    enc_kv_u64(w, "pos", p->pos);
    enc_kv_str(w, "dtype", kp_dtype_name(p->dtype));
    enc_kv_ref(w, "state", &p->state);
    return enc_finish(w, err);
}

int kp_slot_write_params_decode(kp_msg *msg, const kp_session *s, kp_slot_write_params *p,
                                kp_error *err)
{
    dec_fields f;
    int dtype;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, write_fields, err);
    if (rc || (rc = dec_u64(&f, "slot", 0, UINT64_MAX, &p->slot, NULL, err)) ||
        (rc = dec_u64(&f, "pos", 0, UINT64_MAX, &p->pos, NULL, err)) ||
        (rc = dec_enum(&f, "dtype", dtype_names, &dtype, NULL, err)))
        return rc;
    p->dtype = (kp_dtype)dtype;
    uint64_t nbytes = kp_state_bytes(s->geometry.heads, p->dtype);
    if ((rc = dec_ref(&f, "state", nbytes, true, true, &p->state, NULL, err, STATE_SHAPE,
                      STATE_SHAPE_ARGS(s->geometry.heads, p->dtype))))
        return rc;
    if (p->state.kind == KP_REF_INLINE)
        return check_inline_cap(s, "state", nbytes, err);
    return KP_OK;
}

/* ---------------------------------------------------------------------- */
/* slot.info                                                              */
/* ---------------------------------------------------------------------- */

static const char *const info_result_fields[] = {"slots", "pool_free", "quota_left", NULL};
static const char *const info_fields[] = {"slot", "pos", "status", "queued", NULL};

int kp_slot_info_params_encode(kp_writer *w, uint32_t id, const kp_slot_info_params *p,
                               kp_error *err)
{
    if (p->has_slots && p->list.nslots == 0)
        return kp_fail(err, KP_E_INVALID_PARAMS, "slots: at least one handle is needed");
    enc_request(w, id, KP_METHOD_SLOT_INFO, p->has_slots);
    if (p->has_slots)
        enc_kv_handles(w, "slots", p->list.slots, p->list.nslots);
    return enc_finish(w, err);
}

int kp_slot_info_params_decode(kp_msg *msg, const kp_session *s, kp_slot_info_params *p,
                               kp_error *err)
{
    dec_fields f;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, slots_fields, err);
    if (rc)
        return rc;
    return dec_handles(&f, "slots", s->limits.max_slots_per_client, &p->list, &p->has_slots,
                       err);
}

int kp_slot_info_result_encode(kp_writer *w, uint32_t id, const kp_slot_info_result *r,
                               kp_error *err)
{
    for (uint32_t i = 0; i < r->nslots; i++) {
        if ((unsigned)r->slots[i].status > KP_SLOT_LOST)
            return kp_fail(err, KP_E_INTERNAL, "slots[%u].status: %d is not a kp_slot_status",
                           i, (int)r->slots[i].status);
    }
    enc_result(w, id, 3);
    enc_key(w, "slots");
    enc_array(w, r->nslots);
    for (uint32_t i = 0; i < r->nslots; i++) {
        const kp_slot_info *info = &r->slots[i];
        enc_map(w, 4);
        enc_kv_u64(w, "slot", info->slot);
        enc_kv_u64(w, "pos", info->pos);
        enc_kv_str(w, "status", slot_status_names[info->status]);
        enc_kv_u64(w, "queued", info->queued);
    }
    enc_kv_u64(w, "pool_free", r->pool_free);
    enc_kv_u64(w, "quota_left", r->quota_left);
    return enc_finish(w, err);
}

int kp_slot_info_result_decode(kp_msg *msg, kp_slot_info_result *r, kp_error *err)
{
    dec_fields f;
    const msgpack_object *arr;
    uint32_t n;
    memset(r, 0, sizeof(*r));
    int rc = dec_result(&f, msg, info_result_fields, err);
    if (rc || (rc = dec_array(&f, "slots", KP_MAX_SLOTS_PER_CLIENT_CEILING, true, &arr, &n, NULL,
                              err)) ||
        (rc = dec_u32(&f, "pool_free", 0, UINT32_MAX, &r->pool_free, NULL, err)) ||
        (rc = dec_u32(&f, "quota_left", 0, UINT32_MAX, &r->quota_left, NULL, err)))
        return rc;
    kp_slot_info *slots = dec_alloc(msg, n, sizeof(*slots), err);
    if (!slots)
        return err ? err->code : KP_E_NO_MEMORY;
    for (uint32_t i = 0; i < n; i++) {
        char path[DEC_PATH_MAX];
        dec_fields sf;
        int status;
        snprintf(path, sizeof(path), "slots[%u]", i);
        if ((rc = dec_open(&sf, msg, &arr[i], path, info_fields, DEC_LENIENT, KP_E_PROTOCOL,
                           err)) ||
            (rc = dec_u64(&sf, "slot", 0, UINT64_MAX, &slots[i].slot, NULL, err)) ||
            (rc = dec_u64(&sf, "pos", 0, UINT64_MAX, &slots[i].pos, NULL, err)) ||
            (rc = dec_enum(&sf, "status", slot_status_names, &status, NULL, err)) ||
            (rc = dec_u32(&sf, "queued", 0, UINT32_MAX, &slots[i].queued, NULL, err)))
            return rc;
        slots[i].status = (kp_slot_status)status;
    }
    r->slots = slots;
    r->nslots = n;
    return KP_OK;
}
