"""The shared-memory ring between a serving process (producer) and its exporter agent (consumer).

Perfetto's producer/service split (https://perfetto.dev/docs/concepts/buffers): the serving process
only stamps and copies one fixed-size binary message per task into a bounded ring; the agent process
(``otel_kvtrace.export.agent``) decodes, builds spans and ships them. The memory is a ``memfd`` (no
name in ``/dev/shm``, nothing to leak when either side is killed) passed to the agent by file descriptor.

Layout (little-endian but for the native ``MSG_TASK`` and int64 tails; ``docs/export.md`` has the same table)::

    header  HEADER_BYTES = 128: 16 signed 64-bit words, index H_*
            H_MAGIC, H_VERSION, H_NSLOTS, H_SLOT_SIZE,
            H_HEAD      claims made by the producer (hint; the slot commit words are authoritative)
            H_READ      slots consumed (decoded and exported) by the agent
            H_DROPPED   tasks the producer dropped because the ring was full (agent dead or slow): the
                        recorder's exact count, published by ``publish_dropped``
            H_PRODUCER_PID, H_AGENT_PID, H_EXPORTED (tasks the agent handed to its sink),
            H_AGENT_LOST (tasks the agent lost: sink failure, torn slot of a killed producer),
            H_SINK_STATS (1 once the agent's sink reports where its tasks are), H_SINK_DELIVERED,
            H_SINK_SPOOLED, H_SINK_DROPPED (the delivering sink's counts, so the serving process's
            ``stats()`` keeps ``recorded == delivered + spooled + dropped + pending``),
            H_COMMIT_MODE (COMMIT_CRC or COMMIT_STORE_ORDER, chosen by the producer's CPU)
    slot i  at HEADER_BYTES + (i % nslots) * slot_size:
            commit  q   i + 1 once the slot's message is complete: stored last, in its own ``pack_into``
                        after the tail and the body (``struct`` zeroes a field group before filling it in
                        format order, so a commit word packed with the tail would become visible first)
            crc     I   COMMIT_CRC: zlib.crc32 of the body seeded with i, xor (kind << 16 | length) (a torn
                        or reordered write, a tail seen before its body, or a previous lap's body, kind or
                        crc seen with this lap's commit word, is never decoded: the crc, not the store
                        order, makes a slot complete); COMMIT_STORE_ORDER (x86-64): 0
            kind    H   MSG_* | KIND_WRITTEN (a zero slot, or a tail not yet stored, is never complete)
            length  H   body bytes
            body        kind-specific, below

Messages (body ``struct`` formats):

- ``MSG_QUEUE``  ``<IqiiiiiiHHH`` + 3 utf-8 strings: queue index, pid, dp, pp, tp, pcp, dcp, num_layers,
  lengths of run_id, path, thread_name. Sent once per queue, before its first task.
- ``MSG_REQ``    ``<IH`` + utf-8: one request id string and its index (the side table of variable ids:
  a task carries only ``u32`` indices). Sent once per distinct id.
- ``MSG_SUMMARY`` ``SUMMARY_FIXED`` + group ids ``n`` + request-id indices ``I``: one transfer-task summary
  (block count, groups, requests), sent once per distinct summary, after the request ids it names.
- ``MSG_TASK``   ``TASK_FIXED`` (native) then at ``TASK_STAGES_AT`` ``n_stage_ints`` ``n``: one task; its
  transfer tasks are one summary index (``NO_SUMMARY``: none). One ``pack_into`` (``TASK_LAYOUTS``).
- ``MSG_CWAIT``  ``<IqBH`` + ``n``s: the forward's consumer wait of a task sent earlier with
  ``F_AWAITING`` (or why it is absent: ``REASON_*``).
- ``MSG_ERROR``  ``<IqHHH`` + 3 utf-8 strings: the exception of a failed task (sent just before it).
- ``MSG_RESOURCE`` ``marshal`` of one ``(key, value)`` resource attribute.
- ``MSG_CLOSE``  empty: the producer shut down cleanly.
- ``MSG_VOID``   empty: a claimed slot whose write failed (an instrumentation bug; tracing is disabled).

Concurrency: several recording threads of one process write; a claim is ``next()`` on an
``itertools.count`` (atomic under the GIL), so no lock is taken. The room check reads the agent's
``H_READ`` and keeps ``CLAIM_MARGIN`` slots spare for threads racing between check and claim. When full
the message is dropped; a dropped task is counted by the recorder (an ``itertools.count``, exact) and
published into ``H_DROPPED``; the producer never waits.
"""

from __future__ import annotations

import dataclasses
import itertools
import marshal
import mmap
import os
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from otel_kvtrace.instrument.stream_order import StreamPosition, tighten_bounds
from otel_kvtrace.record.model import CONSUMER_RELEASE_NAMES, Stage, TaskRecord

MAGIC = 0x4B56545249524E47  # "KVTRIRNG"
VERSION = 3  # 3: commit word stored last and alone, KIND_WRITTEN, crc mixes kind and length
HEADER_BYTES = 128
SLOT_SIZE = 1024
SLOT_HEAD = struct.Struct("<qIHH")  # commit, then the tail: crc, kind, length
_COMMIT = struct.Struct("<q")  # stored alone and last: publishes the slot
_TAIL = struct.Struct("<IHH")  # at slot + _COMMIT.size
KIND_WRITTEN = 0x8000  # set in every stored kind word: a zeroed (never written) tail is never read as MSG_VOID
BODY_BYTES = SLOT_SIZE - SLOT_HEAD.size
DEFAULT_SLOTS = 8192  # 8 MiB per serving process
CLAIM_MARGIN = 64

(H_MAGIC, H_VERSION, H_NSLOTS, H_SLOT_SIZE, H_HEAD, H_READ, H_DROPPED, H_PRODUCER_PID, H_AGENT_PID,
 H_EXPORTED, H_AGENT_LOST, H_SINK_STATS, H_SINK_DELIVERED, H_SINK_SPOOLED, H_SINK_DROPPED, H_COMMIT_MODE) = range(16)

COMMIT_CRC = 0
"""Commit mode for CPUs that may make stores visible out of order (aarch64, the Kunpeng hosts of Ascend
NPUs): the slot head carries a crc32 of the body seeded with the slot's sequence number."""
COMMIT_STORE_ORDER = 1
"""Commit mode for x86-64 (total store order): stores become visible to the agent in program order, so
the commit word written after the body publishes a complete body; no crc is computed or checked."""


def default_commit_mode() -> int:
    """``OTEL_KVTRACE_RING_COMMIT`` (``crc``/``order``), else (``auto``) ``COMMIT_STORE_ORDER`` on x86-64 and
    ``COMMIT_CRC`` elsewhere (no memory barrier is reachable from Python)."""
    import platform

    from otel_kvtrace.config import ring_commit

    mode = ring_commit()
    if mode != "auto":
        return COMMIT_CRC if mode == "crc" else COMMIT_STORE_ORDER
    return COMMIT_STORE_ORDER if platform.machine().lower() in ("x86_64", "amd64") else COMMIT_CRC

MSG_VOID, MSG_QUEUE, MSG_REQ, MSG_TASK, MSG_CWAIT, MSG_ERROR, MSG_RESOURCE, MSG_CLOSE, MSG_SUMMARY = range(9)
_TASK_KIND = MSG_TASK | KIND_WRITTEN

# TASK_FIXED fields, in order; the task's stage ints (``n_stage_ints`` int64) follow.
TASK_FIELDS = (
    "qidx", "kind", "final_layer", "outcome", "flags", "seq", "step", "layer_id", "src", "gate",
    "qdepth", "inflight", "t_enqueue", "t_dequeue", "t_backend_return", "t_complete", "nbytes",
    "backend_result", "has_dep", *(f"dep{i}" for i in range(10)), "summary", "n_stage_ints",
)
# Native byte order, sizes and alignment (the agent maps the ring on the same host): ``n`` (ssize_t, 8
# bytes on every 64-bit Linux) packs a multi-digit Python int through ``PyLong_AsSsize_t``; the standard
# ``<q`` goes through ``_PyLong_AsByteArray``, ~5k more instructions per task for its ~45 ns stamps.
TASK_FIXED = struct.Struct("@IBBBBnniiniinnnnnnI10nIH")
F_SRC, F_GATE, F_AWAITING, F_STAGES_FOLDED, F_REQS_TRUNCATED = 1, 2, 4, 8, 16
MAX_STAGE_INTS = 3 * 22
MAX_GROUPS = 16
MAX_REQS = 32
SUMMARY_GENERATION = 65536  # summaries defined before cached ones are defined again (the agent keeps 2x)
NO_SUMMARY = 0xFFFFFFFF  # a task without transfer tasks: no group, no request, 0 blocks
# MSG_SUMMARY: index, block count, n_groups, n_reqs, flags (F_REQS_TRUNCATED); then the group ids (int64)
# and the request-id indices (u32 of MSG_REQ).
SUMMARY_FIXED = struct.Struct("<IIBBB")
CWAIT_FIXED = struct.Struct("<IqBH")
MAX_CWAIT_INTS = 3 * 8
QUEUE_FIXED = struct.Struct("<IqiiiiiiHHH")
REQ_FIXED = struct.Struct("<IH")
ERROR_FIXED = struct.Struct("<IqHHH")

REASON_WAITED = 0
REASON_STEP_BOUNDARY = 1  # released at the next start_load_kv: the forward never waited for it
REASON_SHUTDOWN = 2  # released when tracing shut down (or the process exited normally)
REASON_PRODUCER_DIED = 3  # the serving process died before releasing it (agent side)
REASON_AGENT_BOUND = 4  # the agent held MAX_AWAITING tasks awaiting their consumer wait: the oldest went without it
assert CONSUMER_RELEASE_NAMES[REASON_PRODUCER_DIED] == "producer_died"
assert CONSUMER_RELEASE_NAMES[REASON_AGENT_BOUND] == "agent_bound"

_INTS = [struct.Struct(f"@{n}n") for n in range(MAX_STAGE_INTS + 1)]
_U32S = [struct.Struct(f"<{n}I") for n in range(MAX_REQS + 1)]
# The task layout by stage count: one precompiled ``Struct`` per count, one ``pack_into`` per task.
TASK_LAYOUTS = [struct.Struct(f"{TASK_FIXED.format}{n}n") for n in range(MAX_STAGE_INTS + 1)]
# COMMIT_STORE_ORDER: the slot tail (crc 0, kind, length) and the task in one ``pack_into`` at slot + 8; the
# tail is 8 bytes, so every native field keeps its offset from the body (alignment is from the struct start).
TASK_TAILED = [struct.Struct(f"@IHH{layout.format[1:]}") for layout in TASK_LAYOUTS]
assert all(t.size == _TAIL.size + x.size for t, x in zip(TASK_TAILED, TASK_LAYOUTS))
assert struct.pack("@IHH", 1, 2, 3) == _TAIL.pack(1, 2, 3)  # little-endian hosts only (x86-64, aarch64)
assert struct.calcsize("@n") == 8
TASK_STAGES_AT = TASK_LAYOUTS[1].size - 8  # where the stage ints start (after TASK_FIXED's alignment padding)
assert TASK_LAYOUTS[-1].size <= BODY_BYTES
assert SUMMARY_FIXED.size + 8 * MAX_GROUPS + 4 * MAX_REQS <= BODY_BYTES


def slot_crc(body: Any, k: int, kind: int, length: int) -> int:
    """``COMMIT_CRC``'s check word of slot ``k`` (``kind`` with ``KIND_WRITTEN``): seeded with ``k`` so no
    previous lap matches; kind and length mixed in so no stale tail matches. (``write_task`` inlines it.)"""
    return zlib.crc32(body, k & 0xFFFFFFFF) ^ (kind << 16 | length)


def native_layout() -> dict[str, Any]:
    """What ``_ringpack.c`` must have copied from this module, in the form of its ``LAYOUT``: the constants,
    and each ``TASK_FIXED`` field's ``(name, offset, size)`` in ``TASK_FIELDS`` order (from the format)."""
    fields = []
    prefix = TASK_FIXED.format[0]
    for count, code in re.findall(r"(\d*)([a-zA-Z?])", TASK_FIXED.format[1:]):
        for _ in range(int(count or 1)):
            size = struct.calcsize(prefix[0] + code)
            fields.append((struct.calcsize(prefix + code) - size, size))  # aligned offset, as calcsize pads
            prefix += code
    assert len(fields) == len(TASK_FIELDS)
    return {
        "VERSION": VERSION, "TASK_FORMAT": TASK_FIXED.format, "HEADER_BYTES": HEADER_BYTES, "SLOT_SIZE": SLOT_SIZE,
        "SLOT_HEAD": SLOT_HEAD.size, "H_HEAD": H_HEAD, "H_READ": H_READ, "MAX_STAGE_INTS": MAX_STAGE_INTS,
        "NUM_DEP_INTS": sum(name.startswith("dep") for name in TASK_FIELDS), "TASK_KIND": _TASK_KIND,
        "VOID_KIND": MSG_VOID | KIND_WRITTEN, "F_SRC": F_SRC, "F_GATE": F_GATE, "F_AWAITING": F_AWAITING,
        "F_STAGES_FOLDED": F_STAGES_FOLDED, "FIXED_SIZE": TASK_FIXED.size, "STAGES_AT": TASK_STAGES_AT,
        "CWAIT_KIND": MSG_CWAIT | KIND_WRITTEN, "CWAIT_FORMAT": CWAIT_FIXED.format, "MAX_CWAIT_INTS": MAX_CWAIT_INTS,
        "CONSUMER_WAIT": int(Stage.CONSUMER_WAIT),
        "TASK_FIELDS": tuple((name, off, size) for name, (off, size) in zip(TASK_FIELDS, fields)),
    }


def layout_mismatch(layout: Any) -> str:
    """``""`` when a built ``_ringpack.LAYOUT`` equals ``native_layout()``, else the first difference."""
    if not isinstance(layout, dict):
        return "no LAYOUT (built before it was exported)"
    expected = native_layout()
    for key in sorted(expected.keys() | layout.keys()):
        if layout.get(key) != expected.get(key):
            return f"{key} is {layout.get(key)!r} in the build, {expected.get(key)!r} in ring.py"
    return ""


def _load_native() -> tuple[Any, str]:
    """The C task packer (``_ringpack.c``) if it was built and matches this layout: ``(module, why not)``.
    Every constant the C code copies is compared (``layout_mismatch``): the in-place ``.so`` is not rebuilt
    by a ``git pull``, and a stale one must not write another layout."""
    try:
        from otel_kvtrace.record import _ringpack
    except ImportError as exc:
        return None, f"not built ({exc.msg})"
    why = layout_mismatch(getattr(_ringpack, "LAYOUT", None))
    if why:
        return None, f"stale build ({why}; rebuild: pip install -e .)"
    return _ringpack, ""


_NATIVE, _NATIVE_MISSING = _load_native()
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(TaskRecord))  # what the native shipper resets
_NATIVE_FAILED = ""  # why constructing a Packer failed in this process (then every writer uses Python)
_WARNED: set[str] = set()  # reasons logged already: one line each per process


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        import logging

        logging.getLogger("otel_kvtrace").warning("otel-kvtrace: %s", message)


def pack_mode(environ: Any = None) -> tuple[str, str]:
    """Which task packer a new ``RingWriter`` uses: ``("native", "")``, or ``("python", why)``.

    ``OTEL_KVTRACE_RING_PACK``: ``auto`` (default: native when the extension imports), ``python`` (the
    reference path, forced), ``native`` (as ``auto``, but logs a warning, once, when the extension is
    missing). A stale build, or a ``Packer`` that could not be constructed in this process, is logged once
    (``auto`` too) and reported here as the reason."""
    from otel_kvtrace.config import OTEL_KVTRACE_RING_PACK

    env = os.environ if environ is None else environ
    want = env.get(OTEL_KVTRACE_RING_PACK, "").strip().lower() or "auto"
    if want == "python":
        return "python", f"{OTEL_KVTRACE_RING_PACK}=python"
    if want not in ("auto", "native"):
        _warn_once(f"{OTEL_KVTRACE_RING_PACK}={want!r} is not supported (use auto, native or python); using auto")
    if _NATIVE is None:
        why = f"native packer {_NATIVE_MISSING}"
        if want == "native" or _NATIVE_MISSING.startswith("stale"):
            _warn_once(f"{OTEL_KVTRACE_RING_PACK}={want}: {why}; using the Python packer")
        return "python", why
    if _NATIVE_FAILED:
        return "python", f"native packer failed: {_NATIVE_FAILED}"
    return "native", ""


def ring_bytes(nslots: int) -> int:
    return HEADER_BYTES + nslots * SLOT_SIZE


def create_memfd(nslots: int, commit_mode: int | None = None) -> tuple[int, mmap.mmap]:
    """A fresh ring in an anonymous memfd: ``(fd, mapping)``; the fd is what the agent maps.
    ``commit_mode``: ``COMMIT_CRC`` or ``COMMIT_STORE_ORDER`` (default: ``default_commit_mode()``)."""
    fd = os.memfd_create("kvtrace-ring", 0)  # type: ignore[attr-defined]  # Linux only; callers check
    os.ftruncate(fd, ring_bytes(nslots))
    # Pre-faulted: otherwise the first write into each 4 KiB page takes a page fault on a recording thread.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mem = mmap.mmap(fd, ring_bytes(nslots), flags=flags)
    hdr = memoryview(mem)[:HEADER_BYTES].cast("q")
    hdr[H_MAGIC], hdr[H_VERSION], hdr[H_NSLOTS], hdr[H_SLOT_SIZE] = MAGIC, VERSION, nslots, SLOT_SIZE
    hdr[H_PRODUCER_PID] = os.getpid()
    hdr[H_COMMIT_MODE] = default_commit_mode() if commit_mode is None else commit_mode
    hdr.release()
    return fd, mem


def _utf8(text: str, limit: int) -> bytes:
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return raw
    return raw[:limit].decode("utf-8", "ignore").encode()


def _native_packer(mem: Any, nslots: int, limit: int, crc: bool, claims: Any) -> Any:
    """A ``_ringpack.Packer`` over ``mem``, or None when it cannot be made (then logged once, reported by
    ``pack_mode``, and this process uses the Python packer): tracing start never fails for the accelerator."""
    global _NATIVE_FAILED
    try:
        return _NATIVE.Packer(mem, nslots, limit, crc, claims, fold_stages, TaskRecord, StreamPosition)
    except Exception as exc:  # noqa: BLE001 - ValueError, BufferError, MemoryError: the Python path works
        _NATIVE_FAILED = f"{type(exc).__name__}: {exc}"
        _warn_once(f"native ring packer failed ({_NATIVE_FAILED}); using the Python packer")
        return None


class RingWriter:
    """Producer side: one per serving process (per fork). Every method is safe on a host thread."""

    def __init__(self, mem: mmap.mmap) -> None:
        self._mem = mem
        self._buf = memoryview(mem)
        self.hdr = self._buf[:HEADER_BYTES].cast("q")
        self.nslots = self.hdr[H_NSLOTS]
        self._crc = self.hdr[H_COMMIT_MODE] == COMMIT_CRC
        self._limit = self.nslots - CLAIM_MARGIN
        self._claims = itertools.count()
        self._head = 0
        self._queues: dict[int, tuple[Any, int]] = {}
        self._req_ids: dict[str, int] = {}
        self._next_req = itertools.count()
        self._next_queue = itertools.count()
        self._req_generation = 0
        self._next_summary = itertools.count()
        # Per task kind (recv, send), each one tuple swapped in one store (a racing thread reads a
        # consistent one): the identity key of the last shared transfer data and its summary index
        # (``write_task``), and the last summary by value (``_summary_index``).
        self._hits: list[tuple[Any, ...] | None] = [None, None]
        self._last: list[tuple[Any, ...] | None] = [None, None]
        # Device-timing marks (``OTEL_KVTRACE_NPU_TIMING``) are resolved by this callable (the recorder's
        # ``npu_resolver``) before the task is written; stream-order bounds need no callback.
        self.resolver: Any = None
        self.overflow_logged = False
        # the one summary rule, bound here: ``export.spans`` imports ``record.recorder``, which imports this
        # module, so it cannot be imported at the top; an import statement per call cost ~3 µs in context on
        # every step's first task, a recv thread's
        from otel_kvtrace.export.spans import summarize_transfer_tasks

        self._summarize = summarize_transfer_tasks
        # The C task packer (``_ringpack.c``, same bytes; ``pack_mode``), or None: the Python path below.
        self._packer: Any = None
        if pack_mode()[0] == "native":
            self._packer = _native_packer(mem, self.nslots, self._limit, self._crc, self._claims)

    # -- slots ------------------------------------------------------------------------------------
    def _claim(self) -> int:
        """A slot index, or -1 when the ring is full (counted). Lock-free."""
        hdr = self.hdr
        if self._head - hdr[H_READ] >= self._limit:
            return -1  # the task it belonged to is counted by the recorder (``publish_dropped``)
        k = next(self._claims)
        try:
            self._head = k + 1
            if k >= hdr[H_HEAD]:
                hdr[H_HEAD] = k + 1
        except BaseException:
            self._commit(k, MSG_VOID, 0)  # claimed, not written: committed void, as write_task does
            raise
        return k

    def _commit(self, k: int, kind: int, length: int) -> None:
        """The tail after the body, then the commit word alone: it publishes the slot."""
        off = HEADER_BYTES + (k % self.nslots) * SLOT_SIZE
        body = off + SLOT_HEAD.size
        kind |= KIND_WRITTEN
        crc = slot_crc(self._buf[body : body + length], k, kind, length) if self._crc else 0
        _TAIL.pack_into(self._mem, off + 8, crc, kind, length)
        _COMMIT.pack_into(self._mem, off, k + 1)

    def _write(self, kind: int, payload: bytes) -> bool:
        k = self._claim()
        if k < 0:
            return False
        body = HEADER_BYTES + (k % self.nslots) * SLOT_SIZE + SLOT_HEAD.size
        n = len(payload)
        try:
            self._buf[body : body + n] = payload
            self._commit(k, kind, n)
        except BaseException:
            self._commit(k, MSG_VOID, 0)  # a claimed slot is always committed, or the agent would stall
            raise
        return True

    # -- side tables --------------------------------------------------------------------------------
    def queue_index(self, info: Any) -> int:
        """The queue's index, its definition written first; -1 when the ring had no room for it."""
        entry = self._queues.get(id(info))
        if entry is not None and entry[0] is info:
            return entry[1]
        idx = next(self._next_queue)  # atomic: two threads registering their queues at once get two indices
        names = [_utf8(str(s), 250) for s in (info.run_id, info.path, info.thread_name)]
        payload = QUEUE_FIXED.pack(
            idx, info.pid, info.dp, info.pp, info.tp, info.pcp, info.dcp, info.num_layers, *map(len, names)
        ) + b"".join(names)
        if not self._write(MSG_QUEUE, payload):
            return -1  # not remembered when the ring was full: sent again next time
        self._queues[id(info)] = (info, idx)
        return idx

    def req_index(self, req_id: str) -> int:
        """The id's index, its definition written first; -1 when the ring had no room for it (the task
        that needs it is then not written either: the agent never sees an index it cannot name)."""
        idx = self._req_ids.get(req_id)
        if idx is None:
            if len(self._req_ids) >= 65536:
                self._req_generation += 1  # prepared summaries name indices of the old table
                self._req_ids.clear()  # bounded; ids seen again are re-sent under a new index
            idx = next(self._next_req)
            raw = _utf8(req_id, BODY_BYTES - REQ_FIXED.size)
            if not self._write(MSG_REQ, REQ_FIXED.pack(idx & 0xFFFFFFFF, len(raw)) + raw):
                return -1
            self._req_ids[req_id] = idx
        return idx & 0xFFFFFFFF

    def resource(self, key: str, value: Any) -> None:
        payload = marshal.dumps((key, value))
        if len(payload) <= BODY_BYTES:
            self._write(MSG_RESOURCE, payload)

    def publish_dropped(self, dropped: int) -> None:
        """The recorder's exact drop count into ``H_DROPPED`` for the agent (never moves backwards; the
        shutdown path writes the final value from one thread before ``close``)."""
        if dropped > self.hdr[H_DROPPED]:
            self.hdr[H_DROPPED] = dropped

    def close(self) -> None:
        self._write(MSG_CLOSE, b"")

    def release(self) -> None:
        """Unmap the ring (after the agent is done with it, or in a forked child for the parent's ring)."""
        if self._packer is not None:
            self._packer.release()  # its buffer export would keep the mapping open
            self._packer = None
        self.hdr.release()
        self._buf.release()
        self._mem.close()

    def native_shipper(self, recorder: Any, awaiting: bool) -> Any:
        """``recorder._ship(awaiting, ...)`` over this ring in C (``_ringpack.Shipper``), or None (no packer,
        or not the recorder of this package): what ``Recorder.attach_ring`` installs as ``submit``."""
        packer = self._packer
        if packer is None or packer.record_type is not TaskRecord or not hasattr(recorder, "_pool"):
            return None
        blank = TaskRecord()
        blank.reset()
        try:
            return _NATIVE.Shipper(packer, self, recorder, awaiting, recorder._pool, recorder.capacity,
                                   recorder._submitted, _RECORD_FIELDS, blank)
        except Exception as exc:  # noqa: BLE001 - the Python _ship works
            _warn_once(f"native shipper failed ({type(exc).__name__}: {exc}); shipping through Recorder._ship")
            return None

    def native_releaser(self, shipper: Any, fallback: Any) -> Any:
        """``recorder.submit_consumer`` over this ring in C (``_ringpack.Releaser``: ``write_cwait`` of the
        task's ``consumer_stages`` and the recycle through ``shipper``, the recorder's non-awaiting native
        shipper of this ring; ``fallback(rec, reason)``, ``Recorder.submit_consumer``, for everything else), or
        None (no packer, or ``shipper`` is not a native one). Installed by ``Recorder.attach_ring``."""
        if self._packer is None or type(shipper) is not getattr(_NATIVE, "Shipper", None):
            return None
        try:
            return _NATIVE.Releaser(shipper, fallback)
        except Exception as exc:  # noqa: BLE001 - the Python submit_consumer works
            _warn_once(f"native releaser failed ({type(exc).__name__}: {exc}); releasing through Recorder.submit_consumer")
            return None

    # -- per task -----------------------------------------------------------------------------------
    def write_task(self, rec: Any, awaiting: bool, summary: Any = None, native: bool = True) -> bool:
        """One task record in one slot; False when the ring had no room (the caller counts the drop).

        Stamps, dependency bounds and stages are copied as they are, after the NPU bounds were tightened
        by stream order (``tighten_bounds``: numbers of the live step log). The transfer tasks travel as
        one summary index (``MSG_SUMMARY``, sent once per distinct summary: upstream shares one
        ``SharedBlockData`` across the layers of a step, recognised here by identity). ``summary``: a
        precomputed ``TransferSummary`` instead of ``rec.transfer_tasks`` (tests, benches).

        With the native packer the common task (its queue the one resolved last, no error, only stream-order
        marks, the shared transfer data of the last summary) is done by ``Packer.ship`` alone; everything
        else goes through the code below, the reference (``tests/record/test_ringpack.py``: same bytes).
        ``native=False``: ``Packer.ship`` is not tried (it declined this task already).
        """
        packer = self._packer
        if packer is not None and summary is None and native:
            done = packer.ship(self, rec, awaiting)
            if done is not NotImplemented:
                return done
        queue = rec.queue
        entry = self._queues.get(id(queue))
        qidx = entry[1] if entry is not None and entry[0] is queue else self.queue_index(queue)
        if qidx < 0:
            return False  # its definition did not fit: the task is dropped (and counted) rather than lost
        if packer is not None:
            packer.remember_queue(queue, qidx)  # its definition is in the ring for good: ship() may use it
        if rec.error is not None:
            self._write_error(qidx, rec.seq, rec.error)
        if rec.npu_marks and tighten_bounds(rec) and self.resolver is not None:
            # Device-timing marks (opt-in): exact times, clamped into the bounds. The stream-order marks
            # were applied just now; the resolver (``Runtime.resolve``) would apply them again.
            marks = rec.npu_marks
            marks[:] = [m for m in marks if type(m[1]) is not StreamPosition]
            self.resolver(rec)
        slot = rec.kind & 1
        if summary is not None:
            sidx = self._summary_index(None, slot, None, summary)
        else:
            tt = rec.transfer_tasks
            task = tt[0] if type(tt) is list and len(tt) == 1 else tt
            try:
                shared = task.shared_block_data
                req_ids = shared.req_ids
                blocks = shared.block_ids_arr
                group = task.group_id
            except AttributeError:  # no shared data (key path, several tasks, none): summarised exactly
                sidx = NO_SUMMARY if tt is None else self._summary_index(tt, slot, None, None)
            else:
                hit = self._hits[slot]
                if (hit is not None and hit[0] is shared and hit[1] is req_ids and hit[2] is blocks
                        and hit[3] == len(req_ids) and hit[4] == group and hit[5] == len(blocks)
                        and hit[6] == self._req_generation):
                    sidx = hit[7]
                else:
                    sidx = self._summary_index(tt, slot, (shared, req_ids, blocks, group), None)
        if sidx < 0:
            return False  # as for the queue: never a task pointing at a summary the agent lacks
        if packer is not None:  # claim, body, tail, commit in C; NotImplemented: an input left to the code below
            done = packer.write(self, rec, qidx, sidx, awaiting)
            if done is not NotImplemented:
                return done
        flags = 0
        # One snapshot when the forward may still append its consumer wait; without a consumer hold this
        # thread is the record's only writer, and the ``*stages`` below copies it once anyway.
        stages = tuple(rec.stages) if awaiting else rec.stages
        if awaiting:
            flags = F_AWAITING
        n_stages = len(stages)
        if n_stages > MAX_STAGE_INTS:
            stages = fold_stages(stages)
            n_stages = len(stages)
            flags |= F_STAGES_FOLDED
        src = rec.wait_for_save_layer
        if src is None:
            src = 0
        else:
            flags |= F_SRC
        gate = rec.gate_id
        if gate is None:
            gate = 0
        else:
            flags |= F_GATE
        layout = TASK_LAYOUTS[n_stages]
        # _claim(), inlined (this runs once per task on a recording thread); from here to the commit
        # nothing may leave the slot claimed but uncommitted.
        hdr = self.hdr
        if self._head - hdr[H_READ] >= self._limit:
            return False
        k = next(self._claims)
        try:
            self._head = k + 1
            if k >= hdr[H_HEAD]:
                hdr[H_HEAD] = k + 1
            off = HEADER_BYTES + (k % self.nslots) * SLOT_SIZE
            mem = self._mem
            n = layout.size
            if self._crc:  # body, tail (with the crc of the body), then the commit word (_commit, inlined)
                body = off + 16  # SLOT_HEAD.size
                layout.pack_into(
                    mem, body, qidx, rec.kind, rec.final_layer, rec.outcome, flags, rec.seq, rec.step,
                    rec.layer_id, src, gate, rec.queue_depth_at_enqueue, rec.inflight_at_enqueue, rec.t_enqueue,
                    rec.t_dequeue, rec.t_backend_return, rec.t_complete, rec.nbytes, rec.backend_result,
                    rec.has_dep, *rec.deps, sidx, n_stages, *stages,
                )
                _TAIL.pack_into(mem, off + 8, zlib.crc32(self._buf[body : body + n], k & 0xFFFFFFFF)
                                ^ (_TASK_KIND << 16 | n), _TASK_KIND, n)
            else:  # tail and body in one call (all known before it), then the commit word
                TASK_TAILED[n_stages].pack_into(
                    mem, off + 8, 0, _TASK_KIND, n, qidx, rec.kind, rec.final_layer, rec.outcome, flags,
                    rec.seq, rec.step, rec.layer_id, src, gate, rec.queue_depth_at_enqueue,
                    rec.inflight_at_enqueue, rec.t_enqueue, rec.t_dequeue, rec.t_backend_return, rec.t_complete,
                    rec.nbytes, rec.backend_result, rec.has_dep, *rec.deps, sidx, n_stages, *stages,
                )
            _COMMIT.pack_into(mem, off, k + 1)  # last and alone: publishes the slot
        except BaseException:
            self._commit(k, MSG_VOID, 0)  # a claimed slot is always committed, or the agent would stall
            raise
        return True

    def _summary_index(self, tasks: Any, slot: int, key: tuple[Any, ...] | None, summary: Any) -> int:
        """The index of the summary of ``tasks`` (or of ``summary``), its definition written first when it
        differs from the last one of this task kind; -1 when a definition did not fit (the ring was full).
        ``key``: the shared data's identity key, remembered for ``write_task``'s next lookup."""
        generation = self._req_generation
        if summary is None:
            summary = self._summarize(tasks, MAX_REQS + 1)  # one past the cut, so it is flagged
        groups = summary.group_ids
        reqs = summary.request_ids
        blocks = summary.num_blocks & 0xFFFFFFFF
        last = self._last[slot]
        if (last is not None and last[0] == generation and last[1] == groups and last[2] == reqs
                and last[3] == blocks):
            sidx = last[4]
        else:
            sidx = self._define_summary(groups, reqs, blocks)
            if sidx < 0:
                return -1
            if generation != self._req_generation:  # the id table was reset meanwhile: do not keep it
                return sidx
            self._last[slot] = (generation, list(groups), list(reqs), blocks, sidx)
        if key is not None:
            shared, req_ids, block_ids, group = key
            if hasattr(req_ids, "__len__") and hasattr(block_ids, "__len__"):
                self._hits[slot] = (shared, req_ids, block_ids, len(req_ids), group, len(block_ids), generation, sidx)
        return sidx

    def _define_summary(self, groups: list[int], reqs: list[str], blocks: int) -> int:
        """Write one ``MSG_SUMMARY`` (and the request ids it names that the agent lacks); its index or -1."""
        flags = 0
        if len(reqs) > MAX_REQS:
            reqs = reqs[:MAX_REQS]
            flags |= F_REQS_TRUNCATED
        known = self._req_ids  # definitions are written before the summary that uses them
        req_idx = []
        for r in reqs:
            i = known.get(r)
            if i is None:
                i = self.req_index(r)
                if i < 0:
                    return -1
            req_idx.append(i & 0xFFFFFFFF)
        groups = groups[:MAX_GROUPS]
        count = next(self._next_summary)
        sidx = count % NO_SUMMARY  # never NO_SUMMARY itself
        if count and not count % SUMMARY_GENERATION:
            self._req_generation += 1  # no cached summary stays in use longer than the agent keeps it
        payload = (SUMMARY_FIXED.pack(sidx, blocks, len(groups), len(req_idx), flags)
                   + _INTS[len(groups)].pack(*groups) + _U32S[len(req_idx)].pack(*req_idx))
        if not self._write(MSG_SUMMARY, payload):
            return -1
        return sidx

    def write_cwait(self, rec: Any, reason: int, stages: list[int]) -> bool:
        """The consumer-wait stages of a task sent earlier with ``awaiting`` (or the reason they are absent)."""
        entry = self._queues.get(id(rec.queue))
        if entry is None:
            return False
        n = min(len(stages), MAX_CWAIT_INTS)
        return self._write(MSG_CWAIT, CWAIT_FIXED.pack(entry[1], rec.seq, reason, n) + _INTS[n].pack(*stages[:n]))

    def _write_error(self, qidx: int, seq: int, error: BaseException) -> None:
        # Failed tasks only (rare): the text must leave this process, so it is formatted here.
        import traceback

        type_name = type(error).__qualname__
        stack = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        parts = [_utf8(type_name, 100), _utf8(str(error), 300)]
        room = BODY_BYTES - ERROR_FIXED.size - sum(map(len, parts))
        parts.append(_utf8(stack[-room:] if len(stack) > room else stack, room))
        self._write(MSG_ERROR, ERROR_FIXED.pack(qidx, seq, *map(len, parts)) + b"".join(parts))


_CONSUMER_WAIT = int(Stage.CONSUMER_WAIT)


def consumer_stages(stages: list[int]) -> list[int]:
    """The ``consumer_wait`` triples of a record's flat stage list (what ``MSG_CWAIT`` carries), in order.

    The stage ids of the whole triples are compared in C (one slice, ``count``, ``index``) instead of one
    bytecode loop per triple: the forward runs this on its release (with the Python packer; the native
    ``Releaser`` walks the list itself), and a task has one consumer wait, after the recv thread's stages.
    The same as ``[x for i in range(0, len(stages) - 2, 3) if stages[i] == CONSUMER_WAIT for x in
    stages[i : i + 3]]`` (``tests/record/test_ringpack.py``)."""
    kinds = stages[0 : len(stages) // 3 * 3 : 3]
    found = kinds.count(_CONSUMER_WAIT)
    if not found:
        return []
    if found == 1:  # the common case
        i = 3 * kinds.index(_CONSUMER_WAIT)
        return list(stages[i : i + 3])
    out: list[int] = []
    i = -1
    for _ in range(found):
        i = kinds.index(_CONSUMER_WAIT, i + 1)
        out += stages[3 * i : 3 * i + 3]
    return out


def fold_stages(stages: Any) -> list[int]:
    """Repeated stages merged (first start, last end) so a record fits a slot; the builder does the same."""
    first: dict[int, list[int]] = {}
    it = iter(stages)
    for stage, start, end in zip(it, it, it):
        cur = first.get(stage)
        if cur is None:
            first[stage] = [stage, start, end]
        else:
            cur[1] = min(cur[1], start)
            cur[2] = max(cur[2], end)
    return [x for triple in first.values() for x in triple][:MAX_STAGE_INTS]


@dataclass(slots=True)
class Message:
    index: int
    kind: int
    body: bytes


class RingReader:
    """Agent side: reads committed slots in order, without ever writing a slot."""

    def __init__(self, mem: mmap.mmap) -> None:
        self._mem = mem
        self._buf = memoryview(mem)
        self.hdr = self._buf[:HEADER_BYTES].cast("q")
        if self.hdr[H_MAGIC] != MAGIC or self.hdr[H_VERSION] != VERSION:
            raise ValueError("not a kvtrace ring (magic/version mismatch)")
        self.nslots = self.hdr[H_NSLOTS]
        self._crc = self.hdr[H_COMMIT_MODE] == COMMIT_CRC
        self.next = self.hdr[H_READ]

    def poll(self, limit: int) -> list[Message]:
        """Up to ``limit`` complete messages from ``next`` on; stops at the first slot not yet committed."""
        out: list[Message] = []
        while len(out) < limit:
            msg = self._read(self.next)
            if msg is None:
                break
            out.append(msg)
            self.next += 1
        return out

    def _read(self, k: int) -> Message | None:
        off = HEADER_BYTES + (k % self.nslots) * SLOT_SIZE
        commit, crc, kind, length = SLOT_HEAD.unpack_from(self._mem, off)
        if commit != k + 1 or not kind & KIND_WRITTEN or length > BODY_BYTES:
            return None
        body = bytes(self._buf[off + SLOT_HEAD.size : off + SLOT_HEAD.size + length])
        if self._crc and slot_crc(body, k, kind, length) != crc:
            return None  # still being written (or torn): read again later
        return Message(k, kind & ~KIND_WRITTEN, body)

    def skip_to_head(self) -> tuple[list[Message], int]:
        """After the producer died: every committed message up to its last claim; the rest count as lost."""
        head = max(self.hdr[H_HEAD], self.next)
        out: list[Message] = []
        lost = 0
        k = self.next
        while True:
            msg = self._read(k)
            if msg is None:
                if k >= head:
                    break
                lost += 1  # claimed, never committed: the writer died mid-write
            else:
                out.append(msg)
            k += 1
        self.next = k
        return out, lost

    def consumed(self) -> None:
        """Free the slots read so far for the producer (after they were exported)."""
        self.hdr[H_READ] = self.next
