/*
 * daemon_kdac.c - see daemon_kdac.h.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <string.h>

#include "daemon_kdac.h"

kdac_client *dh_kdac_open(const dh_daemon *d, const dh_layer *l)
{
    kdac_options o;
    kdac_options_init(&o);
    o.socket_path = d->sock;
    o.timeout_ms = 60000;
    kdac_client *c = NULL;
    kdac_error err;
    if (kdac_client_open(&c, &o, &err) != KDAC_OK)
        fail_msg("open: %s", err.message);
    kdac_layer layer = {"L", l->A_log, l->dt_bias, l->lower_bound, l->scale};
    if (kdac_layer_register(c, &layer, NULL, &err) != KDAC_OK)
        fail_msg("layer.register: %s", err.message);
    return c;
}

uint64_t dh_kdac_alloc(kdac_client *c)
{
    uint64_t slot;
    kdac_error err;
    if (kdac_slot_alloc(c, 1, 0, &slot, &err) != KDAC_OK)
        fail_msg("slot.alloc: %s", err.message);
    return slot;
}

kdac_seq dh_kdac_seq(uint64_t slot, const dh_seq *s, uint16_t *out)
{
    kdac_seq q;
    memset(&q, 0, sizeof(q));
    q.slot = slot;
    q.len = s->len;
    q.q = kdac_tensor_inline(s->q);
    q.k = kdac_tensor_inline(s->k);
    q.v = kdac_tensor_inline(s->v);
    q.g = kdac_tensor_inline(s->g);
    q.beta = kdac_tensor_inline(s->beta);
    q.out = kdac_output_inline(out);
    return q;
}
