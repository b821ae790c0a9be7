"""``SummaryCache``: the recording thread reuses a transfer-task summary across the layers of a step
(the same ``SharedBlockData`` object) and never returns a stale one when the shared data changes."""

from __future__ import annotations

from export_records import FakeBlockRange, FakeLayerTransferTask, FakeReq, FakeShared

from otel_kvtrace.export.spans import SummaryCache, summarize_transfer_tasks


class CountingId:
    """A request id that counts how often it is named (``str``): each count is one real summary."""

    calls = 0

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        CountingId.calls += 1
        return self.name


def _shared(*names: str, blocks: int = 4) -> FakeShared:
    return FakeShared(req_ids=[CountingId(n) for n in names], block_ids_arr=list(range(blocks)),
                      is_last_chunks=[True] * len(names), load_keys=[])


def _task(shared: FakeShared | None, layer: int, group: int = 0) -> FakeLayerTransferTask:
    return FakeLayerTransferTask(group_id=group, layer_idx_in_group=layer, shared_block_data=shared)


def _view(summary) -> tuple[list[int], list[str], int]:
    return summary.group_ids, summary.request_ids, summary.num_blocks


def test_the_layers_of_one_step_share_one_summary() -> None:
    cache = SummaryCache()
    shared = _shared("a", "b")
    first = cache.get(_task(shared, 0))
    calls = CountingId.calls
    for layer in range(1, 8):  # every layer's task of the step carries the same shared data
        assert cache.get(_task(shared, layer)) is first
        assert cache.get([_task(shared, layer)]) is first  # the list form the wrappers may store too
    assert CountingId.calls == calls, "the cached summary was recomputed"
    assert _view(first) == ([0], ["a", "b"], 4)


def test_a_changed_shared_data_is_summarised_afresh() -> None:
    cache = SummaryCache()
    shared = _shared("a")
    assert _view(cache.get(_task(shared, 0))) == ([0], ["a"], 4)
    # the next step: new shared data (upstream builds one per step)
    assert _view(cache.get(_task(_shared("b", "c", blocks=2), 0))) == ([0], ["b", "c"], 2)
    # the same object, its id list replaced
    shared = _shared("a")
    cache.get(_task(shared, 0))
    shared.req_ids = [CountingId("z")]
    assert _view(cache.get(_task(shared, 1))) == ([0], ["z"], 4)
    # the same list, grown in place
    shared.req_ids.append(CountingId("y"))
    assert _view(cache.get(_task(shared, 2))) == ([0], ["z", "y"], 4)
    # a new block array
    shared.block_ids_arr = [1]
    assert _view(cache.get(_task(shared, 3))) == ([0], ["z", "y"], 1)
    # the same block list, grown in place
    shared.block_ids_arr.append(2)
    assert _view(cache.get(_task(shared, 3))) == ([0], ["z", "y"], 2)
    # another group, same shared data
    assert _view(cache.get(_task(shared, 3, group=2))) == ([2], ["z", "y"], 2)


def test_whatever_is_not_one_task_with_shared_data_is_summarised_exactly() -> None:
    cache = SummaryCache()
    shared = _shared("a")
    two = [_task(shared, 0), _task(_shared("b"), 0, group=1)]
    assert _view(cache.get(two)) == _view(summarize_transfer_tasks(two)) == ([0, 1], ["a", "b"], 8)
    ranged = FakeLayerTransferTask(group_id=3, layer_idx_in_group=0,
                                   block_ranges=[FakeBlockRange(FakeReq("k"), 2, 5)])
    assert _view(cache.get(ranged)) == ([3], ["k"], 3)  # key path: no shared data
    ranged.block_ranges[0].end_block = 9
    assert _view(cache.get(ranged)) == ([3], ["k"], 7)
    assert _view(cache.get(None)) == ([], [], 0)


def test_recv_and_send_tasks_keep_their_own_entry() -> None:
    cache = SummaryCache()
    load, save = _shared("load"), _shared("save")
    loaded = cache.get(_task(load, 0), 0)
    saved = cache.get(_task(save, 0), 1)
    assert cache.get(_task(load, 1), 0) is loaded and cache.get(_task(save, 1), 1) is saved
    assert _view(loaded)[1] == ["load"] and _view(saved)[1] == ["save"]
