"""What the compiled probes' proof (``instrument/rewrite.py``) must refuse, on the REAL vLLM-Ascend recv thread.

The proof is "rewritten minus stamps == original": these tests pin down the places where that alone is not
enough. The source read back must be the code that runs (not a file edited after import, not the inner
function of someone else's wrapper); the inserted statements must sit on upstream's own lines, touch only
``__kvtrace_*`` state, never change control flow, never look up upstream's globals, and never raise into
the thread; upstream shapes the stamps would record wrong are refused.
"""

from __future__ import annotations

import ast
import dis
import functools
import logging
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

from otel_kvtrace.api import start_tracing
from otel_kvtrace.instrument import patches, rewrite

from .harness import FakeBackend, Upstream
from .test_compiled_probes import N_LAYERS, _modified_class, _raise_once, _RaisingClient, _targets_with

pytestmark = pytest.mark.upstream


def _fallback_reason(targets: Any, caplog: Any, name: str, needle: str | None = None) -> str:
    """Start a session, return the one "wrapper path" log line naming ``needle`` (default ``name``) and check
    that class ``name`` is on the wrapper path."""
    caplog.set_level(logging.INFO, logger="otel_kvtrace")
    session = start_tracing(targets, exporter=None, run_id="proof")
    try:
        lines = [r.getMessage() for r in caplog.records if "wrapper path" in r.getMessage() and (needle or name) in r.getMessage()]
        assert patches.probe_paths(targets)[name] == "wrappers"
    finally:
        session.shutdown()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_source_file_edited_after_import_falls_back(upstream: Upstream, tmp_path: Path, caplog: Any) -> None:
    """``pip install -U`` / ``git pull`` under a running server: the file on disk is not the code that runs."""
    modified = _modified_class(upstream, tmp_path, lambda s: s + "\n")
    path = tmp_path / "modified_recv.py"
    text = path.read_text()
    assert "            1,\n" in text
    path.write_text(text.replace("            1,\n", "            0,  # direction changed on disk\n", 1))
    reason = _fallback_reason(_targets_with(upstream, modified), caplog, "Modified")
    assert "installed source differs from the loaded code" in reason


def test_a_third_party_wrapper_is_not_bypassed(upstream: Upstream, caplog: Any) -> None:
    base = upstream.binding.classes["recv_gva"]
    calls: list[int] = []

    @functools.wraps(base._handle_request)
    def counting(self: Any, data: Any) -> Any:
        calls.append(1)
        return base._handle_request(self, data)

    wrapped = type("Wrapped", (base,), {"_handle_request": counting})
    targets = _targets_with(upstream, wrapped)
    assert "wrapped by" in _fallback_reason(targets, caplog, "Wrapped", needle="wrapped by")
    session = start_tracing(targets, exporter=None, run_id="wrapped")
    try:
        thread = upstream.gva_thread(N_LAYERS, FakeBackend(), start=False).thread
        thread.__class__ = wrapped
        thread.add_request(upstream.gva_task(0, [upstream.request("r1", 3)]))
        thread._handle_request(thread.request_queue.get())
    finally:
        session.shutdown()
    assert calls == [1]  # the third party's wrapper ran while traced


def _line_range(fn: Any) -> range:
    lines = [line for _, _, line in fn.__code__.co_lines() if line is not None]
    return range(fn.__code__.co_firstlineno, max(lines) + 1)


def test_the_compiled_code_has_only_upstream_lines_and_globals(upstream: Upstream) -> None:
    """Tracebacks, pdb, coverage see upstream's lines only; the stamps' builtins are closure names, so a
    global of that name in upstream's module can never change them."""
    cls = upstream.binding.classes["recv_gva"]
    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="lines")
    try:
        compiled = cls.__dict__["_handle_request"]
        assert rewrite.is_compiled(compiled)
        original = compiled.__kvtrace_wrapped__
        lines = {line for _, _, line in compiled.__code__.co_lines() if line is not None}
        assert lines <= set(_line_range(original)), sorted(lines - set(_line_range(original)))

        def globals_of(fn: Any) -> set[str]:
            return {i.argval for i in dis.get_instructions(fn) if i.opname == "LOAD_GLOBAL"}

        assert globals_of(compiled) == globals_of(original)
    finally:
        session.shutdown()


def test_a_task_queued_before_tracing_shows_upstream_lines_only(upstream: Upstream) -> None:
    """Untraced task (no record: the prelude hands it to upstream's function): one extra frame, on the
    ``def`` line, then upstream's frames unchanged."""
    plain, plain_frames = _raise_once(upstream)
    backend = FakeBackend()
    backend.store = _RaisingClient()
    env = upstream.gva_thread(N_LAYERS, backend, start=False)
    env.thread.add_request(upstream.gva_task(1, [upstream.request("r1", 3)]))  # before tracing: no record
    item = env.thread.request_queue.get()
    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="untraced")
    try:
        compiled = upstream.binding.classes["recv_gva"].__dict__["_handle_request"]
        assert rewrite.is_compiled(compiled)
        with pytest.raises(type(plain)) as info:
            env.thread._handle_request(item)
    finally:
        session.shutdown()
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(info.value.__traceback__)][1:]
    first = compiled.__kvtrace_wrapped__.__code__.co_firstlineno
    assert frames == [(plain_frames[0][0], first, "_handle_request"), *plain_frames]


def test_every_inserted_call_is_guarded(upstream: Upstream) -> None:
    """A stamp that raises turns tracing off (``rt.fail``), never the thread: every call we insert sits in a
    ``try`` whose handler calls ``__kvtrace_fail`` (the prelude's fallback to upstream's function and the
    ``fail`` calls themselves excepted)."""
    node, _, _ = rewrite.rewrite_tree(upstream.binding.classes["recv_gva"]._handle_request)
    unguarded: list[str] = []

    def visit(n: ast.AST, guarded: bool) -> None:
        if isinstance(n, ast.Call) and getattr(n, rewrite._MARK, False) and not guarded:
            name = ast.unparse(n.func)
            if name not in (rewrite.PREFIX + "original", rewrite.PREFIX + "fail"):
                unguarded.append(f"{n.lineno}: {ast.unparse(n)}")
        if isinstance(n, ast.Try) and getattr(n, rewrite._MARK, False) and any(
                rewrite.PREFIX + "fail" in ast.unparse(h) for h in n.handlers):
            for s in n.body:
                visit(s, True)
            for h in n.handlers:
                visit(h, guarded)
            for s in n.finalbody:
                visit(s, guarded)
            return
        for child in ast.iter_child_nodes(n):
            visit(child, guarded)

    visit(node, False)
    assert not unguarded, unguarded


@pytest.mark.parametrize(("template", "code", "reason"), [
    ("_BUILD_AFTER", "layer_id = 0", "upstream's name 'layer_id'"),
    ("_SAVE_RESTART", "continue", "inserted Continue"),
    ("_STAGGER_AFTER", "SELF.request_queue = None", "stores into"),
    ("_LOAD_SET_BEFORE", "return None", "inserted Return"),
    ("_BUILD_AFTER", "SELF.request_queue.task_done()", "calls 'self.request_queue.task_done' of an upstream"),
    ("_STAGGER_AFTER", "__kvtrace_q = SELF.request_queue\n__kvtrace_q.task_done()", "calls '__kvtrace_q.task_done'"),
    ("_STAGGER_AFTER", "SELF.request_queue._kvtrace = 1", "stores into 'self.request_queue._kvtrace'"),
])
def test_the_proof_refuses_a_stamp_that_touches_upstream_state_or_flow(
        upstream: Upstream, monkeypatch: Any, template: str, code: str, reason: str) -> None:
    fn = upstream.binding.classes["recv_gva"]._handle_request
    rewrite.rewrite_tree(fn)  # as it is: proved
    monkeypatch.setattr(rewrite, template, code)
    with pytest.raises(rewrite.NotRewritable, match=reason):
        rewrite.rewrite_tree(fn)


_STAGGER = "        self._stagger_h2d_submit(layer_id)\n"
SHAPES = {
    "stamp under upstream's try": (
        lambda s: s.replace(_STAGGER, "        try:\n    " + _STAGGER + "        except RuntimeError:\n            pass\n"),
        "inside upstream's try"),
    "locals()": (lambda s: s.replace(_STAGGER, _STAGGER + "        _ = locals()\n"), "calls locals()"),
    "yield": (lambda s: s.replace(_STAGGER, _STAGGER + "        (yield)\n"), "Yield in the body"),
    "continue in a stamped loop": (  # at the end of the save wait loop's body, at that line's indentation
        lambda s: re.sub(r"( *)(logger.info\(\"Layerwise %d save wait timed out.*, wait_for_save\)\n)",
                         r"\1\2\1continue\n", s, count=1),
        "Continue in a stamped loop"),
}


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_upstream_shapes_the_stamps_would_record_wrong_fall_back(
        upstream: Upstream, tmp_path: Path, caplog: Any, case: str) -> None:
    edit, reason = SHAPES[case]
    modified = _modified_class(upstream, tmp_path, edit)
    assert reason in _fallback_reason(_targets_with(upstream, modified), caplog, "Modified")


def test_doctor_reports_what_install_does(upstream: Upstream, monkeypatch: Any) -> None:
    """``check`` (doctor) runs the same steps as the install, so a module missing from ``sys.modules`` (the
    install falls back) is reported, not ``compiled``."""
    cls = upstream.binding.classes["recv_gva"]
    assert rewrite.check(cls) is None
    monkeypatch.delitem(sys.modules, cls.__module__)
    assert "not loaded" in (rewrite.check(cls) or "")


def test_future_flags_come_from_the_code_not_a_module_attribute(upstream: Upstream, monkeypatch: Any) -> None:
    """Upstream rebinding the name ``annotations`` must not make the recompile evaluate annotations."""
    cls = upstream.binding.classes["recv_gva"]
    monkeypatch.setattr(sys.modules[cls.__module__], "annotations", None, raising=False)
    rewrite._COMPILED.clear()
    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="future")
    try:
        compiled = cls.__dict__["_handle_request"]
        assert rewrite.is_compiled(compiled)
        assert compiled.__annotations__ == compiled.__kvtrace_wrapped__.__annotations__
    finally:
        session.shutdown()
        rewrite._COMPILED.clear()


# ---- the compiled add_request: the same proof -----------------------------------------------------------


def test_the_enqueue_prelude_is_proved_like_the_stamps(upstream: Upstream, monkeypatch: Any) -> None:
    """The compiled ``add_request`` goes through the same proof: as it is it is proved (upstream's body
    untouched, only ``_kvtrace*`` attributes stored on upstream's task); a prelude that writes one of
    upstream's own attributes of the task, or returns before upstream's body, is refused."""
    fn = upstream.binding.classes["recv_gva"].add_request
    fn = getattr(fn, "__kvtrace_wrapped__", fn)
    node, _, _ = rewrite.rewrite_add_request_tree(fn)
    assert ast.unparse(node.body[-1].body) == ast.unparse(rewrite._function_of(rewrite._parse_method(fn)[0]).body)
    monkeypatch.setattr(rewrite, "_ENQUEUE_PRELUDE", rewrite._ENQUEUE_PRELUDE + "DATA.layer_id = 0\n")
    with pytest.raises(rewrite.NotRewritable, match="stores into 'req_meta.layer_id'"):
        rewrite.rewrite_add_request_tree(fn)
    monkeypatch.setattr(rewrite, "_ENQUEUE_PRELUDE", "return None\n")
    with pytest.raises(rewrite.NotRewritable, match="inserted Return"):
        rewrite.rewrite_add_request_tree(fn)


# Each of these passed the proof before it checked calls and aliases (review 5, finding 7).
ENQUEUE_REFUSED = {
    "a method of upstream's task": ("DATA.transfer_tasks.clear()", "calls 'req_meta.transfer_tasks.clear'"),
    "a method of upstream's queue": ("SELF.request_queue.put(DATA)", "calls 'self.request_queue.put'"),
    "our attribute on another upstream object": ("SELF.request_queue._kvtrace = None",
                                                 "stores into 'self.request_queue._kvtrace'"),
    "setattr of upstream's attribute": ("__kvtrace_setattr(DATA, 'layer_id', 0)", "setattr only with a constant"),
    "setattr with a computed name": ("__kvtrace_setattr(DATA, '_kvtrace' + 'x', 0)", "setattr only with a constant"),
    "a store through an alias": ("__kvtrace_t = DATA.transfer_tasks\n__kvtrace_t[0] = None",
                                 "stores into '__kvtrace_t[0]'"),
    "a method through an alias": ("__kvtrace_t = DATA.transfer_tasks\n__kvtrace_u = __kvtrace_t\n__kvtrace_u.clear()",
                                  "calls '__kvtrace_u.clear'"),
    "an in-place update through an alias": ("__kvtrace_t = DATA.transfer_tasks\n__kvtrace_t += [None]",
                                            "updates '__kvtrace_t' in place"),
    "a method through our record's field": ("__kvtrace_x = __kvtrace_new_record()\n"
                                            "__kvtrace_x.tasks = DATA.transfer_tasks\n__kvtrace_x.tasks.clear()",
                                            "calls '__kvtrace_x.tasks.clear'"),
    "a method through getattr": ("__kvtrace_getattr(DATA.transfer_tasks, 'clear')()", "of an upstream object"),
    "our attribute dict of another object": ("DATA.transfer_tasks.__dict__.pop('_kvtrace', None)",
                                             "calls 'req_meta.transfer_tasks.__dict__.pop'"),
    "upstream's attribute through __dict__": ("DATA.__dict__.pop('layer_id', None)", "calls 'req_meta.__dict__.pop'"),
    "an upstream value to another function of ours": ("__kvtrace_release_recv(__kvtrace_rt, DATA)",
                                                      "hands an upstream value to '__kvtrace_release_recv'"),
}


@pytest.mark.parametrize("case", sorted(ENQUEUE_REFUSED))
def test_the_enqueue_prelude_may_not_call_or_store_into_upstream_objects(
        upstream: Upstream, monkeypatch: Any, case: str) -> None:
    """The enqueue prelude plus one statement that would change upstream's task or queue: refused."""
    code, reason = ENQUEUE_REFUSED[case]
    fn = upstream.binding.classes["recv_gva"].add_request
    fn = getattr(fn, "__kvtrace_wrapped__", fn)
    rewrite.rewrite_add_request_tree(fn)  # as it is: proved
    monkeypatch.setattr(rewrite, "_ENQUEUE_PRELUDE", rewrite._ENQUEUE_PRELUDE + code + "\n")
    with pytest.raises(rewrite.NotRewritable, match=re.escape(reason)):
        rewrite.rewrite_add_request_tree(fn)


class _Rebinding:
    def add_request(self, task):  # noqa: ANN001, ANN201 - shaped like upstream's
        task = list(task)
        self.request_queue.put(task)


class _Plain:
    def add_request(self, task):  # noqa: ANN001, ANN201
        self.request_queue.put(task)


def test_the_enqueue_undo_reads_the_parameter_only_when_upstream_never_rebinds_it(upstream: Upstream) -> None:
    """The enqueue undo works on the task the prelude saw: upstream's parameter itself when its body never
    rebinds it (0.23: no capture, 2 bytecodes less per enqueue), else a copy taken before upstream's body."""
    fn = upstream.binding.classes["recv_gva"].add_request
    fn = getattr(fn, "__kvtrace_wrapped__", fn)
    p = rewrite.PREFIX
    cases = [(fn, False), (_Plain.add_request, False), (_Rebinding.add_request, True)]
    for f, capture in cases:
        node, _, _ = rewrite.rewrite_add_request_tree(f)
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        assert (p + "item" in names) is capture, f
    tree = ast.parse("def f(self, t):\n    def g():\n        nonlocal t\n        t = 1\n    g()\n").body[0]
    assert rewrite._rebinds(tree, "t")  # a nested scope could rebind it: captured
    for src in ("del t", "t += 1", "for t in x: pass", "with a as t: pass", "(t := 1)", "global t"):
        assert rewrite._rebinds(ast.parse(f"def f(self, t):\n    {src}\n").body[0], "t"), src
    assert not rewrite._rebinds(ast.parse("def f(self, t):\n    self.q.put(t); t.x = 1\n").body[0], "t")


def test_the_compiled_cache_keys_on_the_rewrite_too(upstream: Upstream) -> None:
    """One function compiled with both rewrites (``_handle_request`` is a ``(self, data)`` body the enqueue
    rewrite accepts too) gets each its own factory, not the one cached first (review 5, finding 13)."""
    fn = upstream.binding.classes["recv_gva"]._handle_request
    fn = getattr(fn, "__kvtrace_wrapped__", fn)
    names = tuple(rewrite._closure(fn, None))
    rewrite._COMPILED.pop(fn, None)
    try:
        stamps = rewrite._factory_code(fn, names, rewrite.rewrite_tree)
        enqueue = rewrite._factory_code(fn, names, rewrite.rewrite_add_request_tree)
        assert enqueue is not stamps
        assert rewrite._factory_code(fn, names, rewrite.rewrite_tree) is stamps
        (factory,) = [c for c in enqueue.co_consts if hasattr(c, "co_consts")]
        (compiled,) = [c for c in factory.co_consts if hasattr(c, "co_varnames")]
        assert rewrite.PREFIX + "mine" in compiled.co_varnames  # the enqueue undo, not the stamps
        assert rewrite.PREFIX + "pend" not in compiled.co_varnames
    finally:
        rewrite._COMPILED.pop(fn, None)


TEMPLATES = ("_PRELUDE", "_SAVE_BEFORE", "_SAVE_TIMED_OUT", "_SAVE_RESTART", "_SAVE_AFTER", "_GATE_BEFORE",
             "_GATE_TIMED_OUT", "_GATE_RESTART", "_GATE_AFTER", "_SPAN_BEFORE", "_BUILD_AFTER", "_PENDING",
             "_STAGGER_AFTER", "_SLOT_BEFORE", "_SLOT_AFTER", "_COPY_AFTER", "_BYTES_AFTER", "_LOAD_SET_BEFORE",
             "_NPU_AFTER", "_ON_RAISE", "_ON_EXIT", "_ENQUEUE_PRELUDE", "_ENQUEUE_RAISE", "_ENQUEUE_PRELUDE_CAPTURE",
             "_ENQUEUE_RAISE_CAPTURE", "_ENQUEUE_PRELUDE_INLINE", "_ENQUEUE_RAISE_INLINE", "_GATE_AFTER_INLINE",
             "_SAVE_AFTER_INLINE")


def test_every_template_passes_the_inserted_code_checks() -> None:
    """Main's stamps too (slot release, NPU sync), which the 0.23 sources here never insert; and which names
    the checks take for holders of upstream values (only those: our records and state stay ours)."""
    fn = ast.parse("def f(self, data):\n    pass\n").body[0]
    rw = rewrite._Rewriter(fn)
    body: list[ast.stmt] = []
    for name in TEMPLATES:
        body += rw.stmts(getattr(rewrite, name), fn.body[0], guard=False, ARG=ast.Name("layer_id", ast.Load()),
                         STAGE=ast.Constant(1), RESULT=ast.Name("result", ast.Load()))
    fn.body = body
    returns = {id(n) for s in body for n in ast.walk(s) if isinstance(n, ast.Return)}
    rewrite._check_inserted(fn, returns, rw.loads)
    aliases = rewrite._Upstream([n for n in ast.walk(fn) if getattr(n, rewrite._MARK, False)]).aliases
    p = rewrite.PREFIX
    assert {p + "tasks", p + "gate", p + "layer_id", p + "item", p + "slot_arg", p + "set_ns"} <= aliases
    assert not {p + "rec", p + "st", p + "worker", p + "stages", p + "deps", p + "gstamp", p + "glog"} & aliases
