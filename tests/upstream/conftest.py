"""Fixtures for the conformance tests on the real vLLM-Ascend recv threads.

The sources are obtained at test time (see ``harness.upstream_source_dir``); when they cannot be
obtained the tests FAIL with the reason, they are never skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_kvtrace.instrument import plugin

from .harness import Upstream, UpstreamUnavailable, upstream_session, upstream_source_dir


_fetch_error: list[str] = []  # one failed fetch per session is enough: do not re-run pip for every test


@pytest.fixture(scope="session")
def upstream_root() -> Path:
    if _fetch_error:
        pytest.fail(_fetch_error[0], pytrace=False)
    try:
        return upstream_source_dir()
    except UpstreamUnavailable as exc:
        _fetch_error.append(f"upstream vllm-ascend sources unavailable: {exc}")
        pytest.fail(_fetch_error[0], pytrace=False)


@pytest.fixture(scope="module")
def upstream(upstream_root: Path) -> Iterator[Upstream]:
    """The upstream modules, imported under stubs for this test module only (removed afterwards)."""
    with upstream_session(upstream_root) as session:
        yield session


@pytest.fixture
def no_plugin_session_leak() -> Iterator[None]:
    """No vLLM plugin session from an earlier test is active, and none outlives this one."""
    plugin.stop()
    yield
    plugin.stop()
