"""``kvtrace whatif`` and ``kvtrace sweep``: thin shells over ``whatif()``, ``run_sweep()`` and
``sweep_report()``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from otel_kvtrace import config
from otel_kvtrace.cli_options import output_options
from otel_kvtrace.whatif.engine import FEEDBACKS, ReplayStalled
from otel_kvtrace.whatif.measured import in_order_layers
from otel_kvtrace.whatif.policy import get_policy
from otel_kvtrace.whatif.task import BOUNDS


class ReplayStalledError(click.ClickException):
    """A replay could not finish (a policy bug or inconsistent input): exit 2 with the message, no traceback."""

    exit_code = 2


def _stalled(exc: ReplayStalled) -> ReplayStalledError:
    return ReplayStalledError(f"replay stalled: {exc}. The input or the policy is inconsistent; rerun that "
                              "configuration alone (--where \"cfg_label = '...'\") or without that --policy.")


def _print_summary(report) -> None:  # type: ignore[no-untyped-def]
    """One row per configuration: what was replayed, the FIFO check, HOL, and the verdict with its reason."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(report.title, style="table.title"), show_lines=True)
    table.add_column("configuration", ratio=2, overflow="fold")
    table.add_column("FIFO err %", justify="right")
    table.add_column("HOL/run", justify="right")
    table.add_column("verdict", ratio=3, overflow="fold")
    for v in report.verdicts:
        extra = ""
        if "requests_per_step" in v.config:
            extra = f" r={v.config['requests_per_step']} {v.config.get('stress', '')}"
        if v.config.get("clock") == "real":
            extra += " (real clock)"
        verdict = Text.assemble((str(v.verdict), "bold"), f": {v.reason}")  # labels and reasons are never markup
        table.add_row(Text(str(v.cfg_label) + extra), f"{v.fifo_median_error_pct:.2f}",
                      ",".join(str(n) for n in v.hol_events), verdict)
    console = Console()
    console.print(table)
    console.print(f"Reproduce: {report.reproduce}", soft_wrap=True, markup=False, highlight=False)


@click.command("whatif")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@output_options(
    json="Write the JSON verdict (each configuration: fifo_median_error_pct, verdict, evidence).",
    md="Write the Markdown report.",
    png_dir="Write whatif_ttft.png and whatif_gain.png here.",
    html="Write one self-contained HTML page (verdicts, evidence, charts inlined; opens offline).")
@click.option("--tasks-csv", type=click.Path(dir_okay=False, path_type=Path),
              help="Write per-task start/complete (ns) under every policy as CSV.")
@click.option("--policy", "policies", multiple=True,
              help="Policy to compare with FIFO (repeatable; default: all registered).")
@click.option("--feedback", type=click.Choice(FEEDBACKS), default="full", show_default=True,
              help="How gates/saves follow the replayed forward: both ways, or only later (conservative).")
@click.option("--bound", type=click.Choice(BOUNDS), default="hi", show_default=True,
              help="Bounded NPU times: upper bound (proven) or lower bound (possible).")
@click.option("--where", help="SQL filter on the tasks table, e.g. \"path = 'gva'\".")
@click.option("--measured", "measured", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Traces recorded under another policy (OTEL_KVTRACE_SCHEDULER): predicted vs measured (repeatable).")
def whatif_command(paths: tuple[Path, ...], json_path: Path | None, md_path: Path | None, png_dir: Path | None,
                   html_path: Path | None, tasks_csv: Path | None, policies: tuple[str, ...], feedback: str, bound: str,
                   where: str | None, measured: tuple[Path, ...]) -> None:
    """Replay recorded recv queues under fifo / ready_queue / gate_group and decide: keep FIFO or switch.

    PATHS are trace files or directories (OTLP/JSON lines). Runs (run_id) of one configuration
    (cfg_label) are its independent repeats. A switch needs, in this order: a validated FIFO replay
    (median error <= 5% of service time in every run), >= 3 runs, HOL in every run, a TTFT gain
    whose lower bound over runs is above run-to-run noise, and in every run p99 TTFT no more than
    1% above FIFO's and no increase of peak in-flight tasks.

    With --measured, the measured verdict's bounds are 95% confidence bounds of the mean: paired
    when the run ids name the same seeds (...-s<seed>), else Welch's two-sample bound over every
    run; it is printed also by the worst-pair rule of the prediction (seed pairs only).

    \b
    Example:
      kvtrace demo --out kvtrace-data
      kvtrace whatif kvtrace-data/traces --md verdict.md --json verdict.json --png-dir verdict/
      kvtrace whatif kvtrace-data/traces --html verdict.html   # one page to open or mail
      kvtrace demo --preset hol --seed 1 --out fifo && kvtrace demo --preset hol --seed 1 --scheduler ready_queue --out rq
      kvtrace whatif fifo/traces --measured rq/traces           # A/B: predicted vs measured
    """
    from otel_kvtrace.whatif.api import whatif

    try:
        report = whatif(list(paths), json_path=json_path, md_path=md_path, png_dir=png_dir, html_path=html_path,
                        tasks_csv=tasks_csv,
                        policies=list(policies) or None, feedback=feedback, bound=bound, where=where,
                        measured=list(measured) or None, progress=lambda m: click.echo(m, err=True))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    except ReplayStalled as exc:
        raise _stalled(exc) from exc
    _print_summary(report)
    if measured:
        _print_measured(report)


_SHOWN = (("TTFT mean ms", "ttft_ms_mean"), ("TTFT p99 ms", "ttft_ms_p99"),
          ("consumer wait ms/step", "consumer_wait_ms_per_step"), ("peak in-flight", "peak_inflight"),
          ("throughput tasks/s", "throughput_tasks_per_s"))


def _print_measured(report) -> None:  # type: ignore[no-untyped-def]
    """Per configuration and policy: predicted (from FIFO runs) vs measured (policy runs), noise, verdict."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    for v in report.verdicts:
        for c in v.extra.get("measured", []):
            table = Table(title=escape(f"{v.cfg_label}: {c['policy']} predicted vs measured"), show_lines=False)
            for col in ("metric", "FIFO measured", "predicted", "measured"):
                table.add_column(col, justify="left" if col == "metric" else "right")
            for title, key in _SHOWN:
                table.add_row(title, f"{c['fifo_measured'][key]['mean']:.3f}", f"{c['predicted'][key]['mean']:.3f}",
                              f"{c['measured'][key]['mean']:.3f}")
            table.add_row("TTFT gain ms", "", f"{c['predicted_gain_ms']:.3f}", f"{c['measured_gain_ms']:.3f}")
            cost = c.get("dispatch_cost_us") or 0.0
            if cost:
                table.add_row("gain ms, calibrated", "", f"{c['calibrated_gain_ms']:.3f}", "")
            console.print(table)
            if get_policy(c["policy"]).probes_head:
                console.print(f"predicted with +{v.extra.get('decision_cost_us', 0.0):.1f} us per dequeue: the "
                              "head's readiness checks, timed by the FIFO runs' waits that did not block",
                              soft_wrap=True)
            if cost:
                console.print(f"calibrated: replayed with +{cost:.1f} us per dequeue, the policy's own cost taken "
                              "from the measured runs", soft_wrap=True)
            _print_in_order(console, c)
            console.print(f"noise {c['noise_ms']:.3f} ms; gain error {c['gain_error_pct']:.1f}% "
                          f"({len(c['fifo_runs'])} FIFO / {len(c['policy_runs'])} {escape(c['policy'])} runs); "
                          f"measured verdict (95% confidence bound): [bold]{escape(c['verdict'])}[/bold]: "
                          f"{escape(c['reason'])}",
                          soft_wrap=True)
            if c.get("predicted_verdict"):
                console.print(f"predicted verdict ({escape(c['policy'])} alone, worst-run rule): "
                              f"[bold]{escape(c['predicted_verdict'])}[/bold]: {escape(c['predicted_reason'])}",
                              soft_wrap=True)
            if c.get("verdict_worst"):  # the measurement under the prediction's rule: agreement under one rule
                console.print(f"measured verdict, worst-pair rule (as the prediction's): "
                              f"[bold]{escape(c['verdict_worst'])}[/bold]: {escape(c['reason_worst'])}",
                              soft_wrap=True)


def _print_in_order(console: Any, c: dict[str, Any]) -> None:
    """The live policy's cost beyond the prediction on the layers it serves in order (``in_order_excess_us``)."""
    excess = c.get("in_order_excess_us")
    if excess is None:
        return
    console.print(f"on the {len(in_order_layers(c['layer_effects']))} of {len(c['layer_effects'])} layers the "
                  f"policy serves in FIFO order, the live load completion is {excess:+.1f} us from the predicted "
                  "one (mean over runs, no confidence bound): a cost (+) or saving (-) of running the policy live "
                  "that the prediction does not contain",
                  soft_wrap=True)


@click.command("sweep")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=config.DEFAULT_SWEEP_DIR,
              show_default=True, help="Folder for finished cells (resumable) and the report.")
@click.option("--quick", is_flag=True, help="A handful of cells (smoke runs and tests).")
@click.option("--repeats", type=click.IntRange(min=1), help="Independent runs (seeds) per cell (default 3).")
@click.option("--confirm", is_flag=True, help="Rerun the most interesting cell on the real clock (threaded replica).")
@click.option("--report", "write_report", is_flag=True, help="Write verdict.md / verdict.json / PNGs.")
@output_options(json="JSON path (with --report).", md="Markdown path (with --report).",
                png_dir="PNG folder (with --report).",
                html="Also write one self-contained HTML page here (with --report).")
def sweep_command(out_dir: Path, quick: bool, repeats: int | None, confirm: bool, write_report: bool,
                  json_path: Path | None, md_path: Path | None, png_dir: Path | None, html_path: Path | None) -> None:
    """Run the coverage matrix on the replica (virtual clock) and decide per cell.

    Axes: GVA and key paths, default and explicit prefetch depth, several
    layerwise_num_shared_buffers, buffer reuse on/off, independent layers prefix or not, 1/2/4
    requests per step, and a stress (none, slow save, slow slot release); >= 3 seeds per cell.
    Finished cells are stored under --out and never rerun, so an interrupted sweep resumes.

    \b
    Example:
      kvtrace sweep --report                 # full matrix, a few seconds to minutes
      kvtrace sweep --quick --out /tmp/sw --report --confirm
      kvtrace sweep --quick --out /tmp/sw --report --html /tmp/sw/verdict.html
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from otel_kvtrace.whatif.api import sweep_report
    from otel_kvtrace.whatif.sweep import SweepMatrix, run_sweep

    if html_path is not None and not write_report:
        raise click.UsageError("--html: needs --report (the HTML page is a form of the report)")
    matrix = SweepMatrix.quick() if quick else SweepMatrix()
    if repeats is not None:
        matrix.repeats = repeats
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=False) as bar:
        task = bar.add_task("sweep", total=None)

        def on_progress(slug: str, done: int, total: int, resumed: bool) -> None:
            bar.update(task, total=total, completed=done,
                       description=f"{'resumed' if resumed else 'ran'} {slug}"[:60])

        try:
            result = run_sweep(out_dir, matrix=matrix, quick=quick, confirm=confirm, on_progress=on_progress)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
        except ReplayStalled as exc:
            raise _stalled(exc) from exc
    from rich.console import Console

    from otel_kvtrace.whatif.sweep import summary_lines, sweep_summary

    console = Console()  # wraps to the terminal (80 columns when piped), never truncates
    console.print(f"{len(result.verdicts)} cells: {result.ran} run(s) computed, {result.resumed} resumed from "
                  f"{out_dir}", markup=False, highlight=False)
    for line in summary_lines(sweep_summary(result)):  # the verdict is printed with or without --report
        console.print(line, markup=False, highlight=False)
    report = (sweep_report(result, json_path=json_path, md_path=md_path, png_dir=png_dir, html_path=html_path)
              if write_report else None)
    if report is not None:
        shown = [v for v in report.verdicts if v.verdict != "keep FIFO" or any(v.hol_events)]
        _print_summary(replace(report, verdicts=shown or report.verdicts[:10]))
        click.echo(f"report: {json_path or out_dir / 'verdict.json'}, {md_path or out_dir / 'verdict.md'}"
                   + (f", {html_path}" if html_path is not None else ""))
