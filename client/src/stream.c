/*
 * stream.c - stream-ordered prefills (PROTOCOL.md §Stream-ordered
 * requests): the semaphore words' bookkeeping on the client's side, and the
 * CUDA driver calls that put them on the caller's stream.
 *
 * The library links no CUDA.  The driver (libcuda.so.1) is loaded at the
 * first call that needs it, and only the handful of entry points below are
 * looked up; their types are spelt out here as the driver API defines them.
 */
#include <dlfcn.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include "client_int.h"

typedef int cu_result;                /* CUresult: 0 is CUDA_SUCCESS */
typedef void *cu_stream;              /* CUstream */
typedef void *cu_context;             /* CUcontext */
typedef unsigned long long cu_devptr; /* CUdeviceptr */

#define CU_STREAM_NON_BLOCKING 0x1u
#define CU_STREAM_WAIT_VALUE_GEQ 0x0u
#define CU_MEMHOSTREGISTER_PORTABLE 0x1u
#define CU_MEMHOSTREGISTER_DEVICEMAP 0x2u

typedef struct driver {
    bool loaded;  /* every entry point below was found */
    cu_result (*write64)(cu_stream s, cu_devptr addr, uint64_t value, unsigned flags);
    cu_result (*wait64)(cu_stream s, cu_devptr addr, uint64_t value, unsigned flags);
    cu_result (*stream_create)(cu_stream *s, unsigned flags);
    cu_result (*stream_destroy)(cu_stream s);
    cu_result (*stream_sync)(cu_stream s);
    cu_result (*ctx_get)(cu_context *ctx);
    cu_result (*ctx_push)(cu_context ctx);
    cu_result (*ctx_pop)(cu_context *ctx);
    cu_result (*host_register)(void *p, size_t bytes, unsigned flags);
    cu_result (*host_unregister)(void *p);
    cu_result (*host_dev_ptr)(cu_devptr *d, void *p, unsigned flags);
} driver;

static driver drv;
static int drv_state; /* 0: not loaded, 1: loading, 2: drv is final */

/* The current name of an entry point first (the _v2 forms are what cuda.h
 * maps the plain names to), then the plain one. */
static void *sym(void *h, const char *v2, const char *plain)
{
    void *f = v2 ? dlsym(h, v2) : NULL;
    return f ? f : dlsym(h, plain);
}

static void load_driver(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return;
    void **f[] = {(void **)&drv.write64, (void **)&drv.wait64, (void **)&drv.stream_create,
                  (void **)&drv.stream_destroy, (void **)&drv.stream_sync, (void **)&drv.ctx_get,
                  (void **)&drv.ctx_push, (void **)&drv.ctx_pop, (void **)&drv.host_register,
                  (void **)&drv.host_unregister, (void **)&drv.host_dev_ptr};
    static const char *const names[][2] = {
        {"cuStreamWriteValue64_v2", "cuStreamWriteValue64"},
        {"cuStreamWaitValue64_v2", "cuStreamWaitValue64"},
        {NULL, "cuStreamCreate"},
        {"cuStreamDestroy_v2", "cuStreamDestroy"},
        {NULL, "cuStreamSynchronize"},
        {NULL, "cuCtxGetCurrent"},
        {"cuCtxPushCurrent_v2", "cuCtxPushCurrent"},
        {"cuCtxPopCurrent_v2", "cuCtxPopCurrent"},
        {"cuMemHostRegister_v2", "cuMemHostRegister"},
        {NULL, "cuMemHostUnregister"},
        {"cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"},
    };
    for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++) {
        if (!(*f[i] = sym(h, names[i][0], names[i][1])))
            return; /* the handle stays open: dlclose would race other threads' loads */
    }
    drv.loaded = true;
}

/* Loads the driver once, whichever thread comes first; the others wait for it. */
static bool have_driver(void)
{
    int st = __atomic_load_n(&drv_state, __ATOMIC_ACQUIRE);
    if (st != 2) {
        int expected = 0;
        if (__atomic_compare_exchange_n(&drv_state, &expected, 1, false, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            load_driver();
            __atomic_store_n(&drv_state, 2, __ATOMIC_RELEASE);
        } else {
            while (__atomic_load_n(&drv_state, __ATOMIC_ACQUIRE) != 2)
                sched_yield();
        }
    }
    return drv.loaded;
}

/* ---------------------------------------------------------------------- */
/* Failure values                                                          */
/* ---------------------------------------------------------------------- */

/* Stores value into a device-only word from the host: on a stream of the
 * library's own, non-blocking so that it never waits behind the caller's
 * streams (one of which may be waiting on this very word). */
static void write_device_word(cu_context ctx, cu_devptr dev, uint64_t value)
{
    cu_stream s;
    cu_context popped;
    if (!have_driver() || (ctx && drv.ctx_push(ctx) != 0))
        return;
    if (drv.stream_create(&s, CU_STREAM_NON_BLOCKING) == 0) {
        if (drv.write64(s, dev, value, 0) == 0)
            drv.stream_sync(s);
        drv.stream_destroy(s);
    }
    if (ctx)
        drv.ctx_pop(&popped);
}

void client_sem_fail(pending *p)
{
    if (!p->has_done)
        return;
    p->has_done = false;
    uint64_t v = p->done_value | KDAC_SEM_FAILED;
    if (p->done_host)
        __atomic_store_n((uint64_t *)p->done_host, v, __ATOMIC_RELEASE);
    else if (p->done_dev)
        write_device_word(p->done_ctx, p->done_dev, v);
}

int kdac_sem_check(const kdac_sem *done)
{
    if (!done || !done->host)
        return 0;
    uint64_t w = __atomic_load_n((const uint64_t *)done->host, __ATOMIC_ACQUIRE);
    if (w < done->value)
        return 0;
    return (w & KDAC_SEM_FAILED) ? -1 : 1;
}

/* ---------------------------------------------------------------------- */
/* The stream form                                                         */
/* ---------------------------------------------------------------------- */

int kdac_prefill_on_stream(kdac_client *c, void *stream, const char *layer, const kdac_seq *seqs,
                           uint32_t nseqs, const kdac_sem *ready, const kdac_sem *done,
                           kdac_cb cb, void *data, kdac_error *err)
{
    cu_context ctx = NULL;
    if (!ready || !done || !ready->dev || !done->dev)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "the stream form needs a ready and a "
                         "done semaphore with device addresses (dev)");
    if (!have_driver())
        return kdac_fail(err, KDAC_E_NOT_SUPPORTED, "no CUDA driver with 64-bit stream memory "
                         "operations (libcuda.so.1)");
    if (drv.ctx_get(&ctx) != 0 || !ctx)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "no current CUDA context in this thread");
    int rc = client_prefill_check_sems(c, ready, done, err);
    if (rc)
        return rc;
    /* Both stream operations go in before the request is sent: the stream
     * then blocks at the wait whatever happens next, and every way the
     * request can end writes the done word. */
    cu_result r = drv.write64((cu_stream)stream, (cu_devptr)ready->dev, ready->value, 0);
    if (r != 0)
        return kdac_fail(err, KDAC_E_DEVICE_FAILED, "cuStreamWriteValue64 (ready): CUDA error "
                         "%d", r);
    r = drv.wait64((cu_stream)stream, (cu_devptr)done->dev, done->value,
                   CU_STREAM_WAIT_VALUE_GEQ);
    if (r != 0)
        return kdac_fail(err, KDAC_E_DEVICE_FAILED, "cuStreamWaitValue64 (done): CUDA error %d",
                         r);
    rc = client_prefill_send(c, layer, seqs, nseqs, ready, done, ctx, cb, data, err);
    if (rc) { /* never sent: release the wait just enqueued */
        pending tmp = {.has_done = true, .done_host = done->host, .done_dev = done->dev,
                       .done_value = done->value, .done_ctx = ctx};
        client_sem_fail(&tmp);
    }
    return rc;
}

/* ---------------------------------------------------------------------- */
/* Shared memory for the devices                                           */
/* ---------------------------------------------------------------------- */

int kdac_shm_map_device(kdac_shm *shm, uint64_t *dev, kdac_error *err)
{
    cu_devptr d = 0;
    if (!shm || !shm->base || !dev)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "shm or dev is NULL");
    if (!have_driver())
        return kdac_fail(err, KDAC_E_NOT_SUPPORTED, "no CUDA driver (libcuda.so.1)");
    cu_result r = drv.host_register(shm->base, shm->size,
                                    CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
    if (r != 0)
        return kdac_fail(err, KDAC_E_DEVICE_FAILED, "cuMemHostRegister: CUDA error %d", r);
    if ((r = drv.host_dev_ptr(&d, shm->base, 0)) != 0) {
        drv.host_unregister(shm->base);
        return kdac_fail(err, KDAC_E_DEVICE_FAILED, "cuMemHostGetDevicePointer: CUDA error %d",
                         r);
    }
    *dev = d;
    return KDAC_OK;
}

void kdac_shm_unmap_device(kdac_shm *shm)
{
    if (shm && shm->base && have_driver())
        drv.host_unregister(shm->base);
}
