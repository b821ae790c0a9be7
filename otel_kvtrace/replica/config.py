"""One configuration for both replica engines (threaded real clock and virtual clock).

Defaults follow vLLM-Ascend (research §2.2): on ``main`` with the GVA path, ``num_shared_buffers``
defaults to ``num_layers`` (no reuse) and ``prefetch_layers`` to ``min(B, 8)``; on ``v0.23`` and on the
key path the prefetch depth defaults to 1 and there is no buffer reuse. Times are microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

BEHAVIOURS = ("main", "v0.23")
PATHS = ("gva", "key")
JITTER_KINDS = ("none", "uniform", "lognormal", "exponential")


class ReplicaConfigError(ValueError):
    """A replica option has an impossible value; the message names the option."""


@dataclass(slots=True, frozen=True)
class Timing:
    """Durations in microseconds. Per-block costs scale with the blocks a task moves."""

    layer_compute_us: float = 600.0
    attention_us: float = 300.0
    host_launch_us: float = 150.0
    save_d2h_us_per_block: float = 40.0
    load_h2d_us_per_block: float = 40.0
    copy_call_us: float = 100.0
    meta_build_us: float = 20.0
    h2d_stagger_us: float = 0.0
    slot_release_us: float = 0.0
    """A sibling connector frees each layer's external slot this long after the step starts; with a value
    (or slow slot-release layers) ``main`` GVA gets an ``external_slot_release_waiter`` that blocks until then."""
    blocks_per_request: int = 8
    independent_load_fraction: float = 1.0
    """The share of each request's blocks vLLM has not cached (the tail). Upstream loads only that tail unless
    buffers are really shared (``has_layer_reuse``): then reused layers reload the whole chunk and independent
    layers load the tail. Without reuse (B=N, v0.23, key path) every layer loads the tail. 0 leaves the layers
    that load the tail without load tasks."""
    jitter: str = "none"
    jitter_spread: float = 0.2


@dataclass(slots=True, frozen=True)
class SlowInjection:
    """Extra delay for chosen layers (every step): a slow save, a slow slot release, a late gate."""

    slow_save_layers: tuple[int, ...] = ()
    slow_save_us: float = 0.0
    slow_slot_release_layers: tuple[int, ...] = ()
    slow_slot_release_us: float = 0.0
    """The slot of these layers is freed this much later (absolute: measured from the step start)."""
    late_gate_layers: tuple[int, ...] = ()
    late_gate_us: float = 0.0
    fail_copy_at: tuple[int, int] | None = None
    """(step, layer) whose load copy returns an error code (exception-propagation tests)."""


@dataclass(slots=True, frozen=True)
class ReplicaConfig:
    """What to replicate: upstream behaviour, layout, load and timing.

    Example: ``ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4,
    independent_layers=(0, 4), slow=SlowInjection(slow_save_layers=(1,), slow_save_us=4000))``.
    """

    behaviour: str = "main"
    path: str = "gva"
    num_layers: int = 8
    num_shared_buffers: int | None = None
    prefetch_layers: int | None = None
    independent_layers: tuple[int, ...] | str = (0,)
    buffer_reuse: bool = True
    bucket_pattern: str | None = None
    """Multi-bucket layouts: layer ``l`` gets cache-spec kind ``bucket_pattern[l % len]`` (e.g. ``"aab"``)."""
    requests_per_step: int = 1
    """Concurrent requests: every step's batch holds this many (0 = steps without pool loads)."""
    chunks_per_request: int = 1
    """Steps each request stays in the batch (chunked prefill), staggered so requests end at different steps."""
    steps: int = 4
    seed: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    timing: Timing = field(default_factory=Timing)
    slow: SlowInjection = field(default_factory=SlowInjection)
    scheduler: str = "fifo"
    """Recv-thread policy the threaded replica runs (``otel_kvtrace.schedule``; not part of ``label``)."""

    # -- resolved values -------------------------------------------------------------------------
    @property
    def resolved_buffers(self) -> int:
        """B after defaults: ``num_layers`` when unset (upstream: no reuse)."""
        return self.num_layers if self.num_shared_buffers is None else self.num_shared_buffers

    @property
    def reuse_enabled(self) -> bool:
        """Buffer reuse exists only on ``main`` with the GVA path (research §2.2)."""
        return self.behaviour == "main" and self.path == "gva" and self.buffer_reuse

    @property
    def resolved_prefetch(self) -> int:
        if self.prefetch_layers is not None:
            return self.prefetch_layers
        if self.behaviour == "main" and self.path == "gva":
            return min(self.resolved_buffers, 8)
        return 1

    @property
    def resolved_independent(self) -> tuple[int, ...]:
        """Independent physical layers, normalised (negative indices resolved, sorted)."""
        n = self.num_layers
        if isinstance(self.independent_layers, str):  # "all" (validated)
            return tuple(range(n))
        return tuple(sorted({i % n for i in self.independent_layers}))

    @property
    def independent_label(self) -> str:
        if self.independent_layers == "all":
            return "all"
        return ",".join(str(i) for i in self.resolved_independent)

    @property
    def label(self) -> str:
        """Short human label used as ``kvtrace.cfg.label`` (docs/schema.md)."""
        text = (
            f"{self.behaviour} {self.path} N={self.num_layers} B={self.resolved_buffers} "
            f"P={self.resolved_prefetch} indep={self.independent_label}"
        )
        if self.bucket_pattern:
            text += f" buckets={self.bucket_pattern}"
        if not self.buffer_reuse:
            text += " reuse=off"
        if self.requests_per_step != 1:
            text += f" req={self.requests_per_step}"
        if self.timing.independent_load_fraction != 1:
            text += f" indep_load={self.timing.independent_load_fraction:g}"
        s = self.slow
        for name, layers in (("slow_save", s.slow_save_layers), ("slow_slot", s.slow_slot_release_layers),
                             ("late_gate", s.late_gate_layers)):
            if layers:
                text += f" {name}={','.join(str(x) for x in layers)}"
        return text

    def resource_attributes(self) -> dict[str, object]:
        """``kvtrace.cfg.*`` and replica identity attributes for the OTel resource."""
        return {
            "kvtrace.source": "replica",
            "kvtrace.cfg.label": self.label,
            "kvtrace.cfg.num_layers": self.num_layers,
            "kvtrace.cfg.prefetch_layers": self.resolved_prefetch,
            "kvtrace.cfg.num_shared_buffers": self.resolved_buffers,
            "kvtrace.cfg.independent_layers": self.independent_label,
            "kvtrace.cfg.buffer_reuse": self.reuse_enabled,
            "kvtrace.cfg.scheduler": self.scheduler,
            "kvtrace.rank.tp": self.tp_rank,
            "kvtrace.rank.tp_size": self.tp_size,
            "kvtrace.rank.dp": 0,
            "kvtrace.rank.pp": 0,
            "kvtrace.rank.pcp": 0,
            "kvtrace.rank.dcp": 0,
            "kvtrace.role": "kv_both",
            "vllm_ascend.version": f"replica-{self.behaviour}",
        }

    def with_(self, **changes: object) -> ReplicaConfig:
        """A validated copy with some fields changed."""
        cfg = replace(self, **changes)  # type: ignore[arg-type]
        cfg.validate()
        return cfg

    def validate(self) -> ReplicaConfig:
        """Raise ``ReplicaConfigError`` naming the first bad option; return self when fine."""
        _check(self.behaviour in BEHAVIOURS, "behaviour", f"must be one of {BEHAVIOURS}, got {self.behaviour!r}")
        _check(self.path in PATHS, "path", f"must be one of {PATHS}, got {self.path!r}")
        from otel_kvtrace.schedule import MERGED_LIVE

        _check(self.scheduler in MERGED_LIVE, "scheduler", f"must be one of {MERGED_LIVE}, got {self.scheduler!r}")
        _check(self.scheduler != "gate_group" or self.path == "gva", "scheduler",
               "gate_group needs the GVA path (one merged batch_copy); the key path runs fifo or ready_queue")
        _check_min_int("num_layers", self.num_layers, 1)
        if self.num_shared_buffers is not None:
            _check_min_int("num_shared_buffers", self.num_shared_buffers, 1)
        if self.prefetch_layers is not None:
            _check_min_int("prefetch_layers", self.prefetch_layers, 1)
        indep = self.independent_layers
        if indep != "all":
            _check(
                isinstance(indep, tuple | list),
                "independent_layers",
                f"must be a list of layer indices or 'all', got {indep!r}",
            )
            for layer in indep:
                _check(
                    isinstance(layer, int) and not isinstance(layer, bool)
                    and -self.num_layers <= layer < self.num_layers,
                    "independent_layers",
                    f"unknown layer {layer!r} for num_layers={self.num_layers}",
                )
        if self.bucket_pattern is not None:
            _check(
                isinstance(self.bucket_pattern, str) and len(self.bucket_pattern) >= 1,
                "bucket_pattern",
                "must be a non-empty string of kind letters, e.g. 'aab'",
            )
        _check_min_int("requests_per_step", self.requests_per_step, 0)
        _check_min_int("chunks_per_request", self.chunks_per_request, 1)
        _check_min_int("steps", self.steps, 1)
        _check_min_int("tp_size", self.tp_size, 1)
        _check(_is_int(self.tp_rank) and 0 <= self.tp_rank < self.tp_size, "tp_rank",
               f"must be in [0, tp_size), got {self.tp_rank!r}")
        t = self.timing
        for name in (
            "layer_compute_us", "attention_us", "host_launch_us", "save_d2h_us_per_block",
            "load_h2d_us_per_block", "copy_call_us", "meta_build_us", "h2d_stagger_us", "slot_release_us",
            "jitter_spread",
        ):
            value = getattr(t, name)
            _check(isinstance(value, int | float) and value >= 0, f"timing.{name}", f"must be >= 0, got {value!r}")
        _check(
            isinstance(t.independent_load_fraction, int | float) and 0 <= t.independent_load_fraction <= 1,
            "timing.independent_load_fraction", f"must be in [0, 1], got {t.independent_load_fraction!r}",
        )
        _check_min_int("timing.blocks_per_request", t.blocks_per_request, 1)
        _check(t.jitter in JITTER_KINDS, "timing.jitter", f"must be one of {JITTER_KINDS}, got {t.jitter!r}")
        s = self.slow
        for name in ("slow_save_us", "slow_slot_release_us", "late_gate_us"):
            value = getattr(s, name)
            _check(isinstance(value, int | float) and value >= 0, f"slow.{name}", f"must be >= 0, got {value!r}")
        for name in ("slow_save_layers", "slow_slot_release_layers", "late_gate_layers"):
            for layer in getattr(s, name):
                _check(
                    _is_int(layer) and 0 <= layer < self.num_layers,
                    f"slow.{name}",
                    f"unknown layer {layer!r} for num_layers={self.num_layers}",
                )
        if s.fail_copy_at is not None:
            step, layer = s.fail_copy_at
            _check(0 <= layer < self.num_layers, "slow.fail_copy_at", f"unknown layer {layer!r}")
            _check(0 <= step < self.steps, "slow.fail_copy_at", f"unknown step {step!r}")
        return self


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_min_int(option: str, value: object, minimum: int) -> None:
    ok = _is_int(value) and value >= minimum  # type: ignore[operator]
    _check(ok, option, f"must be an integer >= {minimum}, got {value!r}")


def _check(ok: bool, option: str, message: str) -> None:
    if not ok:
        raise ReplicaConfigError(f"{option}: {message}")
