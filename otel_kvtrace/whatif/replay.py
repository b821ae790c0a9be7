"""Replay a set of recorded tasks under every policy: per run (repeat), per queue, per policy.

``replay_run`` is the unit the verdict compares: one independent run of one configuration, all of its
queues replayed under each policy, summarised into ``RunFigures`` (what the consumer sees).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_kvtrace.whatif import gil
from otel_kvtrace.whatif.decision import decision_cost_ns
from otel_kvtrace.whatif.engine import (
    NONE,
    QueueArrays,
    QueueReplay,
    ReplayStalled,
    replay_queue,
)
from otel_kvtrace.whatif.metrics import (
    HolEvent,
    QueueFigures,
    Validation,
    quantile,
    queue_figures,
    validate_fifo,
    validation_from,
)
from otel_kvtrace.whatif.policy import get_policy, policy_names
from otel_kvtrace.whatif.saves import SaveTask, process_key
from otel_kvtrace.whatif.task import ReplayTask, group_by_queue


@dataclass(slots=True)
class RunFigures:
    """One run under one policy, in ms (means and tails over every (queue, step))."""

    policy: str
    tasks: int
    steps: int
    ttft_ms_mean: float
    ttft_ms_p99: float
    consumer_wait_ms_per_step: float
    consumer_wait_ms_p99_layer: float
    task_latency_ms_p99: float
    peak_inflight: int
    throughput_tasks_per_s: float
    batches: int

    def to_dict(self) -> dict[str, float | int | str]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


@dataclass(slots=True)
class RunReplay:
    """Every queue of one run replayed under every policy."""

    run_id: str
    cfg_label: str
    replays: dict[str, dict[str, QueueReplay]]
    """queue -> policy -> replay."""
    figures: dict[str, RunFigures]
    validation: Validation
    hol: list[HolEvent] = field(default_factory=list)
    gil: dict[str, gil.GilModel | None] = field(default_factory=dict)
    """queue -> the forward wake-up model fitted on its FIFO recording (None: not fitted)."""
    decision_ns: dict[str, int] = field(default_factory=dict)
    """queue -> the cost per dequeue charged to policies that probe the head (:mod:`.decision`)."""

    @property
    def hol_ms(self) -> float:
        return sum(h.duration_ns for h in self.hol) / 1e6

    def summary(self) -> RunSummary:
        """The serialisable part the verdict needs (what the sweep stores per finished cell run)."""
        errors: list[int] = []
        services: list[int] = []
        for per in self.replays.values():
            rep = per["fifo"]
            q = rep.arrays
            for i in range(q.n):
                if q.rec_complete[i] != NONE:
                    errors.append(abs(rep.complete[i] - q.rec_complete[i]))
                    services.append(q.w0[i] + q.w1[i] + q.w2[i] + q.w3[i])
        first = self.hol[0] if self.hol else None
        return RunSummary(
            run_id=self.run_id, cfg_label=self.cfg_label,
            figures={name: f.to_dict() for name, f in self.figures.items()},
            fifo_errors_ns=errors, service_ns=services, hol_events=len(self.hol), hol_ms=self.hol_ms,
            hol_example=(f"seq {first.seq} (step {first.step} layer {first.layer_id}) blocked seq "
                         f"{first.evidence_seq} for {first.duration_ns / 1e6:.3f} ms") if first else "",
            layers={name: self.layer_profile(name) for name in self.figures},
        )

    def layer_profile(self, policy: str) -> dict[str, list[float]]:
        """Per physical layer, means over (queue, step): load completion after the step's first enqueue
        and the forward's consumer wait, in ms (``layer`` lists the layers); ``in_order``: 1.0 where the
        policy served that layer's load, and every load of its step before it, in FIFO order in every step
        (no later task started before it, none merged with it), else 0.0."""
        done: dict[int, list[int]] = {}
        wait: dict[int, list[int]] = {}
        reordered: set[int] = set()
        for per in self.replays.values():
            rep = per[policy]
            q = rep.arrays
            for s, chain in enumerate(q.chain):
                first = min(rep.arr[i] for i in chain)
                for p, i in enumerate(chain):
                    layer = q.layer[i]
                    done.setdefault(layer, []).append(rep.complete[i] - first)
                    if rep.fwd_arrive[s][p] != NONE:
                        wait.setdefault(layer, []).append(rep.fwd_end[s][p] - rep.fwd_arrive[s][p])
                reordered.update(q.layer[i] for i in _after_first_reorder(rep, chain))
        layers = sorted(done)
        return {
            "layer": [float(x) for x in layers],
            "load_done_ms": [sum(done[x]) / len(done[x]) / 1e6 for x in layers],
            "consumer_wait_ms": [sum(wait.get(x, [0])) / max(1, len(wait.get(x, []))) / 1e6 for x in layers],
            "in_order": [0.0 if x in reordered else 1.0 for x in layers],
        }


def _after_first_reorder(rep: QueueReplay, chain: list[int]) -> list[int]:
    """The tasks of one step (``chain``, in seq order) from the first one that ran in a merged batch or
    that a later task started before (or with) on."""
    merged = rep.merged or [False] * len(rep.start)
    first = len(chain)
    later = NONE  # the earliest start of the tasks after p
    for p in range(len(chain) - 1, -1, -1):
        start = rep.start[chain[p]]
        if merged[chain[p]] or (later != NONE and start >= later):
            first = p
        later = start if later == NONE else min(later, start)
    return chain[first:]


@dataclass(slots=True)
class RunSummary:
    """One run's figures per policy, FIFO errors and HOL totals; JSON round-trips through ``to_dict``."""

    run_id: str
    cfg_label: str
    figures: dict[str, dict[str, Any]]
    fifo_errors_ns: list[int]
    service_ns: list[int]
    hol_events: int
    hol_ms: float
    hol_example: str = ""
    layers: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """policy -> per-layer profile (``RunReplay.layer_profile``)."""

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSummary:
        return cls(**{k: data[k] for k in cls.__slots__ if k in data})  # type: ignore[attr-defined]

    @property
    def validation(self) -> Validation:
        return validation_from(self.fifo_errors_ns, self.service_ns)


def summarise(policy: str, figs: Sequence[QueueFigures]) -> RunFigures:
    """Pool per-queue figures of one policy into run figures."""
    ttft = [s.ttft_ns for f in figs for s in f.steps]
    waits = [s.consumer_wait_ns for f in figs for s in f.steps]
    layer_waits = [w for f in figs for s in f.steps for w in s.layer_wait_ns]
    tasks = sum(f.tasks for f in figs)
    return RunFigures(
        policy=policy,
        tasks=tasks,
        steps=len(ttft),
        ttft_ms_mean=sum(ttft) / len(ttft) / 1e6 if ttft else 0.0,
        ttft_ms_p99=quantile(ttft, 0.99) / 1e6,
        consumer_wait_ms_per_step=sum(waits) / len(waits) / 1e6 if waits else 0.0,
        consumer_wait_ms_p99_layer=quantile(layer_waits, 0.99) / 1e6,
        task_latency_ms_p99=max((f.task_latency_p99_ns for f in figs), default=0.0) / 1e6,
        peak_inflight=max((f.peak_inflight for f in figs), default=0),
        throughput_tasks_per_s=sum(f.throughput_tasks_per_s for f in figs),
        batches=sum(f.batches for f in figs),
    )


def replay_run(tasks: Iterable[ReplayTask], *, policies: Sequence[str] | None = None, feedback: str = "full",
               run_id: str = "", cfg_label: str = "", saves: Mapping[str, list[SaveTask]] | None = None,
               dispatch_ns: Mapping[str, int] | None = None, gil_lag: bool = True) -> RunReplay:
    """Replay every queue of one run under each policy (``fifo`` always included, first).

    ``saves``: recorded send-thread saves per process key (:func:`.saves.saves_from_duckdb`); with them
    save times are replayed through the send thread's FIFO (:mod:`.saves`), else they move with the
    forward alone. ``dispatch_ns``: per policy, its own cost per dequeue on top of FIFO's
    (:func:`otel_kvtrace.whatif.engine.replay_queue`), on every dequeue; FIFO never gets one. A policy not
    in it that probes the head (``Policy.probes_head``) is charged instead the cost the FIFO recording gives
    (:mod:`.decision`), on the dequeues with another task queued (``decision_ns``).
    ``gil_lag``: a policy's forward wake-up lags and the send thread's copy and build waits follow the recv
    thread's runs (:mod:`.gil`, sized from the FIFO recording); False = FIFO's recorded lags and save services.

    Raises ``ReplayStalled`` naming the configuration, run, queue and policy when a replay cannot finish.
    """
    names = list(policies) if policies else policy_names()
    if "fifo" in names:
        names.remove("fifo")
    names.insert(0, "fifo")
    instances = {name: get_policy(name) for name in names}
    replays: dict[str, dict[str, QueueReplay]] = {}
    figs: dict[str, list[QueueFigures]] = {name: [] for name in names}
    hol: list[HolEvent] = []
    models: dict[str, gil.GilModel | None] = {}
    decision: dict[str, int] = {}
    for queue, qtasks in group_by_queue(tasks).items():
        arrays = QueueArrays.from_tasks(qtasks, (saves or {}).get(process_key(queue)))
        decision[queue] = decision_cost_ns(qtasks)
        replays[queue] = {}
        reference: list[int] | None = None
        coupling: gil.Coupling | None = None
        for name, policy in instances.items():
            try:
                if name == "fifo":  # the reference: as recorded
                    rep = replay_queue(arrays, policy, feedback=feedback, shift_steps=False)
                    reference = [e[-1] if e else NONE for e in rep.fwd_end]
                    coupling = gil.Coupling.fit(arrays, rep) if gil_lag else None
                    models[queue] = coupling.forward if coupling is not None else None
                else:  # a policy's steps move by its forward's shift from FIFO's
                    given = (dispatch_ns or {}).get(name)
                    rep = gil.replay_policy(
                        arrays, policy, coupling, feedback=feedback, reference=reference, dispatch=given or 0,
                        decision=decision[queue] if given is None and policy.probes_head else 0)
            except ReplayStalled as exc:  # name where, so a user can reproduce it on one configuration
                raise ReplayStalled(f"configuration {cfg_label!r}, run {run_id!r}, queue {queue!r}, "
                                    f"policy {name!r}: {exc}") from exc
            replays[queue][name] = rep
            f = queue_figures(rep, with_hol=name == "fifo")
            hol.extend(f.hol)
            figs[name].append(f)
    validation = validate_fifo([per["fifo"] for per in replays.values()])
    if replays:
        first = next(iter(replays.values()))["fifo"].arrays.tasks[0]
        run_id = run_id or first.run_id
        cfg_label = cfg_label or first.cfg_label
    figures = {name: summarise(name, figs[name]) for name in names}
    return RunReplay(run_id, cfg_label, replays, figures, validation, hol, models, decision)


def config_key(cfg_label: str | None, path: str | None, scheduler: str | None = None) -> str:
    """The configuration a task belongs to: its ``cfg_label``, plus ``[path]`` when the label does not
    name the path already (GVA and key-path queues are always decided separately), plus
    ``[scheduler=X]`` for runs recorded under a policy other than FIFO (never pooled with FIFO runs)."""
    label = cfg_label or "(unlabelled)"
    if path and path not in label.split():
        label += f" [{path}]"
    if scheduler and scheduler != "fifo":
        label += f" [scheduler={scheduler}]"
    return label


def group_runs(tasks: Iterable[ReplayTask]) -> dict[str, dict[str, list[ReplayTask]]]:
    """Tasks per configuration (``config_key``), then per run id (a run is one independent repeat)."""
    out: dict[str, dict[str, list[ReplayTask]]] = {}
    for t in tasks:
        out.setdefault(config_key(t.cfg_label, t.path, t.scheduler), {}).setdefault(t.run_id or "(run)", []).append(t)
    return out


def write_task_times(runs: Sequence[RunReplay], path: str | Path) -> Path:
    """CSV of per-task start/complete under every policy (absolute ns, the input's clock)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = ["run_id", "policy", "correlation_id", "queue", "seq", "step", "layer_id", "start_ns", "complete_ns"]
    with out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for run in runs:
            for per in run.replays.values():
                for policy, rep in per.items():
                    for row in task_times(rep):
                        writer.writerow({"run_id": run.run_id, "policy": policy, **row})
    return out


def task_times(rep: QueueReplay) -> list[dict[str, int | str]]:
    """Per task start/complete (absolute ns, same clock as the input) of one queue replay."""
    q = rep.arrays
    return [
        {"correlation_id": t.correlation_id, "queue": t.queue, "seq": t.seq, "step": t.step,
         "layer_id": t.layer_id, "start_ns": rep.start[i] + q.t0, "complete_ns": rep.complete[i] + q.t0}
        for i, t in enumerate(q.tasks)
    ]


def layer_completion(rep: QueueReplay) -> dict[tuple[int, int], int]:
    """(step, layer) -> load completion (absolute ns) of one queue replay."""
    q = rep.arrays
    return {(t.step, t.layer_id): rep.complete[i] + q.t0 for i, t in enumerate(q.tasks)}
