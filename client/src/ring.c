/*
 * ring.c - kdac_ring_attach: a memfd for the frame ring (PROTOCOL.md §Frame
 * ring), registered as a region and named by ring.attach.  io.c moves the
 * bytes once the answer has arrived.
 */
#include <string.h>

#include "client_int.h"

static int ring_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res, kp_error *err)
{
    (void)p;
    (void)res;
    int rc = kp_empty_result_decode(msg, err);
    if (rc == KP_OK)
        client_ring_start(c); /* before the reader looks at the next socket byte */
    return rc;
}

int kdac_ring_attach(kdac_client *c, uint64_t bytes_per_direction, kdac_error *err)
{
    int rc = client_check_usable(c, true, err);
    if (rc)
        return rc;
    if (c->ring_shm.base)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "this connection has a frame ring already");
    if (c->inflight > 0)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "%u requests are in flight; attach the "
                         "ring before sending any", c->inflight);
    uint64_t size = bytes_per_direction ? bytes_per_direction : KP_RING_DEFAULT_SIZE;
    kp_error e;
    if (kp_ring_check_size(size, UINT64_MAX, &e) != KP_OK)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "bytes_per_direction: %s", e.message);

    kdac_shm shm;
    uint32_t region;
    if ((rc = kdac_shm_create(&shm, KP_RING_HEADER_BYTES + 2 * size, "kdac-ring", err)))
        return rc;
    if ((rc = kdac_region_register_shm(c, shm.fd, shm.size, &region, err))) {
        kdac_shm_close(&shm);
        return rc;
    }
    c->ring_shm = shm;
    kp_ring_init(&c->ring, shm.base, size, false, KP_RING_WANT_DATA);

    sync_call s;
    memset(&s, 0, sizeof(s));
    pending *p = pending_new(c, KP_METHOD_RING_ATTACH, sync_cb, &s, ring_decode);
    if (!p) {
        rc = kdac_fail(err, KDAC_E_NO_MEMORY, "cannot allocate a ring.attach request");
        goto undo;
    }
    p->id = client_next_id(c);
    kp_ring_attach_params params = {region, size};
    if ((rc = kp_ring_attach_params_encode(&p->w, p->id, &params, &e)) != KP_OK) {
        pending_free(p);
        rc = kdac_from_kp(err, &e);
        goto undo;
    }
    client_submit(c, p);
    if ((rc = sync_wait(c, &s, err)) == KDAC_OK)
        return KDAC_OK;
    if (rc == KDAC_E_UNKNOWN_METHOD)
        rc = kdac_fail(err, KDAC_E_NOT_SUPPORTED, "this daemon has no frame ring (ring.attach "
                       "is newer than it)");
undo:
    if (!c->failed)
        kdac_region_release(c, region, NULL);
    kdac_shm_close(&c->ring_shm);
    return rc;
}
