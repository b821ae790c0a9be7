"""Values from a trace (labels, queues, run ids) reach the terminal as text, never as Rich markup."""

from __future__ import annotations

import sys
from pathlib import Path

from click.testing import CliRunner

from otel_kvtrace.asynccheck.replica import ReplicaConfig, run_replica
from otel_kvtrace.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json  # noqa: E402

MARKUP = "B2[/]x [bold]b[/bold] [link=http://x]l[/link]"
"""A closing tag with nothing open (MarkupError before the fix), a style and a link."""

_WIDE = {"COLUMNS": "400"}  # labels fold at 80 columns; wide enough to find them on one line


def _trace(tmp_path: Path) -> Path:
    spec = QueueSpec(run_id="run" + MARKUP, cfg_label="cfg " + MARKUP, thread_name="kv-recv" + MARKUP)
    return write_otlp_json(tmp_path / "t.jsonl", [(spec, simulate_queue(spec, 48, seed=2, hol_probability=0.3))])


def test_report_shows_markup_in_labels_literally(tmp_path: Path) -> None:
    result = CliRunner(env=_WIDE).invoke(main, ["report", str(_trace(tmp_path)), "--no-cache"])
    assert result.exit_code == 0, result.output
    assert "cfg " + MARKUP in result.output
    assert "kv-recv" + MARKUP in result.output  # the queue id (queue depth table)


def test_whatif_shows_markup_in_labels_literally(tmp_path: Path) -> None:
    result = CliRunner(env=_WIDE).invoke(main, ["whatif", str(_trace(tmp_path))])
    assert result.exit_code == 0, result.output
    assert "cfg " + MARKUP in result.output


def test_async_check_shows_markup_in_paths_literally(tmp_path: Path) -> None:
    folder = tmp_path / "d [bold]b [red]r"  # the capture's path is printed with the verdict
    folder.mkdir()
    path = run_replica(ReplicaConfig(mode="async", num_steps=8), out_dir=folder)
    result = CliRunner(env=_WIDE).invoke(main, ["async", "check", str(path)])
    assert result.exit_code == 0, result.output
    assert "d [bold]b [red]r" in result.output
