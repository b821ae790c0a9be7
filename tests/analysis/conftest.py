"""Shared helpers for the analysis tests: the synthetic OTLP/JSON writer lives in bench/."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
