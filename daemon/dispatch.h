/*
 * dispatch.h - requests: from a complete frame to an answer.
 *
 * kd_dispatch_frame decodes the envelope (proto/ kp_msg_decode runs the
 * bounded pre-validation first), takes a passed descriptor when the method
 * carries one, enforces the connection rules (hello first, no id reused in
 * flight, no notifications or responses from clients, draining) and routes
 * the method.  Methods that need no slot FIFO (hello, health, stats,
 * layer.*, region.*, ring.attach, slot.alloc, slot.info) are answered here
 * at once; prefill and the slot operations go to the engine (engine.h), which
 * admits them through exec.c and answers them when they have run.
 *
 * Every request is answered exactly once, with kd_req_reply or
 * kd_req_fail (client.h), which also keep the client's in-flight accounting
 * and the statistics.  An error whose code closes the connection
 * (KP_ERRORS) is followed by a goodbye and the close.
 */
#ifndef KDAD_DISPATCH_H
#define KDAD_DISPATCH_H

#include <stdint.h>

#include "client.h"
#include "stats.h"

/* Handles one frame body of cl (takes it: freed with the request). */
void kd_dispatch_frame(kd_client *cl, uint8_t *body, size_t len, uint64_t arrival_ns);

/* Gauges for the stats method and the metrics file. */
void kd_dispatch_gauges(const kd_daemon *d, kd_stats_gauges *g);

#endif /* KDAD_DISPATCH_H */
