/* Optional accelerator of the recv probes: the bytes sum of a copy's size array (proxies.total_bytes).
 *
 * proxies.total_bytes_rule is the reference and the fallback. total_bytes(sizes) here sums a 1-D integer
 * (or bool) array through the buffer protocol, exactly, in int64; whatever it does not take (not a numpy
 * ndarray, another dimension count, a float or object dtype, a non-native byte order, a buffer export that
 * fails, an item or partial sum outside int64) goes to the Python rule, which then answers as it always did.
 * A value returned here is the exact sum, which is what the rule returns for these arrays: int(sum(tolist()))
 * up to SMALL_ARRAY items, and numpy's sum beyond, which equals the exact sum when that fits int64 (numpy
 * accumulates integers modulo 2^64). tests/instrument/test_total_bytes.py compares both over generated
 * arrays of every integer dtype, shape, stride and range.
 *
 * No Python code runs on the fast path and nothing the GC tracks is allocated (the result is an int).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *fallback;      /* proxies.total_bytes_rule, set once by set_fallback */
static PyTypeObject *ndarray_t; /* numpy.ndarray, set by set_fallback: only its buffers are summed here */

#define SUM(T)                                                                       \
    for (i = 0; i < n; i++) {                                                        \
        T x_;                                                                        \
        memcpy(&x_, p + i * stride, sizeof x_);                                      \
        if ((uint64_t)(x_) > (uint64_t)INT64_MAX && (x_) > 0) goto slow;             \
        if (__builtin_add_overflow(acc, (int64_t)(x_), &acc)) goto slow;             \
    }

/* 1 and *out set when view is a 1-D buffer of a native integer (or bool) type whose exact sum fits int64. */
static int sum_view(const Py_buffer *view, int64_t *out) {
    const char *f = view->format, *p = (const char *)view->buf;
    Py_ssize_t i, n, stride;
    int64_t acc = 0;
    if (view->ndim != 1 || f == NULL || f[0] == '\0' || f[1] != '\0' || view->shape == NULL) return 0;
    n = view->shape[0];
    stride = view->strides != NULL ? view->strides[0] : view->itemsize;
    switch (f[0]) {
    case '?': if (view->itemsize != 1) return 0; SUM(uint8_t) break;
    case 'b': if (view->itemsize != 1) return 0; SUM(int8_t) break;
    case 'B': if (view->itemsize != 1) return 0; SUM(uint8_t) break;
    case 'h': if (view->itemsize != 2) return 0; SUM(int16_t) break;
    case 'H': if (view->itemsize != 2) return 0; SUM(uint16_t) break;
    case 'i': if (view->itemsize != 4) return 0; SUM(int32_t) break;
    case 'I': if (view->itemsize != 4) return 0; SUM(uint32_t) break;
    case 'l': case 'q':
        if (view->itemsize != 8) return 0;
        SUM(int64_t) break;
    case 'L': case 'Q':
        if (view->itemsize != 8) return 0;
        SUM(uint64_t) break;
    default: return 0;
    }
    *out = acc;
    return 1;
slow:
    return 0;
}
#undef SUM

/* total_bytes(sizes) -> int: the exact sum of a 1-D integer ndarray, else proxies.total_bytes_rule(sizes). */
static PyObject *total_bytes(PyObject *Py_UNUSED(module), PyObject *sizes) {
    if (ndarray_t != NULL && Py_IS_TYPE(sizes, ndarray_t)) {
        Py_buffer view;
        if (PyObject_GetBuffer(sizes, &view, PyBUF_STRIDES | PyBUF_FORMAT) == 0) {
            int64_t sum;
            int ok = sum_view(&view, &sum);
            PyBuffer_Release(&view);
            if (ok) return PyLong_FromLongLong(sum);
        } else {
            PyErr_Clear();
        }
    }
    if (fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_probes.set_fallback was not called");
        return NULL;
    }
    return PyObject_CallOneArg(fallback, sizes);
}

/* set_fallback(rule, ndarray_type): the Python rule for everything the fast path does not take. */
static PyObject *set_fallback(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyCallable_Check(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "set_fallback(rule, ndarray_type)");
        return NULL;
    }
    Py_INCREF(args[0]);
    Py_XSETREF(fallback, args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(ndarray_t, (PyTypeObject *)args[1]);
    Py_RETURN_NONE;
}

static PyMethodDef probes_methods[] = {
    {"total_bytes", (PyCFunction)total_bytes, METH_O,
     "total_bytes(sizes): exact sum of a 1-D integer ndarray, else the Python rule's answer"},
    {"set_fallback", (PyCFunction)(void (*)(void))set_fallback, METH_FASTCALL,
     "set_fallback(rule, ndarray_type): the Python rule used for everything else"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef probes_module = {
    PyModuleDef_HEAD_INIT, "_probes", "Native helpers of otel_kvtrace's recv probes", -1, probes_methods,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__probes(void) { return PyModule_Create(&probes_module); }
