"""``kvtrace report``: the command-line shell over ``build_report`` and the renderers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console

from otel_kvtrace import config
from otel_kvtrace.cli_options import option_group, output_options
from otel_kvtrace.load import LoadError

if TYPE_CHECKING:
    from otel_kvtrace.npu_profile import NpuProfile


_cache_options = option_group(
    click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=config.DEFAULT_CACHE_DIR,
                 show_default=True, help="Parquet cache of parsed traces, keyed on the inputs' size and mtime."),
    click.option("--no-cache", is_flag=True, help="Parse the JSON every time; write no cache."))

_npu_options = option_group(
    click.option("--npu-profile", "npu_paths", multiple=True, type=click.Path(exists=True, path_type=Path),
                 help="torch_npu profiler output (a *_ascend_pt or ASCEND_PROFILER_OUTPUT directory, or "
                      "trace_view.json / kernel_details.csv / communication.json): attention kernels, copies "
                      "and communication on the tasks' time axis. Repeatable."),
    click.option("--npu-offset-us", type=float, default=0.0, show_default=True,
                 help="Add this to the profiler's times (both clocks are the host's; see docs/analysis.md)."))


def _read_npu(console: Console, npu_paths: tuple[Path, ...], offset_us: float) -> NpuProfile | None:
    """The --npu-profile files, with what was skipped said on the console."""
    if not npu_paths:
        return None
    from otel_kvtrace.npu_profile import read_npu_profile

    try:
        npu = read_npu_profile(npu_paths, offset_ns=round(offset_us * 1000))
    except FileNotFoundError as exc:
        raise click.BadParameter(str(exc), param_hint="--npu-profile") from exc
    for problem in npu.skipped[:20]:
        console.print(f"skipped: {problem}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"NPU profile: {len(npu.events)} attention/copy/communication slices from "
                  f"{len(npu.files)} file(s); {npu.other_kernels} other kernels not shown; "
                  f"{len(npu.skipped)} record(s) skipped", soft_wrap=True)
    return npu


@click.command("report")
@click.argument("paths", nargs=-1, required=True)
@output_options(
    json="Write the machine-readable report (tasks, stages, hol with every interval) to this file.",
    png_dir="Write stage CDFs, the HOL duration histogram and per-queue timelines as PNG files here.",
    html="Write one self-contained HTML page (zoomable timeline, tables, plots) to this file.")
@_cache_options
@click.option("--db", "db_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also keep the tables in this DuckDB database, with one view per queries/*.sql, "
                   "for the DuckDB CLI (parses the JSON; the cache is not used).")
@click.option("--timeline-tasks", type=click.IntRange(min=10), default=1500, show_default=True,
              help="Tasks drawn in the timelines (a window around each queue's longest HOL event).")
@_npu_options
@click.option("--jaeger-url", help="Jaeger UI base URL (e.g. http://localhost:16686): --html links each task "
                                   "to its trace (trace ids derive from correlation ids).")
def report(paths: tuple[str, ...], json_path: Path | None, png_dir: Path | None, html_path: Path | None,
           cache_dir: Path, no_cache: bool, db_path: Path | None, timeline_tasks: int,
           npu_paths: tuple[Path, ...], npu_offset_us: float, jaeger_url: str | None) -> None:
    """Answer "is there head-of-line blocking, how often, how long, and what proves it?" for traces.

    PATHS are OTLP/JSON lines files (from the local sink or the OpenTelemetry Collector's file
    exporter), directories holding them, or globs; .gz files are read too.

    \b
    Example:
      kvtrace report ./kvtrace-data/traces --html report.html --json report.json
      kvtrace report 'runs/*/traces/*.jsonl.gz' --png-dir plots/
    """
    import duckdb

    from otel_kvtrace.analyse import install_views
    from otel_kvtrace.report import build_report, report as write_outputs
    from otel_kvtrace.report.html import check_jaeger_url

    console = Console(stderr=False)
    try:
        check_jaeger_url(jaeger_url)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--jaeger-url") from exc
    npu = _read_npu(console, npu_paths, npu_offset_us)
    if db_path:
        db_path.parent.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(db_path)) if db_path else None
    try:
        with console.status("loading traces ...") as status:
            result = build_report(list(paths), cache_dir=None if (no_cache or db_path) else cache_dir, con=con,
                                  timeline_tasks=timeline_tasks, progress=status.update, npu=npu)
    except LoadError as exc:
        raise click.BadParameter(str(exc), param_hint="PATHS") from exc
    written: list[Path] = []
    write_outputs(result, json=json_path, html=html_path, png_dir=png_dir, jaeger_url=jaeger_url, console=console,
                  written=written)
    from otel_kvtrace.resources.table import print_resources

    print_resources(result.resources, console)  # resource series beside the traces (serve-replica, collect)
    if db_path:
        install_views(con)
        con.close()
        console.print(f"DuckDB database with tables and query views: {db_path}", soft_wrap=True)
    for path in written:
        console.print(f"wrote {path}", markup=False, highlight=False, soft_wrap=True)


@click.command("export")
@click.argument("paths", nargs=-1, required=True)
@click.option("--perfetto", "perfetto_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Write Chrome Trace Event JSON here, the format ui.perfetto.dev, chrome://tracing and "
                   "MindStudio Insight read.")
@_cache_options
@_npu_options
def export_command(paths: tuple[str, ...], perfetto_path: Path, cache_dir: Path, no_cache: bool,
                   npu_paths: tuple[Path, ...], npu_offset_us: float) -> None:
    """Write the traces as a timeline for the viewers Ascend engineers already use.

    One process per run; per recv queue a recv-thread track (tasks, stages nested) and a HOL track;
    per process the forward and send threads; a flow arrow from each HOL head to the slice naming the
    ready task behind it; queue depth and in-flight counters.

    \b
    Example:
      kvtrace export --perfetto kv.perfetto.json ./kvtrace-data/traces
      kvtrace export --perfetto kv.json traces/ --npu-profile prof/rank0_ascend_pt
      # then open the file in https://ui.perfetto.dev (it stays on your machine)
    """
    from otel_kvtrace.load import load_traces
    from otel_kvtrace.report.perfetto import write_perfetto

    console = Console(stderr=False)
    npu = _read_npu(console, npu_paths, npu_offset_us)
    try:
        with console.status("loading traces ...") as status:
            loaded = load_traces(list(paths), cache_dir=None if no_cache else cache_dir, progress=status.update)
            status.update("writing the timeline ...")
            out = write_perfetto(loaded, perfetto_path, npu=npu)
    except LoadError as exc:
        raise click.BadParameter(str(exc), param_hint="PATHS") from exc
    console.print(f"Trace Event JSON ({loaded.stats.tasks} recv tasks): {out}", markup=False, highlight=False, soft_wrap=True)
