"""Shared CLI options are declared once: the report outputs in ``otel_kvtrace/cli_options.py``, the
default folders in ``otel_kvtrace/config.py``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click

import otel_kvtrace
from otel_kvtrace import config
from otel_kvtrace.asynccheck.cli import check_command
from otel_kvtrace.collect.cli import collect_command
from otel_kvtrace.report.cli import export_command, report
from otel_kvtrace.whatif.cli import sweep_command, whatif_command

PACKAGE = Path(otel_kvtrace.__file__).parent
OUTPUTS = {"json_path": "--json", "md_path": "--md", "png_dir": "--png-dir", "html_path": "--html"}
DEFAULT_FOLDER = re.compile(r"^(\./)?(kvtrace-data|\.kvtrace-cache)(/[\w.-]+)*/?$")


def _outputs(command: click.Command) -> dict[str, tuple]:
    return {p.name: (tuple(p.opts), type(p.type), p.type.file_okay, p.type.dir_okay, p.type.type)
            for p in command.params if p.name in OUTPUTS}


def test_report_whatif_sweep_and_async_check_take_the_same_output_options() -> None:
    declared = [_outputs(c) for c in (report, whatif_command, sweep_command, check_command)]
    assert set(declared[0]) == set(declared[3]) == {"json_path", "png_dir", "html_path"}
    assert set(declared[1]) == set(declared[2]) == set(OUTPUTS)
    for name, flag in OUTPUTS.items():
        shapes = {d[name] for d in declared if name in d}
        assert len(shapes) == 1 and next(iter(shapes))[0] == (flag,), (name, shapes)


def test_the_output_options_are_declared_only_in_cli_options() -> None:
    for module in ("report/cli.py", "whatif/cli.py"):
        literals = {node.value for node in ast.walk(ast.parse((PACKAGE / module).read_text()))
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        assert not literals & set(OUTPUTS.values()), f"{module} declares its own output options"


def test_default_folders_come_from_config() -> None:
    found = [f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "config.py"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and DEFAULT_FOLDER.match(node.value)]
    assert not found, "default folders belong in otel_kvtrace/config.py: " + "; ".join(found)
    defaults = {(c.name, p.name): p.default for c in (collect_command, sweep_command, report, export_command)
                for p in c.params if p.name in ("out", "out_dir", "cache_dir")}
    assert defaults == {("collect", "out"): config.DEFAULT_TRACES_DIR, ("sweep", "out_dir"): config.DEFAULT_SWEEP_DIR,
                        ("report", "cache_dir"): config.DEFAULT_CACHE_DIR,
                        ("export", "cache_dir"): config.DEFAULT_CACHE_DIR}
