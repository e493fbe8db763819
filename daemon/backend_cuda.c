/*
 * backend_cuda.c - the cuda backend: the state pool in device memory and
 * the fused Hopper kernel (kernels/kda_cuda.h), launched by replaying CUDA
 * Graphs.  Built only when nvcc is present (KDAD_HAVE_CUDA).
 *
 * Everything is allocated once, at start: the pool, and for each of the
 * KD_CUDA_DEPTH (2) buffers of the double buffering a pinned descriptor
 * table, its device copy, pinned and device staging for inline bytes each
 * way, an event, and one graph per size bucket.  A graph is
 *   [copy descriptor table -> device, copy count -> device, kernel(max_seqs = bucket)]
 * so replaying it with a freshly written pinned table runs a new batch; the
 * kernel reads how many descriptors are live from device memory.
 *
 * A batch goes through four steps, none of which blocks the loop:
 *   1. stage   (worker thread)  inline inputs and converted states into the
 *              pinned buffer; descriptors (longest first) into the pinned table.
 *              A batch whose buffers are all device memory (CUDA IPC, pinned
 *              shared memory) only needs its descriptors: written on the loop,
 *              which saves the thread hop on the latency path
 *   2. enqueue (loop)           H2D staging copy, slot operations, graph
 *              replay, D2H staging copy, event, cudaLaunchHostFunc
 *   3. done    (loop)           the host function wakes the loop (uv_async);
 *              the event says whether the work succeeded.  A timer also polls
 *              the events, so a fault is noticed even if the host function
 *              never runs
 *   4. unstage (worker thread)  inline outputs and read states out of the
 *              pinned buffer, then the completion callback (loop)
 * With two buffers, batch k+1 is staged and enqueued while batch k runs.
 *
 * Shared-memory regions are pinned and mapped (cudaHostRegisterMapped): the
 * kernel reads and writes them through their device alias.  CUDA IPC
 * regions are device memory the kernel uses directly.
 *
 * Any CUDA error during a batch is treated as fatal (KD_BATCH_FATAL): the
 * context cannot be trusted afterwards, and kdad exits so that systemd
 * restarts it with a fresh one.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h> /* driver types for cuMemGetAddressRange, reached through the runtime */
#include <cuda_runtime_api.h>

#include "backend.h"
#include "defaults.h"
#include "kda_cuda.h"
#include "log.h"

typedef enum buf_state {
    BUF_FREE = 0,
    BUF_STAGING,   /* step 1 on a worker */
    BUF_RUNNING,   /* enqueued on the stream */
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

typedef struct cuda_buf {
    struct cuda_backend *owner;
    buf_state state;
    uint64_t seq;           /* submission number: batches finish in this order */
    kd_batch *batch;
    uv_work_t work;
    kda_seq *desc_host;     /* pinned, max_seqs entries */
    kda_seq *desc_dev;
    int32_t *count_host;    /* pinned */
    int32_t *count_dev;
    uint8_t *in_host, *in_dev;   /* staging towards the device */
    uint8_t *out_host, *out_dev; /* staging back */
    uint64_t in_used, out_used;
    uint64_t *op_off;       /* per op: staging offset, or UINT64_MAX when not staged */
    stage_out *outs;
    uint32_t nouts, outs_cap, ops_cap;
    cudaEvent_t done_ev;
    cudaGraphExec_t *graphs; /* one per bucket */
} cuda_buf;

typedef CUresult (*get_range_fn)(CUdeviceptr *base, size_t *size, CUdeviceptr ptr);

typedef struct cuda_backend {
    kd_backend base;
    kda_cuda *k;
    int device;
    cudaStream_t stream;     /* every batch, in order */
    cudaStream_t aux;        /* layer uploads, off the batch stream */
    uint32_t *buckets;
    uint32_t nbuckets;
    uint64_t stage_bytes;    /* each staging buffer, each way */
    cuda_buf buf[KD_CUDA_DEPTH];
    uint64_t next_seq;
    uv_async_t wake;         /* the host function's doorbell */
    uv_timer_t poll;         /* fault detection while batches run */
    int handles_open;
    bool fatal;
    get_range_fn get_range;  /* NULL if the driver does not export it */
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

/* Reserves staging bytes; the scheduler's cost accounting (exec.c, with the
 * same rounding) guarantees they fit. */
static uint64_t take(uint64_t *used, uint64_t n)
{
    uint64_t off = *used;
    *used += round_stage(n);
    return off;
}

static void add_out(cuda_buf *bf, void *host, uint64_t off, uint64_t bytes, uint64_t elems,
                    kda_dtype dtype)
{
    bf->outs[bf->nouts++] = (stage_out){host, off, elems, bytes, dtype};
}

/* Makes room for a batch's bookkeeping arrays (worker thread). */
static bool reserve(cuda_buf *bf, const kd_batch *b)
{
    uint32_t outs = b->nseqs + b->nops;
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
    bf->nouts = 0;
    if (!reserve(bf, b)) {
        b->status = KD_BATCH_FAILED;
        b->code = KP_E_NO_MEMORY;
        snprintf(b->message, sizeof(b->message), "cuda backend: no memory to stage a batch");
        return;
    }

    for (uint32_t i = 0; i < b->nops; i++) {
        const kd_slot_op *op = &b->ops[i];
        bool staged = (op->kind == KD_OP_READ || op->kind == KD_OP_WRITE) &&
                      (!op->buf.dev || op->dtype != pool_dtype);
        bf->op_off[i] = UINT64_MAX;
        if (!staged)
            continue;
        if (op->kind == KD_OP_WRITE) {
            bf->op_off[i] = take(&bf->in_used, state_bytes);
            kd_state_convert(bf->in_host + bf->op_off[i], pool_dtype, op->buf.host, op->dtype,
                             elems);
        } else {
            bf->op_off[i] = take(&bf->out_used, state_bytes);
            add_out(bf, op->buf.host, bf->op_off[i], state_bytes, elems, op->dtype);
        }
    }

    for (uint32_t i = 0; i < b->nseqs; i++) {
        const kd_batch_seq *q = &b->seqs[i];
        const void *in[5];
        for (int t = 0; t < 5; t++) {
            if (q->in[t].dev) {
                in[t] = q->in[t].dev;
                continue;
            }
            uint64_t n = (uint64_t)q->len * heads * (t == 4 ? 2 : 2 * KDA_HEAD_DIM);
            uint64_t off = take(&bf->in_used, n);
            memcpy(bf->in_host + off, q->in[t].host, n);
            in[t] = bf->in_dev + off;
        }
        void *out = q->out.dev;
        if (!out) {
            uint64_t n = (uint64_t)q->len * heads * 2 * KDA_HEAD_DIM;
            uint64_t off = take(&bf->out_used, n);
            add_out(bf, q->out.host, off, n, 0, KDA_DTYPE_BF16);
            out = bf->out_dev + off;
        }
        bf->desc_host[i] = (kda_seq){.q = in[0], .k = in[1], .v = in[2], .g = in[3],
                                     .beta = in[4], .out = out, .layer = q->layer,
                                     .len = q->len, .slot = q->slot, .flags = q->flags};
    }
    /* Longest first: the kernel hands out work items in table order. */
    qsort(bf->desc_host, b->nseqs, sizeof(kda_seq), by_length_desc);
    *bf->count_host = (int32_t)b->nseqs;
    /* The daemon built this table from checked requests; a table the kernel
     * would refuse is a daemon bug, and must not reach the device. */
    kda_error kerr;
    if (b->nseqs && kda_cuda_batch_check(&cb->base.pool, bf->desc_host, b->nseqs, &kerr)) {
        b->status = KD_BATCH_FAILED;
        b->code = KP_E_INTERNAL;
        snprintf(b->message, sizeof(b->message), "cuda backend: %.200s", kerr.msg);
    }
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

/* Host function: runs on a CUDA driver thread when the stream reaches it.
 * It may make no CUDA call; it only rings the loop's doorbell. */
static void CUDART_CB host_done(void *arg)
{
    cuda_backend *cb = arg;
    uv_async_send(&cb->wake);
}

static void finish(cuda_buf *bf);
static void on_poll(uv_timer_t *t);

/* Queues a staged batch on the stream; a failure here means the context is
 * unusable (what names the step). */
static cudaError_t enqueue(cuda_backend *cb, cuda_buf *bf, const char **what)
{
    kd_batch *b = bf->batch;
    cudaError_t e = cudaSuccess;
    b->t.staged_ns = uv_hrtime();
    *what = "copying staged inputs";
    if (bf->in_used)
        e = cudaMemcpyAsync(bf->in_dev, bf->in_host, bf->in_used, cudaMemcpyHostToDevice,
                            cb->stream);
    for (uint32_t i = 0; e == cudaSuccess && i < b->nops; i++) {
        *what = "a slot operation";
        e = enqueue_op(cb, bf, i);
    }
    if (e == cudaSuccess && b->nseqs > 0) {
        *what = "replaying the prefill graph";
        e = cudaGraphLaunch(bf->graphs[bucket_for(cb, b->nseqs)], cb->stream);
    }
    if (e == cudaSuccess && bf->out_used) {
        *what = "copying staged outputs";
        e = cudaMemcpyAsync(bf->out_host, bf->out_dev, bf->out_used, cudaMemcpyDeviceToHost,
                            cb->stream);
    }
    if (e == cudaSuccess) {
        *what = "recording the completion event";
        e = cudaEventRecord(bf->done_ev, cb->stream);
    }
    if (e == cudaSuccess) {
        *what = "cudaLaunchHostFunc";
        e = cudaLaunchHostFunc(cb->stream, host_done, cb);
    }
    if (e == cudaSuccess) {
        bf->state = BUF_RUNNING;
        bf->seq = cb->next_seq++;
        if (!uv_is_active((uv_handle_t *)&cb->poll))
            uv_timer_start(&cb->poll, on_poll, KD_CUDA_POLL_MS, KD_CUDA_POLL_MS);
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

/* Whether a batch moves any bytes through the staging buffers (else its
 * descriptors are all it needs, and they are cheap to write on the loop). */
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
    return false;
}

/* ---------------------------------------------------------------------- */
/* Steps 3 and 4: done, unstage                                           */
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
    finish(w->data);
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

static cuda_buf *oldest_running(cuda_backend *cb)
{
    cuda_buf *best = NULL;
    for (int i = 0; i < KD_CUDA_DEPTH; i++) {
        cuda_buf *bf = &cb->buf[i];
        if (bf->state == BUF_RUNNING && (!best || bf->seq < best->seq))
            best = bf;
    }
    return best;
}

/* Asks the events of running batches, oldest first, whether they are done. */
static void check_running(cuda_backend *cb)
{
    cuda_buf *bf;
    while ((bf = oldest_running(cb))) {
        cudaError_t e = cudaEventQuery(bf->done_ev);
        if (e == cudaErrorNotReady)
            break;
        if (e != cudaSuccess) {
            /* The device faulted: this batch and every later one are lost. */
            cb->fatal = true;
            while ((bf = oldest_running(cb))) {
                fail_fatal(bf->batch, e, "the prefill batch");
                finish(bf);
            }
            break;
        }
        bf->batch->t.done_ns = uv_hrtime();
        bf->state = BUF_UNSTAGING;
        if (bf->nouts == 0) {
            finish(bf);
            continue;
        }
        bf->work.data = bf;
        if (uv_queue_work(cb->base.loop, &bf->work, unstage_work, unstage_after) != 0) {
            unstage_work(&bf->work); /* cannot happen with a live loop; stay correct anyway */
            finish(bf);
        }
    }
    if (!oldest_running(cb))
        uv_timer_stop(&cb->poll);
}

static void on_wake(uv_async_t *a)
{
    check_running(a->data);
}

static void on_poll(uv_timer_t *t)
{
    check_running(t->data);
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
        /* Device memory only (CUDA IPC regions, pinned shared memory): no
         * thread hop on the latency path.  The callback must not fire from
         * inside submit, so failures are returned instead. */
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
/* Layers and regions                                                     */
/* ---------------------------------------------------------------------- */

/*
 * One device block per layer: [kda_layer][A_log (H)][dt_bias (H x 128)].
 * Uploaded on the aux stream, so the copy does not wait behind running
 * batches; freed stream-ordered on the batch stream, after every batch that
 * could use it.
 */
static int cuda_layer_upload(kd_backend *b, const kda_layer *host, const kda_layer **dev,
                             void **handle, kp_error *err)
{
    cuda_backend *cb = (cuda_backend *)b;
    const size_t h = (size_t)b->pool.heads;
    const size_t head = round_stage(sizeof(kda_layer));
    const size_t a_bytes = round_stage(h * sizeof(float));
    const size_t total = head + a_bytes + h * KDA_HEAD_DIM * sizeof(float);
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
    return KP_OK;
}

static void cuda_layer_release(kd_backend *b, const kda_layer *dev, void *handle)
{
    cudaFreeAsync(handle, ((cuda_backend *)b)->stream);
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

static int cuda_open_ipc(kd_backend *b, const kp_region_register_cuda_params *p, void **dev,
                         void **handle, kp_error *err)
{
    cuda_backend *cb = (cuda_backend *)b;
    if (p->handle_type != KP_CUDA_HANDLE_IPC)
        return kp_fail(err, KP_E_NOT_SUPPORTED, "handle_type: \"posix_fd\" (VMM) regions are "
                       "not supported by this daemon; use \"ipc\"");
    if (strcmp(p->device, b->info.gpu_uuid) != 0)
        return kp_fail(err, KP_E_REGION_INVALID, "device: %s is not this daemon's GPU (%s)",
                       p->device, b->info.gpu_uuid);
    cudaIpcMemHandle_t h;
    memcpy(&h, p->handle, sizeof(h));
    void *ptr = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess)
        return kp_fail(err, KP_E_REGION_INVALID, "handle: cudaIpcOpenMemHandle: %s",
                       cudaGetErrorString(e));
    CUdeviceptr base = 0;
    size_t alloc = 0;
    if (cb->get_range && cb->get_range(&base, &alloc, (CUdeviceptr)(uintptr_t)ptr) == CUDA_SUCCESS &&
        p->size > alloc) {
        cudaIpcCloseMemHandle(ptr);
        return kp_fail(err, KP_E_REGION_INVALID, "size: %llu bytes exceed the allocation of "
                       "%zu bytes", (unsigned long long)p->size, alloc);
    }
    *dev = ptr;
    *handle = ptr;
    return KP_OK;
}

static void cuda_close_ipc(kd_backend *b, void *handle)
{
    cudaIpcCloseMemHandle(handle);
}

/* ---------------------------------------------------------------------- */
/* Creation and teardown                                                  */
/* ---------------------------------------------------------------------- */

static void free_buf(cuda_buf *bf, uint32_t nbuckets)
{
    if (bf->graphs) {
        for (uint32_t i = 0; i < nbuckets; i++) {
            if (bf->graphs[i])
                cudaGraphExecDestroy(bf->graphs[i]);
        }
    }
    free(bf->graphs);
    if (bf->done_ev)
        cudaEventDestroy(bf->done_ev);
    cudaFreeHost(bf->desc_host);
    cudaFreeHost(bf->count_host);
    cudaFreeHost(bf->in_host);
    cudaFreeHost(bf->out_host);
    cudaFree(bf->desc_dev);
    cudaFree(bf->count_dev);
    cudaFree(bf->in_dev);
    cudaFree(bf->out_dev);
    free(bf->outs);
    free(bf->op_off);
}

static void free_all(cuda_backend *cb)
{
    /* A healthy stream is drained first; a faulted one returns at once. */
    if (cb->stream)
        cudaStreamSynchronize(cb->stream);
    for (int i = 0; i < KD_CUDA_DEPTH; i++)
        free_buf(&cb->buf[i], cb->nbuckets);
    cudaFree(cb->base.pool.state);
    if (cb->aux)
        cudaStreamDestroy(cb->aux);
    if (cb->stream)
        cudaStreamDestroy(cb->stream);
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

/* The memory is freed once libuv has closed our two handles (the loop must
 * run once more, as it does at shutdown). */
static void cuda_destroy(kd_backend *b)
{
    cuda_backend *cb = (cuda_backend *)b;
    uv_close((uv_handle_t *)&cb->wake, on_handle_closed);
    uv_close((uv_handle_t *)&cb->poll, on_handle_closed);
}

static const kd_backend_ops cuda_ops = {
    .submit = cuda_submit,
    .layer_upload = cuda_layer_upload,
    .layer_release = cuda_layer_release,
    .pin_host = cuda_pin_host,
    .unpin_host = cuda_unpin_host,
    .open_ipc = cuda_open_ipc,
    .close_ipc = cuda_close_ipc,
    .destroy = cuda_destroy,
};

/* Captures [descriptor upload, count upload, kernel] for one bucket. */
static cudaError_t capture(cuda_backend *cb, cuda_buf *bf, uint32_t bucket, cudaGraphExec_t *out,
                           char *err, size_t errlen)
{
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamBeginCapture(cb->stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess)
        return e;
    cudaMemcpyAsync(bf->desc_dev, bf->desc_host, (size_t)bucket * sizeof(kda_seq),
                    cudaMemcpyHostToDevice, cb->stream);
    cudaMemcpyAsync(bf->count_dev, bf->count_host, sizeof(int32_t), cudaMemcpyHostToDevice,
                    cb->stream);
    kda_error kerr;
    int krc = kda_cuda_prefill(cb->k, &cb->base.pool, bf->desc_dev, bf->count_dev,
                               (int32_t)bucket, cb->stream, &kerr);
    e = cudaStreamEndCapture(cb->stream, &graph);
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

static cudaError_t alloc_buf(cuda_backend *cb, cuda_buf *bf, uint32_t max_seqs)
{
    cudaError_t e;
    bf->owner = cb;
    size_t desc = (size_t)max_seqs * sizeof(kda_seq);
    if ((e = cudaMallocHost((void **)&bf->desc_host, desc)) ||
        (e = cudaMallocHost((void **)&bf->count_host, sizeof(int32_t))) ||
        (e = cudaMallocHost((void **)&bf->in_host, cb->stage_bytes)) ||
        (e = cudaMallocHost((void **)&bf->out_host, cb->stage_bytes)) ||
        (e = cudaMalloc((void **)&bf->desc_dev, desc)) ||
        (e = cudaMalloc((void **)&bf->count_dev, sizeof(int32_t))) ||
        (e = cudaMalloc((void **)&bf->in_dev, cb->stage_bytes)) ||
        (e = cudaMalloc((void **)&bf->out_dev, cb->stage_bytes)) ||
        (e = cudaEventCreateWithFlags(&bf->done_ev, cudaEventDisableTiming)))
        return e;
    /* The graphs copy whole buckets: never let them read uninitialised bytes. */
    memset(bf->desc_host, 0, desc);
    *bf->count_host = 0;
    bf->graphs = calloc(cb->nbuckets, sizeof(*bf->graphs));
    return bf->graphs ? cudaSuccess : cudaErrorMemoryAllocation;
}

static void format_uuid(char *out, size_t size, const cudaUUID_t *u)
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, size, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
             b[13], b[14], b[15]);
}

int kd_backend_cuda_create(uv_loop_t *loop, const kd_backend_config *cfg, kd_backend **out,
                           char *err, size_t errlen)
{
    kda_cuda *k = NULL;
    kda_error kerr;
    if (kda_cuda_create((int)cfg->device, &k, &kerr) != KDA_OK) {
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
    cb->device = (int)cfg->device;
    kd_backend *b = &cb->base;
    b->ops = &cuda_ops;
    b->pool = (kda_pool){NULL, cfg->dtype, (int32_t)cfg->heads, cfg->slots};
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
    uint64_t pool_bytes = (uint64_t)cfg->slots * kd_backend_slot_bytes(b);
    int rc = KP_E_INTERNAL;
    if ((e = cudaGetDeviceProperties(&prop, cb->device)) ||
        (e = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking)) ||
        (e = cudaStreamCreateWithFlags(&cb->aux, cudaStreamNonBlocking))) {
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
            if ((e = capture(cb, &cb->buf[i], cb->buckets[j], &cb->buf[i].graphs[j], err,
                             errlen))) {
                if (!err[0])
                    cuda_err(err, errlen, e, "capturing a CUDA graph");
                goto fail;
            }
        }
    }
    if ((e = cudaStreamSynchronize(cb->stream))) {
        rc = cuda_err(err, errlen, e, "initialising the device");
        goto fail;
    }

    enum cudaDriverEntryPointQueryResult found;
    void *fn = NULL;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
        cb->get_range = (get_range_fn)fn;

    b->info = (kd_backend_info){
        .kind = KP_BACKEND_CUDA,
        .name = "cuda",
        .has_gpu = true,
        .gpu_index = cfg->device,
        .transports = KP_TRANSPORT_INLINE | KP_TRANSPORT_SHM | KP_TRANSPORT_CUDA_IPC,
        .depth = KD_CUDA_DEPTH,
        .stages_host = true,
        .max_stage_in = cb->stage_bytes,
        .max_stage_out = cb->stage_bytes,
    };
    snprintf(b->info.gpu_name, sizeof(b->info.gpu_name), "%s", prop.name);
    format_uuid(b->info.gpu_uuid, sizeof(b->info.gpu_uuid), &prop.uuid);

    uv_async_init(loop, &cb->wake, on_wake);
    uv_timer_init(loop, &cb->poll);
    cb->wake.data = cb->poll.data = cb;
    cb->handles_open = 2;
    KD_INFO("backend cuda: %s (%s, %d SMs), pool of %u slots x %u heads (%s, %llu MiB), "
            "%u graph buckets up to %u sequences, staging 2 x %llu MiB each way",
            prop.name, b->info.gpu_uuid, kda_cuda_sm_count(k), cfg->slots, cfg->heads,
            cfg->dtype == KDA_DTYPE_F32 ? "f32" : "bf16", (unsigned long long)(pool_bytes >> 20),
            cb->nbuckets, max_seqs, (unsigned long long)(cb->stage_bytes >> 20));
    *out = b;
    return KP_OK;
fail:
    free_all(cb);
    return rc;
}
