/*
 * tensors.c - array arguments to kdac_tensor / kdac_output references.
 *
 * An array is taken, in this order, through the buffer protocol (NumPy,
 * bytes, memoryview), DLPack (__dlpack__: PyTorch, CuPy, JAX; host or CUDA),
 * __cuda_array_interface__, or else the Python coerce hook (np.asarray, the
 * uint16 view of an ml_dtypes.bfloat16 array, a contiguous copy of a strided
 * one).  Host memory goes inline from where it lies, as a region reference
 * when it lies in one of the client's shared arrays, or through a staging
 * buffer when the request's inline bytes would exceed the inline limit.
 * Device memory goes as a reference into its allocation's CUDA region.
 */
#include <string.h>

#include "kdapy.h"

/* DLPack (dlpack.h, ABI v0.8: the legacy "dltensor" capsule every producer accepts). */
typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;
typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

enum { DL_CPU = 1, DL_CUDA = 2, DL_CUDA_HOST = 3, DL_CUDA_MANAGED = 13 };
enum { DL_INT = 0, DL_UINT = 1, DL_FLOAT = 2, DL_BFLOAT = 4 };

#define SEQ_FIELDS 6
static const char *const FIELD[SEQ_FIELDS] = {"q", "k", "v", "g", "beta", "out"};

static uint64_t align16(uint64_t n)
{
    return (n + KDAC_TENSOR_ALIGN - 1) & ~(uint64_t)(KDAC_TENSOR_ALIGN - 1);
}

/* Element size a buffer format string stands for: 2 (bf16 bits as 16-bit
 * integers), 4 (float32), 1 (raw bytes), 0 (anything else). */
static int format_elem(const char *f)
{
    if (!f)
        return 1;
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (!f[0] || f[1])
        return 0;
    switch (*f) {
    case 'H':
    case 'h':
        return 2;
    case 'f':
        return 4;
    case 'B':
    case 'b':
    case 'c':
        return 1;
    }
    return 0;
}

static bool elem_ok(kp_elem want, int got)
{
    switch (want) {
    case KP_ELEM_BF16:
        return got == 2 || got == 1;
    case KP_ELEM_F32:
        return got == 4 || got == 1;
    case KP_ELEM_STATE:
        return got != 0;
    }
    return false;
}

static const char *elem_name(kp_elem want)
{
    return want == KP_ELEM_BF16  ? "bf16 (its bits as uint16/int16, or ml_dtypes.bfloat16)"
           : want == KP_ELEM_F32 ? "float32"
                                 : "float32 or bf16 (its bits as uint16)";
}

static int type_error(const char *field, kp_elem want, const char *got)
{
    PyErr_Format(PyExc_TypeError, "%s: %s elements; kdad takes %s here%s", field, got,
                 elem_name(want),
                 want == KP_ELEM_BF16 ? " (kdaclient.to_bf16 converts float arrays)" : "");
    return -1;
}

void kp_tensor_release(tensor_arg *t)
{
    if (t->have_view)
        PyBuffer_Release(&t->view);
    t->have_view = false;
    Py_CLEAR(t->keep);
}

bool kp_arena_find(ClientObject *self, const void *ptr, uint64_t nbytes, uint32_t *region,
                   uint64_t *offset)
{
    uintptr_t p = (uintptr_t)ptr;
    for (uint32_t i = 0; i < self->narenas; i++) {
        uintptr_t b = self->arenas[i].base;
        if (p >= b && p - b <= self->arenas[i].size && nbytes <= self->arenas[i].size - (p - b) &&
            (p - b) % KDAC_TENSOR_ALIGN == 0) {
            *region = self->arenas[i].region;
            *offset = p - b;
            return true;
        }
    }
    return false;
}

/* Host memory at ptr: a shared array's region, or inline. */
static void host_ref(ClientObject *self, tensor_arg *t)
{
    t->host = true;
    t->region = 0;
    t->offset = 0;
    if (kp_arena_find(self, t->ptr, t->nbytes, &t->region, &t->offset))
        t->host = false;
}

static int try_buffer(ClientObject *self, PyObject *obj, const char *field, kp_elem want,
                      bool writable, tensor_arg *t)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &t->view, flags) != 0)
        return 0;
    t->have_view = true;
    int e = format_elem(t->view.format);
    if (!elem_ok(want, e)) {
        static const struct { char c; const char *name; } NAMES[] = {
            {'f', "float32"}, {'d', "float64"}, {'e', "float16"}, {'i', "int32"},
            {'I', "uint32"}, {'l', "int64"}, {'q', "int64"}, {'?', "bool"}};
        const char *f = t->view.format ? t->view.format : "?";
        if (*f == '<' || *f == '=' || *f == '@')
            f++;
        for (size_t i = 0; i < sizeof(NAMES) / sizeof(NAMES[0]); i++)
            if (f[0] == NAMES[i].c && !f[1]) {
                kp_tensor_release(t);
                return type_error(field, want, NAMES[i].name);
            }
        /* A format this module does not know (ml_dtypes.bfloat16 ...): the coerce hook
         * decides. */
        kp_tensor_release(t);
        return 0;
    }
    t->ptr = t->view.buf;
    t->nbytes = (uint64_t)t->view.len;
    t->elem = e;
    host_ref(self, t);
    return 1;
}

/* Device memory at ptr: its allocation's region. */
static int cuda_ref(ClientObject *self, const char *field, uint64_t ptr, tensor_arg *t)
{
    t->cuda = true;
    t->host = false;
    t->ptr = (void *)(uintptr_t)ptr;
    if (t->nbytes == 0)
        return 1;
    return kp_cuda_region(self, ptr, t->nbytes, field, &t->region, &t->offset) == 0 ? 1 : -1;
}

static int try_dlpack(ClientObject *self, PyObject *obj, const char *field, kp_elem want,
                      tensor_arg *t)
{
    PyObject *fn = PyObject_GetAttrString(obj, "__dlpack__");
    if (!fn) {
        PyErr_Clear();
        return 0;
    }
    PyObject *cap = PyObject_CallNoArgs(fn);
    Py_DECREF(fn);
    if (!cap) {
        PyErr_Clear(); /* e.g. a dtype DLPack cannot express: the next route may */
        return 0;
    }
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (!m) {
        PyErr_Clear();
        Py_DECREF(cap);
        return 0;
    }
    /* The capsule, unconsumed, calls the deleter when it goes: keep it until
     * the request completes. */
    t->keep = cap;
    DLTensor *d = &m->dl_tensor;
    int e = (d->dtype.lanes == 1 && d->dtype.bits == 16 &&
             (d->dtype.code == DL_INT || d->dtype.code == DL_UINT || d->dtype.code == DL_BFLOAT))
                ? 2
            : (d->dtype.lanes == 1 && d->dtype.bits == 32 && d->dtype.code == DL_FLOAT) ? 4
                                                                                        : 0;
    bool device = d->device.device_type == DL_CUDA;
    if (!device && d->device.device_type != DL_CPU && d->device.device_type != DL_CUDA_HOST) {
        PyErr_Format(PyExc_TypeError, "%s: DLPack device type %d; kdad takes host or CUDA memory",
                     field, (int)d->device.device_type);
        goto fail;
    }
    if (!elem_ok(want, e)) {
        char got[64];
        snprintf(got, sizeof(got), "DLPack code %u, %u bits", d->dtype.code, d->dtype.bits);
        type_error(field, want, got);
        goto fail;
    }
    uint64_t count = 1;
    int64_t expect = 1;
    bool compact = true;
    for (int i = d->ndim - 1; i >= 0; i--) {
        if (d->strides && d->shape[i] != 1 && d->strides[i] != expect)
            compact = false;
        expect *= d->shape[i];
        count *= (uint64_t)d->shape[i];
    }
    if (!compact) {
        if (!device) { /* a strided host array: the coerce hook copies it */
            Py_CLEAR(t->keep);
            return 0;
        }
        PyErr_Format(PyExc_ValueError,
                     "%s: a strided CUDA tensor; kdad reads dense row-major memory "
                     "(call .contiguous())", field);
        goto fail;
    }
    t->nbytes = count * (uint64_t)(e);
    t->elem = e;
    uint64_t ptr = (uint64_t)(uintptr_t)d->data + d->byte_offset;
    if (device)
        return cuda_ref(self, field, ptr, t);
    t->ptr = (void *)(uintptr_t)ptr;
    host_ref(self, t);
    return 1;
fail:
    Py_CLEAR(t->keep);
    return -1;
}

static int try_cai(ClientObject *self, PyObject *obj, const char *field, kp_elem want,
                   bool writable, tensor_arg *t)
{
    PyObject *cai = PyObject_GetAttrString(obj, "__cuda_array_interface__");
    if (!cai) {
        PyErr_Clear();
        return 0;
    }
    int rc = -1;
    PyObject *data = PyMapping_GetItemString(cai, "data");
    PyObject *shape = PyMapping_GetItemString(cai, "shape");
    PyObject *typestr = PyMapping_GetItemString(cai, "typestr");
    PyObject *strides = PyMapping_GetItemString(cai, "strides");
    if (!data || !shape || !typestr) {
        PyErr_Format(PyExc_TypeError, "%s: __cuda_array_interface__ without data/shape/typestr",
                     field);
        goto out;
    }
    PyErr_Clear(); /* strides is optional */
    const char *ts = PyUnicode_AsUTF8AndSize(typestr, NULL);
    if (!ts)
        goto out;
    int e = (!strcmp(ts, "<u2") || !strcmp(ts, "<i2") || !strcmp(ts, "<V2")) ? 2
            : !strcmp(ts, "<f4")                                            ? 4
                                                                            : 0;
    if (!elem_ok(want, e)) {
        type_error(field, want, ts);
        goto out;
    }
    uint64_t ptr = PyLong_AsUnsignedLongLong(PyTuple_GetItem(data, 0));
    if (PyErr_Occurred())
        goto out;
    if (writable && PyObject_IsTrue(PyTuple_GetItem(data, 1)) == 1) {
        PyErr_Format(PyExc_ValueError, "%s: a read-only CUDA array cannot take an output", field);
        goto out;
    }
    Py_ssize_t nd = PyTuple_Size(shape);
    uint64_t count = 1;
    int64_t expect = e;
    bool compact = true;
    for (Py_ssize_t i = nd - 1; i >= 0; i--) {
        long long n = PyLong_AsLongLong(PyTuple_GetItem(shape, i));
        if (strides && strides != Py_None && n != 1 &&
            PyLong_AsLongLong(PyTuple_GetItem(strides, i)) != expect)
            compact = false;
        expect *= n;
        count *= (uint64_t)n;
    }
    if (PyErr_Occurred())
        goto out;
    if (!compact) {
        PyErr_Format(PyExc_ValueError,
                     "%s: a strided CUDA array; kdad reads dense row-major memory", field);
        goto out;
    }
    t->nbytes = count * (uint64_t)e;
    t->elem = e;
    Py_INCREF(obj);
    t->keep = obj;
    rc = cuda_ref(self, field, ptr, t);
out:
    Py_XDECREF(data);
    Py_XDECREF(shape);
    Py_XDECREF(typestr);
    Py_XDECREF(strides);
    Py_DECREF(cai);
    return rc;
}

int kp_tensor_resolve(ClientObject *self, PyObject *obj, const char *field, kp_elem want,
                      bool writable, tensor_arg *t)
{
    memset(t, 0, sizeof(*t));
    int rc = try_buffer(self, obj, field, want, writable, t);
    if (rc == 0) {
        PyErr_Clear();
        rc = try_dlpack(self, obj, field, want, t);
    }
    if (rc == 0)
        rc = try_cai(self, obj, field, want, writable, t);
    if (rc == 0 && kp_coerce_hook) {
        /* The hook returns an object with the buffer protocol, or raises. */
        PyObject *arr = PyObject_CallFunction(kp_coerce_hook, "Osi", obj, field, (int)want);
        if (!arr)
            return -1;
        rc = try_buffer(self, arr, field, want, writable, t);
        if (rc == 0 && writable) {
            PyErr_Clear();
            Py_DECREF(arr);
            PyErr_Format(PyExc_TypeError,
                         "%s: an output must be writable memory of the right type "
                         "(a C-contiguous uint16 NumPy array, or a CUDA tensor)", field);
            return -1;
        }
        if (rc == 1) {
            if (writable && arr != obj) {
                kp_tensor_release(t);
                Py_DECREF(arr);
                PyErr_Format(PyExc_TypeError,
                             "%s: an output must be writable memory of the right type "
                             "(a C-contiguous uint16 NumPy array, or a CUDA tensor)", field);
                return -1;
            }
            t->keep = arr;
        } else {
            Py_DECREF(arr);
        }
    }
    if (rc == 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s: %s is not an array (no buffer protocol, "
                         "__dlpack__ or __cuda_array_interface__)",
                         field, Py_TYPE(obj) ? "the object" : "?");
        return -1;
    }
    return rc < 0 ? -1 : 0;
}

/* ------------------------------------------------------------------------ */
/* Staging                                                                   */
/* ------------------------------------------------------------------------ */

static uint64_t round_pow2(uint64_t n)
{
    uint64_t p = 1u << 20; /* at least 1 MiB */
    while (p < n)
        p <<= 1;
    return p;
}

static void staging_drop(ClientObject *self, staging *s)
{
    if (!s->shm.base)
        return;
    if (self->c && s->region)
        KP_NOGIL(kdac_region_release(self->c, s->region, NULL));
    kdac_shm_close(&s->shm);
    memset(s, 0, sizeof(*s));
}

void kp_staging_close_all(ClientObject *self)
{
    for (int i = 0; i < KP_STAGING_MAX; i++)
        staging_drop(self, &self->stg[i]);
}

staging *kp_staging_get(ClientObject *self, uint64_t bytes)
{
    staging *fit = NULL, *empty = NULL, *idle = NULL;
    for (int i = 0; i < KP_STAGING_MAX; i++) {
        staging *s = &self->stg[i];
        if (!s->shm.base) {
            if (!empty)
                empty = s;
        } else if (!s->busy) {
            if (s->shm.size >= bytes && (!fit || s->shm.size < fit->shm.size))
                fit = s;
            else if (!idle)
                idle = s;
        }
    }
    if (fit) {
        fit->busy = true;
        return fit;
    }
    staging *s = empty ? empty : idle;
    if (!s) {
        kdac_error e = {.code = KDAC_E_BUSY, .retryable = true};
        snprintf(e.message, sizeof(e.message),
                 "every staging buffer (%d) is in use by requests in flight; wait for one, or "
                 "put the arrays in Client.shared_array memory", KP_STAGING_MAX);
        kp_raise(&e);
        return NULL;
    }
    staging_drop(self, s); /* an idle one too small: replace it */
    kdac_error err;
    int rc;
    uint64_t size = round_pow2(bytes);
    rc = kdac_shm_create(&s->shm, size, "kdaclient-staging", &err);
    if (rc == 0)
        KP_NOGIL(rc = kdac_region_register_shm(self->c, s->shm.fd, s->shm.size, &s->region, &err));
    if (rc != 0) {
        kdac_shm_close(&s->shm);
        memset(s, 0, sizeof(*s));
        kp_raise(&err);
        return NULL;
    }
    s->busy = true;
    return s;
}

void kp_arenas_close_all(ClientObject *self)
{
    for (uint32_t i = 0; i < self->narenas; i++)
        Py_DECREF(self->arenas[i].owner); /* the regions die with the connection */
    PyMem_Free(self->arenas);
    self->arenas = NULL;
    self->narenas = self->arenas_cap = 0;
}

/* ------------------------------------------------------------------------ */
/* Requests                                                                  */
/* ------------------------------------------------------------------------ */

/* mapping[key] as a new reference, NULL when absent (no error set) or on error (set). */
static PyObject *seq_get(PyObject *m, const char *key, int *found)
{
    PyObject *v;
    if (PyDict_Check(m)) {
        v = PyDict_GetItemString(m, key);
        Py_XINCREF(v);
    } else {
        v = PyMapping_GetItemString(m, key);
        if (!v && PyErr_ExceptionMatches(PyExc_KeyError))
            PyErr_Clear();
    }
    if (v == Py_None) {
        Py_DECREF(v);
        v = NULL;
    }
    if (v)
        (*found)++;
    return v;
}

static int unknown_key(PyObject *m, const char *field)
{
    static const char *const known[] = {"slot", "q", "k", "v", "g", "beta", "out",
                                        "fresh", "expect_pos", NULL};
    PyObject *keys = PyMapping_Keys(m);
    if (!keys)
        return -1;
    Py_ssize_t n = PyList_Size(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GetItem(keys, i);
        const char *s = PyUnicode_Check(k) ? PyUnicode_AsUTF8AndSize(k, NULL) : NULL;
        bool ok = false;
        for (int j = 0; s && known[j]; j++)
            ok |= !strcmp(s, known[j]);
        if (!ok) {
            PyErr_Format(PyExc_ValueError, "%s: unknown key %R (known: slot, q, k, v, g, beta, "
                         "out, fresh, expect_pos)", field, k);
            Py_DECREF(keys);
            return -1;
        }
    }
    Py_DECREF(keys);
    return 0;
}

static void set_tensor(kdac_tensor *dst, const tensor_arg *t)
{
    *dst = t->host ? kdac_tensor_inline(t->ptr) : kdac_tensor_region(t->region, t->offset);
}

static int parse_seq(ClientObject *self, PyObject *m, uint32_t i, request *r)
{
    char field[48];
    snprintf(field, sizeof(field), "seqs[%u]", i);
    if (!PyMapping_Check(m) || PyUnicode_Check(m)) {
        PyErr_Format(PyExc_TypeError, "%s: a mapping (slot, q, k, v, g, beta, ...) expected",
                     field);
        return -1;
    }
    kdac_seq *s = &r->seqs[i];
    tensor_arg *a = &r->args[i * SEQ_FIELDS];
    int found = 0;
    PyObject *o[SEQ_FIELDS] = {0}, *slot = NULL, *fresh = NULL, *ep = NULL;
    int rc = -1;
    slot = seq_get(m, "slot", &found);
    for (int f = 0; f < SEQ_FIELDS && !PyErr_Occurred(); f++)
        o[f] = seq_get(m, FIELD[f], &found);
    if (!PyErr_Occurred())
        fresh = seq_get(m, "fresh", &found);
    if (!PyErr_Occurred())
        ep = seq_get(m, "expect_pos", &found);
    if (PyErr_Occurred())
        goto out;
    if (PyMapping_Size(m) > found && unknown_key(m, field) != 0)
        goto out; /* (keys set to None are absent, and pass) */
    if (!slot) {
        PyErr_Format(PyExc_ValueError, "%s.slot: missing", field);
        goto out;
    }
    s->slot = PyLong_AsUnsignedLongLong(slot);
    if (PyErr_Occurred())
        goto out;
    if (fresh) {
        int t = PyObject_IsTrue(fresh);
        if (t < 0)
            goto out;
        if (t)
            s->flags |= KDAC_SEQ_FRESH;
    }
    if (ep) {
        s->expect_pos = PyLong_AsUnsignedLongLong(ep);
        if (PyErr_Occurred())
            goto out;
        s->flags |= KDAC_SEQ_EXPECT_POS;
    }
    uint64_t tok = kdac_token_bytes(1, self->heads);
    char fn[64];
    if (!o[0]) {
        for (int f = 1; f < SEQ_FIELDS; f++)
            if (o[f]) {
                PyErr_Format(PyExc_ValueError, "%s.%s: given without q (a sequence without q "
                             "has no tokens)", field, FIELD[f]);
                goto out;
            }
        s->len = 0;
        rc = 0;
        goto out;
    }
    snprintf(fn, sizeof(fn), "%s.q", field);
    if (kp_tensor_resolve(self, o[0], fn, KP_ELEM_BF16, false, &a[0]) != 0)
        goto out;
    if (a[0].nbytes % tok || a[0].nbytes / tok > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: %llu bytes is not a whole number of tokens of "
                     "[%u, 128] bf16 (%llu bytes each)", fn, (unsigned long long)a[0].nbytes,
                     self->heads, (unsigned long long)tok);
        goto out;
    }
    s->len = (uint32_t)(a[0].nbytes / tok);
    r->any_cuda |= a[0].cuda;
    for (int f = 1; f < SEQ_FIELDS; f++) {
        uint64_t want = f == 4 ? kdac_beta_bytes(s->len, self->heads)
                               : kdac_token_bytes(s->len, self->heads);
        snprintf(fn, sizeof(fn), "%s.%s", field, FIELD[f]);
        if (f == 5 && !o[f]) { /* no out: a new array receives it */
            Py_ssize_t shape[3] = {(Py_ssize_t)s->len, (Py_ssize_t)self->heads, KDAC_HEAD_DIM};
            r->outs[i] = kp_new_array(shape, 3, "uint16", &a[f].view);
            if (!r->outs[i])
                goto out;
            a[f].have_view = true;
            a[f].ptr = a[f].view.buf;
            a[f].nbytes = want;
            a[f].host = true;
            continue;
        }
        if (!o[f]) {
            PyErr_Format(PyExc_ValueError, "%s: missing (q has %u tokens)", fn, s->len);
            goto out;
        }
        if (kp_tensor_resolve(self, o[f], fn, KP_ELEM_BF16, f == 5, &a[f]) != 0)
            goto out;
        if (a[f].nbytes != want) {
            PyErr_Format(PyExc_ValueError, "%s: %llu bytes; %u tokens of [%u%s] bf16 are %llu",
                         fn, (unsigned long long)a[f].nbytes, s->len, self->heads,
                         f == 4 ? "" : ", 128", (unsigned long long)want);
            goto out;
        }
        r->any_cuda |= a[f].cuda;
        if (f == 5) {
            Py_INCREF(o[f]);
            r->outs[i] = o[f];
        }
    }
    set_tensor(&s->q, &a[0]);
    set_tensor(&s->k, &a[1]);
    set_tensor(&s->v, &a[2]);
    set_tensor(&s->g, &a[3]);
    set_tensor(&s->beta, &a[4]);
    s->out = a[5].host ? kdac_output_inline(a[5].ptr)
                       : kdac_output_region(a[5].region, a[5].offset);
    rc = 0;
out:
    Py_XDECREF(slot);
    Py_XDECREF(fresh);
    Py_XDECREF(ep);
    for (int f = 0; f < SEQ_FIELDS; f++)
        Py_XDECREF(o[f]);
    return rc;
}

int kp_request_build(ClientObject *self, PyObject *seqs, request *r)
{
    memset(r, 0, sizeof(*r));
    r->client = self;
    r->pair = -1;
    self->use_clock++;
    if (PyUnicode_Check(seqs) || PyDict_Check(seqs)) {
        PyErr_SetString(PyExc_TypeError, "seqs: a list of mappings expected");
        return -1;
    }
    Py_ssize_t n = PySequence_Size(seqs);
    if (n < 0)
        return -1;
    if (n == 0 || n > 4096) {
        PyErr_Format(PyExc_ValueError, "seqs: %zd sequences; a prefill takes 1 to "
                     "max_seqs_per_request", n);
        return -1;
    }
    r->nseqs = (uint32_t)n;
    r->seqs = PyMem_Calloc((size_t)n, sizeof(*r->seqs));
    r->args = PyMem_Calloc((size_t)n * SEQ_FIELDS, sizeof(*r->args));
    r->outs = PyMem_Calloc((size_t)n, sizeof(*r->outs));
    if (!r->seqs || !r->args || !r->outs) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PySequence_GetItem(seqs, i);
        if (!m)
            return -1;
        int rc = parse_seq(self, m, (uint32_t)i, r);
        Py_DECREF(m);
        if (rc != 0)
            return -1;
    }
    return kp_request_stage(self, r);
}

int kp_request_stage(ClientObject *self, request *r)
{
    uint64_t in = 0, out = 0, total = 0;
    uint32_t nargs = r->nseqs * SEQ_FIELDS;
    for (uint32_t j = 0; j < nargs; j++) {
        tensor_arg *t = &r->args[j];
        if (!t->host || !t->nbytes)
            continue;
        if (j % SEQ_FIELDS == 5)
            out += t->nbytes;
        else
            in += t->nbytes;
        total += align16(t->nbytes);
    }
    uint64_t limit = self->inline_max;
    const kdac_server_info *info = kdac_client_info(self->c);
    if (info->limits.max_inline_bytes < limit)
        limit = info->limits.max_inline_bytes;
    if ((in <= limit && out <= limit) || !(info->transports & KDAC_TRANSPORT_SHM))
        return 0; /* inline (the daemon answers LIMIT_EXCEEDED for what cannot be) */
    r->stg = kp_staging_get(self, total);
    if (!r->stg)
        return -1;
    r->cbs = PyMem_Calloc(r->nseqs, sizeof(*r->cbs));
    if (!r->cbs) {
        PyErr_NoMemory();
        return -1;
    }
    uint8_t *base = r->stg->shm.base;
    uint64_t off = 0;
    for (uint32_t j = 0; j < nargs; j++) {
        tensor_arg *t = &r->args[j];
        if (!t->host || !t->nbytes)
            continue;
        kdac_seq *s = &r->seqs[j / SEQ_FIELDS];
        if (j % SEQ_FIELDS == 5) {
            r->cbs[r->ncbs++] = (copyback){t->ptr, off, t->nbytes};
            s->out = kdac_output_region(r->stg->region, off);
        } else {
            memcpy(base + off, t->ptr, t->nbytes);
            kdac_tensor ref = kdac_tensor_region(r->stg->region, off);
            kdac_tensor *dst[5] = {&s->q, &s->k, &s->v, &s->g, &s->beta};
            *dst[j % SEQ_FIELDS] = ref;
        }
        off += align16(t->nbytes);
    }
    return 0;
}

int kp_request_require_regions(const request *r, const char *why)
{
    for (uint32_t j = 0; j < r->nseqs * SEQ_FIELDS; j++) {
        if (r->args[j].host && r->args[j].nbytes) {
            PyErr_Format(PyExc_ValueError, "seqs[%u].%s: %s in host memory outside "
                         "shared_array memory; %s", j / SEQ_FIELDS, FIELD[j % SEQ_FIELDS],
                         j % SEQ_FIELDS == 5 ? "missing, or" : "", why);
            return -1;
        }
    }
    return 0;
}

void kp_request_unstage(request *r)
{
    if (!r->stg)
        return;
    for (uint32_t i = 0; i < r->ncbs; i++)
        memcpy(r->cbs[i].dst, (uint8_t *)r->stg->shm.base + r->cbs[i].offset, r->cbs[i].nbytes);
    r->stg->busy = false;
    r->stg = NULL;
}

void kp_request_release(request *r)
{
    if (r->stg) { /* failed before completion: give the buffer back unread */
        r->stg->busy = false;
        r->stg = NULL;
    }
    if (r->args)
        for (uint32_t j = 0; j < r->nseqs * SEQ_FIELDS; j++)
            kp_tensor_release(&r->args[j]);
    if (r->outs)
        for (uint32_t i = 0; i < r->nseqs; i++)
            Py_XDECREF(r->outs[i]);
    PyMem_Free(r->seqs);
    PyMem_Free(r->args);
    PyMem_Free(r->outs);
    PyMem_Free(r->cbs);
    Py_CLEAR(r->callback);
    r->seqs = NULL;
    r->args = NULL;
    r->outs = NULL;
    r->cbs = NULL;
}
