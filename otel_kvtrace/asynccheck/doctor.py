"""Check a live (or described) serving process's real async-scheduling configuration.

Reads ``/proc/PID/environ`` and ``/proc/PID/cmdline`` (or a command line and an env file), and reports
``MINDIE_ASYNC_SCHEDULING_ENABLE``, ``TASK_QUEUE_ENABLE``, ``ASCEND_LAUNCH_BLOCKING``,
``--async-scheduling`` / ``--no-async-scheduling``, known conflicts, installed versions (read with
``importlib.metadata`` by the target's own interpreter when it is Python; nothing is imported) and the
log lines that confirm async is active. Every finding carries its fix. Facts: research §4-§6.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OK, INFO, WARN, ERROR = "ok", "info", "warn", "error"
DISTRIBUTIONS = ("vllm", "vllm-ascend", "torch", "torch-npu", "mindie-llm", "msserviceprofiler", "otel-kvtrace")

LOG_PATTERNS: tuple[tuple[str, str, re.Pattern[str], str], ...] = (
    ("vllm_async_enabled", OK, re.compile(r"Asynchronous scheduling is enabled"), "vLLM resolved async scheduling to on"),
    ("vllm_async_disabled", ERROR, re.compile(r"Asynchronous scheduling is disabled"), "vLLM resolved async scheduling to off"),
    (
        "vllm_async_turned_off",
        WARN,
        re.compile(r"[Aa]sync(hronous)? scheduling.*(will be disabled|not supported|is disabled because)"),
        "vLLM turned async scheduling off for an incompatible feature",
    ),
    ("mindie_python_async", OK, re.compile(r"Async inference is activated"), "MindIE Python side async is on"),
    ("mindie_scheduler_async", OK, re.compile(r"Scheduler enable async\. maxScheduledBatch:\s*\d+"), "MindIE C++ scheduler async is on"),
    (
        "mindie_schedule_cost",
        WARN,
        re.compile(r"Response and schedule transfer cost too long"),
        "MindIE scheduling/response took longer than the iteration: a bubble symptom",
    ),
    ("mindie_plugin_rejected", ERROR, re.compile(r"does not support the plugin_type"), "MindIE rejected a plugin under async"),
)


class DoctorError(Exception):
    """Bad input or an unreadable process (the CLI exits with status 2)."""


@dataclass(slots=True)
class Finding:
    key: str
    status: str
    message: str
    fix: str | None = None


@dataclass(slots=True)
class DoctorReport:
    """What was inspected, the findings (worst first), versions and confirming log lines."""

    target: str
    argv: list[str]
    findings: list[Finding]
    versions: dict[str, str | None]
    versions_from: str
    log_matches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def worst(self) -> str:
        order = [OK, INFO, WARN, ERROR]
        return max((f.status for f in self.findings), key=order.index, default=OK)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "worst": self.worst}


# ---- reading the target ----------------------------------------------------------------------------------
def read_process(pid: int) -> tuple[dict[str, str], list[str]]:
    """Environment and argv of a live process; DoctorError when missing or unreadable."""
    base = Path(f"/proc/{pid}")
    try:
        environ = (base / "environ").read_bytes()
        cmdline = (base / "cmdline").read_bytes()
    except FileNotFoundError:
        raise DoctorError(f"--pid {pid}: no such process") from None
    except PermissionError:
        raise DoctorError(
            f"--pid {pid}: permission denied reading {base}/environ; run as the process owner or root"
        ) from None
    return parse_environ(environ), [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]


def parse_environ(raw: bytes) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep and key:
            env[key] = value
    return env


def read_env_file(path: str | Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (``export`` prefix, quotes and ``#`` comments allowed)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise DoctorError(f"--env-file {path}: {exc.strerror or exc}") from None
    env: dict[str, str] = {}
    for line_no, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise DoctorError(f"--env-file {path}:{line_no}: expected KEY=VALUE, got {line!r}")
        env[key.strip()] = value.strip().strip("'\"")
    return env


def _is_python(path: str | None) -> bool:
    return bool(path) and bool(re.search(r"python[\d.]*$", Path(path).name)) and Path(path).exists()


def _interpreter(pid: int | None, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The target's Python: argv[0] as invoked (keeps its virtualenv), else /proc/PID/exe."""
    if argv:
        first = argv[0]
        if not os.path.isabs(first) and pid is not None and os.sep in first:
            first = os.path.join(f"/proc/{pid}/cwd", first)
        elif not os.path.isabs(first):
            first = shutil.which(first, path=env.get("PATH")) or first
        if _is_python(first):
            return first
    if pid is not None:
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            return None
        return exe if _is_python(exe) else None
    return None


def installed_versions(interpreter: str | None, env: Mapping[str, str]) -> tuple[dict[str, str | None], str]:
    """Distribution versions seen by the target's interpreter (metadata only), else by this one."""
    script = (
        "import json, importlib.metadata as md\nout = {}\n"
        f"for d in {list(DISTRIBUTIONS)!r}:\n"
        "    try: out[d] = md.version(d)\n    except md.PackageNotFoundError: out[d] = None\n"
        "print(json.dumps(out))"
    )
    if interpreter:
        run_env = {k: v for k, v in env.items() if k in ("PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "HOME")}
        try:
            done = subprocess.run(
                [interpreter, "-c", script], env=run_env, capture_output=True, text=True, timeout=20, check=True
            )
            return json.loads(done.stdout), interpreter
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out, f"{sys.executable} (this tool's environment)"


# ---- findings ---------------------------------------------------------------------------------------------
def _engine(argv: Sequence[str], env: Mapping[str, str]) -> str:
    joined = " ".join(argv).lower()
    if "vllm" in joined:
        return "vllm"
    if "mindie" in joined or any(k.startswith(("MINDIE_", "MIES_")) for k in env):
        return "mindie"
    return "unknown"


def _flag_value(argv: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def env_findings(env: Mapping[str, str], engine: str) -> list[Finding]:
    out: list[Finding] = []
    mindie = env.get("MINDIE_ASYNC_SCHEDULING_ENABLE")
    if mindie == "1":
        note = " (MindIE only: no effect on vLLM)" if engine == "vllm" else ""
        out.append(Finding("MINDIE_ASYNC_SCHEDULING_ENABLE", OK, f"=1: MindIE async scheduling on{note}"))
    elif mindie is not None:
        out.append(Finding("MINDIE_ASYNC_SCHEDULING_ENABLE", WARN, f"={mindie!r}: MindIE treats anything but '1' as off",
                           "export MINDIE_ASYNC_SCHEDULING_ENABLE=1 (only on D nodes in PD-disaggregated deployments)"))
    elif engine == "mindie":
        out.append(Finding("MINDIE_ASYNC_SCHEDULING_ENABLE", WARN, "not set: MindIE async scheduling is off",
                           "export MINDIE_ASYNC_SCHEDULING_ENABLE=1"))
    else:
        out.append(Finding("MINDIE_ASYNC_SCHEDULING_ENABLE", INFO, "not set (MindIE only)"))
    tq = env.get("TASK_QUEUE_ENABLE")
    tq_fix = "export TASK_QUEUE_ENABLE=2 (recommended level 2; may raise peak NPU memory)"
    if tq is None:
        out.append(Finding("TASK_QUEUE_ENABLE", INFO, "not set: default 1 (level-1 two-stage op dispatch)", tq_fix))
    elif tq == "0":
        out.append(Finding("TASK_QUEUE_ENABLE", ERROR, "=0: task queue off, every op is launched synchronously "
                           "on the host thread", tq_fix))
    elif tq == "1":
        out.append(Finding("TASK_QUEUE_ENABLE", INFO, "=1: level-1 two-stage op dispatch", tq_fix))
    elif tq == "2":
        out.append(Finding("TASK_QUEUE_ENABLE", OK, "=2: level-2 dispatch with load balancing"))
    else:
        out.append(Finding("TASK_QUEUE_ENABLE", WARN, f"={tq!r}: not one of 0, 1, 2", tq_fix))
    blocking = env.get("ASCEND_LAUNCH_BLOCKING")
    if blocking == "1":
        out.append(Finding("ASCEND_LAUNCH_BLOCKING", ERROR, "=1: every launch blocks until the device finishes and "
                           "the task queue is forced off: async scheduling cannot overlap anything",
                           "unset ASCEND_LAUNCH_BLOCKING (debugging only)"))
    else:
        out.append(Finding("ASCEND_LAUNCH_BLOCKING", OK, "not 1: launches are asynchronous"))
    if env.get("SERVICE_PROF_CONFIG_PATH") or env.get("PROFILING_SYMBOLS_PATH"):
        out.append(Finding("msServiceProfiler", WARN, "msServiceProfiler is configured (SERVICE_PROF_CONFIG_PATH/"
                           "PROFILING_SYMBOLS_PATH): its stock vLLM hooks synchronize the NPU around forward, logits "
                           "and sampler, which serialises async scheduling while profiling",
                           "remove the record_function_or_nullcontext/capture_async/compute_logits/sampler_forward "
                           "handlers from the symbols file, or profile with our instrumentation"))
    if env.get("ATB_OPERATION_EXECUTE_ASYNC") == "0":
        out.append(Finding("ATB_OPERATION_EXECUTE_ASYNC", WARN, "=0: ATB graph dispatch is synchronous",
                           "unset it (default 1) or set 2"))
    if env.get("ATB_LLM_LCOC_ENABLE") == "0":
        out.append(Finding("ATB_LLM_LCOC_ENABLE", INFO, "=0: matmul/all-reduce masking (LCOC) off; communication "
                           "is exposed", "unset ATB_LLM_LCOC_ENABLE (default on)"))
    return out


def cmdline_findings(argv: Sequence[str], engine: str) -> list[Finding]:
    out: list[Finding] = []
    flags = [a for a in argv if a in ("--async-scheduling", "--no-async-scheduling")]
    last = flags[-1] if flags else None
    if last == "--no-async-scheduling":
        out.append(Finding("--async-scheduling", ERROR, "--no-async-scheduling on the command line: vLLM async "
                           "scheduling is off", "remove --no-async-scheduling (keep it only on PP prefill nodes)"))
    elif last == "--async-scheduling":
        out.append(Finding("--async-scheduling", OK, "--async-scheduling on the command line (vLLM raises at start-up "
                           "if it is incompatible)"))
    elif engine == "vllm":
        out.append(Finding("--async-scheduling", INFO, "not on the command line: recent vLLM turns it on by default "
                           "unless a feature forbids it", "confirm with the start-up log line "
                           "'Asynchronous scheduling is enabled.' (kvtrace async doctor --log FILE)"))
    if engine == "vllm" and _flag_value(argv, "--scheduler-cls"):
        out.append(Finding("--scheduler-cls", WARN, "a custom scheduler class is set: vLLM picks AsyncScheduler only "
                           "when no scheduler_cls is given", "make the custom class derive from AsyncScheduler"))
    kv = _flag_value(argv, "--kv-transfer-config") or ""
    if "kv_producer" in kv and last != "--no-async-scheduling" and engine == "vllm":
        out.append(Finding("--kv-transfer-config", WARN, "prefill (kv_producer) node with async scheduling: "
                           "recommended on decode nodes only", "add --no-async-scheduling on P nodes"))
    return out


def conflict_findings(argv: Sequence[str], env: Mapping[str, str]) -> list[Finding]:
    """MindIE plugins that disable or reject async (splitfuse, la, memory_decoding)."""
    texts = [" ".join(argv), *env.values()]
    config = env.get("MIES_CONFIG_JSON_PATH")
    if config:
        try:
            texts.append(Path(config).read_text(encoding="utf-8"))
        except OSError:
            pass
    joined = "\n".join(texts).lower()
    async_on = env.get("MINDIE_ASYNC_SCHEDULING_ENABLE") == "1"
    out: list[Finding] = []
    if "splitfuse" in joined:
        status = WARN if async_on else INFO
        out.append(Finding("splitfuse", status, "the splitfuse plugin is enabled: MindIE silently turns the C++ "
                           "batch scheduler's async side off (only 'Async inference is activated.' is logged, not "
                           "'Scheduler enable async.')", "disable the splitfuse plugin to get full async scheduling"))
    for plugin in ("memory_decoding", "\"la\""):
        if async_on and plugin in joined:
            out.append(Finding(f"plugin {plugin.strip(chr(34))}", ERROR, f"plugin {plugin} is rejected by MindIE when "
                               "MINDIE_ASYNC_SCHEDULING_ENABLE=1", "remove the plugin or turn async scheduling off"))
    return out


def log_findings(log: str | Path, engine: str) -> tuple[list[Finding], list[dict[str, Any]]]:
    """Scan a log for the lines that confirm (or deny) async scheduling."""
    try:
        lines = Path(log).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise DoctorError(f"--log {log}: {exc.strerror or exc}") from None
    matches: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for line_no, line in enumerate(lines, 1):
        for key, _, pattern, _ in LOG_PATTERNS:
            if pattern.search(line):
                seen[key] = seen.get(key, 0) + 1
                if seen[key] <= 3:
                    matches.append({"key": key, "line": line_no, "text": line.strip()[:300]})
    out = [Finding(f"log:{key}", status, f"{text} ({seen[key]} lines)") for key, status, _, text in LOG_PATTERNS
           if key in seen]
    if "mindie_python_async" in seen and "mindie_scheduler_async" not in seen:
        out.append(Finding("log:mindie_partial", WARN, "Python side async but no 'Scheduler enable async.' line: only "
                           "partially async (splitfuse?)", "disable splitfuse; check the C++ scheduler log level"))
    if not seen:
        expected = {"vllm": "'Asynchronous scheduling is enabled.'",
                    "mindie": "'Async inference is activated.' and 'Scheduler enable async. maxScheduledBatch:2'"}
        out.append(Finding("log", WARN, f"no async confirmation line in {log}",
                           f"look for {expected.get(engine, 'the start-up lines of vLLM or MindIE')} at INFO level"))
    return out, matches


def doctor(
    *,
    pid: int | None = None,
    cmdline: str | None = None,
    env_file: str | Path | None = None,
    log: str | Path | None = None,
    json_path: str | Path | None = None,
) -> DoctorReport:
    """Inspect a live process (``pid``) or a described one (``cmdline`` + ``env_file``)."""
    if (pid is None) == (cmdline is None):
        raise DoctorError("give exactly one of --pid or --cmdline")
    if pid is not None:
        env, argv = read_process(pid)
        target = f"pid {pid}"
    else:
        argv = shlex.split(cmdline or "")
        env, target = {}, "command line"
    if env_file is not None:
        env.update(read_env_file(env_file))
    engine = _engine(argv, env)
    findings = env_findings(env, engine) + cmdline_findings(argv, engine) + conflict_findings(argv, env)
    matches: list[dict[str, Any]] = []
    if log is not None:
        log_f, matches = log_findings(log, engine)
        findings += log_f
    else:
        findings.append(Finding("log", INFO, "no log scanned", "pass --log FILE to confirm async from the start-up log"))
    versions, versions_from = installed_versions(_interpreter(pid, argv, env), env)
    order = [ERROR, WARN, INFO, OK]
    findings.sort(key=lambda f: order.index(f.status))
    report = DoctorReport(target=f"{target} ({engine})", argv=list(argv), findings=findings, versions=versions,
                          versions_from=versions_from, log_matches=matches)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report.to_dict(), indent=2), encoding="utf-8")
    return report
