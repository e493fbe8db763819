/*
 * defaults.h - every cap and default of kdad in one place.
 *
 * The limits announced in hello (frame, inline, batch, per-client quotas)
 * have their named defaults in proto/kdaproto.h (KP_DEFAULT_*), shared with
 * the client; the daemon-side caps below are never sent on the wire.  Every
 * value here is the default of a config/kdad.yaml key (named in the comment)
 * unless it says "fixed".  kdad takes its defaults from the built-in copy of
 * config/kdad.yaml; tests/test_config.c checks that it agrees with these.
 */
#ifndef KDAD_DEFAULTS_H
#define KDAD_DEFAULTS_H

#define KD_VERSION_STRING KDAD_VERSION     /* from kdaclient.h, through CMake; hello's "server" is "kdad " this */

/* Exit codes of kdad (documented in docs/daemon.md). */
#define KD_EXIT_OK 0
#define KD_EXIT_FAILURE 1          /* runtime failure, device failure */
#define KD_EXIT_USAGE 2            /* bad command line or configuration */
#define KD_EXIT_UNAVAILABLE 69     /* the requested backend is not available (sysexits EX_UNAVAILABLE) */

/* Geometry */
#define KD_DEFAULT_HEADS 96                      /* heads */
#define KD_DEFAULT_SLOTS 256                     /* slots */
#define KD_MAX_SLOTS (1u << 24)                  /* fixed: ceiling of slots (handles keep 32 bits of index) */

/* Clients */
#define KD_DEFAULT_MAX_CONNECTIONS 1024u         /* clients.max_connections */
#define KD_DEFAULT_MAX_CONNECTIONS_PER_UID 256u  /* clients.max_connections_per_uid */
#define KD_DEFAULT_MAX_INFLIGHT_BYTES_PER_UID (4ull << 30) /* clients.max_inflight_bytes_per_uid */
#define KD_FALLBACK_MEMORY_BYTES (16ull << 30) /* the machine's memory when it cannot be read
                                                   (the memory-sized defaults below) */
/* clients.max_inflight_bytes_total = 0: half of the machine's memory
 * clients.max_output_bytes_per_uid = 0: an eighth of it; max_output_bytes_total = 0: a quarter
 * clients.max_region_bytes_per_connection = 0: a quarter of the memory or of RLIMIT_AS,
 * whichever is smaller; max_region_bytes_per_uid = 0: half of it */
#define KD_DEFAULT_OUTPUT_HARD_LIMIT (1ull << 30) /* clients.output_hard_limit: unread bytes that close at once */
#define KD_DEFAULT_OUTPUT_SOFT_LIMIT (512ull << 20) /* clients.output_soft_limit */
#define KD_DEFAULT_OUTPUT_SOFT_SECONDS 10u       /* clients.output_soft_seconds: time above the soft limit */
#define KD_DEFAULT_FRAME_STALL_SECONDS 30u       /* clients.frame_stall_seconds */
#define KD_DEFAULT_OUTPUT_STALL_SECONDS 30u      /* clients.output_stall_seconds */
#define KD_CLOSE_FLUSH_MS 2000u                  /* fixed: time a goodbye gets to drain before the close */

/* Batching */
#define KD_DEFAULT_MAX_QUEUED_REQUESTS 4096u     /* batching.max_queued_requests, daemon-wide */
#define KD_MAX_GRAPH_BUCKETS 32                  /* fixed: entries of batching.graph_buckets */
#define KD_DEFAULT_SPIN_US 200u                  /* batching.spin_us: the loop polls after answering */
#define KD_DEFAULT_HOLD_FILL_PERCENT 50u         /* batching.hold_fill_percent: a held batch this full goes */
#define KD_DEFAULT_HOLD_MAX_US 1000u             /* batching.hold_max_us: the longest a batch is held */
#define KD_DEFAULT_GATHER_US 150u                /* batching.gather_us: the longest a batch is gathered */
#define KD_DEFAULT_GATHER_WAVE_PERCENT 85u       /* batching.gather_wave_percent */
#define KD_DEFAULT_READY_SPIN_US 5000u           /* batching.ready_spin_us */
#define KD_DEFAULT_READY_TIMEOUT_MS 10000u       /* batching.ready_timeout_ms */
#define KD_GATHER_RECENT_US 2000u                /* fixed: a connection answered this recently is awaited */

/* I/O per wakeup: a busy connection yields the loop to the others after this much. */
#define KD_READ_BUDGET_BYTES (8u << 20)          /* fixed */
#define KD_WRITE_BUDGET_BYTES (16u << 20)        /* fixed */
#define KD_READ_BUFFER_BYTES (64u << 10)         /* fixed: small frames are read through this buffer;
                                                    larger bodies go straight into the frame */

/* libuv's worker threads (UV_THREADPOOL_SIZE unless the environment sets it),
 * started at start-up so that no later request depends on creating them */
#define KD_UV_THREADPOOL_SIZE 4                  /* fixed */

/* Shutdown and housekeeping */
#define KD_DEFAULT_DRAIN_TIMEOUT_MS 30000u       /* drain_timeout_ms: then queued requests get SHUTTING_DOWN */
#define KD_HOUSEKEEPING_MS 1000u                 /* fixed: output soft-limit checks */
#define KD_IDLE_TRIM_MS 1000u                    /* fixed: freed heap goes back to the system
                                                    this long after the last work */
#define KD_DEFAULT_METRICS_INTERVAL_MS 10000u    /* metrics.interval_ms */

/* CUDA backend */
#define KD_DEFAULT_CUDA_SPLIT_SCRATCH (256ull << 20) /* cuda_split_scratch (KDA_CUDA_SPLIT_SCRATCH_DEFAULT) */
#define KD_CUDA_DEPTH 2               /* fixed: batches queued on the stream (double buffering) */
#define KD_CUDA_POLL_NS 2000          /* fixed: cuda_completion poll: how often the completion thread asks a running batch's event */
#define KD_CUDA_FAULT_POLL_NS 100000  /* fixed: cuda_completion poll: how often a batch watched through its done word is asked for a device fault */
#define KD_CUDA_GATED_LANES 4         /* fixed: gated prefills launched ahead of their ready words at once (a lane each) */
#define KD_STAGE_ALIGN 256            /* fixed: staged tensors start on this boundary (kernel needs 16) */

#endif /* KDAD_DEFAULTS_H */
