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
