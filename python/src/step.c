/*
 * step.c - decode steps (Client.step, AsyncClient.step): kdac_step over one
 * list of slots, per-sequence token counts, and one packed tensor per input
 * ([T, H, 128], T the sum of the counts), optionally keeping the state after
 * every token (speculative decoding rolls back with write_slot).
 *
 * Arrays resolve as the prefill's do (tensors.c).  Host arrays go inline, or
 * through a staging buffer when they exceed the inline limit or when states
 * are kept in host memory outside a shared array (the protocol writes states
 * into a region only).
 */
#include <string.h>

#include "kdapy.h"

enum { ST_Q, ST_K, ST_V, ST_G, ST_BETA, ST_OUT, ST_STATES, ST_N };
static const char *const NAME[ST_N] = {"q", "k", "v", "g", "beta", "out", "states"};

typedef struct step_call {
    ClientObject *client;      /* strong reference while in flight (async) */
    kdac_step_request req;
    uint64_t *slots, *expect;
    uint8_t *lens;
    tensor_arg a[ST_N];
    PyObject *out, *states;    /* what the result hands back (the caller's, or new arrays) */
    staging *stg;
    copyback cbs[2];           /* out and states, when staged */
    uint32_t ncbs;
    bool any_cuda;
    PyObject *callback;
} step_call;

static void step_release(step_call *s)
{
    if (s->stg) { /* failed before completion: give the buffer back unread */
        s->stg->busy = false;
        s->stg = NULL;
    }
    for (int i = 0; i < ST_N; i++)
        kp_tensor_release(&s->a[i]);
    Py_CLEAR(s->out);
    Py_CLEAR(s->states);
    Py_CLEAR(s->callback);
    PyMem_Free(s->slots);
    PyMem_Free(s->expect);
    PyMem_Free(s->lens);
    s->slots = s->expect = NULL;
    s->lens = NULL;
}

/* An integer (int, numpy.int64, ... : anything with __index__) as a u64. */
static uint64_t as_u64(PyObject *o)
{
    PyObject *i = PyNumber_Index(o);
    if (!i)
        return 0;
    uint64_t v = PyLong_AsUnsignedLongLong(i);
    Py_DECREF(i);
    return v;
}

/* A list of n unsigned integers (u64) from a sequence; field names it in errors. */
static int u64_list(PyObject *o, uint32_t n, const char *field, uint64_t **out)
{
    Py_ssize_t len = PyUnicode_Check(o) ? -1 : PySequence_Size(o);
    if (len < 0) {
        PyErr_Format(PyExc_TypeError, "%s: a list of %u integers expected", field, n);
        return -1;
    }
    if (len != (Py_ssize_t)n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd entries; one per slot (%u)", field, len, n);
        return -1;
    }
    uint64_t *a = PyMem_Calloc(n, sizeof(*a));
    if (!a) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < n && !PyErr_Occurred(); i++) {
        PyObject *x = PySequence_GetItem(o, i);
        if (x) {
            a[i] = as_u64(x);
            Py_DECREF(x);
        }
    }
    if (PyErr_Occurred()) {
        PyMem_Free(a);
        return -1;
    }
    *out = a;
    return 0;
}

/* A new host array for an output the caller did not give. */
static int new_output(tensor_arg *t, PyObject **keep, const Py_ssize_t *shape, int ndim,
                      const char *dtype, uint64_t nbytes)
{
    *keep = kp_new_array(shape, ndim, dtype, &t->view);
    if (!*keep)
        return -1;
    t->have_view = true;
    t->ptr = t->view.buf;
    t->nbytes = nbytes;
    t->host = true;
    return 0;
}

/* Stages the host arrays of s through one staging buffer when needed. */
static int step_stage(ClientObject *self, step_call *s)
{
    uint64_t in = 0, out = 0, total = 0;
    for (int i = 0; i < ST_N; i++) {
        tensor_arg *t = &s->a[i];
        if (!t->host || !t->nbytes)
            continue;
        if (i >= ST_OUT)
            out += t->nbytes;
        else
            in += t->nbytes;
        total += (t->nbytes + KDAC_TENSOR_ALIGN - 1) & ~(uint64_t)(KDAC_TENSOR_ALIGN - 1);
    }
    uint64_t limit = self->inline_max;
    const kdac_server_info *info = kdac_client_info(self->c);
    if (info->limits.max_inline_bytes < limit)
        limit = info->limits.max_inline_bytes;
    bool host_states = s->a[ST_STATES].host && s->a[ST_STATES].nbytes;
    if ((!host_states && in <= limit && out <= limit) || !(info->transports & KDAC_TRANSPORT_SHM))
        return 0; /* inline (the library or the daemon refuses what cannot be) */
    if (!(s->stg = kp_staging_get(self, total)))
        return -1;
    uint8_t *base = s->stg->shm.base;
    uint64_t off = 0;
    kdac_tensor *in_ref[5] = {&s->req.q, &s->req.k, &s->req.v, &s->req.g, &s->req.beta};
    for (int i = 0; i < ST_N; i++) {
        tensor_arg *t = &s->a[i];
        if (!t->host || !t->nbytes)
            continue;
        if (i >= ST_OUT) {
            s->cbs[s->ncbs++] = (copyback){t->ptr, off, t->nbytes};
            *(i == ST_OUT ? &s->req.out : &s->req.states) = kdac_output_region(s->stg->region, off);
        } else {
            memcpy(base + off, t->ptr, t->nbytes);
            *in_ref[i] = kdac_tensor_region(s->stg->region, off);
        }
        off += (t->nbytes + KDAC_TENSOR_ALIGN - 1) & ~(uint64_t)(KDAC_TENSOR_ALIGN - 1);
    }
    return 0;
}

static void step_unstage(step_call *s)
{
    if (!s->stg)
        return;
    for (uint32_t i = 0; i < s->ncbs; i++)
        memcpy(s->cbs[i].dst, (uint8_t *)s->stg->shm.base + s->cbs[i].offset, s->cbs[i].nbytes);
    s->stg->busy = false;
    s->stg = NULL;
}

/* Parses step(layer, slots, q, k, v, g, beta, *, lens, expect_pos, out, states, sync)
 * into s (the lock held); *layer and *sync receive those arguments. */
static int step_build(ClientObject *self, PyObject *args, PyObject *kw, bool with_callback,
                      const char **layer, int *sync, step_call *s)
{
    static char *kwlist[] = {"layer", "slots", "q", "k", "v", "g", "beta", "lens",
                             "expect_pos", "out", "states", "sync", "callback", NULL};
    PyObject *slots, *in[5], *lens = Py_None, *ep = Py_None, *outo = Py_None,
             *sto = Py_None, *cb = Py_None;
    memset(s, 0, sizeof(*s));
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOOOOOO|$OOOOpO", kwlist, layer, &slots,
                                     &in[0], &in[1], &in[2], &in[3], &in[4], &lens, &ep, &outo,
                                     &sto, sync, &cb))
        return -1;
    if (with_callback == (cb == Py_None)) {
        PyErr_SetString(PyExc_TypeError, with_callback ? "callback: required"
                                                       : "callback: unexpected");
        return -1;
    }
    s->callback = with_callback ? Py_NewRef(cb) : NULL;
    self->use_clock++;
    uint32_t n;
    if (!(s->slots = kp_handle_list(slots, &n)))
        return -1;
    s->req.nseqs = n;
    s->req.slots = s->slots;
    if (!(s->lens = PyMem_Malloc(n)))
        return (PyErr_NoMemory(), -1);
    uint64_t *l = NULL;
    if (lens == Py_None || !PySequence_Check(lens)) { /* one count for all */
        uint64_t each = lens == Py_None ? 1 : as_u64(lens);
        if (PyErr_Occurred())
            return -1;
        if (!(l = PyMem_Malloc(n * sizeof(*l))))
            return (PyErr_NoMemory(), -1);
        for (uint32_t i = 0; i < n; i++)
            l[i] = each;
    } else if (u64_list(lens, n, "lens", &l) != 0) {
        return -1;
    }
    uint32_t T = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (l[i] < 1 || l[i] > KDAC_STEP_MAX_TOKENS) {
            PyErr_Format(PyExc_ValueError, "lens[%u]: %llu; a step takes 1 to %d tokens per "
                         "sequence", i, (unsigned long long)l[i], KDAC_STEP_MAX_TOKENS);
            PyMem_Free(l);
            return -1;
        }
        s->lens[i] = (uint8_t)l[i];
        T += (uint32_t)l[i];
    }
    PyMem_Free(l);
    s->req.lens = s->lens;
    if (ep != Py_None) {
        if (u64_list(ep, n, "expect_pos", &s->expect) != 0)
            return -1;
        s->req.expect_pos = s->expect;
    }

    const uint32_t H = self->heads;
    const kdac_dtype sd = self->state_dtype;
    const uint64_t want[ST_N] = {
        kdac_token_bytes(T, H), kdac_token_bytes(T, H), kdac_token_bytes(T, H),
        kdac_token_bytes(T, H), kdac_beta_bytes(T, H),  kdac_token_bytes(T, H),
        (uint64_t)T * kdac_state_bytes(H, sd)};
    PyObject *obj[ST_N] = {in[0], in[1], in[2], in[3], in[4], outo, sto};
    for (int i = 0; i < ST_N; i++) {
        tensor_arg *t = &s->a[i];
        if (i == ST_OUT && outo == Py_None) {
            Py_ssize_t shape[3] = {T, H, KDAC_HEAD_DIM};
            if (new_output(t, &s->out, shape, 3, "uint16", want[i]) != 0)
                return -1;
            continue;
        }
        if (i == ST_STATES && (sto == Py_None || sto == Py_False))
            continue;
        if (i == ST_STATES && sto == Py_True) {
            Py_ssize_t shape[4] = {T, H, KDAC_HEAD_DIM, KDAC_HEAD_DIM};
            if (new_output(t, &s->states, shape, 4,
                           sd == KDAC_DTYPE_F32 ? "float32" : "uint16", want[i]) != 0)
                return -1;
            continue;
        }
        kp_elem e = i == ST_STATES ? KP_ELEM_STATE : KP_ELEM_BF16;
        if (kp_tensor_resolve(self, obj[i], NAME[i], e, i >= ST_OUT, t) != 0)
            return -1;
        if (i == ST_STATES && t->elem != 1 && t->elem != (sd == KDAC_DTYPE_F32 ? 4 : 2)) {
            PyErr_Format(PyExc_TypeError, "states: %d-byte elements; the pool's states are %s",
                         t->elem, sd == KDAC_DTYPE_F32 ? "float32" : "bf16 (uint16 bits)");
            return -1;
        }
        if (t->nbytes != want[i]) {
            PyErr_Format(PyExc_ValueError, "%s: %llu bytes; %u tokens of [%u%s] %s are %llu",
                         NAME[i], (unsigned long long)t->nbytes, T, H,
                         i == ST_BETA ? "" : i == ST_STATES ? ", 128, 128" : ", 128",
                         i == ST_STATES ? (sd == KDAC_DTYPE_F32 ? "f32" : "bf16") : "bf16",
                         (unsigned long long)want[i]);
            return -1;
        }
        s->any_cuda |= t->cuda;
        if (i == ST_OUT)
            s->out = Py_NewRef(outo);
        else if (i == ST_STATES)
            s->states = Py_NewRef(sto);
    }
    kdac_tensor *ref[5] = {&s->req.q, &s->req.k, &s->req.v, &s->req.g, &s->req.beta};
    for (int i = 0; i < 5; i++)
        *ref[i] = s->a[i].host ? kdac_tensor_inline(s->a[i].ptr)
                               : kdac_tensor_region(s->a[i].region, s->a[i].offset);
    const tensor_arg *o = &s->a[ST_OUT], *st = &s->a[ST_STATES];
    s->req.out = o->host ? kdac_output_inline(o->ptr) : kdac_output_region(o->region, o->offset);
    s->req.states = st->host ? kdac_output_inline(st->ptr)
                             : kdac_output_region(st->region, st->offset);
    return step_stage(self, s);
}

/* {"pos": [...], "out": out, "states": states or None} */
static PyObject *step_result(step_call *s, const uint64_t *pos)
{
    PyObject *p = PyList_New(s->req.nseqs);
    if (!p)
        return NULL;
    for (uint32_t i = 0; i < s->req.nseqs; i++)
        PyList_SetItem(p, i, PyLong_FromUnsignedLongLong(pos[i]));
    PyObject *r = Py_BuildValue("{sOsOsO}", "pos", p, "out", s->out, "states",
                                s->states ? s->states : Py_None);
    Py_DECREF(p);
    return r;
}

PyObject *kp_client_step(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    if (kp_check_open(self))
        return NULL;
    step_call s;
    const char *layer;
    int sync = 1;
    PyObject *ret = NULL;
    kp_lock(self);
    if (step_build(self, args, kw, false, &layer, &sync, &s) != 0 ||
        (s.any_cuda && sync && kp_cuda_sync() != 0))
        goto out;
    kdac_step_result res;
    kdac_error err;
    int rc;
    KP_NOGIL(rc = kdac_step(self->c, layer, &s.req, &res, &err));
    if (rc != 0) {
        kp_raise(&err);
        goto out;
    }
    step_unstage(&s);
    ret = step_result(&s, res.pos); /* res.pos lives until the next call */
    kp_set_timings(self, res.queue_us, res.run_us, res.device_us, res.kernel_us);
out:
    kp_unlock(self);
    step_release(&s);
    return ret;
}

/* A completion of _submit_step: callback(result, None, timings) or callback(None, exc, None). */
static void step_done(kdac_client *c, void *data, const kdac_result *res, int status)
{
    step_call *s = data;
    PyGILState_STATE g = PyGILState_Ensure();
    ClientObject *self = s->client;
    PyObject *result = NULL, *exc = NULL;
    if (status == 0) {
        const kdac_step_result *p = &res->u.step;
        step_unstage(s);
        result = step_result(s, p->pos);
        kp_set_timings(self, p->queue_us, p->run_us, p->device_us, p->kernel_us);
    } else {
        exc = kp_make_exception(&res->error);
    }
    if (!result && !exc)
        exc = kp_fetch_exception();
    kp_complete(self, s->callback, result, exc);
    self->async_inflight--;
    step_release(s);
    PyMem_Free(s);
    Py_DECREF((PyObject *)self);
    PyGILState_Release(g);
}

PyObject *kp_client_submit_step(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    if (kp_check_open(self))
        return NULL;
    step_call *s = PyMem_Calloc(1, sizeof(*s));
    if (!s)
        return PyErr_NoMemory();
    const char *layer;
    int sync = 1;
    kdac_error err;
    kp_lock(self);
    if (step_build(self, args, kw, true, &layer, &sync, s) != 0 ||
        (s->any_cuda && sync && kp_cuda_sync() != 0))
        goto fail;
    if (kdac_step_send(self->c, layer, &s->req, step_done, s, &err) != 0) {
        kp_raise(&err);
        goto fail;
    }
    Py_INCREF((PyObject *)self); /* the request holds its client until it completes */
    s->client = self;
    self->async_inflight++;
    kp_unlock(self);
    Py_RETURN_NONE;
fail:
    kp_unlock(self);
    step_release(s);
    PyMem_Free(s);
    return NULL;
}
