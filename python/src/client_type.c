/*
 * client_type.c - kdaclient._Client, one connection to kdad (the base of
 * kdaclient.Client, which adds conversions and documentation in Python).
 *
 * Blocking calls run with the GIL released and the client's lock held, so
 * other threads keep running and a client is used by one thread at a time.
 * The non-blocking path (_submit_prefill, _progress, fileno, _events) is what
 * kdaclient.AsyncClient drives from an asyncio loop; its completions call a
 * Python callback with (result, exception) from inside _progress or a
 * blocking call.
 */
#include <string.h>

#include "kdapy.h"
#include <structmember.h>

static int raise_code(int code, const char *msg)
{
    kdac_error e = {.code = code, .retryable = kdac_err_retryable(code)};
    snprintf(e.message, sizeof(e.message), "%s", msg);
    kp_raise(&e);
    return -1;
}

int kp_check_open(ClientObject *self)
{
    if (!self->c)
        return raise_code(KDAC_E_INVALID_ARGUMENT, "the client is closed");
    if (self->in_callback)
        return raise_code(KDAC_E_INVALID_ARGUMENT,
                          "a completion callback cannot call its client");
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Lifetime                                                                  */
/* ------------------------------------------------------------------------ */

static int client_init(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"path", "timeout", "name", "inline_max", NULL};
    PyObject *path = Py_None, *timeout = Py_None, *name = Py_None, *inline_max = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OOOO", kwlist, &path, &timeout, &name,
                                     &inline_max))
        return -1;
    if (self->c) {
        PyErr_SetString(PyExc_RuntimeError, "the client is already open");
        return -1;
    }
    if (!self->lock && !(self->lock = PyThread_allocate_lock())) {
        PyErr_NoMemory();
        return -1;
    }
    kdac_options opts;
    kdac_options_init(&opts);
    PyObject *pathb = NULL, *nameb = NULL;
    int rc = -1;
    if (path != Py_None) {
        if (!PyUnicode_FSConverter(path, &pathb))
            return -1;
        opts.socket_path = PyBytes_AsString(pathb);
    }
    if (name != Py_None) {
        const char *n = PyUnicode_AsUTF8AndSize(name, NULL);
        if (!n)
            goto out;
        nameb = PyBytes_FromString(n);
        opts.client_name = PyBytes_AsString(nameb);
    } else {
        opts.client_name = "kdaclient-python/" "0";
    }
    if (timeout != Py_None) {
        double t = PyFloat_AsDouble(timeout);
        if (PyErr_Occurred())
            goto out;
        if (!(t > 0) || t > 2e6) {
            PyErr_Format(PyExc_ValueError, "timeout: %g s; a positive number of seconds, or None "
                         "to wait forever", t);
            goto out;
        }
        opts.timeout_ms = t * 1000 < 1 ? 1 : (int)(t * 1000);
    }
    self->inline_max = KP_DEFAULT_INLINE_MAX;
    if (inline_max != Py_None) {
        self->inline_max = PyLong_AsUnsignedLongLong(inline_max);
        if (PyErr_Occurred())
            goto out;
    }
    kdac_error err;
    kdac_client *c = NULL;
    int r;
    KP_NOGIL(r = kdac_client_open(&c, &opts, &err));
    if (r != 0) {
        kp_raise(&err);
        goto out;
    }
    self->c = c;
    const kdac_server_info *info = kdac_client_info(c);
    self->heads = info->heads;
    self->state_dtype = info->state_dtype;
    self->max_regions = info->limits.max_regions_per_client;
    rc = 0;
out:
    Py_XDECREF(pathb);
    Py_XDECREF(nameb);
    return rc;
}

/* Closes the connection (requests in flight complete with CANCELED first). */
static void client_shutdown(ClientObject *self)
{
    if (!self->c)
        return;
    kdac_client *c = self->c;
    kp_lock(self);
    /* Cached regions, staging and shared arrays die with the connection. */
    kp_cuda_forget_all(self, false);
    for (int i = 0; i < KP_STAGING_MAX; i++)
        self->stg[i].region = 0;
    self->c = NULL;
    kdac_client_close(c); /* runs pending callbacks with CANCELED (GIL held), which write
                             the failure value into stream-ordered done words */
    kp_words_close(self);
    kp_staging_close_all(self);
    kp_arenas_close_all(self);
    kp_unlock(self);
}

static void client_dealloc(PyObject *o)
{
    ClientObject *self = (ClientObject *)o;
    PyTypeObject *tp = Py_TYPE(o);
    PyObject_GC_UnTrack(o);
    if (self->weakreflist)
        PyObject_ClearWeakRefs(o);
    client_shutdown(self);
    if (self->lock)
        PyThread_free_lock(self->lock);
    freefunc f = PyType_GetSlot(tp, Py_tp_free);
    f(o);
    Py_DECREF(tp);
}

static int client_traverse(PyObject *o, visitproc visit, void *arg)
{
    ClientObject *self = (ClientObject *)o;
    for (uint32_t i = 0; i < self->narenas; i++)
        Py_VISIT(self->arenas[i].owner);
    Py_VISIT(Py_TYPE(o));
    return 0;
}

static PyObject *client_close(PyObject *o, PyObject *unused)
{
    ClientObject *self = (ClientObject *)o;
    if (self->in_callback) {
        raise_code(KDAC_E_INVALID_ARGUMENT, "a completion callback cannot close its client");
        return NULL;
    }
    client_shutdown(self);
    Py_RETURN_NONE;
}

static PyObject *client_enter(PyObject *o, PyObject *unused)
{
    return Py_NewRef(o);
}

static PyObject *client_exit(PyObject *o, PyObject *args)
{
    PyObject *r = client_close(o, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

/* ------------------------------------------------------------------------ */
/* Information                                                               */
/* ------------------------------------------------------------------------ */

static const char *dtype_name(kdac_dtype d)
{
    return d == KDAC_DTYPE_F32 ? "f32" : "bf16";
}

/* The clients.* bounds, named as the daemon's configuration keys. */
static PyObject *client_bounds_dict(const kdac_bounds *b)
{
    return Py_BuildValue(
        "{sIsIsKsKsKsKsIsKsKsKsKsIsI}", "max_connections", b->max_connections,
        "max_connections_per_uid", b->max_connections_per_uid, "max_inflight_bytes_per_uid",
        (unsigned long long)b->max_inflight_bytes_per_uid, "max_inflight_bytes_total",
        (unsigned long long)b->max_inflight_bytes_total, "output_hard_limit",
        (unsigned long long)b->output_hard_limit, "output_soft_limit",
        (unsigned long long)b->output_soft_limit, "output_soft_seconds", b->output_soft_seconds,
        "max_output_bytes_per_uid", (unsigned long long)b->max_output_bytes_per_uid,
        "max_output_bytes_total", (unsigned long long)b->max_output_bytes_total,
        "max_region_bytes_per_connection", (unsigned long long)b->max_region_bytes_per_connection,
        "max_region_bytes_per_uid", (unsigned long long)b->max_region_bytes_per_uid,
        "frame_stall_seconds", b->frame_stall_seconds, "output_stall_seconds",
        b->output_stall_seconds);
}

/* d[key] = v, consuming v; false (an exception set) on failure. */
static bool set_new(PyObject *d, const char *key, PyObject *v)
{
    bool ok = v && PyDict_SetItemString(d, key, v) == 0;
    Py_XDECREF(v);
    return ok;
}

/* hello's and stats' "memory": the daemon's memory by use, bytes. */
static PyObject *memory_dict(const kdac_memory *m)
{
    return Py_BuildValue("{sKsKsKsKsKsKsK}", "pool", (unsigned long long)m->pool, "staging",
                         (unsigned long long)m->staging, "scratch", (unsigned long long)m->scratch,
                         "kernel", (unsigned long long)m->kernel, "lanes",
                         (unsigned long long)m->lanes, "layers", (unsigned long long)m->layers,
                         "total", (unsigned long long)m->total);
}

static PyObject *client_hello(PyObject *o, PyObject *unused)
{
    ClientObject *self = (ClientObject *)o;
    if (kp_check_open(self))
        return NULL;
    const kdac_server_info *i = kdac_client_info(self->c);
    const kdac_limits *l = &i->limits;
    PyObject *gpu = i->has_gpu ? Py_BuildValue("{sssssIsssO}", "name", i->gpu_name, "uuid",
                                               i->gpu_uuid, "index", i->gpu_index, "pci_bus_id",
                                               i->gpu_pci_bus_id, "mps",
                                               i->gpu_mps ? Py_True : Py_False)
                               : Py_NewRef(Py_None);
    PyObject *tr = PyList_New(0), *feat = PyList_New(0);
    if (!gpu || !tr || !feat)
        goto fail;
    static const struct { unsigned bit; const char *name; } T[] = {
        {KDAC_TRANSPORT_INLINE, "inline"}, {KDAC_TRANSPORT_SHM, "shm"},
        {KDAC_TRANSPORT_CUDA_IPC, "cuda_ipc"}};
    for (int k = 0; k < 3; k++)
        if (i->transports & T[k].bit) {
            PyObject *s = PyUnicode_FromString(T[k].name);
            PyList_Append(tr, s);
            Py_DECREF(s);
        }
    for (uint32_t k = 0; k < i->nfeatures; k++) {
        PyObject *s = PyUnicode_FromString(i->features[k]);
        PyList_Append(feat, s);
        Py_DECREF(s);
    }
    PyObject *limits = Py_BuildValue(
        "{sKsKsIsIsIsIsIsIsKsI}", "max_frame_bytes", (unsigned long long)l->max_frame_bytes,
        "max_inline_bytes", (unsigned long long)l->max_inline_bytes, "max_batch_tokens",
        l->max_batch_tokens, "max_batch_seqs", l->max_batch_seqs, "max_seqs_per_request",
        l->max_seqs_per_request, "max_slots_per_client", l->max_slots_per_client,
        "max_regions_per_client", l->max_regions_per_client, "max_inflight_requests",
        l->max_inflight_requests, "max_inflight_bytes", (unsigned long long)l->max_inflight_bytes,
        "max_layers", l->max_layers);
    if (!limits)
        goto fail;
    /* per-uid and daemon-wide bounds: only those the daemon sent */
    if ((i->bounds.max_layers_per_uid &&
         !set_new(limits, "max_layers_per_uid", PyLong_FromUnsignedLong(i->bounds.max_layers_per_uid))) ||
        (i->bounds.max_slots_per_uid &&
         !set_new(limits, "max_slots_per_uid", PyLong_FromUnsignedLong(i->bounds.max_slots_per_uid))) ||
        (i->has_bounds && !set_new(limits, "clients", client_bounds_dict(&i->bounds)))) {
        Py_DECREF(limits);
        goto fail;
    }
    PyObject *d = Py_BuildValue(
        "{sIsssKsssNsIsisIsssNsOsNsN}", "version", i->version, "server", i->server, "instance",
        (unsigned long long)i->instance, "backend", i->backend, "gpu", gpu, "heads", i->heads,
        "head_dim", KDAC_HEAD_DIM, "slots", i->slots, "state_dtype", dtype_name(i->state_dtype),
        "transports", tr, "slots_persist", i->slots_persist ? Py_True : Py_False, "features",
        feat, "limits", limits);
    if (d && i->has_memory && !set_new(d, "memory", memory_dict(&i->memory)))
        Py_CLEAR(d);
    return d;
fail:
    Py_XDECREF(gpu);
    Py_XDECREF(tr);
    Py_XDECREF(feat);
    return NULL;
}

static PyObject *counters(const kdac_counter *c, uint32_t n)
{
    PyObject *d = PyDict_New();
    for (uint32_t i = 0; d && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(c[i].value);
        PyDict_SetItemString(d, c[i].name, v);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject *held_dict(const kdac_held *h)
{
    return Py_BuildValue("{sKsKsKsK}", "inflight_bytes", (unsigned long long)h->inflight_bytes,
                         "partial_bytes", (unsigned long long)h->partial_bytes, "output_bytes",
                         (unsigned long long)h->output_bytes, "region_bytes",
                         (unsigned long long)h->region_bytes);
}

/* stats' "uid" and "clients", when the daemon reports them. */
static bool add_usage(PyObject *d, const kdac_usage_info *u)
{
    if (u->has_uid) {
        PyObject *uid = Py_BuildValue("{sIsIsI}", "uid", u->uid, "layers", u->layers, "slots",
                                      u->slots);
        if (uid && u->has_uid_held &&
            (!set_new(uid, "connections", PyLong_FromUnsignedLong(u->connections)) ||
             !set_new(uid, "held", held_dict(&u->held))))
            Py_CLEAR(uid);
        if (!set_new(d, "uid", uid))
            return false;
    }
    if (u->has_clients) {
        PyObject *cl = Py_BuildValue("{sNsNsKsKsN}", "held", held_dict(&u->total), "peak",
                                     held_dict(&u->peak), "stalled",
                                     (unsigned long long)u->stalled, "refused",
                                     (unsigned long long)u->refused, "bounds",
                                     client_bounds_dict(&u->bounds));
        if (!set_new(d, "clients", cl))
            return false;
    }
    return !u->has_memory || set_new(d, "memory", memory_dict(&u->memory));
}

static PyObject *client_stats(PyObject *o, PyObject *unused)
{
    ClientObject *self = (ClientObject *)o;
    if (kp_check_open(self))
        return NULL;
    kdac_stats_info *s = PyMem_Malloc(sizeof(*s));
    if (!s)
        return PyErr_NoMemory();
    kdac_usage_info u;
    kdac_error err;
    int rc;
    kp_lock(self);
    KP_NOGIL(rc = kdac_stats_usage(self->c, s, &u, sizeof(u), &err));
    kp_unlock(self);
    if (rc != 0) {
        PyMem_Free(s);
        return kp_raise(&err);
    }
    static const char *const TR[3] = {"inline", "shm", "cuda_ipc"};
    PyObject *tb = PyDict_New(), *phases = PyDict_New();
    for (int k = 0; k < 3; k++) {
        PyObject *v = Py_BuildValue("{sKsK}", "in", (unsigned long long)s->bytes_in[k], "out",
                                    (unsigned long long)s->bytes_out[k]);
        PyDict_SetItemString(tb, TR[k], v);
        Py_XDECREF(v);
    }
    for (uint32_t k = 0; k < s->nphases; k++) {
        const kdac_phase *p = &s->phases[k];
        PyObject *v = Py_BuildValue("{sKsKsKsK}", "p50", (unsigned long long)p->p50_us, "p90",
                                    (unsigned long long)p->p90_us, "p99",
                                    (unsigned long long)p->p99_us, "sum",
                                    (unsigned long long)p->sum_us);
        PyDict_SetItemString(phases, p->name, v);
        Py_XDECREF(v);
    }
    PyObject *d = Py_BuildValue(
        "{sKsIsKsKsKsKsKsKsKs{sKsKsKsKsK}s{sIsIsI}sIsIsIsKsNsNsNs{sKsIsN}}", "uptime_us",
        (unsigned long long)s->uptime_us, "connections", s->connections, "connections_total",
        (unsigned long long)s->connections_total, "requests", (unsigned long long)s->requests,
        "batches", (unsigned long long)s->batches, "batches_held",
        (unsigned long long)s->batches_held, "batches_gathered",
        (unsigned long long)s->batches_gathered, "seqs", (unsigned long long)s->seqs, "tokens",
        (unsigned long long)s->tokens, "latency_us", "count",
        (unsigned long long)s->latency_count, "p50", (unsigned long long)s->latency_p50_us, "p90",
        (unsigned long long)s->latency_p90_us, "p99", (unsigned long long)s->latency_p99_us, "max",
        (unsigned long long)s->latency_max_us, "pool", "slots", s->slots_total, "used",
        s->slots_used, "lost", s->slots_lost, "layers", s->layers, "regions", s->regions, "rings",
        s->rings, "ring_doorbells", (unsigned long long)s->ring_doorbells, "errors",
        counters(s->errors, s->nerrors), "disconnects", counters(s->disconnects, s->ndisconnects),
        "transport_bytes", tb, "batch_us", "count", (unsigned long long)s->batch_count, "window",
        s->batch_window, "phases", phases);
    PyMem_Free(s);
    if (d && !add_usage(d, &u))
        Py_CLEAR(d);
    return d;
}

static PyObject *client_health(PyObject *o, PyObject *unused)
{
    ClientObject *self = (ClientObject *)o;
    if (kp_check_open(self))
        return NULL;
    kdac_health_info h;
    kdac_error err;
    int rc;
    kp_lock(self);
    KP_NOGIL(rc = kdac_health(self->c, &h, &err));
    kp_unlock(self);
    if (rc != 0)
        return kp_raise(&err);
    return Py_BuildValue("{sssKsIsI}", "status", h.draining ? "draining" : "ok", "uptime_us",
                         (unsigned long long)h.uptime_us, "queued", h.queued, "running",
                         h.running);
}

/* ------------------------------------------------------------------------ */
/* Layers                                                                    */
/* ------------------------------------------------------------------------ */

static PyObject *client_register_layer(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"name", "A_log", "dt_bias", "lower_bound", "scale", NULL};
    const char *name;
    PyObject *alog, *dtb, *scale = Py_None;
    double lb;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOOd|O", kwlist, &name, &alog, &dtb, &lb, &scale))
        return NULL;
    if (kp_check_open(self))
        return NULL;
    double sc = KDAC_DEFAULT_SCALE;
    if (scale != Py_None && (sc = PyFloat_AsDouble(scale), PyErr_Occurred()))
        return NULL;
    tensor_arg a = {0}, d = {0};
    PyObject *ret = NULL;
    kp_lock(self);
    if (kp_tensor_resolve(self, alog, "A_log", KP_ELEM_F32, false, &a) != 0 ||
        kp_tensor_resolve(self, dtb, "dt_bias", KP_ELEM_F32, false, &d) != 0)
        goto out;
    if (a.cuda || d.cuda) {
        PyErr_SetString(PyExc_TypeError, "A_log, dt_bias: host arrays (float32) expected");
        goto out;
    }
    if (a.nbytes != 4ull * self->heads || d.nbytes != 512ull * self->heads) {
        PyErr_Format(PyExc_ValueError, "A_log: %llu bytes, dt_bias: %llu bytes; the daemon's "
                     "H = %u wants float32 [%u] and [%u, 128]", (unsigned long long)a.nbytes,
                     (unsigned long long)d.nbytes, self->heads, self->heads, self->heads);
        goto out;
    }
    kdac_layer L = {name, a.ptr, d.ptr, (float)lb, (float)sc};
    bool created = false;
    kdac_error err;
    int rc;
    KP_NOGIL(rc = kdac_layer_register(self->c, &L, &created, &err));
    ret = rc == 0 ? PyBool_FromLong(created) : kp_raise(&err);
out:
    kp_unlock(self);
    kp_tensor_release(&a);
    kp_tensor_release(&d);
    return ret;
}

static PyObject *client_drop_layer(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"name", NULL};
    const char *name;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s", kwlist, &name) || kp_check_open(self))
        return NULL;
    kdac_error err;
    int rc;
    kp_lock(self);
    KP_NOGIL(rc = kdac_layer_drop(self->c, name, &err));
    kp_unlock(self);
    if (rc != 0)
        return kp_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *client_layers(PyObject *o, PyObject *unused)
{
    ClientObject *self = (ClientObject *)o;
    if (kp_check_open(self))
        return NULL;
    uint32_t cap = 64, n = 0;
    kdac_layer_info *L = NULL;
    kdac_error err;
    int rc;
    for (;;) {
        kdac_layer_info *nl = PyMem_Realloc(L, cap * sizeof(*L));
        if (!nl) {
            PyMem_Free(L);
            return PyErr_NoMemory();
        }
        L = nl;
        kp_lock(self);
        KP_NOGIL(rc = kdac_layer_list(self->c, L, cap, &n, &err));
        kp_unlock(self);
        if (rc != 0 || n <= cap)
            break;
        cap = n;
    }
    PyObject *list = rc == 0 ? PyList_New(0) : kp_raise(&err);
    for (uint32_t i = 0; list && i < n; i++) {
        PyObject *d = Py_BuildValue("{sssdsdss}", "name", L[i].name, "lower_bound",
                                    (double)L[i].lower_bound, "scale", (double)L[i].scale,
                                    "source", L[i].from_config ? "config" : "client");
        PyList_Append(list, d);
        Py_XDECREF(d);
    }
    PyMem_Free(L);
    return list;
}

/* ------------------------------------------------------------------------ */
/* Slots                                                                     */
/* ------------------------------------------------------------------------ */

static PyObject *client_alloc_slots(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"n", "zero", NULL};
    unsigned long n = 1;
    int zero = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|kp", kwlist, &n, &zero) || kp_check_open(self))
        return NULL;
    if (n < 1 || n > 16384) {
        PyErr_Format(PyExc_ValueError, "n: %lu slots; 1 to max_slots_per_client", n);
        return NULL;
    }
    uint64_t *slots = PyMem_Malloc(n * sizeof(*slots));
    if (!slots)
        return PyErr_NoMemory();
    kdac_error err;
    int rc;
    kp_lock(self);
    KP_NOGIL(rc = kdac_slot_alloc(self->c, (uint32_t)n, zero ? 0 : KDAC_SLOT_ALLOC_EMPTY, slots,
                                  &err));
    kp_unlock(self);
    PyObject *list = rc == 0 ? PyList_New((Py_ssize_t)n) : kp_raise(&err);
    for (unsigned long i = 0; list && i < n; i++)
        PyList_SetItem(list, (Py_ssize_t)i, PyLong_FromUnsignedLongLong(slots[i]));
    PyMem_Free(slots);
    return list;
}

uint64_t *kp_handle_list(PyObject *h, uint32_t *n)
{
    if (PyLong_Check(h)) {
        uint64_t *a = PyMem_Malloc(sizeof(*a));
        if (!a)
            return (uint64_t *)PyErr_NoMemory();
        a[0] = PyLong_AsUnsignedLongLong(h);
        *n = 1;
        if (PyErr_Occurred()) {
            PyMem_Free(a);
            return NULL;
        }
        return a;
    }
    PyObject *seq = PySequence_List(h);
    if (!seq)
        return NULL;
    Py_ssize_t len = PyList_Size(seq);
    if (len < 1 || len > 16384) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "handles: %zd of them; 1 to max_slots_per_client", len);
        return NULL;
    }
    uint64_t *a = PyMem_Malloc((size_t)len * sizeof(*a));
    for (Py_ssize_t i = 0; a && i < len; i++)
        a[i] = PyLong_AsUnsignedLongLong(PyList_GetItem(seq, i));
    Py_DECREF(seq);
    if (!a)
        return (uint64_t *)PyErr_NoMemory();
    if (PyErr_Occurred()) {
        PyMem_Free(a);
        return NULL;
    }
    *n = (uint32_t)len;
    return a;
}

typedef int (*slot_list_fn)(kdac_client *, const uint64_t *, uint32_t, kdac_error *);

static PyObject *slot_list_call(ClientObject *self, PyObject *args, PyObject *kw,
                                slot_list_fn fn)
{
    static char *kwlist[] = {"handles", NULL};
    PyObject *h;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O", kwlist, &h) || kp_check_open(self))
        return NULL;
    uint32_t n;
    uint64_t *a = kp_handle_list(h, &n);
    if (!a)
        return NULL;
    kdac_error err;
    int rc;
    kp_lock(self);
    KP_NOGIL(rc = fn(self->c, a, n, &err));
    kp_unlock(self);
    PyMem_Free(a);
    if (rc != 0)
        return kp_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *client_free_slots(PyObject *o, PyObject *args, PyObject *kw)
{
    return slot_list_call((ClientObject *)o, args, kw, kdac_slot_free);
}

static PyObject *client_reset_slots(PyObject *o, PyObject *args, PyObject *kw)
{
    return slot_list_call((ClientObject *)o, args, kw, kdac_slot_reset);
}

static PyObject *client_fork_slot(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"src", "dst", NULL};
    unsigned long long src, dst = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K|K", kwlist, &src, &dst) || kp_check_open(self))
        return NULL;
    uint64_t slot = 0, pos = 0;
    kdac_error err;
    int rc;
    kp_lock(self);
    KP_NOGIL(rc = kdac_slot_fork(self->c, src, dst, &slot, &pos, &err));
    kp_unlock(self);
    if (rc != 0)
        return kp_raise(&err);
    return Py_BuildValue("(KK)", (unsigned long long)slot, (unsigned long long)pos);
}

static PyObject *client_slot_info(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"handles", NULL};
    PyObject *h = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwlist, &h) || kp_check_open(self))
        return NULL;
    uint32_t n = 0;
    uint64_t *a = NULL;
    if (h != Py_None && !(a = kp_handle_list(h, &n)))
        return NULL;
    kdac_slot_info_result res;
    kdac_error err;
    int rc;
    kp_lock(self);
    KP_NOGIL(rc = kdac_slot_info(self->c, a, n, &res, &err));
    PyObject *list = rc == 0 ? PyList_New(0) : kp_raise(&err);
    static const char *const ST[3] = {"ready", "empty", "lost"};
    for (uint32_t i = 0; list && i < res.nslots; i++) {
        const kdac_slot_entry *e = &res.slots[i];
        PyObject *d = Py_BuildValue("{sKsKsssI}", "slot", (unsigned long long)e->slot, "pos",
                                    (unsigned long long)e->pos, "status",
                                    e->status <= 2 ? ST[e->status] : "?", "queued", e->queued);
        PyList_Append(list, d);
        Py_XDECREF(d);
    }
    kp_unlock(self); /* res points into the client until its next call */
    PyMem_Free(a);
    return list;
}

static int parse_dtype(PyObject *d, kdac_dtype *out)
{
    PyObject *s = PyObject_Str(d);
    if (!s)
        return -1;
    const char *n = PyUnicode_AsUTF8AndSize(s, NULL);
    int rc = 0;
    if (n && (!strcmp(n, "f32") || !strcmp(n, "float32")))
        *out = KDAC_DTYPE_F32;
    else if (n && (!strcmp(n, "bf16") || !strcmp(n, "bfloat16") || !strcmp(n, "uint16")))
        *out = KDAC_DTYPE_BF16;
    else {
        PyErr_Format(PyExc_ValueError, "dtype: %R; 'f32' or 'bf16'", d);
        rc = -1;
    }
    Py_DECREF(s);
    return rc;
}

static PyObject *client_read_slot(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"handle", "dtype", "out", "with_pos", NULL};
    unsigned long long h;
    PyObject *dt = Py_None, *outo = Py_None;
    int with_pos = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K|OO$p", kwlist, &h, &dt, &outo, &with_pos) ||
        kp_check_open(self))
        return NULL;
    kdac_dtype dtype = self->state_dtype;
    if (dt != Py_None && parse_dtype(dt, &dtype) != 0)
        return NULL;
    staging *stg = NULL;
    tensor_arg t = {0};
    PyObject *arr = NULL, *ret = NULL;
    kp_lock(self);
    if (outo == Py_None) {
        Py_ssize_t shape[3] = {(Py_ssize_t)self->heads, KDAC_HEAD_DIM, KDAC_HEAD_DIM};
        arr = kp_new_array(shape, 3, dtype == KDAC_DTYPE_F32 ? "float32" : "uint16", &t.view);
        if (!arr)
            goto out;
        t.have_view = true;
        t.host = true;
        t.ptr = t.view.buf;
        t.nbytes = kdac_state_bytes(self->heads, dtype);
    } else {
        self->use_clock++;
        if (kp_tensor_resolve(self, outo, "out", KP_ELEM_STATE, true, &t) != 0)
            goto out;
        arr = Py_NewRef(outo);
        if (dt == Py_None && (t.elem == 2 || t.elem == 4)) /* the dtype of out */
            dtype = t.elem == 4 ? KDAC_DTYPE_F32 : KDAC_DTYPE_BF16;
    }
    uint64_t bytes = kdac_state_bytes(self->heads, dtype);
    if (t.nbytes != bytes) {
        PyErr_Format(PyExc_ValueError, "out: %llu bytes; [%u, 128, 128] %s is %llu",
                     (unsigned long long)t.nbytes, self->heads, dtype_name(dtype),
                     (unsigned long long)bytes);
        goto out;
    }
    kdac_output dst = t.host ? kdac_output_inline(t.ptr) : kdac_output_region(t.region, t.offset);
    if (t.host && (bytes > self->inline_max ||
                   bytes > kdac_client_info(self->c)->limits.max_inline_bytes)) {
        if (!(stg = kp_staging_get(self, bytes)))
            goto out;
        dst = kdac_output_region(stg->region, 0);
    }
    if (t.cuda && kp_cuda_sync() != 0)
        goto out;
    uint64_t pos = 0;
    kdac_error err;
    int rc;
    KP_NOGIL(rc = kdac_slot_read(self->c, h, dtype, dst, &pos, &err));
    if (rc != 0) {
        kp_raise(&err);
        goto out;
    }
    if (stg)
        memcpy(t.ptr, stg->shm.base, bytes);
    ret = with_pos ? Py_BuildValue("(OK)", arr, (unsigned long long)pos) : Py_NewRef(arr);
out:
    if (stg)
        stg->busy = false;
    kp_unlock(self);
    kp_tensor_release(&t);
    Py_XDECREF(arr);
    return ret;
}

static PyObject *client_write_slot(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"handle", "state", "pos", "dtype", NULL};
    unsigned long long h, pos = 0;
    PyObject *st, *dt = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KO|KO", kwlist, &h, &st, &pos, &dt) ||
        kp_check_open(self))
        return NULL;
    kdac_dtype dtype;
    if (dt != Py_None && parse_dtype(dt, &dtype) != 0)
        return NULL;
    staging *stg = NULL;
    tensor_arg t = {0};
    PyObject *ret = NULL;
    kp_lock(self);
    self->use_clock++;
    if (kp_tensor_resolve(self, st, "state", KP_ELEM_STATE, false, &t) != 0)
        goto out;
    if (dt == Py_None) {
        if (t.elem != 2 && t.elem != 4) {
            PyErr_SetString(PyExc_ValueError, "dtype: needed for raw bytes ('f32' or 'bf16')");
            goto out;
        }
        dtype = t.elem == 4 ? KDAC_DTYPE_F32 : KDAC_DTYPE_BF16;
    }
    uint64_t bytes = kdac_state_bytes(self->heads, dtype);
    if (t.nbytes != bytes) {
        PyErr_Format(PyExc_ValueError, "state: %llu bytes; [%u, 128, 128] %s is %llu",
                     (unsigned long long)t.nbytes, self->heads, dtype_name(dtype),
                     (unsigned long long)bytes);
        goto out;
    }
    kdac_tensor src = t.host ? kdac_tensor_inline(t.ptr) : kdac_tensor_region(t.region, t.offset);
    if (t.host && (bytes > self->inline_max ||
                   bytes > kdac_client_info(self->c)->limits.max_inline_bytes)) {
        if (!(stg = kp_staging_get(self, bytes)))
            goto out;
        memcpy(stg->shm.base, t.ptr, bytes);
        src = kdac_tensor_region(stg->region, 0);
    }
    if (t.cuda && kp_cuda_sync() != 0)
        goto out;
    kdac_error err;
    int rc;
    KP_NOGIL(rc = kdac_slot_write(self->c, h, pos, dtype, src, &err));
    if (rc != 0) {
        kp_raise(&err);
        goto out;
    }
    ret = Py_NewRef(Py_None);
out:
    if (stg)
        stg->busy = false;
    kp_unlock(self);
    kp_tensor_release(&t);
    return ret;
}

/* ------------------------------------------------------------------------ */
/* Prefill                                                                   */
/* ------------------------------------------------------------------------ */

void kp_set_timings(ClientObject *self, uint64_t queue, uint64_t run, uint64_t device,
                    uint64_t kernel)
{
    self->last_us[0] = queue;
    self->last_us[1] = run;
    self->last_us[2] = device;
    self->last_us[3] = kernel;
}

static PyObject *client_prefill(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"layer", "seqs", "sync", NULL};
    const char *layer;
    PyObject *seqs;
    int sync = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO|$p", kwlist, &layer, &seqs, &sync) ||
        kp_check_open(self))
        return NULL;
    request r;
    PyObject *ret = NULL;
    kp_lock(self);
    if (kp_request_build(self, seqs, &r) != 0 || (r.any_cuda && sync && kp_cuda_sync() != 0)) {
        kp_unlock(self);
        goto out;
    }
    kdac_prefill_result res;
    kdac_error err;
    int rc;
    KP_NOGIL(rc = kdac_prefill(self->c, layer, r.seqs, r.nseqs, &res, &err));
    if (rc == 0) {
        kp_request_unstage(&r);
        ret = kp_prefill_result(&r, res.pos); /* res.pos lives until the next call */
        kp_set_timings(self, res.queue_us, res.run_us, res.device_us, res.kernel_us);
    }
    kp_unlock(self);
    if (rc != 0)
        kp_raise(&err);
out:
    kp_request_release(&r);
    return ret;
}

void kp_complete(ClientObject *self, PyObject *cb, PyObject *result, PyObject *exc)
{
    PyObject *timings = result ? kp_timings(self->last_us) : NULL;
    if (result && !timings) {
        Py_CLEAR(result);
        exc = kp_fetch_exception();
    }
    self->in_callback++;
    PyObject *ret = PyObject_CallFunctionObjArgs(cb, result ? result : Py_None,
                                                 exc ? exc : Py_None,
                                                 timings ? timings : Py_None, NULL);
    self->in_callback--;
    if (!ret)
        PyErr_WriteUnraisable(cb);
    Py_XDECREF(ret);
    Py_XDECREF(result);
    Py_XDECREF(exc);
    Py_XDECREF(timings);
}

/* A completion of _submit_prefill (and of stream-ordered prefills):
 * callback(result, None, timings) or callback(None, exc, None). */
void kp_prefill_done(kdac_client *c, void *data, const kdac_result *res, int status)
{
    request *r = data;
    PyGILState_STATE g = PyGILState_Ensure();
    ClientObject *self = r->client;
    PyObject *result = NULL, *exc = NULL;
    if (r->pair >= 0)
        kp_words_put(self, r->pair); /* the library wrote a failure value before this */
    if (status == 0) {
        const kdac_prefill_result *p = &res->u.prefill;
        kp_request_unstage(r);
        result = kp_prefill_result(r, p->pos);
        kp_set_timings(self, p->queue_us, p->run_us, p->device_us, p->kernel_us);
    } else {
        exc = kp_make_exception(&res->error);
    }
    if (!result && !exc) /* building the result failed: hand that error over */
        exc = kp_fetch_exception();
    kp_complete(self, r->callback, result, exc);
    self->async_inflight--;
    kp_request_release(r);
    PyMem_Free(r);
    Py_DECREF((PyObject *)self);
    PyGILState_Release(g);
}

static PyObject *client_submit_prefill(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"layer", "seqs", "callback", "sync", NULL};
    const char *layer;
    PyObject *seqs, *cb;
    int sync = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO|$p", kwlist, &layer, &seqs, &cb, &sync) ||
        kp_check_open(self))
        return NULL;
    request *r = PyMem_Calloc(1, sizeof(*r));
    if (!r)
        return PyErr_NoMemory();
    kp_lock(self);
    if (kp_request_build(self, seqs, r) != 0 || (r->any_cuda && sync && kp_cuda_sync() != 0))
        goto fail;
    r->callback = Py_NewRef(cb);
    kdac_error err;
    if (kdac_prefill_send(self->c, layer, r->seqs, r->nseqs, kp_prefill_done, r, &err) != 0) {
        kp_raise(&err);
        goto fail;
    }
    Py_INCREF((PyObject *)self); /* the request holds its client until it completes */
    r->client = self;
    self->async_inflight++;
    kp_unlock(self);
    Py_RETURN_NONE;
fail:
    kp_unlock(self);
    kp_request_release(r);
    PyMem_Free(r);
    return NULL;
}

static PyObject *client_progress(PyObject *o, PyObject *unused)
{
    ClientObject *self = (ClientObject *)o;
    if (kp_check_open(self))
        return NULL;
    kp_lock(self);
    int rc = kdac_client_progress(self->c); /* callbacks need the GIL: keep it */
    int ev = kdac_client_events(self->c);
    kp_unlock(self);
    return Py_BuildValue("(ii)", rc, ev);
}

static PyObject *client_events(PyObject *o, PyObject *unused)
{
    ClientObject *self = (ClientObject *)o;
    if (kp_check_open(self))
        return NULL;
    return PyLong_FromLong(kdac_client_events(self->c));
}

static PyObject *client_fileno(PyObject *o, PyObject *unused)
{
    ClientObject *self = (ClientObject *)o;
    if (kp_check_open(self))
        return NULL;
    return PyLong_FromLong(kdac_client_fd(self->c));
}

/* ------------------------------------------------------------------------ */
/* Regions                                                                   */
/* ------------------------------------------------------------------------ */

/* _add_shared(fd, base, size, owner) -> region: registers a sealed memfd whose
 * mapping `owner` holds at `base`; arrays there then travel as region references. */
static PyObject *client_add_shared(PyObject *o, PyObject *args)
{
    ClientObject *self = (ClientObject *)o;
    int fd;
    unsigned long long base, size;
    PyObject *owner;
    if (!PyArg_ParseTuple(args, "iKKO", &fd, &base, &size, &owner) || kp_check_open(self))
        return NULL;
    if (self->narenas == self->arenas_cap) {
        uint32_t cap = self->arenas_cap ? self->arenas_cap * 2 : 4;
        arena *n = PyMem_Realloc(self->arenas, cap * sizeof(*n));
        if (!n)
            return PyErr_NoMemory();
        self->arenas = n;
        self->arenas_cap = cap;
    }
    uint32_t region;
    kdac_error err;
    int rc;
    kp_lock(self);
    KP_NOGIL(rc = kdac_region_register_shm(self->c, fd, size, &region, &err));
    kp_unlock(self);
    if (rc != 0)
        return kp_raise(&err);
    self->arenas[self->narenas++] = (arena){(uintptr_t)base, size, region, Py_NewRef(owner)};
    return PyLong_FromUnsignedLong(region);
}

static PyObject *client_release_cuda_regions(PyObject *o, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)o;
    static char *kwlist[] = {"all", NULL};
    int all = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$p", kwlist, &all) || kp_check_open(self))
        return NULL;
    kp_lock(self);
    int n = kp_cuda_sweep(self, all != 0);
    kp_unlock(self);
    return PyLong_FromLong(n);
}

static PyObject *client_region_counts(PyObject *o, PyObject *unused)
{
    ClientObject *self = (ClientObject *)o;
    int stg = 0;
    for (int i = 0; i < KP_STAGING_MAX; i++)
        stg += self->stg[i].shm.base != NULL;
    return Py_BuildValue("{sIsKsKsisI}", "cuda", self->ncuda, "cuda_registered",
                         (unsigned long long)self->cuda_registered, "cuda_released",
                         (unsigned long long)self->cuda_released, "staging", stg, "shared",
                         self->narenas);
}

/* ------------------------------------------------------------------------ */
/* Properties                                                                */
/* ------------------------------------------------------------------------ */

static PyObject *get_closed(PyObject *o, void *unused)
{
    return PyBool_FromLong(((ClientObject *)o)->c == NULL);
}

static PyObject *get_heads(PyObject *o, void *unused)
{
    return PyLong_FromUnsignedLong(((ClientObject *)o)->heads);
}

static PyObject *get_path(PyObject *o, void *unused)
{
    ClientObject *self = (ClientObject *)o;
    if (kp_check_open(self))
        return NULL;
    return PyUnicode_DecodeFSDefault(kdac_client_path(self->c));
}

static PyObject *get_inflight(PyObject *o, void *unused)
{
    return PyLong_FromUnsignedLong(((ClientObject *)o)->async_inflight);
}

static PyObject *get_last_timings(PyObject *o, void *unused)
{
    return kp_timings(((ClientObject *)o)->last_us);
}

static PyGetSetDef getset[] = {
    {"closed", get_closed, NULL, "True once close() ran.", NULL},
    {"heads", get_heads, NULL, "H, the daemon's heads.", NULL},
    {"path", get_path, NULL, "The socket path this client connected to.", NULL},
    {"inflight", get_inflight, NULL, "Non-blocking requests not yet completed.", NULL},
    {"last_timings", get_last_timings, NULL,
     "The daemon's times of the last completed prefill or step, microseconds: queue_us (admission to "
     "launch), run_us (launch to completion), device_us and kernel_us (0 when not reported).",
     NULL},
    {NULL},
};

#define KW (METH_VARARGS | METH_KEYWORDS)
static PyMethodDef client_methods[] = {
    {"close", client_close, METH_NOARGS,
     "close($self)\n--\n\n"
     "Closes the connection. Requests in flight fail with Canceled; the daemon frees this "
     "connection's slots (unless slots persist) and regions. Calling it twice is harmless."},
    {"__enter__", client_enter, METH_NOARGS, NULL},
    {"__exit__", client_exit, METH_VARARGS, NULL},
    {"hello", client_hello, METH_NOARGS,
     "hello($self)\n--\n\n"
     "Returns dict. What the daemon said in the handshake: version, server, instance, backend,"
     " gpu (name, uuid, index; None on the CPU backend), heads, head_dim, slots, state_dtype "
     "('f32' or 'bf16'), transports, slots_persist, features, limits (max_inline_bytes, "
     "max_batch_tokens, max_seqs_per_request, max_slots_per_client, max_regions_per_client, "
     "..., max_layers_per_uid and max_slots_per_uid, and clients: the daemon's clients.* "
     "bounds, per uid and daemon-wide; each only when the daemon sends it)."},
    {"stats", client_stats, METH_NOARGS,
     "stats($self)\n--\n\n"
     "Returns dict. The daemon's counters since it started (all connections): requests, "
     "batches, seqs, tokens, latency_us, pool, errors, disconnects, transport_bytes "
     "({inline|shm|cuda_ipc: {in, out}}), batch_us; when the daemon reports them, uid (the "
     "caller's uid: uid, layers, slots, connections, held) and clients (held, peak, stalled, "
     "refused, bounds), held being {inflight_bytes, partial_bytes, output_bytes, "
     "region_bytes}."},
    {"health", client_health, METH_NOARGS,
     "health($self)\n--\n\n"
     "Returns dict. status ('ok' or 'draining'), uptime_us, queued, running."},
    {"_register_layer", (PyCFunction)(void (*)(void))client_register_layer, KW, NULL},
    {"drop_layer", (PyCFunction)(void (*)(void))client_drop_layer, KW,
     "drop_layer($self, name)\n--\n\n"
     "Removes a layer registered by this uid. Raises UnknownLayer, PermissionDenied."},
    {"layers", client_layers, METH_NOARGS,
     "layers($self)\n--\n\n"
     "Returns list[dict]. The daemon's layers: name, lower_bound, scale, source ('config' or "
     "'client')."},
    {"alloc_slots", (PyCFunction)(void (*)(void))client_alloc_slots, KW,
     "alloc_slots($self, n=1, zero=True)\n--\n\n"
     "Returns list[int]. Allocates n state slots (all or none): ready with a zero state at "
     "position 0, or with zero=False empty (to be written, forked into, or prefilled with "
     "fresh=True). Raises PoolFull (retryable), QuotaExceeded."},
    {"free_slots", (PyCFunction)(void (*)(void))client_free_slots, KW,
     "free_slots($self, handles)\n--\n\n"
     "Frees slots (an int or an iterable of ints; all checked before any is freed); their "
     "handles go stale. Raises UnknownSlot, StaleSlot, PermissionDenied."},
    {"reset_slots", (PyCFunction)(void (*)(void))client_reset_slots, KW,
     "reset_slots($self, handles)\n--\n\n"
     "Resets slots to a zero state at position 0 (after the requests queued on them)."},
    {"fork_slot", (PyCFunction)(void (*)(void))client_fork_slot, KW,
     "fork_slot($self, src, dst=None)\n--\n\n"
     "Returns (slot, pos). Copies src's state and position into dst, or into a new slot. "
     "Raises StateLost, PoolFull, QuotaExceeded."},
    {"slot_info", (PyCFunction)(void (*)(void))client_slot_info, KW,
     "slot_info($self, handles=None)\n--\n\n"
     "Returns list[dict]. slot, pos, status ('ready', 'empty', 'lost') and queued of the slots"
     " given, or of every slot this client owns."},
    {"read_slot", (PyCFunction)(void (*)(void))client_read_slot, KW,
     "read_slot($self, handle, dtype=None, out=None, *, with_pos=False)\n--\n\n"
     "Returns array. Snapshot of a slot's state [H, 128(v), 128(k)] (V-major) in dtype 'f32' "
     "(float32) or 'bf16' (uint16 bits); default: the pool's. Into a new NumPy array, or into "
     "out (host array or CUDA tensor, written in place). with_pos: returns (array, pos). "
     "Raises StateLost, StaleSlot, ..."},
    {"write_slot", (PyCFunction)(void (*)(void))client_write_slot, KW,
     "write_slot($self, handle, state, pos=0, dtype=None)\n--\n\n"
     "Restores a state [H, 128, 128] (float32, or bf16 as uint16; host array or CUDA tensor) "
     "and a position into a slot, which becomes ready. dtype is needed only for raw bytes."},
    {"prefill", (PyCFunction)(void (*)(void))client_prefill, KW,
     "prefill($self, layer, seqs, *, sync=True)\n--\n\n"
     "Returns list[dict]. Runs KDA prefill with the weights of layer over seqs, a list of "
     "mappings, one per sequence: slot (handle), q, k, v, g (bf16 [len, H, 128]), beta (bf16 "
     "[len, H]), and optionally out (bf16 [len, H, 128], written in place), fresh (start from "
     "a zero state), expect_pos (fail with PositionMismatch unless the slot is there). Without"
     " q a sequence has no tokens. All sequences run in one device launch, all or nothing. "
     "Returns one dict per sequence: pos (the slot's new position) and out (the given out, a "
     "new uint16 NumPy array, or None without tokens). Host arrays go inline, or through a "
     "shared-memory staging buffer above inline_max; CUDA tensors go as regions of their "
     "allocations (sync=True first waits for the current CUDA context's work). Raises "
     "UnknownLayer, StaleSlot, PositionMismatch, StateLost, LimitExceeded, InvalidParams, "
     "DeviceFailed, ..."},
    {"_submit_prefill", (PyCFunction)(void (*)(void))client_submit_prefill, KW, NULL},
    {"step", (PyCFunction)(void (*)(void))kp_client_step, KW,
     "step($self, layer, slots, q, k, v, g, beta, *, lens=None, expect_pos=None, out=None, "
     "states=None, sync=True)\n--\n\n"
     "Returns dict. Runs one decode step with the weights of layer: sequence i continues the "
     "state in slots[i] by lens[i] tokens (1..16; None: 1 each; an int: that many each), the "
     "sequences' tokens back to back in one tensor per input: q, k, v, g (bf16 [T, H, 128], T "
     "the sum of lens), beta (bf16 [T, H]); optionally out (bf16 [T, H, 128], written in "
     "place), expect_pos (one position per slot: PositionMismatch unless every slot is there) "
     "and states (the pool's dtype [T, H, 128, 128]: the state after every token, for rolling "
     "a speculative draft back with write_slot; True: a new NumPy array). One device launch, "
     "all or nothing. Returns {'pos': [each slot's new position], 'out': out or a new uint16 "
     "array, 'states': states or None}. Needs a daemon with the 'step' feature (else "
     "UnknownMethod). Raises as prefill."},
    {"_submit_step", (PyCFunction)(void (*)(void))kp_client_submit_step, KW, NULL},
    {"_submit_prefill_on_stream", (PyCFunction)(void (*)(void))kp_client_submit_ordered, KW,
     NULL},
    {"_set_ready", kp_client_set_ready, METH_VARARGS, NULL},
    {"_done_word", kp_client_done_word, METH_VARARGS, NULL},
    {"_wait", kp_client_wait, METH_VARARGS, NULL},
    {"_progress", client_progress, METH_NOARGS, NULL},
    {"_events", client_events, METH_NOARGS, NULL},
    {"fileno", client_fileno, METH_NOARGS,
     "fileno($self)\n--\n\n"
     "Returns int. The connection's socket, for an event loop (AsyncClient watches it). Never "
     "read or write it."},
    {"_add_shared", client_add_shared, METH_VARARGS, NULL},
    {"release_cuda_regions", (PyCFunction)(void (*)(void))client_release_cuda_regions, KW,
     "release_cuda_regions($self, *, all=False)\n--\n\n"
     "Returns int. Gives back the CUDA registrations whose allocation is gone (all=True: every"
     " one, e.g. after torch.cuda.empty_cache()); returns how many. The client also does this "
     "by itself when it meets new allocations."},
    {"_region_counts", client_region_counts, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef client_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(ClientObject, weakreflist), READONLY},
    {NULL},
};

static PyType_Slot client_slots[] = {
    {Py_tp_doc, "A connection to kdad (the C part of kdaclient.Client)."},
    {Py_tp_init, client_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, client_dealloc},
    {Py_tp_traverse, client_traverse},
    {Py_tp_methods, client_methods},
    {Py_tp_getset, getset},
    {Py_tp_members, client_members},
    {0, NULL},
};

PyType_Spec kp_client_spec = {
    .name = "kdaclient._kdaclient._Client",
    .basicsize = sizeof(ClientObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = client_slots,
};
