"""Run the real vLLM-Ascend recv threads on CPU: fetch the sources, fake the NPU and the backend.

The upstream code is never copied into this repository. :func:`upstream_source_dir` obtains the released
sdist with pip at test time (into a cache directory), or uses a source tree named by
``KVTRACE_UPSTREAM_SRC`` (how main is tested). :func:`otel_kvtrace.instrument.upstream.source_tree`
imports it with torch/vllm replaced by stand-ins; this module adds what a test needs on top: a
``torch.npu.Event`` whose device completion time is real, a MemCache-like backend that records its calls,
and builders for the threads and tasks that follow each version's constructor signature.

Also used by ``bench/upstream_overhead.py`` (imported by file path).
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

from otel_kvtrace.instrument.upstream import UpstreamBinding, source_tree

RELEASE = "0.23.0.post1"
REPO_ROOT = Path(__file__).resolve().parents[2]
SRC_ENV = "KVTRACE_UPSTREAM_SRC"
CACHE_ENV = "KVTRACE_UPSTREAM_CACHE"
DEFAULT_CACHE = REPO_ROOT / ".kvtrace-cache" / "upstream"
KV_TRANSFER_REL = Path("vllm_ascend/distributed/kv_transfer/kv_pool/ascend_store/kv_transfer.py")


class UpstreamUnavailable(RuntimeError):
    """The upstream sources could not be obtained; the message says how to fix it."""


# ---- obtaining the sources -----------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser().resolve()


def upstream_source_dir(version: str = RELEASE) -> Path:
    """Root of the vllm-ascend source tree to test: ``$KVTRACE_UPSTREAM_SRC`` or the cached sdist.

    The sdist is fetched with ``pip download --no-deps --no-build-isolation --no-clean``: building its
    metadata fails on a CPU machine, but pip has unpacked the sources into ``TMPDIR`` by then and
    ``--no-clean`` keeps them. Should pip ever build the metadata instead, the downloaded archive is
    unpacked with ``tarfile``. A file lock makes concurrent test processes fetch once.
    """
    override = os.environ.get(SRC_ENV)
    if override:
        root = Path(override).expanduser().resolve()
        if not (root / KV_TRANSFER_REL).is_file():
            raise UpstreamUnavailable(f"{SRC_ENV}={override}: {KV_TRANSFER_REL} not found under it")
        return root
    base = cache_dir()
    target = base / f"vllm-ascend-{version}"
    if (target / KV_TRANSFER_REL).is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / KV_TRANSFER_REL).is_file():  # another process fetched it meanwhile
            return target
        _fetch_sdist(version, base, target)
    return target


def _fetch_sdist(version: str, base: Path, target: Path) -> None:
    work = base / f"fetch-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "tmp").mkdir(parents=True)
    env = dict(os.environ, TMPDIR=str(work / "tmp"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "--no-clean",
           "--no-binary", ":all:", "-d", str(work / "dl"), f"vllm-ascend=={version}"]
    print(f"[kvtrace] fetching vllm-ascend {version} sdist into {base} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    unpacked = [p.parents[len(KV_TRANSFER_REL.parts) - 1] for p in (work / "tmp").glob(f"*/*/{KV_TRANSFER_REL}")]
    if not unpacked:
        for archive in sorted((work / "dl").glob("*.tar.gz")):
            with tarfile.open(archive) as tar:
                tar.extractall(work / "x", filter="data")
            unpacked = [p.parents[len(KV_TRANSFER_REL.parts) - 1] for p in (work / "x").glob(f"*/{KV_TRANSFER_REL}")]
    if not unpacked:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        shutil.rmtree(work, ignore_errors=True)
        raise UpstreamUnavailable(
            f"could not obtain the vllm-ascend {version} sources with `{' '.join(cmd)}` "
            f"(exit {proc.returncode}). PyPI must be reachable, or set {SRC_ENV} to an unpacked tree.\n{tail}"
        )
    shutil.rmtree(target, ignore_errors=True)
    shutil.move(str(unpacked[0]), str(target))
    shutil.rmtree(work, ignore_errors=True)


# ---- fake NPU --------------------------------------------------------------------------------------


class FakeNpuEvent:
    """``torch.npu.Event`` whose device completes ``lag_s`` after ``record()``.

    ``query()`` is true and ``synchronize()`` returns only once that time has passed, as on a device
    that reaches the recorded point later than the host issued it. Events recorded by upstream code
    itself (the attention gate's) use the class-wide ``FakeNpuEvent.device_lag_s``. All events share one
    in-order stream, so an event recorded right behind another (a timing mark) completes with it.
    """

    device_lag_s: float = 0.0
    stream_tail: float = 0.0  # one in-order stream: an event completes no earlier than the one before

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.lag_s: float | None = None
        self.recorded_at: float | None = None
        self.done_at: float | None = None
        self.sync_calls = 0

    def record(self, stream: Any = None) -> None:
        cls = type(self)
        lag = cls.device_lag_s if self.lag_s is None else self.lag_s
        self.recorded_at = time.perf_counter()
        self.done_at = max(self.recorded_at + lag, cls.stream_tail)
        cls.stream_tail = self.done_at

    def query(self) -> bool:
        return self.done_at is None or time.perf_counter() >= self.done_at

    def synchronize(self) -> None:
        self.sync_calls += 1
        if self.done_at is None:  # like the real API: an unrecorded event is complete
            return
        remaining = self.done_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end: FakeNpuEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with enable_timing=True")
        if self.done_at is None or end.done_at is None or not (self.query() and end.query()):
            raise RuntimeError("Both events must be recorded and completed before elapsed_time")
        return (end.done_at - self.done_at) * 1000.0


# ---- fake backend ----------------------------------------------------------------------------------


@dataclass(slots=True)
class BackendCall:
    op: str
    thread: str
    start: float
    end: float
    args: tuple[Any, ...]


class FakeMemcacheClient:
    """The raw ``m_store.store`` client: ``batch_copy`` returns the queued result codes (0 by default)."""

    def __init__(self, owner: FakeBackend) -> None:
        self.owner = owner

    def batch_copy(self, gvas: list[int], addrs: list[int], sizes: list[int], direction: int) -> int:
        start = time.perf_counter()
        duration = self.owner.save_copy_s if direction == 0 else self.owner.copy_s
        if duration > 0:
            time.sleep(duration)
        result = self.owner.results.pop(0) if self.owner.results and direction == 1 else 0
        self.owner.log("batch_copy", start, (len(gvas), int(sum(sizes)), direction, result))
        return result


class FakeBackend:
    """``m_store`` stand-in with the calls the recv threads make; every call is logged with its thread."""

    def __init__(self, copy_s: float = 0.0, get_error: BaseException | None = None,
                 save_copy_s: float | None = None) -> None:
        self.copy_s = copy_s
        self.save_copy_s = copy_s if save_copy_s is None else save_copy_s  # direction 0 (L2G, send thread)
        self.get_error = get_error
        self.results: list[int] = []
        self.calls: list[BackendCall] = []
        self._lock = threading.Lock()
        self.store = FakeMemcacheClient(self)

    def log(self, op: str, start: float, args: tuple[Any, ...]) -> None:
        with self._lock:
            self.calls.append(BackendCall(op, threading.current_thread().name, start, time.perf_counter(), args))

    def set_device(self) -> None:
        pass

    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> None:
        start = time.perf_counter()
        if self.copy_s > 0:
            time.sleep(self.copy_s)
        self.log("get", start, (list(keys),))
        if self.get_error is not None:
            raise self.get_error

    def batch_remove_lease(self, keys: list[str]) -> int:
        self.log("batch_remove_lease", time.perf_counter(), (list(keys),))
        return 0

    def ops(self) -> list[str]:
        return [c.op for c in self.calls]


# ---- upstream session: modules, threads, tasks -------------------------------------------------------

ASCEND_STORE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store"
BLOCK_SIZE = 16
CACHES_PER_LAYER = 2  # K and V
BLOCK_LEN = 4096  # bytes per cache entry per block


def _call_with_supported(func: Any, **kwargs: Any) -> Any:
    """Call ``func`` with the keyword arguments its signature accepts (constructors differ by version)."""
    params = inspect.signature(func).parameters
    return func(**{k: v for k, v in kwargs.items() if k in params})


@dataclass
class Upstream:
    """The imported upstream modules of one source tree, with helpers to build real threads and tasks."""

    binding: UpstreamBinding
    kv_transfer: ModuleType
    metadata: ModuleType
    gate_module: ModuleType
    torch: ModuleType
    threads: list[Any] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return bool(self.binding.flags["raise_if_failed"])

    @property
    def gate_class(self) -> type:
        return self.binding.classes["gate"]

    def token_database(self, num_layers: int) -> Any:
        """A real ``ChunkedTokenDatabase`` with per-layer K/V buffers registered for group 0."""
        key_meta = self.metadata.KeyMetadata(model_name="m", head_or_tp_rank=0, pcp_rank=0, dcp_rank=0, pp_rank=0)
        db = _call_with_supported(self.metadata.ChunkedTokenDatabase, metadata=[key_meta],
                                  block_size=[BLOCK_SIZE], partitions=None)
        entries = num_layers * CACHES_PER_LAYER
        db.group_kv_caches_base_addr[0] = [0x10000000 + i * 0x1000000 for i in range(entries)]
        db.group_block_len[0] = [BLOCK_LEN] * entries
        db.group_block_stride[0] = [BLOCK_LEN] * entries
        db.group_num_layers["kv"][0] = num_layers
        return db

    def gva_thread(self, num_layers: int, backend: FakeBackend, *, save_failure_checker: Any = None,
                   slot_release_waiter: Any = None, start: bool = True) -> SimpleNamespace:
        """A real ``KVCacheStoreLayerRecvingThread`` with real builders, events and (main) fake NPU events."""
        db = self.token_database(num_layers)
        builder = _call_with_supported(
            self.kv_transfer.LayerBatchBuilder, token_database=db, my_key_index=0, num_ranks_per_layer=1,
            page_size_bytes=BLOCK_LEN * CACHES_PER_LAYER, num_layers=num_layers, group_id=0)
        env = SimpleNamespace(
            ready=threading.Event(), get_event=threading.Event(),
            load_done=[threading.Event() for _ in range(num_layers)],
            save_done=[threading.Event() for _ in range(num_layers)],
            sync_save=[FakeNpuEvent() for _ in range(num_layers)],
            backend=backend, num_layers=num_layers)
        env.thread = _call_with_supported(
            self.binding.classes["recv_gva"], m_store=backend, token_database=db, block_size=BLOCK_SIZE,
            tp_rank=0, tp_size=1, dcp_size=1, my_key_index=0, num_ranks_per_layer=1,
            page_size_bytes=BLOCK_LEN * CACHES_PER_LAYER, ready_event=env.ready, get_event=env.get_event,
            layer_load_finished_events=env.load_done, layer_save_finished_events=env.save_done,
            sync_save_events=env.sync_save, num_layers=num_layers, group_builders=[builder],
            external_slot_release_waiter=slot_release_waiter, save_failure_checker=save_failure_checker)
        return self._start(env, start)

    def key_thread(self, num_layers: int, backend: FakeBackend, *, start: bool = True) -> SimpleNamespace:
        """A real ``KVCacheStoreKeyLayerRecvingThread`` (key-based path, synchronous ``m_store.get``)."""
        db = self.token_database(num_layers)
        env = SimpleNamespace(
            ready=threading.Event(), get_event=threading.Event(),
            load_done=[threading.Event() for _ in range(num_layers)],
            save_done=[threading.Event() for _ in range(num_layers)],
            backend=backend, num_layers=num_layers)
        env.thread = self.binding.classes["recv_key"](
            m_store=backend, token_database=db, block_size=BLOCK_SIZE, tp_rank=0, tp_size=1, dcp_size=1,
            ready_event=env.ready, get_event=env.get_event, layer_load_finished_events=env.load_done,
            layer_save_finished_events=env.save_done, num_layers=num_layers)
        return self._start(env, start)

    def _start(self, env: SimpleNamespace, start: bool) -> SimpleNamespace:
        if start:
            env.thread.start()
            if not env.ready.wait(5):
                raise RuntimeError("upstream recv thread did not signal ready_event")
        self.threads.append(env.thread)
        return env

    # tasks --------------------------------------------------------------------------------------------
    def request(self, req_id: str, num_blocks: int, *, last_chunk: bool = True) -> SimpleNamespace:
        """A request as the recv threads read it (``ReqMeta`` fields used on the load path)."""
        return SimpleNamespace(req_id=req_id, is_last_chunk=last_chunk,
                               block_ids=list(range(1, num_blocks + 1)),
                               block_hashes=[f"{req_id}-{i:04x}".encode().hex() for i in range(num_blocks)])

    def shared_data(self, requests: list[SimpleNamespace], load_keys: list[str] | None = None) -> Any:
        """The ``SharedBlockData`` of ``requests``: upstream builds one per step and group and hands the
        same object to every layer's transfer task (``pool_worker._build_shared_load_data``)."""
        block_ids = np.concatenate([np.asarray(r.block_ids, dtype=np.int64) for r in requests])
        return self.metadata.SharedBlockData(
            block_ids_arr=block_ids,
            block_gvas_arr=np.arange(1, len(block_ids) + 1, dtype=np.int64) * 0x100000,
            req_ids=[r.req_id for r in requests], is_last_chunks=[r.is_last_chunk for r in requests],
            load_keys=list(load_keys or [f"{r.req_id}-key" for r in requests]))

    def gva_task(self, layer_id: int, requests: list[SimpleNamespace], *, wait_for_save_layer: int | None = None,
                 gate: Any = None, load_keys: list[str] | None = None, shared: Any = None) -> Any:
        """A ``LayerLoadTask`` whose transfer task carries shared block data (the normal GVA path);
        ``shared``: the step's ``shared_data(requests)`` (a fresh one per task when omitted)."""
        md = self.metadata
        transfer_tasks = []
        if requests:
            if shared is None:
                shared = self.shared_data(requests, load_keys)
            ranges = [md.LayerBlockRange(request=r, start_block=0, end_block=len(r.block_ids)) for r in requests]
            transfer_tasks.append(md.LayerTransferTask(layer_id=layer_id, block_ranges=ranges,
                                                       shared_block_data=shared, group_id=0,
                                                       layer_idx_in_group=layer_id))
        return md.LayerLoadTask(wait_for_save_layer=wait_for_save_layer, transfer_tasks=transfer_tasks,
                                layer_id=layer_id, attention_start_gate=gate)

    def key_task(self, layer_id: int, request: SimpleNamespace | None, *, wait_for_save_layer: int | None = None,
                 gate: Any = None) -> Any:
        md = self.metadata
        tasks = []
        if request is not None:
            block_range = md.LayerBlockRange(request=request, start_block=0, end_block=len(request.block_ids))
            tasks.append(md.LayerTransferTask(layer_id=layer_id, block_ranges=[block_range]))
        return md.LayerLoadTask(wait_for_save_layer=wait_for_save_layer, transfer_tasks=tasks,
                                layer_id=layer_id, attention_start_gate=gate)


@contextlib.contextmanager
def upstream_session(root: Path) -> Iterator[Upstream]:
    """Import the tree under stubs with the timed fake NPU event; everything is removed on exit."""
    with source_tree(root) as binding:
        if not binding.ok:
            missing = ", ".join(f"{p.point.id} {p.where}" for p in binding.missing_required())
            raise UpstreamUnavailable(f"{root}: required patch points missing: {missing}; errors: {binding.errors}")
        import importlib

        torch = importlib.import_module("torch")
        torch.npu.Event = FakeNpuEvent
        FakeNpuEvent.device_lag_s = 0.0
        FakeNpuEvent.stream_tail = 0.0
        session = Upstream(
            binding=binding,
            kv_transfer=importlib.import_module(binding.modules["kv_transfer"]),
            metadata=importlib.import_module(binding.modules["metadata"]),
            gate_module=importlib.import_module(binding.modules["gate"]),
            torch=torch,
        )
        try:
            yield session
        finally:
            # Started threads are daemons parked in queue.get() (upstream has no stop); they hold only
            # references to the already-imported classes, so removing the modules below is safe.
            FakeNpuEvent.device_lag_s = 0.0


# ---- reading the trace back ------------------------------------------------------------------------


def otlp_value(value: dict[str, Any]) -> Any:
    """Plain Python value of an OTLP/JSON ``AnyValue``."""
    (kind, raw), = value.items()
    if kind == "intValue":
        return int(raw)
    if kind == "arrayValue":
        return [otlp_value(v) for v in raw.get("values", [])]
    return raw


def otlp_attrs(attributes: list[dict[str, Any]]) -> dict[str, Any]:
    return {a["key"]: otlp_value(a["value"]) for a in attributes}


@dataclass(slots=True)
class SpanView:
    name: str
    start: int  # epoch ns
    end: int
    attrs: dict[str, Any]
    status_code: int
    status_message: str = ""


@dataclass(slots=True)
class TaskTrace:
    """One exported task: the root span and its children by name."""

    root: SpanView
    children: dict[str, SpanView]
    trace_id: str = ""
    links: dict[str, list[str]] = field(default_factory=dict)  # child name -> linked trace ids

    @property
    def attrs(self) -> dict[str, Any]:
        return self.root.attrs

    def stage_names(self) -> list[str]:
        """Child span names in start order."""
        return [s.name for s in sorted(self.children.values(), key=lambda s: (s.start, s.end))]


def task_traces(spans: list[dict[str, Any]], root_name: str = "kvtrace.recv.task") -> list[TaskTrace]:
    """Group OTLP/JSON spans into tasks (root ``root_name`` + children sharing its trace id)."""
    views: dict[str, list[tuple[dict[str, Any], SpanView]]] = {}
    for span in spans:
        view = SpanView(span["name"], int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"]),
                        otlp_attrs(span.get("attributes", [])), int(span.get("status", {}).get("code", 0) or 0),
                        str(span.get("status", {}).get("message", "")))
        views.setdefault(span["traceId"], []).append((span, view))
    tasks = []
    for members in views.values():
        roots = [v for s, v in members if not s.get("parentSpanId")]
        if len(roots) != 1 or roots[0].name != root_name:
            continue
        children = {v.name: v for s, v in members if s.get("parentSpanId")}
        links = {s["name"]: [link["traceId"] for link in s.get("links", [])] for s, _ in members if s.get("links")}
        tasks.append(TaskTrace(roots[0], children, members[0][0]["traceId"], links))
    return sorted(tasks, key=lambda t: t.attrs["kvtrace.seq"])


def records_to_spans(session: Any) -> list[dict[str, Any]]:
    """Drain the session's recorder and build the spans with the exporter's own span builder."""
    from otel_kvtrace.export.spans import build_task_spans

    spans: list[dict[str, Any]] = []
    for record in session.recorder.drain(1 << 20):
        spans.extend(build_task_spans(record, session.recorder.anchor))
    return spans


def exported_spans(out_dir: Path) -> list[dict[str, Any]]:
    """Every span in the OTLP/JSON lines files the embedded sink wrote under ``out_dir``."""
    import json

    spans: list[dict[str, Any]] = []
    for path in sorted(Path(out_dir).rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                for rs in json.loads(line).get("resourceSpans", []):
                    for ss in rs.get("scopeSpans", []):
                        spans.extend(ss.get("spans", []))
    return spans


def epoch_of(session: Any, perf_s: float) -> int:
    """A ``time.perf_counter()`` reading (the fakes' clock) as epoch ns on the trace's timeline."""
    anchor = session.recorder.anchor
    return anchor.to_epoch(int(perf_s * 1e9))


def pool_worker(up: Upstream, num_layers: int, prefetch: int, backend: FakeBackend) -> Any:
    """A real ``KVPoolWorker`` (made with ``__new__``, like upstream's unit tests) for the layerwise GVA
    path, kv_both role, whose real ``_start_kv_transfer_threads`` builds and starts the real threads."""
    import importlib

    pw = importlib.import_module(up.binding.modules["pool_worker"])
    worker = pw.KVPoolWorker.__new__(pw.KVPoolWorker)
    db = up.token_database(num_layers)
    builder_kwargs = dict(token_database=db, my_key_index=0, num_ranks_per_layer=1,
                          page_size_bytes=BLOCK_LEN * CACHES_PER_LAYER, num_layers=num_layers, group_id=0)
    attrs = dict(
        _transfer_threads_started=False, use_layerwise=True, use_gva_layerwise=True, num_layers=num_layers,
        num_prefetch_layers=prefetch, kv_role="kv_both", consumer_is_to_put=False, kv_send_thread=None,
        kv_recv_thread=None, m_store=backend, token_database=db, block_size=BLOCK_SIZE, tp_rank=0, tp_size=1,
        dcp_size=1, pcp_rank=0, dcp_rank=0, pp_rank=0, dp_rank=0, put_step=1, my_key_index=0,
        num_ranks_per_layer=1, page_size_bytes=BLOCK_LEN * CACHES_PER_LAYER, h2d_stagger_us=0,
        layerwise_max_transfer_blocks=0, layerwise_max_transfer_bytes=0, external_slot_release_waiter=None,
        prefetch_layer_map={}, current_layer=0, next_layer_to_submit=0,
        layer_load_tasks=[[] for _ in range(num_layers)], layer_save_tasks=[[] for _ in range(num_layers)],
    )
    for name, value in attrs.items():
        setattr(worker, name, value)
    worker._build_group_layer_builders = lambda: [
        _call_with_supported(up.kv_transfer.LayerBatchBuilder, **builder_kwargs)]
    worker._start_kv_transfer_threads()
    up.threads.extend(t for t in (worker.kv_recv_thread, worker.kv_send_thread) if t is not None)
    return worker


def drive_step(up: Upstream, worker: Any, loads: dict[int, list[SimpleNamespace]],
               saves: dict[int, list[SimpleNamespace]] | None = None) -> None:
    """One forward step as vLLM runs it: start_load_kv, then per layer wait -> attention -> save."""
    worker.start_load_kv(SimpleNamespace(requests=[]))
    for layer, requests in loads.items():  # what process_layer_data would have prepared
        worker.layer_load_tasks[layer][:] = up.gva_task(layer, requests).transfer_tasks
    for layer, requests in (saves or {}).items():  # same block data, copied L2G by the send thread
        worker.layer_save_tasks[layer][:] = up.gva_task(layer, requests).transfer_tasks
    for _ in range(worker.num_layers):
        worker.wait_for_layer_load()
        up.gate_module.record_attention_compute_start()
        worker.save_kv_layer(None)
