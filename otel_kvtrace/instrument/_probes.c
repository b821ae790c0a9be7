/* Optional accelerators of the recv probes: the bytes sum of a copy's size array (proxies.total_bytes), the
 * enqueue's record take (wrappers.take_rule, below), the gate rule after a gate wait (wrappers.gate_rule), the
 * save wait's after-stamp (rewrite.save_rule) and the forward's gate record wrapper (wrappers.gate_record_rule).
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
static PyObject *long_one, *long_zero, *long_minus_one, *str_dict; /* 1, 0, -1 and "__dict__", set at import */

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
    int ready;            /* set by a whole __init__, the last thing it does; a second __init__ is refused */
    vectorcallfunc vectorcall;
} Take;

/* o.<name>, a new reference: the slot at offset when o's type is exactly type (NULL with AttributeError when
 * it is unset, as getattr would), else getattr. */
static inline PyObject *slot_get(PyObject *o, Py_ssize_t offset, PyTypeObject *type, PyObject *name) {
    if (offset > 0 && Py_TYPE(o) == type) {
        PyObject *v = *(PyObject **)((char *)o + offset);
        if (v == NULL) {
            PyErr_SetObject(PyExc_AttributeError, name);
            return NULL;
        }
        Py_INCREF(v);
        return v;
    }
    return PyObject_GetAttr(o, name);
}

/* o.<name> = v (v borrowed), at the slot's offset as slot_get reads it, else setattr. */
static inline int slot_set(PyObject *o, Py_ssize_t offset, PyTypeObject *type, PyObject *name, PyObject *v) {
    if (offset > 0 && Py_TYPE(o) == type) {
        Py_INCREF(v);
        Py_XSETREF(*(PyObject **)((char *)o + offset), v);
        return 0;
    }
    return PyObject_SetAttr(o, name, v);
}

/* Field f of o (a new reference) and o.<f> = v (v borrowed). */
static PyObject *fget(Take *t, PyObject *o, int f) {
    return slot_get(o, t->offset[f], t->type[field_owner[f]], t->name[f]);
}

static int fset(Take *t, PyObject *o, int f, PyObject *v) {
    return slot_set(o, t->offset[f], t->type[field_owner[f]], t->name[f], v);
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
    if (!t->ready) {
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
    if (self->ready) { /* its offsets would change under a call in progress on another thread */
        PyErr_SetString(PyExc_TypeError, "Take() is initialised once");
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
    self->ready = 1;
    return 0;
}

static int Take_traverse(Take *self, visitproc visit, void *arg) {
    int i;
    Py_VISIT(self->pop);
    Py_VISIT(self->new_record);
    Py_VISIT(self->gate_attr);
    for (i = 0; i < 3; i++) Py_VISIT(self->type[i]);
    for (i = 0; i < N_FIELDS; i++) Py_VISIT(self->name[i]);
    return 0;
}

static int Take_clear(Take *self) {
    int i;
    self->ready = 0;
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


/* ---- the gate rule after a successful gate wait (wrappers.gate_rule is the reference; same statements, same
 * order) ----------------------------------------------------------------------------------------------------
 *
 * GateAfter(rule, record_type, log_type, position_type, stamp_attr, cond_wait, npu_sync, dep_npu, bits,
 *           record_lo, npu_lo)
 *     (rec, gate, g0, g1, stages) -> None:
 *
 *     try: gstamp = gate.__dict__.get(stamp_attr)
 *     except AttributeError: gstamp = None
 *     deps = rec.deps
 *     rec.has_dep |= bits
 *     if gstamp is None:
 *         stages += (npu_sync, g0, g1)
 *         deps[record_lo] = deps[npu_lo] = rec.t_enqueue
 *         deps[record_lo + 1] = g0
 *         deps[npu_lo + 1] = g1
 *     else:
 *         grec, gpos, gmark = gstamp
 *         gcond = grec if grec < g1 else g1
 *         if gcond < g0: gcond = g0
 *         if gcond > g0: stages += (cond_wait, g0, gcond, npu_sync, gcond, g1)
 *         else: stages += (npu_sync, gcond, g1)
 *         glog = gpos.log
 *         gp = gpos.position
 *         if g1 < glog.done_by[gp]: glog.done_by[gp] = g1
 *         if gp > glog.observed: glog.observed = gp
 *         deps[record_lo] = deps[record_lo + 1] = deps[npu_lo] = grec
 *         deps[npu_lo + 1] = g1
 *         rec.npu_marks.append((dep_npu, gpos))
 *         if gmark is not None: rec.npu_marks.append((dep_npu, gmark))
 *
 * The constants are the rule's own, handed in by wrappers.make_gate_after. A stamp that is neither None nor a
 * tuple of three (never written by wrap_gate_record) goes to ``rule`` (the rule's text compiled,
 * wrappers.gate_after_rule) before anything is written, which then unpacks it as the text does. Fields of the
 * exact record / log / position types are their slots, read and written at the member offsets; another type,
 * or a field that is not a plain slot, goes through getattr/setattr. The one list operations are the rule's:
 * ``stages += tuple`` appends the items to an exact list (what list.extend does), anything else gets the
 * tuple through ``+=`` (PyNumber_InPlaceAdd; the caller's ``stages`` is not rebound, but it is the record's own
 * list, and ``+=`` of a non-list never reaches the record); ``deps[i] = v`` and ``done_by[gp]`` on an exact
 * list with an index inside it are the list's item, else PyObject_SetItem/GetItem (the same IndexError).
 * Comparisons are PyObject_RichCompareBool (the rule's ``<``/``>`` and truth), ``|=`` PyNumber_InPlaceOr, both done
 * in C for exact ints of up to two digits (gcompare, gor: the same answers). Upstream's gate is only read:
 * its ``__dict__`` and, in that, our own stamp. An error leaves the exception set, as the rule would raise it,
 * with what the rule had written by then written (the caller's handler turns tracing off).
 * tests/instrument/test_gate_after.py compares it with the rule over generated records, stamps and logs. */

enum { GF_DEPS, GF_HAS_DEP, GF_T_ENQUEUE, GF_NPU_MARKS, /* TaskRecord */
       GF_LOG, GF_POSITION,                             /* StreamPosition */
       GF_DONE_BY, GF_OBSERVED,                          /* StreamLog */
       N_GFIELDS };
static const char *gfield_names[N_GFIELDS] = {"deps", "has_dep", "t_enqueue", "npu_marks", "log", "position",
                                              "done_by", "observed"};
static const int gfield_owner[N_GFIELDS] = {0, 0, 0, 0, 2, 2, 1, 1};
static PyObject *str_get, *str_append; /* "get", "append", set at import */

/* GateAfter's, and SaveAfter's (below: bits, lo[0], idx[0..1], type[0], the record's fields, and its own names
 * and stage). */
typedef struct {
    PyObject_HEAD
    PyObject *rule;       /* the rule's text compiled: a stamp that is not None or a 3-tuple */
    PyObject *stamp_attr; /* wrappers.GATE_STAMP_ATTR */
    PyObject *cond_wait, *npu_sync, *dep_npu, *bits;
    PyObject *events_attr, *set_ns_attr, *stage; /* SaveAfter: "layer_save_finished_events", "set_ns", its stage */
    Py_ssize_t lo[2];     /* deps index of GATE_RECORD's lo, GATE_NPU's lo */
    PyObject *idx[4];     /* the same indices and their his, as ints: record_lo, record_lo + 1, npu_lo, npu_lo + 1 */
    PyTypeObject *type[3]; /* TaskRecord, StreamLog, StreamPosition: their slots are read at offset[] */
    PyObject *name[N_GFIELDS];
    Py_ssize_t offset[N_GFIELDS];
    int ready;            /* as Take's: a call before a whole __init__, or a second __init__, is refused */
    vectorcallfunc vectorcall;
} Rule;

/* Field f of o (a new reference) and o.<f> = v (v borrowed), as Take's fget/fset. */
static PyObject *gget(Rule *t, PyObject *o, int f) {
    return slot_get(o, t->offset[f], t->type[gfield_owner[f]], t->name[f]);
}

static int gset(Rule *t, PyObject *o, int f, PyObject *v) {
    return slot_set(o, t->offset[f], t->type[gfield_owner[f]], t->name[f], v);
}

/* 1 and *out set when o is an exact int of at most two 30-bit digits (|v| < 2^60: every ns stamp, index, count
 * and bit mask), read from its digits as _ringpack's as_int reads them; 0 otherwise (no exception). */
static inline int small_int(PyObject *o, long long *out) {
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    if (PyLong_CheckExact(o)) {
        Py_ssize_t size = Py_SIZE(o);
        const digit *d = ((PyLongObject *)o)->ob_digit;
        if (size >= -2 && size <= 2) {
            Py_ssize_t n = size < 0 ? -size : size;
            long long v = n == 0 ? 0 : n == 1 ? (long long)d[0] : (long long)d[0] | (long long)d[1] << PyLong_SHIFT;
            *out = size < 0 ? -v : v;
            return 1;
        }
    }
#else
    (void)o;
    (void)out;
#endif
    return 0;
}

/* PyObject_RichCompareBool(a, b, op) for op <, > or >=: two such exact ints compared by value in C (what
 * long_richcompare answers), anything else the generic comparison (its exceptions too). */
static inline int gcompare(PyObject *a, PyObject *b, int op) {
    long long x, y;
    if (small_int(a, &x) && small_int(b, &y)) return op == Py_LT ? x < y : op == Py_GT ? x > y : x >= y;
    return PyObject_RichCompareBool(a, b, op);
}

/* v | bits (new reference): in C for two such non-negative exact ints (PyLong_FromLongLong: the small-int cache
 * as long_or's result), else PyNumber_InPlaceOr (the rule's |=). */
static inline PyObject *gor(PyObject *v, PyObject *bits) {
    long long x, y;
    if (small_int(v, &x) && small_int(bits, &y) && x >= 0 && y >= 0) return PyLong_FromLongLong(x | y);
    return PyNumber_InPlaceOr(v, bits);
}

/* deps[k] = v for the k-th of the four gate indices (v borrowed): list_ass_item's own store when deps is an
 * exact list holding that index, else the subscript store (its IndexError, a dict's or another type's). */
static int gstore(Rule *t, PyObject *deps, int k, PyObject *v) {
    Py_ssize_t i = t->lo[k >> 1] + (k & 1);
    if (PyList_CheckExact(deps) && i < PyList_GET_SIZE(deps)) {
        PyObject *old = PyList_GET_ITEM(deps, i);
        Py_INCREF(v);
        PyList_SET_ITEM(deps, i, v);
        Py_DECREF(old);
        return 0;
    }
    return PyObject_SetItem(deps, t->idx[k], v);
}

/* stages += (n items) (borrowed). */
static int gextend(PyObject *stages, PyObject **items, int n) {
    int i;
    PyObject *tup, *r;
    if (PyList_CheckExact(stages)) {
        for (i = 0; i < n; i++)
            if (PyList_Append(stages, items[i]) < 0) return -1;
        return 0;
    }
    if ((tup = PyTuple_New(n)) == NULL) return -1;
    for (i = 0; i < n; i++) {
        Py_INCREF(items[i]);
        PyTuple_SET_ITEM(tup, i, items[i]);
    }
    r = PyNumber_InPlaceAdd(stages, tup);
    Py_DECREF(tup);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* rec.npu_marks.append((dep_npu, mark)) */
static int gmark_append(Rule *t, PyObject *rec, PyObject *mark) {
    PyObject *marks, *pair, *r;
    int ret;
    if ((marks = gget(t, rec, GF_NPU_MARKS)) == NULL) return -1;
    if ((pair = PyTuple_Pack(2, t->dep_npu, mark)) == NULL) {
        Py_DECREF(marks);
        return -1;
    }
    if (PyList_CheckExact(marks)) {
        ret = PyList_Append(marks, pair);
    } else {
        r = PyObject_CallMethodOneArg(marks, str_append, pair); /* not "O": pair is a tuple */
        ret = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(pair);
    Py_DECREF(marks);
    return ret;
}

/* gate.__dict__.get(stamp_attr), None on AttributeError anywhere in that expression (a new reference; NULL
 * with another exception). */
static PyObject *gate_stamp(Rule *t, PyObject *gate) {
    PyObject *d, *v;
    if ((d = PyObject_GetAttr(gate, str_dict)) != NULL) {
        if (PyDict_CheckExact(d)) {
            v = PyDict_GetItemWithError(d, t->stamp_attr);
            if (v == NULL && !PyErr_Occurred()) v = Py_None;
            Py_XINCREF(v);
        } else {
            v = PyObject_CallMethodOneArg(d, str_get, t->stamp_attr);
        }
        Py_DECREF(d);
        if (v != NULL) return v;
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
    PyErr_Clear();
    Py_RETURN_NONE;
}

static PyObject *GateAfter_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Rule *t = (Rule *)callable;
    PyObject *rec, *g0, *g1, *stages, *gstamp, *deps = NULL, *v = NULL, *glog = NULL, *gp = NULL, *done_by = NULL;
    PyObject *items[6];
    int r;
    if (PyVectorcall_NARGS(nargsf) != 5 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "gate_after(rec, gate, g0, g1, stages)");
        return NULL;
    }
    if (!t->ready) {
        PyErr_SetString(PyExc_TypeError, "GateAfter not initialised");
        return NULL;
    }
    rec = args[0];
    g0 = args[2];
    g1 = args[3];
    stages = args[4];
    if ((gstamp = gate_stamp(t, args[1])) == NULL) return NULL;
    if (gstamp != Py_None && !(PyTuple_CheckExact(gstamp) && PyTuple_GET_SIZE(gstamp) == 3)) {
        Py_DECREF(gstamp); /* not the stamp wrap_gate_record writes: the rule's own unpacking */
        return PyObject_Vectorcall(t->rule, args, 5, NULL);
    }
    if ((deps = gget(t, rec, GF_DEPS)) == NULL) goto fail;
    if ((v = gget(t, rec, GF_HAS_DEP)) == NULL) goto fail;
    Py_SETREF(v, gor(v, t->bits));
    if (v == NULL || gset(t, rec, GF_HAS_DEP, v) < 0) goto fail;
    Py_CLEAR(v);
    if (gstamp == Py_None) { /* recorded before tracing started (or a gate without __dict__) */
        items[0] = t->npu_sync;
        items[1] = g0;
        items[2] = g1;
        if (gextend(stages, items, 3) < 0) goto fail;
        if ((v = gget(t, rec, GF_T_ENQUEUE)) == NULL) goto fail;
        if (gstore(t, deps, 0, v) < 0 || gstore(t, deps, 2, v) < 0) goto fail;
        Py_CLEAR(v);
        if (gstore(t, deps, 1, g0) < 0 || gstore(t, deps, 3, g1) < 0) goto fail;
    } else {
        /* borrowed from gstamp (a tuple, held until the end) */
        PyObject *grec = PyTuple_GET_ITEM(gstamp, 0), *gpos = PyTuple_GET_ITEM(gstamp, 1);
        PyObject *gmark = PyTuple_GET_ITEM(gstamp, 2), *gcond;
        if ((r = gcompare(grec, g1, Py_LT)) < 0) goto fail;
        gcond = r ? grec : g1;
        if ((r = gcompare(gcond, g0, Py_LT)) < 0) goto fail;
        if (r) gcond = g0;
        if ((r = gcompare(gcond, g0, Py_GT)) < 0) goto fail;
        if (r) {
            items[0] = t->cond_wait;
            items[1] = g0;
            items[2] = gcond;
            items[3] = t->npu_sync;
            items[4] = gcond;
            items[5] = g1;
            r = gextend(stages, items, 6);
        } else {
            items[0] = t->npu_sync;
            items[1] = gcond;
            items[2] = g1;
            r = gextend(stages, items, 3);
        }
        if (r < 0) goto fail;
        if ((glog = gget(t, gpos, GF_LOG)) == NULL || (gp = gget(t, gpos, GF_POSITION)) == NULL) goto fail;
        if ((done_by = gget(t, glog, GF_DONE_BY)) == NULL) goto fail;
        if (PyList_CheckExact(done_by)) {
            long long i;
            if (small_int(gp, &i) && i >= 0 && i < PyList_GET_SIZE(done_by)) { /* else the subscript's own way */
                v = PyList_GET_ITEM(done_by, i);
                Py_INCREF(v);
            }
        }
        if (v == NULL && (v = PyObject_GetItem(done_by, gp)) == NULL) goto fail;
        Py_CLEAR(done_by);
        r = gcompare(g1, v, Py_LT);
        Py_CLEAR(v);
        if (r < 0) goto fail;
        if (r) {
            if ((done_by = gget(t, glog, GF_DONE_BY)) == NULL || PyObject_SetItem(done_by, gp, g1) < 0) goto fail;
            Py_CLEAR(done_by);
        }
        if ((v = gget(t, glog, GF_OBSERVED)) == NULL) goto fail;
        r = gcompare(gp, v, Py_GT);
        Py_CLEAR(v);
        if (r < 0 || (r && gset(t, glog, GF_OBSERVED, gp) < 0)) goto fail;
        if (gstore(t, deps, 0, grec) < 0 || gstore(t, deps, 1, grec) < 0 || gstore(t, deps, 2, grec) < 0 ||
            gstore(t, deps, 3, g1) < 0)
            goto fail;
        if (gmark_append(t, rec, gpos) < 0) goto fail; /* tightened to the earliest later completion */
        if (gmark != Py_None && gmark_append(t, rec, gmark) < 0) goto fail;
        Py_CLEAR(glog);
        Py_CLEAR(gp);
    }
    Py_DECREF(deps);
    Py_DECREF(gstamp);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(v);
    Py_XDECREF(done_by);
    Py_XDECREF(gp);
    Py_XDECREF(glog);
    Py_XDECREF(deps);
    Py_DECREF(gstamp);
    return NULL;
}

static int GateAfter_init(Rule *self, PyObject *args, PyObject *kwds) {
    PyObject *rule, *types[3], *stamp_attr, *cond_wait, *npu_sync, *dep_npu, *bits;
    Py_ssize_t lo[2];
    int i;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "GateAfter() takes no keyword arguments");
        return -1;
    }
    if (self->ready) { /* its offsets would change under a call in progress on another thread */
        PyErr_SetString(PyExc_TypeError, "GateAfter() is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OO!O!O!UO!O!O!O!nn", &rule, &PyType_Type, &types[0], &PyType_Type, &types[1],
                          &PyType_Type, &types[2], &stamp_attr, &PyLong_Type, &cond_wait, &PyLong_Type, &npu_sync,
                          &PyLong_Type, &dep_npu, &PyLong_Type, &bits, &lo[0], &lo[1]))
        return -1;
    if (!PyCallable_Check(rule)) {
        PyErr_SetString(PyExc_TypeError, "GateAfter: rule must be callable");
        return -1;
    }
    if (lo[0] < 0 || lo[1] < 0 || lo[0] > PY_SSIZE_T_MAX - 1 || lo[1] > PY_SSIZE_T_MAX - 1) {
        PyErr_SetString(PyExc_ValueError, "GateAfter: deps indices must be >= 0");
        return -1;
    }
    Py_INCREF(stamp_attr);
    Py_XSETREF(self->stamp_attr, stamp_attr);
    PyUnicode_InternInPlace(&self->stamp_attr);
    Py_INCREF(cond_wait);
    Py_XSETREF(self->cond_wait, cond_wait);
    Py_INCREF(npu_sync);
    Py_XSETREF(self->npu_sync, npu_sync);
    Py_INCREF(dep_npu);
    Py_XSETREF(self->dep_npu, dep_npu);
    Py_INCREF(bits);
    Py_XSETREF(self->bits, bits);
    for (i = 0; i < 4; i++) {
        self->lo[i >> 1] = lo[i >> 1];
        Py_XSETREF(self->idx[i], PyLong_FromSsize_t(lo[i >> 1] + (i & 1)));
        if (self->idx[i] == NULL) return -1;
    }
    for (i = 0; i < 3; i++) {
        Py_INCREF(types[i]);
        Py_XSETREF(self->type[i], (PyTypeObject *)types[i]);
    }
    for (i = 0; i < N_GFIELDS; i++) {
        Py_XSETREF(self->name[i], PyUnicode_InternFromString(gfield_names[i]));
        if (self->name[i] == NULL) return -1;
        if ((self->offset[i] = member_offset(self->type[gfield_owner[i]], self->name[i])) < -1) return -1;
    }
    Py_INCREF(rule);
    Py_XSETREF(self->rule, rule);
    self->ready = 1;
    return 0;
}

static int Rule_traverse(Rule *self, visitproc visit, void *arg) {
    int i;
    Py_VISIT(self->rule);
    Py_VISIT(self->stamp_attr); /* a str or int subclass given to __init__ may hold a cycle */
    Py_VISIT(self->cond_wait);
    Py_VISIT(self->npu_sync);
    Py_VISIT(self->dep_npu);
    Py_VISIT(self->bits);
    Py_VISIT(self->events_attr);
    Py_VISIT(self->set_ns_attr);
    Py_VISIT(self->stage);
    for (i = 0; i < 4; i++) Py_VISIT(self->idx[i]);
    for (i = 0; i < 3; i++) Py_VISIT(self->type[i]);
    for (i = 0; i < N_GFIELDS; i++) Py_VISIT(self->name[i]);
    return 0;
}

static int Rule_clear(Rule *self) {
    int i;
    self->ready = 0;
    Py_CLEAR(self->rule);
    Py_CLEAR(self->stamp_attr);
    Py_CLEAR(self->cond_wait);
    Py_CLEAR(self->npu_sync);
    Py_CLEAR(self->dep_npu);
    Py_CLEAR(self->bits);
    Py_CLEAR(self->events_attr);
    Py_CLEAR(self->set_ns_attr);
    Py_CLEAR(self->stage);
    for (i = 0; i < 4; i++) Py_CLEAR(self->idx[i]);
    for (i = 0; i < 3; i++) Py_CLEAR(self->type[i]);
    for (i = 0; i < N_GFIELDS; i++) Py_CLEAR(self->name[i]);
    return 0;
}

static void Rule_dealloc(Rule *self) {
    PyObject_GC_UnTrack(self);
    Rule_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *GateAfter_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Rule *self = (Rule *)type->tp_alloc(type, 0);
    if (self != NULL) self->vectorcall = GateAfter_call;
    return (PyObject *)self;
}

static PyTypeObject GateAfter_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_kvtrace.instrument._probes.GateAfter",
    .tp_basicsize = sizeof(Rule),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "GateAfter(rule, record_type, log_type, position_type, stamp_attr, cond_wait, npu_sync, dep_npu, bits, "
              "record_lo, npu_lo): the gate rule after a successful gate wait (wrappers.gate_rule), called as "
              "gate_after(rec, gate, g0, g1, stages) -> None",
    .tp_new = GateAfter_new,
    .tp_init = (initproc)GateAfter_init,
    .tp_dealloc = (destructor)Rule_dealloc,
    .tp_traverse = (traverseproc)Rule_traverse,
    .tp_clear = (inquiry)Rule_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Rule, vectorcall),
};


/* ---- the save wait's after-stamp (rewrite.save_rule is the reference; same statements, same order) ---------
 *
 * SaveAfter(record_type, events_attr, set_ns_attr, stage, bit, lo)
 *     (rec, thread, index, w0, w1, stages) -> None:
 *
 *     stages += (stage, w0, w1)
 *     set_ns = getattr(thread.<events_attr>[index], <set_ns_attr>, -1)
 *     deps = rec.deps
 *     rec.has_dep |= bit
 *     if set_ns >= 0: deps[lo] = deps[lo + 1] = set_ns
 *     else:
 *         deps[lo] = rec.t_enqueue
 *         deps[lo + 1] = w1
 *
 * The constants and names are the rule's own, handed in by rewrite.make_save_after; there is no fallback (every
 * step above is taken with the operation the rule applies, whatever the types). Upstream's thread,
 * its event list and the event are only read, with the rule's operations (getattr, subscript, getattr with a
 * default: only AttributeError gives -1); the rest as in GateAfter (record slots at their offsets, ``+=``,
 * item stores, comparisons). An error leaves the exception set, as the rule would raise it, with what the rule
 * had written by then written. tests/instrument/test_save_after.py compares it with the rule. */

static PyObject *SaveAfter_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Rule *t = (Rule *)callable;
    PyObject *rec, *w1, *v, *set_ns, *deps = NULL, *items[3];
    int r;
    if (PyVectorcall_NARGS(nargsf) != 6 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "save_after(rec, thread, index, w0, w1, stages)");
        return NULL;
    }
    if (!t->ready) {
        PyErr_SetString(PyExc_TypeError, "SaveAfter not initialised");
        return NULL;
    }
    rec = args[0];
    w1 = args[4];
    items[0] = t->stage;
    items[1] = args[3];
    items[2] = w1;
    if (gextend(args[5], items, 3) < 0) return NULL;
    if ((v = PyObject_GetAttr(args[1], t->events_attr)) == NULL) return NULL;
    Py_SETREF(v, PyObject_GetItem(v, args[2]));
    if (v == NULL) return NULL;
    set_ns = PyObject_GetAttr(v, t->set_ns_attr);
    Py_DECREF(v);
    if (set_ns == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
        set_ns = long_minus_one;
        Py_INCREF(set_ns);
    }
    if ((deps = gget(t, rec, GF_DEPS)) == NULL) goto fail;
    if ((v = gget(t, rec, GF_HAS_DEP)) == NULL) goto fail;
    Py_SETREF(v, gor(v, t->bits));
    if (v == NULL) goto fail;
    r = gset(t, rec, GF_HAS_DEP, v);
    Py_DECREF(v);
    if (r < 0 || (r = gcompare(set_ns, long_zero, Py_GE)) < 0) goto fail;
    if (r) {
        if (gstore(t, deps, 0, set_ns) < 0 || gstore(t, deps, 1, set_ns) < 0) goto fail;
    } else {
        if ((v = gget(t, rec, GF_T_ENQUEUE)) == NULL) goto fail;
        r = gstore(t, deps, 0, v);
        Py_DECREF(v);
        if (r < 0 || gstore(t, deps, 1, w1) < 0) goto fail;
    }
    Py_DECREF(deps);
    Py_DECREF(set_ns);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(deps);
    Py_DECREF(set_ns);
    return NULL;
}

static int SaveAfter_init(Rule *self, PyObject *args, PyObject *kwds) {
    PyObject *type, *events_attr, *set_ns_attr, *stage, *bit;
    Py_ssize_t lo;
    int i;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "SaveAfter() takes no keyword arguments");
        return -1;
    }
    if (self->ready) { /* its offsets would change under a call in progress on another thread */
        PyErr_SetString(PyExc_TypeError, "SaveAfter() is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!UUO!O!n", &PyType_Type, &type, &events_attr, &set_ns_attr, &PyLong_Type, &stage,
                          &PyLong_Type, &bit, &lo))
        return -1;
    if (lo < 0 || lo > PY_SSIZE_T_MAX - 1) {
        PyErr_SetString(PyExc_ValueError, "SaveAfter: the deps index must be >= 0");
        return -1;
    }
    Py_INCREF(events_attr);
    Py_XSETREF(self->events_attr, events_attr);
    PyUnicode_InternInPlace(&self->events_attr);
    Py_INCREF(set_ns_attr);
    Py_XSETREF(self->set_ns_attr, set_ns_attr);
    PyUnicode_InternInPlace(&self->set_ns_attr);
    Py_INCREF(bit);
    Py_XSETREF(self->bits, bit);
    self->lo[0] = lo;
    for (i = 0; i < 2; i++) {
        Py_XSETREF(self->idx[i], PyLong_FromSsize_t(lo + i));
        if (self->idx[i] == NULL) return -1;
    }
    Py_INCREF(type);
    Py_XSETREF(self->type[0], (PyTypeObject *)type);
    for (i = 0; i < N_GFIELDS; i++) {
        self->offset[i] = -1;
        if (gfield_owner[i] != 0) continue; /* the record's fields only */
        Py_XSETREF(self->name[i], PyUnicode_InternFromString(gfield_names[i]));
        if (self->name[i] == NULL) return -1;
        if ((self->offset[i] = member_offset(self->type[0], self->name[i])) < -1) return -1;
    }
    Py_INCREF(stage);
    Py_XSETREF(self->stage, stage);
    self->ready = 1;
    return 0;
}

static PyObject *SaveAfter_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Rule *self = (Rule *)type->tp_alloc(type, 0);
    if (self != NULL) self->vectorcall = SaveAfter_call;
    return (PyObject *)self;
}

static PyTypeObject SaveAfter_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_kvtrace.instrument._probes.SaveAfter",
    .tp_basicsize = sizeof(Rule),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "SaveAfter(record_type, events_attr, set_ns_attr, stage, bit, lo): the save wait's after-stamp "
              "(rewrite.save_rule), called as save_after(rec, thread, index, w0, w1, stages) -> None",
    .tp_new = SaveAfter_new,
    .tp_init = (initproc)SaveAfter_init,
    .tp_dealloc = (destructor)Rule_dealloc,
    .tp_traverse = (traverseproc)Rule_traverse,
    .tp_clear = (inquiry)Rule_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Rule, vectorcall),
};


/* ---- the gate's record wrapper (wrappers.gate_record_rule is the reference; same statements, same order) -------
 *
 * GateRecord(original, rt, clock, fallback, stamp_attr, log_type, position_type, max_events, far_future), bound
 * like a function (a method of the gate class), called as gate.record(*args, **kwargs):
 *
 *     if getattr(self, "_event", None) is None and rt.recorder.enabled and \
 *             stamp_attr not in getattr(self, "__dict__", _NO_DICT):
 *         if rt.npu_timing_wanted: return fallback(self, *args, **kwargs)   (the rule with its device mark)
 *         try:
 *             recorded = clock()
 *             log = rt.stream_log
 *             done_by = log.done_by
 *             if len(done_by) >= max_events: log = rt.stream_log = log_type(); done_by = log.done_by
 *             done_by.append(far_future)
 *             position = StreamPosition(log, len(done_by) - 1)
 *             setattr(self, stamp_attr, (recorded, position, None))
 *         except Exception as exc: rt.fail(exc)
 *     return original(self, *args, **kwargs)
 *
 * The forward thread runs this once per layer: in C it runs no Python frame (the wrapper's and the frozen
 * dataclass's __init__ were two). The position is made as StreamPosition's __init__ makes it (its two slots
 * set; a StreamPosition type without those plain slots is called instead). Upstream's gate is only read
 * (``_event``, ``__dict__``) and given our stamp attribute, as by the rule. A gate whose ``_event`` or
 * ``__dict__`` read raises something other than AttributeError raises it to the caller, as the rule does.
 * tests/instrument/test_gate_record.py compares it with the rule. */

typedef struct {
    PyObject_HEAD
    PyObject *original, *rt, *clock, *fallback, *stamp_attr, *log_type, *position_type, *far_future;
    Py_ssize_t max_events;
    Py_ssize_t log_offset, position_offset; /* StreamPosition's slots (-1: call the type) */
    PyObject *dict;                         /* functools.update_wrapper's attributes, __kvtrace_wrapped__ */
    PyObject *weakrefs;                     /* weakly referenced as a function can be */
    int ready;
    vectorcallfunc vectorcall;
} GateRecord;

#if PY_VERSION_HEX < 0x030D0000 /* getattr(o, name, default)'s lookup: 1 found, 0 AttributeError, -1 other error */
#define PyObject_GetOptionalAttr _PyObject_LookupAttr
#endif

static PyObject *str_event, *str_recorder, *str_enabled, *str_npu_timing_wanted, *str_stream_log, *str_done_by,
    *str_fail, *str_log, *str_position;

/* The stamp (the rule's try body); -1 with the exception set. */
static int record_stamp(GateRecord *g, PyObject *self) {
    PyObject *recorded, *log = NULL, *done_by = NULL, *position = NULL, *idx = NULL, *stamp;
    Py_ssize_t n;
    int r = -1;
    if ((recorded = PyObject_CallNoArgs(g->clock)) == NULL) return -1;
    if ((log = PyObject_GetAttr(g->rt, str_stream_log)) == NULL) goto done;
    if ((done_by = PyObject_GetAttr(log, str_done_by)) == NULL) goto done;
    if ((n = PyObject_Length(done_by)) < 0) goto done;
    if (n >= g->max_events) {
        Py_SETREF(log, PyObject_CallNoArgs(g->log_type));
        if (log == NULL || PyObject_SetAttr(g->rt, str_stream_log, log) < 0) goto done;
        Py_SETREF(done_by, PyObject_GetAttr(log, str_done_by));
        if (done_by == NULL) goto done;
    }
    if (PyList_CheckExact(done_by)) {
        if (PyList_Append(done_by, g->far_future) < 0) goto done;
    } else {
        PyObject *v = PyObject_CallMethodOneArg(done_by, str_append, g->far_future);
        if (v == NULL) goto done;
        Py_DECREF(v);
    }
    if ((n = PyObject_Length(done_by)) < 0 || (idx = PyLong_FromSsize_t(n - 1)) == NULL) goto done;
    if (g->log_offset > 0 && g->position_offset > 0) {
        PyTypeObject *pt = (PyTypeObject *)g->position_type;
        if ((position = pt->tp_alloc(pt, 0)) == NULL) goto done;
        Py_INCREF(log);
        *(PyObject **)((char *)position + g->log_offset) = log;
        Py_INCREF(idx);
        *(PyObject **)((char *)position + g->position_offset) = idx;
    } else {
        PyObject *pargs[2] = {log, idx};
        if ((position = PyObject_Vectorcall(g->position_type, pargs, 2, NULL)) == NULL) goto done;
    }
    if ((stamp = PyTuple_Pack(3, recorded, position, Py_None)) == NULL) goto done;
    r = PyObject_SetAttr(self, g->stamp_attr, stamp);
    Py_DECREF(stamp);
done:
    Py_DECREF(recorded);
    Py_XDECREF(log);
    Py_XDECREF(done_by);
    Py_XDECREF(position);
    Py_XDECREF(idx);
    return r;
}

/* 1: stamp this call, 0: not, -1: raise (the rule's condition, evaluated as it is: left to right, short-circuit). */
static int gate_wants_stamp(GateRecord *g, PyObject *self) {
    PyObject *v, *recorder;
    int r;
    if (PyObject_GetOptionalAttr(self, str_event, &v) < 0) return -1;
    if (v != NULL && v != Py_None) {
        Py_DECREF(v);
        return 0;
    }
    Py_XDECREF(v);
    if ((recorder = PyObject_GetAttr(g->rt, str_recorder)) == NULL) return -1;
    v = PyObject_GetAttr(recorder, str_enabled);
    Py_DECREF(recorder);
    if (v == NULL) return -1;
    r = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (r <= 0) return r;
    if (PyObject_GetOptionalAttr(self, str_dict, &v) < 0) return -1;
    if (v == NULL) return 0; /* no __dict__: _NO_DICT, which holds the stamp */
    r = PySequence_Contains(v, g->stamp_attr);
    Py_DECREF(v);
    return r < 0 ? -1 : !r;
}

/* rt.fail(exc) for an Exception that the stamp raised (the rule's handler); 0, or -1 with the exception set (a
 * BaseException, which the rule's ``except Exception`` does not catch, or one raised by fail itself). */
static int gate_failed(GateRecord *g) {
    PyObject *type, *value, *tb, *res, *saved[3];
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) PyException_SetTraceback(value, tb);
    PyErr_GetExcInfo(&saved[0], &saved[1], &saved[2]);
    Py_XINCREF(type);
    Py_XINCREF(value);
    Py_XINCREF(tb);
    PyErr_SetExcInfo(type, value, tb); /* handled while fail runs, as in the rule's except block */
    res = PyObject_CallMethodOneArg(g->rt, str_fail, value);
    PyErr_SetExcInfo(saved[0], saved[1], saved[2]);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (res == NULL) return -1;
    Py_DECREF(res);
    return 0;
}

static PyObject *GateRecord_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    GateRecord *g = (GateRecord *)callable;
    PyObject *v;
    int r;
    if (!g->ready) {
        PyErr_SetString(PyExc_TypeError, "GateRecord not initialised");
        return NULL;
    }
    if (PyVectorcall_NARGS(nargsf) < 1) /* no self: the original's own TypeError */
        return PyObject_Vectorcall(g->original, args, nargsf, kwnames);
    if ((r = gate_wants_stamp(g, args[0])) < 0) return NULL;
    if (r) {
        /* read inside the rule's try: a failure there is the rule's to handle (rt.fail, then the original) */
        r = -1;
        if ((v = PyObject_GetAttr(g->rt, str_npu_timing_wanted)) != NULL) {
            r = PyObject_IsTrue(v);
            Py_DECREF(v);
        }
        if (r < 0 && !PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
        if (r) {
            PyErr_Clear();
            return PyObject_Vectorcall(g->fallback, args, nargsf, kwnames);
        }
        if (record_stamp(g, args[0]) < 0 && gate_failed(g) < 0) return NULL;
    }
    return PyObject_Vectorcall(g->original, args, nargsf, kwnames);
}

/* Bound as a function is: ``gate.record`` is a method of the gate (LOAD_METHOD calls it unbound, with the gate). */
static PyObject *GateRecord_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type)) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static Py_ssize_t plain_slot(PyTypeObject *type, PyObject *name) {
    Py_ssize_t off = member_offset(type, name);
    if (off == -2) PyErr_Clear();
    return off;
}

/* Sets log_offset/position_offset when a StreamPosition can be made as its __init__ makes it, without running it:
 * an exact type (no metaclass, object's __new__), two plain slots and nothing else in the instance, and a call of
 * the type that stores exactly its two arguments in them (checked once, here, on a sample). Otherwise both stay -1
 * and every position is made by calling the type. -1 with the exception set on an error of the sample call. */
static int position_shape(GateRecord *self) {
    PyTypeObject *pt = (PyTypeObject *)self->position_type;
    PyObject *log, *idx, *sample, *pargs[2];
    Py_ssize_t lo, po;
    int same;
    if (Py_TYPE(pt) != &PyType_Type || pt->tp_new != PyBaseObject_Type.tp_new ||
        pt->tp_basicsize != (Py_ssize_t)(sizeof(PyObject) + 2 * sizeof(PyObject *)) || pt->tp_dictoffset != 0)
        return 0;
    if ((lo = plain_slot(pt, str_log)) <= 0 || (po = plain_slot(pt, str_position)) <= 0) return PyErr_Occurred() ? -1 : 0;
    if ((log = PyObject_CallNoArgs(self->log_type)) == NULL) return -1;
    if ((idx = PyLong_FromLong(12345)) == NULL) {
        Py_DECREF(log);
        return -1;
    }
    pargs[0] = log;
    pargs[1] = idx;
    sample = PyObject_Vectorcall((PyObject *)pt, pargs, 2, NULL);
    same = sample != NULL && Py_TYPE(sample) == pt && *(PyObject **)((char *)sample + lo) == log &&
           *(PyObject **)((char *)sample + po) == idx;
    Py_XDECREF(sample);
    Py_DECREF(log);
    Py_DECREF(idx);
    if (sample == NULL) return -1;
    if (same) {
        self->log_offset = lo;
        self->position_offset = po;
    }
    return 0;
}

static int GateRecord_init(GateRecord *self, PyObject *args, PyObject *kwds) {
    PyObject *o[8];
    Py_ssize_t max_events;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "GateRecord() takes no keyword arguments");
        return -1;
    }
    if (self->ready) {
        PyErr_SetString(PyExc_TypeError, "GateRecord() is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOOO!O!O!nO", &o[0], &o[1], &o[2], &o[3], &PyUnicode_Type, &o[4], &PyType_Type,
                          &o[5], &PyType_Type, &o[6], &max_events, &o[7]))
        return -1;
    if (!PyUnicode_CheckExact(o[4])) {
        PyErr_SetString(PyExc_TypeError, "GateRecord: stamp_attr must be a str");
        return -1;
    }
    Py_XSETREF(self->original, Py_NewRef(o[0]));
    Py_XSETREF(self->rt, Py_NewRef(o[1]));
    Py_XSETREF(self->clock, Py_NewRef(o[2]));
    Py_XSETREF(self->fallback, Py_NewRef(o[3]));
    Py_XSETREF(self->stamp_attr, Py_NewRef(o[4]));
    PyUnicode_InternInPlace(&self->stamp_attr);
    Py_XSETREF(self->log_type, Py_NewRef(o[5]));
    Py_XSETREF(self->position_type, Py_NewRef(o[6]));
    Py_XSETREF(self->far_future, Py_NewRef(o[7]));
    self->max_events = max_events;
    self->log_offset = self->position_offset = -1;
    if (position_shape(self) < 0) return -1;
    self->ready = 1;
    return 0;
}

static int GateRecord_traverse(GateRecord *self, visitproc visit, void *arg) {
    Py_VISIT(self->original);
    Py_VISIT(self->rt);
    Py_VISIT(self->clock);
    Py_VISIT(self->fallback);
    Py_VISIT(self->stamp_attr);
    Py_VISIT(self->log_type);
    Py_VISIT(self->position_type);
    Py_VISIT(self->far_future);
    Py_VISIT(self->dict);
    return 0;
}

static int GateRecord_clear(GateRecord *self) {
    self->ready = 0;
    Py_CLEAR(self->original);
    Py_CLEAR(self->rt);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->stamp_attr);
    Py_CLEAR(self->log_type);
    Py_CLEAR(self->position_type);
    Py_CLEAR(self->far_future);
    Py_CLEAR(self->dict);
    return 0;
}

static void GateRecord_dealloc(GateRecord *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)self);
    GateRecord_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *GateRecord_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    GateRecord *self = (GateRecord *)type->tp_alloc(type, 0);
    if (self != NULL) self->vectorcall = GateRecord_call;
    return (PyObject *)self;
}

static PyGetSetDef GateRecord_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject GateRecord_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_kvtrace.instrument._probes.GateRecord",
    .tp_basicsize = sizeof(GateRecord),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "GateRecord(original, rt, clock, fallback, stamp_attr, log_type, position_type, max_events, "
              "far_future): the gate's record wrapper (wrappers.gate_record_rule) in C, a method of the gate class",
    .tp_new = GateRecord_new,
    .tp_init = (initproc)GateRecord_init,
    .tp_dealloc = (destructor)GateRecord_dealloc,
    .tp_traverse = (traverseproc)GateRecord_traverse,
    .tp_clear = (inquiry)GateRecord_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(GateRecord, vectorcall),
    .tp_descr_get = GateRecord_get,
    .tp_getset = GateRecord_getset,
    .tp_dictoffset = offsetof(GateRecord, dict),
    .tp_weaklistoffset = offsetof(GateRecord, weakrefs),
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
        (long_minus_one = PyLong_FromLong(-1)) == NULL ||
        (str_dict = PyUnicode_InternFromString("__dict__")) == NULL ||
        (str_get = PyUnicode_InternFromString("get")) == NULL ||
        (str_append = PyUnicode_InternFromString("append")) == NULL ||
        (str_event = PyUnicode_InternFromString("_event")) == NULL ||
        (str_recorder = PyUnicode_InternFromString("recorder")) == NULL ||
        (str_enabled = PyUnicode_InternFromString("enabled")) == NULL ||
        (str_npu_timing_wanted = PyUnicode_InternFromString("npu_timing_wanted")) == NULL ||
        (str_stream_log = PyUnicode_InternFromString("stream_log")) == NULL ||
        (str_done_by = PyUnicode_InternFromString("done_by")) == NULL ||
        (str_fail = PyUnicode_InternFromString("fail")) == NULL ||
        (str_log = PyUnicode_InternFromString("log")) == NULL ||
        (str_position = PyUnicode_InternFromString("position")) == NULL)
        return NULL;
    if (PyType_Ready(&Take_Type) < 0 || PyType_Ready(&GateAfter_Type) < 0 || PyType_Ready(&SaveAfter_Type) < 0 ||
        PyType_Ready(&GateRecord_Type) < 0)
        return NULL;
    if ((m = PyModule_Create(&probes_module)) == NULL) return NULL;
    Py_INCREF(&Take_Type);
    if (PyModule_AddObject(m, "Take", (PyObject *)&Take_Type) < 0) {
        Py_DECREF(&Take_Type);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&GateAfter_Type);
    if (PyModule_AddObject(m, "GateAfter", (PyObject *)&GateAfter_Type) < 0) {
        Py_DECREF(&GateAfter_Type);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SaveAfter_Type);
    if (PyModule_AddObject(m, "SaveAfter", (PyObject *)&SaveAfter_Type) < 0) {
        Py_DECREF(&SaveAfter_Type);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&GateRecord_Type);
    if (PyModule_AddObject(m, "GateRecord", (PyObject *)&GateRecord_Type) < 0) {
        Py_DECREF(&GateRecord_Type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
