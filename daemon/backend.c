/*
 * backend.c - the parts every backend shares: the in-flight count,
 * completion, and state dtype conversion.  (Selection: backend_select.c.)
 */
#include "backend.h"

#include <string.h>

#include "bf16.h"

void kd_backend_destroy(kd_backend *b)
{
    if (b)
        b->ops->destroy(b);
}

static void start_batch(kd_batch *batch, bool gated)
{
    batch->status = KD_BATCH_OK;
    batch->code = KP_OK;
    batch->message[0] = '\0';
    batch->on_device = false;
    batch->gated = gated;
    uint64_t formed = batch->t.formed_ns;
    batch->t = (kd_batch_timing){.formed_ns = formed, .submit_ns = uv_hrtime()};
    batch->steps_t = (kd_batch_timing){0};
}

int kd_backend_submit(kd_backend *b, kd_batch *batch, kp_error *err)
{
    start_batch(batch, false);
    int rc = b->ops->submit(b, batch, err);
    if (rc == KP_OK)
        b->inflight++;
    return rc;
}

int kd_backend_submit_gated(kd_backend *b, kd_batch *batch, const kd_sem_word *ready,
                            kp_error *err)
{
    if (!b->ops->submit_gated || b->gated_inflight >= b->info.gated_lanes)
        return kp_fail(err, KP_E_INTERNAL, "no free lane for a gated batch");
    start_batch(batch, true);
    int rc = b->ops->submit_gated(b, batch, ready, err);
    if (rc == KP_OK)
        b->gated_inflight++;
    return rc;
}

void kd_backend_gated_go(kd_backend *b, kd_batch *batch)
{
    b->ops->gated_go(b, batch);
}

void kd_backend_gated_cancel(kd_backend *b, kd_batch *batch, const kp_error *err)
{
    b->ops->gated_cancel(b, batch, err->code, err->message);
}

void kd_backend_launched(kd_backend *b, kd_batch *batch)
{
    batch->on_device = true;
    b->on_device++;
}

/* Whether the batch was on the device (it no longer is). */
static bool leave_device(kd_backend *b, kd_batch *batch)
{
    if (!batch->on_device)
        return false;
    batch->on_device = false;
    b->on_device--;
    return true;
}

void kd_backend_device_done(kd_backend *b, kd_batch *batch)
{
    if (leave_device(b, batch) && b->on_device == 0 && b->idle)
        b->idle(b->done_ctx);
}

void kd_backend_steps_done(kd_backend *b, kd_batch *batch)
{
    if (b->steps_done)
        b->steps_done(b->done_ctx, batch);
}

void kd_backend_complete(kd_backend *b, kd_batch *batch)
{
    leave_device(b, batch);
    kd_batch_timing *t = &batch->t;
    if (!t->done_ns)
        t->done_ns = uv_hrtime();
    if (!t->unstaged_ns)
        t->unstaged_ns = uv_hrtime();
    if (batch->gated)
        b->gated_inflight--;
    else
        b->inflight--;
    b->done(b->done_ctx, batch);
}

int kd_backend_read_word(kd_backend *b, kd_buf word, uint64_t *value)
{
    if (word.host) {
        *value = __atomic_load_n((const uint64_t *)word.host, __ATOMIC_ACQUIRE);
        return KP_OK;
    }
    if (!b->ops->read_word)
        return KP_E_NOT_SUPPORTED;
    return b->ops->read_word(b, word, value);
}

void kd_backend_write_word(kd_backend *b, kd_buf word, uint64_t value)
{
    if (word.host)
        __atomic_store_n((uint64_t *)word.host, value, __ATOMIC_RELEASE);
    else if (b->ops->write_word)
        b->ops->write_word(b, word, value);
}

kp_memory kd_backend_memory(const kd_backend *b)
{
    kp_memory m = b->memory;
    m.total = m.pool + m.staging + m.scratch + m.kernel + m.lanes + m.layers;
    return m;
}

uint64_t kd_backend_slot_bytes(const kd_backend *b)
{
    return (uint64_t)kda_slot_elems(b->pool.heads) * kda_dtype_size(b->pool.dtype);
}

void kd_state_convert(void *dst, kda_dtype dst_dtype, const void *src, kda_dtype src_dtype,
                      uint64_t n)
{
    if (dst_dtype == src_dtype) {
        memcpy(dst, src, n * kda_dtype_size(dst_dtype));
        return;
    }
    uint8_t *d = dst;
    const uint8_t *s = src;
    if (dst_dtype == KDA_DTYPE_F32) { /* bf16 -> f32: exact */
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            float f = kda_bf16_to_f32(h);
            memcpy(d + 4 * i, &f, 4);
        }
    } else { /* f32 -> bf16: round to nearest even */
        for (uint64_t i = 0; i < n; i++) {
            float f;
            memcpy(&f, s + 4 * i, 4);
            uint16_t h = kda_f32_to_bf16(f);
            memcpy(d + 2 * i, &h, 2);
        }
    }
}
