"""Suite-wide fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
"""The synthetic OTLP/JSON writer (``synthetic_traces``) lives in bench/; tests import it from there."""
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


@pytest.fixture(autouse=True)
def _spool_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """OTLP delivery spools (``OTEL_KVTRACE_SPOOL_DIR``) go to a temporary directory, never the checkout.

    Set in the environment, so subprocesses started by a test inherit it.
    """
    root = tmp_path_factory.mktemp("spool")
    monkeypatch.setenv("OTEL_KVTRACE_SPOOL_DIR", str(root))
    return root
