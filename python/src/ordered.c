/*
 * ordered.c - stream-ordered prefills (Client.prefill_on_stream; PROTOCOL.md,
 * Stream-ordered requests): the client's semaphore words and the submission
 * through kdac_prefill_on_stream (or kdac_prefill_send_sems when the host
 * writes the ready word).
 *
 * The words live in one shared-memory page set of the client, registered as a
 * region at the first use and mapped for the devices (cuMemHostRegister,
 * through libkdaclient, which loads the CUDA driver at run time) at the first
 * use with a stream.  Each request takes a pair, ready at 16 * i and done at
 * 16 * i + 8, with a value above every value handed out before, so a word
 * only rises and an earlier request's wait on a reused pair stays released.
 * A pair whose done word carries the failure bit would release every later
 * wait on it at once: it is retired, never handed out again.  Free pairs go
 * round first in, first out, so a pair comes back as late as possible.
 */
#include <poll.h>
#include <string.h>

#include "kdapy.h"

static words *words_get(ClientObject *self)
{
    if (self->words)
        return self->words;
    words *w = PyMem_Calloc(1, sizeof(*w));
    if (!w)
        return (words *)PyErr_NoMemory();
    kdac_error err;
    int rc = kdac_shm_create(&w->shm, (uint64_t)KP_WORD_PAIRS * 16, "kdaclient-words", &err);
    if (rc == 0)
        KP_NOGIL(rc = kdac_region_register_shm(self->c, w->shm.fd, w->shm.size, &w->region,
                                               &err));
    if (rc != 0) {
        kdac_shm_close(&w->shm);
        PyMem_Free(w);
        return (words *)kp_raise(&err);
    }
    for (uint32_t i = 0; i < KP_WORD_PAIRS; i++)
        w->ring[i] = i;
    w->nfree = KP_WORD_PAIRS;
    self->words = w;
    return w;
}

static uint64_t *word(words *w, int32_t pair, int which) /* 0 ready, 1 done */
{
    return (uint64_t *)((uint8_t *)w->shm.base + 16 * (uint64_t)pair + 8 * which);
}

static int32_t pair_take(words *w)
{
    if (!w->nfree) {
        uint32_t inflight = KP_WORD_PAIRS - w->retired;
        kdac_error e = {.code = KDAC_E_BUSY, .retryable = inflight > 0};
        snprintf(e.message, sizeof(e.message), "no semaphore words left: %u stream-ordered "
                 "prefills in flight, %u pairs retired by failed ones (reconnect to renew them)",
                 inflight, w->retired);
        kp_raise(&e);
        return -1;
    }
    int32_t p = (int32_t)w->ring[w->head];
    w->head = (w->head + 1) % KP_WORD_PAIRS;
    w->nfree--;
    return p;
}

void kp_words_put(ClientObject *self, int32_t pair)
{
    words *w = self->words;
    if (__atomic_load_n(word(w, pair, 1), __ATOMIC_ACQUIRE) & KDAC_SEM_FAILED) {
        w->retired++;
        return;
    }
    w->ring[(w->head + w->nfree) % KP_WORD_PAIRS] = (uint32_t)pair;
    w->nfree++;
}

void kp_words_close(ClientObject *self)
{
    words *w = self->words;
    if (!w)
        return;
    if (w->dev)
        kdac_shm_unmap_device(&w->shm);
    kdac_shm_close(&w->shm);
    PyMem_Free(w);
    self->words = NULL;
}

static const char WHY[] =
    "a stream-ordered prefill reads and writes regions only (a CUDA tensor, or shared_array "
    "memory): a host array would be sent or copied when the call is made, before the stream "
    "has produced it";

/* _submit_prefill_on_stream(layer, seqs, stream, callback) -> (pair, value).  stream: a
 * cudaStream_t as an int, or None for a ready word the host writes (_set_ready). */
PyObject *kp_client_submit_ordered(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"layer", "seqs", "stream", "callback", NULL};
    const char *layer;
    PyObject *seqs, *stream, *cb;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOOO", kwlist, &layer, &seqs, &stream, &cb) ||
        kp_check_open(self))
        return NULL;
    void *cu_stream = NULL;
    if (stream != Py_None) {
        cu_stream = PyLong_AsVoidPtr(stream);
        if (PyErr_Occurred())
            return NULL;
    }
    request *r = PyMem_Calloc(1, sizeof(*r));
    if (!r)
        return PyErr_NoMemory();
    words *w;
    kdac_error err;
    int rc;
    kp_lock(self);
    if (kp_request_build(self, seqs, r) != 0 || kp_request_require_regions(r, WHY) != 0 ||
        !(w = words_get(self)))
        goto fail;
    if (stream != Py_None && !w->dev) {
        KP_NOGIL(rc = kdac_shm_map_device(&w->shm, &w->dev, &err));
        if (rc != 0) {
            w->dev = 0;
            kp_raise(&err);
            goto fail;
        }
    }
    if ((r->pair = pair_take(w)) < 0)
        goto fail;
    uint64_t value = ++w->value, off = 16 * (uint64_t)r->pair;
    bool dev = stream != Py_None;
    kdac_sem ready = {w->region, off, value, word(w, r->pair, 0), dev ? w->dev + off : 0};
    kdac_sem done = {w->region, off + 8, value, word(w, r->pair, 1), dev ? w->dev + off + 8 : 0};
    r->callback = Py_NewRef(cb);
    if (dev)
        rc = kdac_prefill_on_stream(self->c, cu_stream, layer, r->seqs, r->nseqs, &ready, &done,
                                    kp_prefill_done, r, &err);
    else
        rc = kdac_prefill_send_sems(self->c, layer, r->seqs, r->nseqs, &ready, &done,
                                    kp_prefill_done, r, &err);
    if (rc != 0) {
        kp_words_put(self, r->pair);
        kp_raise(&err);
        goto fail;
    }
    Py_INCREF((PyObject *)self); /* the request holds its client until it completes */
    r->client = self;
    self->async_inflight++;
    PyObject *ret = Py_BuildValue("(iK)", (int)r->pair, (unsigned long long)value);
    kp_unlock(self);
    return ret;
fail:
    kp_unlock(self);
    kp_request_release(r);
    PyMem_Free(r);
    return NULL;
}

/* The (pair, value) arguments of _set_ready and _done_word -> the pair's ready (which 0) or
 * done (1) word as the host sees it, expecting value; -1 with the error set. */
static int pair_sem(PyObject *o, PyObject *args, int which, kdac_sem *sem)
{
    ClientObject *self = (ClientObject *)o;
    words *w = self->words;
    int pair;
    unsigned long long value;
    if (!PyArg_ParseTuple(args, "iK", &pair, &value))
        return -1;
    if (!w || pair < 0 || pair >= KP_WORD_PAIRS) {
        PyErr_SetString(PyExc_ValueError, w ? "no such semaphore pair"
                                            : "the client has no semaphore words "
                                              "(closed, or none taken yet)");
        return -1;
    }
    *sem = (kdac_sem){w->region, 16 * (uint64_t)pair + 8 * which, value, word(w, pair, which), 0};
    return 0;
}

/* _set_ready(pair, value): the host's ready store (release: the inputs before it), raising
 * the word to value unless it is there already (a late call never lowers a reused pair). */
PyObject *kp_client_set_ready(PyObject *o, PyObject *args)
{
    kdac_sem ready;
    if (pair_sem(o, args, 0, &ready) != 0)
        return NULL;
    uint64_t *p = ready.host, cur = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (cur < ready.value && !__atomic_compare_exchange_n(p, &cur, ready.value, true,
                                                             __ATOMIC_RELEASE, __ATOMIC_RELAXED))
        ;
    Py_RETURN_NONE;
}

/* _done_word(pair, value) -> 0 below value, 1 reached, -1 reached with the failure bit. */
PyObject *kp_client_done_word(PyObject *o, PyObject *args)
{
    kdac_sem done;
    if (pair_sem(o, args, 1, &done) != 0)
        return NULL;
    return PyLong_FromLong(kdac_sem_check(&done));
}

/* _wait(timeout): waits up to timeout seconds for the connection's socket, with the GIL and
 * the lock released, then completes what arrived; returns kdac_client_progress's code. */
PyObject *kp_client_wait(PyObject *o, PyObject *args)
{
    ClientObject *self = (ClientObject *)o;
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout) || kp_check_open(self))
        return NULL;
    kp_lock(self);
    int ev = kdac_client_events(self->c);
    struct pollfd p = {kdac_client_fd(self->c), 0, 0};
    if (ev & KDAC_READABLE)
        p.events |= POLLIN;
    if (ev & KDAC_WRITABLE)
        p.events |= POLLOUT;
    int ms = !(timeout > 0) ? 0 : timeout > 3600 ? 3600000 : (int)(timeout * 1000);
    kp_unlock(self); /* other threads may call meanwhile */
    if (ev)
        KP_NOGIL(poll(&p, 1, ms));
    if (kp_check_open(self))
        return NULL; /* closed meanwhile */
    kp_lock(self);
    int rc = kdac_client_progress(self->c); /* callbacks need the GIL: keep it */
    kp_unlock(self);
    return PyLong_FromLong(rc);
}
