"""``kvtrace doctor`` and the source-tree binding on the fetched upstream sources.

The negative cases edit a scratch copy of the KV-pool sources (never committed): one with a required
method renamed, one with a parameter renamed, so the report must say missing / signature changed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from otel_kvtrace.cli import main
from otel_kvtrace.doctor import EXIT_MISSING_REQUIRED, EXIT_NOT_IMPORTABLE, EXIT_OK, doctor
from otel_kvtrace.instrument.upstream import SIGNATURE_CHANGED, source_tree

pytestmark = pytest.mark.upstream

KV_POOL = Path("vllm_ascend/distributed/kv_transfer/kv_pool/ascend_store")


def _copy_kv_pool(root: Path, dest: Path) -> Path:
    """The minimal slice of a tree doctor imports: the KV-pool package and the fence module."""
    shutil.copytree(root / KV_POOL, dest / KV_POOL)
    fence = root / "vllm_ascend/memcache_comm_fence.py"
    if fence.exists():
        shutil.copy(fence, dest / "vllm_ascend/memcache_comm_fence.py")
    return dest


def _points(report: dict) -> dict[str, dict]:
    return {p["id"]: p for p in report["points"]}


def test_doctor_cli_reports_every_point_found_with_version_and_layout(upstream_root: Path) -> None:
    result = CliRunner().invoke(main, ["doctor", "--source", str(upstream_root), "--json"])
    assert result.exit_code == EXIT_OK, result.output
    report = json.loads(result.output)
    points = _points(report)
    assert report["ok"] and all(p["status"] == "found" for p in points.values() if p["required"])
    assert report["recv_probes"] == "compiled"
    assert report["gva_enqueue"] == "compiled"
    if report["layout"] == "main":
        assert report["flags"]["recv_save_npu_sync"] and points["P6"]["status"] == "found"
        assert report["modules"]["gate"].endswith(".attention_fence")
    else:
        assert report["layout"] == "v0.23" and report["version"] == "0.23.0.post1"
        assert points["P6"]["status"] == "missing" and points["P6"]["missing_params"] == ["sync_save_events"]
        assert report["modules"]["gate"] == "vllm_ascend.memcache_comm_fence"
        assert report["modules"]["metadata"].endswith(".config_data")


def test_doctor_table_output_names_points(upstream_root: Path) -> None:
    result = CliRunner().invoke(main, ["doctor", "--source", str(upstream_root)])
    assert result.exit_code == EXIT_OK
    assert "P11" in result.output and "_batch_copy_with_limits" in result.output
    assert "tracing can bind" in result.output
    assert "recv probes (GVA _handle_request): compiled" in result.output
    assert "GVA enqueue: compiled" in result.output


def test_doctor_says_when_the_recv_thread_would_use_the_wrappers(upstream_root: Path, tmp_path: Path) -> None:
    """An upstream edit the compiled probes do not know (a second gate wait) -> wrappers, with the reason."""
    tree = _copy_kv_pool(upstream_root, tmp_path / "edited")
    kv_transfer = tree / KV_POOL / "kv_transfer.py"
    text = kv_transfer.read_text()
    anchor = "        self._stagger_h2d_submit(layer_id)\n"
    start = text.index("class KVCacheStoreLayerRecvingThread")
    at = text.index(anchor, start)
    kv_transfer.write_text(text[:at] + anchor + anchor + text[at + len(anchor):])
    report = doctor(tree)
    assert report.exit_code == EXIT_OK  # every patch point is there: tracing binds, on the wrapper path
    assert report.probes.startswith("wrappers: expected one gate wait, stagger and batch copy"), report.probes


def test_doctor_says_when_the_enqueue_would_use_the_wrapper(upstream_root: Path, tmp_path: Path) -> None:
    """An ``add_request`` the compiled enqueue refuses (zero-argument ``super()``): the GVA enqueue line says
    ``wrapper`` and why, the recv probes stay compiled (review 5, finding 10)."""
    tree = _copy_kv_pool(upstream_root, tmp_path / "edited")
    kv_transfer = tree / KV_POOL / "kv_transfer.py"
    text = kv_transfer.read_text()
    start = text.index("class KVCacheStoreLayerRecvingThread")
    at = text.index("def add_request(", start)
    put = text.index("        self.request_queue.put(", at)
    end = text.index("\n", put)
    kv_transfer.write_text(text[:put] + "        super().add_request" + text[put + len("        self.request_queue.put"):])
    assert "super().add_request" in kv_transfer.read_text()[at:end + 10]
    report = doctor(tree)
    assert report.exit_code == EXIT_OK
    assert report.probes == "compiled"
    assert report.enqueue == "wrapper: line %d: uses 'super'" % (text[:put].count("\n") + 1), report.enqueue
    result = CliRunner().invoke(main, ["doctor", "--source", str(tree)])
    assert "GVA enqueue: wrapper: line" in result.output, result.output


def test_doctor_fails_on_a_missing_required_point(upstream_root: Path, tmp_path: Path) -> None:
    tree = _copy_kv_pool(upstream_root, tmp_path / "renamed")
    kv_transfer = tree / KV_POOL / "kv_transfer.py"
    kv_transfer.write_text(kv_transfer.read_text().replace("def _batch_copy_with_limits(", "def _batch_copy_v2("))
    result = CliRunner().invoke(main, ["doctor", "--source", str(tree), "--json"])
    assert result.exit_code == EXIT_MISSING_REQUIRED
    points = _points(json.loads(result.output))
    assert points["P11"]["status"] == "missing"


def test_doctor_reports_a_changed_signature(upstream_root: Path, tmp_path: Path) -> None:
    tree = _copy_kv_pool(upstream_root, tmp_path / "changed")
    kv_transfer = tree / KV_POOL / "kv_transfer.py"
    text = kv_transfer.read_text()
    start = text.index("    def build_addrs(")
    end = text.index(")", start)
    kv_transfer.write_text(text[:start] + text[start:end].replace("layer_id", "layer_index") + text[end:])
    report = doctor(tree)
    assert report.exit_code == EXIT_MISSING_REQUIRED
    (p8,) = [p for p in report.binding.points if p.point.id == "P8"]
    assert p8.status == SIGNATURE_CHANGED and p8.missing_params == ("layer_id",)


def test_doctor_says_clearly_when_nothing_is_importable(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["doctor", "--source", str(tmp_path)])
    assert result.exit_code == EXIT_NOT_IMPORTABLE
    assert "no vllm_ascend/ package directory" in result.output
    result = runner.invoke(main, ["doctor"])  # the test venv has no vllm-ascend installed
    assert result.exit_code == EXIT_NOT_IMPORTABLE
    assert "vllm_ascend is not importable" in result.output and "--source" in result.output


def test_source_tree_leaves_no_stub_behind(upstream_root: Path) -> None:
    before = set(sys.modules)
    meta_path = list(sys.meta_path)
    with source_tree(upstream_root) as binding:
        assert binding.ok
        assert "torch" in sys.modules and "vllm" in sys.modules
    leaked = {m for m in set(sys.modules) - before if m.split(".")[0] in ("torch", "torch_npu", "vllm", "vllm_ascend")}
    assert not leaked
    assert sys.meta_path == meta_path


def _doctor_json(upstream_root: Path, env: dict[str, str]) -> dict:
    """A real ``kvtrace doctor --json`` process with ``env`` over ours (no OTEL_KVTRACE_AGENT_* of ours leaks)."""
    import os
    import subprocess

    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_KVTRACE_")}
    out = subprocess.run([sys.executable, "-m", "otel_kvtrace.cli", "doctor", "--source", str(upstream_root), "--json"],
                         env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == EXIT_OK, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="Linux scheduling policies")
def test_doctor_says_the_agent_policy_the_real_agent_then_runs(upstream_root: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The doctor line against the policy, nice level and CPUs read back from a real agent started with the
    same settings: default (idle, escalation), then ``normal`` at nice +7 on one CPU, then the thread exporter."""
    import os

    from otel_kvtrace.export.agent_link import AgentExporter
    from otel_kvtrace.record import ring as R
    from otel_kvtrace.record.recorder import Recorder

    cpu = max(os.sched_getaffinity(0))
    cases = [({}, os.SCHED_IDLE, None, "SCHED_IDLE (SCHED_OTHER at nice +10 while the ring is more than 1/2 full, "
                                         "back at 1/8); CPUs: the serving process's"),
             ({"OTEL_KVTRACE_AGENT_SCHED": "normal", "OTEL_KVTRACE_AGENT_NICE": "7",
               "OTEL_KVTRACE_AGENT_CPUS": str(cpu)}, os.SCHED_OTHER, 7, f"SCHED_OTHER at nice +7; CPUs {cpu}")]
    for env, policy, nice, line in cases:
        assert _doctor_json(upstream_root, env)["agent_sched"] == line
        for key in ("OTEL_KVTRACE_AGENT_SCHED", "OTEL_KVTRACE_AGENT_NICE", "OTEL_KVTRACE_AGENT_CPUS"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        exporter = AgentExporter(Recorder(), {"service.name": "doctor-test"}, out_dir=tmp_path)
        pid = int(exporter.writer.hdr[R.H_AGENT_PID])
        try:
            assert os.sched_getscheduler(pid) == policy
            if nice is not None:
                assert os.getpriority(os.PRIO_PROCESS, pid) - os.getpriority(os.PRIO_PROCESS, 0) == nice
                assert os.sched_getaffinity(pid) == {cpu}
            else:
                assert os.sched_getaffinity(pid) == os.sched_getaffinity(0)
        finally:
            exporter.shutdown()
    report = _doctor_json(upstream_root, {"OTEL_KVTRACE_EXPORTER": "thread", "OTEL_KVTRACE_AGENT_CPUS": "0"})
    assert report["agent_sched"].startswith("no agent (OTEL_KVTRACE_EXPORTER=thread")
    for key in ("OTEL_KVTRACE_AGENT_SCHED", "OTEL_KVTRACE_AGENT_NICE", "OTEL_KVTRACE_EXPORTER"):
        monkeypatch.delenv(key, raising=False)
    table = CliRunner().invoke(main, ["doctor", "--source", str(upstream_root)], env={"OTEL_KVTRACE_AGENT_CPUS": str(cpu)})
    assert "exporter agent scheduling: SCHED_IDLE (SCHED_OTHER at nice +10 " in table.output
    assert f"; CPUs {cpu}\n" in table.output
    assert _doctor_json(upstream_root, {"OTEL_KVTRACE_AGENT_CPUS": "4000-4001"})["agent_sched"].endswith(
        "; CPUs 4000-4001 not allowed here: the serving process's")


@pytest.mark.parametrize(("cpus", "text"), [((0, 1, 2, 3, 8), "0-3,8"), ((5,), "5"), ((1, 3, 4), "1,3-4")])
def test_doctor_cpu_list_is_the_form_the_setting_takes(cpus: tuple[int, ...], text: str) -> None:
    from otel_kvtrace import config
    from otel_kvtrace.doctor import _cpu_list

    assert _cpu_list(cpus) == text
    assert config.agent_cpus({config.OTEL_KVTRACE_AGENT_CPUS: text}) == cpus


def test_the_doctor_says_when_the_agent_may_not_leave_sched_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unprivileged with RLIMIT_NICE 0 (Linux's default) the agent cannot return to SCHED_OTHER: the line
    must not promise the escalation; as root, or with a limit that allows the level, it does."""
    import resource

    from otel_kvtrace import doctor

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getpriority", lambda *_a: 0)
    monkeypatch.setattr(resource, "getrlimit", lambda _r: (0, 0))
    assert doctor._escalation_blocked(10) == "not root, RLIMIT_NICE=0 < 10"
    monkeypatch.setattr(resource, "getrlimit", lambda _r: (10, 10))
    assert doctor._escalation_blocked(10) == ""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(resource, "getrlimit", lambda _r: (0, 0))
    assert doctor._escalation_blocked(10) == ""
