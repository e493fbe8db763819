/*
 * backend_cuda.c - the cuda backend: the state pool in device memory and
 * the fused Hopper kernel (kernels/kda_cuda.h), launched by replaying CUDA
 * Graphs.  Built only when nvcc is present (KDAD_HAVE_CUDA).
 *
 * Everything is allocated once, at start: the pool, and for each of the
 * KD_CUDA_DEPTH (2) buffers of the double buffering a pinned descriptor
 * table, its device copy, pinned and device staging each way, its events,
 * a done word in pinned host memory, and one graph per size bucket.  A graph is
 *   [copy launch table -> device, record k0_ev, kernel(max_seqs = bucket), record k1_ev,
 *    write 1 to the done word]
 * where the launch table is [count of live descriptors | descriptors]: one
 * copy, so replaying the graph with a freshly written pinned table runs a new
 * batch; the kernel reads how many descriptors are live from device memory.
 * The order is measured (bench/bench_launch.cu, on the H200 host): a timing
 * event recorded before the copy delayed the kernel's end by ~9 us, one after
 * it by ~2; the done word is seen ~2 us sooner than k1_ev through
 * cudaEventQuery.
 *
 * Three streams, ordered by events, so that a batch's copies overlap the
 * kernel of the batch before it:
 *   h2d      copies in: inline bytes (one copy of the pinned staging) and
 *            shared-memory tensors (from the pinned, registered region
 *            straight into device staging), then the event in_ev
 *   stream   waits for in_ev; slot operations, the graph replay (the kernel
 *            runs on device memory only); then kernel_ev
 *   d2h      waits for kernel_ev; copies out: inline outputs and staged
 *            states (into pinned staging), shared-memory outputs (straight
 *            into the region)
 * A batch with nothing to copy (CUDA IPC regions) stays on `stream` alone.
 * Timing events bracket the whole (begin_ev .. end_ev: the batch's device
 * time) and the kernel (k0_ev .. k1_ev, recorded by the graph's own event
 * nodes).  A batch that is the graph alone (device memory, no slot
 * operations) records nothing else: every record costs the launch path a
 * driver call, so such a launch is one; its device time is the kernel's.
 *
 * A batch goes through four steps, none of which blocks the loop:
 *   1. stage   (worker thread)  inline inputs and converted states into the
 *              pinned buffer; the copy lists; descriptors (longest first).
 *              A batch that moves no bytes through pinned staging (CUDA IPC,
 *              shared memory) is staged on the loop: no thread hop
 *   2. enqueue (loop)           the copies, slot operations, graph replay and
 *              events above on the three streams
 *   3. done     a completion thread waits for each batch's end in submission
 *              order (cuda_completion: poll spins on the done word of a batch
 *              that is the graph alone and polls cudaEventQuery on the end
 *              event of any other; block sleeps in cudaEventSynchronize on a
 *              blocking-sync event) and
 *              rings the loop (uv_async; in poll mode the loop also stays
 *              awake and looks itself while batches run); the loop reads the
 *              device times
 *   4. unstage (worker thread)  inline outputs and read states out of the
 *              pinned buffer, then the completion callback (loop)
 * With two buffers, batch k+1 is staged, copied in and enqueued while batch
 * k runs, and batch k's outputs copy out while batch k+1's kernel runs.
 *
 * Shared-memory regions are pinned and mapped once (cudaHostRegisterMapped).
 * Their tensors are copied by the copy engines into device staging while it
 * has room (the scheduler counts them against the staging budget, so a
 * batch of them fits); a tensor that does not fit (a request larger than
 * the staging buffers) is read or written by the kernel through the
 * region's device alias instead.  Both paths give the same bytes.  CUDA IPC
 * regions are device memory the kernel uses directly.
 *
 * Decode steps (kd_batch_step) run the step kernel (kda_cuda_step), one
 * launch per step.  In a batch with a prefill graph they run on a fourth
 * stream, `steps`: it forks from `stream` before the batch's work there
 * (after every earlier batch's), waits for the copies in only when some step
 * input is staged, and joins `stream` again before the copies out, so the
 * steps run beside the prefill graph instead of behind its chains (their
 * slots differ from the graph's: a batch names each slot once, and a slot's
 * next request forms only after its batch is done, or, for a step answered
 * apart, its next batch runs after this one's join).  When no step output
 * waits for the copies out, the steps are answered apart: s0_ev and s1_ev
 * bracket them and they write their own done word (steps_done_host), which
 * the completion thread watches before the batch's end, so their requests
 * are answered when the steps are done (kd_backend_steps_done), not when the
 * prefill is.  Their descriptors go in one copy of the step table
 * [kda_step x nsteps | kda_step_seq x sequences]; inline inputs and outputs
 * are staged as a prefill's, region tensors used in place (shared memory
 * through its device alias).  The step kernel reads its descriptors from
 * device memory when it runs, so it is graph-safe.  A batch of steps alone
 * (no prefill graph to run beside) stays on `stream`: no fork, no join.  With
 * nothing to copy out it is watched through its done word, written after its
 * last event; with nothing to copy at all and no slot operations it is, like
 * a graph-only batch, [step table copy, k0_ev, step kernel, k1_ev, done
 * word]: one step is the replay of the buffer's step graph for its size
 * bucket (one driver call; captured for the bucket's sequences, its kernel's
 * blocks past the step's own exit at once), several steps five calls and one
 * per further step.  A driver that cannot capture the step graphs gets the
 * direct launches.
 *
 * Gated prefills (a ready word not written yet) whose tensors are all device
 * memory may be queued before their words come, each on a lane of its own
 * behind a cuStreamWaitValue64 (cuda_lane, submit_gated): the GPU starts the
 * kernel when the client's stream writes the word.  A lane shares nothing with
 * the batches above (stream, kernel counters, table, graphs, staging, the
 * in-flight count); the loop watches its end word once the word was reached.
 *
 * Any CUDA error during a batch is treated as fatal (KD_BATCH_FATAL): the
 * context cannot be trusted afterwards, and kdad exits so that systemd
 * restarts it with a fresh one.
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <unistd.h>

#include <cuda.h> /* driver types (VMM, cuMemGetAddressRange, stream writes), reached through the runtime */
#include <cuda_runtime_api.h>

#include "backend.h"
#include "defaults.h"
#include "kda_cuda.h"
#include "log.h"

typedef enum buf_state {
    BUF_FREE = 0,
    BUF_STAGING,   /* step 1 on a worker */
    BUF_RUNNING,   /* enqueued on the streams */
    BUF_UNSTAGING, /* step 4 on a worker */
} buf_state;

/* A staged output: device bytes [off, off + bytes) of out_dev come back to
 * `host`, converted from the pool dtype to `dtype` (or copied). */
typedef struct stage_out {
    void *host;
    uint64_t off;
    uint64_t elems;    /* state elements for READ, else 0 (plain copy of bytes) */
    uint64_t bytes;
    kda_dtype dtype;
} stage_out;

/* One copy between a shared-memory region (pinned host memory) and device
 * staging; adjacent tensors are merged into one copy. */
typedef struct xfer {
    uint8_t *dev;
    uint8_t *host;
    uint64_t bytes;
} xfer;

typedef struct xfer_list {
    xfer *v;
    uint32_t n, cap;
} xfer_list;

/* The launch table: the count, padded so that the descriptors after it are aligned. */
#define TABLE_HEAD 64
/* A lane's table head also holds its done word's address and value (cuda_lane). */
#define LANE_DONE_ADDR 8
#define LANE_DONE_VALUE 16
static size_t table_bytes(uint32_t nseqs)
{
    return TABLE_HEAD + (size_t)nseqs * sizeof(kda_seq);
}

typedef struct cuda_buf {
    struct cuda_backend *owner;
    buf_state state;
    uint64_t seq;           /* submission number: batches finish in this order */
    kd_batch *batch;
    uv_work_t work;
    uint8_t *table_host, *table_dev; /* the launch table: pinned, and its device copy */
    int32_t *count_host, *count_dev; /* in the table: how many descriptors are live */
    kda_seq *desc_host, *desc_dev;   /* in the table: max_seqs descriptors */
    uint8_t *in_host, *in_dev;   /* staging towards the device */
    uint8_t *out_host, *out_dev; /* staging back */
    uint64_t in_pinned, out_pinned; /* bytes of [0, n) that go through the pinned buffers */
    uint64_t in_used, out_used;     /* device staging in use (pinned part, then shm copies) */
    xfer_list shm_in, shm_out;      /* shared-memory tensors copied by the copy engines */
    uint64_t *op_off;       /* per op: staging offset, or UINT64_MAX when not staged */
    stage_out *outs;
    uint32_t nouts, outs_cap, ops_cap;
    cudaEvent_t in_ev, kernel_ev;                 /* cross-stream order */
    cudaEvent_t begin_ev, k0_ev, k1_ev, end_ev;   /* timing */
    cudaEvent_t first_ev, last_ev;                /* this batch's bracket; last_ev completes it */
    uint8_t *steps_host, *steps_dev; /* the step table: pinned, and its device copy */
    uint32_t steps_cap;     /* steps, and step sequences, it holds */
    uint64_t steps_bytes;   /* of this batch's table */
    bool steps_in, steps_out; /* some step's inputs / outputs go through staging */
    cudaEvent_t fork_ev, join_ev;                 /* the steps stream's order against `stream` */
    cudaEvent_t s0_ev, s1_ev; /* the steps of a batch that answers them apart (timing; s1_ev
                                 tells their end when steps_done_host cannot) */
    bool steps_apart;       /* this batch's steps are answered when they end (kd_backend_steps_done) */
    uint32_t *done_host;    /* the graphs write 1 here last (pinned, mapped); NULL: they do not */
    CUdeviceptr done_dev;   /* its device alias */
    uint32_t *steps_done_host; /* the steps stream writes 1 here after steps answered apart */
    CUdeviceptr steps_done_dev;
    bool watch_done;        /* this batch is the graph alone: done_host tells its end */
    cudaGraphExec_t *graphs; /* one per bucket */
    /* one per bucket: [step table copy, k0_ev, step kernel, k1_ev, done word] for a batch of one
     * step alone (NULL: its steps are launched directly) */
    cudaGraphExec_t *step_graphs;
    /* set by the completion thread (under the backend's mutex) */
    cudaError_t sync_err;
    uint64_t signaled_ns;
    uint64_t steps_signaled_ns;
} cuda_buf;

typedef CUresult (*get_range_fn)(CUdeviceptr *base, size_t *size, CUdeviceptr ptr);
typedef CUresult (*write_value_fn)(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned flags);
typedef CUresult (*write_value64_fn)(CUstream stream, CUdeviceptr addr, cuuint64_t value,
                                     unsigned flags);
typedef CUresult (*wait_value64_fn)(CUstream stream, CUdeviceptr addr, cuuint64_t value,
                                    unsigned flags);

typedef enum lane_state {
    LANE_FREE = 0,
    LANE_WAITING,  /* queued behind the device-side wait for its ready word */
    LANE_WATCHED,  /* the word was reached (or written by kdad on cancel): its end is watched */
} lane_state;

/*
 * A gated prefill's own launch (backend.h, submit_gated): a stream, a kernel
 * instance (its scheduler counters and scratch: two persistent kernels must not
 * share them), a launch table and one graph per bucket, so that nothing of the
 * double-buffered batches waits for the word.  On its stream:
 *   wait ready >= its value,
 *   graph [upload table, k0_ev, kernel, k1_ev, store the table's done value at its done address],
 *   end_ev, write 1 -> end word
 * The table's head holds [count | done address | done value] (LANE_DONE_*), all read on the
 * device when the graph runs.  Called off (the word never came): the count becomes 0 and the
 * done value value | KP_SEM_FAILED in the pinned table (the upload copies them once the wait
 * is released: the kernel runs no work, the done word gets the failure value), then kdad
 * itself stores the ready value into the ready word, which releases the wait.
 */
typedef struct cuda_lane {
    lane_state state;
    kd_batch *batch;
    cudaStream_t stream;
    kda_cuda *k;
    uint8_t *table_host, *table_dev;
    cudaGraphExec_t *graphs;     /* one per bucket */
    cudaEvent_t k0_ev, k1_ev, end_ev;
    uint32_t *end_host;          /* written 1 last (pinned, mapped); NULL: end_ev is asked */
    CUdeviceptr end_dev;
    kd_sem_word ready;
    bool cancelled;
    uint64_t ask_ns;             /* next time end_ev is asked for a device fault */
} cuda_lane;

/* The driver's VMM calls that open a client's exported allocation (posix_fd regions); all NULL
 * if the driver lacks one of them. */
typedef struct vmm_api {
    CUresult (*import)(CUmemGenericAllocationHandle *h, void *os_handle, CUmemAllocationHandleType t);
    CUresult (*props)(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h);
    CUresult (*granularity)(size_t *g, const CUmemAllocationProp *prop, CUmemAllocationGranularity_flags o);
    CUresult (*reserve)(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags);
    CUresult (*map)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                    unsigned long long flags);
    CUresult (*set_access)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
    CUresult (*unmap)(CUdeviceptr ptr, size_t size);
    CUresult (*free_va)(CUdeviceptr ptr, size_t size);
    CUresult (*release)(CUmemGenericAllocationHandle h);
} vmm_api;

/* A client's device memory as the backend holds it (the region's handle). */
typedef struct cuda_region {
    void *ptr;
    bool vmm;                           /* posix_fd: imported and mapped here */
    size_t mapped;                      /* VMM: bytes reserved and mapped at ptr */
    CUmemGenericAllocationHandle alloc; /* VMM: the imported allocation */
} cuda_region;

typedef struct cuda_backend {
    kd_backend base;
    kda_cuda *k;
    int device;
    cudaStream_t stream;     /* slot operations and kernels, every batch in order */
    cudaStream_t h2d, d2h;   /* copies in and out, in order, overlapping other batches */
    cudaStream_t aux;        /* layer uploads, off the batch streams */
    cudaStream_t steps;      /* step kernels, beside the prefill graph of their batch */
    uint32_t *buckets;
    uint32_t nbuckets;
    uint64_t stage_bytes;    /* each staging buffer, each way */
    cuda_buf buf[KD_CUDA_DEPTH];
    uint64_t next_seq;
    uv_async_t wake;         /* the completion thread's doorbell */
    uv_idle_t spin;          /* poll mode: keeps the loop awake while batches run */
    int handles_open;
    bool fatal;
    get_range_fn get_range;  /* NULL if the driver does not export it */
    write_value_fn write_value; /* cuStreamWriteValue32, for the done words; NULL if absent */
    uint32_t *done_words;    /* one per buffer, pinned and mapped */
    write_value64_fn write_value64; /* cuStreamWriteValue64, for requests' done words; NULL: the
                                       backend offers no semaphores */
    wait_value64_fn wait_value64;   /* cuStreamWaitValue64, for the lanes */
    cuda_lane lanes[KD_CUDA_GATED_LANES];
    uint32_t nlanes;         /* lanes set up (0: gated prefills wait on the host) */
    uint32_t *lane_words;    /* the lanes' end words, pinned and mapped */
    uv_idle_t lane_spin;     /* watches lanes whose words were reached */
    vmm_api vmm;
    /* The completion thread and what it shares with the loop (under mu). */
    kd_cuda_completion completion;
    pthread_t waiter;
    bool waiter_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    cuda_buf *pending[KD_CUDA_DEPTH]; /* enqueued, not yet seen done: submission order */
    uint32_t npending;
    cuda_buf *signaled[KD_CUDA_DEPTH]; /* seen done, not yet taken by the loop: in order */
    uint32_t nsignaled;
    cuda_buf *steps_signaled[KD_CUDA_DEPTH]; /* steps answered apart seen done, not yet taken */
    uint32_t nsteps_signaled;
    int stop;                /* the thread exits (read atomically while it polls) */
} cuda_backend;

/* A CUDA failure while setting up: message and KP_E_* code. */
static int cuda_err(char *err, size_t errlen, cudaError_t e, const char *what)
{
    snprintf(err, errlen, "%s: %s", what, cudaGetErrorString(e));
    return KP_E_INTERNAL;
}

static uint8_t *slot_ptr(const cuda_backend *cb, uint32_t slot)
{
    return (uint8_t *)cb->base.pool.state + (uint64_t)slot * kd_backend_slot_bytes(&cb->base);
}

static uint64_t round_stage(uint64_t n)
{
    return (n + KD_STAGE_ALIGN - 1) / KD_STAGE_ALIGN * KD_STAGE_ALIGN;
}

/* ---------------------------------------------------------------------- */
/* Step 1: stage (no CUDA calls: it may run on a worker thread)            */
/* ---------------------------------------------------------------------- */

static int by_length_desc(const void *a, const void *b)
{
    const kda_seq *x = a, *y = b;
    return (x->len < y->len) - (x->len > y->len);
}

/* Reserves n bytes of pinned staging at *used; false when the buffer would
 * overflow (the scheduler's cost accounting, exec.c with the same rounding,
 * makes that a daemon bug). */
static bool take(const cuda_backend *cb, uint64_t *used, uint64_t n, uint64_t *off)
{
    uint64_t r = round_stage(n);
    if (r < n || *used > cb->stage_bytes || r > cb->stage_bytes - *used)
        return false;
    *off = *used;
    *used += r;
    return true;
}

/*
 * Places n bytes of a shared-memory tensor at `host` in device staging
 * (base, *used) and adds its copy to l, merged with the previous copy when
 * the tensor follows it in the region (then it also follows it in staging,
 * which keeps the 16-byte alignment of region offsets).  NULL when staging
 * has no room left: the kernel then uses the region's device alias.
 */
static uint8_t *take_shm(const cuda_backend *cb, uint8_t *base, uint64_t *used, xfer_list *l,
                         uint8_t *host, uint64_t n)
{
    const uint64_t cap = cb->stage_bytes;
    xfer *last = l->n ? &l->v[l->n - 1] : NULL;
    if (last && last->host + last->bytes == host && last->dev + last->bytes == base + *used) {
        if (*used > cap || n > cap - *used)
            return NULL;
        uint8_t *dst = base + *used;
        *used += n;
        last->bytes += n;
        return dst;
    }
    uint64_t off = round_stage(*used);
    if (off < *used || off > cap || n > cap - off)
        return NULL;
    if (l->n == l->cap) {
        uint32_t c = l->cap ? 2 * l->cap : 16;
        xfer *v = realloc(l->v, c * sizeof(*v));
        if (!v)
            return NULL;
        l->v = v;
        l->cap = c;
    }
    l->v[l->n++] = (xfer){base + off, host, n};
    *used = off + n;
    return base + off;
}

static void add_out(cuda_buf *bf, void *host, uint64_t off, uint64_t bytes, uint64_t elems,
                    kda_dtype dtype)
{
    bf->outs[bf->nouts++] = (stage_out){host, off, elems, bytes, dtype};
}

/* Makes room for a batch's bookkeeping arrays (worker thread). */
static bool reserve(cuda_buf *bf, const kd_batch *b)
{
    uint32_t outs = b->nseqs + b->nops + b->nsteps;
    if (outs > bf->outs_cap) {
        stage_out *o = realloc(bf->outs, outs * sizeof(*o));
        if (!o)
            return false;
        bf->outs = o;
        bf->outs_cap = outs;
    }
    if (b->nops > bf->ops_cap) {
        uint64_t *off = realloc(bf->op_off, b->nops * sizeof(*off));
        if (!off)
            return false;
        bf->op_off = off;
        bf->ops_cap = b->nops;
    }
    return true;
}

static void stage_fail(kd_batch *b, int code, const char *what)
{
    b->status = KD_BATCH_FAILED;
    b->code = code;
    snprintf(b->message, sizeof(b->message), "cuda backend: %s", what);
}

/* Whether a buffer is a shared-memory region's: pinned host memory with a
 * device alias (inline tensors have no alias, CUDA IPC memory no host address). */
static bool is_shm(kd_buf b)
{
    return b.host && b.dev;
}

/* The step table and the steps' inline tensors (pass 1); false when the batch failed. */
static bool stage_steps(cuda_backend *cb, cuda_buf *bf, kd_batch *b)
{
    const int32_t heads = cb->base.pool.heads;
    uint32_t nseqs = 0;
    for (uint32_t s = 0; s < b->nsteps; s++)
        nseqs += b->steps[s].nseqs;
    bf->steps_bytes = 0;
    bf->steps_in = bf->steps_out = false;
    if (b->nsteps == 0)
        return true;
    if (b->nsteps > bf->steps_cap || nseqs > bf->steps_cap) {
        stage_fail(b, KP_E_INTERNAL, "a batch overflows the step table");
        return false;
    }
    kda_step *steps = (kda_step *)bf->steps_host;
    kda_step_seq *seqs = (kda_step_seq *)(bf->steps_host + b->nsteps * sizeof(kda_step));
    const kda_step_seq *seqs_dev =
        (const kda_step_seq *)(bf->steps_dev + b->nsteps * sizeof(kda_step));
    uint32_t used = 0;
    for (uint32_t s = 0; s < b->nsteps; s++) {
        const kd_batch_step *st = &b->steps[s];
        const void *in[5];
        for (int t = 0; t < 5; t++) {
            if (st->in[t].dev) {
                in[t] = st->in[t].dev; /* CUDA IPC, or shared memory through its alias */
                continue;
            }
            uint64_t n = (uint64_t)st->tokens * heads * (t == 4 ? 2 : 2 * KDA_HEAD_DIM), off;
            if (!take(cb, &bf->in_used, n, &off)) {
                stage_fail(b, KP_E_INTERNAL, "a batch overflows the staging buffers");
                return false;
            }
            memcpy(bf->in_host + off, st->in[t].host, n);
            in[t] = bf->in_dev + off;
            bf->steps_in = true;
        }
        void *out = st->out.dev;
        if (!out) {
            uint64_t n = (uint64_t)st->tokens * heads * 2 * KDA_HEAD_DIM, off;
            if (!take(cb, &bf->out_used, n, &off)) {
                stage_fail(b, KP_E_INTERNAL, "a batch overflows the staging buffers");
                return false;
            }
            add_out(bf, st->out.host, off, n, 0, KDA_DTYPE_BF16);
            out = bf->out_dev + off;
            bf->steps_out = true;
        }
        memcpy(seqs + used, st->seqs, st->nseqs * sizeof(*seqs));
        steps[s] = (kda_step){.q = in[0], .k = in[1], .v = in[2], .g = in[3], .beta = in[4],
                              .out = out, .states = st->states.dev, .layer = st->layer,
                              .seqs = seqs + used, .nseqs = (int32_t)st->nseqs,
                              .tokens = (int32_t)st->tokens};
        /* As for the prefill table: a step the kernel would refuse is a daemon bug. */
        kda_error kerr;
        if (st->states.host && !st->states.dev) {
            stage_fail(b, KP_E_INTERNAL, "states: not in memory the device can write");
            return false;
        }
        if (kda_cuda_step_check(&cb->base.pool, &steps[s], &kerr)) {
            char what[220];
            snprintf(what, sizeof(what), "%.200s", kerr.msg);
            stage_fail(b, KP_E_INTERNAL, what);
            return false;
        }
        steps[s].seqs = seqs_dev + used;
        used += st->nseqs;
    }
    bf->steps_bytes = b->nsteps * sizeof(kda_step) + (uint64_t)used * sizeof(kda_step_seq);
    return true;
}

static void stage_work(uv_work_t *w)
{
    cuda_buf *bf = w->data;
    cuda_backend *cb = bf->owner;
    kd_batch *b = bf->batch;
    const int32_t heads = cb->base.pool.heads;
    const kda_dtype pool_dtype = cb->base.pool.dtype;
    const uint64_t elems = (uint64_t)kda_slot_elems(heads);
    const uint64_t state_bytes = kd_backend_slot_bytes(&cb->base);
    bf->in_used = bf->out_used = 0;
    bf->shm_in.n = bf->shm_out.n = 0;
    bf->nouts = 0;
    if (!reserve(bf, b)) {
        stage_fail(b, KP_E_NO_MEMORY, "no memory to stage a batch");
        return;
    }

    /* Pass 1: what goes through the pinned buffers (converted states, inline
     * tensors); it always fits. */
    for (uint32_t i = 0; i < b->nops; i++) {
        const kd_slot_op *op = &b->ops[i];
        bool staged = (op->kind == KD_OP_READ || op->kind == KD_OP_WRITE) &&
                      (!op->buf.dev || op->dtype != pool_dtype);
        bf->op_off[i] = UINT64_MAX;
        if (!staged)
            continue;
        uint64_t off;
        if (!take(cb, op->kind == KD_OP_WRITE ? &bf->in_used : &bf->out_used, state_bytes,
                  &off)) {
            stage_fail(b, KP_E_INTERNAL, "a batch overflows the staging buffers");
            return;
        }
        bf->op_off[i] = off;
        if (op->kind == KD_OP_WRITE)
            kd_state_convert(bf->in_host + off, pool_dtype, op->buf.host, op->dtype, elems);
        else
            add_out(bf, op->buf.host, off, state_bytes, elems, op->dtype);
    }

    for (uint32_t i = 0; i < b->nseqs; i++) {
        const kd_batch_seq *q = &b->seqs[i];
        const void *in[5];
        for (int t = 0; t < 5; t++) {
            if (q->in[t].dev) {
                in[t] = q->in[t].dev; /* CUDA IPC, or shm (maybe replaced in pass 2) */
                continue;
            }
            uint64_t n = (uint64_t)q->len * heads * (t == 4 ? 2 : 2 * KDA_HEAD_DIM), off;
            if (!take(cb, &bf->in_used, n, &off)) {
                stage_fail(b, KP_E_INTERNAL, "a batch overflows the staging buffers");
                return;
            }
            memcpy(bf->in_host + off, q->in[t].host, n);
            in[t] = bf->in_dev + off;
        }
        void *out = q->out.dev;
        if (!out) {
            uint64_t n = (uint64_t)q->len * heads * 2 * KDA_HEAD_DIM, off;
            if (!take(cb, &bf->out_used, n, &off)) {
                stage_fail(b, KP_E_INTERNAL, "a batch overflows the staging buffers");
                return;
            }
            add_out(bf, q->out.host, off, n, 0, KDA_DTYPE_BF16);
            out = bf->out_dev + off;
        }
        bf->desc_host[i] = (kda_seq){.q = in[0], .k = in[1], .v = in[2], .g = in[3],
                                     .beta = in[4], .out = out, .layer = q->layer,
                                     .len = q->len, .slot = q->slot, .flags = q->flags};
    }
    if (!stage_steps(cb, bf, b))
        return;
    bf->in_pinned = bf->in_used;
    bf->out_pinned = bf->out_used;

    /* Pass 2: shared-memory tensors into device staging while it has room. */
    for (uint32_t i = 0; i < b->nseqs; i++) {
        const kd_batch_seq *q = &b->seqs[i];
        kda_seq *d = &bf->desc_host[i];
        const uint16_t **in[5] = {&d->q, &d->k, &d->v, &d->g, &d->beta};
        for (int t = 0; t < 5; t++) {
            if (!is_shm(q->in[t]))
                continue;
            uint64_t n = (uint64_t)q->len * heads * (t == 4 ? 2 : 2 * KDA_HEAD_DIM);
            uint8_t *dst = take_shm(cb, bf->in_dev, &bf->in_used, &bf->shm_in, q->in[t].host, n);
            if (dst)
                *in[t] = (const uint16_t *)dst;
        }
        if (is_shm(q->out)) {
            uint64_t n = (uint64_t)q->len * heads * 2 * KDA_HEAD_DIM;
            uint8_t *dst = take_shm(cb, bf->out_dev, &bf->out_used, &bf->shm_out, q->out.host, n);
            if (dst)
                d->out = (uint16_t *)dst;
        }
    }

    /* Longest first: the kernel hands out work items in table order. */
    qsort(bf->desc_host, b->nseqs, sizeof(kda_seq), by_length_desc);
    *bf->count_host = (int32_t)b->nseqs;
    /* The daemon built this table from checked requests; a table the kernel
     * would refuse is a daemon bug, and must not reach the device. */
    kda_error kerr;
    if (b->nseqs && kda_cuda_batch_check(&cb->base.pool, bf->desc_host, b->nseqs, &kerr)) {
        char what[220];
        snprintf(what, sizeof(what), "%.200s", kerr.msg);
        stage_fail(b, KP_E_INTERNAL, what);
    }
    b->t.staged_ns = uv_hrtime();
}

/* ---------------------------------------------------------------------- */
/* Step 2: enqueue (loop)                                                 */
/* ---------------------------------------------------------------------- */

static void fail_fatal(kd_batch *b, cudaError_t e, const char *what)
{
    b->status = KD_BATCH_FATAL;
    b->code = KP_E_DEVICE_FAILED;
    snprintf(b->message, sizeof(b->message), "%s: %s", what, cudaGetErrorString(e));
}

static cudaError_t enqueue_op(cuda_backend *cb, cuda_buf *bf, uint32_t i)
{
    const kd_slot_op *op = &bf->batch->ops[i];
    uint64_t bytes = kd_backend_slot_bytes(&cb->base);
    uint8_t *slot = slot_ptr(cb, op->slot);
    switch (op->kind) {
    case KD_OP_ZERO:
        return cudaMemsetAsync(slot, 0, bytes, cb->stream);
    case KD_OP_COPY:
        return cudaMemcpyAsync(slot, slot_ptr(cb, op->src), bytes, cudaMemcpyDeviceToDevice,
                               cb->stream);
    case KD_OP_WRITE:
        if (bf->op_off[i] != UINT64_MAX)
            return cudaMemcpyAsync(slot, bf->in_dev + bf->op_off[i], bytes,
                                   cudaMemcpyDeviceToDevice, cb->stream);
        return cudaMemcpyAsync(slot, op->buf.dev, bytes, cudaMemcpyDefault, cb->stream);
    case KD_OP_READ:
        if (bf->op_off[i] != UINT64_MAX)
            return cudaMemcpyAsync(bf->out_dev + bf->op_off[i], slot, bytes,
                                   cudaMemcpyDeviceToDevice, cb->stream);
        return cudaMemcpyAsync(op->buf.dev, slot, bytes, cudaMemcpyDefault, cb->stream);
    }
    return cudaErrorInvalidValue;
}

static uint32_t bucket_for(const cuda_backend *cb, uint32_t nseqs)
{
    uint32_t i = 0;
    while (i + 1 < cb->nbuckets && cb->buckets[i] < nseqs)
        i++;
    return i;
}

static void finish(cuda_buf *bf);

static void on_wake(uv_async_t *a);

/*
 * Poll mode, while batches run: the loop does not sleep in epoll but looks
 * for batches the completion thread has seen finish on every turn.  Waking a
 * sleeping loop through the doorbell took 20-50 us per batch on the H200
 * host (a virtual machine); this costs the loop's core while the GPU works,
 * as the polling completion thread already does.  Stops when none is left.
 */
static void on_spin(uv_idle_t *h)
{
    cuda_backend *cb = h->data;
    pthread_mutex_lock(&cb->mu);
    const bool signaled = cb->nsignaled > 0 || cb->nsteps_signaled > 0,
               running = cb->npending > 0;
    pthread_mutex_unlock(&cb->mu);
    if (signaled)
        on_wake(&cb->wake);   /* the doorbell's callback then finds nothing left */
    else if (!running)
        uv_idle_stop(&cb->spin);
}

/* Hands a running buffer to the completion thread (submission order). */
static void wait_for(cuda_backend *cb, cuda_buf *bf)
{
    pthread_mutex_lock(&cb->mu);
    cb->pending[cb->npending++] = bf;
    pthread_cond_signal(&cb->cv);
    pthread_mutex_unlock(&cb->mu);
    if (cb->completion == KD_CUDA_COMPLETION_POLL)
        uv_idle_start(&cb->spin, on_spin);
}

/* The steps of a batch.  Beside a prefill graph they run on the steps stream,
 * forked from `stream` before this batch's work there (after every earlier
 * batch's: their slots may be the same), and behind the copies in only when
 * some of their inputs are staged; the caller joins them back before the
 * copies out.  Answered apart (steps_apart), they are bracketed by s0_ev and
 * s1_ev, then write their done word.  Without a prefill graph (steps alone,
 * the decode loop's batches) they run on `stream` itself: the fork and join are
 * four driver calls and two cross-stream waits on the device for nothing to
 * overlap; the kernel's timing events then bracket them (a prefill graph
 * records its own), and one step with nothing else to do is the replay of
 * the step graph of its size bucket (graph). */
static cudaError_t enqueue_steps(cuda_backend *cb, cuda_buf *bf, bool graph, const char **what)
{
    const kd_batch *b = bf->batch;
    const bool alone = b->nseqs == 0;
    cudaStream_t s_steps = alone ? cb->stream : cb->steps;
    cudaError_t e = cudaSuccess;
    *what = "launching the steps";
    if (graph) /* k0_ev, kernel, k1_ev, done word; its blocks past the step's sequences exit */
        return cudaGraphLaunch(bf->step_graphs[bucket_for(cb, b->steps[0].nseqs)], cb->stream);
    if (!alone) {
        e = cudaEventRecord(bf->fork_ev, cb->stream);
        if (e == cudaSuccess)
            e = cudaStreamWaitEvent(cb->steps, bf->fork_ev, 0);
        if (e == cudaSuccess && bf->steps_in)
            e = cudaStreamWaitEvent(cb->steps, bf->in_ev, 0);
    }
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(bf->steps_dev, bf->steps_host, bf->steps_bytes,
                            cudaMemcpyHostToDevice, s_steps);
    cudaEvent_t t0 = alone ? bf->k0_ev : bf->s0_ev, t1 = alone ? bf->k1_ev : bf->s1_ev;
    const bool timed = alone || bf->steps_apart;
    if (e == cudaSuccess && timed)
        e = cudaEventRecord(t0, s_steps);
    const kda_step *steps = (const kda_step *)bf->steps_dev;
    for (uint32_t s = 0; e == cudaSuccess && s < b->nsteps; s++) {
        kda_error kerr;
        if (kda_cuda_step(cb->k, &cb->base.pool, steps + s, (int32_t)b->steps[s].nseqs, s_steps,
                          &kerr) != KDA_OK) {
            e = cudaGetLastError();
            if (e == cudaSuccess)
                e = cudaErrorLaunchFailure;
        }
    }
    if (e == cudaSuccess && timed)
        e = cudaEventRecord(t1, s_steps);
    if (e == cudaSuccess && bf->steps_apart && bf->steps_done_host &&
        cb->write_value((CUstream)cb->steps, bf->steps_done_dev, 1, 0) != CUDA_SUCCESS)
        e = cudaErrorUnknown;
    if (e == cudaSuccess && !alone)
        e = cudaEventRecord(bf->join_ev, cb->steps);
    return e;
}

/* Queues a staged batch on the streams; a failure here means the context is
 * unusable (what names the step). */
static cudaError_t enqueue(cuda_backend *cb, cuda_buf *bf, const char **what)
{
    kd_batch *b = bf->batch;
    cudaError_t e = cudaSuccess;
    bool copy_in = bf->in_pinned || bf->shm_in.n;
    bool copy_out = bf->out_pinned || bf->shm_out.n;
    bool graph_only = !copy_in && !copy_out && b->nops == 0 && b->nseqs > 0 && b->nsteps == 0;
    /* steps alone, nothing to copy out: the done word follows their last event */
    bool steps_only = b->nsteps > 0 && b->nseqs == 0 && !copy_out;
    /* the step kernels alone (no copies, no slot operations): their timing events are the
     * batch's bracket, as a graph's are, and no other event is recorded */
    bool steps_bare = steps_only && !copy_in && b->nops == 0;
    /* one step alone: the step graph writes the done word itself */
    bool step_graph = steps_bare && b->nsteps == 1 && b->ndones == 0 && bf->step_graphs;
    bool kernel_only = graph_only || steps_bare;
    bf->first_ev = kernel_only ? bf->k0_ev : bf->begin_ev;
    bf->last_ev = kernel_only ? bf->k1_ev : bf->end_ev;
    bf->watch_done = (graph_only || steps_only) && bf->done_host != NULL;
    /* steps beside a prefill, none of whose outputs wait for the copies out */
    bf->steps_apart = b->nsteps > 0 && b->nseqs > 0 && !bf->steps_out && cb->base.steps_done;
    if (bf->watch_done)
        __atomic_store_n(bf->done_host, 0, __ATOMIC_RELAXED); /* the launch call orders it */
    if (bf->steps_apart && bf->steps_done_host)
        __atomic_store_n(bf->steps_done_host, 0, __ATOMIC_RELAXED);
    *what = "copying inputs to the device";
    if (copy_in) {
        e = cudaEventRecord(bf->begin_ev, cb->h2d);
        if (e == cudaSuccess && bf->in_pinned)
            e = cudaMemcpyAsync(bf->in_dev, bf->in_host, bf->in_pinned, cudaMemcpyHostToDevice,
                                cb->h2d);
        for (uint32_t i = 0; e == cudaSuccess && i < bf->shm_in.n; i++) {
            const xfer *x = &bf->shm_in.v[i];
            e = cudaMemcpyAsync(x->dev, x->host, x->bytes, cudaMemcpyHostToDevice, cb->h2d);
        }
        if (e == cudaSuccess)
            e = cudaEventRecord(bf->in_ev, cb->h2d);
    } else if (!kernel_only) {
        e = cudaEventRecord(bf->begin_ev, cb->stream);
    }
    if (e == cudaSuccess && b->nsteps > 0 && b->nseqs > 0)
        e = enqueue_steps(cb, bf, false, what); /* forked before the wait for the copies in */
    if (e == cudaSuccess && copy_in) {
        *what = "copying inputs to the device";
        e = cudaStreamWaitEvent(cb->stream, bf->in_ev, 0);
    }
    for (uint32_t i = 0; e == cudaSuccess && i < b->nops; i++) {
        *what = "a slot operation";
        e = enqueue_op(cb, bf, i);
    }
    if (e == cudaSuccess && b->nsteps > 0 && b->nseqs == 0)
        e = enqueue_steps(cb, bf, step_graph, what);
    if (e == cudaSuccess && b->nseqs > 0) {
        *what = "replaying the prefill graph"; /* it records k0_ev and k1_ev itself */
        e = cudaGraphLaunch(bf->graphs[bucket_for(cb, b->nseqs)], cb->stream);
    }
    if (e == cudaSuccess && b->nsteps > 0 && b->nseqs > 0) {
        *what = "joining the steps";
        e = cudaStreamWaitEvent(cb->stream, bf->join_ev, 0);
    }
    if (e == cudaSuccess && copy_out) {
        *what = "copying outputs from the device";
        e = cudaEventRecord(bf->kernel_ev, cb->stream);
        if (e == cudaSuccess)
            e = cudaStreamWaitEvent(cb->d2h, bf->kernel_ev, 0);
        if (e == cudaSuccess && bf->out_pinned)
            e = cudaMemcpyAsync(bf->out_host, bf->out_dev, bf->out_pinned,
                                cudaMemcpyDeviceToHost, cb->d2h);
        for (uint32_t i = 0; e == cudaSuccess && i < bf->shm_out.n; i++) {
            const xfer *x = &bf->shm_out.v[i];
            e = cudaMemcpyAsync(x->host, x->dev, x->bytes, cudaMemcpyDeviceToHost, cb->d2h);
        }
    }
    /* Requests' done words (PROTOCOL.md §Stream-ordered requests), after the
     * last write of the batch on the stream that makes it: the copies out,
     * else the kernels.  A captured graph cannot hold per-request words, so
     * they follow its launch on the same stream. */
    for (uint32_t i = 0; e == cudaSuccess && i < b->ndones; i++) {
        *what = "writing a done word";
        CUresult r = cb->write_value64((CUstream)(copy_out ? cb->d2h : cb->stream),
                                       (CUdeviceptr)(uintptr_t)b->dones[i].buf.dev,
                                       b->dones[i].value, 0);
        if (r != CUDA_SUCCESS)
            e = cudaErrorUnknown;
    }
    if (e == cudaSuccess && !kernel_only) {
        *what = "recording the completion event";
        e = cudaEventRecord(bf->end_ev, copy_out ? cb->d2h : cb->stream);
    }
    if (e == cudaSuccess && steps_only && bf->watch_done && !step_graph) {
        *what = "writing the done word";
        if (cb->write_value((CUstream)cb->stream, bf->done_dev, 1, 0) != CUDA_SUCCESS)
            e = cudaErrorUnknown;
    }
    if (e == cudaSuccess) {
        b->t.launched_ns = uv_hrtime();
        kd_backend_launched(&cb->base, b);
        bf->state = BUF_RUNNING;
        bf->seq = cb->next_seq++;
        wait_for(cb, bf);
    }
    return e;
}

static void stage_after(uv_work_t *w, int status)
{
    cuda_buf *bf = w->data;
    cuda_backend *cb = bf->owner;
    kd_batch *b = bf->batch;
    const char *what;
    cudaError_t e;
    if (b->status != KD_BATCH_OK || cb->fatal) {
        if (cb->fatal && b->status == KD_BATCH_OK)
            fail_fatal(b, cudaErrorContextIsDestroyed, "earlier device failure");
        finish(bf);
    } else if ((e = enqueue(cb, bf, &what)) != cudaSuccess) {
        cb->fatal = true;
        fail_fatal(b, e, what);
        finish(bf);
    }
}

/* Whether a batch moves any bytes through the pinned staging buffers (else
 * its descriptors and copy lists are all it needs, cheap to build on the loop). */
static bool needs_staging(const cuda_backend *cb, const kd_batch *b)
{
    for (uint32_t i = 0; i < b->nops; i++) {
        const kd_slot_op *op = &b->ops[i];
        if ((op->kind == KD_OP_READ || op->kind == KD_OP_WRITE) &&
            (!op->buf.dev || op->dtype != cb->base.pool.dtype))
            return true;
    }
    for (uint32_t i = 0; i < b->nseqs; i++) {
        for (int t = 0; t < 5; t++) {
            if (!b->seqs[i].in[t].dev)
                return true;
        }
        if (!b->seqs[i].out.dev)
            return true;
    }
    for (uint32_t s = 0; s < b->nsteps; s++) {
        for (int t = 0; t < 5; t++) {
            if (!b->steps[s].in[t].dev)
                return true;
        }
        if (!b->steps[s].out.dev)
            return true;
    }
    return false;
}

/* ---------------------------------------------------------------------- */
/* Step 3: the completion thread                                          */
/* ---------------------------------------------------------------------- */

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Spins about ns nanoseconds without touching the driver. */
static void pause_ns(uint64_t ns)
{
    uint64_t until = uv_hrtime() + ns;
    while (uv_hrtime() < until)
        cpu_relax();
}

static bool stopping(cuda_backend *cb)
{
    return __atomic_load_n(&cb->stop, __ATOMIC_RELAXED);
}

/* Waits for the end of what `word` (NULL: none) and `ev` follow on the device: cudaSuccess, or
 * the device's error (cudaErrorNotReady: the thread is stopping). */
static cudaError_t wait_signal(cuda_backend *cb, const uint32_t *word, cudaEvent_t ev)
{
    if (cb->completion == KD_CUDA_COMPLETION_BLOCK)
        return cudaEventSynchronize(ev);
    if (word) {
        /* The done word costs no driver call.  Its event, asked now and then, reports a device
         * fault (then the word never comes); its success does not end the wait, since the
         * word's write would still be on its way and could land after the buffer's next
         * batch cleared it. */
        uint64_t ask = uv_hrtime() + KD_CUDA_FAULT_POLL_NS;
        while (!__atomic_load_n(word, __ATOMIC_ACQUIRE)) {
            if (stopping(cb))
                return cudaErrorNotReady;
            if (uv_hrtime() >= ask) {
                cudaError_t e = cudaEventQuery(ev);
                if (e != cudaSuccess && e != cudaErrorNotReady)
                    return e;
                ask = uv_hrtime() + KD_CUDA_FAULT_POLL_NS;
            }
            cpu_relax();
        }
        return cudaSuccess;
    }
    for (;;) {
        cudaError_t e = cudaEventQuery(ev);
        if (e != cudaErrorNotReady)
            return e;
        if (stopping(cb))
            return cudaErrorNotReady;
        /* asking the driver less often leaves its locks to the loop's enqueues */
        pause_ns(KD_CUDA_POLL_NS);
        sched_yield();
    }
}

static void *waiter_main(void *arg)
{
    cuda_backend *cb = arg;
    cudaSetDevice(cb->device);
    pthread_mutex_lock(&cb->mu);
    for (;;) {
        while (!cb->stop && cb->npending == 0)
            pthread_cond_wait(&cb->cv, &cb->mu);
        if (cb->stop)
            break;
        cuda_buf *bf = cb->pending[0];
        pthread_mutex_unlock(&cb->mu);
        cudaError_t e = cudaSuccess;
        if (bf->steps_apart) {
            /* its steps first; a fault there is the batch's too, reported at its end */
            e = wait_signal(cb, bf->steps_done_host, bf->s1_ev);
            uint64_t now = uv_hrtime();
            pthread_mutex_lock(&cb->mu);
            if (e == cudaErrorNotReady) /* stopping */
                break;
            if (e == cudaSuccess) {
                bf->steps_signaled_ns = now;
                cb->steps_signaled[cb->nsteps_signaled++] = bf;
            }
            pthread_mutex_unlock(&cb->mu);
            if (e == cudaSuccess)
                uv_async_send(&cb->wake);
        }
        if (e == cudaSuccess)
            e = wait_signal(cb, bf->watch_done ? bf->done_host : NULL, bf->last_ev);
        uint64_t now = uv_hrtime();
        pthread_mutex_lock(&cb->mu);
        if (e == cudaErrorNotReady) /* stopping */
            break;
        bf->sync_err = e;
        bf->signaled_ns = now;
        memmove(cb->pending, cb->pending + 1, --cb->npending * sizeof(cb->pending[0]));
        cb->signaled[cb->nsignaled++] = bf;
        pthread_mutex_unlock(&cb->mu);
        uv_async_send(&cb->wake);
        pthread_mutex_lock(&cb->mu);
    }
    pthread_mutex_unlock(&cb->mu);
    return NULL;
}

/* ---------------------------------------------------------------------- */
/* Steps 3 and 4 on the loop: done, unstage                               */
/* ---------------------------------------------------------------------- */

static void unstage_work(uv_work_t *w)
{
    cuda_buf *bf = w->data;
    kda_dtype pool_dtype = bf->owner->base.pool.dtype;
    for (uint32_t i = 0; i < bf->nouts; i++) {
        const stage_out *o = &bf->outs[i];
        if (o->elems)
            kd_state_convert(o->host, o->dtype, bf->out_host + o->off, pool_dtype, o->elems);
        else
            memcpy(o->host, bf->out_host + o->off, o->bytes);
    }
}

static void unstage_after(uv_work_t *w, int status)
{
    cuda_buf *bf = w->data;
    bf->batch->t.unstaged_ns = uv_hrtime();
    finish(bf);
}

/* Hands the batch back and frees the buffer. */
static void finish(cuda_buf *bf)
{
    cuda_backend *cb = bf->owner;
    kd_batch *b = bf->batch;
    bf->batch = NULL;
    bf->state = BUF_FREE;
    kd_backend_complete(&cb->base, b);
}

/* Nanoseconds between two recorded timing events (0 if the driver cannot tell). */
static uint64_t elapsed_ns(cudaEvent_t a, cudaEvent_t b)
{
    float ms = 0;
    if (cudaEventElapsedTime(&ms, a, b) != cudaSuccess || !(ms > 0))
        return 0;
    return (uint64_t)((double)ms * 1e6);
}

/* The batches the completion thread saw finish, in submission order. */
static void on_wake(uv_async_t *a)
{
    cuda_backend *cb = a->data;
    cuda_buf *done[KD_CUDA_DEPTH], *steps[KD_CUDA_DEPTH];
    pthread_mutex_lock(&cb->mu);
    uint32_t n = cb->nsignaled, nsteps = cb->nsteps_signaled;
    memcpy(done, cb->signaled, n * sizeof(done[0]));
    memcpy(steps, cb->steps_signaled, nsteps * sizeof(steps[0]));
    cb->nsignaled = cb->nsteps_signaled = 0;
    pthread_mutex_unlock(&cb->mu);
    uint64_t now = uv_hrtime();
    /* Steps answered apart, before any batch's end: theirs comes later (the thread saw them
     * first), as does every later batch's. */
    for (uint32_t i = 0; i < nsteps && !cb->fatal; i++) {
        cuda_buf *bf = steps[i];
        kd_batch_timing *t = &bf->batch->steps_t;
        *t = bf->batch->t;
        t->signaled_ns = bf->steps_signaled_ns;
        t->done_ns = t->unstaged_ns = now;
        t->device_ns = t->kernel_ns = elapsed_ns(bf->s0_ev, bf->s1_ev);
        kd_backend_steps_done(&cb->base, bf->batch);
    }
    for (uint32_t i = 0; i < n; i++) {
        cuda_buf *bf = done[i];
        kd_batch *b = bf->batch;
        if (bf->sync_err != cudaSuccess || cb->fatal) {
            /* The device faulted: this batch is lost, and so is every later one
             * (their events report the same sticky error). */
            cb->fatal = true;
            fail_fatal(b, bf->sync_err != cudaSuccess ? bf->sync_err
                                                      : cudaErrorContextIsDestroyed,
                       "the prefill batch");
            finish(bf);
            continue;
        }
        b->t.signaled_ns = bf->signaled_ns;
        b->t.done_ns = now;
        b->t.device_ns = elapsed_ns(bf->first_ev, bf->last_ev);
        b->t.kernel_ns = b->nseqs || b->nsteps ? elapsed_ns(bf->k0_ev, bf->k1_ev) : 0;
        if (bf->nouts == 0) {
            b->t.unstaged_ns = now;
            finish(bf);
            continue;
        }
        bf->state = BUF_UNSTAGING;
        kd_backend_device_done(&cb->base, b);
        bf->work.data = bf;
        if (uv_queue_work(cb->base.loop, &bf->work, unstage_work, unstage_after) != 0) {
            unstage_work(&bf->work); /* cannot happen with a live loop; stay correct anyway */
            unstage_after(&bf->work, 0);
        }
    }
}

static int cuda_submit(kd_backend *b, kd_batch *batch, kp_error *err)
{
    cuda_backend *cb = (cuda_backend *)b;
    if (cb->fatal)
        return kp_fail(err, KP_E_DEVICE_FAILED, "the device failed earlier");
    cuda_buf *bf = NULL;
    for (int i = 0; i < KD_CUDA_DEPTH && !bf; i++) {
        if (cb->buf[i].state == BUF_FREE)
            bf = &cb->buf[i];
    }
    if (!bf)
        return kp_fail(err, KP_E_INTERNAL, "cuda backend: more than %d batches submitted",
                       KD_CUDA_DEPTH);
    bf->batch = batch;
    bf->state = BUF_STAGING;
    bf->work.data = bf;
    if (!needs_staging(cb, batch)) {
        /* Device memory and shared memory only: no thread hop on the latency
         * path.  The callback must not fire from inside submit, so failures
         * are returned instead. */
        const char *what;
        stage_work(&bf->work);
        cudaError_t e = batch->status == KD_BATCH_OK ? enqueue(cb, bf, &what) : cudaSuccess;
        if (batch->status != KD_BATCH_OK || e != cudaSuccess) {
            bf->batch = NULL;
            bf->state = BUF_FREE;
            if (e == cudaSuccess)
                return kp_fail(err, batch->code, "%s", batch->message);
            cb->fatal = true;
            return kp_fail(err, KP_E_DEVICE_FAILED, "%s: %s", what, cudaGetErrorString(e));
        }
        return KP_OK;
    }
    int rc = uv_queue_work(b->loop, &bf->work, stage_work, stage_after);
    if (rc) {
        bf->batch = NULL;
        bf->state = BUF_FREE;
        return kp_fail(err, KP_E_INTERNAL, "uv_queue_work: %s", uv_strerror(rc));
    }
    return KP_OK;
}

/* ---------------------------------------------------------------------- */
/* Gated launches: a lane per prefill, behind a device-side wait           */
/* ---------------------------------------------------------------------- */

static cuda_lane *lane_of(cuda_backend *cb, const kd_batch *b)
{
    for (uint32_t i = 0; i < cb->nlanes; i++) {
        if (cb->lanes[i].batch == b)
            return &cb->lanes[i];
    }
    return NULL;
}

static void on_lane_spin(uv_idle_t *h);

static void watch_lane(cuda_backend *cb, cuda_lane *ln)
{
    ln->state = LANE_WATCHED;
    ln->ask_ns = uv_hrtime() + KD_CUDA_FAULT_POLL_NS;
    uv_idle_start(&cb->lane_spin, on_lane_spin);
}

/* The batch's descriptors: every tensor is device memory (engine.c takes no other). */
static bool lane_stage(cuda_backend *cb, cuda_lane *ln, kd_batch *b)
{
    kda_seq *desc = (kda_seq *)(ln->table_host + TABLE_HEAD);
    if (b->nops || b->nsteps || b->ndones > 1 || b->nseqs == 0 ||
        b->nseqs > cb->buckets[cb->nbuckets - 1]) {
        stage_fail(b, KP_E_INTERNAL, "a gated batch holds more than one prefill");
        return false;
    }
    for (uint32_t i = 0; i < b->nseqs; i++) {
        const kd_batch_seq *q = &b->seqs[i];
        for (int t = 0; t < 5; t++) {
            if (!q->in[t].dev || q->in[t].host) {
                stage_fail(b, KP_E_INTERNAL, "a gated batch with tensors in host memory");
                return false;
            }
        }
        desc[i] = (kda_seq){.q = q->in[0].dev, .k = q->in[1].dev, .v = q->in[2].dev,
                            .g = q->in[3].dev, .beta = q->in[4].dev, .out = q->out.dev,
                            .layer = q->layer, .len = q->len, .slot = q->slot,
                            .flags = q->flags};
    }
    qsort(desc, b->nseqs, sizeof(kda_seq), by_length_desc);
    kda_error kerr;
    if (kda_cuda_batch_check(&cb->base.pool, desc, b->nseqs, &kerr)) {
        char what[220];
        snprintf(what, sizeof(what), "%.200s", kerr.msg);
        stage_fail(b, KP_E_INTERNAL, what);
        return false;
    }
    uint64_t addr = b->ndones ? (uint64_t)(uintptr_t)b->dones[0].buf.dev : 0;
    uint64_t value = b->ndones ? b->dones[0].value : 0;
    memcpy(ln->table_host + LANE_DONE_ADDR, &addr, sizeof(addr));
    memcpy(ln->table_host + LANE_DONE_VALUE, &value, sizeof(value));
    __atomic_store_n((int32_t *)ln->table_host, (int32_t)b->nseqs, __ATOMIC_RELEASE);
    return true;
}

static cudaError_t lane_enqueue(cuda_backend *cb, cuda_lane *ln, const kd_batch *b,
                                const char **what)
{
    cudaError_t e = cudaSuccess;
    CUstream st = (CUstream)ln->stream;
    *what = "queueing a gated launch";
    if (cb->wait_value64(st, (CUdeviceptr)(uintptr_t)ln->ready.buf.dev, ln->ready.value,
                         CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS)
        return cudaErrorUnknown;
    if ((e = cudaGraphLaunch(ln->graphs[bucket_for(cb, b->nseqs)], ln->stream)))
        return e;
    if ((e = cudaEventRecord(ln->end_ev, ln->stream)))
        return e;
    if (ln->end_host && cb->write_value(st, ln->end_dev, 1, 0) != CUDA_SUCCESS)
        return cudaErrorUnknown;
    return cudaSuccess;
}

static int cuda_submit_gated(kd_backend *b, kd_batch *batch, const kd_sem_word *ready,
                             kp_error *err)
{
    cuda_backend *cb = (cuda_backend *)b;
    if (cb->fatal)
        return kp_fail(err, KP_E_DEVICE_FAILED, "the device failed earlier");
    cuda_lane *ln = NULL;
    for (uint32_t i = 0; i < cb->nlanes && !ln; i++) {
        if (cb->lanes[i].state == LANE_FREE)
            ln = &cb->lanes[i];
    }
    if (!ln || !ready->buf.dev)
        return kp_fail(err, KP_E_INTERNAL, "cuda backend: no lane for a gated batch");
    if (!lane_stage(cb, ln, batch))
        return kp_fail(err, batch->code, "%s", batch->message);
    batch->t.staged_ns = uv_hrtime();
    ln->ready = *ready;
    ln->cancelled = false;
    if (ln->end_host)
        __atomic_store_n(ln->end_host, 0, __ATOMIC_RELAXED); /* the calls below order it */
    const char *what;
    cudaError_t e = lane_enqueue(cb, ln, batch, &what);
    if (e != cudaSuccess) {
        cb->fatal = true;
        return kp_fail(err, KP_E_DEVICE_FAILED, "%s: %s", what, cudaGetErrorString(e));
    }
    batch->t.launched_ns = uv_hrtime();
    ln->batch = batch;
    ln->state = LANE_WAITING;
    return KP_OK;
}

static void cuda_gated_go(kd_backend *b, kd_batch *batch)
{
    cuda_backend *cb = (cuda_backend *)b;
    cuda_lane *ln = lane_of(cb, batch);
    if (ln && ln->state == LANE_WAITING)
        watch_lane(cb, ln);
}

/* Stores the ready value into a waiting lane's ready word, raising it only:
 * the client may have written it, or more, meanwhile. */
static void release_ready(cuda_backend *cb, const kd_sem_word *w)
{
    if (w->buf.host) {
        uint64_t *p = w->buf.host, cur = __atomic_load_n(p, __ATOMIC_ACQUIRE);
        while (cur < w->value &&
               !__atomic_compare_exchange_n(p, &cur, w->value, false, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE))
            ;
    } else {
        cb->write_value64((CUstream)cb->aux, (CUdeviceptr)(uintptr_t)w->buf.dev, w->value, 0);
    }
}

/* Calls a waiting lane's launch off on the device (see cuda_lane) and releases its wait: the
 * table is still in pinned memory, read by the graph's upload only once the wait is released. */
static void call_off(cuda_backend *cb, cuda_lane *ln)
{
    const kd_batch *b = ln->batch;
    uint64_t failed = b->ndones ? b->dones[0].value | KP_SEM_FAILED : 0;
    memcpy(ln->table_host + LANE_DONE_VALUE, &failed, sizeof(failed));
    __atomic_store_n((int32_t *)ln->table_host, 0, __ATOMIC_SEQ_CST);
    release_ready(cb, &ln->ready);
    ln->cancelled = true;
}

static void cuda_gated_cancel(kd_backend *b, kd_batch *batch, int code, const char *message)
{
    cuda_backend *cb = (cuda_backend *)b;
    cuda_lane *ln = lane_of(cb, batch);
    if (!ln || ln->state != LANE_WAITING)
        return;
    batch->code = code;
    snprintf(batch->message, sizeof(batch->message), "%s", message);
    call_off(cb, ln);
    watch_lane(cb, ln);
}

/* The loop's look at the watched lanes, on every turn while there are any: their end words
 * cost a load; their end events are asked now and then for a device fault. */
static void on_lane_spin(uv_idle_t *h)
{
    cuda_backend *cb = h->data;
    bool watching = false;
    for (uint32_t i = 0; i < cb->nlanes; i++) {
        cuda_lane *ln = &cb->lanes[i];
        if (ln->state != LANE_WATCHED)
            continue;
        cudaError_t e = cudaErrorNotReady;
        uint64_t now = uv_hrtime();
        if (ln->end_host && __atomic_load_n(ln->end_host, __ATOMIC_ACQUIRE))
            e = cudaSuccess;
        else if (!ln->end_host || now >= ln->ask_ns) {
            e = cudaEventQuery(ln->end_ev);
            ln->ask_ns = now + KD_CUDA_FAULT_POLL_NS;
            if (e == cudaSuccess && ln->end_host)
                e = cudaErrorNotReady; /* the end word is still on its way */
        }
        if (e == cudaErrorNotReady) {
            watching = true;
            continue;
        }
        kd_batch *b = ln->batch;
        ln->batch = NULL;
        ln->state = LANE_FREE;
        b->t.signaled_ns = b->t.done_ns = now;
        if (e != cudaSuccess || cb->fatal) {
            cb->fatal = true;
            fail_fatal(b, e != cudaSuccess ? e : cudaErrorContextIsDestroyed, "a gated launch");
        } else if (ln->cancelled) {
            b->status = KD_BATCH_FAILED; /* code and message set when called off */
        } else {
            b->t.device_ns = b->t.kernel_ns = elapsed_ns(ln->k0_ev, ln->k1_ev);
        }
        kd_backend_complete(&cb->base, b);
    }
    for (uint32_t i = 0; i < cb->nlanes && !watching; i++)
        watching = cb->lanes[i].state == LANE_WATCHED; /* one may have begun meanwhile */
    if (!watching)
        uv_idle_stop(&cb->lane_spin);
}

/* ---------------------------------------------------------------------- */
/* Layers and regions                                                     */
/* ---------------------------------------------------------------------- */

/*
 * One device block per layer: [kda_layer][A_log (H)][dt_bias (H x 128)].
 * Uploaded on the aux stream, so the copy does not wait behind running
 * batches; freed stream-ordered on the batch stream, after every batch that
 * could use it.
 */
static size_t layer_bytes(const kd_backend *b)
{
    const size_t h = (size_t)b->pool.heads;
    return round_stage(sizeof(kda_layer)) + round_stage(h * sizeof(float)) +
           h * KDA_HEAD_DIM * sizeof(float);
}

static int cuda_layer_upload(kd_backend *b, const kda_layer *host, const kda_layer **dev,
                             void **handle, kp_error *err)
{
    cuda_backend *cb = (cuda_backend *)b;
    const size_t h = (size_t)b->pool.heads;
    const size_t head = round_stage(sizeof(kda_layer));
    const size_t a_bytes = round_stage(h * sizeof(float));
    const size_t total = layer_bytes(b);
    uint8_t *image = malloc(total);
    if (!image)
        return kp_fail(err, KP_E_NO_MEMORY, "no memory for a layer image");
    uint8_t *d = NULL;
    cudaError_t e = cudaMallocAsync((void **)&d, total, cb->aux);
    if (e == cudaSuccess) {
        kda_layer l = *host;
        l.A_log = (const float *)(d + head);
        l.dt_bias = (const float *)(d + head + a_bytes);
        memcpy(image, &l, sizeof(l));
        memcpy(image + head, host->A_log, h * sizeof(float));
        memcpy(image + head + a_bytes, host->dt_bias, h * KDA_HEAD_DIM * sizeof(float));
        e = cudaMemcpyAsync(d, image, total, cudaMemcpyHostToDevice, cb->aux);
    }
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(cb->aux);
    free(image);
    if (e != cudaSuccess) {
        if (d)
            cudaFreeAsync(d, cb->aux);
        return kp_fail(err, KP_E_DEVICE_FAILED, "uploading layer weights: %s",
                       cudaGetErrorString(e));
    }
    *dev = (const kda_layer *)d;
    *handle = d;
    b->memory.layers += total;
    return KP_OK;
}

static void cuda_layer_release(kd_backend *b, const kda_layer *dev, void *handle)
{
    cudaFreeAsync(handle, ((cuda_backend *)b)->stream);
    b->memory.layers -= layer_bytes(b);
}

static int cuda_pin_host(kd_backend *b, void *host, uint64_t size, void **dev, void **handle,
                         kp_error *err)
{
    cudaError_t e = cudaHostRegister(host, size, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (e == cudaSuccess) {
        e = cudaHostGetDevicePointer(dev, host, 0);
        if (e != cudaSuccess)
            cudaHostUnregister(host);
    }
    if (e != cudaSuccess)
        return kp_fail(err, KP_E_REGION_INVALID, "cannot pin the region for the GPU: %s",
                       cudaGetErrorString(e));
    *handle = host;
    return KP_OK;
}

static void cuda_unpin_host(kd_backend *b, void *handle)
{
    cudaHostUnregister(handle);
}

/* A CUDA IPC allocation whose size is a multiple of this is read at full speed. */
#define IPC_FAST_MULTIPLE ((size_t)64 << 10)

/* A cudaIpcMemHandle_t from cudaIpcGetMemHandle on a cudaMalloc allocation. */
static int open_ipc(cuda_backend *cb, const kp_region_register_cuda_params *p, cuda_region *cr,
                    kp_error *err)
{
    cudaIpcMemHandle_t h;
    memcpy(&h, p->handle, sizeof(h));
    cudaError_t e = cudaIpcOpenMemHandle(&cr->ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess)
        return kp_fail(err, KP_E_REGION_INVALID, "handle: cudaIpcOpenMemHandle: %s",
                       cudaGetErrorString(e));
    CUdeviceptr base = 0;
    size_t alloc = 0;
    if (!cb->get_range || cb->get_range(&base, &alloc, (CUdeviceptr)(uintptr_t)cr->ptr) != CUDA_SUCCESS)
        return KP_OK;
    if (p->size > alloc) {
        cudaIpcCloseMemHandle(cr->ptr);
        return kp_fail(err, KP_E_REGION_INVALID, "size: %llu bytes exceed the allocation of "
                       "%zu bytes", (unsigned long long)p->size, alloc);
    }
    /* Measured on the H200 (bench/bench_ipc.cu): the kernel ran 13-24% slower on such an
       allocation opened here, and at full speed on the same allocation in its own process. */
    if (alloc % IPC_FAST_MULTIPLE)
        KD_WARN("region: the CUDA IPC allocation is %zu bytes, not a multiple of 64 KiB; the "
                "kernel reads it up to 24%% slower (allocate in multiples of 2 MiB, as PyTorch's "
                "caching allocator does)", alloc);
    return KP_OK;
}

/* A VMM allocation exported as a POSIX fd (cuMemExportToShareableHandle): imported, given an
 * address range of its first `size` bytes (rounded up to the allocation granularity) and mapped
 * read-write for this device.  Takes over fd. */
static int open_vmm(cuda_backend *cb, uint64_t size, int fd, cuda_region *cr, kp_error *err)
{
    const vmm_api *v = &cb->vmm;
    if (!v->import) {
        close(fd);
        return kp_fail(err, KP_E_NOT_SUPPORTED, "handle_type: \"posix_fd\": this driver lacks "
                       "the VMM calls; use \"ipc\"");
    }
    CUresult rc = v->import(&cr->alloc, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    if (rc != CUDA_SUCCESS)
        return kp_fail(err, KP_E_REGION_INVALID, "the fd is not an exported CUDA allocation "
                       "(cuMemImportFromShareableHandle: error %d)", (int)rc);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    size_t gran = 0;
    const char *what = NULL;
    if ((rc = v->props(&prop, cr->alloc)) != CUDA_SUCCESS)
        what = "cannot read the allocation's properties";
    else if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != cb->device)
        what = "the allocation is not in this daemon's GPU memory";
    else if ((rc = v->granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) != CUDA_SUCCESS ||
             gran == 0)
        what = "cannot read the allocation granularity";
    if (what) {
        v->release(cr->alloc);
        return kp_fail(err, KP_E_REGION_INVALID, "%s", what);
    }
    cr->mapped = (size_t)((size + gran - 1) / gran * gran);
    CUdeviceptr ptr = 0;
    if ((rc = v->reserve(&ptr, cr->mapped, gran, 0, 0)) != CUDA_SUCCESS) {
        v->release(cr->alloc);
        return kp_fail(err, KP_E_NO_MEMORY, "no device address range for %zu bytes (error %d)",
                       cr->mapped, (int)rc);
    }
    if ((rc = v->map(ptr, cr->mapped, 0, cr->alloc, 0)) != CUDA_SUCCESS) {
        v->free_va(ptr, cr->mapped);
        v->release(cr->alloc);
        return kp_fail(err, KP_E_REGION_INVALID, "size: %llu bytes (%zu with the allocation "
                       "granularity) exceed the allocation (cuMemMap: error %d)",
                       (unsigned long long)size, cr->mapped, (int)rc);
    }
    const CUmemAccessDesc access = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = cb->device},
                                    .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if ((rc = v->set_access(ptr, cr->mapped, &access, 1)) != CUDA_SUCCESS) {
        v->unmap(ptr, cr->mapped);
        v->free_va(ptr, cr->mapped);
        v->release(cr->alloc);
        return kp_fail(err, KP_E_REGION_INVALID, "cannot map the allocation read-write "
                       "(cuMemSetAccess: error %d)", (int)rc);
    }
    cr->ptr = (void *)(uintptr_t)ptr;
    cr->vmm = true;
    return KP_OK;
}

static int cuda_open_cuda(kd_backend *b, const kp_region_register_cuda_params *p, int fd,
                          void **dev, void **handle, kp_error *err)
{
    cuda_backend *cb = (cuda_backend *)b;
    if (strcmp(p->device, b->info.gpu_uuid) != 0) {
        if (fd >= 0)
            close(fd);
        return kp_fail(err, KP_E_REGION_INVALID, "device: %s is not this daemon's GPU (%s)",
                       p->device, b->info.gpu_uuid);
    }
    cuda_region *cr = calloc(1, sizeof(*cr));
    if (!cr) {
        if (fd >= 0)
            close(fd);
        return kp_fail(err, KP_E_NO_MEMORY, "no memory for a region");
    }
    cudaSetDevice(cb->device); /* the driver calls below act on the current context */
    int rc = p->handle_type == KP_CUDA_HANDLE_POSIX_FD ? open_vmm(cb, p->size, fd, cr, err)
                                                        : open_ipc(cb, p, cr, err);
    if (rc != KP_OK) {
        free(cr);
        return rc;
    }
    *dev = cr->ptr;
    *handle = cr;
    return KP_OK;
}

/* A device-only semaphore word: read through the side stream (which waits for nothing of the
 * batches'), synchronously: a small copy, for a word that host memory cannot hold. */
static int cuda_read_word(kd_backend *b, kd_buf word, uint64_t *value)
{
    cuda_backend *cb = (cuda_backend *)b;
    if (!word.dev || cb->fatal)
        return KP_E_DEVICE_FAILED;
    cudaError_t e = cudaMemcpyAsync(value, word.dev, sizeof(*value), cudaMemcpyDeviceToHost,
                                    cb->aux);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(cb->aux);
    return e == cudaSuccess ? KP_OK : KP_E_DEVICE_FAILED;
}

/* A device-only word's failure (or no-work) value: a stream write on the side stream, not
 * waited for (a failed device would hold the loop). */
static void cuda_write_word(kd_backend *b, kd_buf word, uint64_t value)
{
    cuda_backend *cb = (cuda_backend *)b;
    if (word.dev && cb->write_value64 && !cb->fatal)
        cb->write_value64((CUstream)cb->aux, (CUdeviceptr)(uintptr_t)word.dev, value, 0);
}

static void cuda_close_cuda(kd_backend *b, void *handle)
{
    cuda_backend *cb = (cuda_backend *)b;
    cuda_region *cr = handle;
    if (cr->vmm) {
        CUdeviceptr ptr = (CUdeviceptr)(uintptr_t)cr->ptr;
        cb->vmm.unmap(ptr, cr->mapped);
        cb->vmm.free_va(ptr, cr->mapped);
        cb->vmm.release(cr->alloc);
    } else {
        cudaIpcCloseMemHandle(cr->ptr);
    }
    free(cr);
}

/* ---------------------------------------------------------------------- */
/* Creation and teardown                                                  */
/* ---------------------------------------------------------------------- */

/* A driver entry point through the runtime (kdad does not link libcuda itself); NULL if absent. */
static void *driver_call(const char *name)
{
    enum cudaDriverEntryPointQueryResult found;
    void *fn = NULL;
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
        return NULL;
    return fn;
}

static void find_vmm(vmm_api *v)
{
    void **calls[] = {(void **)&v->import, (void **)&v->props, (void **)&v->granularity,
                      (void **)&v->reserve, (void **)&v->map, (void **)&v->set_access,
                      (void **)&v->unmap, (void **)&v->free_va, (void **)&v->release};
    static const char *const names[] = {
        "cuMemImportFromShareableHandle", "cuMemGetAllocationPropertiesFromHandle",
        "cuMemGetAllocationGranularity", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess",
        "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"};
    for (size_t i = 0; i < sizeof(calls) / sizeof(calls[0]); i++) {
        if (!(*calls[i] = driver_call(names[i]))) {
            memset(v, 0, sizeof(*v));
            return;
        }
    }
}

/* Lanes still waiting at teardown (kdad exits after a device failure) are released first:
 * their streams could not be drained otherwise. */
static void free_lanes(cuda_backend *cb)
{
    for (uint32_t i = 0; i < KD_CUDA_GATED_LANES; i++) {
        cuda_lane *ln = &cb->lanes[i];
        if (ln->state == LANE_WAITING && !ln->cancelled)
            call_off(cb, ln);
        if (ln->stream)
            cudaStreamSynchronize(ln->stream);
        if (ln->graphs) {
            for (uint32_t j = 0; j < cb->nbuckets; j++) {
                if (ln->graphs[j])
                    cudaGraphExecDestroy(ln->graphs[j]);
            }
        }
        free(ln->graphs);
        cudaEvent_t evs[3] = {ln->k0_ev, ln->k1_ev, ln->end_ev};
        for (int j = 0; j < 3; j++) {
            if (evs[j])
                cudaEventDestroy(evs[j]);
        }
        cudaFreeHost(ln->table_host);
        cudaFree(ln->table_dev);
        if (ln->stream)
            cudaStreamDestroy(ln->stream);
        kda_cuda_destroy(ln->k);
    }
    cudaFreeHost(cb->lane_words);
}

static void free_step_graphs(cuda_buf *bf, uint32_t nbuckets)
{
    if (!bf->step_graphs)
        return;
    for (uint32_t i = 0; i < nbuckets; i++) {
        if (bf->step_graphs[i])
            cudaGraphExecDestroy(bf->step_graphs[i]);
    }
    free(bf->step_graphs);
    bf->step_graphs = NULL;
}

static void free_buf(cuda_buf *bf, uint32_t nbuckets)
{
    if (bf->graphs) {
        for (uint32_t i = 0; i < nbuckets; i++) {
            if (bf->graphs[i])
                cudaGraphExecDestroy(bf->graphs[i]);
        }
    }
    free(bf->graphs);
    free_step_graphs(bf, nbuckets);
    cudaEvent_t *evs[10] = {&bf->in_ev, &bf->kernel_ev, &bf->begin_ev, &bf->k0_ev, &bf->k1_ev,
                            &bf->end_ev, &bf->fork_ev, &bf->join_ev, &bf->s0_ev, &bf->s1_ev};
    for (int i = 0; i < 10; i++) {
        if (*evs[i])
            cudaEventDestroy(*evs[i]);
    }
    cudaFreeHost(bf->table_host);
    cudaFreeHost(bf->steps_host);
    cudaFree(bf->steps_dev);
    cudaFreeHost(bf->in_host);
    cudaFreeHost(bf->out_host);
    cudaFree(bf->table_dev);
    cudaFree(bf->in_dev);
    cudaFree(bf->out_dev);
    free(bf->outs);
    free(bf->op_off);
    free(bf->shm_in.v);
    free(bf->shm_out.v);
}

static void stop_waiter(cuda_backend *cb)
{
    if (!cb->waiter_started)
        return;
    pthread_mutex_lock(&cb->mu);
    __atomic_store_n(&cb->stop, 1, __ATOMIC_RELAXED);
    pthread_cond_signal(&cb->cv);
    pthread_mutex_unlock(&cb->mu);
    pthread_join(cb->waiter, NULL);
    cb->waiter_started = false;
}

static void free_all(cuda_backend *cb)
{
    stop_waiter(cb);
    free_lanes(cb);
    /* Healthy streams are drained first; faulted ones return at once. */
    cudaStream_t *streams[5] = {&cb->h2d, &cb->stream, &cb->steps, &cb->d2h, &cb->aux};
    for (int i = 0; i < 5; i++) {
        if (*streams[i])
            cudaStreamSynchronize(*streams[i]);
    }
    for (int i = 0; i < KD_CUDA_DEPTH; i++)
        free_buf(&cb->buf[i], cb->nbuckets);
    cudaFreeHost(cb->done_words);
    cudaFree(cb->base.pool.state);
    for (int i = 0; i < 5; i++) {
        if (*streams[i])
            cudaStreamDestroy(*streams[i]);
    }
    pthread_mutex_destroy(&cb->mu);
    pthread_cond_destroy(&cb->cv);
    kda_cuda_destroy(cb->k);
    free(cb->buckets);
    free(cb);
}

static void on_handle_closed(uv_handle_t *h)
{
    cuda_backend *cb = h->data;
    if (--cb->handles_open == 0)
        free_all(cb);
}

/* The memory is freed once libuv has closed the doorbell and the spin handle
 * (the loop must run once more, as it does at shutdown).  No batch is in flight: the completion
 * thread is idle, and stops first. */
static void cuda_destroy(kd_backend *b)
{
    cuda_backend *cb = (cuda_backend *)b;
    stop_waiter(cb);
    uv_close((uv_handle_t *)&cb->wake, on_handle_closed);
    uv_close((uv_handle_t *)&cb->spin, on_handle_closed);
    uv_close((uv_handle_t *)&cb->lane_spin, on_handle_closed);
}

static const kd_backend_ops cuda_ops = {
    .submit = cuda_submit,
    .layer_upload = cuda_layer_upload,
    .layer_release = cuda_layer_release,
    .pin_host = cuda_pin_host,
    .unpin_host = cuda_unpin_host,
    .open_cuda = cuda_open_cuda,
    .close_cuda = cuda_close_cuda,
    .read_word = cuda_read_word,
    .write_word = cuda_write_word,
    .submit_gated = cuda_submit_gated,
    .gated_go = cuda_gated_go,
    .gated_cancel = cuda_gated_cancel,
    .destroy = cuda_destroy,
};

typedef enum graph_kind {
    GRAPH_PREFILL, /* a buffer's prefill launch; the table is [count | descriptors] (table_bytes) */
    GRAPH_LANE,    /* a lane's: the same, then its request's done word (cuda_lane) */
    GRAPH_STEP,    /* a buffer's step alone; the table is [kda_step | kda_step_seq x bucket] */
} graph_kind;

/* Captures [launch table upload, record k0, kernel, record k1, done word write (when done_dev)]
 * for one bucket on stream st: the timing events are nodes of the graph, so that a replay is
 * one driver call.  The kernel reads how much of the bucket is live from the table (the step
 * kernel's blocks past the step's sequences exit at once). */
static cudaError_t capture(cuda_backend *cb, cudaStream_t st, kda_cuda *k, const uint8_t *table_host,
                           uint8_t *table_dev, cudaEvent_t k0, cudaEvent_t k1, CUdeviceptr done_dev,
                           graph_kind kind, uint32_t bucket, cudaGraphExec_t *out, char *err,
                           size_t errlen)
{
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess)
        return e;
    size_t bytes = kind == GRAPH_STEP ? sizeof(kda_step) + (size_t)bucket * sizeof(kda_step_seq)
                                      : table_bytes(bucket);
    cudaMemcpyAsync(table_dev, table_host, bytes, cudaMemcpyHostToDevice, st);
    cudaEventRecordWithFlags(k0, st, cudaEventRecordExternal);
    kda_error kerr;
    int krc = kind == GRAPH_STEP
                  ? kda_cuda_step(k, &cb->base.pool, (const kda_step *)table_dev, (int32_t)bucket,
                                  st, &kerr)
                  : kda_cuda_prefill(k, &cb->base.pool, (const kda_seq *)(table_dev + TABLE_HEAD),
                                     (const int32_t *)table_dev, (int32_t)bucket, st, &kerr);
    cudaEventRecordWithFlags(k1, st, cudaEventRecordExternal);
    if (done_dev)
        cb->write_value((CUstream)st, done_dev, 1, 0);
    if (kind == GRAPH_LANE && krc == KDA_OK)
        krc = kda_cuda_store_word((uint64_t *const *)(table_dev + LANE_DONE_ADDR),
                                  (const uint64_t *)(table_dev + LANE_DONE_VALUE), st, &kerr);
    e = cudaStreamEndCapture(st, &graph);
    if (krc != KDA_OK) {
        snprintf(err, errlen, "capturing the kernel for %u sequences: %s", bucket, kerr.msg);
        if (graph)
            cudaGraphDestroy(graph);
        return cudaErrorUnknown;
    }
    if (e == cudaSuccess)
        e = cudaGraphInstantiate(out, graph, 0);
    if (graph)
        cudaGraphDestroy(graph);
    return e;
}

/* Every buffer's step graphs, one per bucket (cuda_buf.step_graphs); on an error none (steps
 * are then launched directly). */
static cudaError_t capture_steps(cuda_backend *cb, char *err, size_t errlen)
{
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < KD_CUDA_DEPTH && e == cudaSuccess; i++) {
        cuda_buf *bf = &cb->buf[i];
        if (!(bf->step_graphs = calloc(cb->nbuckets, sizeof(*bf->step_graphs))))
            e = cudaErrorMemoryAllocation;
        for (uint32_t j = 0; e == cudaSuccess && j < cb->nbuckets; j++)
            e = capture(cb, cb->stream, cb->k, bf->steps_host, bf->steps_dev, bf->k0_ev,
                        bf->k1_ev, bf->done_host ? bf->done_dev : 0, GRAPH_STEP, cb->buckets[j],
                        &bf->step_graphs[j], err, errlen);
    }
    if (e != cudaSuccess) {
        for (int i = 0; i < KD_CUDA_DEPTH; i++)
            free_step_graphs(&cb->buf[i], cb->nbuckets);
    }
    return e;
}

static cudaError_t alloc_buf(cuda_backend *cb, cuda_buf *bf, uint32_t max_seqs)
{
    cudaError_t e;
    /* Either may end a batch (see first_ev / last_ev). */
    const unsigned completion_flags = cb->completion == KD_CUDA_COMPLETION_BLOCK
                                          ? cudaEventBlockingSync
                                          : cudaEventDefault;
    bf->owner = cb;
    size_t table = table_bytes(max_seqs);
    /* a step has at least one sequence: max_seqs of each at most */
    size_t steps_table = (size_t)max_seqs * (sizeof(kda_step) + sizeof(kda_step_seq));
    bf->steps_cap = max_seqs;
    if ((e = cudaMallocHost((void **)&bf->table_host, table)) ||
        (e = cudaMallocHost((void **)&bf->steps_host, steps_table)) ||
        (e = cudaMalloc((void **)&bf->steps_dev, steps_table)) ||
        (e = cudaEventCreateWithFlags(&bf->fork_ev, cudaEventDisableTiming)) ||
        (e = cudaEventCreateWithFlags(&bf->join_ev, cudaEventDisableTiming)) ||
        (e = cudaMallocHost((void **)&bf->in_host, cb->stage_bytes)) ||
        (e = cudaMallocHost((void **)&bf->out_host, cb->stage_bytes)) ||
        (e = cudaMalloc((void **)&bf->table_dev, table)) ||
        (e = cudaMalloc((void **)&bf->in_dev, cb->stage_bytes)) ||
        (e = cudaMalloc((void **)&bf->out_dev, cb->stage_bytes)) ||
        (e = cudaEventCreateWithFlags(&bf->in_ev, cudaEventDisableTiming)) ||
        (e = cudaEventCreateWithFlags(&bf->kernel_ev, cudaEventDisableTiming)) ||
        (e = cudaEventCreateWithFlags(&bf->begin_ev, cudaEventDefault)) ||
        (e = cudaEventCreateWithFlags(&bf->k0_ev, cudaEventDefault)) ||
        (e = cudaEventCreateWithFlags(&bf->k1_ev, completion_flags)) ||
        (e = cudaEventCreateWithFlags(&bf->end_ev, completion_flags)) ||
        (e = cudaEventCreateWithFlags(&bf->s0_ev, cudaEventDefault)) ||
        (e = cudaEventCreateWithFlags(&bf->s1_ev, completion_flags)))
        return e;
    cb->base.memory.staging += steps_table + table + 2 * cb->stage_bytes;
    /* The graphs copy whole buckets: never let them read uninitialised bytes. */
    memset(bf->table_host, 0, table);
    memset(bf->steps_host, 0, steps_table);
    bf->count_host = (int32_t *)bf->table_host;
    bf->count_dev = (int32_t *)bf->table_dev;
    bf->desc_host = (kda_seq *)(bf->table_host + TABLE_HEAD);
    bf->desc_dev = (kda_seq *)(bf->table_dev + TABLE_HEAD);
    bf->graphs = calloc(cb->nbuckets, sizeof(*bf->graphs));
    return bf->graphs ? cudaSuccess : cudaErrorMemoryAllocation;
}

/* The done words, a cache line apart. */
#define DONE_STRIDE_WORDS 16

/* cuda_completion poll: the words the graphs write last, checked once (a captured write lands
 * in host memory), and the steps' words (cuda_buf.steps_done_host) after them; false (batches
 * are then watched through their events alone) when the driver cannot capture one. */
static bool setup_done_words(cuda_backend *cb)
{
    const size_t bytes = 2 * KD_CUDA_DEPTH * DONE_STRIDE_WORDS * sizeof(uint32_t);
    void *dev = NULL;
    cudaGraph_t g = NULL;
    cudaGraphExec_t x = NULL;
    bool ok = false;
    cb->write_value = (write_value_fn)driver_call("cuStreamWriteValue32");
    if (cb->write_value &&
        cudaHostAlloc((void **)&cb->done_words, bytes, cudaHostAllocMapped) == cudaSuccess &&
        cudaHostGetDevicePointer(&dev, cb->done_words, 0) == cudaSuccess &&
        cudaStreamBeginCapture(cb->stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
        memset(cb->done_words, 0, bytes);
        CUresult w = cb->write_value((CUstream)cb->stream, (CUdeviceptr)(uintptr_t)dev, 1, 0);
        cudaError_t e = cudaStreamEndCapture(cb->stream, &g);
        ok = w == CUDA_SUCCESS && e == cudaSuccess && cudaGraphInstantiate(&x, g, 0) == cudaSuccess &&
             cudaGraphLaunch(x, cb->stream) == cudaSuccess &&
             cudaStreamSynchronize(cb->stream) == cudaSuccess &&
             __atomic_load_n(&cb->done_words[0], __ATOMIC_ACQUIRE) == 1;
    }
    if (x)
        cudaGraphExecDestroy(x);
    if (g)
        cudaGraphDestroy(g);
    if (!ok)
        return false;
    for (int i = 0; i < KD_CUDA_DEPTH; i++) {
        const int j = KD_CUDA_DEPTH + i;
        cb->buf[i].done_host = cb->done_words + i * DONE_STRIDE_WORDS;
        cb->buf[i].done_dev = (CUdeviceptr)(uintptr_t)dev + i * DONE_STRIDE_WORDS * sizeof(uint32_t);
        cb->buf[i].steps_done_host = cb->done_words + j * DONE_STRIDE_WORDS;
        cb->buf[i].steps_done_dev =
            (CUdeviceptr)(uintptr_t)dev + j * DONE_STRIDE_WORDS * sizeof(uint32_t);
    }
    return true;
}

/* Whether cuStreamWriteValue64 works here (64-bit stream memory operations are a device
 * capability): one word written into mapped host memory and read back. */
static bool probe_write_value64(cuda_backend *cb)
{
    uint64_t *host = NULL;
    void *dev = NULL;
    bool ok = cudaHostAlloc((void **)&host, sizeof(*host), cudaHostAllocMapped) == cudaSuccess &&
              cudaHostGetDevicePointer(&dev, host, 0) == cudaSuccess;
    if (ok) {
        *host = 0;
        ok = cb->write_value64((CUstream)cb->aux, (CUdeviceptr)(uintptr_t)dev, KP_SEM_FAILED | 7,
                               0) == CUDA_SUCCESS &&
             cudaStreamSynchronize(cb->aux) == cudaSuccess &&
             __atomic_load_n(host, __ATOMIC_ACQUIRE) == (KP_SEM_FAILED | 7);
    }
    if (host)
        cudaFreeHost(host);
    return ok;
}

/* The gated lanes (cuda_lane), when the driver offers 64-bit stream waits and writes; their end
 * words when it can write 32-bit words from a stream (else their end events are asked). */
static cudaError_t setup_lanes(cuda_backend *cb, uint32_t max_seqs, uint64_t split_scratch,
                               char *err, size_t errlen)
{
    cb->wait_value64 = (wait_value64_fn)driver_call("cuStreamWaitValue64");
    if (!cb->write_value64 || !cb->wait_value64)
        return cudaSuccess;
    const size_t table = table_bytes(max_seqs);
    const size_t words = KD_CUDA_GATED_LANES * DONE_STRIDE_WORDS * sizeof(uint32_t);
    void *words_dev = NULL;
    cudaError_t e;
    if (cb->write_value) {
        if ((e = cudaHostAlloc((void **)&cb->lane_words, words, cudaHostAllocMapped)) ||
            (e = cudaHostGetDevicePointer(&words_dev, cb->lane_words, 0)))
            return e;
        memset(cb->lane_words, 0, words);
    }
    for (uint32_t i = 0; i < KD_CUDA_GATED_LANES; i++) {
        cuda_lane *ln = &cb->lanes[i];
        kda_error kerr;
        if (kda_cuda_create_with_scratch(cb->device, split_scratch, &ln->k, &kerr) != KDA_OK) {
            snprintf(err, errlen, "a gated lane's kernel: %s", kerr.msg);
            return cudaErrorUnknown;
        }
        cb->base.memory.lanes += kda_cuda_device_bytes(ln->k);
        if ((e = cudaStreamCreateWithFlags(&ln->stream, cudaStreamNonBlocking)) ||
            (e = cudaMallocHost((void **)&ln->table_host, table)) ||
            (e = cudaMalloc((void **)&ln->table_dev, table)) ||
            (e = cudaEventCreateWithFlags(&ln->k0_ev, cudaEventDefault)) ||
            (e = cudaEventCreateWithFlags(&ln->k1_ev, cudaEventDefault)) ||
            (e = cudaEventCreateWithFlags(&ln->end_ev, cudaEventDisableTiming)))
            return e;
        cb->base.memory.lanes += table;
        memset(ln->table_host, 0, table); /* the graphs copy whole buckets */
        if (!(ln->graphs = calloc(cb->nbuckets, sizeof(*ln->graphs))))
            return cudaErrorMemoryAllocation;
        for (uint32_t j = 0; j < cb->nbuckets; j++) {
            if ((e = capture(cb, ln->stream, ln->k, ln->table_host, ln->table_dev, ln->k0_ev,
                             ln->k1_ev, 0, GRAPH_LANE, cb->buckets[j], &ln->graphs[j], err,
                             errlen)))
                return e;
        }
        if (cb->lane_words) {
            ln->end_host = cb->lane_words + i * DONE_STRIDE_WORDS;
            ln->end_dev = (CUdeviceptr)(uintptr_t)words_dev + i * DONE_STRIDE_WORDS * sizeof(uint32_t);
        }
        cb->nlanes++;
    }
    return cudaSuccess;
}

static void format_uuid(char *out, size_t size, const cudaUUID_t *u)
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, size, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
             b[13], b[14], b[15]);
}

/* The ordinal of the GPU `spec` names (config `device`): "N", or a GPU UUID
 * or a prefix of one that exactly one GPU matches (any case).  Ordinals count
 * the GPUs CUDA_VISIBLE_DEVICES leaves visible; UUIDs name a GPU whatever the
 * ordering.  KP_E_NOT_SUPPORTED (kdad exits 69) when none matches. */
static int resolve_device(const char *spec, int *ordinal, char *err, size_t errlen)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice || (e == cudaSuccess && n == 0)) {
        snprintf(err, errlen, "no GPU: %s",
                 e == cudaErrorInsufficientDriver
                     ? "no NVIDIA driver is loaded, or it is older than this CUDA runtime"
                     : "the NVIDIA driver sees no device");
        return KP_E_NOT_SUPPORTED;
    }
    if (e != cudaSuccess) {
        snprintf(err, errlen, "device %s: cudaGetDeviceCount: %s", spec, cudaGetErrorString(e));
        return KP_E_NOT_SUPPORTED;
    }
    if (strncmp(spec, "GPU-", 4) != 0) { /* config.c admits digits or a UUID prefix */
        long v = strtol(spec, NULL, 10);
        if (v >= n) {
            snprintf(err, errlen, "device %s: no such GPU (%d visible: ordinals 0..%d)", spec, n,
                     n - 1);
            return KP_E_NOT_SUPPORTED;
        }
        *ordinal = (int)v;
        return KP_OK;
    }
    char seen[512] = "", uuid[64];
    int found = -1, matches = 0;
    for (int i = 0; i < n; i++) {
        struct cudaDeviceProp prop;
        if ((e = cudaGetDeviceProperties(&prop, i)) != cudaSuccess)
            return cuda_err(err, errlen, e, "reading the GPUs' UUIDs");
        format_uuid(uuid, sizeof(uuid), &prop.uuid);
        snprintf(seen + strlen(seen), sizeof(seen) - strlen(seen), "%s%d: %s", i ? ", " : "", i,
                 uuid);
        if (strncasecmp(uuid, spec, strlen(spec)) == 0) {
            found = i;
            matches++;
        }
    }
    if (matches != 1) {
        snprintf(err, errlen, "device %s: %s (visible: %s)", spec,
                 matches ? "more than one GPU matches this prefix" : "no GPU has this UUID", seen);
        return KP_E_NOT_SUPPORTED;
    }
    *ordinal = found;
    return KP_OK;
}

int kd_backend_cuda_create(uv_loop_t *loop, const kd_backend_config *cfg, kd_backend **out,
                           char *err, size_t errlen)
{
    kda_cuda *k = NULL;
    kda_error kerr;
    int device = 0;
    int rc = resolve_device(cfg->device ? cfg->device : "0", &device, err, errlen);
    if (rc != KP_OK)
        return rc;
    if (kda_cuda_create_with_scratch(device, cfg->split_scratch_bytes, &k, &kerr) != KDA_OK) {
        snprintf(err, errlen, "%s", kerr.msg);
        return kerr.code == KDA_ENOTSUP ? KP_E_NOT_SUPPORTED : KP_E_INTERNAL;
    }
    cuda_backend *cb = calloc(1, sizeof(*cb));
    if (!cb) {
        kda_cuda_destroy(k);
        snprintf(err, errlen, "no memory for the cuda backend");
        return KP_E_NO_MEMORY;
    }
    cb->k = k;
    cb->device = device;
    cb->completion = cfg->completion;
    pthread_mutex_init(&cb->mu, NULL);
    pthread_cond_init(&cb->cv, NULL);
    kd_backend *b = &cb->base;
    b->ops = &cuda_ops;
    b->pool = (kda_pool){NULL, cfg->dtype, (int32_t)cfg->heads, cfg->slots};
    b->memory.scratch = kda_cuda_split_scratch_bytes(k);
    b->memory.kernel = kda_cuda_device_bytes(k) - b->memory.scratch;
    cb->buckets = malloc(cfg->nbuckets * sizeof(*cb->buckets));
    if (!cb->buckets) {
        kda_cuda_destroy(k);
        free(cb);
        snprintf(err, errlen, "no memory for the cuda backend");
        return KP_E_NO_MEMORY;
    }
    memcpy(cb->buckets, cfg->buckets, cfg->nbuckets * sizeof(*cb->buckets));
    cb->nbuckets = cfg->nbuckets;
    uint32_t max_seqs = cfg->buckets[cfg->nbuckets - 1];
    /* Room for the largest inline request or result, for a staged state,
     * and for the alignment of every staged tensor of a full batch. */
    cb->stage_bytes = round_stage(cfg->max_inline_bytes) +
                      round_stage(kp_state_bytes(cfg->heads, KP_DTYPE_F32)) +
                      (uint64_t)(max_seqs + 1) * 6 * KD_STAGE_ALIGN;

    cudaError_t e;
    struct cudaDeviceProp prop;
    int mps = 0;
    uint64_t pool_bytes = (uint64_t)cfg->slots * kd_backend_slot_bytes(b);
    rc = KP_E_INTERNAL;
    if ((e = cudaGetDeviceProperties(&prop, cb->device)) ||
        (e = cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, cb->device)) ||
        (e = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking)) ||
        (e = cudaStreamCreateWithFlags(&cb->h2d, cudaStreamNonBlocking)) ||
        (e = cudaStreamCreateWithFlags(&cb->d2h, cudaStreamNonBlocking)) ||
        (e = cudaStreamCreateWithFlags(&cb->aux, cudaStreamNonBlocking)) ||
        (e = cudaStreamCreateWithFlags(&cb->steps, cudaStreamNonBlocking))) {
        rc = cuda_err(err, errlen, e, "creating streams");
        goto fail;
    }
    /* Zeroed on the batch stream itself (a cudaMemset would run on the legacy
     * stream, unordered with ours); the first captures wait for it. */
    if ((e = cudaMalloc(&b->pool.state, pool_bytes)) ||
        (e = cudaMemsetAsync(b->pool.state, 0, pool_bytes, cb->stream)) ||
        (e = cudaStreamSynchronize(cb->stream))) {
        snprintf(err, errlen, "cannot allocate the state pool of %llu MiB on %s: %s",
                 (unsigned long long)(pool_bytes >> 20), prop.name, cudaGetErrorString(e));
        rc = KP_E_NO_MEMORY;
        goto fail;
    }
    b->memory.pool = pool_bytes;
    if (cb->completion == KD_CUDA_COMPLETION_POLL && !setup_done_words(cb))
        KD_WARN("cuda backend: this driver cannot capture cuStreamWriteValue32; batches are "
                "watched through their events alone");
    for (int i = 0; i < KD_CUDA_DEPTH; i++) {
        if ((e = alloc_buf(cb, &cb->buf[i], max_seqs))) {
            snprintf(err, errlen, "cannot allocate staging buffers (2 x %llu MiB pinned and "
                     "device per buffer): %s", (unsigned long long)(cb->stage_bytes >> 20),
                     cudaGetErrorString(e));
            rc = KP_E_NO_MEMORY;
            goto fail;
        }
        for (uint32_t j = 0; j < cb->nbuckets; j++) {
            err[0] = '\0';
            cuda_buf *bf = &cb->buf[i];
            if ((e = capture(cb, cb->stream, cb->k, bf->table_host, bf->table_dev, bf->k0_ev,
                             bf->k1_ev, bf->done_host ? bf->done_dev : 0, GRAPH_PREFILL, cb->buckets[j],
                             &bf->graphs[j], err, errlen))) {
                if (!err[0])
                    cuda_err(err, errlen, e, "capturing a CUDA graph");
                goto fail;
            }
        }
    }
    err[0] = '\0';
    if ((e = capture_steps(cb, err, errlen))) {
        KD_WARN("cuda backend: capturing the step graphs failed (%s); steps are launched directly",
                err[0] ? err : cudaGetErrorString(e));
        (void)cudaGetLastError(); /* a capture refused is no device fault */
    }
    if ((e = cudaStreamSynchronize(cb->stream))) {
        rc = cuda_err(err, errlen, e, "initialising the device");
        goto fail;
    }

    cb->get_range = (get_range_fn)driver_call("cuMemGetAddressRange");
    cb->write_value64 = (write_value64_fn)driver_call("cuStreamWriteValue64");
    if (cb->write_value64 && !probe_write_value64(cb)) {
        KD_WARN("cuda backend: this device or driver cannot write 64-bit words from a stream; "
                "stream-ordered prefills (semaphores) are off");
        cb->write_value64 = NULL;
    }
    find_vmm(&cb->vmm);
    err[0] = '\0';
    /* Each lane is a kernel instance of its own (its scratch included) and a set of graphs:
     * only when gated launches may use them. */
    if (cfg->gated_lanes &&
        (e = setup_lanes(cb, max_seqs, cfg->split_scratch_bytes, err, errlen))) {
        rc = KP_E_INTERNAL;
        if (!err[0])
            cuda_err(err, errlen, e, "setting up the gated lanes");
        goto fail;
    }

    b->info = (kd_backend_info){
        .kind = KP_BACKEND_CUDA,
        .name = "cuda",
        .has_gpu = true,
        .gpu_index = (uint32_t)device,
        .transports = KP_TRANSPORT_INLINE | KP_TRANSPORT_SHM | KP_TRANSPORT_CUDA_IPC,
        .depth = KD_CUDA_DEPTH,
        .stages_host = true,
        .max_stage_in = cb->stage_bytes,
        .max_stage_out = cb->stage_bytes,
        .wave_chains = (uint32_t)kda_cuda_sm_count(cb->k),
        .paired_chains = (uint32_t)kda_cuda_paired_clusters(cb->k),
        .sems = cb->write_value64 != NULL,
        .gated_lanes = cb->nlanes,
        .gpu_mps = mps != 0,
    };
    snprintf(b->info.gpu_name, sizeof(b->info.gpu_name), "%s", prop.name);
    format_uuid(b->info.gpu_uuid, sizeof(b->info.gpu_uuid), &prop.uuid);
    /* "0000:19:00.0": the bus id nvidia-smi and the kernel print (in lower case) */
    snprintf(b->info.gpu_pci_bus_id, sizeof(b->info.gpu_pci_bus_id), "%04x:%02x:%02x.0",
             (unsigned)prop.pciDomainID, (unsigned)prop.pciBusID, (unsigned)prop.pciDeviceID);

    if (pthread_create(&cb->waiter, NULL, waiter_main, cb) != 0) {
        snprintf(err, errlen, "cannot start the completion thread");
        rc = KP_E_INTERNAL;
        goto fail;
    }
    cb->waiter_started = true;
    uv_async_init(loop, &cb->wake, on_wake);
    cb->wake.data = cb;
    uv_idle_init(loop, &cb->spin);
    cb->spin.data = cb;
    uv_idle_init(loop, &cb->lane_spin);
    cb->lane_spin.data = cb;
    cb->handles_open = 3;
    KD_INFO("backend cuda: %s (device %d, %s, PCI %s, %d SMs), pool of %u slots x %u heads "
            "(%s, %llu MiB), %u graph buckets up to %u sequences, staging 2 x %llu MiB each way, "
            "%u gated lanes, "
            "completion %s, %s",
            prop.name, device, b->info.gpu_uuid, b->info.gpu_pci_bus_id, kda_cuda_sm_count(k),
            cfg->slots, cfg->heads, cfg->dtype == KDA_DTYPE_F32 ? "f32" : "bf16",
            (unsigned long long)(pool_bytes >> 20), cb->nbuckets, max_seqs, (unsigned long long)(cb->stage_bytes >> 20),
            cb->nlanes,
            cb->completion == KD_CUDA_COMPLETION_BLOCK ? "block" : "poll",
            mps ? "context shared through MPS"
                : "own context (without MPS, a client's kernels and kdad's take turns on the GPU)");
    *out = b;
    return KP_OK;
fail:
    free_all(cb);
    return rc;
}
