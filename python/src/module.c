/*
 * module.c - the kdaclient._kdaclient module: the Client base type, the
 * library's error table and version, and the hooks the Python package sets
 * (its exception classes, its array coercion).
 */
#include "kdapy.h"

PyObject *kp_numpy_empty;
PyObject *kp_coerce_hook;
PyObject *kp_error_base;
static PyObject *error_classes; /* dict: code -> class */

PyObject *kp_error_class(int code)
{
    PyObject *k = PyLong_FromLong(code);
    PyObject *cls = (k && error_classes) ? PyDict_GetItem(error_classes, k) : NULL;
    Py_XDECREF(k);
    if (cls)
        return cls;
    return kp_error_base ? kp_error_base : PyExc_RuntimeError;
}

int kp_numpy(void)
{
    if (kp_numpy_empty)
        return 0;
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np)
        return -1;
    kp_numpy_empty = PyObject_GetAttrString(np, "empty");
    Py_DECREF(np);
    return kp_numpy_empty ? 0 : -1;
}

static PyObject *set_hooks(PyObject *mod, PyObject *args)
{
    PyObject *base, *classes, *coerce;
    if (!PyArg_ParseTuple(args, "OO!O", &base, &PyDict_Type, &classes, &coerce))
        return NULL;
    Py_XDECREF(kp_error_base);
    Py_XDECREF(error_classes);
    Py_XDECREF(kp_coerce_hook);
    kp_error_base = Py_NewRef(base);
    error_classes = Py_NewRef(classes);
    kp_coerce_hook = coerce == Py_None ? NULL : Py_NewRef(coerce);
    Py_RETURN_NONE;
}

static PyObject *error_table(PyObject *mod, PyObject *unused)
{
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
#define KP_ROW(name, code, retryable, message)                                           \
    {                                                                                    \
        PyObject *row = Py_BuildValue("(siOs)", #name, code, (retryable) ? Py_True : Py_False, \
                                      message);                                          \
        if (!row || PyList_Append(list, row) != 0) {                                     \
            Py_XDECREF(row);                                                             \
            Py_DECREF(list);                                                             \
            return NULL;                                                                 \
        }                                                                                \
        Py_DECREF(row);                                                                  \
    }
    KDAC_ERRORS(KP_ROW)
#undef KP_ROW
    return list;
}

static PyObject *socket_default(PyObject *mod, PyObject *unused)
{
    char buf[KDAC_PATH_MAX];
    if (kdac_socket_default(buf, sizeof(buf)) != 0) {
        kdac_error e = {.code = KDAC_E_INVALID_ARGUMENT};
        snprintf(e.message, sizeof(e.message), "the default socket path does not fit in %d bytes",
                 KDAC_PATH_MAX);
        return kp_raise(&e);
    }
    return PyUnicode_DecodeFSDefault(buf);
}

static PyMethodDef methods[] = {
    {"_set_hooks", set_hooks, METH_VARARGS,
     "_set_hooks(error_base, {code: class}, coerce) -- set by the kdaclient package."},
    {"error_table", error_table, METH_NOARGS,
     "error_table() -> [(name, code, retryable, message)]: libkdaclient's error table."},
    {"socket_default", socket_default, METH_NOARGS,
     "socket_default() -> str: the socket a client uses when given none ($KDAD_SOCKET, else "
     "$XDG_RUNTIME_DIR/kdad.sock if it exists, else /run/kdad/kdad.sock)."},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *mod)
{
    PyObject *t = PyType_FromModuleAndSpec(mod, &kp_client_spec, NULL);
    if (!t)
        return -1;
    int rc = PyModule_AddObjectRef(mod, "_Client", t);
    Py_DECREF(t);
    if (rc != 0)
        return -1;
    if (PyModule_AddStringConstant(mod, "LIBRARY_VERSION", kdac_version_string()) != 0 ||
        PyModule_AddIntConstant(mod, "PROTOCOL_VERSION", KDAC_PROTOCOL_VERSION) != 0 ||
        PyModule_AddIntConstant(mod, "HEAD_DIM", KDAC_HEAD_DIM) != 0 ||
        PyModule_AddIntConstant(mod, "TENSOR_ALIGN", KDAC_TENSOR_ALIGN) != 0 ||
        PyModule_AddIntConstant(mod, "READABLE", KDAC_READABLE) != 0 ||
        PyModule_AddIntConstant(mod, "WRITABLE", KDAC_WRITABLE) != 0 ||
        PyModule_AddIntConstant(mod, "DEFAULT_INLINE_MAX", KP_DEFAULT_INLINE_MAX) != 0 ||
        PyModule_AddObject(mod, "DEFAULT_SCALE", PyFloat_FromDouble(KDAC_DEFAULT_SCALE)) != 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kdaclient._kdaclient",
    .m_doc = "libkdaclient for Python (the C part of the kdaclient package).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__kdaclient(void)
{
    return PyModuleDef_Init(&module);
}
