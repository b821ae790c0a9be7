"""The factor analysis recovers planted effects: only B matters -> P within noise, and the reverse."""

from __future__ import annotations

import random

import pytest

from otel_kvtrace.experiment.analysis import factor_effects, verdict


def _grid(hol_of, runs: int = 3, noise: float = 0.5, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    cells = []
    for b in (2, 4):
        for p in (2, 4):
            values = [hol_of(b, p) + rng.gauss(0, noise) for _ in range(runs)]
            cells.append({"config": {"num_shared_buffers": b, "prefetch_layers": p}, "run_values": {"hol_total_ms": values}})
    return cells


def _by_factor(effects: list[dict]) -> dict[str, dict]:
    return {e["factor"]: e for e in effects}


FACTORS = ["num_shared_buffers", "prefetch_layers"]
SEEDS = range(200)


def _real_rate(hol_of, factor: str, **kw) -> float:
    hits = 0
    for seed in SEEDS:
        eff = _by_factor(factor_effects(_grid(hol_of, seed=seed, **kw), FACTORS, ["hol_total_ms"]))
        hits += eff[factor]["real"]
    return hits / len(SEEDS)


def test_only_b_matters() -> None:
    only_b = lambda b, p: 20.0 - 1.0 * b  # noqa: E731 - B 2 -> 4 lowers HOL by 2 ms, noise sd 0.5 ms
    eff = _by_factor(factor_effects(_grid(only_b), FACTORS, ["hol_total_ms"]))
    assert eff["num_shared_buffers"]["effect"] == pytest.approx(-2.0, abs=0.7)
    assert "num_shared_buffers (2 -> 4) lowers" in verdict(list(eff.values()))
    assert _real_rate(only_b, "num_shared_buffers") >= 0.95  # the planted effect is found
    assert _real_rate(only_b, "prefetch_layers") <= 0.10  # P: within noise of zero (~5% false calls at 95%)
    assert _real_rate(only_b, "num_shared_buffers:prefetch_layers") <= 0.10


def test_only_p_matters() -> None:
    only_p = lambda b, p: 1.0 * p  # noqa: E731
    assert _real_rate(only_p, "prefetch_layers") >= 0.95
    assert _real_rate(only_p, "num_shared_buffers") <= 0.10
    eff = _by_factor(factor_effects(_grid(only_p), FACTORS, ["hol_total_ms"]))
    assert eff["prefetch_layers"]["effect"] == pytest.approx(2.0, abs=0.7)


def test_interaction_is_separated_from_main_effects() -> None:
    # HOL only when B is small AND P is large: both main effects and the interaction are real
    eff = _by_factor(factor_effects(_grid(lambda b, p: 10.0 if (b, p) == (2, 4) else 0.0),
                                    ["num_shared_buffers", "prefetch_layers"], ["hol_total_ms"]))
    assert eff["num_shared_buffers:prefetch_layers"]["effect"] == pytest.approx(-5.0, abs=1.0)
    assert eff["num_shared_buffers:prefetch_layers"]["real"]


def test_noise_is_the_pooled_run_to_run_spread() -> None:
    # no effect at all, large run-to-run noise: nothing is real, and a single run gives no noise at all
    assert _real_rate(lambda b, p: 5.0 + 0.5 * b, "num_shared_buffers", noise=3.0) <= 0.15  # lost in the noise
    one = factor_effects(_grid(lambda b, p: 5.0 * b, runs=1), ["num_shared_buffers", "prefetch_layers"], ["hol_total_ms"])
    assert all(e["noise"] is None and not e["real"] for e in one)
    assert "only one run per cell" in verdict(one)


def test_collapsed_axis_does_not_confound_other_factors() -> None:
    # the sweep's shape: the key path has no B (None). HOL depends only on the path; B must show no effect
    rng = random.Random(3)
    cells = []
    for path, buffers in (("gva", 2), ("gva", 4), ("key", None)):
        values = [(10.0 if path == "key" else 0.0) + rng.gauss(0, 0.2) for _ in range(3)]
        cells.append({"config": {"path": path, "num_shared_buffers": buffers}, "run_values": {"hol_total_ms": values}})
    effects = factor_effects(cells, ["path", "num_shared_buffers"], ["hol_total_ms"])
    b = [e for e in effects if e["factor"] == "num_shared_buffers"]
    two_four = next(e for e in b if e["high"] == 4)
    assert abs(two_four["effect"]) < 1.0 and not two_four["real"]
    default = next(e for e in b if e["high"] is None)  # B=None exists only on the key path: no sub-grid
    assert default["effect"] is None and not default["real"]
    assert "not estimable" in verdict(effects)


def test_middle_level_and_failed_cell_are_visible() -> None:
    cells = [{"config": {"num_shared_buffers": b, "prefetch_layers": p},
              "run_values": {"hol_total_ms": [] if (b, p) == (4, 4) else [b + 0.1 * k for k in range(3)]}}
             for b in (2, 3, 4) for p in (2, 4)]
    effects = factor_effects(cells, FACTORS, ["hol_total_ms"])
    b_rows = {e["high"]: e for e in effects if e["factor"] == "num_shared_buffers"}
    assert set(b_rows) == {3, 4}  # the middle level has its own row
    assert b_rows[3]["balanced"] and b_rows[3]["effect"] == pytest.approx(1.0)
    assert not b_rows[4]["balanced"] and b_rows[4]["contexts"] == 1 and b_rows[4]["contexts_total"] == 2
    assert "unbalanced" in verdict(effects)


def test_pooled_variance_ignores_missing_values() -> None:
    from otel_kvtrace.experiment.analysis import pooled_variance

    assert pooled_variance([[1.0, None, 3.0], [None]]) == (2.0, 1)
