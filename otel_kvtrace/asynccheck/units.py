"""Time-unit conventions of the capture formats, and epoch-magnitude checks.

Each format has a documented unit (``FORMAT_UNITS``); an epoch timestamp's magnitude tells its unit
unambiguously (2026 is ~1.8e9 s, ~1.8e12 ms, ~1.8e15 µs, ~1.8e18 ns), so a column whose values
disagree with its label (msServiceProfiler's ``batch.csv`` ``start_time(ms)`` holds µs) is read in the
unit its magnitude shows, and the importer reports the correction.
"""

from __future__ import annotations

import math

NS_PER = {"ns": 1, "us": 1_000, "ms": 1_000_000, "s": 1_000_000_000}

FORMAT_UNITS: dict[str, str] = {
    "otlp_json": "ns",  # startTimeUnixNano
    "chrome_tracing": "us",  # ts / dur, floats allowed
    "slice": "ns",  # profiler.db / ms_service_*.db slice.timestamp, duration
    "mspti": "ns",  # Communication / Kernel start, end
    "forward_csv": "ms",  # start_time(ms), end_time(ms), divided by 1000 in the exporter
    "batch_csv": "us",  # start_time(ms), end_time(ms): never divided, epoch µs despite the label
}


def epoch_unit(value: float) -> str | None:
    """The unit an epoch timestamp's magnitude implies, or ``None`` when it is not an epoch time."""
    v = abs(value)
    if v >= 1e17:
        return "ns"
    if v >= 1e14:
        return "us"
    if v >= 1e11:
        return "ms"
    if v >= 1e8:
        return "s"
    return None


def to_ns(value: float, unit: str) -> int:
    """Exact for the integer part: ``value * 1e3`` as one float would round epoch µs to 256 ns."""
    whole = math.floor(value)
    return int(whole) * NS_PER[unit] + round((value - whole) * NS_PER[unit])
