/*
 * test_proto_harness.c - shared fixtures of the proto/ message tests (see
 * test_proto_harness.h).
 */
#include <stdlib.h>
#include <string.h>

#include "test_proto_harness.h"

kp_session test_session;
kp_writer test_writer;

void expect_error(int rc, const kp_error *err, int code, const char *substr)
{
    if (rc != code)
        fail_msg("rc %d (%s: %s), expected %d (%s) with \"%s\"", rc, kp_code_name(rc),
                 err->message, code, kp_code_name(code), substr);
    assert_int_equal(err->code, code);
    if (!strstr(err->message, substr))
        fail_msg("message \"%s\" lacks \"%s\"", err->message, substr);
}

void *filled(size_t n, uint8_t seed)
{
    uint8_t *p = malloc(n);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(i * 7 + seed);
    return p;
}

/* ---------------------------------------------------------------------- */
/* The wire: the writer's frame as a decoded message                      */
/* ---------------------------------------------------------------------- */

/* Flattens test_writer's frame, checks its prefix and decodes the envelope. */
void wire_open(wire *x)
{
    kp_error err;
    assert_int_equal(kp_writer_flatten(&test_writer, &x->frame, &x->len, &err), KP_OK);
    uint32_t body = (uint32_t)x->frame[0] << 24 | x->frame[1] << 16 | x->frame[2] << 8 |
                    x->frame[3];
    assert_int_equal(body, x->len - 4);
    kp_msg_init(&x->msg);
    int rc = kp_msg_decode(&x->msg, x->frame + 4, x->len - 4, KP_DEFAULT_MAX_FRAME_BYTES, &err);
    if (rc)
        fail_msg("decode: %s", err.message);
}

void wire_close(wire *x)
{
    kp_msg_close(&x->msg);
    free(x->frame);
}

void open_request(wire *x, kp_method m, uint32_t id)
{
    wire_open(x);
    assert_int_equal(x->msg.kind, KP_MSG_REQUEST);
    assert_int_equal(x->msg.method, m);
    assert_string_equal(x->msg.name, kp_method_name(m));
    assert_int_equal(x->msg.id, id);
}

void open_result(wire *x, uint32_t id)
{
    wire_open(x);
    assert_int_equal(x->msg.kind, KP_MSG_RESPONSE);
    assert_int_equal(x->msg.id, id);
    assert_null(x->msg.error);
}

/* ---------------------------------------------------------------------- */
/* Editing a message's object tree                                        */
/* ---------------------------------------------------------------------- */

void edit_begin(edit *e)
{
    kp_error err;
    memset(e, 0, sizeof(*e));
    assert_int_equal(kp_writer_flatten(&test_writer, &e->frame, &e->len, &err), KP_OK);
    msgpack_unpacked_init(&e->up);
    assert_int_equal(msgpack_unpack_next(&e->up, (const char *)e->frame + 4, e->len - 4, NULL),
                     MSGPACK_UNPACK_SUCCESS);
    e->map = &e->up.data.via.array.ptr[3];
    msgpack_sbuffer_init(&e->packed);
    kp_msg_init(&e->msg);
}

void edit_end(edit *e)
{
    kp_msg_close(&e->msg);
    msgpack_sbuffer_destroy(&e->packed);
    msgpack_unpacked_destroy(&e->up);
    free(e->frame);
}

msgpack_object_kv *edit_find(msgpack_object *map, const char *key)
{
    assert_int_equal(map->type, MSGPACK_OBJECT_MAP);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        msgpack_object_kv *kv = &map->via.map.ptr[i];
        if (kv->key.via.str.size == strlen(key) &&
            memcmp(kv->key.via.str.ptr, key, kv->key.via.str.size) == 0)
            return kv;
    }
    return NULL;
}

msgpack_object *edit_get(msgpack_object *map, const char *key)
{
    msgpack_object_kv *kv = edit_find(map, key);
    assert_non_null(kv);
    return &kv->val;
}

msgpack_object v_str(const char *s)
{
    msgpack_object o = {.type = MSGPACK_OBJECT_STR};
    o.via.str.ptr = s;
    o.via.str.size = (uint32_t)strlen(s);
    return o;
}

/* Appends key: v even if key exists (to make duplicates). */
void edit_append(edit *e, msgpack_object *map, const char *key, msgpack_object v)
{
    uint32_t n = map->via.map.size;
    msgpack_object_kv *kv = msgpack_zone_malloc(e->up.zone, (n + 1) * sizeof(*kv));
    assert_non_null(kv);
    if (n)
        memcpy(kv, map->via.map.ptr, n * sizeof(*kv));
    kv[n].key = v_str(key);
    kv[n].val = v;
    map->via.map.ptr = kv;
    map->via.map.size = n + 1;
}

void edit_set(edit *e, msgpack_object *map, const char *key, msgpack_object v)
{
    msgpack_object_kv *kv = edit_find(map, key);
    if (kv)
        kv->val = v;
    else
        edit_append(e, map, key, v);
}

void edit_del(msgpack_object *map, const char *key)
{
    msgpack_object_kv *kv = edit_find(map, key);
    assert_non_null(kv);
    msgpack_object_kv *end = map->via.map.ptr + map->via.map.size;
    memmove(kv, kv + 1, (size_t)(end - kv - 1) * sizeof(*kv));
    map->via.map.size--;
}

msgpack_object v_u64(uint64_t v)
{
    msgpack_object o = {.type = MSGPACK_OBJECT_POSITIVE_INTEGER};
    o.via.u64 = v;
    return o;
}

msgpack_object v_neg(int64_t v)
{
    msgpack_object o = {.type = MSGPACK_OBJECT_NEGATIVE_INTEGER};
    o.via.i64 = v;
    return o;
}

msgpack_object v_f64(double v)
{
    msgpack_object o = {.type = MSGPACK_OBJECT_FLOAT64};
    o.via.f64 = v;
    return o;
}

msgpack_object v_bool(bool v)
{
    msgpack_object o = {.type = MSGPACK_OBJECT_BOOLEAN};
    o.via.boolean = v;
    return o;
}

msgpack_object v_nil(void)
{
    msgpack_object o = {.type = MSGPACK_OBJECT_NIL};
    return o;
}

msgpack_object v_bin(const void *p, uint32_t n)
{
    msgpack_object o = {.type = MSGPACK_OBJECT_BIN};
    o.via.bin.ptr = p;
    o.via.bin.size = n;
    return o;
}

msgpack_object v_array(edit *e, uint32_t n, const msgpack_object *items)
{
    msgpack_object o = {.type = MSGPACK_OBJECT_ARRAY};
    msgpack_object *v = msgpack_zone_malloc(e->up.zone, (n ? n : 1) * sizeof(*v));
    assert_non_null(v);
    if (n)
        memcpy(v, items, n * sizeof(*v));
    o.via.array.ptr = v;
    o.via.array.size = n;
    return o;
}

msgpack_object v_region(edit *e, uint64_t region, uint64_t offset)
{
    msgpack_object o = {.type = MSGPACK_OBJECT_MAP};
    o.via.map.size = 0;
    o.via.map.ptr = NULL;
    edit_append(e, &o, "region", v_u64(region));
    edit_append(e, &o, "offset", v_u64(offset));
    return o;
}

/* params.seqs[i] of a prefill */
msgpack_object *seq_at(edit *e, uint32_t i)
{
    msgpack_object *seqs = edit_get(e->map, "seqs");
    assert_true(i < seqs->via.array.size);
    return &seqs->via.array.ptr[i];
}

/* Re-packs the edited tree and decodes its envelope. */
void edit_repack(edit *e)
{
    kp_error err;
    msgpack_packer pk;
    msgpack_sbuffer_clear(&e->packed);
    msgpack_packer_init(&pk, &e->packed, msgpack_sbuffer_write);
    assert_int_equal(msgpack_pack_object(&pk, e->up.data), 0);
    kp_msg_close(&e->msg);
    int rc = kp_msg_decode(&e->msg, e->packed.data, e->packed.size, KP_DEFAULT_MAX_FRAME_BYTES,
                           &err);
    if (rc)
        fail_msg("envelope: %s", err.message);
}

/* Decodes a request's params with the decoder of its method, as the daemon's
 * dispatcher does. */
int decode_params(kp_msg *msg, const kp_session *s, kp_error *err)
{
    union {
        kp_hello_params hello;
        kp_layer_register_params layer_register;
        kp_layer_drop_params layer_drop;
        kp_slot_alloc_params slot_alloc;
        kp_slot_list slot_list;
        kp_slot_fork_params slot_fork;
        kp_slot_read_params slot_read;
        kp_slot_write_params slot_write;
        kp_slot_info_params slot_info;
        kp_region_register_shm_params shm;
        kp_region_register_cuda_params cuda;
        kp_region_release_params release;
        kp_ring_attach_params ring;
        kp_prefill_params prefill;
        kp_step_params step;
    } u;
    switch (msg->method) {
    case KP_METHOD_HELLO: return kp_hello_params_decode(msg, s, &u.hello, err);
    case KP_METHOD_HEALTH: return kp_health_params_decode(msg, s, err);
    case KP_METHOD_STATS: return kp_stats_params_decode(msg, s, err);
    case KP_METHOD_LAYER_REGISTER:
        return kp_layer_register_params_decode(msg, s, &u.layer_register, err);
    case KP_METHOD_LAYER_LIST: return kp_layer_list_params_decode(msg, s, err);
    case KP_METHOD_LAYER_DROP: return kp_layer_drop_params_decode(msg, s, &u.layer_drop, err);
    case KP_METHOD_SLOT_ALLOC: return kp_slot_alloc_params_decode(msg, s, &u.slot_alloc, err);
    case KP_METHOD_SLOT_FREE: return kp_slot_free_params_decode(msg, s, &u.slot_list, err);
    case KP_METHOD_SLOT_RESET: return kp_slot_reset_params_decode(msg, s, &u.slot_list, err);
    case KP_METHOD_SLOT_FORK: return kp_slot_fork_params_decode(msg, s, &u.slot_fork, err);
    case KP_METHOD_SLOT_READ: return kp_slot_read_params_decode(msg, s, &u.slot_read, err);
    case KP_METHOD_SLOT_WRITE: return kp_slot_write_params_decode(msg, s, &u.slot_write, err);
    case KP_METHOD_SLOT_INFO: return kp_slot_info_params_decode(msg, s, &u.slot_info, err);
    case KP_METHOD_REGION_REGISTER_SHM:
        return kp_region_register_shm_params_decode(msg, s, &u.shm, err);
    case KP_METHOD_REGION_REGISTER_CUDA:
        return kp_region_register_cuda_params_decode(msg, s, &u.cuda, err);
    case KP_METHOD_REGION_RELEASE:
        return kp_region_release_params_decode(msg, s, &u.release, err);
    case KP_METHOD_RING_ATTACH: return kp_ring_attach_params_decode(msg, s, &u.ring, err);
    case KP_METHOD_PREFILL: return kp_prefill_params_decode(msg, s, &u.prefill, err);
    case KP_METHOD_STEP: return kp_step_params_decode(msg, s, &u.step, err);
    default: return kp_fail(err, KP_E_UNKNOWN_METHOD, "%s", msg->name);
    }
}

/* The edited request is refused with code and a message containing substr. */
void expect_refused_with(edit *e, const kp_session *s, int code, const char *substr)
{
    kp_error err = {0};
    edit_repack(e);
    expect_error(decode_params(&e->msg, s, &err), &err, code, substr);
    if (e->msg.method == KP_METHOD_PREFILL)
        assert_false(prefill_read_agrees(e->packed.data, e->packed.size, s, false));
}

static void expect_same_ref(const kp_ref *a, const kp_ref *b, uint32_t seq, int t)
{
    if (a->kind != b->kind || a->data != b->data || a->region != b->region ||
        a->offset != b->offset || a->nbytes != b->nbytes)
        fail_msg("seqs[%u].%s: the one-pass reader's reference differs", seq,
                 kp_prefill_tensor_name(t));
}

bool prefill_read_agrees(const void *body, size_t len, const kp_session *s, bool must_read)
{
    kp_msg full, fast;
    kp_prefill_params want, got;
    kp_error err;
    kp_msg_init(&full);
    kp_msg_init(&fast);
    bool valid = kp_msg_decode(&full, body, len, KP_DEFAULT_MAX_FRAME_BYTES, &err) == KP_OK &&
                 full.kind == KP_MSG_REQUEST && full.method == KP_METHOD_PREFILL &&
                 kp_prefill_params_decode(&full, s, &want, &err) == KP_OK;
    bool read = kp_prefill_request_read(&fast, body, len, KP_DEFAULT_MAX_FRAME_BYTES, s, &got);
    if (read && !valid)
        fail_msg("the one-pass reader accepted a frame the decoder refuses: %s", err.message);
    if (valid && must_read && !read)
        fail_msg("the one-pass reader declined a valid request");
    if (read) {
        assert_int_equal(fast.kind, KP_MSG_REQUEST);
        assert_true(fast.has_id);
        assert_int_equal(fast.id, full.id);
        assert_int_equal(fast.method, KP_METHOD_PREFILL);
        assert_string_equal(fast.name, full.name);
        assert_string_equal(got.layer, want.layer);
        assert_int_equal(got.nseqs, want.nseqs);
        for (uint32_t i = 0; i < want.nseqs; i++) {
            const kp_prefill_seq *a = &want.seqs[i], *b = &got.seqs[i];
            assert_int_equal(a->slot, b->slot);
            assert_int_equal(a->has_expect_pos, b->has_expect_pos);
            assert_int_equal(a->expect_pos, b->expect_pos);
            assert_int_equal(a->len, b->len);
            assert_int_equal(a->fresh, b->fresh);
            for (int t = 0; t < KP_PREFILL_TENSORS; t++)
                expect_same_ref(&a->tensors[t], &b->tensors[t], i, t);
        }
    } else {
        assert_null(fast.unpacked.zone);
        assert_false(fast.has_id);
    }
    kp_msg_close(&full);
    kp_msg_close(&fast);
    return valid;
}

bool prefill_result_read_agrees(const void *body, size_t len, const kp_prefill_params *req,
                                bool must_read)
{
    kp_msg full;
    kp_prefill_result want, got;
    kp_error err;
    kp_msg_init(&full);
    bool valid = kp_msg_decode(&full, body, len, KP_DEFAULT_MAX_FRAME_BYTES, &err) == KP_OK &&
                 full.kind == KP_MSG_RESPONSE && full.result &&
                 kp_prefill_result_decode(&full, &test_session, req, &want, &err) == KP_OK;
    uint64_t *pos = malloc((req->nseqs ? req->nseqs : 1) * sizeof(*pos));
    assert_non_null(pos);
    bool read = kp_prefill_result_read(body, len, KP_DEFAULT_MAX_FRAME_BYTES, req, pos, &got);
    if (read && !valid)
        fail_msg("the one-pass result reader accepted a frame the decoder refuses: %s",
                 err.message);
    if (valid && must_read && !read)
        fail_msg("the one-pass result reader declined a valid result");
    if (read) {
        uint32_t id = 0;
        assert_true(kp_response_peek_id(body, len, &id));
        assert_int_equal(id, full.id);
        assert_int_equal(got.nseqs, want.nseqs);
        assert_null(got.seqs);
        for (uint32_t i = 0; i < want.nseqs; i++) {
            assert_int_equal(pos[i], want.seqs[i].pos);
            assert_int_equal(want.seqs[i].out.kind, KP_REF_ABSENT);
        }
        assert_int_equal(got.queue_us, want.queue_us);
        assert_int_equal(got.run_us, want.run_us);
        assert_int_equal(got.timed, want.timed);
        assert_int_equal(got.device_us, want.device_us);
        assert_int_equal(got.kernel_us, want.kernel_us);
    }
    free(pos);
    kp_msg_close(&full);
    return valid;
}

void expect_refused(edit *e, int code, const char *substr)
{
    expect_refused_with(e, &test_session, code, substr);
}

void expect_accepted(edit *e)
{
    kp_error err;
    edit_repack(e);
    int rc = decode_params(&e->msg, &test_session, &err);
    if (rc)
        fail_msg("refused: %s", err.message);
    if (e->msg.method == KP_METHOD_PREFILL)
        assert_true(prefill_read_agrees(e->packed.data, e->packed.size, &test_session, true));
}

/* ---------------------------------------------------------------------- */
/* Fixtures                                                               */
/* ---------------------------------------------------------------------- */

int harness_setup(void **state)
{
    test_session.geometry = (kp_geometry){.heads = H, .head_dim = 128, .slots = 64,
                                          .state_dtype = KP_DTYPE_F32};
    kp_limits_default(&test_session.limits);
    return kp_writer_init(&test_writer, KP_DEFAULT_MAX_FRAME_BYTES);
}

int harness_teardown(void **state)
{
    kp_writer_close(&test_writer);
    return 0;
}

/* Inline tensors of the valid prefill: len 12 (seqs 0 and 2). */
static void *tok12[4], *beta12;

int prefill_setup(void **state)
{
    for (int t = 0; t < 4; t++)
        tok12[t] = filled(TOK_BYTES(12), (uint8_t)t);
    beta12 = filled(BETA_BYTES(12), 9);
    return 0;
}

int prefill_teardown(void **state)
{
    for (int t = 0; t < 4; t++)
        free(tok12[t]);
    free(beta12);
    return 0;
}

/* 4 sequences: [0] len 12 inline with expect_pos, [1] len 5 by region with
 * an out region and fresh, [2] len 12 inline, [3] len 0. */
void valid_prefill_seqs(kp_prefill_seq seqs[4])
{
    memset(seqs, 0, 4 * sizeof(*seqs));
    seqs[0] = (kp_prefill_seq){.slot = SLOT(1), .has_expect_pos = true, .expect_pos = 300,
                               .len = 12};
    seqs[2] = (kp_prefill_seq){.slot = SLOT(3), .len = 12};
    for (int i = 0; i <= 2; i += 2) {
        for (int t = 0; t < 4; t++)
            seqs[i].tensors[t] = kp_ref_inline(tok12[t], TOK_BYTES(12));
        seqs[i].beta = kp_ref_inline(beta12, BETA_BYTES(12));
    }
    seqs[1] = (kp_prefill_seq){.slot = SLOT(2), .len = 5, .fresh = true};
    seqs[1].q = kp_ref_region(1, R1_Q, TOK_BYTES(5));
    seqs[1].k = kp_ref_region(1, R1_K, TOK_BYTES(5));
    seqs[1].v = kp_ref_region(1, R1_V, TOK_BYTES(5));
    seqs[1].g = kp_ref_region(1, R1_G, TOK_BYTES(5));
    seqs[1].beta = kp_ref_region(1, R1_BETA, BETA_BYTES(5));
    seqs[1].out = kp_ref_region(2, 4096, TOK_BYTES(5));
    seqs[3] = (kp_prefill_seq){.slot = SLOT(4), .len = 0, .has_expect_pos = true,
                               .expect_pos = 0};
}

void encode_valid_prefill(void)
{
    kp_prefill_seq seqs[4];
    valid_prefill_seqs(seqs);
    kp_prefill_params p = {.layer = "model.layers.3.kda", .seqs = seqs, .nseqs = 4};
    ENC(kp_prefill_params_encode(&test_writer, 11, &p, &enc_err_));
}
