/* Optional accelerators of the recv probes: the bytes sum of a copy's size array (proxies.total_bytes), and
 * the enqueue's record take (wrappers.take_rule, below).
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
#include <structmember.h>
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


/* ---- the enqueue's record take (wrappers.take_rule is the reference; same statements, same order) ----------
 *
 * Take(pool, new_record, record_type, queue_type, worker_type, gate_id_attr)
 *     (st, layer_id, wait_for_save_layer, tasks, gate) -> rec:
 *
 *     rec = pool.pop()  (IndexError: new_record())
 *     worker = st.worker
 *     rec.queue = st.info
 *     rec.seq = enqueued = st.enqueued
 *     rec.queue_depth_at_enqueue = enqueued - st.dequeued
 *     rec.inflight_at_enqueue = enqueued - st.completed
 *     if not worker.driven: (seen = worker.seen_layers; a layer seen again: worker.step += 1, seen.clear();
 *                            seen.add(layer_id))
 *     rec.layer_id = layer_id
 *     rec.final_layer = layer_id == st.final_layer_id
 *     rec.wait_for_save_layer = wait_for_save_layer
 *     if gate is not None: the gate-id rule (gate_id below: our id on the gate, kept in its __dict__)
 *     if tasks: rec.transfer_tasks = tasks[0] if len(tasks) == 1 else list(tasks)
 *     rec.step = worker.step
 *     rec.holds.append(0)
 *
 * Only our own objects are written (the record, the queue and worker state) and, as the rule's setattr does,
 * our own _kvtrace_gate_id attribute of the gate; the upstream values (layer id, save layer, task list, gate)
 * are read with the operations the rule applies to them (==, hash, truth, len, [0], list, __dict__.get).
 * Fields of the exact record/state types are their slots, read and written at the member offsets (no
 * attribute lookup); another type, or a field that is not a plain slot, goes through getattr/setattr. An
 * error leaves the exception set, as the rule would raise it (the caller's handler turns tracing off; a
 * record already taken from the pool is then dropped, as by the rule). tests/instrument/test_enqueue_take.py
 * compares it with the rule over generated states and tasks. */

enum { F_INFO, F_WORKER, F_ENQUEUED, F_DEQUEUED, F_COMPLETED, F_FINAL_LAYER_ID, F_GATES_SEEN, /* QueueState */
       F_DRIVEN, F_SEEN, F_WSTEP, F_FORWARD_LAYER,                                       /* WorkerState */
       F_QUEUE, F_SEQ, F_DEPTH, F_INFLIGHT, F_LAYER, F_FINAL, F_WFSL, F_GATE_ID, F_TASKS, F_RSTEP, F_HOLDS,
       N_FIELDS };                                                                        /* TaskRecord ^ */
static const char *field_names[N_FIELDS] = {
    "info", "worker", "enqueued", "dequeued", "completed", "final_layer_id", "gates_seen",
    "driven", "seen_layers", "step", "forward_layer",
    "queue", "seq", "queue_depth_at_enqueue", "inflight_at_enqueue", "layer_id", "final_layer",
    "wait_for_save_layer", "gate_id", "transfer_tasks", "step", "holds"};
static const int field_owner[N_FIELDS] = {0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
static PyObject *long_one, *long_zero, *str_dict; /* 1, 0 and "__dict__", set at import */

/* The offset of type's plain object slot name (a T_OBJECT_EX member, writable, inside the instance), -1
 * when it is not one (a property put there, a changed class: that field then goes through getattr/setattr),
 * -2 with the exception set when the type has no such attribute at all. */
static Py_ssize_t member_offset(PyTypeObject *type, PyObject *name) {
    PyMemberDef *m;
    PyObject *d = PyObject_GetAttr((PyObject *)type, name);
    if (d == NULL) return -2;
    m = Py_IS_TYPE(d, &PyMemberDescr_Type) ? ((PyMemberDescrObject *)d)->d_member : NULL;
    Py_DECREF(d);
    return (m == NULL || m->type != T_OBJECT_EX || (m->flags & READONLY) || m->offset <= 0 ||
            m->offset + (Py_ssize_t)sizeof(PyObject *) > type->tp_basicsize) ? -1 : m->offset;
}

typedef struct {
    PyObject_HEAD
    PyObject *pop;        /* pool.pop */
    PyObject *new_record; /* TaskRecord */
    PyObject *gate_attr;  /* attach.GATE_ID_ATTR */
    PyTypeObject *type[3]; /* QueueState, WorkerState, TaskRecord: their slots are read at offset[] */
    PyObject *name[N_FIELDS];
    Py_ssize_t offset[N_FIELDS];
    vectorcallfunc vectorcall;
} Take;

/* Field f of o, a new reference (NULL with AttributeError when the slot is unset, as getattr would). */
static PyObject *fget(Take *t, PyObject *o, int f) {
    if (t->offset[f] > 0 && Py_TYPE(o) == t->type[field_owner[f]]) {
        PyObject *v = *(PyObject **)((char *)o + t->offset[f]);
        if (v == NULL) {
            PyErr_SetObject(PyExc_AttributeError, t->name[f]);
            return NULL;
        }
        Py_INCREF(v);
        return v;
    }
    return PyObject_GetAttr(o, t->name[f]);
}

/* o.<f> = v (v borrowed). */
static int fset(Take *t, PyObject *o, int f, PyObject *v) {
    if (t->offset[f] > 0 && Py_TYPE(o) == t->type[field_owner[f]]) {
        Py_INCREF(v);
        Py_XSETREF(*(PyObject **)((char *)o + t->offset[f]), v);
        return 0;
    }
    return PyObject_SetAttr(o, t->name[f], v);
}

/* o.<f> = v, v stolen (NULL: the exception of the expression that made it). */
static int fset_new(Take *t, PyObject *o, int f, PyObject *v) {
    int r;
    if (v == NULL) return -1;
    r = fset(t, o, f, v);
    Py_DECREF(v);
    return r;
}

/* The gate-id rule (gate not None):
 *     try: gid = gate.__dict__.get(GATE_ID_ATTR)
 *     except AttributeError: pass   (a gate without __dict__ cannot keep its id: none recorded)
 *     else:
 *         if gid is None: gid = worker.forward_layer; (gid < 0: gid = st.gates_seen); st.gates_seen += 1;
 *                         setattr(gate, GATE_ID_ATTR, gid)
 *         rec.gate_id = gid */
static int gate_id(Take *t, PyObject *st, PyObject *worker, PyObject *rec, PyObject *gate) {
    PyObject *d, *gid, *v;
    int r;
    if ((d = PyObject_GetAttr(gate, str_dict)) == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    if (PyDict_CheckExact(d)) {
        gid = PyDict_GetItemWithError(d, t->gate_attr);
        Py_XINCREF(gid);
        if (gid == NULL && PyErr_Occurred()) {
            Py_DECREF(d);
            return -1;
        }
        if (gid == Py_None) Py_CLEAR(gid);
    } else {
        gid = PyObject_CallMethod(d, "get", "O", t->gate_attr);
        if (gid == NULL) {
            Py_DECREF(d);
            return -1;
        }
        if (gid == Py_None) Py_CLEAR(gid);
    }
    Py_DECREF(d);
    if (gid == NULL) { /* the one home of the gate-id rule: the forward layer that created the gate */
        if ((gid = fget(t, worker, F_FORWARD_LAYER)) == NULL) return -1;
        if ((r = PyObject_RichCompareBool(gid, long_zero, Py_LT)) < 0) goto fail;
        if (r) {
            Py_SETREF(gid, fget(t, st, F_GATES_SEEN));
            if (gid == NULL) return -1;
        }
        if ((v = fget(t, st, F_GATES_SEEN)) == NULL) goto fail;
        Py_SETREF(v, PyNumber_InPlaceAdd(v, long_one));
        if (fset_new(t, st, F_GATES_SEEN, v) < 0) goto fail;
        if (PyObject_SetAttr(gate, t->gate_attr, gid) < 0) goto fail;
    }
    r = fset(t, rec, F_GATE_ID, gid);
    Py_DECREF(gid);
    return r;
fail:
    Py_DECREF(gid);
    return -1;
}

static PyObject *Take_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Take *t = (Take *)callable;
    PyObject *st, *layer_id, *tasks, *rec, *worker = NULL, *enqueued = NULL, *v = NULL, *seen = NULL, *holds;
    int truth;
    if (PyVectorcall_NARGS(nargsf) != 5 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "take(st, layer_id, wait_for_save_layer, tasks, gate)");
        return NULL;
    }
    if (t->pop == NULL) {
        PyErr_SetString(PyExc_TypeError, "Take not initialised");
        return NULL;
    }
    st = args[0];
    layer_id = args[1];
    tasks = args[3];
    rec = PyObject_CallNoArgs(t->pop);
    if (rec == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_IndexError)) return NULL;
        PyErr_Clear();
        if ((rec = PyObject_CallNoArgs(t->new_record)) == NULL) return NULL;
    }
    if ((worker = fget(t, st, F_WORKER)) == NULL) goto fail;
    if (fset_new(t, rec, F_QUEUE, fget(t, st, F_INFO)) < 0) goto fail;
    if ((enqueued = fget(t, st, F_ENQUEUED)) == NULL || fset(t, rec, F_SEQ, enqueued) < 0) goto fail;
    if ((v = fget(t, st, F_DEQUEUED)) == NULL) goto fail;
    Py_SETREF(v, PyNumber_Subtract(enqueued, v));
    if (fset_new(t, rec, F_DEPTH, v) < 0) { v = NULL; goto fail; }
    if ((v = fget(t, st, F_COMPLETED)) == NULL) goto fail;
    Py_SETREF(v, PyNumber_Subtract(enqueued, v));
    if (fset_new(t, rec, F_INFLIGHT, v) < 0) { v = NULL; goto fail; }
    v = NULL;
    if ((v = fget(t, worker, F_DRIVEN)) == NULL || (truth = PyObject_IsTrue(v)) < 0) goto fail;
    Py_CLEAR(v);
    if (!truth) { /* no start_load_kv: a repeated layer starts a new step */
        if ((seen = fget(t, worker, F_SEEN)) == NULL || (truth = PySequence_Contains(seen, layer_id)) < 0) goto fail;
        if (truth) {
            if ((v = fget(t, worker, F_WSTEP)) == NULL) goto fail;
            Py_SETREF(v, PyNumber_InPlaceAdd(v, long_one));
            if (fset_new(t, worker, F_WSTEP, v) < 0) { v = NULL; goto fail; }
            v = NULL;
            if (PySet_CheckExact(seen)) {
                if (PySet_Clear(seen) < 0) goto fail;
            } else if ((v = PyObject_CallMethod(seen, "clear", NULL)) == NULL) {
                goto fail;
            }
            Py_CLEAR(v);
        }
        if (PySet_CheckExact(seen)) {
            if (PySet_Add(seen, layer_id) < 0) goto fail;
        } else if ((v = PyObject_CallMethod(seen, "add", "O", layer_id)) == NULL) {
            goto fail;
        }
        Py_CLEAR(v);
        Py_CLEAR(seen);
    }
    if (fset(t, rec, F_LAYER, layer_id) < 0) goto fail;
    if ((v = fget(t, st, F_FINAL_LAYER_ID)) == NULL) goto fail;
    Py_SETREF(v, PyObject_RichCompare(layer_id, v, Py_EQ));
    if (fset_new(t, rec, F_FINAL, v) < 0) { v = NULL; goto fail; }
    v = NULL;
    if (fset(t, rec, F_WFSL, args[2]) < 0) goto fail;
    if (args[4] != Py_None && gate_id(t, st, worker, rec, args[4]) < 0) goto fail;
    if ((truth = PyObject_IsTrue(tasks)) < 0) goto fail;
    if (truth) { /* upstream clears the list after the task: keep its elements (one task as is) */
        Py_ssize_t n = PyObject_Size(tasks);
        if (n < 0) goto fail;
        v = n == 1 ? PySequence_GetItem(tasks, 0) : PySequence_List(tasks);
        if (fset_new(t, rec, F_TASKS, v) < 0) { v = NULL; goto fail; }
        v = NULL;
    }
    if (fset_new(t, rec, F_RSTEP, fget(t, worker, F_WSTEP)) < 0) goto fail;
    if ((holds = fget(t, rec, F_HOLDS)) == NULL) goto fail;
    if (PyList_CheckExact(holds)) {
        truth = PyList_Append(holds, long_zero);
    } else {
        v = PyObject_CallMethod(holds, "append", "O", long_zero);
        truth = v == NULL ? -1 : 0;
        Py_CLEAR(v);
    }
    Py_DECREF(holds);
    if (truth < 0) goto fail;
    Py_DECREF(worker);
    Py_DECREF(enqueued);
    return rec;
fail:
    Py_XDECREF(v);
    Py_XDECREF(seen);
    Py_XDECREF(worker);
    Py_XDECREF(enqueued);
    Py_DECREF(rec);
    return NULL;
}

static int Take_init(Take *self, PyObject *args, PyObject *kwds) {
    PyObject *pool, *new_record, *types[3];
    int i;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Take() takes no keyword arguments");
        return -1;
    }
    PyObject *gate_attr;
    if (!PyArg_ParseTuple(args, "OOO!O!O!U", &pool, &new_record, &PyType_Type, &types[2], &PyType_Type, &types[0],
                          &PyType_Type, &types[1], &gate_attr))
        return -1;
    Py_INCREF(gate_attr);
    Py_XSETREF(self->gate_attr, gate_attr);
    PyUnicode_InternInPlace(&self->gate_attr);
    Py_XSETREF(self->pop, PyObject_GetAttrString(pool, "pop"));
    if (self->pop == NULL) return -1;
    Py_INCREF(new_record);
    Py_XSETREF(self->new_record, new_record);
    for (i = 0; i < 3; i++) {
        Py_INCREF(types[i]);
        Py_XSETREF(self->type[i], (PyTypeObject *)types[i]);
    }
    for (i = 0; i < N_FIELDS; i++) {
        Py_XSETREF(self->name[i], PyUnicode_InternFromString(field_names[i]));
        if (self->name[i] == NULL) return -1;
        if ((self->offset[i] = member_offset(self->type[field_owner[i]], self->name[i])) < -1) return -1;
    }
    return 0;
}

static int Take_traverse(Take *self, visitproc visit, void *arg) {
    int i;
    Py_VISIT(self->pop);
    Py_VISIT(self->new_record);
    for (i = 0; i < 3; i++) Py_VISIT(self->type[i]);
    return 0;
}

static int Take_clear(Take *self) {
    int i;
    Py_CLEAR(self->pop);
    Py_CLEAR(self->new_record);
    Py_CLEAR(self->gate_attr);
    for (i = 0; i < 3; i++) Py_CLEAR(self->type[i]);
    for (i = 0; i < N_FIELDS; i++) Py_CLEAR(self->name[i]);
    return 0;
}

static void Take_dealloc(Take *self) {
    PyObject_GC_UnTrack(self);
    Take_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Take_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Take *self = (Take *)type->tp_alloc(type, 0);
    if (self != NULL) self->vectorcall = Take_call;
    return (PyObject *)self;
}

static PyTypeObject Take_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_kvtrace.instrument._probes.Take",
    .tp_basicsize = sizeof(Take),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Take(pool, new_record, record_type, queue_type, worker_type, gate_id_attr): the enqueue's record "
              "take (wrappers.take_rule), called as take(st, layer_id, wait_for_save_layer, tasks, gate) -> record",
    .tp_new = Take_new,
    .tp_init = (initproc)Take_init,
    .tp_dealloc = (destructor)Take_dealloc,
    .tp_traverse = (traverseproc)Take_traverse,
    .tp_clear = (inquiry)Take_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Take, vectorcall),
};

static PyMethodDef probes_methods[] = {
    {"total_bytes", (PyCFunction)total_bytes, METH_O,
     "total_bytes(sizes): exact sum of a 1-D integer ndarray, else the Python rule's answer"},
    {"set_fallback", (PyCFunction)(void (*)(void))set_fallback, METH_FASTCALL,
     "set_fallback(rule, ndarray_type): the Python rule used for everything else"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef probes_module = {
    PyModuleDef_HEAD_INIT, "_probes", "Native helpers of otel_kvtrace's recv probes", -1, probes_methods,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__probes(void) {
    PyObject *m;
    if ((long_one = PyLong_FromLong(1)) == NULL || (long_zero = PyLong_FromLong(0)) == NULL ||
        (str_dict = PyUnicode_InternFromString("__dict__")) == NULL)
        return NULL;
    if (PyType_Ready(&Take_Type) < 0) return NULL;
    if ((m = PyModule_Create(&probes_module)) == NULL) return NULL;
    Py_INCREF(&Take_Type);
    if (PyModule_AddObject(m, "Take", (PyObject *)&Take_Type) < 0) {
        Py_DECREF(&Take_Type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
