"""Replica configuration: upstream defaults and clear errors that name the bad option."""

from __future__ import annotations

import pytest

from otel_kvtrace.replica.config import ReplicaConfig, ReplicaConfigError, SlowInjection, Timing


def test_main_gva_defaults_follow_upstream() -> None:
    cfg = ReplicaConfig(num_layers=12)
    assert cfg.resolved_buffers == 12  # B defaults to N: no reuse
    assert cfg.resolved_prefetch == 8  # min(B, 8)
    assert ReplicaConfig(num_layers=12, num_shared_buffers=3).resolved_prefetch == 3
    assert cfg.resolved_independent == (0,)


@pytest.mark.parametrize("cfg", [ReplicaConfig(behaviour="v0.23", num_shared_buffers=2), ReplicaConfig(path="key")])
def test_v023_and_key_path_prefetch_one_and_no_reuse(cfg: ReplicaConfig) -> None:
    assert cfg.resolved_prefetch == 1
    assert not cfg.reuse_enabled


def test_independent_layers_negative_and_all() -> None:
    assert ReplicaConfig(num_layers=8, independent_layers=(0, -1)).resolved_independent == (0, 7)
    assert ReplicaConfig(num_layers=3, independent_layers="all").resolved_independent == (0, 1, 2)
    assert ReplicaConfig(num_layers=8, independent_layers=(4, 0)).independent_label == "0,4"


@pytest.mark.parametrize(
    ("changes", "option"),
    [
        ({"num_shared_buffers": 0}, "num_shared_buffers"),
        ({"prefetch_layers": 0}, "prefetch_layers"),
        ({"independent_layers": (0, 9)}, "independent_layers"),
        ({"independent_layers": (-9,)}, "independent_layers"),
        ({"independent_layers": "some"}, "independent_layers"),
        ({"behaviour": "v0.22"}, "behaviour"),
        ({"path": "rdma"}, "path"),
        ({"num_layers": 0}, "num_layers"),
        ({"steps": 0}, "steps"),
        ({"timing": Timing(attention_us=-1)}, "timing.attention_us"),
        ({"timing": Timing(load_h2d_us_per_block=-0.5)}, "timing.load_h2d_us_per_block"),
        ({"timing": Timing(jitter="gauss")}, "timing.jitter"),
        ({"timing": Timing(independent_load_fraction=1.5)}, "timing.independent_load_fraction"),
        ({"slow": SlowInjection(slow_save_us=-3)}, "slow.slow_save_us"),
        ({"slow": SlowInjection(slow_save_layers=(8,))}, "slow.slow_save_layers"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
    ],
)
def test_bad_option_is_named(changes: dict, option: str) -> None:
    with pytest.raises(ReplicaConfigError, match=rf"^{option}: "):
        ReplicaConfig(num_layers=8).with_(**changes)


def test_label_and_resource_attributes() -> None:
    cfg = ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, independent_layers=(0, 4))
    assert cfg.label == "main gva N=8 B=2 P=4 indep=0,4"
    attrs = cfg.resource_attributes()
    assert attrs["kvtrace.source"] == "replica"
    assert attrs["kvtrace.cfg.label"] == cfg.label
    assert attrs["kvtrace.cfg.num_shared_buffers"] == 2
    assert attrs["kvtrace.cfg.independent_layers"] == "0,4"
    assert attrs["kvtrace.cfg.buffer_reuse"] is True
    assert attrs["vllm_ascend.version"] == "replica-main"
    assert ReplicaConfig(behaviour="v0.23").resource_attributes()["kvtrace.cfg.buffer_reuse"] is False
    # scenarios that differ only in load or injected delays get different labels (reports group by label)
    stressed = cfg.with_(requests_per_step=2, slow=SlowInjection(slow_save_layers=(1,), slow_slot_release_layers=(3,)))
    assert stressed.label == "main gva N=8 B=2 P=4 indep=0,4 req=2 slow_save=1 slow_slot=3"
