"""Canonical spans -> one row per engine step, plus the run-level capture warnings.

Our own traces carry ``async.step``; captures from msServiceProfiler do not, so their spans are
matched by ordinal (the n-th schedule, the n-th dispatch, the n-th forward are step n) after keeping
one origin per phase (``classify.ORIGIN_PRIORITY``) and one process per phase (the busiest pid).
The device-completion time of a step is, by preference: ``execute_done`` (ours), a device-synchronised
``forward`` span, or the end of the step's kernels. A kernel belongs to the step whose launch issued its
MSPTI ``Api`` call (joined by ``correlationId``, or by name in launch order where the parser replaced
kernel names with Api names): host calls are ordered by the launch windows, kernels are not, since under
async launch n+1 precedes the end of device work n. Without Api rows a kernel goes to the last launch
before it, which is exact only while the device is idle at every launch (warned otherwise).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict, deque
from collections.abc import Iterable
from pathlib import Path

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.classify import MINDIE_PD_MESSAGES, ORIGIN_PRIORITY, SOURCE_PRIORITY, VLLM_PATCHER_SPANS
from otel_kvtrace.asynccheck.msprof import source_kind

_DEVICE = frozenset({m.COMPUTE, m.COMMUNICATION, m.LAUNCH_API})


def _source_key(s: m.SpanRow) -> str:
    return "device" if s.name in _DEVICE else str(s.attrs.get("raw", s.origin))


def dedup_markers(markers: list[m.Marker]) -> list[m.Marker]:
    """Each marker counted from the best capture file kind that has it (the files repeat the same spans)."""
    def rank(mk: m.Marker) -> int:
        return SOURCE_PRIORITY.get(source_kind(Path(mk.file)), 9)

    best: dict[str, int] = {}
    for mk in markers:
        best[mk.marker] = min(best.get(mk.marker, 9), rank(mk))
    return [mk for mk in markers if rank(mk) == best[mk.marker]]


def dedup_sources(spans: list[m.SpanRow]) -> list[m.SpanRow]:
    """Each raw span name (device rows as one group) from the best file kind of the capture only.

    The files of one parse output repeat the same spans; reading several of them must not double steps.
    """
    best: dict[str, int] = {}
    for s in spans:
        if s.step is None:
            key, rank = _source_key(s), SOURCE_PRIORITY.get(str(s.attrs.get("source")), 9)
            best[key] = min(best.get(key, rank), rank)
    return [s for s in spans if s.step is not None
            or SOURCE_PRIORITY.get(str(s.attrs.get("source")), 9) == best[_source_key(s)]]


def build_steps(spans: list[m.SpanRow], run: str,
                lost_starts: Iterable[str] = ()) -> tuple[list[m.StepRow], list[m.CaptureWarning]]:
    """Steps of one run and warnings about how they were matched (``lost_starts``: span names with start 0)."""
    outputs = [s for s in spans if s.name == m.OUTPUT_READY]
    calls = [s for s in spans if s.name == m.WORKER_LAUNCH]
    ours = [s for s in spans if s.step is not None]
    capture = [s for s in spans if s.step is None and s.name not in m.WORKER_SPANS]
    steps = _steps_from_ours(ours, run)
    if outputs:
        join_worker_outputs(steps, outputs)
    if calls:
        join_worker_launches(steps, calls, sync_outputs=not outputs)
    warnings: list[m.CaptureWarning] = []
    if capture:
        capture_steps, warnings = _steps_from_capture(capture, run, frozenset(lost_starts))
        steps += capture_steps
    return steps, warnings


def _steps_from_ours(spans: list[m.SpanRow], run: str) -> list[m.StepRow]:
    rows: dict[tuple[str, int], m.StepRow] = {}
    for s in spans:
        assert s.step is not None
        row = rows.setdefault((s.lane, s.step), m.StepRow(run, s.lane, s.step))
        if s.name == m.BATCH_SCHEDULE:
            row.schedule_start, row.schedule_end = s.start_ns, s.end_ns
            row.batch_queue = bool(s.attrs.get(m.ATTR_BATCH_QUEUE))
        elif s.name == m.MODEL_EXECUTE:
            row.launch_start, row.launch_end = s.start_ns, s.end_ns
            row.queue_depth = s.attrs.get(m.ATTR_QUEUE_DEPTH)
        elif s.name == m.EXECUTE_DONE:
            row.done, row.done_precision = s.end_ns, s.attrs.get(m.ATTR_DONE_PRECISION)
        elif s.name == m.UPDATE_OUTPUT:
            row.update_start, row.update_end = s.start_ns, s.end_ns
        elif s.name == m.COMPUTE:
            row.device_start = s.start_ns if row.device_start is None else min(row.device_start, s.start_ns)
    return [rows[k] for k in sorted(rows)]


_ENGINE_BOUNDS = frozenset({m.DONE_ENGINE_OBSERVED, m.DONE_ENGINE_POLL})


def join_worker_outputs(steps: list[m.StepRow], outputs: list[m.SpanRow]) -> None:
    """Give engine steps that only know the engine's own poll the ready time of the worker's output.

    A ``MultiprocExecutor`` worker creates step n's output after the engine launched step n and before
    the engine's update of step n (the engine waits for it): the first unmatched output of the worker
    process created in [launch start(n), update start(n)] is step n's. The worker process is the one
    with the most outputs inside the engine lane's time span (same host clock, epoch ns).
    """
    engine_lanes: dict[str, list[m.StepRow]] = defaultdict(list)
    for row in steps:
        engine_lanes[row.lane].append(row)
    for rows in engine_lanes.values():
        rows = [r for r in rows if r.launch_start is not None and r.update_start is not None]
        if not rows or not any(r.done_precision in _ENGINE_BOUNDS for r in rows):
            continue
        pending = _worker_lane(rows, outputs)
        i = 0
        for row in rows:
            while i < len(pending) and pending[i].start_ns < row.launch_start:
                i += 1
            if i < len(pending) and pending[i].start_ns <= row.update_start:
                o = pending[i]
                i += 1
                if row.done_precision in _ENGINE_BOUNDS and (row.done is None or o.end_ns <= row.done):
                    row.done = o.end_ns
                    row.done_precision = str(o.attrs.get(m.ATTR_DONE_PRECISION) or m.DONE_DEVICE_READY)


def _worker_lane(rows: list[m.StepRow], spans: list[m.SpanRow]) -> list[m.SpanRow]:
    """The worker process's spans: the lane with most spans inside the engine lane's time span."""
    by_lane: dict[str, list[m.SpanRow]] = defaultdict(list)
    for s in spans:
        by_lane[s.lane].append(s)
    lo, hi = rows[0].launch_start, rows[-1].update_start
    return sorted(max(by_lane.values(), key=lambda ss: sum(lo <= s.start_ns <= hi for s in ss)),
                  key=lambda s: s.start_ns)


def join_worker_launches(steps: list[m.StepRow], calls: list[m.SpanRow], *, sync_outputs: bool = False) -> None:
    """Give each engine step the launch of the worker process that really launches onto the device.

    The worker runs the engine's messages in order: step n's ``execute_model`` is the first one starting in
    [launch start(n), update start(n)], followed by its ``sample_tokens`` (if any) before the next
    ``execute_model``. A launch that blocks on the device blocks there, not in the engine's dispatch.
    ``sync_outputs``: the worker made no async outputs; in a step of the sync loop (no batch queue) its last
    call then returned the synchronous output: that return bounds the ready time tighter than the engine's
    update entry.
    """
    engine_lanes: dict[str, list[m.StepRow]] = defaultdict(list)
    for row in steps:
        if row.launch_start is not None and row.update_start is not None:
            engine_lanes[row.lane].append(row)
    for rows in engine_lanes.values():
        worker = _worker_lane(rows, calls)
        i = 0
        for row in rows:
            while i < len(worker) and (worker[i].start_ns < row.launch_start
                                       or worker[i].attrs.get(m.ATTR_WORKER_CALL) != "execute_model"):
                i += 1
            if i >= len(worker) or worker[i].start_ns > row.update_start:
                continue
            row.worker_launch_start, row.worker_launch_end = worker[i].start_ns, worker[i].end_ns
            i += 1
            while (i < len(worker) and worker[i].attrs.get(m.ATTR_WORKER_CALL) == "sample_tokens"
                   and worker[i].start_ns <= row.update_start):
                row.worker_launch_end = max(row.worker_launch_end, worker[i].end_ns)
                i += 1
            if sync_outputs and not row.batch_queue and row.done_precision == m.DONE_ENGINE_OBSERVED \
                    and row.done is not None and row.worker_launch_end <= row.done:
                # no async output (the sync loop): the worker's last call returned the synchronous output
                row.done, row.done_precision = row.worker_launch_end, m.DONE_WORKER_RETURN


def _best_origin(spans: list[m.SpanRow]) -> list[m.SpanRow]:
    if not spans:
        return spans
    best = min(ORIGIN_PRIORITY.get(s.origin, 9) for s in spans)
    return [s for s in spans if ORIGIN_PRIORITY.get(s.origin, 9) == best]


def _busiest_pid(spans: list[m.SpanRow], run: str, what: str) -> tuple[list[m.SpanRow], list[m.CaptureWarning]]:
    counts = Counter(s.attrs.get("pid") for s in spans)
    if len(counts) <= 1:
        return spans, []
    pid = sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))[0][0]
    warning = m.CaptureWarning(
        run, spans[0].file, m.WARN_MULTI_PROCESS,
        f"{what} spans come from {len(counts)} processes; analysed pid {pid} only ({counts[pid]} spans)",
    )
    return [s for s in spans if s.attrs.get("pid") == pid], [warning]


def _steps_from_capture(spans: list[m.SpanRow], run: str,
                        lost_starts: frozenset[str] = frozenset()) -> tuple[list[m.StepRow], list[m.CaptureWarning]]:
    by_name: dict[str, list[m.SpanRow]] = defaultdict(list)
    for s in spans:
        by_name[s.name].append(s)
    warnings: list[m.CaptureWarning] = []
    phases: dict[str, list[m.SpanRow]] = {}
    if lost_starts and any(s.origin == "modelRunnerExec" for s in by_name.get(m.MODEL_EXECUTE, [])):
        by_name[m.MODEL_EXECUTE] = [s for s in by_name[m.MODEL_EXECUTE] if s.origin not in lost_starts]
    for name in (m.BATCH_SCHEDULE, m.MODEL_EXECUTE, m.FORWARD):
        chosen, warns = _busiest_pid(_best_origin(by_name.get(name, [])), run, name)
        phases[name] = sorted(chosen, key=lambda s: s.start_ns)
        warnings += warns
    n = max(len(v) for v in phases.values())
    rows = [m.StepRow(run, "capture", i) for i in range(n)]
    for i, s in enumerate(phases[m.BATCH_SCHEDULE]):
        rows[i].schedule_start, rows[i].schedule_end = s.start_ns, s.end_ns
        rows[i].batch_size = s.attrs.get("batch_size")
        rows[i].batch_type = s.attrs.get("batch_type")
    for i, s in enumerate(phases[m.MODEL_EXECUTE]):
        rows[i].launch_start, rows[i].launch_end = s.start_ns, s.end_ns
    for i, s in enumerate(phases[m.FORWARD]):
        precision = m.FORWARD_UNKNOWN if s.attrs.get("source") == "forward_csv" else m.DONE_SYNCED_FORWARD
        rows[i].device_start, rows[i].done, rows[i].done_precision = s.start_ns, s.end_ns, precision
    if phases[m.FORWARD] and phases[m.FORWARD][0].attrs.get("source") == "forward_csv":
        warnings.append(m.CaptureWarning(
            run, phases[m.FORWARD][0].file, m.WARN_FORWARD_KIND_UNKNOWN,
            "forward.csv has no 'async' column: its forwards are device-synchronised (MindIE sync) or host "
            "launches (MindIE async); overlap measured from them is a lower bound. Pass chrome_tracing.json or "
            "profiler.db from the same parse output to tell.",
        ))
    _done_from_callback(rows, phases[m.MODEL_EXECUTE])
    if not phases[m.FORWARD]:
        device = [s for s in by_name.get(m.COMPUTE, []) + by_name.get(m.COMMUNICATION, [])
                  if s.attrs.get("source") != "forward_csv"]
        warnings += _done_from_kernels(rows, device, by_name.get(m.LAUNCH_API, []), run)
    _fill_queue_depth(rows)
    return rows, warnings


def _done_from_callback(rows: list[m.StepRow], launches: list[m.SpanRow]) -> None:
    """Current vLLM hooks end ``modelExec`` when its Future resolves (output ready), 1.2.3 at dispatch return.

    When the span ends at or after the synchronised forward in most steps it is the done-callback kind:
    its end is the output-ready time and the dispatch return is unknown.
    """
    if not launches or launches[0].origin != "modelExec":
        return
    paired = [r for r in rows if r.done is not None and r.launch_end is not None]
    if not paired or sum(r.launch_end >= r.done for r in paired) < 0.8 * len(paired):
        return
    for r in rows:
        if r.launch_end is not None:
            r.done, r.done_precision, r.launch_end = r.launch_end, m.DONE_FUTURE_CALLBACK, None


def _step_of(launched: list[m.StepRow], starts: list[int], t: int) -> m.StepRow | None:
    i = bisect_right(starts, t) - 1
    return launched[i] if i >= 0 else None


def _api_steps(launched: list[m.StepRow], starts: list[int], apis: list[m.SpanRow],
               kernels: list[m.SpanRow]) -> dict[int, m.StepRow]:
    """``id(kernel) -> step`` through the kernel's Api call (correlationId, else same name in launch order)."""
    by_corr: dict[object, m.StepRow] = {}
    by_name: dict[str, deque[tuple[int, m.StepRow]]] = defaultdict(deque)
    for a in sorted(apis, key=lambda x: x.start_ns):
        step = _step_of(launched, starts, a.start_ns)
        if step is None:
            continue
        if a.attrs.get("corr") is not None:
            by_corr[a.attrs["corr"]] = step
        by_name[a.origin].append((a.start_ns, step))
    out: dict[int, m.StepRow] = {}
    for k in kernels:
        corr = k.attrs.get("corr")
        if corr is not None and corr in by_corr:
            out[id(k)] = by_corr[corr]
            continue
        queue = by_name.get(k.origin)
        if queue and queue[0][0] <= k.start_ns:
            out[id(k)] = queue.popleft()[1]
    return out


def _busy_launches(launch_starts: list[int], kernels: list[m.SpanRow]) -> int:
    """Launches at which a kernel was running (kernels sorted by start; merged busy intervals)."""
    busy: list[tuple[int, int]] = []
    for k in kernels:
        if busy and k.start_ns <= busy[-1][1]:
            busy[-1] = (busy[-1][0], max(busy[-1][1], k.end_ns))
        else:
            busy.append((k.start_ns, k.end_ns))
    begins = [b[0] for b in busy]
    count = 0
    for t in launch_starts:
        i = bisect_right(begins, t) - 1
        count += i >= 0 and busy[i][1] > t
    return count


def _done_from_kernels(rows: list[m.StepRow], kernels: list[m.SpanRow], apis: list[m.SpanRow],
                       run: str) -> list[m.CaptureWarning]:
    launched = [r for r in rows if r.launch_start is not None]
    if not kernels or not launched:
        return []
    starts = [r.launch_start for r in launched]
    kernels = sorted(kernels, key=lambda k: k.start_ns)
    via_api = _api_steps(launched, starts, apis, kernels) if apis else {}
    for k in kernels:
        r = via_api.get(id(k)) or (None if via_api else _step_of(launched, starts, k.start_ns))
        if r is None:
            continue
        r.device_start = k.start_ns if r.device_start is None else min(r.device_start, k.start_ns)
        r.done = k.end_ns if r.done is None else max(r.done, k.end_ns)
        r.done_precision = m.DONE_KERNELS
    if via_api:
        return []
    busy = _busy_launches(starts[1:], kernels)
    if not busy:
        return []
    return [m.CaptureWarning(
        run, kernels[0].file, m.WARN_KERNELS_BY_TIME,
        f"kernels without their Api rows, and the device was busy at {busy} of {len(starts) - 1} launches: "
        "a kernel was given to the last launch before it, so device work of step n that ran after launch n+1 "
        "counts for step n+1 and overlap is a lower bound. Include the MSPTI ascend_service_profiler_*.db.",
    )]


def _fill_queue_depth(rows: list[m.StepRow]) -> None:
    for i, r in enumerate(rows):
        if r.launch_start is None:
            continue
        r.queue_depth = 1 + sum(
            1 for prev in rows[max(0, i - 8):i] if prev.done is not None and prev.done > r.launch_start
        )


def run_warnings(spans: list[m.SpanRow], seen: set[str], run: str) -> list[m.CaptureWarning]:
    """Warnings about the capture as a whole: synchronising hooks, dropped domains, comm sources."""
    out: list[m.CaptureWarning] = []
    names = {s.name for s in spans}
    origins = {s.origin for s in spans}
    if origins & VLLM_PATCHER_SPANS and m.FORWARD in names:
        out.append(m.CaptureWarning(
            run, "", m.WARN_NPU_SYNC_HOOKS,
            "msServiceProfiler's vLLM hooks synchronize the NPU around 'forward' (and logits/sampler); "
            "device/host overlap cannot be judged from this capture. Remove those handlers from the symbols "
            "file and collect again.",
        ))
    msprof_seen = {x for x in seen if ":" not in x} - set(m.STEP_CHILD_SPANS)
    only_forward_csv = "format:forward_csv" in seen and msprof_seen <= {"forward"} and "format:batch_csv" not in seen
    if m.BATCH_SCHEDULE not in names and only_forward_csv:
        out.append(m.CaptureWarning(
            run, "", m.WARN_SCHEDULE_MISSING,
            "forward.csv has no schedule spans; pass batch.csv (or profiler.db / chrome_tracing.json) from the "
            "same parse output",
        ))
    elif (m.BATCH_SCHEDULE not in names and (msprof_seen or m.FORWARD in names)
          and "domain:Schedule" not in seen and any(x.startswith("domain:") for x in seen)):
        out.append(m.CaptureWarning(
            run, "", m.WARN_SCHEDULE_DOMAIN_MISSING,
            "no BatchSchedule/batchFrameworkProcessing spans and no span of domain 'Schedule' among the domains "
            f"recorded ({', '.join(sorted(x[7:] for x in seen if x.startswith('domain:')))}): the collection's domain "
            "filter dropped 'Schedule' (MindIE emits BatchSchedule under it). Collect with domain \"\" or include "
            "Schedule.",
        ))
    if ("domain:Communication" in seen or seen & MINDIE_PD_MESSAGES) and m.COMMUNICATION not in names:
        out.append(m.CaptureWarning(
            run, "", m.WARN_COMM_DOMAIN_NOT_HCCL,
            "the 'Communication' domain holds P/D request messages, not HCCL/LCCL time; collective time needs "
            "acl_task_time=2 (MSPTI Communication table) or acl_task_time=1 (msprof).",
        ))
    return out
