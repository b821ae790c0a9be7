"""The send thread's build wake-up, behind the recv thread's build (``whatif/gil.py``, third part).

Found with the scheduler's events on the threaded replica (docs/whatif.md, "The final layer's miss,
measured to the sleep"): both threads sleep briefly in their metadata build; one timer interrupt ends two
sleeps that began together, and the recv thread, run first, keeps the CPU through its Python to its copy's
sleep. Under FIFO that delays ``hol``'s saves 2 and 6, under live ``ready_queue`` save 4 too.
"""

from __future__ import annotations

from types import SimpleNamespace

from otel_kvtrace.whatif import gil
from otel_kvtrace.whatif.columns import QueueArrays
from otel_kvtrace.whatif.engine import replay_queue
from otel_kvtrace.whatif.policy import get_policy
from otel_kvtrace.whatif.saves import SaveTask
from otel_kvtrace.whatif.task import ReplayTask
from tests.whatif.fixtures import U, three_loads_behind_a_save


def test_a_recv_build_ends_before_the_wait_after_it_and_its_copy_starts_after() -> None:
    # build 0-10 of the work, then a gate wait that blocks until 100, then the copy at work offset 20
    task = ReplayTask("q", 0, 0, 0, 0, (10, 0, 50, 40), ready_gate_ns=100, copy_at_ns=20, backend_submit_ns=30,
                      meta_at_ns=0, meta_ns=10)
    rep = replay_queue(QueueArrays.from_tasks([task]), get_policy("fifo"))
    # ... but across that blocking wait the recv thread let go of the CPU: no run from the build to the copy
    assert gil.recv_builds(rep) == []
    # in one run of its work (the wait met at once) it is one
    met = ReplayTask("q", 0, 0, 0, 0, (10, 0, 50, 40), ready_gate_ns=5, copy_at_ns=20, backend_submit_ns=30,
                     meta_at_ns=0, meta_ns=10)
    assert gil.recv_builds(replay_queue(QueueArrays.from_tasks([met]), get_policy("fifo"))) == [(10, 20)]
    # a task without a recorded build is not one
    bare = ReplayTask("q", 0, 0, 0, 0, (10, 0, 50, 40), copy_at_ns=20, backend_submit_ns=30)
    assert gil.recv_builds(replay_queue(QueueArrays.from_tasks([bare]), get_policy("fifo"))) == []


def test_a_save_meets_a_build_that_ends_while_it_sleeps_in_its_own_and_waits_for_that_copy() -> None:
    rep = SimpleNamespace(send_pre=[[(0, 100 * U), (200 * U, 300 * U), (400 * U, 500 * U), (600 * U, 600 * U)]])
    builds = [(20 * U, 95 * U), (60 * U, 90 * U), (260 * U, 280 * U), (420 * U, 430 * U)]
    met = gil.meetings(rep, builds)
    # save 0 meets the build ending at 60 (the one at 20 ended in its first half: the send thread was
    # still running then); save 2 meets none in its second half; save 3 has no pre-sync work
    assert met == {(0, 0): (0, 100 * U, (60 * U, 90 * U)), (0, 1): (200 * U, 300 * U, (260 * U, 280 * U)),
                   (0, 2): (400 * U, 500 * U, None)}
    model = gil.BuildModel(20 * U, {(0, 0): 100 * U, (0, 1): 60 * U, (0, 2): 100 * U}, 30)
    # save 0: the met copy starts at 90, + 20 = 110, 10 after its own end; save 1: 300 against 260
    assert gil.build_waits(rep, builds, model) == {(0, 0): 10 * U, (0, 1): 40 * U, (0, 2): 0}
    # a save whose own work would have ended before the met build did does not wait for it (a FIFO save
    # slow for another reason: its recorded window is long, the build ended late in it, its own work not)
    early = gil.BuildModel(20 * U, {(0, 0): 50 * U, (0, 1): 59 * U, (0, 2): 100 * U}, 30)
    assert gil.build_waits(rep, builds, early) == {(0, 0): 0, (0, 1): 0, (0, 2): 0}
    q = SimpleNamespace(send=[[()] * 4])
    rep.arrays = q
    assert gil.pre_extra(rep, {(0, 0): 10 * U, (0, 1): 0, (0, 2): 0}, {(0, 0): 0, (0, 1): 40 * U, (0, 2): 0}
                         ) == [[-10 * U, 40 * U, 0, 0]]


def test_the_model_is_sized_from_fifo_saves_that_met_a_build() -> None:
    # 40 steps of one save: alone it works 60 us before its sync; in steps 0-31 it meets a recv build and
    # ends 20 us (24 steps) or 25 us (8 steps) after that copy's start, 100 us after its own start
    def fifo(met_steps: range) -> tuple[SimpleNamespace, list[tuple[int, int]]]:
        windows, builds = [], []
        for s in range(40):
            a = s * 1000 * U
            if s in met_steps:
                windows.append([(a, a + 100 * U)])
                builds.append((a + 70 * U, a + (80 if s % 4 else 75) * U))
            else:
                windows.append([(a, a + 60 * U)])
        return SimpleNamespace(send_pre=windows), builds

    assert gil.fit_build(*fifo(range(29))) is None  # 29 meetings: fewer than MIN_POINTS
    model = gil.fit_build(*fifo(range(32)))
    assert model is not None and model.points == 32
    assert model.tail_ns == 20 * U  # 24 x 20 and 8 x 25 us
    # a save that met a build works, on its own, what the saves of its position that met none worked
    assert model.own[(0, 0)] == 60 * U and model.own[(39, 0)] == 60 * U


def test_a_build_wait_delays_the_save_before_its_npu_sync_and_the_load_behind_it() -> None:
    tasks = three_loads_behind_a_save()
    saves = [SaveTask(0, 0, 110 * U, 1500 * U, 120 * U, 310 * U, 400 * U, 1400 * U),
             SaveTask(0, 1, 210 * U, 2600 * U, 1510 * U, 1511 * U, 1600 * U, 2590 * U)]
    q = QueueArrays.from_tasks(tasks, saves)
    rep = replay_queue(q, get_policy("fifo"))
    assert rep.send_pre == [[(110 * U, 120 * U), (1500 * U, 1510 * U)]]  # start .. NPU sync start
    moved = replay_queue(q, get_policy("fifo"), pre_extra_ns=[[0, 30 * U]])
    assert moved.send_pre == [[(110 * U, 120 * U), (1500 * U, 1540 * U)]]
    assert moved.complete[2] == rep.complete[2] + 30 * U  # layer 2 waits on the save of layer 1
    # save 0's NPU sync waited for its device until 310: 100 us more work before it is absorbed there
    absorbed = replay_queue(q, get_policy("fifo"), pre_extra_ns=[[100 * U, 0]])
    assert absorbed.send_post == rep.send_post and absorbed.complete == rep.complete
    # less than none: the sync never starts before the save did (save 1 has 10 us of it)
    cut = replay_queue(q, get_policy("fifo"), pre_extra_ns=[[0, -500 * U]])
    assert cut.send_pre == [[(110 * U, 120 * U), (1500 * U, 1500 * U)]]
    assert cut.complete[2] == rep.complete[2] - 10 * U


def test_a_policy_replay_gets_its_build_waits_minus_fifo_s() -> None:
    """``replay_policy``'s third pass with a build model: FIFO's save 1 waited 30 us behind a recv build; on
    the policy's timeline it meets none (no recv task has a recorded build), so it loses that wait, down
    to its own start (10 us of pre-sync work here), and layer 2 behind it moves with it."""
    tasks = three_loads_behind_a_save()
    saves = [SaveTask(0, 0, 110 * U, 1500 * U, 120 * U, 310 * U, 400 * U, 1400 * U),
             SaveTask(0, 1, 210 * U, 2600 * U, 1510 * U, 1511 * U, 1600 * U, 2590 * U)]
    q = QueueArrays.from_tasks(tasks, saves)
    fifo = replay_queue(q, get_policy("fifo"), shift_steps=False)
    policy = get_policy("ready_queue")
    kw = {"feedback": "full", "reference": [e[-1] for e in fifo.fwd_end]}
    plain = gil.replay_policy(q, policy, None, **kw)
    model = gil.BuildModel(20 * U, {}, 30)
    coupling = gil.Coupling(None, "copy", gil.release_points(q, "copy"), [], None, {}, model,
                            {(0, 0): 0, (0, 1): 30 * U})
    coupled = gil.replay_policy(q, policy, coupling, **kw)
    assert coupled.complete[2] == plain.complete[2] - 10 * U
    assert coupled.complete[:2] == plain.complete[:2]
