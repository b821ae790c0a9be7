"""CLI and docs stay in step: every command loads, has help with an example, and is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from otel_kvtrace.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent


def test_top_level_help_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    for name in COMMANDS:
        assert re.search(rf"^\s+{re.escape(name)}\s", result.output, re.M), f"{name} missing from --help"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_imports_and_has_help(name: str) -> None:
    result = CliRunner().invoke(main, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert len(result.output.strip().splitlines()) > 3, f"`kvtrace {name} --help` says too little"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_is_mentioned_in_the_readme(name: str) -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"kvtrace {name}" in readme, f"README does not mention `kvtrace {name}`"


def test_unknown_command_is_a_clear_error() -> None:
    result = CliRunner().invoke(main, ["no-such-command"])
    assert result.exit_code != 0
    assert "No such command" in result.output


def test_schema_names_every_serve_resource_attribute_and_exporter_metric() -> None:
    """A resource attribute or metric the package emits is in docs/schema.md (it is how users find it)."""
    from otel_kvtrace.export import worker

    schema = (ROOT / "docs" / "schema.md").read_text()
    serve = (ROOT / "otel_kvtrace" / "serve" / "run.py").read_text()
    names = set(re.findall(r'"(kvtrace\.serve\.[a-z_]+)"', serve))
    names |= {worker.DROPPED_METRIC, worker.DELIVERED_METRIC, worker.SPOOLED_METRIC}
    assert len(names) >= 5
    assert sorted(n for n in names if f"`{n}`" not in schema) == []
    assert "global MeterProvider when one is configured" not in schema  # meter_provider= exists


def test_readme_says_where_scheduler_and_drop_log_settings_do_not_apply() -> None:
    rows = {line.split("|")[1].strip(): line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| `OTEL_KVTRACE_")}
    assert "key path" in rows["`OTEL_KVTRACE_SCHEDULER`"] and "external_slot_release_waiter" in rows["`OTEL_KVTRACE_SCHEDULER`"]
    drop_row = next(line for key, line in rows.items() if "OTEL_KVTRACE_DROP_LOG_INTERVAL_S" in key)
    assert "agent mode" in drop_row
