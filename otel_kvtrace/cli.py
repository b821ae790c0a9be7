"""The ``kvtrace`` command line.

Subcommands are loaded lazily from ``COMMANDS`` so that ``kvtrace --help`` stays fast and a command's
heavy imports (DuckDB, matplotlib, gRPC) are paid only by the command that needs them. To add a command,
add one line to ``COMMANDS``: ``name: ("module.path", "click_object_name", "one-line help")``.
"""

from __future__ import annotations

import importlib

import click

COMMANDS: dict[str, tuple[str, str, str]] = {
    # name: (module, attribute, short help shown by `kvtrace --help`)
    "async": ("otel_kvtrace.asynccheck.cli", "async_group", "Did async scheduling take effect? `check` timelines, `doctor` a live process, `replica`."),
    "doctor": ("otel_kvtrace.doctor", "doctor_command", "Check every patch point against the installed vLLM-Ascend (or --source DIR)."),
    "demo": ("otel_kvtrace.demo", "demo_command", "Run the CPU replica (HOL and FIFO-optimal scenarios), traced, and summarise it."),
    "collect": ("otel_kvtrace.collect.cli", "collect_command", "Embedded OTLP receiver writing files for `kvtrace report`."),
    "resend": ("otel_kvtrace.export.resend", "resend_command", "Deliver an OTLP delivery spool left on disk when the endpoint was unreachable."),
    "whatif": ("otel_kvtrace.whatif.cli", "whatif_command", "Replay recorded queues under other policies; verdict: keep FIFO or switch."),
    "experiment": ("otel_kvtrace.experiment.cli", "experiment_command", "Coverage matrix on a real server (or serve-replica), >= 3 runs per cell; --report."),
    "export": ("otel_kvtrace.report.cli", "export_command", "Traces as a timeline file: --perfetto (Chrome Trace Event JSON for Perfetto/chrome://tracing/MindStudio Insight)."),
    "load": ("otel_kvtrace.loadgen.cli", "load_command", "Streaming load on an OpenAI-compatible server: TTFT, TPOT, ITL, throughput; vLLM bench import."),
    "report": ("otel_kvtrace.report.cli", "report", "HOL blocking from traces: stage and HOL tables, --json, --png-dir, --html."),
    "serve-replica": ("otel_kvtrace.serve.cli", "serve_replica_command", "OpenAI-compatible streaming server whose model is the threaded replica (traced)."),
    "sweep": ("otel_kvtrace.whatif.cli", "sweep_command", "Coverage matrix on the replica, >= 3 seeds per cell, verdict per cell (resumable)."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module_name, attr, _ = entry
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="otel-kvtrace")
def main() -> None:
    """Trace, analyse and decide on head-of-line blocking in vLLM-Ascend's layerwise KV recv queue.

    Typical flow: `kvtrace demo` (replica -> traces in ./kvtrace-data/), then
    `kvtrace report ./kvtrace-data/traces` and `kvtrace whatif ./kvtrace-data/traces`.
    """


if __name__ == "__main__":  # pragma: no cover
    main()
