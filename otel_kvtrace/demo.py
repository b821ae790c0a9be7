"""``kvtrace demo``: run the threaded replica, traced, and summarise what the traces show.

Two real-clock scenarios by default: ``hol`` (main, N=8, B=2, P=4, independent layers 0 and 4, a slow
save on layer 1: an independent task sits ready behind a head waiting for a save) and ``fifo-optimal``
(the same pipeline with the uniform layout, where FIFO is already readiness-optimal). Each scenario is
instrumented through ``otel_kvtrace.api.start_tracing`` and exported as OTLP/JSON lines under ``out``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import click
import orjson

from otel_kvtrace import config
from otel_kvtrace.replica.config import ReplicaConfig, ReplicaConfigError, SlowInjection
from otel_kvtrace.replica.threaded import ThreadedResult, replica_targets, run_threaded
from otel_kvtrace.schedule import MERGED_LIVE

PRESETS: dict[str, ReplicaConfig] = {
    "hol": ReplicaConfig(
        behaviour="main", path="gva", num_layers=8, num_shared_buffers=2, prefetch_layers=4,
        independent_layers=(0, 4), requests_per_step=2, steps=150,
        slow=SlowInjection(slow_save_layers=(1,), slow_save_us=3000.0),
    ),
    "fifo-optimal": ReplicaConfig(
        behaviour="main", path="gva", num_layers=8, num_shared_buffers=2, prefetch_layers=4,
        independent_layers=(0,), requests_per_step=2, steps=150,
    ),
    "buckets": ReplicaConfig(
        behaviour="main", path="gva", num_layers=12, num_shared_buffers=2, prefetch_layers=4,
        bucket_pattern="aab", requests_per_step=2, steps=100,
        slow=SlowInjection(slow_save_layers=(4,), slow_save_us=3000.0),
    ),
    "slow-slot": ReplicaConfig(
        behaviour="main", path="gva", num_layers=8, num_shared_buffers=2, prefetch_layers=4,
        requests_per_step=2, steps=150,
        slow=SlowInjection(slow_slot_release_layers=(3,), slow_slot_release_us=6000.0),
    ),
}
DEFAULT_PAIR = ("hol", "fifo-optimal")
PRESET_CHOICES = ("both", "all", *PRESETS)
STAGE_ORDER = (
    "queue_wait", "save_cpu_wait", "save_npu_sync", "gate_cond_wait", "gate_npu_sync", "meta_build",
    "h2d_stagger", "slot_release_wait", "backend_submit", "completion", "consumer_wait",
)


@dataclass(slots=True)
class StageStats:
    name: str
    count: int
    p50_ms: float
    p99_ms: float


@dataclass(slots=True)
class ScenarioResult:
    """One traced scenario: its config, run id, the replica's own result and what the traces contain."""

    name: str
    config: ReplicaConfig
    run_id: str
    replica: ThreadedResult
    trace_files: list[Path]
    recv_tasks: int
    send_tasks: int
    stages: list[StageStats]
    wall_s: float


@dataclass(slots=True)
class DemoResult:
    out_dir: Path
    scenarios: list[ScenarioResult] = field(default_factory=list)


def scenario_configs(
    preset: str = "both",
    *,
    layers: int | None = None,
    buffers: int | None = None,
    prefetch: int | None = None,
    independent: str | Sequence[int] | None = None,
    requests: int | None = None,
    steps: int | None = None,
    seed: int = 0,
    behaviour: str | None = None,
    path: str | None = None,
    scheduler: str = "fifo",
) -> list[tuple[str, ReplicaConfig]]:
    """The preset's scenarios with the given overrides applied (and validated) to each."""
    if preset not in PRESET_CHOICES:
        raise ReplicaConfigError(f"preset: must be one of {PRESET_CHOICES}, got {preset!r}")
    names = list(DEFAULT_PAIR) if preset == "both" else list(PRESETS) if preset == "all" else [preset]
    out = []
    for name in names:
        cfg = PRESETS[name]
        changes: dict[str, Any] = {"seed": seed, "scheduler": scheduler}
        if behaviour is not None:
            changes["behaviour"] = behaviour
        if path is not None:
            changes["path"] = path
        if layers is not None:
            changes["num_layers"] = layers
            # slow injections name layers: keep only those that still exist
            slow = cfg.slow
            changes["slow"] = replace(
                slow,
                slow_save_layers=tuple(x for x in slow.slow_save_layers if x < layers),
                slow_slot_release_layers=tuple(x for x in slow.slow_slot_release_layers if x < layers),
            )
        if buffers is not None:
            changes["num_shared_buffers"] = buffers
        if prefetch is not None:
            changes["prefetch_layers"] = prefetch
        if independent is not None:
            changes["independent_layers"] = parse_independent(independent)
        if requests is not None:
            changes["requests_per_step"] = requests
        if steps is not None:
            changes["steps"] = steps
        if layers is not None and independent is None and not isinstance(cfg.independent_layers, str):
            # the preset's independent layers may not exist any more
            kept = tuple(x for x in cfg.independent_layers if -layers <= x < layers)
            changes["independent_layers"] = kept or (0,)
        out.append((name, cfg.with_(**changes)))
    return out


def parse_independent(value: str | Sequence[int]) -> tuple[int, ...] | str:
    """``"0,4"`` -> ``(0, 4)``; ``"all"`` stays ``"all"``."""
    if not isinstance(value, str):
        return tuple(int(v) for v in value)
    text = value.strip()
    if text == "all":
        return "all"
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ReplicaConfigError(f"independent_layers: expected e.g. '0,4' or 'all', got {value!r}") from None


def run_demo(
    preset: str = "both",
    *,
    layers: int | None = None,
    buffers: int | None = None,
    prefetch: int | None = None,
    independent: str | Sequence[int] | None = None,
    requests: int | None = None,
    steps: int | None = None,
    seed: int = 0,
    behaviour: str | None = None,
    path: str | None = None,
    scheduler: str = "fifo",
    out: str | Path | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> DemoResult:
    """Run the preset's scenarios on real threads, traced into ``out``; returns what was written.

    ``on_progress(scenario, steps_done, steps_total)`` is called after every step.
    """
    scenarios = scenario_configs(
        preset, layers=layers, buffers=buffers, prefetch=prefetch, independent=independent,
        requests=requests, steps=steps, seed=seed, behaviour=behaviour, path=path, scheduler=scheduler,
    )
    out_dir = Path(out if out is not None else config.data_dir())
    result = DemoResult(out_dir)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    for name, cfg in scenarios:
        run_id = f"demo-{name}-{stamp}-s{seed}"
        t0 = time.perf_counter()
        session = _start_tracing(cfg, run_id, out_dir)
        try:
            replica = run_threaded(cfg, keep_log=False, on_step=_step_callback(on_progress, name, cfg.steps))
        finally:
            session.shutdown()
        wall = time.perf_counter() - t0
        files = sorted((out_dir / "traces").glob(f"kvtrace-{run_id}-*.jsonl"))
        recv_n, send_n, stages = summarise_trace_files(files)
        result.scenarios.append(ScenarioResult(name, cfg, run_id, replica, files, recv_n, send_n, stages, wall))
        if replica.error is not None:
            raise RuntimeError(f"scenario {name} failed: {replica.error!r}") from replica.error
    return result


def _step_callback(
    on_progress: Callable[[str, int, int], None] | None, name: str, total: int
) -> Callable[[int], None] | None:
    if on_progress is None:
        return None
    return lambda step: on_progress(name, step + 1, total)


def _start_tracing(cfg: ReplicaConfig, run_id: str, out_dir: Path) -> Any:
    """The one place the demo turns tracing on (``otel_kvtrace.api``)."""
    from otel_kvtrace.api import start_tracing

    # The fake NPU supports timing-enabled events, so device times are exact (HOL "proven", not "possible").
    return start_tracing(
        replica_targets(cfg.behaviour), resource=cfg.resource_attributes(), out_dir=out_dir, run_id=run_id,
        npu_timing=True,
    )


def summarise_trace_files(files: Sequence[Path]) -> tuple[int, int, list[StageStats]]:
    """Recv/save task counts and per-stage p50/p99 of recv tasks, read back from exported OTLP/JSON lines."""
    recv_traces: set[str] = set()
    send = 0
    children: list[tuple[str, str, int]] = []
    for path in files:
        with open(path, "rb") as fh:
            for line in fh:
                doc = orjson.loads(line)
                for rs in doc.get("resourceSpans", ()):
                    for ss in rs.get("scopeSpans", ()):
                        for span in ss.get("spans", ()):
                            name = span.get("name", "")
                            if name == "kvtrace.recv.task":
                                recv_traces.add(span["traceId"])
                            elif name == "kvtrace.send.task":
                                send += 1
                            elif name in STAGE_ORDER:
                                dur = int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])
                                children.append((span["traceId"], name, dur))
    durations: dict[str, list[int]] = {}
    for trace_id, name, dur in children:
        if trace_id in recv_traces:
            durations.setdefault(name, []).append(dur)
    stats = []
    for name in STAGE_ORDER:
        values = durations.get(name)
        if values:
            stats.append(StageStats(name, len(values), _pct(values, 50) / 1e6, _pct(values, 99) / 1e6))
    return len(recv_traces), send, stats


def _pct(values: list[int], q: int) -> float:
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def print_demo_summary(result: DemoResult, console: Any = None) -> None:
    """Rich tables: per scenario tasks and per-stage p50/p99; then the HOL report if available."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    for sc in result.scenarios:
        table = Table(title=Text(f"{sc.name}: {sc.config.label}  (run {sc.run_id})", style="table.title"), title_justify="left")
        table.add_column("stage")
        table.add_column("spans", justify="right")
        table.add_column("p50 ms", justify="right")
        table.add_column("p99 ms", justify="right")
        for st in sc.stages:
            table.add_row(Text(st.name), str(st.count), f"{st.p50_ms:.3f}", f"{st.p99_ms:.3f}")
        console.print(table)
        console.print(
            f"  recv tasks {sc.recv_tasks}, save tasks {sc.send_tasks}, steps {sc.replica.steps_done}, "
            f"wall {sc.wall_s:.1f} s, files: {', '.join(str(p) for p in sc.trace_files)}", markup=False, highlight=False
        )
    if any(sc.trace_files for sc in result.scenarios):
        _print_hol_report(result, console)
        console.print(f"Traces in {result.out_dir}/traces. Next: `kvtrace report {result.out_dir}/traces`.",
                      markup=False, highlight=False)
    else:
        console.print(_where_traces_went(), markup=False, highlight=False)


def _where_traces_went() -> str:
    """Why no file was written: the exporter chose another sink from the environment, as any OTel SDK."""
    from otel_kvtrace import config

    if config.sdk_disabled():
        return (f"No traces written: {config.OTEL_SDK_DISABLED}=true discards them. Unset it to get files "
                "under --out.")
    endpoint = config.otlp_endpoint()
    if endpoint:
        return (f"No trace files: the traces were sent to the OTLP endpoint {endpoint} "
                f"({config.OTEL_EXPORTER_OTLP_ENDPOINT} or {config.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT} is set), "
                "so there is nothing local to summarise. Look there (e.g. Jaeger), or unset the variable to "
                "write files under --out.")
    return "No trace files were written (see the log above)."


def _print_hol_report(result: DemoResult, console: Any) -> None:
    """HOL per scenario through the analysis package (DuckDB over the files just written)."""
    try:
        from otel_kvtrace.report import print_summary
    except ImportError:  # pragma: no cover - the report package ships with otel_kvtrace
        console.print("(HOL summary unavailable: run `kvtrace report` on the traces)")
        return
    files = [path for sc in result.scenarios for path in sc.trace_files]
    if files:
        print_summary(files, console=console)


@click.command("demo")
@click.option("--preset", type=click.Choice(PRESET_CHOICES), default="both", show_default=True,
              help="Scenarios: hol, fifo-optimal, both (those two), buckets, slow-slot, or all.")
@click.option("--layers", type=int, help="Number of layers N.")
@click.option("--buffers", type=int, help="layerwise_num_shared_buffers B.")
@click.option("--prefetch", type=int, help="layerwise_prefetch_layers P.")
@click.option("--independent", help="layerwise_independent_layers, e.g. '0,4' or 'all'.")
@click.option("--requests", type=int, help="Requests per step.")
@click.option("--steps", type=int, help="Forward steps per scenario.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for sampled durations.")
@click.option("--behaviour", type=click.Choice(["main", "v0.23"]),
              help="Upstream behaviour to replicate (default: the preset's, main).")
@click.option("--path", "path", type=click.Choice(["gva", "key"]), help="Recv path (default: the preset's, gva).")
@click.option("--scheduler", type=click.Choice(list(MERGED_LIVE)), default="fifo", show_default=True,
              envvar=config.OTEL_KVTRACE_SCHEDULER, help="Recv-thread policy the replica runs (env: OTEL_KVTRACE_SCHEDULER).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output directory (traces go to OUT/traces). Default: $OTEL_KVTRACE_DATA_DIR, else "
                   "./kvtrace-data (otel_kvtrace.config.data_dir).")
def demo_command(preset: str, layers: int | None, buffers: int | None, prefetch: int | None,
                 independent: str | None, requests: int | None, steps: int | None, seed: int,
                 behaviour: str | None, path: str | None, scheduler: str, out: str | None) -> None:
    """Run the CPU replica of the layerwise KV pipeline, traced, and summarise it.

    Runs real threads on a fake NPU, instrumented exactly like vLLM-Ascend, and writes one OTLP/JSON
    trace file per scenario under OUT/traces. Takes a few seconds with the defaults.

    hol: main, N=8, B=2, P=4, independent layers 0,4 and a 3 ms slow save on layer 1, so the
    independent task of layer 4 sits ready behind layer 3, which waits for save(1).
    fifo-optimal: the same pipeline with the uniform layout (independent layer 0), where FIFO is
    already readiness-optimal. buckets: two cache-spec buckets (kinds "aab") with a slow save on layer
    4, so a task of the other bucket is ready behind the head. slow-slot: the uniform layout with the
    external slot of layer 3 freed 6 ms into each step. Overrides apply to every scenario of the preset.
    The summary shows per-stage p50/p99 of the recv tasks and the HOL table of `kvtrace report`.
    With OTEL_EXPORTER_OTLP_ENDPOINT set the traces go to that endpoint, as with any OTel SDK, and the
    demo says so instead of summarising files it did not write.

    \b
    Example:
        kvtrace demo
        kvtrace demo --preset hol --layers 16 --buffers 4 --prefetch 8 --independent 0,8 --steps 100
        kvtrace demo --behaviour v0.23 --out /tmp/kvtrace-v023
        kvtrace demo --preset hol --scheduler ready_queue --out /tmp/kvtrace-rq
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    try:
        configs = scenario_configs(preset, layers=layers, buffers=buffers, prefetch=prefetch,
                                   independent=independent, requests=requests, steps=steps, seed=seed,
                                   behaviour=behaviour, path=path, scheduler=scheduler)
    except ReplicaConfigError as exc:
        raise click.BadParameter(str(exc)) from exc
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        bars = {name: progress.add_task(f"{name}: {cfg.label}", total=cfg.steps) for name, cfg in configs}

        def on_progress(name: str, done: int, total: int) -> None:
            progress.update(bars[name], completed=done)

        result = run_demo(preset, layers=layers, buffers=buffers, prefetch=prefetch, independent=independent,
                          requests=requests, steps=steps, seed=seed, behaviour=behaviour, path=path,
                          scheduler=scheduler, out=out,
                          on_progress=on_progress)
    print_demo_summary(result, console)
