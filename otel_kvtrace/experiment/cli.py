"""``kvtrace experiment`` command line."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("experiment")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Output folder (with MATRIX.yaml).")
@click.option("--report", "make_report", is_flag=True, help="Write report.md/.html/.json (after running, or for DIR).")
def experiment_command(source: Path, out: Path | None, make_report: bool) -> None:
    """Run a coverage matrix against a real server (or serve-replica) and write the investigation report.

    SOURCE is a MATRIX.yaml (run it into --out DIR; resumable: runs already ok are skipped) or an
    experiment DIR (with --report: analyse what it holds). Each cell's server command is rendered from
    the template (the --kv-transfer-config JSON with the layerwise keys), started, checked on its health
    URL, loaded (kvtrace load) and stopped with SIGTERM, once per run. A server that fails to start or
    dies mid-run is reported with the tail of its log and that run is marked failed; the rest go on.
    Ctrl-C stops the server it started.

    \b
    Example:
        kvtrace experiment examples/experiment-replica.yaml --out runs/replica --report
        kvtrace experiment runs/replica --report
    """
    from otel_kvtrace.experiment.matrix import MatrixError, read_matrix

    if source.is_dir():
        if not make_report:
            raise click.UsageError("SOURCE is a folder: add --report (or give a MATRIX.yaml and --out)")
        _report(source)
        return
    if out is None:
        raise click.UsageError("--out DIR is required with a MATRIX.yaml")
    try:
        matrix = read_matrix(source)
    except MatrixError as exc:
        raise click.ClickException(str(exc)) from exc
    outcomes = _run(matrix, out)
    failed = [o for o in outcomes if o.status == "failed"]
    for o in failed:
        click.echo(f"FAILED {o.cell_id} run {o.run}: {o.reason}\n  server log tail:\n    "
                   + "\n    ".join(o.log_tail.splitlines() or ["(empty)"]), err=True)
    done = sum(o.status != "failed" for o in outcomes)
    click.echo(f"{done} of {len(outcomes)} runs ok ({sum(o.status == 'skipped' for o in outcomes)} from before) in {out}")
    if make_report:
        _report(out)
    if failed:
        raise SystemExit(1)


def _run(matrix, out: Path):  # type: ignore[no-untyped-def]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from otel_kvtrace.experiment.runner import run_matrix

    total = len(matrix.cells) * matrix.runs
    try:
        with Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
            task = bar.add_task(f"{matrix.name}: {len(matrix.cells)} cells x {matrix.runs} runs", total=total)

            def on_run(o) -> None:  # type: ignore[no-untyped-def]
                bar.update(task, advance=1, description=f"{o.cell_id} run {o.run}: {o.status}")

            return run_matrix(matrix, out, on_run=on_run)
    except KeyboardInterrupt:
        raise click.ClickException("interrupted: the running server was stopped; run again to resume") from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc


def _report(folder: Path) -> None:
    from otel_kvtrace.experiment.report import ReportError, write_reports

    try:
        paths = write_reports(folder)
    except ReportError as exc:
        raise click.ClickException(str(exc)) from exc
    for p in paths:
        click.echo(f"report: {p}")
