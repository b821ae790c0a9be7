"""The coverage sweep: a matrix of replica configurations, >= 3 seeded repeats per cell, a verdict per cell.

Each cell run simulates the configuration on the replica's virtual clock, replays its recv tasks under
every policy and stores the run's summary as ``<out>/cells/<cell>/seed<k>.json``. A run whose file
exists is loaded, not rerun, so an interrupted sweep resumes where it stopped. Optionally one chosen
cell is confirmed on the real clock (threaded replica, traced, loaded through DuckDB, replayed).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from otel_kvtrace import config
from otel_kvtrace.whatif.replay import RunSummary, replay_run
from otel_kvtrace.whatif.task import tasks_from_records
from otel_kvtrace.whatif.verdict import ConfigVerdict, decide

STRESSES = ("none", "slow_save", "slow_slot")
"""``none``: uniform timing; ``slow_save``: the save of layer 1 takes 3 ms longer; ``slow_slot``: the
external slot of layer 3 is released 3 ms late (every step)."""


class SweepError(ValueError):
    """A sweep option is unusable; the message names the option."""


@dataclass(slots=True, frozen=True)
class SweepCell:
    """One configuration of the matrix (``None`` means the upstream default)."""

    path: str = "gva"
    prefetch_layers: int | None = None
    num_shared_buffers: int | None = None
    buffer_reuse: bool = True
    independent_layers: tuple[int, ...] = (0,)
    requests_per_step: int = 1
    stress: str = "none"

    @property
    def slug(self) -> str:
        indep = "_".join(str(i) for i in self.independent_layers)
        return (f"{self.path}-P{self.prefetch_layers or 'def'}-B{self.num_shared_buffers or 'def'}-"
                f"reuse{'on' if self.buffer_reuse else 'off'}-indep{indep}-r{self.requests_per_step}-{self.stress}")

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


def _stress(name: str, num_layers: int) -> Any:
    from otel_kvtrace.replica.config import SlowInjection

    if name == "none":
        return SlowInjection()
    if name == "slow_save":
        return SlowInjection(slow_save_layers=(min(1, num_layers - 1),), slow_save_us=3000.0)
    if name == "slow_slot":
        return SlowInjection(slow_slot_release_layers=(min(3, num_layers - 1),), slow_slot_release_us=3000.0)
    raise SweepError(f"stress: must be one of {STRESSES}, got {name!r}")


def default_base() -> Any:
    """The replica configuration every cell starts from: 8 layers, 4 steps, lognormal jitter (20%)."""
    from otel_kvtrace.replica.config import ReplicaConfig, Timing

    return ReplicaConfig(num_layers=8, steps=4, timing=Timing(jitter="lognormal", jitter_spread=0.2))


def cell_config(cell: SweepCell, seed: int, base: Any = None) -> Any:
    """The ``ReplicaConfig`` of one cell run."""
    base = base if base is not None else default_base()
    return base.with_(
        path=cell.path, prefetch_layers=cell.prefetch_layers, num_shared_buffers=cell.num_shared_buffers,
        buffer_reuse=cell.buffer_reuse, independent_layers=cell.independent_layers,
        requests_per_step=cell.requests_per_step, slow=_stress(cell.stress, base.num_layers), seed=seed,
    )


@dataclass(slots=True)
class SweepMatrix:
    """The axes of the coverage matrix. ``cells()`` is their product with irrelevant axes collapsed:
    the key path has no buffer reuse (B, reuse and independent layers do not apply); without effective
    reuse (reuse off, or B = N) the independent layers do not apply."""

    paths: tuple[str, ...] = ("gva", "key")
    prefetch: tuple[int | None, ...] = (None, 2, 4)
    buffers: tuple[int | None, ...] = (None, 2, 4)
    reuse: tuple[bool, ...] = (True, False)
    independent: tuple[tuple[int, ...], ...] = ((0,), (0, 4))
    requests: tuple[int, ...] = (1, 2, 4)
    stresses: tuple[str, ...] = ("none", "slow_save", "slow_slot")
    repeats: int = 3

    @classmethod
    def quick(cls) -> SweepMatrix:
        """A handful of cells for tests and smoke runs."""
        return cls(paths=("gva",), prefetch=(4,), buffers=(2,), reuse=(True,), independent=((0,), (0, 4)),
                   requests=(2,), stresses=("slow_save",), repeats=3)

    def validate(self, base: Any) -> None:
        if self.repeats < 1:
            raise SweepError(f"repeats: must be >= 1, got {self.repeats}")
        for s in self.stresses:
            _stress(s, base.num_layers)
        for p in self.paths:
            if p not in ("gva", "key"):
                raise SweepError(f"paths: unknown path {p!r} (gva, key)")

    def cells(self, base: Any = None) -> list[SweepCell]:
        base = base if base is not None else default_base()
        n = base.num_layers
        out: dict[SweepCell, None] = {}
        for path, p, b, reuse, indep, req, stress in itertools.product(
                self.paths, self.prefetch, self.buffers, self.reuse, self.independent, self.requests, self.stresses):
            if path == "key":
                b, reuse, indep = None, False, (0,)
            elif not reuse or b is None or b >= n:
                indep = (0,)
            out[SweepCell(path, p, b, reuse, tuple(indep), req, stress)] = None
        return list(out)


@dataclass(slots=True)
class SweepResult:
    """What ``run_sweep`` produced: a verdict per cell, and how many runs were computed or resumed."""

    out_dir: Path
    verdicts: list[ConfigVerdict]
    ran: int
    resumed: int
    confirmation: ConfigVerdict | None = None
    cells: list[SweepCell] = field(default_factory=list)
    quick: bool = False
    steps: int = 0
    repeats: int = 0

    @property
    def evidence(self) -> str:
        """What every cell's verdict rests on (said next to each switch, never left implicit)."""
        kind = "quick matrix, " if self.quick else ""
        return f"{kind}virtual clock, {self.steps} steps x {self.repeats} seeds per cell"


def _cell_dir(out_dir: Path, cell: SweepCell) -> Path:
    digest = hashlib.sha1(json.dumps(cell.to_dict(), sort_keys=True).encode()).hexdigest()[:8]
    return out_dir / "cells" / f"{cell.slug}-{digest}"


def run_cell(cell: SweepCell, seed: int, base: Any = None) -> RunSummary:
    """Simulate one cell run on the virtual clock and replay it under every policy."""
    from otel_kvtrace.replica.simulate import simulate

    cfg = cell_config(cell, seed, base)
    result = simulate(cfg, run_id=f"sweep-{cell.slug}-s{seed}")
    if result.error:
        raise RuntimeError(f"cell {cell.slug} seed {seed}: replica failed: {result.error}")
    tasks = tasks_from_records(result.recv, run_id=f"{cell.slug}-s{seed}", cfg_label=cfg.label)
    return replay_run(tasks).summary()


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a killed sweep never leaves a half-written cell


def reproduce_command(out_dir: Path, quick: bool, repeats: int = 3, confirm: bool = False) -> str:
    """The exact ``kvtrace sweep`` command that reproduces (or resumes) this sweep."""
    return (f"kvtrace sweep --out {out_dir}{' --quick' if quick else ''}"
            f"{f' --repeats {repeats}' if repeats != 3 else ''}{' --confirm' if confirm else ''} --report")


def run_sweep(
    out_dir: str | Path = config.DEFAULT_SWEEP_DIR,
    *,
    matrix: SweepMatrix | None = None,
    quick: bool = False,
    base: Any = None,
    confirm: bool = False,
    on_progress: Callable[[str, int, int, bool], None] | None = None,
) -> SweepResult:
    """Run (or resume) the coverage sweep and decide each cell.

    ``on_progress(cell_slug, done, total, resumed)`` is called after every cell run. ``confirm`` reruns
    the most interesting cell (the best switch verdict, else the most HOL) on the real clock.
    """
    matrix = matrix or (SweepMatrix.quick() if quick else SweepMatrix())
    base = base if base is not None else default_base()
    matrix.validate(base)
    out = Path(out_dir)
    cells = matrix.cells(base)
    total = len(cells) * matrix.repeats
    done = ran = resumed = 0
    verdicts: list[ConfigVerdict] = []
    for cell in cells:
        cdir = _cell_dir(out, cell)
        _write_json(cdir / "cell.json", {"cell": cell.to_dict(), "config": cell_config(cell, 0, base).label})
        runs: list[RunSummary] = []
        for seed in range(matrix.repeats):
            path = cdir / f"seed{seed}.json"
            was_resumed = path.exists()
            if was_resumed:
                runs.append(RunSummary.from_dict(json.loads(path.read_text())))
                resumed += 1
            else:
                summary = run_cell(cell, seed, base)
                _write_json(path, summary.to_dict())
                runs.append(summary)
                ran += 1
            done += 1
            if on_progress is not None:
                on_progress(cell.slug, done, total, was_resumed)
        cfg = cell_config(cell, 0, base)
        v = decide(runs, cfg_label=cfg.label, config={**cell.to_dict(), "label": cfg.label,
                                                       "num_layers": cfg.num_layers, "steps": cfg.steps},
                   reproduce=reproduce_command(out, quick, matrix.repeats, confirm))
        v.extra["slug"] = cell.slug
        v.extra["path"] = cell.path
        v.extra["hol_example"] = next((r.hol_example for r in runs if r.hol_example), "")
        verdicts.append(v)
    confirmation = None
    if confirm and cells:
        confirmation = confirm_cell(pick_confirmation(verdicts, cells), out, base, repeats=matrix.repeats,
                                   reproduce=reproduce_command(out, quick, matrix.repeats, confirm))
    result = SweepResult(out, verdicts, ran, resumed, confirmation, cells, quick, base.steps, matrix.repeats)
    _qualify(result)
    return result


def _qualify(result: SweepResult) -> None:
    """A virtual-clock switch is a candidate, not a verdict: say what it rests on, and what the real clock
    said when the cell was confirmed (the virtual clock has no measurement noise, so its noise floor is
    lower than a recorded run's and a gain can clear it there and not on a real server)."""
    conf = result.confirmation
    for v in result.verdicts:
        v.extra["evidence"] = result.evidence
        if v.verdict == "keep FIFO":
            continue
        v.reason += (f" [{result.evidence}: a candidate, not final; confirm with `kvtrace sweep --confirm` or "
                     "`kvtrace whatif` on recorded runs]")
        if conf is not None and conf.extra.get("slug") == v.extra.get("slug") and conf.verdict != v.verdict:
            v.reason += f" [real-clock confirmation disagrees: {conf.verdict}: {conf.reason}]"


SWEEP_FACTORS = ("path", "prefetch_layers", "num_shared_buffers", "buffer_reuse", "independent_layers",
                 "requests_per_step", "stress")


def sweep_summary(result: SweepResult) -> dict[str, Any]:
    """The summary the sweep shows first: which factors produce HOL and by how much (main effects, and
    the B x P interaction, each with its noise), how many cells have stable HOL, and the overall verdict."""
    from otel_kvtrace.experiment.analysis import factor_effects, verdict

    cells = [{"config": {f: v.config.get(f) for f in SWEEP_FACTORS}, "run_values": {"hol_total_ms": list(v.hol_ms)}}
             for v in result.verdicts]
    effects = factor_effects(cells, SWEEP_FACTORS, ["hol_total_ms"], pairs=[("num_shared_buffers", "prefetch_layers")])
    stable = [v for v in result.verdicts if v.hol_events and all(n > 0 for n in v.hol_events)]
    switch = [v for v in result.verdicts if v.verdict != "keep FIFO"]
    conf = result.confirmation
    if not switch:
        overall = f"keep FIFO in all {len(result.verdicts)} cells ({result.evidence})"
    else:
        names = ", ".join(sorted({v.verdict for v in switch}))
        overall = (f"{len(switch)} of {len(result.verdicts)} cells are switch candidates ({names}) on the "
                   f"{result.evidence}; not final: confirm with --confirm or `kvtrace whatif` on recorded runs")
        if conf is not None:
            overall += f"; real-clock confirmation of {conf.extra.get('slug')}: {conf.verdict} ({conf.reason})"
    return {"evidence": result.evidence, "cells": len(result.verdicts), "stable_hol_cells": len(stable),
            "switch_candidates": len(switch), "hol_factors": verdict(effects, "hol_total_ms"),
            "factor_effects": effects, "verdict": overall}


def summary_lines(summary: dict[str, Any]) -> list[str]:
    return [f"Summary ({summary['evidence']}): {summary['stable_hol_cells']} of {summary['cells']} cells have "
            f"HOL in every seed.", f"What produces HOL: {summary['hol_factors']}.", f"Verdict: {summary['verdict']}."]


def pick_confirmation(verdicts: Sequence[ConfigVerdict], cells: Sequence[SweepCell]) -> SweepCell:
    """The cell worth a real-clock run: the best switch verdict, else the one with the most HOL."""
    def score(v: ConfigVerdict) -> tuple[int, float]:
        gain = max((g["lower_bound_ms"] for g in v.gains.values()), default=0.0)
        return (1 if v.verdict != "keep FIFO" else 0, gain if v.verdict != "keep FIFO" else sum(v.hol_ms))

    best = max(range(len(verdicts)), key=lambda i: score(verdicts[i]))
    return cells[best]


def confirm_cell(cell: SweepCell, out_dir: Path, base: Any = None, *, repeats: int = 3,
                 reproduce: str = "") -> ConfigVerdict:
    """Run ``cell`` on the real clock (threaded replica, traced to OTLP/JSON with NPU timing, loaded
    into DuckDB) ``repeats`` times, replay the loaded ``tasks`` table and decide, exactly as
    ``kvtrace whatif`` does on recorded traces."""
    from otel_kvtrace.api import start_tracing
    from otel_kvtrace.load import load_traces
    from otel_kvtrace.replica.threaded import replica_targets, run_threaded
    from otel_kvtrace.whatif.task import tasks_from_duckdb

    runs: list[RunSummary] = []
    trace_dir = out_dir / "realclock" / cell.slug
    for seed in range(repeats):
        cfg = cell_config(cell, seed, base)
        run_id = f"confirm-{cell.slug}-s{seed}"
        session = start_tracing(replica_targets(cfg.behaviour), resource=cfg.resource_attributes(),
                                out_dir=trace_dir, run_id=run_id, npu_timing=True)
        try:
            result = run_threaded(cfg)
        finally:
            session.shutdown()
        if result.error is not None:
            raise RuntimeError(f"real-clock run of {cell.slug} failed: {result.error!r}")
        loaded = load_traces(sorted((trace_dir / "traces").glob(f"kvtrace-{run_id}-*.jsonl")))
        tasks = tasks_from_duckdb(loaded.con, where="path IS NOT NULL")
        tasks = [replace(t, run_id=run_id, cfg_label=cfg.label) for t in tasks]
        runs.append(replay_run(tasks).summary())
    v = decide(runs, cfg_label=cell_config(cell, 0, base).label, config={**cell.to_dict(), "clock": "real"},
               reproduce=reproduce or f"kvtrace sweep --out {out_dir} --confirm --report")
    v.extra["slug"] = cell.slug
    v.extra["clock"] = "real"
    return v
