"""One number formatter for every table cell (the report's terminal, the async check's terminal and page)."""

from __future__ import annotations

from typing import Any


def num(value: Any, fmt: str | None = None) -> str:
    """``value`` in ``fmt``; ``-`` when the input has no such value. Without ``fmt``: a float to three
    decimals (from 1000 on, one decimal with thousands separators), anything else as ``str``."""
    if value is None:
        return "-"
    if fmt is not None:
        return fmt.format(value)
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.1f}"
    return str(value)
