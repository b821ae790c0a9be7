"""Time-unit conventions of the capture formats, and epoch-magnitude checks.

Each format has a documented unit (``FORMAT_UNITS``); an epoch timestamp's magnitude tells its unit
unambiguously (2026 is ~1.8e9 s, ~1.8e12 ms, ~1.8e15 µs, ~1.8e18 ns), so a column whose values
disagree with its label (msServiceProfiler's ``batch.csv`` ``start_time(ms)`` holds µs) is read in the
unit its magnitude shows, and the importer reports the correction.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

NS_PER = {"ns": 1, "us": 1_000, "ms": 1_000_000, "s": 1_000_000_000}

FORMAT_UNITS: dict[str, str] = {
    "otlp_json": "ns",  # startTimeUnixNano
    "chrome_tracing": "us",  # ts / dur, floats allowed
    "slice": "ns",  # profiler.db / ms_service_*.db slice.timestamp, duration
    "mspti": "ns",  # Communication / Kernel start, end
    "forward_csv": "ms",  # start_time(ms), end_time(ms), divided by 1000 in the exporter
    "batch_csv": "us",  # start_time(ms), end_time(ms): never divided, epoch µs despite the label
}


def epoch_unit(value: float | Decimal) -> str | None:
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


def to_ns(value: float | int | Decimal, unit: str) -> int:
    """Exact conversion: ``value * 1e3`` in floats would round epoch µs to 256 ns.

    Importers parse numbers from text as ``Decimal`` (an epoch in ms with 3 decimals does not fit a
    float exactly); a float is taken at its exact binary value.
    """
    scaled = Decimal(value) * NS_PER[unit]
    return int(scaled.to_integral_value(ROUND_HALF_EVEN))


def parse_number(value: object) -> Decimal:
    """A number from JSON/CSV/SQLite (numeric strings allowed); ValueError otherwise."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"not a number: {value!r}")
    if isinstance(value, (int, float, Decimal)):
        number = Decimal(value)
    else:
        try:
            number = Decimal(str(value).strip())
        except InvalidOperation:
            raise ValueError(f"not a number: {value!r}") from None
    if not number.is_finite():
        raise ValueError(f"not a finite number: {value!r}")
    return number


MIN_EPOCH_NS = 946_684_800 * NS_PER["s"]
"""2000-01-01: msServiceProfiler times are epoch clock readings, never earlier."""
MAX_EPOCH_NS = 4_102_444_800 * NS_PER["s"]
"""2100-01-01: later is an impossible reading (and keeps every time inside int64)."""
MAX_SPAN_NS = 86_400 * NS_PER["s"]
"""A span longer than a day is a corrupt end time, not an engine phase."""


def time_problem(start_ns: int, end_ns: int) -> str | None:
    """Why ``[start_ns, end_ns]`` cannot be an msServiceProfiler span, or None when it can."""
    if not MIN_EPOCH_NS <= start_ns <= MAX_EPOCH_NS:
        return f"start {start_ns} ns is not an epoch time between 2000 and 2100"
    if end_ns < start_ns:
        return "ends before it starts"
    if end_ns - start_ns > MAX_SPAN_NS:
        return "lasts more than a day: corrupt end time"
    return None
