/*
 * backend_cpu.c - the cpu backend: the state pool in host memory and
 * kda_cpu_step / kda_cpu_prefill (kernels/kda_cpu.h) run on a libuv worker thread, one
 * batch at a time, so the loop never waits for it.  kda_cpu spreads each
 * batch over its own threads.
 *
 * Every buffer is host memory used in place.  kda_cpu indexes bf16 arrays
 * directly, so an input that sits at an odd address (an inline tensor after
 * an odd-length msgpack header) is first copied to aligned scratch memory,
 * on the worker thread.
 *
 * A batch that holds decode steps and prefill sequences runs its steps as a
 * worker job of their own, reports them done (kd_backend_steps_done: their
 * requests are answered), then runs the rest: a step never waits for the
 * prefill of its batch.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "kda_cpu.h"
#include "log.h"

typedef struct cpu_backend {
    kd_backend base;
    kda_cpu *cpu;
    uv_work_t work;
    kd_batch *batch; /* the batch on the worker, or NULL */
    bool steps_apart; /* its steps run (and are answered) before the rest of it */
} cpu_backend;

static void *slot_state(const kd_backend *b, uint32_t slot)
{
    return (uint8_t *)b->pool.state + (uint64_t)slot * kd_backend_slot_bytes(b);
}

static void run_op(kd_backend *b, const kd_slot_op *op)
{
    uint64_t bytes = kd_backend_slot_bytes(b);
    uint64_t elems = (uint64_t)kda_slot_elems(b->pool.heads);
    switch (op->kind) {
    case KD_OP_ZERO:
        memset(slot_state(b, op->slot), 0, bytes);
        break;
    case KD_OP_COPY:
        memcpy(slot_state(b, op->slot), slot_state(b, op->src), bytes);
        break;
    case KD_OP_READ:
        kd_state_convert(op->buf.host, op->dtype, slot_state(b, op->slot), b->pool.dtype, elems);
        break;
    case KD_OP_WRITE:
        kd_state_convert(slot_state(b, op->slot), b->pool.dtype, op->buf.host, op->dtype, elems);
        break;
    }
}

/* Bytes of input tensor t (q, k, v, g or beta) of a sequence. */
static uint64_t input_bytes(int t, int64_t len, int32_t heads)
{
    return (uint64_t)len * (uint64_t)heads * (t == 4 ? 2 : 2 * KDA_HEAD_DIM);
}

/* Runs the launch (which checks everything before it writes) and, when it
 * succeeded, the slot operations: so a failing batch changes nothing (lost:
 * steps of the batch ran before it and were not answered apart). */
static void cpu_run(kd_backend *b, kd_batch *batch, kda_cpu *cpu, bool lost);
/* Runs the batch's decode steps, before its prefill: their sequences are the
 * short, latency-bound ones. */
static void cpu_run_steps(kd_backend *b, kd_batch *batch, kda_cpu *cpu);

/* Nothing to stage: the worker starting is both. */
static void start_timing(kd_batch *batch)
{
    batch->t.staged_ns = batch->t.launched_ns = uv_hrtime();
}

/* Worker thread: the steps of a batch that runs them apart. */
static void cpu_steps_work(uv_work_t *w)
{
    cpu_backend *cb = w->data;
    start_timing(cb->batch);
    cpu_run_steps(&cb->base, cb->batch, cb->cpu);
    cb->batch->t.signaled_ns = uv_hrtime();
}

/* Worker thread: the batch, or what is left of it after its steps. */
static void cpu_work(uv_work_t *w)
{
    cpu_backend *cb = w->data;
    kd_batch *batch = cb->batch;
    kd_batch_timing *t = &batch->t;
    if (!cb->steps_apart) {
        start_timing(batch);
        cpu_run_steps(&cb->base, batch, cb->cpu);
    }
    if (batch->status == KD_BATCH_OK)
        cpu_run(&cb->base, batch, cb->cpu, batch->nsteps > 0 && !cb->steps_apart);
    if (batch->status == KD_BATCH_OK) {
        for (uint32_t i = 0; i < batch->nops; i++)
            run_op(&cb->base, &batch->ops[i]);
        /* Release stores: a client that sees the value sees the outputs and states. */
        for (uint32_t i = 0; i < batch->ndones; i++)
            kd_backend_write_word(&cb->base, batch->dones[i].buf, batch->dones[i].value);
    }
    t->signaled_ns = uv_hrtime();
    t->device_ns = t->signaled_ns - t->launched_ns;
}

static void cpu_run(kd_backend *b, kd_batch *batch, kda_cpu *cpu, bool lost)
{
    if (batch->nseqs == 0)
        return;

    uint64_t scratch_bytes = 0;
    for (uint32_t i = 0; i < batch->nseqs; i++) {
        for (int t = 0; t < 5; t++) {
            if ((uintptr_t)batch->seqs[i].in[t].host & 1)
                scratch_bytes += input_bytes(t, batch->seqs[i].len, b->pool.heads);
        }
    }
    kda_seq *seqs = calloc(batch->nseqs, sizeof(*seqs));
    uint8_t *scratch = scratch_bytes ? malloc(scratch_bytes) : NULL;
    if (!seqs || (scratch_bytes && !scratch)) {
        batch->status = KD_BATCH_FAILED;
        batch->code = KP_E_NO_MEMORY;
        snprintf(batch->message, sizeof(batch->message), "no memory to stage %llu bytes of "
                 "unaligned inline tensors", (unsigned long long)scratch_bytes);
        goto out;
    }
    uint64_t used = 0;
    for (uint32_t i = 0; i < batch->nseqs; i++) {
        const kd_batch_seq *q = &batch->seqs[i];
        const void *in[5];
        for (int t = 0; t < 5; t++) {
            in[t] = q->in[t].host;
            if ((uintptr_t)in[t] & 1) {
                uint64_t n = input_bytes(t, q->len, b->pool.heads);
                memcpy(scratch + used, in[t], n);
                in[t] = scratch + used;
                used += n;
            }
        }
        seqs[i] = (kda_seq){.q = in[0], .k = in[1], .v = in[2], .g = in[3], .beta = in[4],
                            .out = q->out.host, .layer = q->layer, .len = q->len,
                            .slot = q->slot, .flags = q->flags};
    }
    kda_error kerr;
    uint64_t t0 = uv_hrtime();
    int krc = kda_cpu_prefill(cpu, &b->pool, seqs, batch->nseqs, &kerr);
    batch->t.kernel_ns += uv_hrtime() - t0;
    if (krc != KDA_OK) {
        /* kda_cpu checks everything before it writes: the states are intact
         * (the batch's steps, if any, did run: then it is lost). */
        batch->status = lost ? KD_BATCH_LOST : KD_BATCH_FAILED;
        batch->code = kerr.code == KDA_ENOMEM ? KP_E_NO_MEMORY : KP_E_INTERNAL;
        snprintf(batch->message, sizeof(batch->message), "cpu backend: %.200s", kerr.msg);
    }
out:
    free(seqs);
    free(scratch);
}

static void cpu_run_steps(kd_backend *b, kd_batch *batch, kda_cpu *cpu)
{
    uint64_t kernel_ns = 0;
    for (uint32_t s = 0; s < batch->nsteps && batch->status == KD_BATCH_OK; s++) {
        const kd_batch_step *st = &batch->steps[s];
        uint64_t bytes[5], scratch_bytes = 0;
        for (int t = 0; t < 5; t++) {
            bytes[t] = input_bytes(t, st->tokens, b->pool.heads);
            if ((uintptr_t)st->in[t].host & 1)
                scratch_bytes += bytes[t];
        }
        uint8_t *scratch = scratch_bytes ? malloc(scratch_bytes) : NULL;
        if (scratch_bytes && !scratch) {
            batch->status = KD_BATCH_FAILED;
            batch->code = KP_E_NO_MEMORY;
            snprintf(batch->message, sizeof(batch->message), "no memory to stage %llu bytes of "
                     "unaligned inline tensors", (unsigned long long)scratch_bytes);
            break;
        }
        const void *in[5];
        uint64_t used = 0;
        for (int t = 0; t < 5; t++) {
            in[t] = st->in[t].host;
            if ((uintptr_t)in[t] & 1) {
                memcpy(scratch + used, in[t], bytes[t]);
                in[t] = scratch + used;
                used += bytes[t];
            }
        }
        kda_step k = {.q = in[0], .k = in[1], .v = in[2], .g = in[3], .beta = in[4],
                      .out = st->out.host, .states = st->states.host, .layer = st->layer,
                      .seqs = st->seqs, .nseqs = (int32_t)st->nseqs, .tokens = (int32_t)st->tokens};
        kda_error kerr;
        uint64_t t0 = uv_hrtime();
        int krc = kda_cpu_step(cpu, &b->pool, &k, &kerr);
        kernel_ns += uv_hrtime() - t0;
        free(scratch);
        if (krc != KDA_OK) {
            /* A failed step changed nothing; the steps before it did run, so
             * the batch counts as lost (its sequences' slots are not trusted). */
            batch->status = s == 0 ? KD_BATCH_FAILED : KD_BATCH_LOST;
            batch->code = kerr.code == KDA_ENOMEM ? KP_E_NO_MEMORY : KP_E_INTERNAL;
            snprintf(batch->message, sizeof(batch->message), "cpu backend: %.200s", kerr.msg);
        }
    }
    batch->t.kernel_ns = kernel_ns;
}

/* Loop thread. */
static void cpu_after_work(uv_work_t *w, int status)
{
    cpu_backend *cb = w->data;
    kd_batch *batch = cb->batch;
    cb->batch = NULL;
    batch->t.done_ns = batch->t.unstaged_ns = uv_hrtime();
    kd_backend_complete(&cb->base, batch);
}

/* Loop thread: the steps ran; answered, then the rest goes to the worker (a
 * failure ends the batch there, as when they run with it). */
static void cpu_after_steps(uv_work_t *w, int status)
{
    cpu_backend *cb = w->data;
    kd_batch *batch = cb->batch;
    if (batch->status != KD_BATCH_OK) {
        batch->t.device_ns = batch->t.signaled_ns - batch->t.launched_ns;
        cpu_after_work(w, status);
        return;
    }
    kd_batch_timing *st = &batch->steps_t;
    *st = batch->t;
    st->done_ns = st->unstaged_ns = uv_hrtime();
    st->device_ns = st->signaled_ns - st->launched_ns;
    kd_backend_steps_done(&cb->base, batch);
    if (uv_queue_work(cb->base.loop, &cb->work, cpu_work, cpu_after_work) != 0) {
        cpu_work(w); /* cannot happen with a live loop; stay correct anyway */
        cpu_after_work(w, 0);
    }
}

static int cpu_submit(kd_backend *b, kd_batch *batch, kp_error *err)
{
    cpu_backend *cb = (cpu_backend *)b;
    if (cb->batch)
        return kp_fail(err, KP_E_INTERNAL, "cpu backend: a batch is already running");
    cb->batch = batch;
    cb->work.data = cb;
    cb->steps_apart = batch->nsteps > 0 && batch->nseqs > 0 && b->steps_done;
    int rc = cb->steps_apart ? uv_queue_work(b->loop, &cb->work, cpu_steps_work, cpu_after_steps)
                             : uv_queue_work(b->loop, &cb->work, cpu_work, cpu_after_work);
    if (rc) {
        cb->batch = NULL;
        return kp_fail(err, KP_E_INTERNAL, "uv_queue_work: %s", uv_strerror(rc));
    }
    kd_backend_launched(b, batch);
    return KP_OK;
}

/* The kernel reads host weights in place. */
static int cpu_layer_upload(kd_backend *b, const kda_layer *host, const kda_layer **dev,
                            void **handle, kp_error *err)
{
    *dev = host;
    *handle = NULL;
    return KP_OK;
}

static void cpu_layer_release(kd_backend *b, const kda_layer *dev, void *handle)
{
}

static void cpu_destroy(kd_backend *b)
{
    cpu_backend *cb = (cpu_backend *)b;
    kda_cpu_destroy(cb->cpu);
    free(b->pool.state);
    free(cb);
}

static const kd_backend_ops cpu_ops = {
    .submit = cpu_submit,
    .layer_upload = cpu_layer_upload,
    .layer_release = cpu_layer_release,
    .pin_host = NULL,
    .unpin_host = NULL,
    .open_cuda = NULL,
    .close_cuda = NULL,
    .read_word = NULL,
    .write_word = NULL,
    .destroy = cpu_destroy,
};

int kd_backend_cpu_create(uv_loop_t *loop, const kd_backend_config *cfg, kd_backend **out,
                          char *err, size_t errlen)
{
    cpu_backend *cb = calloc(1, sizeof(*cb));
    if (!cb) {
        snprintf(err, errlen, "no memory for the cpu backend");
        return KP_E_NO_MEMORY;
    }
    kd_backend *b = &cb->base;
    b->ops = &cpu_ops;
    b->pool = (kda_pool){NULL, cfg->dtype, (int32_t)cfg->heads, cfg->slots};
    uint64_t bytes = (uint64_t)cfg->slots * kd_backend_slot_bytes(b);
    /* calloc: pages are only touched when a slot is first written, so a
     * large pool costs nothing until it is used. */
    b->pool.state = calloc(1, bytes);
    kda_error kerr;
    if (!b->pool.state) {
        snprintf(err, errlen, "cannot allocate the state pool: %u slots x %llu bytes",
                 cfg->slots, (unsigned long long)kd_backend_slot_bytes(b));
        free(cb);
        return KP_E_NO_MEMORY;
    }
    if (kda_cpu_create((int)cfg->cpu_threads, &cb->cpu, &kerr) != KDA_OK) {
        snprintf(err, errlen, "cpu backend: %s", kerr.msg);
        free(b->pool.state);
        free(cb);
        return KP_E_NO_MEMORY;
    }
    b->memory.pool = bytes; /* host memory: the kernel reads the layers in place and takes its
                               scratch per batch */
    b->info = (kd_backend_info){
        .kind = KP_BACKEND_CPU,
        .name = "cpu",
        .has_gpu = false,
        .transports = KP_TRANSPORT_INLINE | KP_TRANSPORT_SHM,
        .depth = 1, /* kda_cpu runs one batch at a time; a second would only wait */
        .stages_host = false,
        .max_stage_in = UINT64_MAX,
        .max_stage_out = UINT64_MAX,
        .sems = true,
    };
    KD_INFO("backend cpu: %d threads, pool of %u slots x %u heads (%s, %llu MiB)",
            kda_cpu_threads(cb->cpu), cfg->slots, cfg->heads,
            cfg->dtype == KDA_DTYPE_F32 ? "f32" : "bf16", (unsigned long long)(bytes >> 20));
    *out = b;
    return KP_OK;
}
