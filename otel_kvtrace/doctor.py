"""``kvtrace doctor``: can tracing bind to this vLLM-Ascend? Per patch point: found, missing, changed.

Run it on the machine that serves (it imports the installed ``vllm_ascend``), or against a checkout with
``--source DIR`` (imported with torch/vllm stubbed, so it works on any laptop). The exit status is 0 when
every required point is found, 1 when one is missing or its signature changed, 2 when vLLM-Ascend cannot
be imported at all.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from otel_kvtrace.instrument.upstream import (
    FOUND,
    UpstreamBinding,
    UpstreamNotFound,
    resolve_installed,
    source_tree,
)

EXIT_OK = 0
EXIT_MISSING_REQUIRED = 1
EXIT_NOT_IMPORTABLE = 2


@dataclass(slots=True)
class DoctorReport:
    """What ``doctor`` found: the binding (version, layout, per-point status) and the exit status."""

    binding: UpstreamBinding
    exit_code: int
    probes: str = ""  # how the GVA recv _handle_request would be instrumented: compiled, or wrappers (why)
    enqueue: str = ""  # how the GVA recv add_request would be: compiled, or wrapper: <why>

    def as_dict(self) -> dict[str, object]:
        b = self.binding
        return {
            "version": b.version,
            "layout": b.layout,
            "source": b.source,
            "ok": b.ok,
            "modules": b.modules,
            "flags": b.flags,
            "import_errors": b.errors,
            "recv_probes": self.probes,
            "gva_enqueue": self.enqueue,
            "ring_pack": ring_pack(),
            "agent_sched": agent_policy(),
            "points": [
                {
                    "id": p.point.id,
                    "status": p.status,
                    "required": p.point.required,
                    "where": p.where,
                    "what": p.point.what,
                    "signature": p.signature,
                    "missing_params": list(p.missing_params),
                }
                for p in b.points
            ],
        }


def doctor(source: str | Path | None = None) -> DoctorReport:
    """Bind to the installed vLLM-Ascend, or to the source tree ``source``, and report every patch point.

    Raises :class:`~otel_kvtrace.instrument.upstream.UpstreamNotFound` when it cannot be imported.
    """
    if source is None:
        binding = resolve_installed()
        probes, enqueue = probe_path(binding), enqueue_path(binding)
    else:
        with source_tree(source) as binding:  # the binding keeps the report; the stubbed modules go on exit
            probes, enqueue = probe_path(binding), enqueue_path(binding)
    return DoctorReport(binding, EXIT_OK if binding.ok else EXIT_MISSING_REQUIRED, probes, enqueue)


def probe_path(binding: UpstreamBinding) -> str:
    """``compiled`` when the GVA recv thread's ``_handle_request`` takes the compiled probes
    (``instrument/rewrite.py``), else ``wrappers: <reason>``."""
    return _compiled_path(binding, "_handle_request", "wrappers")


def enqueue_path(binding: UpstreamBinding) -> str:
    """``compiled`` when the GVA recv thread's ``add_request`` takes the compiled enqueue (the record set-up
    inline, ``rewrite.rewrite_add_request_tree``), else ``wrapper: <reason>``."""
    return _compiled_path(binding, "add_request", "wrapper")


def _compiled_path(binding: UpstreamBinding, member: str, fallback: str) -> str:
    """``compiled`` when install would compile ``member`` of the GVA recv class, else ``<fallback>: <why>``."""
    from otel_kvtrace import config
    from otel_kvtrace.instrument import rewrite

    cls = binding.classes.get("recv_gva")
    if cls is None:
        return f"{fallback}: no GVA recv class"
    if config.probes_mode() == "wrappers":
        return f"{fallback}: {config.OTEL_KVTRACE_PROBES}=wrappers"
    reason = rewrite.check(cls, member)
    return "compiled" if reason is None else f"{fallback}: {reason}"


def ring_pack() -> str:
    """``native`` (the C extension ``record/_ringpack``) or ``python: <why>``: who packs ring task slots."""
    from otel_kvtrace.record.ring import pack_mode

    mode, why = pack_mode()
    return mode if not why else f"{mode}: {why}"


def agent_policy() -> str:
    """How the exporter agent of a session started here would be scheduled (``OTEL_KVTRACE_EXPORTER``,
    ``_AGENT_SCHED``, ``_AGENT_NICE``, ``_AGENT_CPUS``, read as ``AgentExporter`` reads them; the policy
    switches as ``export/agent.py:Priority`` makes them), e.g. ``SCHED_IDLE (SCHED_OTHER at nice +10 while
    the ring is more than 1/2 full, back at 1/8); CPUs 1``."""
    import os

    from otel_kvtrace import config
    from otel_kvtrace.export.agent import Priority

    if config.exporter_mode() != config.EXPORTER_AGENT:
        return f"no agent ({config.OTEL_KVTRACE_EXPORTER}={config.exporter_mode()}: the in-process exporter thread)"
    nice = config.env_int(config.OTEL_KVTRACE_AGENT_NICE, config.DEFAULT_AGENT_NICE, minimum=0)
    if config.agent_sched() == config.AGENT_SCHED_IDLE and hasattr(os, "SCHED_IDLE"):
        escalation = (f"SCHED_OTHER at nice +{nice} while the ring is more than {_fraction(Priority.ESCALATE)} "
                      f"full, back at {_fraction(Priority.RELAX)}")
        blocked = _escalation_blocked(nice)
        if blocked:
            escalation = f"stays SCHED_IDLE: leaving it is not permitted here ({blocked})"
        policy = f"SCHED_IDLE ({escalation})"
    else:
        policy = f"SCHED_OTHER at nice +{nice}"
    cpus = config.agent_cpus()
    if cpus is None:
        return policy + "; CPUs: the serving process's"
    allowed = sorted(set(cpus) & os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(cpus)
    if not allowed:
        return policy + f"; CPUs {_cpu_list(cpus)} not allowed here: the serving process's"
    return policy + f"; CPUs {_cpu_list(allowed)}"


def _escalation_blocked(nice: int) -> str:
    """Why the agent could not leave SCHED_IDLE, or "" when it can: Linux lets an unprivileged process
    leave it only when ``RLIMIT_NICE`` allows its nice value (``20 - nice <= limit``)."""
    import os
    import resource

    if os.geteuid() == 0:
        return ""
    limit = resource.getrlimit(resource.RLIMIT_NICE)[0]
    level = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    if limit == resource.RLIM_INFINITY or 20 - level <= limit:
        return ""
    return f"not root, RLIMIT_NICE={limit} < {20 - level}"


def _fraction(value: float) -> str:
    return f"1/{round(1 / value)}" if value > 0 and abs(1 / value - round(1 / value)) < 1e-9 else f"{value:g}"


def _cpu_list(cpus: "tuple[int, ...] | list[int]") -> str:
    """``0-3,8`` for 0, 1, 2, 3, 8 (the form ``OTEL_KVTRACE_AGENT_CPUS`` takes)."""
    out: list[str] = []
    for c in sorted(set(cpus)):
        if out and out[-1].rsplit("-", 1)[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def _print_report(report: DoctorReport) -> None:
    from rich.console import Console
    from rich.markup import escape

    b = report.binding
    console = Console(soft_wrap=True, highlight=False)
    console.print(f"vLLM-Ascend [bold]{escape(b.version)}[/] (layout: {b.layout}) from {escape(b.source)}")
    for role, module in sorted(b.modules.items()):
        console.print(f"  module {role:12} {module}")
    for role, error in sorted(b.errors.items()):
        console.print(f"  [red]module {role:12} not importable[/]: {escape(error)}")
    for p in b.points:
        colour = "green" if p.status == FOUND else ("red" if p.point.required else "yellow")
        kind = "required" if p.point.required else "optional"
        member = ".".join(p.where.rsplit(".", 2)[-2:])
        extra = f" [no {', '.join(p.missing_params)}]" if p.missing_params else ""
        console.print(f"  {p.point.id:5} [{colour}]{p.status:17}[/] {kind:8} {member}{escape(extra)}  "
                      f"[dim]{p.point.what}[/]")
    console.print("feature flags: " + ", ".join(f"{k}={v}" for k, v in b.flags.items()))
    colour = "green" if report.probes == "compiled" else "yellow"
    console.print(f"recv probes (GVA _handle_request): [{colour}]{escape(report.probes)}[/]")
    colour = "green" if report.enqueue == "compiled" else "yellow"
    console.print(f"GVA enqueue: [{colour}]{escape(report.enqueue)}[/]")
    console.print(f"ring task packer: {escape(ring_pack())}")
    console.print(f"exporter agent scheduling: {escape(agent_policy())}")
    if b.ok:
        console.print("[green]all required patch points found: tracing can bind[/]")
    else:
        missing = ", ".join(p.point.id for p in b.missing_required())
        console.print(f"[red]required patch points missing or changed: {missing}; tracing would stay off[/]")


@click.command("doctor")
@click.option("--source", "source", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Root of a vllm-ascend source tree (checkout or unpacked sdist) instead of the installed one.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of a table.")
def doctor_command(source: Path | None, as_json: bool) -> None:
    """Check that every patch point of the tracer exists in this vLLM-Ascend.

    Prints, per patch point, found / missing / signature changed, the detected version and layout
    (main or v0.23) and the feature flags the instrumentation branches on. Exits 1 when a required
    point is missing, 2 when vLLM-Ascend is not importable.

    \b
    Example:
      kvtrace doctor                              # the installed vllm-ascend
      kvtrace doctor --source ~/src/vllm-ascend   # a checkout, torch/vllm not needed
    """
    try:
        report = doctor(source)
    except UpstreamNotFound as exc:
        click.echo(f"kvtrace doctor: {exc}", err=True)
        sys.exit(EXIT_NOT_IMPORTABLE)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2, default=str))
    else:
        _print_report(report)
    sys.exit(report.exit_code)
