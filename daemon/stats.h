/*
 * stats.h - kdad's counters and its prefill latency histogram, the `stats`
 * method's result, and a Prometheus text rendering of the same numbers.
 *
 * Updated on the loop thread only; no locking.
 */
#ifndef KDAD_STATS_H
#define KDAD_STATS_H

#include <stdint.h>

#include "kdaproto.h"

/* Why a connection closed (the `disconnects` counters). */
#define KD_DISCONNECTS(X)                                                       \
    X(PEER_CLOSED, "peer_closed")         /* the client closed or reset it */   \
    X(PROTOCOL, "protocol")               /* a PROTOCOL error */                \
    X(FRAME_TOO_LARGE, "frame_too_large") /* a frame over the cap */            \
    X(VERSION, "unsupported_version")     /* hello found no common version */   \
    X(OUTPUT_LIMIT, "output_limit")       /* unread responses over the limit */ \
    X(PERMISSION, "permission")           /* peer not in the access lists */    \
    X(TOO_MANY, "too_many_connections")   /* clients.max_connections reached */ \
    X(QUOTA, "quota")                     /* its uid's connection quota reached */ \
    X(IO_ERROR, "io_error")               /* read or write failed */            \
    X(SHUTDOWN, "shutdown")               /* kdad drained and exits */          \
    X(DEVICE_FAILED, "device_failed")     /* the device failed; kdad exits */

typedef enum kd_disconnect {
#define KD_DISC_ENUM(id, name) KD_DISC_##id,
    KD_DISCONNECTS(KD_DISC_ENUM)
#undef KD_DISC_ENUM
    KD_DISC_COUNT
} kd_disconnect;

const char *kd_disconnect_name(kd_disconnect d);

#define KD_LAT_BOUNDS 22   /* 10 us .. 100 s in a 1-2-5 series */
#define KD_ERROR_SLOTS 64  /* error codes are -1 .. -63 */

typedef struct kd_stats {
    uint64_t start_ns;
    uint32_t connections;
    uint64_t connections_total;
    uint64_t requests;
    uint64_t batches;
    uint64_t seqs;
    uint64_t tokens;
    uint64_t errors[KD_ERROR_SLOTS];   /* by -code */
    uint64_t disconnects[KD_DISC_COUNT];
    uint64_t bytes_in[KP_TRANSPORT_ID_COUNT];
    uint64_t bytes_out[KP_TRANSPORT_ID_COUNT];
    uint64_t lat_bounds[KD_LAT_BOUNDS];
    uint64_t lat_counts[KD_LAT_BOUNDS + 1];
    uint64_t lat_count, lat_max, lat_sum; /* microseconds */
} kd_stats;

/* What the stats result needs besides the counters. */
typedef struct kd_stats_gauges {
    uint32_t slots_total, slots_used, slots_lost;
    uint32_t layers;
    uint32_t regions;
    uint32_t queued;   /* requests waiting for the device */
    uint32_t running;  /* batches on the device */
} kd_stats_gauges;

void kd_stats_init(kd_stats *s, uint64_t now_ns);
void kd_stats_latency(kd_stats *s, uint64_t us);
void kd_stats_error(kd_stats *s, int code);

/* Storage for the arrays a kp_stats_result points into. */
typedef struct kd_stats_view {
    kp_counter errors[KD_ERROR_SLOTS];
    kp_counter disconnects[KD_DISC_COUNT];
} kd_stats_view;

/* Fills r (pointing into s and v) from the counters at now_ns. */
void kd_stats_result(const kd_stats *s, const kd_stats_gauges *g, uint64_t now_ns,
                     kd_stats_view *v, kp_stats_result *r);

/* The Prometheus text exposition (format 0.0.4) of the same numbers: a
 * malloc'd string, or NULL without memory. */
char *kd_stats_prometheus(const kd_stats *s, const kd_stats_gauges *g, uint64_t now_ns);

#endif /* KDAD_STATS_H */
