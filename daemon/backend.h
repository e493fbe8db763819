/*
 * backend.h - what kdad asks of a backend: the state pool's memory, layer
 * weights where the kernel reads them, region memory the device can use,
 * and batches run asynchronously with their completion reported back on the
 * loop thread.
 *
 * A batch holds the prefill sequences of one fused launch, decode steps
 * (each a launch of the step kernel) and slot operations (zero, copy, read
 * out, write in).  Everything in one batch
 * names distinct slots (the scheduler guarantees it), so the backend may run
 * the operations and the launch in any order; it runs operations in list
 * order, which matters only for a ZERO that clears a slot a READ of the same
 * batch then reads.  A batch runs whole or not at all (KD_BATCH_FAILED),
 * short of a device failure.  A batch's decode steps may be reported done
 * before the rest of it (kd_backend_steps_cb): a step then waits for no
 * prefill chain of its batch.
 *
 * Buffers (kd_buf) carry a host address, a device address, or both:
 *   inline tensors and inline outputs   host only (the cuda backend stages them)
 *   shared-memory regions               host, plus a device alias on cuda (pinned, mapped)
 *   CUDA IPC regions                    device only (cuda backend only)
 * The cpu backend uses host addresses.  The cuda backend uses device memory
 * in place, copies shared-memory tensors into device staging with the copy
 * engines (through the alias when staging is full), and stages host-only
 * buffers through its pinned buffers.
 *
 * Backends: backend_cpu.c (kda_cpu on a libuv worker thread) and
 * backend_cuda.c (the fused Hopper kernel via CUDA Graphs; built only with
 * KDAD_HAVE_CUDA).
 */
#ifndef KDAD_BACKEND_H
#define KDAD_BACKEND_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "config.h"
#include "kda.h"
#include "kdaproto.h"
#include "stats.h"

typedef struct kd_backend kd_backend;

/* A buffer as a request resolved it (see above). */
typedef struct kd_buf {
    void *host; /* host address, or NULL for device-only memory */
    void *dev;  /* address the device reads/writes directly, or NULL */
} kd_buf;

/* One prefill sequence of a launch. */
typedef struct kd_batch_seq {
    kd_buf in[5];            /* q, k, v, g (bf16 [len][H][128]), beta (bf16 [len][H]) */
    kd_buf out;              /* bf16 [len][H][128] */
    const kda_layer *layer;  /* the backend's copy (kd_layer.dev) */
    int64_t len;             /* >= 1: zero-length sequences never reach a backend */
    int64_t slot;
    uint32_t flags;          /* KDA_SEQ_ZERO_STATE for fresh sequences and lazily zeroed slots */
} kd_batch_seq;

/*
 * One decode step of a launch (a `step` request whose sequences all run in
 * the recurrent form): packed tensors, the sequences back to back along the
 * token axis (kda.h, kda_step).  Its slots are distinct from every other slot
 * of the batch, so a backend may run it beside the batch's prefill launch.
 */
typedef struct kd_batch_step {
    kd_buf in[5];               /* q, k, v, g (bf16 [tokens][H][128]), beta (bf16 [tokens][H]) */
    kd_buf out;                 /* bf16 [tokens][H][128] */
    kd_buf states;              /* pool dtype [tokens][H][128][128], or none (both NULL) */
    const kda_layer *layer;     /* the backend's copy (kd_layer.dev) */
    const kda_step_seq *seqs;   /* host memory [nseqs]: pool indices, starts, lengths, flags */
    uint32_t nseqs, tokens;
} kd_batch_step;

typedef enum kd_op_kind {
    KD_OP_ZERO,  /* slot := 0 */
    KD_OP_COPY,  /* slot := src */
    KD_OP_READ,  /* buf := slot, converted to dtype */
    KD_OP_WRITE, /* slot := buf, converted from dtype */
} kd_op_kind;

typedef struct kd_slot_op {
    kd_op_kind kind;
    uint32_t slot;   /* the slot operated on (COPY: the destination) */
    uint32_t src;    /* COPY: the source */
    kda_dtype dtype; /* READ, WRITE: element type of buf ([H][128][128], V-major) */
    kd_buf buf;      /* READ, WRITE */
} kd_slot_op;

/* Outcome of a batch. */
typedef enum kd_batch_status {
    KD_BATCH_OK = 0,
    KD_BATCH_FAILED, /* nothing in the batch ran; states untouched; requests get `code` */
    KD_BATCH_LOST,   /* the launch failed; the states of its sequences may be damaged */
    KD_BATCH_FATAL,  /* the device is unusable: every state is suspect, kdad must exit */
} kd_batch_status;

/* A 64-bit semaphore word in a client's region and the value to store
 * there (PROTOCOL.md §Stream-ordered requests). */
typedef struct kd_sem_word {
    kd_buf buf;     /* 8 bytes, 8-aligned: host, device, or both */
    uint64_t value;
} kd_sem_word;

typedef struct kd_batch {
    kd_batch_seq *seqs;
    uint32_t nseqs;
    kd_slot_op *ops;  /* run in order (before or after the launch: they name other slots) */
    uint32_t nops;
    kd_sem_word *dones; /* stored once every output and state of the batch is written, only
                           when the batch succeeds (the daemon writes failures) */
    uint32_t ndones;
    kd_batch_step *steps; /* decode steps, each one launch of the step kernel */
    uint32_t nsteps;
    /* Set by the backend before the completion callback. */
    kd_batch_status status;
    int code;          /* kp_code for FAILED (KP_E_NO_MEMORY, KP_E_INTERNAL, ...) */
    char message[256];
    /* Stamped along the way (stats.h): formed_ns and submit_ns by the daemon,
     * staged_ns .. unstaged_ns and the device times by the backend (which
     * clears them at submit), replied_ns by the daemon. */
    kd_batch_timing t;
    /* The steps' own timing, when the backend answers them before the batch ends
     * (kd_backend_steps_done): t up to launched_ns, then their signal and device times. */
    kd_batch_timing steps_t;
    bool on_device;    /* backend.c: counted in kd_backend.on_device */
    bool gated;        /* submitted behind a device-side wait (kd_backend_submit_gated) */
} kd_batch;

/* Runs on the loop thread when a submitted batch is done (whatever its status). */
typedef void (*kd_backend_done_cb)(void *ctx, kd_batch *batch);
/* Runs on the loop thread, before the batch is done, when a batch that holds
 * decode steps and other work has run its steps: their outputs and slots are
 * written (the batch's status is still KD_BATCH_OK), so their requests may be
 * answered.  The rest of the batch completes later through the done callback;
 * a later batch still runs after all of it. */
typedef void (*kd_backend_steps_cb)(void *ctx, kd_batch *batch);
/* Runs on the loop thread when the device finished the last batch launched
 * on it while that batch is not done yet (its outputs are being copied out
 * on the host): the device idles unless it gets another. */
typedef void (*kd_backend_idle_cb)(void *ctx);

typedef struct kd_backend_ops {
    /* Starts a batch; 0, or a kp_code (then the callback never fires). */
    int (*submit)(kd_backend *b, kd_batch *batch, kp_error *err);
    /* Copies a layer's weights where the kernel reads them; *dev is what
     * kd_batch_seq.layer must hold. */
    int (*layer_upload)(kd_backend *b, const kda_layer *host, const kda_layer **dev, void **handle,
                        kp_error *err);
    void (*layer_release)(kd_backend *b, const kda_layer *dev, void *handle);
    /* Makes a shared-memory mapping usable by the device (pinning); NULL when
     * the backend reads host memory anyway. */
    int (*pin_host)(kd_backend *b, void *host, uint64_t size, void **dev, void **handle,
                    kp_error *err);
    void (*unpin_host)(kd_backend *b, void *handle);
    /* Opens a client's device memory: a CUDA IPC handle, or (handle_type
     * posix_fd) the VMM allocation behind fd, which it takes over and closes
     * in every case (-1 for IPC).  NULL when unsupported. */
    int (*open_cuda)(kd_backend *b, const kp_region_register_cuda_params *p, int fd, void **dev,
                     void **handle, kp_error *err);
    void (*close_cuda)(kd_backend *b, void *handle);
    /* A semaphore word the host cannot reach (device memory): read it now,
     * or store a value (after everything the device has queued so far for
     * the batches, or at once).  NULL when every word is host memory. */
    int (*read_word)(kd_backend *b, kd_buf word, uint64_t *value);
    void (*write_word)(kd_backend *b, kd_buf word, uint64_t value);
    /* A batch of one gated prefill, staged now and queued on a lane of its own
     * (never the streams, buffers, graphs or kernel counters of other batches)
     * behind a device-side wait for `ready`: 0, or a kp_code (then the callback
     * never fires).  NULL when the backend has no lanes (info.gated_lanes 0). */
    int (*submit_gated)(kd_backend *b, kd_batch *batch, const kd_sem_word *ready, kp_error *err);
    /* Its ready word was reached: the backend watches the batch to its end. */
    void (*gated_go)(kd_backend *b, kd_batch *batch);
    /* Its ready word never came: the launch is called off on the device (it
     * changes nothing and its done words get the failure value) and released;
     * the batch then completes as KD_BATCH_FAILED with `code` and `message`. */
    void (*gated_cancel)(kd_backend *b, kd_batch *batch, int code, const char *message);
    /* Frees everything; no batch may be in flight. */
    void (*destroy)(kd_backend *b);
} kd_backend_ops;

typedef struct kd_backend_info {
    kp_backend kind;
    const char *name;           /* "cpu" | "cuda" */
    bool has_gpu;
    char gpu_name[KP_TEXT_MAX];
    char gpu_uuid[64];          /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    uint32_t gpu_index;
    char gpu_pci_bus_id[32];    /* "0000:19:00.0" (lower case, as nvidia-smi prints it) */
    bool gpu_mps;               /* the context is shared through CUDA MPS */
    uint32_t transports;        /* KP_TRANSPORT_* the backend can serve */
    uint32_t depth;             /* batches it takes at once (2: double-buffered) */
    bool stages_host;           /* host-only buffers are staged (kd_job_cost.stage_*) */
    uint64_t max_stage_in;      /* staging bytes per batch, each way */
    uint64_t max_stage_out;
    uint32_t wave_chains;       /* (sequence, head) chains the device runs at once (its SMs);
                                   0: no waves (hold.h gathers nothing) */
    uint32_t paired_chains;     /* up to this many chains run on two SMs each */
    bool sems;                  /* it writes batches' done words (stream-ordered prefills) */
    uint32_t gated_lanes;       /* gated batches it takes at once (submit_gated); 0: none */
} kd_backend_info;

struct kd_backend {
    const kd_backend_ops *ops;
    kd_backend_info info;
    kda_pool pool;              /* state memory: host (cpu) or device (cuda) */
    uv_loop_t *loop;
    kd_backend_done_cb done;
    kd_backend_steps_cb steps_done; /* may be NULL: steps are then answered with their batch */
    kd_backend_idle_cb idle;    /* may be NULL */
    void *done_ctx;             /* both callbacks' */
    uint32_t inflight;          /* batches submitted and not completed */
    uint32_t on_device;         /* of those, batches launched on the device and not finished
                                   there (not staging, not unstaging) */
    uint32_t gated_inflight;    /* gated batches submitted and not completed (not in inflight) */
    kp_memory memory;           /* what the backend allocated, counted where it allocates
                                   (total: kd_backend_memory) */
};

typedef struct kd_backend_config {
    kd_backend_kind kind;    /* config.h */
    const char *device;      /* cuda: an ordinal "N", or a GPU UUID or a unique prefix of one */
    kd_cuda_completion completion; /* cuda: how batch completion is learnt */
    uint32_t cpu_threads;    /* 0: one per CPU */
    uint32_t heads, slots;
    kda_dtype dtype;
    const uint32_t *buckets; /* cuda graph buckets, increasing; the last >= max_batch_seqs */
    uint32_t nbuckets;
    uint64_t max_inline_bytes; /* sizes the cuda staging buffers */
    bool gated_lanes;        /* cuda: set up the lanes of gated launches (ready_on_device) */
    uint64_t split_scratch_bytes; /* cuda: each kernel instance's split outputs scratch */
} kd_backend_config;

/*
 * Creates the backend a config asks for: auto tries cuda (when built in)
 * and falls back to cpu, logging why.  Returns 0, or KP_E_NOT_SUPPORTED
 * when an explicitly requested backend is unavailable (err says why), or
 * another kp_code.
 */
int kd_backend_create(uv_loop_t *loop, const kd_backend_config *cfg, kd_backend_done_cb done,
                      kd_backend_idle_cb idle, void *ctx, kd_backend **out, char *err,
                      size_t errlen);
void kd_backend_destroy(kd_backend *b);

/* Submits and counts the batch in flight. */
int kd_backend_submit(kd_backend *b, kd_batch *batch, kp_error *err);
/* A gated batch (backend_ops.submit_gated), counted in gated_inflight; the
 * ready word's outcome goes to the backend through the two calls after it. */
int kd_backend_submit_gated(kd_backend *b, kd_batch *batch, const kd_sem_word *ready,
                            kp_error *err);
void kd_backend_gated_go(kd_backend *b, kd_batch *batch);
void kd_backend_gated_cancel(kd_backend *b, kd_batch *batch, const kp_error *err);
/* Called by backends on the loop thread when a batch's device work starts
 * (cuda: enqueued on the streams; cpu: handed to the worker, its device). */
void kd_backend_launched(kd_backend *b, kd_batch *batch);
/* Called by backends on the loop thread when the device has finished a
 * batch that still has host work left (unstaging); may call the idle callback. */
void kd_backend_device_done(kd_backend *b, kd_batch *batch);
/* Called by backends on the loop thread when a batch's steps are done before the
 * rest of it (kd_backend_steps_cb; batch->steps_t set), at most once per batch. */
void kd_backend_steps_done(kd_backend *b, kd_batch *batch);
/* Called by backends on the loop thread when a batch is done (implies
 * kd_backend_device_done, without the idle callback: the done callback follows). */
void kd_backend_complete(kd_backend *b, kd_batch *batch);

/* A semaphore word: host memory through atomics (acquire / release), device
 * memory through the backend.  read: 0, or a kp_code. */
int kd_backend_read_word(kd_backend *b, kd_buf word, uint64_t *value);
void kd_backend_write_word(kd_backend *b, kd_buf word, uint64_t value);

/* The backend's memory by use, its total summed (hello, stats, the start-up line). */
kp_memory kd_backend_memory(const kd_backend *b);

/* Bytes of one slot's state in the pool's dtype. */
uint64_t kd_backend_slot_bytes(const kd_backend *b);

/* Converts n state elements between dtypes (memcpy when equal).  Host only;
 * src and dst may be unaligned. */
void kd_state_convert(void *dst, kda_dtype dst_dtype, const void *src, kda_dtype src_dtype,
                      uint64_t n);

int kd_backend_cpu_create(uv_loop_t *loop, const kd_backend_config *cfg, kd_backend **out,
                          char *err, size_t errlen);
#ifdef KDAD_HAVE_CUDA
/* KP_E_NOT_SUPPORTED when no usable GPU is present. */
int kd_backend_cuda_create(uv_loop_t *loop, const kd_backend_config *cfg, kd_backend **out,
                           char *err, size_t errlen);
#endif

#endif /* KDAD_BACKEND_H */
