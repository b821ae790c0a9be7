"""``kvtrace async``: thin click shells over ``asynccheck.check`` / ``compare`` / ``doctor``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click
from rich.console import Console

from otel_kvtrace import config
from otel_kvtrace.asynccheck.analysis import check, compare
from otel_kvtrace.asynccheck.doctor import DoctorError, doctor
from otel_kvtrace.cli_options import output_options


class InputError(click.ClickException):
    """Bad input or an unreadable target: exit status 2."""

    exit_code = 2


@click.group("async")
def async_group() -> None:
    """Did async scheduling (异步调度) really take effect?

    `check` judges timelines (our traces or msServiceProfiler outputs); `doctor` checks a live
    process's real environment and command line.
    """


def _parse_compare(items: Sequence[str]) -> dict[str, list[str]]:
    runs: dict[str, list[str]] = {}
    for item in items:
        label, sep, path = item.rpartition("=")
        if not sep or not label or not path:
            raise click.BadParameter(f"expected LABEL=PATH, got {item!r}", param_hint="--compare")
        if not Path(path).exists():
            raise click.BadParameter(f"{path}: no such file or directory", param_hint="--compare")
        runs.setdefault(label, []).append(path)
    return runs


@async_group.command("check")
@click.argument("paths", nargs=-1, type=click.Path(exists=True))
@click.option(
    "--compare",
    "compare_runs",
    multiple=True,
    metavar="LABEL=PATH",
    help="A labelled run (repeat; same label twice = more files of that run). Rows keep this order.",
)
@output_options(json="Also write the result as JSON here.",
                png_dir="Write the curves (step interval, request latency, overlap timeline) as PNG files here.",
                html="Write one self-contained HTML page here.")
def check_command(paths: tuple[str, ...], compare_runs: tuple[str, ...], json_path: Path | None,
                  png_dir: Path | None, html_path: Path | None) -> None:
    """Decide from timelines whether schedule(n+1) overlaps execute(n).

    PATHS are files or directories of one capture: our traces (./kvtrace-data/async/*.jsonl) and/or
    msServiceProfiler outputs (chrome_tracing.json, forward.csv, batch.csv, profiler.db,
    ms_service_*.db, ascend_service_profiler_*.db, request.csv, service_profiling_symbols*.yaml), of
    either parser generation. Verdict: effective / not effective / cannot tell, with reasons, and the
    outcome (step interval, request latency, throughput). PATHS holding several runs get one verdict
    per run, and a run of several engine processes (data parallel) one verdict per process.

    \b
    Example:
      kvtrace async check ./kvtrace-data/async
      kvtrace async check ./msprof_out/ --png-dir plots/ --html async.html
      kvtrace async check --compare baseline=run0/ --compare +TASK_QUEUE_ENABLE=2=run1/ \\
                          --compare +--async-scheduling=run2/ --json ladder.json
    """
    console = Console()
    if compare_runs and paths:
        raise click.UsageError("give PATHS for one run or --compare LABEL=PATH for several, not both")
    if not compare_runs and not paths:
        raise click.UsageError("give capture PATHS or --compare LABEL=PATH")
    from otel_kvtrace.asynccheck.render import render_check, render_compare

    from otel_kvtrace.asynccheck.runs import NothingToCheckError, SeveralRunsError

    from otel_kvtrace.asynccheck.tables import connect

    con = connect()
    try:
        if compare_runs:
            results = compare(_parse_compare(compare_runs), json_path=json_path, con=con)
            render_compare(results, console)
        else:
            try:
                results = [check(list(paths), json_path=json_path, con=con)]
                render_check(results[0], console)
            except SeveralRunsError as exc:
                if exc.runs is None:
                    raise
                console.print(f"[bold]{exc}[/] (use --compare LABEL=PATH to choose labels and order)")
                con = connect()
                results = compare(exc.runs, json_path=json_path, con=con)
                render_compare(results, console)
    except (NothingToCheckError, SeveralRunsError) as exc:
        raise InputError(str(exc)) from None
    if png_dir or html_path:
        from otel_kvtrace.asynccheck.curves import curve_pngs, write_html
        from otel_kvtrace.report.plots import write_png_files

        pngs = curve_pngs(con, results)
        if png_dir:
            for path in write_png_files(pngs, png_dir):
                console.print(f"wrote {path}")
        if html_path:
            console.print(f"wrote {write_html(pngs, results, html_path)}")


@async_group.command("replica")
@click.option("--mode", type=click.Choice(["sync", "async", "serialised"]), multiple=True,
              help="Engine loop(s) to run (repeat; default all three).")
@click.option("--steps", "num_steps", type=click.IntRange(min=1), default=24, show_default=True, help="Engine steps.")
@click.option("--comm-overlap", is_flag=True, help="Run each layer's all-reduce under the next layer's compute.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=str(config.DEFAULT_ASYNC_DIR), show_default=True,
              help="Directory for the trace files.")
def replica_command(mode: tuple[str, ...], num_steps: int, comm_overlap: bool, out_dir: str) -> None:
    """Run the engine-loop replica (virtual clock, fake device) and write traces for `check`.

    \b
    Example:
      kvtrace async replica --mode sync --mode async
      kvtrace async check --compare sync=kvtrace-data/async/kvtrace-async-replica-sync.jsonl \\
                          --compare async=kvtrace-data/async/kvtrace-async-replica-async.jsonl
    """
    from otel_kvtrace.asynccheck.replica import ReplicaConfig, run_replica

    for m in mode or ("sync", "async", "serialised"):
        path = run_replica(ReplicaConfig(mode=m, num_steps=num_steps, comm_overlap=comm_overlap), out_dir=Path(out_dir))
        click.echo(f"{m}: {path}")


@async_group.command("doctor")
@click.option("--pid", type=int, help="Live process to inspect (reads /proc/PID/environ and cmdline).")
@click.option("--cmdline", help='Command line to inspect instead, e.g. "vllm serve M --async-scheduling".')
@click.option("--env-file", type=click.Path(dir_okay=False), help="KEY=VALUE environment (added on top).")
@click.option("--log", type=click.Path(dir_okay=False), help="Server log to scan for async confirmation lines.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the report as JSON here.")
def doctor_command(
    pid: int | None, cmdline: str | None, env_file: str | None, log: str | None, json_path: str | None
) -> None:
    """Check a serving process's real async-scheduling configuration, with a fix per finding.

    Reports MINDIE_ASYNC_SCHEDULING_ENABLE, TASK_QUEUE_ENABLE, ASCEND_LAUNCH_BLOCKING,
    --async-scheduling / --no-async-scheduling, conflicts (splitfuse, profiler hooks), installed versions
    and the log lines that confirm async is on. Exit status 2 for a missing or unreadable process.

    \b
    Example:
      kvtrace async doctor --pid $(pgrep -f "vllm serve") --log server.log
      kvtrace async doctor --cmdline "vllm serve Qwen3 --no-async-scheduling" --env-file deploy.env
    """
    try:
        report = doctor(pid=pid, cmdline=cmdline, env_file=env_file, log=log, json_path=json_path)
    except DoctorError as exc:
        raise InputError(str(exc)) from None
    from otel_kvtrace.asynccheck.render import render_doctor

    render_doctor(report, Console())
