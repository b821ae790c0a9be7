"""The policy decisions, one definition for the what-if replay and the live recv scheduler.

"May task X go before the head H?" is answered here and nowhere else. The replay
(``otel_kvtrace.whatif.policies``) asks with replayed times, the live scheduler
(:mod:`otel_kvtrace.schedule.queue`) asks with non-blocking checks of the real events; both pass plain
values, so a prediction and an execution apply the same rules:

- ``dependency``: X passes only when every wait it has (save CPU+NPU event, gate, slot release) is met.
- ``buffer_chain``: X never passes a task of its own step whose layer the forward must pass before X's
  save/gate dependency can happen (same buffer-owner chain: X would write a buffer its owner still reads).
- ``same_request``: X never passes a task of an earlier step that may share a request (a later chunk of a
  request needs the earlier chunk's KV; request ids unknown = shared).
- ``final_last``: the step's final-layer task (lease release) starts only when it is the last unserved
  task of its step.
- ``barrier``: an item that is not a load task (the ``None`` sentinel) is never passed and never passes.
- ``gate_group``: a batch is the head and the contiguous tasks queued right behind it of its step and
  gate (not the final layer), up to the first whose dependency sits behind a load not done yet
  (``buffer_chain``): :func:`gate_batch`. The replay serves the batch as one call; the threaded replica
  copies it in one backend call (``otel_kvtrace.replica.kv_transfer``). Members stay in FIFO order.

Where the replay and the live queue still ask with different quantities (each stated, none silent):

- ``buffer_chain``: the replay passes ``need = max(ks, kg)`` (chain positions of the save source *and*
  of the gate's layer) and ``first_unfinished`` = the forward's replayed progress (the first chain
  position whose load has not completed). Live passes ``need = wait_for_save_layer`` (a layer id; the
  gate is left out) and ``first_unfinished`` = the layer of the step's first still-queued task. The
  second pair agrees: there is one recv thread, so at ``get()`` every handed-out task has completed and
  the first queued task of a step is its first unfinished load; layers of a step are enqueued in
  increasing order, so layer ids and chain positions order alike. The gate is not in live ``need``
  because a gate is per step (never stale): it is recorded only once the forward reached it, which
  ``dependency`` checks (``gate._event`` recorded and complete), and that already implies the loads
  before it completed.
- ``same_request``: applied live only. The replay's task columns carry no request ids, so the replay
  lets a task pass an earlier step's task that shares a request; it is the forward's per-layer waits that
  make such a cross-step bypass rare (none in the fidelity runs).
- ``dependency`` on the external slot: the replay uses the recorded release time; live, a waiter without
  ``kvtrace_release_time`` (upstream main's blocking waiter) makes the thread FIFO (see
  :func:`otel_kvtrace.schedule.queue.unreadable_waiter`), so such a run has nothing to compare.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

DEPENDENCY = "dependency"
BUFFER_CHAIN = "buffer_chain"
SAME_REQUEST = "same_request"
FINAL_LAST = "final_last"
BARRIER = "barrier"

RULES = (DEPENDENCY, BUFFER_CHAIN, SAME_REQUEST, FINAL_LAST, BARRIER)
"""Every reason a task may not go out of FIFO order, as reported by :func:`bypass_blocker`."""


def final_must_wait(is_final: bool, unserved_in_step: int) -> bool:
    """``final_last``: a final-layer task not alone among its step's unserved tasks must wait."""
    return is_final and unserved_in_step > 1


def chain_blocks(need: int, first_unfinished: int) -> bool:
    """``buffer_chain``: X's save/gate dependency sits behind the forward's pass of position ``need``
    (-1: none); the forward has not passed ``first_unfinished`` yet, so X must wait for it."""
    return need >= 0 and need >= first_unfinished


def request_blocks(cand_step: int, cand_requests: Collection[str] | None,
                   earlier_step: int, earlier_requests: Collection[str] | None) -> bool:
    """``same_request``: an earlier step's task that may share a request is never passed."""
    if earlier_step == cand_step:
        return False
    if cand_requests is None or earlier_requests is None:
        return True
    own = cand_requests if isinstance(cand_requests, (set, frozenset)) else set(cand_requests)
    return not own.isdisjoint(earlier_requests)


def bypass_blocker(*, ready: bool, is_final: bool, unserved_in_step: int, need: int, first_unfinished: int,
                   barrier: bool = False) -> str | None:
    """The rule that keeps X behind the head, or None when X may go first. ``same_request`` is asked
    per earlier task with :func:`request_blocks` (it needs the other task's step and requests)."""
    if barrier:
        return BARRIER
    if final_must_wait(is_final, unserved_in_step):
        return FINAL_LAST
    if chain_blocks(need, first_unfinished):
        return BUFFER_CHAIN
    if not ready:
        return DEPENDENCY
    return None


def ends_gate_group(head_step: int, head_gate: object, step: int, gate: object, is_final: bool) -> bool:
    """A gate batch is contiguous: the first task of another step or gate (or the final layer) ends it."""
    return step != head_step or gate != head_gate or is_final


def gate_batch(head_step: int, head_gate: object, first_unfinished: int,
               queued: Iterable[tuple[int, object, bool, int]]) -> int:
    """``gate_group``: how many of ``queued`` join the head's batch. ``queued`` = ``(step, gate, is_final,
    need)`` of the tasks right behind the head, in queue order (``need`` as in :func:`chain_blocks`,
    ``first_unfinished`` the head's position: nothing before it is unfinished). The batch is contiguous:
    it ends at the first task of another step or gate, the final layer, or a task whose save/gate
    dependency sits behind a load of the batch (it would wait for the batch it is in)."""
    n = 0
    for step, gate, is_final, need in queued:
        if ends_gate_group(head_step, head_gate, step, gate, is_final) or chain_blocks(need, first_unfinished):
            break
        n += 1
    return n
