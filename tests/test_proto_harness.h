/*
 * test_proto_harness.h - shared fixtures of the proto/ message tests
 * (test_proto_messages.c, test_proto_prefill.c):
 *
 *   - a session like a daemon's after hello: H = 96 heads, f32 pool, 64 slots,
 *     default limits; and one writer every test encodes into;
 *   - "wire": the writer's frame flattened, its prefix checked, its envelope
 *     decoded, as a receiver sees it;
 *   - "edit": a valid message's object tree that a test changes in exactly one
 *     place (set, delete, append a duplicate key) and re-packs, so each
 *     invalid case differs from a good message by that one change;
 *   - a valid four-sequence prefill request to start edits from.
 *
 * Includes cmocka and its prerequisites.
 */
#ifndef TEST_PROTO_HARNESS_H
#define TEST_PROTO_HARNESS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "kdaproto.h"

#define H 96
#define TOK_BYTES(len) ((size_t)(len) * H * 128 * 2)   /* bf16 [len, H, 128] */
#define BETA_BYTES(len) ((size_t)(len) * H * 2)         /* bf16 [len, H] */
#define STATE_F32_BYTES ((size_t)H * 128 * 128 * 4)
#define STATE_BF16_BYTES ((size_t)H * 128 * 128 * 2)

extern kp_session test_session;
extern kp_writer test_writer;

/* cmocka group setup/teardown: the session and the writer. */
int harness_setup(void **state);
int harness_teardown(void **state);

/* rc and err->code are `code`, and err->message contains substr. */
void expect_error(int rc, const kp_error *err, int code, const char *substr);
/* n malloc'd bytes of a pattern that depends on seed. */
void *filled(size_t n, uint8_t seed);

/* ENC/DEC run an encoder/decoder call that must succeed; they declare the
 * kp_error (enc_err_ / dec_err_) the call passes, to report its message. */
#define ENC(call)                                                   \
    do {                                                            \
        kp_error enc_err_;                                          \
        int enc_rc_ = (call);                                       \
        if (enc_rc_)                                                \
            fail_msg("%s: %s", #call, enc_err_.message);            \
    } while (0)
#define DEC(call)                                                   \
    do {                                                            \
        kp_error dec_err_;                                          \
        int dec_rc_ = (call);                                       \
        if (dec_rc_)                                                \
            fail_msg("%s: %s", #call, dec_err_.message);            \
    } while (0)

/* ---------------------------------------------------------------------- */
/* The wire                                                               */
/* ---------------------------------------------------------------------- */

typedef struct wire {
    uint8_t *frame;
    size_t len;
    kp_msg msg;
} wire;

/* Flattens test_writer's frame, checks its prefix and decodes the envelope. */
void wire_open(wire *x);
void wire_close(wire *x);
/* wire_open, then checks it is request `id` of method m / a success response to `id`. */
void open_request(wire *x, kp_method m, uint32_t id);
void open_result(wire *x, uint32_t id);

/* ---------------------------------------------------------------------- */
/* Editing a message                                                      */
/* ---------------------------------------------------------------------- */

typedef struct edit {
    uint8_t *frame;         /* test_writer's frame; the tree references its bytes */
    size_t len;
    msgpack_unpacked up;    /* the tree; new objects are allocated in its zone */
    msgpack_object *map;    /* params of a request, result of a response */
    msgpack_sbuffer packed; /* the edited message */
    kp_msg msg;             /* the edited message, decoded by edit_repack */
} edit;

/* Starts editing test_writer's current frame; edit_end releases everything. */
void edit_begin(edit *e);
void edit_end(edit *e);

/* map[key]: the entry or NULL / the value, which must exist. */
msgpack_object_kv *edit_find(msgpack_object *map, const char *key);
msgpack_object *edit_get(msgpack_object *map, const char *key);
/* map[key] = v, replacing or adding / adding even if present (duplicates) /
 * removing the key, which must exist. */
void edit_set(edit *e, msgpack_object *map, const char *key, msgpack_object v);
void edit_append(edit *e, msgpack_object *map, const char *key, msgpack_object v);
void edit_del(msgpack_object *map, const char *key);
/* params.seqs[i] of a prefill request. */
msgpack_object *seq_at(edit *e, uint32_t i);

/* Values to put in.  Strings and bins are referenced, not copied. */
msgpack_object v_str(const char *s);
msgpack_object v_u64(uint64_t v);
msgpack_object v_neg(int64_t v);
msgpack_object v_f64(double v);
msgpack_object v_bool(bool v);
msgpack_object v_nil(void);
msgpack_object v_bin(const void *p, uint32_t n);
msgpack_object v_array(edit *e, uint32_t n, const msgpack_object *items);
msgpack_object v_region(edit *e, uint64_t region, uint64_t offset);

/* Re-packs the tree into e->packed and decodes its envelope into e->msg. */
void edit_repack(edit *e);
/* Decodes a request's params with its method's decoder, as a daemon's
 * dispatcher does. */
int decode_params(kp_msg *msg, const kp_session *s, kp_error *err);
/* Re-packs, decodes, and expects the request refused with code and a message
 * containing substr (under session s, or test_session) / accepted. */
void expect_refused_with(edit *e, const kp_session *s, int code, const char *substr);
void expect_refused(edit *e, int code, const char *substr);
void expect_accepted(edit *e);
/* Decodes a frame body with both prefill decoders: the general one
 * (kp_msg_decode + kp_prefill_params_decode) and the one-pass reader
 * (kp_prefill_request_read).  Fails the test when the reader accepts what
 * the decoder refuses, when the two disagree on anything decoded, or, with
 * must_read, when the reader declines a valid request.  Returns whether the
 * frame is a valid prefill request.  Prefill edits check this too. */
bool prefill_read_agrees(const void *body, size_t len, const kp_session *s, bool must_read);
/* The same for a prefill result answering req: the general decoder (kp_msg_decode +
 * kp_prefill_result_decode) against kp_prefill_result_read and kp_response_peek_id.  Returns
 * whether the frame is a valid result of req. */
bool prefill_result_read_agrees(const void *body, size_t len, const kp_prefill_params *req,
                                bool must_read);

/* ---------------------------------------------------------------------- */
/* The valid prefill                                                      */
/* ---------------------------------------------------------------------- */

/* Region layout of seqs[1] (len 5): inputs in region 1, output in region 2. */
#define R1_Q 0
#define R1_K (R1_Q + TOK_BYTES(5))
#define R1_V (R1_K + TOK_BYTES(5))
#define R1_G (R1_V + TOK_BYTES(5))
#define R1_BETA (R1_G + TOK_BYTES(5))
#define SLOT(i) kp_slot_handle(7, (i))

/* cmocka per-test setup/teardown: the inline tensors of the valid prefill. */
int prefill_setup(void **state);
int prefill_teardown(void **state);
/* 4 sequences: [0] len 12 inline with expect_pos 300, [1] len 5 by region
 * with an out region and fresh, [2] len 12 inline, [3] len 0 with expect_pos. */
void valid_prefill_seqs(kp_prefill_seq seqs[4]);
/* Encodes it into test_writer as request 11 on layer "model.layers.3.kda". */
void encode_valid_prefill(void);

#endif /* TEST_PROTO_HARNESS_H */
