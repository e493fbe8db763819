/*
 * stats.h - kdad's counters and its prefill latency histogram, the `stats`
 * method's result, and a Prometheus text rendering of the same numbers.
 *
 * Updated on the loop thread only; no locking.
 */
#ifndef KDAD_STATS_H
#define KDAD_STATS_H

#include <stdint.h>

#include "conn.h" /* kd_disconnect */
#include "kdaproto.h"


/*
 * The timing of one batch, stamped as it goes through the daemon and the
 * backend: host times are uv_hrtime() nanoseconds (0: the step did not
 * happen or was not stamped), device times are durations measured on the
 * device (0: not measured).
 */
typedef struct kd_batch_timing {
    uint64_t formed_ns;   /* daemon: the scheduler formed it */
    uint64_t submit_ns;   /* daemon: prepared, handed to the backend */
    uint64_t staged_ns;   /* backend: inputs and descriptors staged (the "launch" of run_us) */
    uint64_t launched_ns; /* backend: everything enqueued on the device (cpu: the worker starts) */
    uint64_t signaled_ns; /* backend: a waiting thread saw the device finish (cpu: the worker ends) */
    uint64_t done_ns;     /* backend: the loop learnt of it */
    uint64_t unstaged_ns; /* backend: outputs in place (= done_ns when nothing was staged out) */
    uint64_t replied_ns;  /* daemon: every response of the batch written */
    uint64_t device_ns;   /* cuda: GPU time from the first copy in to the last copy out (events);
                             cpu: the worker's run */
    uint64_t kernel_ns;   /* cuda: the kernel alone (events around it); cpu: kda_cpu_prefill */
} kd_batch_timing;

/*
 * The phases of a batch kdad keeps (stats "batch_us", Prometheus
 * kdad_batch_phase_seconds): consecutive steps of kd_batch_timing, the
 * whole, and the device times.  A phase whose stamps are missing counts 0.
 */
#define KD_PHASES(X)                                                                     \
    X(FORM, "form")         /* formed -> submitted: run-time checks, output buffers */     \
    X(STAGE, "stage")       /* submitted -> staged: staging (a worker hop on cpu or for inline bytes) */ \
    X(LAUNCH, "launch")     /* staged -> launched: the enqueue calls */                     \
    X(WAIT, "wait")         /* launched -> signaled: the device (and any batch ahead of it) */ \
    X(NOTICE, "notice")     /* signaled -> done: the wake-up of the loop */                 \
    X(UNSTAGE, "unstage")   /* done -> unstaged: staged outputs copied out */               \
    X(REPLY, "reply")       /* unstaged -> replied: bookkeeping and responses */            \
    X(TOTAL, "total")       /* formed -> replied */                                         \
    X(DEVICE, "device")     /* device_ns */                                                 \
    X(KERNEL, "kernel")     /* kernel_ns */                                                 \
    X(HOST, "host")         /* total - device: what the daemon adds to the device's time */

typedef enum kd_phase {
#define KD_PHASE_ENUM(id, name) KD_PHASE_##id,
    KD_PHASES(KD_PHASE_ENUM)
#undef KD_PHASE_ENUM
    KD_PHASE_COUNT
} kd_phase;

#define KD_PHASE_WINDOW 1024 /* quantiles cover the most recent batches */

const char *kd_phase_name(kd_phase p);
/* The phases of t in microseconds (rounded down; 0 where stamps are missing). */
void kd_batch_phases(const kd_batch_timing *t, uint64_t us[KD_PHASE_COUNT]);

#define KD_LAT_BOUNDS 22   /* 10 us .. 100 s in a 1-2-5 series */
#define KD_ERROR_SLOTS 64  /* error codes are -1 .. -63 */

typedef struct kd_stats {
    uint64_t start_ns;
    uint32_t connections;
    uint64_t connections_total;
    uint64_t requests;
    uint64_t batches;
    uint64_t batches_held;     /* held back while the device was busy (hold.h) */
    uint64_t batches_gathered; /* held on an idle device for a fuller last wave (hold.h) */
    uint64_t seqs;
    uint64_t tokens;
    uint64_t errors[KD_ERROR_SLOTS];   /* by -code */
    uint64_t disconnects[KD_DISC_COUNT];
    uint64_t bytes_in[KP_TRANSPORT_ID_COUNT];
    uint64_t bytes_out[KP_TRANSPORT_ID_COUNT];
    uint64_t lat_bounds[KD_LAT_BOUNDS];
    uint64_t lat_counts[KD_LAT_BOUNDS + 1];
    uint64_t lat_count, lat_max, lat_sum; /* microseconds */
    /* batch phases: totals since start, and the last KD_PHASE_WINDOW batches */
    uint64_t batches_timed;
    uint64_t phase_sum[KD_PHASE_COUNT];                  /* microseconds */
    uint32_t phase_ring[KD_PHASE_WINDOW][KD_PHASE_COUNT]; /* microseconds, saturated */
    uint32_t ring_next, ring_len;
} kd_stats;

/* What clients make kdad hold, by kind. */
#define KD_HELD(X)                                                                   \
    X(INFLIGHT, "inflight")     /* request frames unanswered, those arriving too */ \
    X(PARTIAL, "partial")       /* of which frames still arriving */                 \
    X(OUTPUT, "output")         /* responses not read yet */                         \
    X(REGIONS, "regions")       /* regions mapped */

typedef enum kd_held_kind {
#define KD_HELD_ENUM(id, name) KD_HELD_##id,
    KD_HELD(KD_HELD_ENUM)
#undef KD_HELD_ENUM
    KD_HELD_COUNT
} kd_held_kind;

typedef struct kd_stats_held {
    uint64_t now, peak;
    uint64_t bound_uid;    /* the per-uid bound (0: none of its own) */
    uint64_t bound_total;  /* the daemon-wide or per-connection bound (0: none) */
    const char *uid_key, *total_key; /* their configuration keys */
} kd_stats_held;

/* What the stats result needs besides the counters. */
typedef struct kd_stats_gauges {
    uint32_t slots_total, slots_used, slots_lost;
    uint32_t layers;
    uint32_t regions;
    uint32_t rings;    /* connections on a frame ring */
    uint32_t queued;   /* requests waiting for the device */
    uint32_t running;  /* batches on the device */
    uint64_t ring_doorbells; /* rung to sleeping frame-ring clients so far (conn.h) */
    /* Bytes clients make kdad hold (quota.h): now, the peak since start, and
     * the daemon-wide bound (per-uid bounds in kd_stats_bounds). */
    kd_stats_held held[KD_HELD_COUNT];
    bool has_memory;
    kp_memory memory;  /* the backend's memory by use (kd_backend_memory) */
} kd_stats_gauges;

void kd_stats_init(kd_stats *s, uint64_t now_ns);
void kd_stats_latency(kd_stats *s, uint64_t us);
void kd_stats_error(kd_stats *s, int code);
/* Records a finished batch's phases. */
void kd_stats_batch(kd_stats *s, const kd_batch_timing *t);

/* Storage for the arrays a kp_stats_result points into. */
typedef struct kd_stats_view {
    kp_counter errors[KD_ERROR_SLOTS];
    kp_counter disconnects[KD_DISC_COUNT];
    kp_phase phases[KD_PHASE_COUNT];
} kd_stats_view;

/* Fills r (pointing into s and v) from the counters at now_ns. */
void kd_stats_result(const kd_stats *s, const kd_stats_gauges *g, uint64_t now_ns,
                     kd_stats_view *v, kp_stats_result *r);

/* The Prometheus text exposition (format 0.0.4) of the same numbers: a
 * malloc'd string, or NULL without memory. */
char *kd_stats_prometheus(const kd_stats *s, const kd_stats_gauges *g, uint64_t now_ns);

#endif /* KDAD_STATS_H */
