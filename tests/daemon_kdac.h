/*
 * daemon_kdac.h - the libkdaclient calls shared by the daemon tests that
 * drive kdad through the client library (test_daemon_ring,
 * test_daemon_stream, test_soak).  Each fails the test when the call does
 * not succeed.  Include cmocka's prerequisites first.
 */
#ifndef DAEMON_KDAC_H
#define DAEMON_KDAC_H

#include "daemon_harness.h"
#include "kdaclient.h"

/* A client of d with l registered as layer "L". */
kdac_client *dh_kdac_open(const dh_daemon *d, const dh_layer *l);
/* One slot. */
uint64_t dh_kdac_alloc(kdac_client *c);
/* s as a sequence of inline tensors on slot, its output into out (NULL: none asked). */
kdac_seq dh_kdac_seq(uint64_t slot, const dh_seq *s, uint16_t *out);

#endif /* DAEMON_KDAC_H */
