"""Fixtures for the exporter tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from export_records import fill_record

from otel_kvtrace.record.model import TaskRecord


@pytest.fixture
def make_record() -> Callable[..., TaskRecord]:
    """Factory of realistic recv-task records (keyword arguments as ``fill_record``)."""

    def make(**kwargs: Any) -> TaskRecord:
        return fill_record(TaskRecord(), **kwargs)

    return make
