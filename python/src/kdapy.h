/*
 * kdapy.h - private to the kdaclient extension: the Client object, the
 * record of one request (blocking or in flight), and what the module's files
 * share.
 *
 *   module.c       module init, the error classes, the hooks set from Python
 *   client_type.c  the Client type: connection, setup calls, async plumbing
 *   tensors.c      array arguments -> kdac_tensor / kdac_output (buffers,
 *                  DLPack, __cuda_array_interface__, staging through shm)
 *   cuda.c         CUDA regions: segment lookup through the driver (dlopen'd),
 *                  the per-allocation registration cache
 *   results.c      exceptions and result objects
 *   step.c         decode steps (Client.step): packed tensors, kept states
 *   ordered.c      stream-ordered prefills: the client's semaphore words,
 *                  the ready write and done wait on the caller's CUDA stream
 *
 * Built against the stable ABI (Py_LIMITED_API, set by setup.py).
 */
#ifndef KDAPY_H
#define KDAPY_H

#include <Python.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdint.h>

#include "kdaclient.h"

/* Shared-memory staging buffers kept per client for host arrays too large to
 * go inline (each one region of the connection's quota). */
#define KP_STAGING_MAX 4
/* Host arrays of a request go through staging above this many bytes in and
 * out together (or above the daemon's max_inline_bytes, whichever is less). */
#define KP_DEFAULT_INLINE_MAX (4u << 20)
/* Regions the client keeps for itself (staging buffers, a spare): the CUDA cache
 * evicts before it would take these from max_regions_per_client. */
#define KP_REGIONS_RESERVED (KP_STAGING_MAX + 1)

typedef struct staging {
    kdac_shm shm;    /* mapping and memfd (shm.base NULL: unused entry) */
    uint32_t region; /* its id on the connection */
    bool busy;       /* held by a request in flight */
} staging;

/* The memory of a shared array (Client.shared_array): a memfd mapping owned
 * by a Python mmap object, registered once as a region. */
typedef struct arena {
    uintptr_t base;
    uint64_t size;
    uint32_t region;
    PyObject *owner; /* the mmap: keeps the addresses valid while the entry exists */
} arena;

/* Semaphore words of stream-ordered prefills: one shared-memory page set
 * registered as a region, pairs of 64-bit words (ready at 16 * i, done at
 * 16 * i + 8) handed out first in, first out. */
#define KP_WORD_PAIRS 4096
typedef struct words {
    kdac_shm shm;       /* shm.base NULL until the first stream-ordered prefill */
    uint32_t region;
    uint64_t dev;       /* device address of shm.base once mapped for the devices */
    uint64_t value;     /* the last semaphore value handed out (values only rise) */
    uint32_t ring[KP_WORD_PAIRS]; /* free pairs, from head */
    uint32_t head, nfree;
    uint32_t retired;   /* pairs whose done word keeps a failure value (never reused) */
} words;

/* One registered CUDA allocation. */
typedef struct cuda_entry {
    uint64_t buffer_id; /* CU_POINTER_ATTRIBUTE_BUFFER_ID: unique per allocation (VMM:
                           MEMORY_BLOCK_ID, the physical allocation's) */
    uint64_t base;      /* the allocation's first byte */
    uint64_t size;
    uint32_t region;
    uint64_t last_use;  /* the client's use clock, for LRU eviction */
    bool vmm;           /* registered by POSIX fd (a VMM mapping), not an IPC handle */
} cuda_entry;

typedef struct ClientObject {
    PyObject_HEAD
    kdac_client *c;             /* NULL once closed */
    PyThread_type_lock lock;    /* one call at a time on the connection */
    uint32_t heads;
    kdac_dtype state_dtype;
    uint64_t inline_max;        /* staging threshold, bytes */
    uint32_t max_regions;
    uint32_t async_inflight;    /* requests with a Python callback pending */
    int in_callback;            /* > 0 while a completion callback runs */
    staging stg[KP_STAGING_MAX];
    arena *arenas;
    uint32_t narenas, arenas_cap;
    cuda_entry *cuda;
    uint32_t ncuda, cuda_cap;
    uint64_t use_clock;         /* advanced per request: its registrations are not evicted */
    uint64_t cuda_registered;   /* registrations made, for tests and tuning */
    uint64_t cuda_released;
    uint64_t last_us[4];        /* the last completed prefill or step: queue, run, device,
                                   kernel */
    words *words;               /* stream-ordered prefills' semaphores (NULL until used) */
    PyObject *weakreflist;
} ClientObject;

/* One resolved array argument. */
typedef struct tensor_arg {
    bool host;            /* host memory at ptr; else region/offset */
    void *ptr;
    uint64_t nbytes;
    uint32_t region;      /* region >= 1 when !host (or a host arena) */
    uint64_t offset;
    Py_buffer view;       /* held when have_view */
    bool have_view;
    PyObject *keep;       /* owner kept alive (a DLPack capsule, a coerced array) */
    bool cuda;            /* device memory */
    int elem;             /* element bytes: 2 (bf16), 4 (f32), 1 (raw bytes) */
} tensor_arg;

/* A staged output: copied from the staging buffer to dst on completion. */
typedef struct copyback {
    void *dst;
    uint64_t offset;
    uint64_t nbytes;
} copyback;

/* A prefill, read or write from argument parsing to completion. */
typedef struct request {
    ClientObject *client;   /* strong reference while in flight (async) */
    uint32_t nseqs;
    kdac_seq *seqs;
    tensor_arg *args;       /* 6 per sequence: q k v g beta out */
    PyObject **outs;        /* per sequence: the result's out (or NULL) */
    staging *stg;
    copyback *cbs;
    uint32_t ncbs;
    bool any_cuda;
    PyObject *callback;     /* async: called with (result, exception, timings) */
    int32_t pair;           /* stream-ordered: its semaphore words, else -1 */
} request;

/* module.c */
extern PyObject *kp_numpy_empty;   /* numpy.empty, set on first use */
extern PyObject *kp_coerce_hook;   /* Python: obj, field -> array with the buffer protocol */
extern PyObject *kp_error_base;    /* kdaclient.Error */
PyObject *kp_error_class(int code);
int kp_numpy(void);

/* results.c: raise kdaclient.<Name>(message) for err; returns NULL. */
PyObject *kp_raise(const kdac_error *err);
PyObject *kp_make_exception(const kdac_error *err);
/* A NumPy array of the given shape (uint16, float32 ...) and its writable buffer. */
PyObject *kp_new_array(const Py_ssize_t *shape, int ndim, const char *dtype, Py_buffer *view);
/* The prefill result list from positions and out arrays. */
PyObject *kp_prefill_result(request *r, const uint64_t *pos);
/* {"queue_us", "run_us", "device_us", "kernel_us"} of us[4]. */
PyObject *kp_timings(const uint64_t *us);
/* The pending exception as an object (for a completion callback), or None. */
PyObject *kp_fetch_exception(void);

/* tensors.c */
typedef enum kp_elem { KP_ELEM_BF16, KP_ELEM_F32, KP_ELEM_STATE } kp_elem;
int kp_tensor_resolve(ClientObject *self, PyObject *obj, const char *field, kp_elem elem,
                      bool writable, tensor_arg *t);
void kp_tensor_release(tensor_arg *t);
int kp_request_build(ClientObject *self, PyObject *seqs, request *r);
void kp_request_release(request *r);
/* Raises ValueError naming the first tensor of r that is not in a region (a CUDA
 * tensor or shared_array memory), ending the message with why. */
int kp_request_require_regions(const request *r, const char *why);
/* Copies staged outputs back and gives the staging buffer back. */
void kp_request_unstage(request *r);
/* Routes the host arrays of r through a staging buffer when they exceed the inline limit. */
int kp_request_stage(ClientObject *self, request *r);
staging *kp_staging_get(ClientObject *self, uint64_t bytes);
void kp_staging_close_all(ClientObject *self);
void kp_arenas_close_all(ClientObject *self);
/* A host range inside one of the client's shared arrays: its region and offset. */
bool kp_arena_find(ClientObject *self, const void *ptr, uint64_t nbytes, uint32_t *region,
                   uint64_t *offset);

/* cuda.c */
/* The region and offset holding device memory [ptr, ptr + nbytes): registers
 * its allocation on first use. */
int kp_cuda_region(ClientObject *self, uint64_t ptr, uint64_t nbytes, const char *field,
                   uint32_t *region, uint64_t *offset);
/* Waits for the current context's work (inputs written before a request reads them). */
int kp_cuda_sync(void);
void kp_cuda_forget_all(ClientObject *self, bool release);
/* Releases cached registrations whose allocation is gone (or all); returns how many. */
int kp_cuda_sweep(ClientObject *self, bool all);

/* client_type.c */
extern PyType_Spec kp_client_spec;
/* Takes the client's lock (one call at a time on a connection), waiting for
 * it with the GIL released when another thread holds it. */
static inline void kp_lock(ClientObject *self)
{
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
}
static inline void kp_unlock(ClientObject *self)
{
    PyThread_release_lock(self->lock);
}
/* Runs stmt (a blocking libkdaclient call) with the GIL released; the caller holds the lock. */
#define KP_NOGIL(stmt)            \
    do {                          \
        Py_BEGIN_ALLOW_THREADS    \
        stmt;                     \
        Py_END_ALLOW_THREADS      \
    } while (0)
int kp_check_open(ClientObject *self);
/* handles (an int or an iterable of ints) -> PyMem array; *n its length. */
uint64_t *kp_handle_list(PyObject *h, uint32_t *n);
/* The completion of a non-blocking prefill (r->callback gets the outcome). */
void kp_prefill_done(kdac_client *c, void *data, const kdac_result *res, int status);
/* Calls cb(result, exc, timings) as a completion callback of self; takes the references to
 * result and exc. */
void kp_complete(ClientObject *self, PyObject *cb, PyObject *result, PyObject *exc);
/* Records a completed call's timings (last_timings). */
void kp_set_timings(ClientObject *self, uint64_t queue, uint64_t run, uint64_t device,
                    uint64_t kernel);

/* step.c */
PyObject *kp_client_step(PyObject *o, PyObject *args, PyObject *kw);
PyObject *kp_client_submit_step(PyObject *o, PyObject *args, PyObject *kw);

/* ordered.c */
PyObject *kp_client_submit_ordered(PyObject *o, PyObject *args, PyObject *kw);
PyObject *kp_client_set_ready(PyObject *o, PyObject *args);
PyObject *kp_client_done_word(PyObject *o, PyObject *args);
PyObject *kp_client_wait(PyObject *o, PyObject *args);
/* Gives a completed request's words back (or retires them when its done word failed). */
void kp_words_put(ClientObject *self, int32_t pair);
/* Unmaps and closes the words (after the connection is closed). */
void kp_words_close(ClientObject *self);

#endif /* KDAPY_H */
