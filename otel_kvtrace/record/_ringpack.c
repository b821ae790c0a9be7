/* Optional accelerator of RingWriter.write_task (otel_kvtrace/record/ring.py): the task slot's claim,
 * body, tail and commit word in one C call instead of ~45 Python ints copied into a struct.pack_into.
 *
 * ring.py is the reference and the fallback; the bytes written here are the same (tests/record/
 * test_ringpack.py compares them over generated records). This file only handles the common case: every
 * field an int (a Python int or a subclass: bool, IntEnum) in range of its slot field, deps a list of 10,
 * stages a list. Anything else returns NotImplemented BEFORE a slot is claimed, and ring.py's Python path
 * then writes (or raises) exactly as it always did. So no input can make this code write a different
 * slot than the reference. Between the claim and the commit only storing the writer's claim hint can fail
 * (ring.py's path fails there too); that slot, like a claim no commit word can hold, is committed MSG_VOID.
 *
 * The GIL is held throughout and no Python code runs between reading the record and the commit but
 * fold_stages (a Python callable, before the claim). While it runs the GIL can switch and the forward can
 * append its consumer wait to an awaiting task's stages, so an awaiting task's stages are folded from a
 * snapshot (tuple), as ring.py folds tuple(rec.stages).
 *
 * Every layout constant copied here is exported in LAYOUT (with each field's offset and size) and compared
 * with ring.py's by ring._load_native: a stale build (the in-place .so is not rebuilt by a git pull) is
 * not used.
 *
 * Layout (ring.py TASK_FIXED = "@IBBBBnniiniinnnnnnI10nIH", native sizes and alignment): struct
 * task_fixed below has the same offsets (LAYOUT exports each field's offset and size, ring.py compares
 * them with the format's); stage int64s start at 192, and the body length is 192 + 8 * n also with no
 * stage (TASK_LAYOUTS[0] is TASK_FIXED + "0n", which pads to 8). The struct only gives the offsets: each
 * field is copied into a zeroed byte buffer at its offsetof, so padding bytes are 0 (struct.pack_into
 * zeroes its whole size; C does not promise that member stores leave padding alone); bytes past the
 * length are not touched (by struct.pack_into neither).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define RING_VERSION 3
#define TASK_FORMAT "@IBBBBnniiniinnnnnnI10nIH"
#define HEADER_BYTES 128
#define SLOT_SIZE 1024
#define SLOT_HEAD 16 /* commit q, crc I, kind H, length H */
#define BODY_BYTES (SLOT_SIZE - SLOT_HEAD)
#define H_HEAD 4
#define H_READ 5
#define MAX_STAGE_INTS 66
#define NUM_DEP_INTS 10
#define MSG_VOID 0
#define MSG_TASK 3
#define KIND_WRITTEN 0x8000
#define TASK_KIND (MSG_TASK | KIND_WRITTEN)
#define VOID_KIND (MSG_VOID | KIND_WRITTEN)
#define F_SRC 1
#define F_GATE 2
#define F_AWAITING 4
#define F_STAGES_FOLDED 8
#define MSG_CWAIT 4
#define CWAIT_KIND (MSG_CWAIT | KIND_WRITTEN)
#define CWAIT_FORMAT "<IqBH" /* queue index, seq, reason, number of ints; then the ints, native int64 */
#define CWAIT_FIXED 15
#define MAX_CWAIT_INTS 24
#define CONSUMER_WAIT 8 /* model.Stage.CONSUMER_WAIT */
_Static_assert(CWAIT_FIXED + 8 * MAX_CWAIT_INTS <= BODY_BYTES, "a consumer wait fits a slot");

struct task_fixed { /* the C compiler's natural alignment is struct's "@" alignment */
    uint32_t qidx;
    uint8_t kind, final_layer, outcome, flags;
    int64_t seq, step;
    int32_t layer_id, src;
    int64_t gate;
    int32_t qdepth, inflight;
    int64_t t_enqueue, t_dequeue, t_backend_return, t_complete, nbytes, backend_result;
    uint32_t has_dep;
    int64_t deps[NUM_DEP_INTS];
    uint32_t summary;
    uint16_t n_stage_ints;
};
#define FIXED_SIZE (offsetof(struct task_fixed, n_stage_ints) + 2) /* 190: struct.calcsize, no tail pad */
#define STAGES_AT 192
_Static_assert(FIXED_SIZE == 190, "TASK_FIXED layout");
_Static_assert(sizeof(struct task_fixed) == STAGES_AT, "stage ints start 8-aligned after TASK_FIXED");
_Static_assert(STAGES_AT + 8 * MAX_STAGE_INTS <= BODY_BYTES, "a task fits a slot");

/* zlib.crc32 (the reflected 0xEDB88320 polynomial), for COMMIT_CRC: table built at import. */
static uint32_t crc_table[256];

static uint32_t crc32_of(const unsigned char *p, size_t n, uint32_t seed) {
    uint32_t c = ~seed;
    while (n--) c = crc_table[(c ^ *p++) & 0xFF] ^ (c >> 8);
    return ~c;
}

/* Attribute names of TaskRecord, interned once. */
enum { A_KIND, A_FINAL, A_OUTCOME, A_SEQ, A_STEP, A_LAYER, A_SRC, A_GATE, A_QDEPTH, A_INFLIGHT, A_TENQ,
       A_TDEQ, A_TRET, A_TCOMP, A_NBYTES, A_RESULT, A_HASDEP, A_DEPS, A_STAGES, A_QUEUE, A_ERROR, A_MARKS,
       A_TT, N_ATTRS };
static const char *attr_names[N_ATTRS] = {
    "kind", "final_layer", "outcome", "seq", "step", "layer_id", "wait_for_save_layer", "gate_id",
    "queue_depth_at_enqueue", "inflight_at_enqueue", "t_enqueue", "t_dequeue", "t_backend_return",
    "t_complete", "nbytes", "backend_result", "has_dep", "deps", "stages", "queue", "error", "npu_marks",
    "transfer_tasks"};
static PyObject *attrs[N_ATTRS];
static PyObject *str_head; /* "_head": the writer's claim hint, kept as ring.py's _claim keeps it */
/* Shipper: the recorder's attribute and methods it reads or calls, and TaskRecord.reset */
static PyObject *str_ring_name, *str_ship_name, *str_drop_name, *str_disable_name, *str_reset_name;
/* Releaser: the writer's queue table (RingWriter._queues) */
static PyObject *str_queues_name;
/* ship(): names read on the writer, the stream marks and upstream's transfer task (ring.py write_task) */
enum { S_HITS, S_GENERATION, S_SHARED, S_REQ_IDS, S_BLOCKS, S_GROUP, S_LOG, S_POSITION, S_OBSERVED, S_DONE_BY,
       N_SHIP_NAMES };
static const char *ship_names[N_SHIP_NAMES] = {"_hits", "_req_generation", "shared_block_data", "req_ids",
                                               "block_ids_arr", "group_id", "log", "position", "observed",
                                               "done_by"};
static PyObject *names[N_SHIP_NAMES];
#define NO_SUMMARY 0xFFFFFFFFLL
#define MAX_SCAN 64
#define NUM_DEPS (NUM_DEP_INTS / 2)

/* 1 and *out set when o is an int within [lo, hi]; 0 (no exception) when it is not: the caller then
 * returns NotImplemented and the Python path decides (it packs an __index__ object, raises on a float). */
static inline int as_int(PyObject *o, long long lo, long long hi, long long *out) {
    int overflow;
    long long v;
    if (!PyLong_Check(o)) return 0; /* PyLong_AsLongLong would call __index__, i.e. Python code */
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    { /* up to two 30-bit digits (|v| < 2^60: every ns stamp, index and count) read inline; the value is
       * the one PyLong_AsLongLongAndOverflow returns (the same digits, sign from ob_size) */
        Py_ssize_t size = Py_SIZE(o);
        const digit *d = ((PyLongObject *)o)->ob_digit;
        if (size >= -2 && size <= 2) {
            Py_ssize_t n = size < 0 ? -size : size;
            v = n == 0 ? 0 : n == 1 ? (long long)d[0] : (long long)d[0] | (long long)d[1] << PyLong_SHIFT;
            if (size < 0) v = -v;
            if (v < lo || v > hi) return 0;
            *out = v;
            return 1;
        }
    }
#endif
    v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    if (v < lo || v > hi) return 0;
    *out = v;
    return 1;
}

#define I64_MIN (-0x7FFFFFFFFFFFFFFFLL - 1)
#define I64_MAX 0x7FFFFFFFFFFFFFFFLL

typedef struct {
    PyObject_HEAD
    Py_buffer view;   /* the ring mapping, writable; held until release() */
    int have_view;
    Py_ssize_t nslots;
    long long limit;  /* nslots - CLAIM_MARGIN */
    int crc;          /* COMMIT_CRC */
    PyObject *claims; /* the writer's itertools.count: claims shared with its Python _claim */
    PyObject *fold;   /* ring.fold_stages */
    /* TaskRecord is a slots dataclass: each field is a member descriptor reading the object pointer at a
     * fixed offset. For records of exactly that type the fields are read there (what the descriptor does,
     * without one attribute lookup per field: ~3,000 instructions per task); other objects use getattr. */
    PyTypeObject *rec_type; /* NULL: no fast path */
    Py_ssize_t offset[N_ATTRS];
    /* ship(): the last queue ring.py resolved (remember_queue) and its index, and the StreamPosition type */
    PyObject *queue;
    long long qidx;
    PyObject *position_type;
} Packer;

static void packer_release_view(Packer *self) {
    if (self->have_view) {
        self->have_view = 0;
        PyBuffer_Release(&self->view);
    }
}

static void Packer_dealloc(Packer *self) {
    packer_release_view(self);
    Py_XDECREF(self->claims);
    Py_XDECREF(self->fold);
    Py_XDECREF(self->rec_type);
    Py_XDECREF(self->queue);
    Py_XDECREF(self->position_type);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The slot offsets of rec_type's fields, or 0 when one of them is not a plain object slot. */
static int find_offsets(Packer *self, PyObject *rec_type) {
    int a;
    for (a = 0; a < N_ATTRS; a++) {
        PyObject *d = PyObject_GetAttr(rec_type, attrs[a]); /* on the class: the descriptor itself */
        PyMemberDef *m;
        if (d == NULL) {
            PyErr_Clear();
            return 0;
        }
        m = Py_IS_TYPE(d, &PyMemberDescr_Type) ? ((PyMemberDescrObject *)d)->d_member : NULL;
        Py_DECREF(d);
        if (m == NULL || m->type != T_OBJECT_EX || (m->flags & READONLY) || m->offset <= 0 ||
            m->offset + (Py_ssize_t)sizeof(PyObject *) > ((PyTypeObject *)rec_type)->tp_basicsize)
            return 0;
        self->offset[a] = m->offset;
    }
    return 1;
}

/* The field a of rec, a new reference (NULL with an exception when it is missing). */
static PyObject *get(Packer *self, PyObject *rec, int a) {
    if (Py_TYPE(rec) == self->rec_type) {
        PyObject *o = *(PyObject **)((char *)rec + self->offset[a]);
        if (o != NULL) {
            Py_INCREF(o);
            return o;
        } /* an unset slot: getattr raises the AttributeError */
    }
    return PyObject_GetAttr(rec, attrs[a]);
}

/* Packer(mem, nslots, limit, crc, claims, fold_stages, record_type[, position_type]) */
static int Packer_init(Packer *self, PyObject *args, PyObject *Py_UNUSED(kwds)) {
    PyObject *mem, *claims, *fold, *rec_type, *position_type = NULL;
    Py_ssize_t nslots;
    long long limit;
    int crc;
    if (!PyArg_ParseTuple(args, "OnLpOOO|O", &mem, &nslots, &limit, &crc, &claims, &fold, &rec_type, &position_type))
        return -1;
    Py_XINCREF(position_type); /* ship(): the type of a stream-order mark (stream_order.StreamPosition) */
    Py_XSETREF(self->position_type, position_type);
    if (!PyIter_Check(claims) || !PyCallable_Check(fold)) { /* PyIter_Next on a non-iterator: a NULL call */
        PyErr_SetString(PyExc_TypeError, "claims must be an iterator and fold_stages callable");
        return -1;
    }
    Py_CLEAR(self->rec_type);
    if (PyType_Check(rec_type) && find_offsets(self, rec_type)) {
        Py_INCREF(rec_type);
        self->rec_type = (PyTypeObject *)rec_type;
    }
    if (nslots <= 0) {
        PyErr_SetString(PyExc_ValueError, "nslots must be positive");
        return -1;
    }
    packer_release_view(self);
    if (PyObject_GetBuffer(mem, &self->view, PyBUF_WRITABLE) < 0) return -1;
    self->have_view = 1;
    if (self->view.len < HEADER_BYTES + (Py_ssize_t)nslots * SLOT_SIZE ||
        ((uintptr_t)self->view.buf & 7) != 0) { /* the header and commit words are aligned int64 stores */
        packer_release_view(self);
        PyErr_SetString(PyExc_ValueError, "ring mapping smaller than its slots, or not 8-byte aligned");
        return -1;
    }
    self->nslots = nslots;
    self->limit = limit;
    self->crc = crc;
    Py_INCREF(claims);
    Py_XSETREF(self->claims, claims);
    Py_INCREF(fold);
    Py_XSETREF(self->fold, fold);
    return 0;
}

/* One int field of rec into *out, or 0: NotImplemented (or -1 with an exception from getattr). */
static int field(Packer *self, PyObject *rec, int a, long long lo, long long hi, long long *out) {
    PyObject *o = get(self, rec, a);
    int ok;
    if (o == NULL) return -1;
    ok = as_int(o, lo, hi, out);
    Py_DECREF(o);
    return ok;
}

/* Slot idx committed as MSG_VOID for claim k (ring.py _commit(k, MSG_VOID, 0)): its tail, then the commit
 * word k + 1 alone. The crc of an empty body seeded with k is k. */
static void commit_void(Packer *self, Py_ssize_t idx, uint64_t k) {
    unsigned char *slot = (unsigned char *)self->view.buf + HEADER_BYTES + idx * SLOT_SIZE;
    uint16_t kind = VOID_KIND, len = 0;
    uint32_t crc = self->crc ? (uint32_t)k ^ ((uint32_t)kind << 16) : 0;
    memcpy(slot + 8, &crc, 4);
    memcpy(slot + 12, &kind, 2);
    memcpy(slot + 14, &len, 2);
    __atomic_store_n((int64_t *)slot, (int64_t)(k + 1), __ATOMIC_RELEASE);
}

/* A claim no commit word can hold (negative, or from 2^63 - 1 on; RingWriter's itertools.count() from 0
 * never gets there, but Packer is public): its slot (k mod nslots, Python's sign rule) committed void with
 * the claim + 1 modulo 2^64, and OverflowError. Nothing else is written. */
static PyObject *claim_out_of_range(Packer *self, PyObject *kobj) {
    PyObject *n = PyLong_FromSsize_t(self->nslots), *rem = n == NULL ? NULL : PyNumber_Remainder(kobj, n);
    Py_XDECREF(n);
    if (rem != NULL) {
        Py_ssize_t idx = PyLong_AsSsize_t(rem);
        Py_DECREF(rem);
        if (idx >= 0 && idx < self->nslots) commit_void(self, idx, PyLong_AsUnsignedLongLongMask(kobj));
    }
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "claim outside [0, 2**63 - 1): slot committed void");
    return NULL;
}

/* body[0:length] into a claimed slot as a message of (stored) kind ``kind``: ring.py's _claim, then the body,
 * the tail (crc, kind, length) and the commit word last and alone (_write / _commit, same rule and bytes).
 * True, False (ring full: nothing claimed), NotImplemented (the writer's claim hint is not an int: nothing
 * claimed) or NULL with an exception. From the claim on nothing can fail before the commit but the claim
 * counter itself (a failed next() claims nothing) and storing the claim hint (then the slot is committed
 * MSG_VOID, as ring.py does). */
static inline __attribute__((always_inline)) PyObject *put_slot(Packer *self, PyObject *writer, const unsigned char *body,
                                                                 size_t length, uint16_t kind) {
    int64_t *hdr = (int64_t *)self->view.buf;
    long long head, k;
    unsigned char *slot;
    uint32_t crc = 0;
    uint16_t tail_kind = kind, tail_len = (uint16_t)length;
    PyObject *o, *kobj, *head_obj;
    int overflow;

    o = PyObject_GetAttr(writer, str_head);
    if (o == NULL) return NULL;
    if (!as_int(o, I64_MIN, I64_MAX, &head)) {
        Py_DECREF(o);
        Py_RETURN_NOTIMPLEMENTED;
    }
    Py_DECREF(o);
    if (head - __atomic_load_n(&hdr[H_READ], __ATOMIC_RELAXED) >= self->limit) Py_RETURN_FALSE;
    kobj = PyIter_Next(self->claims);
    if (kobj == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "claim counter exhausted");
        return NULL;
    }
    if (!PyLong_Check(kobj)) { /* names no slot: nothing to commit */
        Py_DECREF(kobj);
        PyErr_SetString(PyExc_TypeError, "claim counter yielded a non-int");
        return NULL;
    }
    k = PyLong_AsLongLongAndOverflow(kobj, &overflow);
    if (overflow || k < 0 || k >= I64_MAX) { /* 2^63 - 1 claims: not reachable from RingWriter */
        PyObject *err = claim_out_of_range(self, kobj);
        Py_DECREF(kobj);
        return err;
    }
    Py_DECREF(kobj);
    head_obj = PyLong_FromLongLong(k + 1);
    if (head_obj == NULL || PyObject_SetAttr(writer, str_head, head_obj) < 0) {
        /* Claimed but not written: commit it as MSG_VOID (ring.py does the same), then raise. */
        Py_XDECREF(head_obj);
        commit_void(self, (Py_ssize_t)(k % self->nslots), (uint64_t)k);
        return NULL;
    }
    Py_DECREF(head_obj);
    if (k >= hdr[H_HEAD]) __atomic_store_n(&hdr[H_HEAD], (int64_t)(k + 1), __ATOMIC_RELAXED);

    /* k % nslots < nslots and the mapping holds nslots slots (checked in __init__): in bounds. */
    slot = (unsigned char *)self->view.buf + HEADER_BYTES + (k % self->nslots) * SLOT_SIZE;
    memcpy(slot + SLOT_HEAD, body, length);
    /* over the local body (the same bytes), never read back from the shared mapping */
    if (self->crc) crc = crc32_of(body, length, (uint32_t)k) ^ ((uint32_t)tail_kind << 16 | tail_len);
    memcpy(slot + 8, &crc, 4);
    memcpy(slot + 12, &tail_kind, 2);
    memcpy(slot + 14, &tail_len, 2);
    /* Last and alone, one aligned 8-byte store; release: the body and tail stores above are not moved
     * after it by the compiler (x86-64 keeps program order itself; elsewhere this is a release store,
     * though COMMIT_CRC is what the reader relies on there). */
    __atomic_store_n((int64_t *)slot, (int64_t)(k + 1), __ATOMIC_RELEASE);
    Py_RETURN_TRUE;
}

/* write(writer, rec, qidx, sidx, awaiting) -> True (written), False (ring full: nothing claimed) or
 * NotImplemented (an input the Python path must handle: nothing claimed). */
static PyObject *write_impl(Packer *self, PyObject *writer, PyObject *rec, long long qidx, long long sidx,
                            int awaiting);

/* 1 when a method of a live packer got ``want`` arguments; else 0 with TypeError (usage) or ValueError set. */
static int callable_with(Packer *self, Py_ssize_t nargs, Py_ssize_t want, const char *usage) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return 0;
    }
    if (!self->have_view) {
        PyErr_SetString(PyExc_ValueError, "packer released");
        return 0;
    }
    return 1;
}

static PyObject *Packer_write(Packer *self, PyObject *const *args, Py_ssize_t nargs) {
    long long qidx, sidx;
    int awaiting;
    if (!callable_with(self, nargs, 5, "write(writer, rec, qidx, sidx, awaiting)")) return NULL;
    awaiting = PyObject_IsTrue(args[4]);
    if (awaiting < 0) return NULL;
    if (!as_int(args[2], 0, UINT32_MAX, &qidx) || !as_int(args[3], 0, UINT32_MAX, &sidx))
        Py_RETURN_NOTIMPLEMENTED;
    return write_impl(self, args[0], args[1], qidx, sidx, awaiting);
}

/* The task body of rec, claimed and committed (write() after its argument checks). */
static PyObject *write_impl(Packer *self, PyObject *writer, PyObject *rec, long long qidx, long long sidx,
                            int awaiting) {
    /* The body is assembled here first, then copied into the slot: the slot sees only whole writes. */
    union { int64_t align; unsigned char raw[BODY_BYTES]; } body;
    long long v, kind, final_layer, outcome, src, gate, flags;
    PyObject *o, *stages = NULL;
    Py_ssize_t n, i;
    size_t length;
    int r = 1;

    memset(body.raw, 0, STAGES_AT); /* padding bytes are 0, as struct writes them; fields copied in below */
/* member of struct task_fixed = value, copied into body.raw at its offset (never a member store). */
#define PUT(member, value)                                                                   \
    do {                                                                                     \
        __typeof__(((struct task_fixed *)0)->member) put_ = (value);                         \
        memcpy(body.raw + offsetof(struct task_fixed, member), &put_, sizeof put_);          \
    } while (0)
#define FIELD(a, lo, hi, member)               \
    do {                                       \
        r = field(self, rec, a, lo, hi, &v);   \
        if (r <= 0) goto not_this;             \
        PUT(member, v);                        \
    } while (0)
#define LOCAL(a, lo, hi, dst)                  \
    do {                                       \
        r = field(self, rec, a, lo, hi, &v);   \
        if (r <= 0) goto not_this;             \
        dst = v;                               \
    } while (0)
    LOCAL(A_KIND, 0, 255, kind);
    LOCAL(A_FINAL, 0, 255, final_layer);
    LOCAL(A_OUTCOME, 0, 255, outcome);
    FIELD(A_SEQ, I64_MIN, I64_MAX, seq);
    FIELD(A_STEP, I64_MIN, I64_MAX, step);
    FIELD(A_LAYER, INT32_MIN, INT32_MAX, layer_id);
    FIELD(A_QDEPTH, INT32_MIN, INT32_MAX, qdepth);
    FIELD(A_INFLIGHT, INT32_MIN, INT32_MAX, inflight);
    FIELD(A_TENQ, I64_MIN, I64_MAX, t_enqueue);
    FIELD(A_TDEQ, I64_MIN, I64_MAX, t_dequeue);
    FIELD(A_TRET, I64_MIN, I64_MAX, t_backend_return);
    FIELD(A_TCOMP, I64_MIN, I64_MAX, t_complete);
    FIELD(A_NBYTES, I64_MIN, I64_MAX, nbytes);
    FIELD(A_RESULT, I64_MIN, I64_MAX, backend_result);
    FIELD(A_HASDEP, 0, UINT32_MAX, has_dep);
    flags = awaiting ? F_AWAITING : 0;
    /* wait_for_save_layer / gate_id: None means absent (0 and no flag), as in ring.py */
    o = get(self, rec, A_SRC);
    if (o == NULL) return NULL;
    r = o == Py_None ? (src = 0, 1) : (flags |= F_SRC, as_int(o, INT32_MIN, INT32_MAX, &src));
    Py_DECREF(o);
    if (!r) Py_RETURN_NOTIMPLEMENTED;
    o = get(self, rec, A_GATE);
    if (o == NULL) return NULL;
    r = o == Py_None ? (gate = 0, 1) : (flags |= F_GATE, as_int(o, I64_MIN, I64_MAX, &gate));
    Py_DECREF(o);
    if (!r) Py_RETURN_NOTIMPLEMENTED;

    o = get(self, rec, A_DEPS);
    if (o == NULL) return NULL;
    if (!PyList_CheckExact(o) || PyList_GET_SIZE(o) != NUM_DEP_INTS) {
        Py_DECREF(o);
        Py_RETURN_NOTIMPLEMENTED;
    }
    for (i = 0; i < NUM_DEP_INTS; i++) {
        if (!as_int(PyList_GET_ITEM(o, i), I64_MIN, I64_MAX, &v)) {
            Py_DECREF(o);
            Py_RETURN_NOTIMPLEMENTED;
        }
        PUT(deps[i], v);
    }
    Py_DECREF(o);

    stages = get(self, rec, A_STAGES);
    if (stages == NULL) return NULL;
    if (!PyList_CheckExact(stages) && !PyTuple_CheckExact(stages)) goto not_this;
    if (PySequence_Fast_GET_SIZE(stages) > MAX_STAGE_INTS) { /* repeated stages folded, by ring.py's rule */
        /* awaiting: the forward may append to the live list while fold runs (Python code), so fold a
         * snapshot, as ring.py does; a tuple's snapshot is itself. */
        PyObject *arg = awaiting ? PySequence_Tuple(stages) : Py_NewRef(stages);
        if (arg == NULL) goto not_this;
        Py_SETREF(stages, PyObject_CallOneArg(self->fold, arg));
        Py_DECREF(arg);
        if (stages == NULL) return NULL;
        if (!PyList_CheckExact(stages) || PyList_GET_SIZE(stages) > MAX_STAGE_INTS) goto not_this;
        flags |= F_STAGES_FOLDED;
    }
    n = PySequence_Fast_GET_SIZE(stages);
    for (i = 0; i < n; i++) {
        if (!as_int(PySequence_Fast_GET_ITEM(stages, i), I64_MIN, I64_MAX, &v)) goto not_this;
        memcpy(body.raw + STAGES_AT + 8 * i, &v, 8);
    }
    Py_CLEAR(stages);
    PUT(qidx, (uint32_t)qidx);
    PUT(kind, (uint8_t)kind);
    PUT(final_layer, (uint8_t)final_layer);
    PUT(outcome, (uint8_t)outcome);
    PUT(flags, (uint8_t)flags);
    PUT(src, (int32_t)src);
    PUT(gate, gate);
    PUT(summary, (uint32_t)sidx);
    PUT(n_stage_ints, (uint16_t)n);
    length = STAGES_AT + 8 * (size_t)n;

    return put_slot(self, writer, body.raw, length, TASK_KIND);

not_this:
    Py_XDECREF(stages);
    if (r < 0 || PyErr_Occurred()) return NULL;
    Py_RETURN_NOTIMPLEMENTED;
#undef FIELD
#undef LOCAL
#undef PUT
}

/* ---- ship(): the rest of ring.py RingWriter.write_task for the common task, in C ---------------------------
 * The queue index (the one ring.py resolved last, remember_queue), no error, the stream-order bounds of
 * StreamPosition marks (stream_order.tighten_bounds), the summary index of upstream's shared transfer data
 * when it is the one remembered in writer._hits (the same identity check), then write_impl. Every other
 * case returns NotImplemented and ring.py's Python path (the reference) does it all, as before. The bounds
 * are applied to the record before write_impl; if write_impl then declines, the Python path applies them
 * again, which changes nothing (the rule is idempotent: a lowered bound is not lowered further by the same
 * log; the bits set stay set). tests/record/test_ringpack.py drives both paths over generated records. */

#define MAX_MARKS 8

/* A new reference to obj.<names[n]>, or NULL with no exception left (ring.py's path will read it again and
 * raise what it raises). */
static PyObject *read_attr(PyObject *obj, int n) {
    PyObject *o = PyObject_GetAttr(obj, names[n]);
    if (o == NULL) PyErr_Clear();
    return o;
}

/* 1 and *out set when obj.<names[n]> is an int in [lo, hi]; 0 otherwise (no exception left). */
static int read_int(PyObject *obj, int n, long long lo, long long hi, long long *out) {
    PyObject *o = read_attr(obj, n);
    int ok;
    if (o == NULL) return 0;
    ok = as_int(o, lo, hi, out);
    Py_DECREF(o);
    return ok;
}

/* The stream-order upper bound of one StreamPosition (tighten_bounds' loop body): 1 with *bound, 2 when the
 * position itself was not seen complete yet (no bound), 0 when an input is not the common case. */
static int stream_bound(PyObject *mark, long long *bound) {
    long long p, last, b, x;
    Py_ssize_t end, j, len;
    PyObject *log, *done_by;
    int ok = 0;
    if (!read_int(mark, S_POSITION, 0, I64_MAX, &p)) return 0; /* a negative index: Python's rule, not ours */
    if ((log = read_attr(mark, S_LOG)) == NULL) return 0;
    if (!read_int(log, S_OBSERVED, I64_MIN, I64_MAX, &last) || (done_by = read_attr(log, S_DONE_BY)) == NULL) {
        Py_DECREF(log);
        return 0;
    }
    Py_DECREF(log);
    if (!PyList_CheckExact(done_by)) goto done;
    len = PyList_GET_SIZE(done_by);
    if (p > last) {
        ok = 2;
        goto done;
    }
    if (p >= len) goto done; /* IndexError (or min() of an empty slice) in Python */
    if (p == last) {
        ok = as_int(PyList_GET_ITEM(done_by, p), I64_MIN, I64_MAX, &b);
    } else {
        end = (Py_ssize_t)(last < p + MAX_SCAN ? last + 1 : p + MAX_SCAN);
        if (end > len) end = len;
        ok = as_int(PyList_GET_ITEM(done_by, p), I64_MIN, I64_MAX, &b);
        for (j = (Py_ssize_t)p + 1; ok && j < end; j++) {
            ok = as_int(PyList_GET_ITEM(done_by, j), I64_MIN, I64_MAX, &x);
            if (ok && x < b) b = x; /* x is unset when the item is not an int */
        }
    }
    if (ok) *bound = b;
done:
    Py_DECREF(done_by);
    return ok;
}

/* tighten_bounds(rec) for marks that are all StreamPositions: 1 (applied), 0 (not the common case: nothing
 * changed), -1 (an exception storing a value). */
static int tighten(Packer *self, PyObject *rec, PyObject *marks) {
    long long dep[MAX_MARKS], bound[MAX_MARKS], deps[NUM_DEP_INTS], has_dep, v;
    int have[MAX_MARKS], changed[NUM_DEP_INTS] = {0}, any = 0, r;
    Py_ssize_t n = PyList_GET_SIZE(marks), i;
    PyObject *dl;
    if (n > MAX_MARKS || self->position_type == NULL) return 0;
    for (i = 0; i < n; i++) { /* every mark checked before anything is changed */
        PyObject *m = PyList_GET_ITEM(marks, i);
        if (!PyTuple_CheckExact(m) || PyTuple_GET_SIZE(m) != 2 || !as_int(PyTuple_GET_ITEM(m, 0), 0, NUM_DEPS - 1, &dep[i]) ||
            (PyObject *)Py_TYPE(PyTuple_GET_ITEM(m, 1)) != self->position_type)
            return 0;
        r = stream_bound(PyTuple_GET_ITEM(m, 1), &bound[i]);
        if (r == 0) return 0;
        have[i] = r == 1;
    }
    if ((dl = get(self, rec, A_DEPS)) == NULL) {
        PyErr_Clear();
        return 0;
    }
    r = 0;
    if (!PyList_CheckExact(dl) || PyList_GET_SIZE(dl) != NUM_DEP_INTS || field(self, rec, A_HASDEP, 0, UINT32_MAX, &has_dep) <= 0)
        goto out;
    for (i = 0; i < NUM_DEP_INTS; i++)
        if (!as_int(PyList_GET_ITEM(dl, i), I64_MIN, I64_MAX, &deps[i])) goto out;
    for (i = 0; i < n; i++) { /* in mark order: a later mark of the same dependency sees the earlier one's */
        Py_ssize_t hi = 2 * (Py_ssize_t)dep[i] + 1;
        if (!have[i] || bound[i] >= deps[hi]) continue;
        has_dep |= 1LL << dep[i];
        deps[hi] = bound[i] > deps[hi - 1] ? bound[i] : deps[hi - 1];
        changed[hi] = any = 1;
    }
    r = 1;
    if (any) {
        PyObject *h = PyLong_FromLongLong(has_dep);
        if (h == NULL || PyObject_SetAttr(rec, attrs[A_HASDEP], h) < 0) r = -1;
        Py_XDECREF(h);
        for (i = 0; r > 0 && i < NUM_DEP_INTS; i++) {
            if (!changed[i]) continue;
            if ((v = deps[i], h = PyLong_FromLongLong(v)) == NULL) r = -1;
            else PyList_SetItem(dl, i, h); /* steals h */
        }
    }
out:
    Py_DECREF(dl);
    if (r == 0 && PyErr_Occurred()) PyErr_Clear();
    return r;
}

/* The summary index of rec's transfer tasks when ring.py's identity check would hit (writer._hits[slot]):
 * 1 with *sidx, 0 otherwise (no exception left). */
static int summary_hit(PyObject *writer, PyObject *tt, long long slot, long long *sidx) {
    PyObject *task, *shared = NULL, *req_ids = NULL, *blocks = NULL, *group = NULL, *hits = NULL, *hit;
    long long v, gen;
    Py_ssize_t len;
    int ok = 0;
    if (tt == Py_None) {
        *sidx = NO_SUMMARY;
        return 1;
    }
    task = PyList_CheckExact(tt) && PyList_GET_SIZE(tt) == 1 ? PyList_GET_ITEM(tt, 0) : tt;
    Py_INCREF(task);
    if ((shared = read_attr(task, S_SHARED)) == NULL || (req_ids = read_attr(shared, S_REQ_IDS)) == NULL ||
        (blocks = read_attr(shared, S_BLOCKS)) == NULL || (group = read_attr(task, S_GROUP)) == NULL ||
        (hits = read_attr(writer, S_HITS)) == NULL)
        goto out;
    if (!PyList_CheckExact(hits) || PyList_GET_SIZE(hits) != 2) goto out;
    hit = PyList_GET_ITEM(hits, slot);
    if (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 8 || PyTuple_GET_ITEM(hit, 0) != shared ||
        PyTuple_GET_ITEM(hit, 1) != req_ids || PyTuple_GET_ITEM(hit, 2) != blocks)
        goto out;
    if ((len = PyObject_Size(req_ids)) < 0 || !as_int(PyTuple_GET_ITEM(hit, 3), len, len, &v)) goto out;
    /* hit[4] == group: both plain ints (another type's __eq__ is Python's to run) */
    if (!PyLong_CheckExact(group) || !PyLong_CheckExact(PyTuple_GET_ITEM(hit, 4)) ||
        PyObject_RichCompareBool(PyTuple_GET_ITEM(hit, 4), group, Py_EQ) != 1)
        goto out;
    if ((len = PyObject_Size(blocks)) < 0 || !as_int(PyTuple_GET_ITEM(hit, 5), len, len, &v)) goto out;
    if (!read_int(writer, S_GENERATION, I64_MIN, I64_MAX, &gen) || !as_int(PyTuple_GET_ITEM(hit, 6), gen, gen, &v))
        goto out;
    ok = as_int(PyTuple_GET_ITEM(hit, 7), 0, UINT32_MAX, sidx);
out:
    Py_DECREF(task);
    Py_XDECREF(shared);
    Py_XDECREF(req_ids);
    Py_XDECREF(blocks);
    Py_XDECREF(group);
    Py_XDECREF(hits);
    if (PyErr_Occurred()) PyErr_Clear();
    return ok;
}

/* ship() after its argument checks: True, False (ring full), NotImplemented, or NULL with an exception. */
static PyObject *ship_impl(Packer *self, PyObject *writer, PyObject *rec, int awaiting) {
    PyObject *o;
    long long kind, sidx;
    int r;
    if (self->queue == NULL) Py_RETURN_NOTIMPLEMENTED;
    if ((o = get(self, rec, A_QUEUE)) == NULL) goto python;
    r = o == self->queue;
    Py_DECREF(o);
    if (!r || (o = get(self, rec, A_ERROR)) == NULL) goto python;
    r = o == Py_None;
    Py_DECREF(o);
    if (!r || field(self, rec, A_KIND, 0, 255, &kind) <= 0 || (o = get(self, rec, A_TT)) == NULL) goto python;
    r = summary_hit(writer, o, kind & 1, &sidx);
    Py_DECREF(o);
    if (!r || (o = get(self, rec, A_MARKS)) == NULL) goto python;
    r = PyList_CheckExact(o) ? (PyList_GET_SIZE(o) ? tighten(self, rec, o) : 1) : 0;
    Py_DECREF(o);
    if (r < 0) return NULL;
    if (!r) goto python;
    return write_impl(self, writer, rec, self->qidx, sidx, awaiting);
python:
    PyErr_Clear();
    Py_RETURN_NOTIMPLEMENTED;
}

/* ship(writer, rec, awaiting) -> True, False (ring full) or NotImplemented (ring.py's path writes it). */
static PyObject *Packer_ship(Packer *self, PyObject *const *args, Py_ssize_t nargs) {
    int awaiting;
    if (!callable_with(self, nargs, 3, "ship(writer, rec, awaiting)")) return NULL;
    if ((awaiting = PyObject_IsTrue(args[2])) < 0) {
        PyErr_Clear();
        Py_RETURN_NOTIMPLEMENTED;
    }
    return ship_impl(self, args[0], args[1], awaiting);
}

/* ---- Shipper: recorder.Recorder._ship of a ring whose writer has a packer, in C ------------------------------
 * Recorder.attach_ring makes two (submit: awaiting False, submit_first: True) when the writer has a packer
 * (RingWriter.native_shipper); they replace the functools.partial objects over Recorder._ship, the reference.
 * A call does what _ship does: when the recorder's ring is still this writer, the task through ship_impl;
 * True: next(recorder._submitted); then, not awaiting, the record reset and back into the pool when the pool
 * has room. Every other outcome goes to Python as _ship would take it: NotImplemented -> recorder._ship(
 * awaiting, rec, False) (the whole reference path, Packer.ship not tried again); False -> recorder._ring_drop(
 * writer) and the recycle; an Exception -> recorder.disable("ring write failed: <repr>"), _ring_drop, the
 * recycle; a BaseException that is not an Exception propagates, nothing recycled (as from _ship); a detached
 * or replaced ring -> recorder._ship(awaiting, rec).
 *
 * The reset (TaskRecord.reset, the reference) for records of the packer's record type: every field named in
 * ``fields`` takes the value of the same field of ``blank`` (a reset record), but a list field, which keeps its
 * identity and gets the blank's items (clear(), deps[:] = ...). A record whose list fields are not lists, or of
 * another type, has its own reset() called. tests/record/test_ringpack.py compares both over generated records. */

#define MAX_FIELDS 40

typedef struct {
    PyObject_HEAD
    Packer *packer;
    vectorcallfunc vectorcall;
    PyObject *writer, *recorder, *pool, *append, *submitted, *blank;
    Py_ssize_t capacity;
    int awaiting;
    int nfields;
    Py_ssize_t offset[MAX_FIELDS]; /* the fields' slot offsets in packer->rec_type */
    int is_list[MAX_FIELDS];       /* the blank's value is an exact list: reset in place */
} Shipper;

static int Shipper_traverse(Shipper *self, visitproc visit, void *arg) {
    Py_VISIT(self->packer);
    Py_VISIT(self->writer);
    Py_VISIT(self->recorder);
    Py_VISIT(self->pool);
    Py_VISIT(self->append);
    Py_VISIT(self->submitted);
    Py_VISIT(self->blank);
    return 0;
}

static int Shipper_clear(Shipper *self) {
    Py_CLEAR(self->packer);
    Py_CLEAR(self->writer);
    Py_CLEAR(self->recorder);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->append);
    Py_CLEAR(self->submitted);
    Py_CLEAR(self->blank);
    return 0;
}

static void Shipper_dealloc(Shipper *self) {
    PyObject_GC_UnTrack(self);
    Shipper_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject PackerType;

/* Shipper(packer, writer, recorder, awaiting, pool, capacity, submitted, fields, blank) */
static int Shipper_init(Shipper *self, PyObject *args, PyObject *Py_UNUSED(kwds)) {
    PyObject *packer, *writer, *recorder, *pool, *submitted, *fields, *blank, *append;
    Py_ssize_t capacity, i, n;
    int awaiting;
    if (self->recorder != NULL) { /* borrowed pointers of a ship in progress must not be swapped */
        PyErr_SetString(PyExc_TypeError, "Shipper already initialised");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!OOpOnOO!O", &PackerType, &packer, &writer, &recorder, &awaiting, &pool, &capacity,
                          &submitted, &PyTuple_Type, &fields, &blank))
        return -1;
    if (((Packer *)packer)->rec_type == NULL || Py_TYPE(blank) != ((Packer *)packer)->rec_type) {
        PyErr_SetString(PyExc_TypeError, "blank must be a record of the packer's record type");
        return -1;
    }
    if (!PyIter_Check(submitted)) {
        PyErr_SetString(PyExc_TypeError, "submitted must be an iterator");
        return -1;
    }
    n = PyTuple_GET_SIZE(fields);
    if (n > MAX_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "too many record fields");
        return -1;
    }
    for (i = 0; i < n; i++) { /* each field a plain object slot of the record type, set on the blank */
        PyObject *d = PyObject_GetAttr((PyObject *)((Packer *)packer)->rec_type, PyTuple_GET_ITEM(fields, i)), *v;
        PyMemberDef *m;
        if (d == NULL) return -1;
        m = Py_IS_TYPE(d, &PyMemberDescr_Type) ? ((PyMemberDescrObject *)d)->d_member : NULL;
        Py_DECREF(d);
        if (m == NULL || m->type != T_OBJECT_EX || (m->flags & READONLY) || m->offset <= 0 ||
            m->offset + (Py_ssize_t)sizeof(PyObject *) > ((Packer *)packer)->rec_type->tp_basicsize) {
            PyErr_SetString(PyExc_TypeError, "a record field is not a plain slot");
            return -1;
        }
        v = *(PyObject **)((char *)blank + m->offset);
        if (v == NULL) {
            PyErr_SetString(PyExc_ValueError, "a field of the blank record is unset");
            return -1;
        }
        self->offset[i] = m->offset;
        self->is_list[i] = PyList_CheckExact(v);
    }
    if ((append = PyObject_GetAttrString(pool, "append")) == NULL) return -1;
    self->nfields = (int)n;
    self->capacity = capacity;
    self->awaiting = awaiting;
    Py_XSETREF(self->append, append);
#define KEEP(member, value) do { Py_INCREF(value); Py_XSETREF(self->member, value); } while (0)
    KEEP(packer, (Packer *)packer);
    KEEP(writer, writer);
    KEEP(recorder, recorder);
    KEEP(pool, pool);
    KEEP(submitted, submitted);
    KEEP(blank, blank);
#undef KEEP
    return 0;
}

/* rec back to the blank state (TaskRecord.reset). */
static int reset_record(Shipper *self, PyObject *rec) {
    int i;
    PyObject *r;
    if (Py_TYPE(rec) == self->packer->rec_type) {
        for (i = 0; i < self->nfields; i++) { /* every list field checked before anything changes */
            PyObject *cur = *(PyObject **)((char *)rec + self->offset[i]);
            if (self->is_list[i] && (cur == NULL || !PyList_CheckExact(cur))) goto python;
        }
        for (i = 0; i < self->nfields; i++) {
            PyObject **slot = (PyObject **)((char *)rec + self->offset[i]);
            PyObject *want = *(PyObject **)((char *)self->blank + self->offset[i]);
            if (self->is_list[i]) {
                /* the blank's items into the record's own list (a list of ints or empty: no Python code) */
                if (PyList_SetSlice(*slot, 0, PY_SSIZE_T_MAX, want) < 0) return -1;
            } else if (*slot != want) {
                Py_INCREF(want);
                Py_XSETREF(*slot, want);
            }
        }
        return 0;
    }
python:
    r = PyObject_CallMethodNoArgs(rec, str_reset_name);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* _ship's recycle: reset and pooled when the pool has room (only when not awaiting). */
static int recycle(Shipper *self, PyObject *rec) {
    Py_ssize_t n;
    PyObject *r;
    if (self->awaiting) return 0;
    if ((n = PyObject_Size(self->pool)) < 0) return -1;
    if (n >= self->capacity) return 0;
    if (reset_record(self, rec) < 0) return -1;
    r = PyObject_CallOneArg(self->append, rec);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static PyObject *Shipper_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Shipper *self = (Shipper *)callable;
    PyObject *rec, *ring, *done, *r, *exc_type, *exc, *tb;
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "ship(record)");
        return NULL;
    }
    rec = args[0];
    if (self->recorder == NULL) { /* never initialised, or cleared by the GC */
        PyErr_SetString(PyExc_TypeError, "Shipper not initialised");
        return NULL;
    }
    if ((ring = PyObject_GetAttr(self->recorder, str_ring_name)) == NULL) return NULL;
    Py_DECREF(ring); /* only compared */
    if (ring != self->writer || !self->packer->have_view) /* detached or replaced meanwhile: _ship decides */
        return PyObject_CallMethodObjArgs(self->recorder, str_ship_name, self->awaiting ? Py_True : Py_False, rec, NULL);
    done = ship_impl(self->packer, self->writer, rec, self->awaiting);
    if (done == Py_True) {
        Py_DECREF(done);
        if ((r = PyIter_Next(self->submitted)) == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_StopIteration, "");
            return NULL;
        }
        Py_DECREF(r);
        if (recycle(self, rec) < 0) return NULL;
        Py_RETURN_NONE;
    }
    if (done == Py_NotImplemented) { /* the reference path, Packer.ship not tried again */
        Py_DECREF(done);
        return PyObject_CallMethodObjArgs(self->recorder, str_ship_name, self->awaiting ? Py_True : Py_False, rec,
                                          Py_False, NULL);
    }
    if (done == NULL) { /* _ship: except Exception -> disable, then as a drop */
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
        PyErr_Fetch(&exc_type, &exc, &tb);
        PyErr_NormalizeException(&exc_type, &exc, &tb);
        Py_XDECREF(exc_type);
        Py_XDECREF(tb);
        r = exc == NULL ? PyUnicode_FromString("ring write failed") : PyUnicode_FromFormat("ring write failed: %R", exc);
        Py_XDECREF(exc);
        if (r == NULL) return NULL;
        Py_SETREF(r, PyObject_CallMethodOneArg(self->recorder, str_disable_name, r));
        if (r == NULL) return NULL;
        Py_DECREF(r);
    } else {
        Py_DECREF(done); /* False: the ring was full */
    }
    if ((r = PyObject_CallMethodOneArg(self->recorder, str_drop_name, self->writer)) == NULL) return NULL;
    Py_DECREF(r);
    if (recycle(self, rec) < 0) return NULL;
    Py_RETURN_NONE;
}

/* reset(rec): the reset a recycled record gets (for the tests comparing it with TaskRecord.reset). */
static PyObject *Shipper_reset(Shipper *self, PyObject *rec) {
    if (self->packer == NULL) {
        PyErr_SetString(PyExc_TypeError, "Shipper not initialised");
        return NULL;
    }
    if (reset_record(self, rec) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Shipper_methods[] = {
    {"reset", (PyCFunction)Shipper_reset, METH_O, "reset(rec): the reset of a recycled record (TaskRecord.reset)"},
    {NULL, NULL, 0, NULL}};

static PyObject *Shipper_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Shipper *self = (Shipper *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) self->vectorcall = Shipper_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject ShipperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_kvtrace.record._ringpack.Shipper",
    .tp_basicsize = sizeof(Shipper),
    .tp_dealloc = (destructor)Shipper_dealloc,
    .tp_vectorcall_offset = offsetof(Shipper, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Shipper(packer, writer, recorder, awaiting, pool, capacity, submitted, fields, blank): "
              "Recorder._ship(awaiting, rec) of that writer's ring in C",
    .tp_methods = Shipper_methods,
    .tp_traverse = (traverseproc)Shipper_traverse,
    .tp_clear = (inquiry)Shipper_clear,
    .tp_init = (initproc)Shipper_init,
    .tp_new = Shipper_new,
};

/* ---- Releaser: recorder.Recorder.submit_consumer of a ring whose writer has a packer, in C -----------------------
 * Recorder.attach_ring installs one as the recorder's submit_consumer next to the Shipper pair (the forward's
 * release of a task the recv thread shipped with F_AWAITING: wrappers.wait_for_layer_load, release, and
 * release_recv when the forward released first). A call does what Recorder.submit_consumer does with a ring:
 * RingWriter.write_cwait(rec, reason, consumer_stages(rec.stages)) (the MSG_CWAIT body: the queue index from
 * writer._queues[id(rec.queue)], seq, reason, the consumer_wait triples, at most MAX_CWAIT_INTS ints; no slot
 * when the queue is unknown or the ring is full, as there), then _recycle_one (the Shipper's recycle: reset and
 * pooled when the pool has room). Every input that is not the common case (a queue table that is not a dict, an
 * entry that is not a tuple, a stage id that is not an exact int, a value out of its field's range, stages
 * that are not a list or tuple) calls ``fallback(rec, reason)`` (Recorder.submit_consumer itself, the
 * reference) BEFORE anything is claimed or changed, so the two cannot leave different rings or records. As
 * there: an Exception from the write -> recorder.disable("ring write failed: <repr>") and the recycle; a
 * BaseException that is not an Exception propagates, nothing recycled; a detached or replaced ring (or a
 * released packer) -> fallback. No Python code runs between reading the record and the commit.
 * tests/record/test_ringpack.py drives both over generated records on a small ring that fills. */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Shipper *shipper; /* the recorder's non-awaiting Shipper: packer, writer, recorder, pool, reset */
    PyObject *fallback;
} Releaser;

static int Releaser_traverse(Releaser *self, visitproc visit, void *arg) {
    Py_VISIT(self->shipper);
    Py_VISIT(self->fallback);
    return 0;
}

static int Releaser_clear(Releaser *self) {
    Py_CLEAR(self->shipper);
    Py_CLEAR(self->fallback);
    return 0;
}

static void Releaser_dealloc(Releaser *self) {
    PyObject_GC_UnTrack(self);
    Releaser_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Releaser(shipper, fallback): shipper a non-awaiting Shipper, fallback(rec, reason) the reference. */
static int Releaser_init(Releaser *self, PyObject *args, PyObject *Py_UNUSED(kwds)) {
    PyObject *shipper, *fallback;
    if (self->shipper != NULL) {
        PyErr_SetString(PyExc_TypeError, "Releaser already initialised");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!O", &ShipperType, &shipper, &fallback)) return -1;
    if (((Shipper *)shipper)->recorder == NULL || ((Shipper *)shipper)->awaiting) {
        PyErr_SetString(PyExc_TypeError, "shipper must be an initialised Shipper that recycles (awaiting False)");
        return -1;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be callable");
        return -1;
    }
    Py_INCREF(shipper);
    self->shipper = (Shipper *)shipper;
    Py_INCREF(fallback);
    self->fallback = fallback;
    return 0;
}

/* The MSG_CWAIT body of rec into body (*length set, *known 1), or *known 0 when writer._queues has no entry for
 * id(rec.queue) (write_cwait writes nothing). Returns 1, or 0 when an input is not the common case (no
 * exception left: the reference runs and raises or writes what it does), or -1 with an exception that is not
 * an Exception (propagates, as from the reference). In submit_consumer's order: the stages are walked
 * (consumer_stages compares every stage id) before the queue is looked up. */
static int cwait_body(Packer *self, PyObject *writer, PyObject *rec, long long reason, unsigned char *body,
                      size_t *length, int *known) {
    PyObject *queue = NULL, *table = NULL, *key = NULL, *entry, *stages = NULL, *o;
    long long qidx, seq, v;
    Py_ssize_t n, i, ints = 0;
    uint32_t q32;
    int64_t s64;
    uint16_t n16;
    int ok = 0;

    *known = 0;
    if ((stages = get(self, rec, A_STAGES)) == NULL) goto out;
    if (!PyList_CheckExact(stages) && !PyTuple_CheckExact(stages)) goto out;
    n = PySequence_Fast_GET_SIZE(stages);
    /* consumer_stages: every triple whose stage id equals CONSUMER_WAIT, in order (range(0, len - 2, 3)); the
     * first MAX_CWAIT_INTS ints of them are sent (write_cwait's cut). Only exact ints are compared here (==
     * of another type is Python's to run); the start and end of a triple past the cut are not packed, so
     * not checked (write_cwait does not pack them either). */
    for (i = 0; i + 2 < n; i += 3) {
        o = PySequence_Fast_GET_ITEM(stages, i);
        if (!PyLong_CheckExact(o)) goto out;
        if (!as_int(o, I64_MIN, I64_MAX, &v)) continue; /* past int64: not CONSUMER_WAIT */
        if (v != CONSUMER_WAIT || ints >= MAX_CWAIT_INTS) continue;
        s64 = CONSUMER_WAIT;
        memcpy(body + CWAIT_FIXED + 8 * ints, &s64, 8);
        if (!as_int(PySequence_Fast_GET_ITEM(stages, i + 1), I64_MIN, I64_MAX, &v)) goto out;
        s64 = v;
        memcpy(body + CWAIT_FIXED + 8 * (ints + 1), &s64, 8);
        if (!as_int(PySequence_Fast_GET_ITEM(stages, i + 2), I64_MIN, I64_MAX, &v)) goto out;
        s64 = v;
        memcpy(body + CWAIT_FIXED + 8 * (ints + 2), &s64, 8);
        ints += 3;
    }
    /* write_cwait: entry = writer._queues.get(id(rec.queue)) */
    if ((queue = get(self, rec, A_QUEUE)) == NULL) goto out;
    if ((table = PyObject_GetAttr(writer, str_queues_name)) == NULL || !PyDict_CheckExact(table)) goto out;
    if ((key = PyLong_FromVoidPtr(queue)) == NULL) goto out;
    entry = PyDict_GetItemWithError(table, key); /* borrowed; an int key runs no Python code */
    if (entry == NULL) {
        ok = !PyErr_Occurred(); /* unknown queue: nothing written */
        goto out;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) < 2 || !as_int(PyTuple_GET_ITEM(entry, 1), 0, UINT32_MAX, &qidx))
        goto out;
    if (field(self, rec, A_SEQ, I64_MIN, I64_MAX, &seq) <= 0) goto out;
    /* CWAIT_FIXED "<IqBH": little-endian, no padding (x86-64 and aarch64 are little-endian, as ring.py asserts) */
    q32 = (uint32_t)qidx;
    s64 = seq;
    n16 = (uint16_t)ints;
    memcpy(body, &q32, 4);
    memcpy(body + 4, &s64, 8);
    body[12] = (unsigned char)reason;
    memcpy(body + 13, &n16, 2);
    *length = CWAIT_FIXED + 8 * (size_t)ints;
    *known = 1;
    ok = 1;
out:
    Py_XDECREF(queue);
    Py_XDECREF(table);
    Py_XDECREF(key);
    Py_XDECREF(stages);
    if (ok) return 1;
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
        PyErr_Clear(); /* the reference meets it again and raises it (then: tracing disabled) */
    }
    return 0;
}

static PyObject *Releaser_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Releaser *self = (Releaser *)callable;
    Shipper *sh = self->shipper;
    PyObject *rec, *ring, *done, *r, *exc_type, *exc, *tb;
    unsigned char body[CWAIT_FIXED + 8 * MAX_CWAIT_INTS];
    size_t length = 0;
    long long reason;
    int known, c;
    if (PyVectorcall_NARGS(nargsf) != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "submit_consumer(record, reason)");
        return NULL;
    }
    if (sh == NULL || self->fallback == NULL || sh->recorder == NULL || sh->packer == NULL || sh->writer == NULL) {
        /* never initialised, or cleared by the GC (this object or its shipper) */
        PyErr_SetString(PyExc_TypeError, "Releaser not initialised");
        return NULL;
    }
    rec = args[0];
    if ((ring = PyObject_GetAttr(sh->recorder, str_ring_name)) == NULL) return NULL;
    Py_DECREF(ring); /* only compared */
    if (ring != sh->writer || !sh->packer->have_view || !as_int(args[1], 0, 255, &reason))
        return PyObject_Vectorcall(self->fallback, args, 2, NULL); /* the reference decides */
    c = cwait_body(sh->packer, sh->writer, rec, reason, body, &length, &known);
    if (c < 0) return NULL;
    if (c == 0) return PyObject_Vectorcall(self->fallback, args, 2, NULL);
    if (known) {
        done = put_slot(sh->packer, sh->writer, body, length, CWAIT_KIND);
        if (done == Py_NotImplemented) { /* nothing claimed: the reference writes it */
            Py_DECREF(done);
            return PyObject_Vectorcall(self->fallback, args, 2, NULL);
        }
        if (done == NULL) { /* submit_consumer: except Exception -> disable, then the recycle */
            if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
            PyErr_Fetch(&exc_type, &exc, &tb);
            PyErr_NormalizeException(&exc_type, &exc, &tb);
            Py_XDECREF(exc_type);
            Py_XDECREF(tb);
            r = exc == NULL ? PyUnicode_FromString("ring write failed") : PyUnicode_FromFormat("ring write failed: %R", exc);
            Py_XDECREF(exc);
            if (r == NULL) return NULL;
            Py_SETREF(r, PyObject_CallMethodOneArg(sh->recorder, str_disable_name, r));
            if (r == NULL) return NULL;
            Py_DECREF(r);
        } else {
            Py_DECREF(done); /* True, or False: the ring was full (not counted, as in write_cwait) */
        }
    }
    if (recycle(sh, rec) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Releaser_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Releaser *self = (Releaser *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) self->vectorcall = Releaser_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject ReleaserType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_kvtrace.record._ringpack.Releaser",
    .tp_basicsize = sizeof(Releaser),
    .tp_dealloc = (destructor)Releaser_dealloc,
    .tp_vectorcall_offset = offsetof(Releaser, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Releaser(shipper, fallback): Recorder.submit_consumer(rec, reason) of the shipper's ring in C",
    .tp_traverse = (traverseproc)Releaser_traverse,
    .tp_clear = (inquiry)Releaser_clear,
    .tp_init = (initproc)Releaser_init,
    .tp_new = Releaser_new,
};

/* remember_queue(queue, qidx): the queue ring.py just resolved (RingWriter._queues keeps it for good). */
static PyObject *Packer_remember_queue(Packer *self, PyObject *const *args, Py_ssize_t nargs) {
    long long qidx;
    if (nargs != 2 || !as_int(args[1], 0, UINT32_MAX, &qidx)) {
        PyErr_SetString(PyExc_TypeError, "remember_queue(queue, qidx) with 0 <= qidx < 2**32");
        return NULL;
    }
    Py_INCREF(args[0]);
    Py_XSETREF(self->queue, args[0]);
    self->qidx = qidx;
    Py_RETURN_NONE;
}

static PyObject *Packer_release(Packer *self, PyObject *Py_UNUSED(unused)) {
    packer_release_view(self);
    Py_RETURN_NONE;
}

static PyMethodDef Packer_methods[] = {
    {"write", (PyCFunction)(void (*)(void))Packer_write, METH_FASTCALL,
     "write(writer, rec, qidx, sidx, awaiting): True, False (ring full) or NotImplemented (use Python)"},
    {"ship", (PyCFunction)(void (*)(void))Packer_ship, METH_FASTCALL,
     "ship(writer, rec, awaiting): write_task's common case in C: True, False (ring full) or NotImplemented"},
    {"remember_queue", (PyCFunction)(void (*)(void))Packer_remember_queue, METH_FASTCALL,
     "remember_queue(queue, qidx): the queue index ship() uses for records of that queue"},
    {"release", (PyCFunction)Packer_release, METH_NOARGS, "drop the ring mapping's buffer"},
    {NULL, NULL, 0, NULL}};

static PyMemberDef Packer_members[] = {
    {"record_type", T_OBJECT, offsetof(Packer, rec_type), READONLY, "the type read by slot offsets, or None"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject PackerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_kvtrace.record._ringpack.Packer",
    .tp_basicsize = sizeof(Packer),
    .tp_dealloc = (destructor)Packer_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Packer(mem, nslots, limit, crc, claims, fold_stages, record_type): the task slot writer of one ring",
    .tp_methods = Packer_methods,
    .tp_members = Packer_members,
    .tp_init = (initproc)Packer_init,
    .tp_new = PyType_GenericNew,
};

/* LAYOUT: every constant this file copies from ring.py, and each TASK_FIXED field's (name, offset, size)
 * as this compiler laid out struct task_fixed; ring._load_native compares it all with ring.py's. */
#define MEMBER(name) {#name, offsetof(struct task_fixed, name), sizeof(((struct task_fixed *)0)->name)}
static const struct { const char *name; size_t offset, size; } task_members[] = {
    MEMBER(qidx), MEMBER(kind), MEMBER(final_layer), MEMBER(outcome), MEMBER(flags), MEMBER(seq),
    MEMBER(step), MEMBER(layer_id), MEMBER(src), MEMBER(gate), MEMBER(qdepth), MEMBER(inflight),
    MEMBER(t_enqueue), MEMBER(t_dequeue), MEMBER(t_backend_return), MEMBER(t_complete), MEMBER(nbytes),
    MEMBER(backend_result), MEMBER(has_dep), MEMBER(deps), MEMBER(summary), MEMBER(n_stage_ints)};
#undef MEMBER

static PyObject *layout_dict(void) {
    PyObject *fields = PyList_New(0), *d = NULL;
    size_t i;
    int j;
    if (fields == NULL) return NULL;
    for (i = 0; i < sizeof task_members / sizeof task_members[0]; i++) {
        int deps = strcmp(task_members[i].name, "deps") == 0;
        for (j = 0; j < (deps ? NUM_DEP_INTS : 1); j++) { /* deps: dep0..dep9, as ring.TASK_FIELDS names them */
            PyObject *t = deps ? Py_BuildValue("(Nnn)", PyUnicode_FromFormat("dep%d", j),
                                              (Py_ssize_t)(task_members[i].offset + 8 * j), (Py_ssize_t)8)
                               : Py_BuildValue("(snn)", task_members[i].name, (Py_ssize_t)task_members[i].offset,
                                              (Py_ssize_t)task_members[i].size);
            if (t == NULL || PyList_Append(fields, t) < 0) {
                Py_XDECREF(t);
                Py_DECREF(fields);
                return NULL;
            }
            Py_DECREF(t);
        }
    }
    d = Py_BuildValue(
        "{s:i,s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:s,s:i,s:i,s:N}", "VERSION",
        RING_VERSION,
        "TASK_FORMAT", TASK_FORMAT, "HEADER_BYTES", HEADER_BYTES, "SLOT_SIZE", SLOT_SIZE, "SLOT_HEAD", SLOT_HEAD,
        "H_HEAD", H_HEAD, "H_READ", H_READ, "MAX_STAGE_INTS", MAX_STAGE_INTS, "NUM_DEP_INTS", NUM_DEP_INTS,
        "TASK_KIND", TASK_KIND, "VOID_KIND", VOID_KIND, "F_SRC", F_SRC, "F_GATE", F_GATE, "F_AWAITING",
        F_AWAITING, "F_STAGES_FOLDED", F_STAGES_FOLDED, "FIXED_SIZE", (int)FIXED_SIZE, "STAGES_AT", STAGES_AT,
        "CWAIT_KIND", CWAIT_KIND, "CWAIT_FORMAT", CWAIT_FORMAT, "MAX_CWAIT_INTS", MAX_CWAIT_INTS, "CONSUMER_WAIT",
        CONSUMER_WAIT, "TASK_FIELDS", PyList_AsTuple(fields));
    Py_DECREF(fields);
    return d;
}

static struct PyModuleDef ringpack_module = {
    PyModuleDef_HEAD_INIT, "_ringpack", "Native task-slot writer of otel_kvtrace.record.ring", -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ringpack(void) {
    PyObject *m;
    uint32_t i, c;
    int j;
    for (i = 0; i < 256; i++) {
        c = i;
        for (j = 0; j < 8; j++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
    for (j = 0; j < N_ATTRS; j++)
        if ((attrs[j] = PyUnicode_InternFromString(attr_names[j])) == NULL) return NULL;
    if ((str_head = PyUnicode_InternFromString("_head")) == NULL ||
        (str_ring_name = PyUnicode_InternFromString("ring")) == NULL ||
        (str_ship_name = PyUnicode_InternFromString("_ship")) == NULL ||
        (str_drop_name = PyUnicode_InternFromString("_ring_drop")) == NULL ||
        (str_disable_name = PyUnicode_InternFromString("disable")) == NULL ||
        (str_reset_name = PyUnicode_InternFromString("reset")) == NULL ||
        (str_queues_name = PyUnicode_InternFromString("_queues")) == NULL)
        return NULL;
    for (j = 0; j < N_SHIP_NAMES; j++)
        if ((names[j] = PyUnicode_InternFromString(ship_names[j])) == NULL) return NULL;
    if (PyType_Ready(&PackerType) < 0 || PyType_Ready(&ShipperType) < 0 || PyType_Ready(&ReleaserType) < 0)
        return NULL;
    m = PyModule_Create(&ringpack_module);
    if (m == NULL) return NULL;
    Py_INCREF(&PackerType);
    Py_INCREF(&ShipperType);
    Py_INCREF(&ReleaserType);
    if (PyModule_AddObject(m, "Packer", (PyObject *)&PackerType) < 0 ||
        PyModule_AddObject(m, "Shipper", (PyObject *)&ShipperType) < 0 ||
        PyModule_AddObject(m, "Releaser", (PyObject *)&ReleaserType) < 0 ||
        PyModule_AddIntConstant(m, "STAGES_AT", STAGES_AT) < 0 ||
        PyModule_AddIntConstant(m, "FIXED_SIZE", (long)FIXED_SIZE) < 0 ||
        PyModule_AddObject(m, "LAYOUT", layout_dict()) < 0) {
        Py_DECREF(&PackerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
