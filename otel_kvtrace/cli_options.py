"""Click options that several commands share, declared once here.

``output_options`` is the one declaration of the report outputs (``--json``, ``--md``, ``--png-dir``,
``--html``): ``kvtrace report``, ``kvtrace whatif``, ``kvtrace sweep`` and ``kvtrace async check`` take
them with the same names, parameter names and types, and each says in its own help what it writes there.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def option_group(*options: Callable[[F], F]) -> Callable[[F], F]:
    """Several click options as one decorator, so commands sharing them declare them once."""
    def apply(func: F) -> F:
        for option in reversed(options):
            func = option(func)
        return func
    return apply


def output_options(*, json: str, png_dir: str, html: str, md: str | None = None) -> Callable[[F], F]:
    """``--json PATH`` (``json_path``), ``--md PATH`` (``md_path``, only when ``md`` help is given),
    ``--png-dir DIR`` (``png_dir``) and ``--html PATH`` (``html_path``), in that order, with the
    command's help for each."""
    file_path = click.Path(dir_okay=False, path_type=Path)
    options = [click.option("--json", "json_path", type=file_path, help=json)]
    if md is not None:
        options.append(click.option("--md", "md_path", type=file_path, help=md))
    options.append(click.option("--png-dir", type=click.Path(file_okay=False, path_type=Path), help=png_dir))
    options.append(click.option("--html", "html_path", type=file_path, help=html))
    return option_group(*options)
