/*
 * results.c - exceptions carrying the daemon's message, and the objects
 * results are made of (NumPy arrays through numpy.empty, result lists).
 */
#include "kdapy.h"

PyObject *kp_make_exception(const kdac_error *err)
{
    PyObject *cls = kp_error_class(err->code);
    return PyObject_CallFunction(cls, "siO", err->message, err->code,
                                 err->retryable ? Py_True : Py_False);
}

PyObject *kp_raise(const kdac_error *err)
{
    PyObject *exc = kp_make_exception(err);
    if (exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

PyObject *kp_new_array(const Py_ssize_t *shape, int ndim, const char *dtype, Py_buffer *view)
{
    if (kp_numpy() != 0)
        return NULL;
    PyObject *t = PyTuple_New(ndim);
    if (!t)
        return NULL;
    for (int i = 0; i < ndim; i++)
        PyTuple_SetItem(t, i, PyLong_FromSsize_t(shape[i]));
    PyObject *arr = PyObject_CallFunction(kp_numpy_empty, "Os", t, dtype);
    Py_DECREF(t);
    if (!arr)
        return NULL;
    if (PyObject_GetBuffer(arr, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

PyObject *kp_prefill_result(request *r, const uint64_t *pos)
{
    PyObject *list = PyList_New(r->nseqs);
    if (!list)
        return NULL;
    for (uint32_t i = 0; i < r->nseqs; i++) {
        PyObject *out = r->outs[i] ? r->outs[i] : Py_None;
        PyObject *d = Py_BuildValue("{sKsO}", "pos", (unsigned long long)pos[i], "out", out);
        if (!d) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SetItem(list, i, d);
    }
    return list;
}

PyObject *kp_timings(const uint64_t *us)
{
    return Py_BuildValue("{sKsKsKsK}", "queue_us", (unsigned long long)us[0], "run_us",
                         (unsigned long long)us[1], "device_us", (unsigned long long)us[2],
                         "kernel_us", (unsigned long long)us[3]);
}

PyObject *kp_fetch_exception(void)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (v && tb)
        PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v ? v : Py_NewRef(Py_None);
}
