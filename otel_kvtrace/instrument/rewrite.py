"""Compiled probes: upstream's recv ``_handle_request`` recompiled with its stamps inline.

Every recv stage of vLLM-Ascend's GVA ``KVCacheStoreLayerRecvingThread._handle_request`` (0.23 and main)
is a statement of that one function: the save wait loop (main: plus the NPU ``synchronize``), the address
build, the attention-gate wait loop, the H2D stagger, the slot-release wait (main), the batch copy and the
load event ``set()``. At install the installed method's own source (``inspect.getsourcelines``: never a
copy in this repository) is parsed, stamp statements are inserted at those statements, and the result is
compiled under upstream's file name and line numbers (each inserted node on the line of the statement it
stamps), in upstream's module globals (the names we add, builtins included, are closure variables called
``__kvtrace_*``). The stamps write straight into the task's ``TaskRecord``,
exactly what ``wrappers.py`` + ``proxies.py`` write: no wrapper frame, no proxy, no thread lookup per
stage.

Semantics are proved at install, not trusted: the source must compile to the running ``fn.__code__`` (not
a file edited after import, not the inner function of a wrapper); the inserted statements (all marked)
are stripped from the rewritten tree, which must then dump equal to the original
(``ast.dump(include_attributes=False)``); the inserted nodes may only store ``__kvtrace_*`` state (and our
``_kvtrace*`` attributes on upstream's ``self``/task), call no method of an upstream object (but reading our
own ``_kvtrace*`` attribute through ``__dict__``), hand upstream values only to a listed few functions of
ours, and never return, raise, break, continue or yield (but the prelude's fallback and the handler's
re-raise; :func:`_check_inserted` says exactly what is checked); and every
call of a stamped method must sit in a recognised statement. Otherwise (another upstream version, a
patched method) :func:`compile_handle_request` logs ONE line with the reason and returns the
wrapper of ``wrappers.wrap_handle_request`` (the other wrappers then stay on, see ``patches.install``).

The body runs in ``try: ... except BaseException: <mark>; raise`` (bare ``raise``: the same exception
object and traceback lines) ``finally: <release>``; ``task_done()``, ``_fatal_error`` and shutdown are
upstream's statements, untouched. Every call in a stamp is inside a ``try`` whose handler turns tracing off
(``rt.fail``), never the thread; outside are only local assignments and attribute reads on the record.
"""

from __future__ import annotations

import __future__
import ast
import copy
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

from otel_kvtrace import config
from otel_kvtrace.instrument import attach, wrappers
from otel_kvtrace.instrument.proxies import total_bytes
from otel_kvtrace.instrument.runtime import Runtime
from otel_kvtrace.record.model import NO_TIME, BackendResultError, Dep, Outcome, Stage, TaskRecord

logger = logging.getLogger("otel_kvtrace")

PREFIX = "__kvtrace_"
_MARK = "_kvtrace_inserted"  # on every AST node we insert (stripped by the proof)
OWN_ATTR = "_kvtrace"  # attributes of this prefix on upstream objects are ours (task record, gate id)

_S = {s.name: int(s) for s in Stage}
_D = {d.name: int(d) for d in Dep}
_ERROR = int(Outcome.ERROR)
_EMPTY = int(Outcome.EMPTY)


class NotRewritable(Exception):
    """The source is not the shape the probes know; the message says what differs."""


# ---- stamp templates (``ARG``: the statement's own index / argument expression, re-read) -------------------

_T = PREFIX
# Outside its ``try``: local stores and attribute reads of our own objects (``recorder.enabled``,
# ``rec.stages``), which cannot raise; the fallback ``return original(...)`` is upstream's own function.
_PRELUDE = f"""
{_T}rec = None
if {_T}recorder.enabled and DATA is not None:
    try:
        {_T}t = {_T}clock()
        {_T}st = SELF.__dict__.get({attach.STATE_ATTR!r}) or {_T}queue_state(SELF, {_T}rt)
        try:
            {_T}rec = DATA.__dict__.pop("_kvtrace", None)
        except {_T}AttributeError:
            {_T}rec = None
        if {_T}rec is not None and {_T}rec.queue is not {_T}st.info and \\
                {_T}getattr({_T}rec.queue, "run_id", None) != {_T}st.info.run_id:
            {_T}rec = None
        if {_T}rec is None:
            {_T}st.untraced += 1
        else:
            {_T}rec.t_dequeue = {_T}t
            {_T}st.dequeued += 1
    except {_T}Exception as {_T}e:
        {_T}fail({_T}e)
        {_T}rec = None
if {_T}rec is None:
    return {_T}original(SELF, DATA)
{_T}stages = {_T}rec.stages
{_T}pend = -1
{_T}slot_arg = None
"""

_ON_RAISE = f"""
try:
    if {_T}pend >= 0:
        {_T}stages += ({_T}pend, {_T}p0, {_T}clock())
        if {_T}pend == {_S['BACKEND_SUBMIT']}:
            {_T}rec.backend_result = -1
        elif {_T}pend == {_S['SLOT_RELEASE_WAIT']}:
            {_T}slot_done({_T}rec, SELF, {_T}slot_arg, {_T}stages[-1])
    {_T}rec.outcome = {_ERROR}
    {_T}rec.error = {_T}exc
    if {_T}rec.t_complete == {NO_TIME}:
        {_T}rec.t_complete = {_T}clock()
except {_T}Exception as {_T}e:
    {_T}fail({_T}e)
"""

_ON_EXIT = f"""
try:
    {_T}st.completed += 1
    if {_T}rec.outcome != {_ERROR}:
        if {_T}rec.t_backend_return == {NO_TIME}:
            {_T}rec.outcome = {_EMPTY}
        elif {_T}rec.backend_result:
            {_T}rec.outcome = {_ERROR}
            {_T}rec.error = {_T}BackendResultError({_T}rec.backend_result)
    if {_T}rec.t_complete == {NO_TIME}:
        {_T}rec.t_complete = {_T}clock()
    {_T}holds = {_T}rec.holds
    if {_T}len({_T}holds) < 2:
        if {_T}holds and {_T}holds.pop() == 0:
            {_T}recorder.submit({_T}rec)
    else:
        {_T}release_recv({_T}rt, {_T}rec)
except {_T}Exception as {_T}e:
    {_T}fail({_T}e)
"""



def _wait_loop(start: str, stage: str) -> tuple[str, str, str]:
    """Stamps of a ``while not <wait>(timeout=10): ...`` loop: before it, at the top of its body (the wait
    timed out: one stage per call, as the wrappers record it) and at the end of its body (the next call)."""
    return (f"{_T}{start} = {_T}clock()", f"{_T}stages += ({_S[stage]}, {_T}{start}, {_T}clock())",
            f"{_T}{start} = {_T}clock()")


_SAVE_BEFORE, _SAVE_TIMED_OUT, _SAVE_RESTART = _wait_loop("w0", "SAVE_CPU_WAIT")
_SAVE_EVENTS, _SET_NS = "layer_save_finished_events", "set_ns"


def save_rule(p: str, thread: str, index: str) -> str:
    """THE save wait's after-stamp, as statements over names prefixed ``p``: after the last (successful) ``wait()``
    of ``<thread>.layer_save_finished_events[<index>]`` that ran from ``w0`` to ``w1``, its stage and the save's CPU
    dependency, exact when the event is our proxy (its ``set_ns``, the producer's ``set()`` time), else bounded by
    the task's enqueue and ``w1``. ``_probes.SaveAfter`` (``NATIVE_SAVE``) is this rule in C, statement by
    statement, called once in its place (``save_after(rec, thread, index, w0, w1, stages)``); without the
    extension the text is inlined (``tests/instrument/test_save_after.py`` holds the two equal;
    :func:`save_after_rule` is the text as a function, the tests' reference)."""
    lo = 2 * _D["SAVE_CPU"]
    return f"""
{p}stages += ({_S['SAVE_CPU_WAIT']}, {p}w0, {p}w1)
{p}set_ns = {p}getattr({thread}.{_SAVE_EVENTS}[{index}], {_SET_NS!r}, -1)
{p}deps = {p}rec.deps
{p}rec.has_dep |= {1 << _D['SAVE_CPU']}
if {p}set_ns >= 0:
    {p}deps[{lo}] = {p}deps[{lo + 1}] = {p}set_ns
else:
    {p}deps[{lo}] = {p}rec.t_enqueue
    {p}deps[{lo + 1}] = {p}w1
"""


def save_after_rule() -> Callable:
    """:func:`save_rule`'s text as the function ``save_after(rec, thread, index, w0, w1, stages)``: the reference
    ``tests/instrument/test_save_after.py`` compares ``_probes.SaveAfter`` with."""
    source = ("def make():\n    def save_after(rec, thread, index, w0, w1, stages):\n" +
              wrappers.indent_rule(save_rule("", "thread", "index"), 8) + "\n    return save_after\n")
    return wrappers.compile_generated("save_after", False, source, __file__)()


NATIVE_SAVE: Any = wrappers.native_probe("SaveAfter")
"""The native save after-stamp (``None``: :func:`save_rule` is inlined). Read when ``_SAVE_AFTER`` is generated
(at import) and when the callable is made (:func:`make_save_after`); a test that sets it to None swaps
``_SAVE_AFTER`` too."""


def make_save_after() -> Any:
    """``NATIVE_SAVE`` over the rule's own names and constants, or None without the extension."""
    if NATIVE_SAVE is None:
        return None
    return NATIVE_SAVE(TaskRecord, _SAVE_EVENTS, _SET_NS, _S["SAVE_CPU_WAIT"], 1 << _D["SAVE_CPU"],
                       2 * _D["SAVE_CPU"])


def _save_after(native: bool) -> str:
    """After the last (successful) save ``wait()``: :func:`save_rule`, or (``native``) its one native call."""
    rule = (f"{_T}save_after({_T}rec, SELF, ARG, {_T}w0, {_T}w1, {_T}stages)\n" if native
            else save_rule(_T, "SELF", "ARG"))
    return f"""
{_T}w1 = {_T}clock()
try:
""" + wrappers.indent_rule(rule, 4) + f"""
except {_T}Exception as {_T}e:
    {_T}fail({_T}e)
"""


_SAVE_AFTER = _save_after(NATIVE_SAVE is not None)
_SAVE_AFTER_INLINE = _save_after(False)  # the rule's text: what a process without the extension compiles

_GATE_BEFORE, _GATE_TIMED_OUT, _GATE_RESTART = _wait_loop("g0", "GATE_COND_WAIT")


def _gate_after(native: bool) -> str:
    """After the last (successful) gate ``wait()``: ``wrappers.gate_rule``, the one definition the wrapper path
    is generated from too; ``native``: that rule as one call of ``_probes.GateAfter`` (``__kvtrace_gate_after``)."""
    rule = (f"{_T}gate_after({_T}rec, ARG, {_T}g0, {_T}g1, {_T}stages)\n" if native
            else wrappers.gate_rule(_T, "ARG"))
    return f"""
{_T}g1 = {_T}clock()
try:
""" + wrappers.indent_rule(rule, 4) + f"""
except {_T}Exception as {_T}e:
    {_T}fail({_T}e)
"""


_GATE_AFTER = _gate_after(wrappers.NATIVE_GATE is not None)
_GATE_AFTER_INLINE = _gate_after(False)  # the rule's text: what a process without the extension compiles

_SPAN_BEFORE = f"{_T}k0 = {_T}clock()"
_BUILD_AFTER = f"{_T}stages += ({_S['META_BUILD']}, {_T}k0, {_T}clock())"

_PENDING = f"""
{_T}pend = STAGE
{_T}p0 = {_T}clock()
"""
_STAGGER_AFTER = f"""
{_T}stages += ({_S['H2D_STAGGER']}, {_T}p0, {_T}clock())
{_T}pend = -1
"""
_SLOT_BEFORE = f"""
{_T}pend = {_S['SLOT_RELEASE_WAIT']}
{_T}slot_arg = ARG
{_T}p0 = {_T}clock()
"""
_SLOT_AFTER = f"""
{_T}pend = -1
{_T}stages += ({_S['SLOT_RELEASE_WAIT']}, {_T}p0, {_T}clock())
try:
    {_T}slot_done({_T}rec, SELF, {_T}slot_arg, {_T}stages[-1])
except {_T}Exception as {_T}e:
    {_T}fail({_T}e)
"""
_COPY_AFTER = f"""
{_T}b1 = {_T}clock()
{_T}pend = -1
{_T}stages += ({_S['BACKEND_SUBMIT']}, {_T}p0, {_T}b1)
{_T}rec.t_backend_return = {_T}b1
if {_T}type(RESULT) is {_T}int:
    {_T}rec.backend_result = RESULT
"""
_BYTES_AFTER = f"""
try:
    {_T}rec.nbytes += {_T}total_bytes(ARG)
except {_T}Exception as {_T}e:
    {_T}fail({_T}e)
"""
_LOAD_SET_BEFORE = f"{_T}rec.t_complete = {_T}clock()"
_GUARD = f"""
try:
    pass
except {_T}Exception as {_T}e:
    {_T}fail({_T}e)
"""
_NPU_AFTER = f"""
{_T}n1 = {_T}clock()
try:
    {_T}npu_done({_T}rec, SELF.sync_save_events[ARG], {_T}k0, {_T}n1)
except {_T}Exception as {_T}e:
    {_T}fail({_T}e)
"""


# ---- stamps too long to inline (run once per task, only on their own path) ---------------------------------

_SN = 2 * _D["SAVE_NPU"]


def _npu_done(rec: Any, event: Any, t0: int, t1: int) -> None:
    """After ``sync_save_events[w].synchronize()`` (main): ``proxies.TracedNpuEvent.synchronize``'s record
    stamps; the proxy itself (still there for the send threads) has updated its bound and the stream log."""
    rec.stages.extend((_S["SAVE_NPU_SYNC"], t0, t1))
    record_ns = getattr(event, "record_ns", None)
    if record_ns is None:  # not our proxy: no dependency known
        return
    rec.has_dep |= 1 << _D["SAVE_NPU"]
    rec.deps[_SN] = record_ns if record_ns >= 0 else rec.t_enqueue
    rec.deps[_SN + 1] = event.sync_hi
    if event.position is not None:
        rec.npu_marks.append((_D["SAVE_NPU"], event.position))
    if event.mark is not None:
        rec.npu_marks.append((_D["SAVE_NPU"], event.mark))


_SR = 2 * _D["SLOT_RELEASE"]


def _slot_done(rec: Any, thread: Any, layer_id: Any, t1: int) -> None:
    """After the slot-release waiter (main): ``proxies.traced_slot_waiter``'s dependency, exact when the
    waiter tells its release time without blocking (``kvtrace_release_time``)."""
    release_time = getattr(thread.external_slot_release_waiter, "kvtrace_release_time", None)
    exact = release_time(layer_id) if release_time is not None else None
    deps = rec.deps
    rec.has_dep |= 1 << _D["SLOT_RELEASE"]
    if exact is not None and exact >= 0:
        deps[_SR] = deps[_SR + 1] = exact
    else:
        deps[_SR] = rec.t_enqueue
        deps[_SR + 1] = t1


# ---- recognising upstream's statements ---------------------------------------------------------------------


def _is_self_attr(node: ast.AST, self_name: str, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
            and node.value.id == self_name)


def _method_call(node: ast.AST) -> tuple[ast.AST, str] | None:
    """``<obj>.<name>(...)`` -> (obj, name)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.value, node.func.attr
    return None


def _event_call(node: ast.AST, self_name: str, lst: str, method: str) -> ast.AST | None:
    """``self.<lst>[ARG].<method>(...)`` -> ARG (a plain name or constant), else None."""
    call = _method_call(node)
    if call is None or call[1] != method:
        return None
    obj = call[0]
    if isinstance(obj, ast.Subscript) and _is_self_attr(obj.value, self_name, lst) and \
            isinstance(obj.slice, (ast.Name, ast.Constant)):
        return obj.slice
    return None


_TRACED_METHODS = {"build_addrs", "build", "_stagger_h2d_submit", "_batch_copy_with_limits", "synchronize",
                   "external_slot_release_waiter"}


class _Rewriter:
    """Inserts the stamps into one function's statement lists; counts what it matched."""

    def __init__(self, fn: ast.FunctionDef) -> None:
        self.self_name = fn.args.args[0].arg
        self.data_name = fn.args.args[1].arg
        self.found: dict[str, int] = {}
        self.claimed: set[int] = set()  # id() of the Call nodes a stamp covers
        self.loads = {self.self_name, self.data_name}  # upstream names the stamps may read (substituted)

    def stmts(self, source: str, anchor: ast.AST, guard: bool = True, **subst: ast.AST) -> list[ast.stmt]:
        """The template's statements, ``SELF``/``DATA``/``subst`` filled in, every node on ``anchor``'s line
        (the upstream statement it stamps: tracebacks, debuggers and coverage see only upstream's lines),
        and, with ``guard``, the whole in ``try: ... except Exception as e: fail(e)``."""
        tree = ast.parse(source.strip("\n"))
        names = {"SELF": ast.Name(self.self_name, ast.Load()), "DATA": ast.Name(self.data_name, ast.Load()), **subst}
        self.loads.update(n.id for v in subst.values() for n in ast.walk(v) if isinstance(n, ast.Name))

        class Sub(ast.NodeTransformer):
            def visit_Name(self, node: ast.Name) -> ast.AST:
                if node.id in names:
                    return ast.parse(ast.unparse(names[node.id]), mode="eval").body
                return node

        body = [Sub().visit(s) for s in tree.body]
        if guard:
            wrapped = ast.parse(_GUARD).body
            wrapped[0].body = body
            body = wrapped
        for s in body:
            for n in ast.walk(s):
                if "lineno" in n._attributes:
                    ast.copy_location(n, anchor)
            _mark_all(s)
        return body

    def _hit(self, what: str, call: ast.AST) -> None:
        self.found[what] = self.found.get(what, 0) + 1
        self.claimed.add(id(call))

    def block(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for s in stmts:
            before, after = self.stamp(s)
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(s, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    setattr(s, field, self.block(inner))
            for handler in getattr(s, "handlers", ()):
                handler.body = self.block(handler.body)
            out.extend(before)
            out.append(s)
            out.extend(after)
        return out

    def stamp(self, s: ast.stmt) -> tuple[list[ast.stmt], list[ast.stmt]]:
        sn = self.self_name
        if isinstance(s, ast.While) and isinstance(s.test, ast.UnaryOp) and isinstance(s.test.op, ast.Not):
            call = s.test.operand
            arg = _event_call(call, sn, "layer_save_finished_events", "wait")
            if arg is not None:
                self._hit("save wait", call)
                s.body = self.stmts(_SAVE_TIMED_OUT, s) + s.body + self.stmts(_SAVE_RESTART, s)
                return self.stmts(_SAVE_BEFORE, s), self.stmts(_SAVE_AFTER, s, ARG=arg)
            m = _method_call(call)
            if m is not None and m[1] == "wait" and isinstance(m[0], ast.Name):
                self._hit("gate wait", call)
                s.body = self.stmts(_GATE_TIMED_OUT, s) + s.body + self.stmts(_GATE_RESTART, s)
                return self.stmts(_GATE_BEFORE, s), self.stmts(_GATE_AFTER, s, ARG=m[0])
        value = s.value if isinstance(s, (ast.Expr, ast.Assign, ast.AnnAssign)) else None
        if value is None:
            return [], []
        m = _method_call(value)
        if isinstance(s, (ast.Assign, ast.AnnAssign)) and m is not None and m[1] in ("build_addrs", "build") \
                and isinstance(m[0], ast.Name):
            self._hit("build", value)
            return self.stmts(_SPAN_BEFORE, s), self.stmts(_BUILD_AFTER, s)
        if isinstance(s, ast.Expr) and m is not None and m[1] == "_stagger_h2d_submit" and \
                isinstance(m[0], ast.Name) and m[0].id == sn:
            self._hit("stagger", value)
            return (self.stmts(_PENDING, s, STAGE=ast.Constant(_S["H2D_STAGGER"])), self.stmts(_STAGGER_AFTER, s))
        if isinstance(s, ast.Assign) and m is not None and m[1] == "_batch_copy_with_limits" and \
                isinstance(m[0], ast.Name) and m[0].id == sn and len(s.targets) == 1 and \
                isinstance(s.targets[0], ast.Name) and len(value.args) >= 3 and isinstance(value.args[2], ast.Name):
            self._hit("batch copy", value)
            result = ast.Name(s.targets[0].id, ast.Load())
            return (self.stmts(_PENDING, s, STAGE=ast.Constant(_S["BACKEND_SUBMIT"])),
                    self.stmts(_COPY_AFTER, s, RESULT=result) +
                    self.stmts(_BYTES_AFTER, s, guard=False, ARG=value.args[2]))  # has its own try
        if isinstance(s, ast.Expr):
            arg = _event_call(value, sn, "layer_load_finished_events", "set")
            if arg is not None:
                self._hit("load set", value)
                return self.stmts(_LOAD_SET_BEFORE, s), []
            arg = _event_call(value, sn, "sync_save_events", "synchronize")
            if arg is not None:
                self._hit("npu sync", value)
                return self.stmts(_SPAN_BEFORE, s), self.stmts(_NPU_AFTER, s, ARG=arg)
            if isinstance(value, ast.Call) and _is_self_attr(value.func, sn, "external_slot_release_waiter") and \
                    len(value.args) == 1 and not value.keywords and isinstance(value.args[0], (ast.Name, ast.Constant)):
                self._hit("slot release", value)
                return self.stmts(_SLOT_BEFORE, s, ARG=value.args[0]), self.stmts(_SLOT_AFTER, s)
        return [], []


_SINGLETONS = (ast.expr_context, ast.boolop, ast.operator, ast.unaryop, ast.cmpop)


def _mark_all(node: ast.AST) -> None:
    """Mark ``node`` and its children as ours (not the parser's shared operator singletons)."""
    for n in ast.walk(node):
        if not isinstance(n, _SINGLETONS):
            setattr(n, _MARK, True)


_REQUIRED = ("save wait", "build", "gate wait", "stagger", "batch copy", "load set")


def _check_names(fn: ast.FunctionDef) -> None:
    """No name the recompile (outside the class body, with our closure) would change."""
    for node in ast.walk(fn):
        if getattr(node, _MARK, False):
            continue
        if isinstance(node, ast.Name) and (node.id.startswith(PREFIX) or node.id in ("super", "__class__")):
            raise NotRewritable(f"line {node.lineno}: uses {node.id!r}")
        if isinstance(node, (ast.Attribute, ast.Name)):
            ident = node.attr if isinstance(node, ast.Attribute) else node.id
            if ident.startswith("__") and not ident.endswith("__"):
                raise NotRewritable(f"line {node.lineno}: private name {ident!r} (would not be mangled)")


def _check_uncovered(fn: ast.FunctionDef, rw: _Rewriter) -> None:
    """Every call of a stamped method must be one the stamps cover; no name the recompile would change."""
    _check_names(fn)
    for node in ast.walk(fn):
        if getattr(node, _MARK, False):
            continue
        if isinstance(node, ast.Call) and id(node) not in rw.claimed:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            waits = name == "wait" and isinstance(func, ast.Attribute) and (
                isinstance(func.value, ast.Name) or _event_call(node, rw.self_name, "layer_save_finished_events", "wait"))
            loads = _event_call(node, rw.self_name, "layer_load_finished_events", "set") is not None
            if name in _TRACED_METHODS or waits or loads:
                raise NotRewritable(f"line {node.lineno}: {ast.unparse(node)[:60]} is not in a statement the probes know")


# ---- proof ---------------------------------------------------------------------------------------------------


def _strip(node: ast.AST) -> ast.AST:
    """The rewritten tree minus every inserted statement; an inserted ``try`` is replaced by its body."""
    for field, value in ast.iter_fields(node):
        if isinstance(value, list):
            kept: list[Any] = []
            for item in value:
                if not isinstance(item, ast.AST):
                    kept.append(item)
                elif isinstance(item, (ast.stmt, ast.excepthandler)) and getattr(item, _MARK, False):
                    if isinstance(item, ast.Try) and getattr(item, "_kvtrace_wrap", False):
                        kept.extend(_strip(ast.Module(item.body, [])).body)
                    continue
                else:
                    kept.append(_strip(item))
            setattr(node, field, kept)
        elif isinstance(value, ast.AST):
            _strip(value)
    return node


def _parse_method(fn: Callable) -> tuple[ast.Module, str]:
    """(module with one class holding the method, file name); line numbers and columns are upstream's."""
    lines, first = inspect.getsourcelines(fn)
    filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
    indent = len(lines[0]) - len(lines[0].lstrip())
    header = "class _:\n" if indent else ""
    tree = ast.parse(header + "".join(lines), filename=filename)
    ast.increment_lineno(tree, first - (2 if indent else 1))
    return tree, filename


def _function_of(tree: ast.Module) -> ast.FunctionDef:
    node = tree.body[0]
    if isinstance(node, ast.ClassDef):
        node = node.body[0]
    if not isinstance(node, ast.FunctionDef):
        raise NotRewritable("not a plain function definition")
    return node


def _future_flags(fn: Callable) -> int:
    """Upstream's own ``from __future__`` flags, read from its code (``annotations`` keeps them strings)."""
    mask = 0
    for name in __future__.all_feature_names:
        mask |= getattr(__future__, name).compiler_flag
    return fn.__code__.co_flags & mask


def _same_code(a: Any, b: Any) -> bool:
    """Equal bytecode, names and constants (code constants recursively); lines and positions ignored."""
    fields = ("co_code", "co_names", "co_varnames", "co_freevars", "co_cellvars", "co_argcount",
              "co_posonlyargcount", "co_kwonlyargcount", "co_flags", "co_name")
    if any(getattr(a, f) != getattr(b, f) for f in fields) or len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if inspect.iscode(x) or inspect.iscode(y):
            if not (inspect.iscode(x) and inspect.iscode(y) and _same_code(x, y)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _check_loaded(fn: Callable, filename: str) -> None:
    """The source read back must be the code that runs: not a wrapper (``inspect`` unwraps), not a file
    changed on disk after import. The whole file is compiled (the bytecode of ``x.m()`` depends on whether
    ``x`` is imported at module level) and the function found by qualified name and first line."""
    if inspect.unwrap(fn) is not fn:
        raise NotRewritable(f"wrapped by {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)!s}")
    lines, _ = inspect.findsource(fn)
    want = fn.__code__
    todo = [compile("".join(lines), filename, "exec", flags=_future_flags(fn), dont_inherit=True)]
    while todo:
        code = todo.pop()
        if code.co_qualname == want.co_qualname and code.co_firstlineno == want.co_firstlineno:
            if _same_code(code, want):
                return
            break
        todo.extend(c for c in code.co_consts if inspect.iscode(c))
    raise NotRewritable("installed source differs from the loaded code")


_ALLOWED_STMTS = (ast.Assign, ast.AugAssign, ast.Expr, ast.If, ast.Try, ast.Pass)
_FORBIDDEN_EXPRS = (ast.Yield, ast.YieldFrom, ast.Await, ast.Lambda, ast.NamedExpr, ast.ListComp, ast.SetComp,
                    ast.DictComp, ast.GeneratorExp)
_OWN_RESULT = frozenset({"clock", "queue_state", "new_record", "take", "id", "len", "type"})
"""Our closure functions whose result is ours (never an upstream object), whatever their arguments."""
TAKE_UPSTREAM_FIELDS = frozenset({"layer_id", "final_layer", "wait_for_save_layer", "transfer_tasks"})
"""The record fields the enqueue's native ``take`` fills with upstream values (``wrappers.take_rule``: its task's
layer id, the comparison with it, save layer and transfer tasks): where ``take`` is called, :class:`_Upstream`
treats them as it treats the fields the rule's text assigns such values to."""
UPSTREAM_ARG_CALLS = frozenset({"getattr", "setattr", "len", "id", "type", "list", "queue_state", "slot_done",
                                "npu_done", "total_bytes", "take", "gate_after", "save_after", "fail", "original",
                                "BackendResultError"})
"""The only functions of ours (``__kvtrace_<name>``) the inserted code may hand an upstream object (or a value
read from one); they read it (``setattr``: only with a constant ``_kvtrace*`` name, ``original``: upstream's
own function)."""


def _own_attr_dict_call(node: ast.AST) -> bool:
    """``<name>.__dict__.get("_kvtrace…"[, None])`` or ``.pop(...)``: our own attribute of an upstream object."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop")):
        return False
    d = node.func.value
    args = node.args
    return (isinstance(d, ast.Attribute) and d.attr == "__dict__" and isinstance(d.value, ast.Name)
            and not node.keywords and 1 <= len(args) <= 2 and all(isinstance(a, ast.Constant) for a in args)
            and isinstance(args[0].value, str) and args[0].value.startswith(OWN_ATTR))


def _bound_names(targets: list[ast.expr]) -> list[str]:
    """The names an assignment binds (``a = ...``, ``a, b = ...``; not the ``a`` of ``a.x = ...``)."""
    out: list[str] = []
    for t in targets:
        if isinstance(t, ast.Name):
            out.append(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            out.extend(_bound_names(t.elts))
        elif isinstance(t, ast.Starred):
            out.extend(_bound_names([t.value]))
    return out


class _Upstream:
    """Which inserted expressions may be an upstream object (or a value read from one): upstream's names, the
    ``__kvtrace_*`` names ever bound to such a value (``aliases``, flow-insensitive, to a fixpoint; every
    handler's exception name), and attributes, items and (most) call results of those. Ours: constants, our
    own attributes read through ``__dict__`` (``_own_attr_dict_call``) and the results of ``_OWN_RESULT``."""

    def __init__(self, nodes: list[ast.AST]) -> None:
        self.aliases: set[str] = {n.name for n in nodes if isinstance(n, ast.ExceptHandler) and n.name}
        self.fields: set[str] = set()  # attributes of our objects that get an upstream value (``rec.error``)
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == PREFIX + "take"
               for n in nodes):  # the native take's assignments, as its rule's text makes them
            self.fields.update(TAKE_UPSTREAM_FIELDS)
        assigns = [(n.targets if isinstance(n, ast.Assign) else [n.target], n.value)
                   for n in nodes if isinstance(n, (ast.Assign, ast.AugAssign))]
        while True:
            before = len(self.aliases) + len(self.fields)
            for targets, value in assigns:
                if self(value):
                    self.aliases.update(_bound_names(targets))
                    self.fields.update(t.attr for t in targets if isinstance(t, ast.Attribute))
            if len(self.aliases) + len(self.fields) == before:
                return

    def __call__(self, e: ast.AST) -> bool:
        if isinstance(e, ast.Name):
            return not e.id.startswith(PREFIX) or e.id in self.aliases
        if isinstance(e, ast.Constant):
            return False
        if isinstance(e, ast.Attribute):
            return e.attr in self.fields or self(e.value)
        if isinstance(e, ast.Subscript):  # an item of our container is ours
            return self(e.value)
        if isinstance(e, ast.Call):
            if _own_attr_dict_call(e):
                return False
            if isinstance(e.func, ast.Name) and e.func.id.startswith(PREFIX) and \
                    e.func.id[len(PREFIX):] in _OWN_RESULT:
                return False
            return any(self(c) for c in [e.func, *e.args, *(k.value for k in e.keywords)])
        return any(self(c) for c in ast.iter_child_nodes(e) if isinstance(c, ast.expr))


def _check_inserted(fn: ast.FunctionDef, own: set[int], allowed_loads: set[str]) -> None:
    """The inserted nodes touch only our own state and never change upstream's control flow:
    - they store only ``__kvtrace_*`` names and attributes/items of our own objects (an object reached from a
      ``__kvtrace_*`` name that never holds an upstream value, see :class:`_Upstream`), plus ``_kvtrace*``
      attributes on upstream's own ``self``/task parameter (``task._kvtrace = rec``);
    - they read only ``__kvtrace_*`` names and the upstream names substituted into the templates;
    - they call no method of an upstream object but ``<name>.__dict__.get/pop("_kvtrace…")`` (our own
      attribute), call no upstream callable, hand upstream values only to ``UPSTREAM_ARG_CALLS``, and
      ``setattr`` only with a constant ``_kvtrace*`` name;
    - they return/raise only where we put it (``own``: the prelude's fallback return, the handler's bare
      ``raise``): no other return, raise, break, continue, yield, await, lambda, walrus or comprehension."""
    mine = [n for n in ast.walk(fn) if getattr(n, _MARK, False)]
    up = _Upstream(mine)
    self_data = {fn.args.args[0].arg, fn.args.args[1].arg}
    for node in mine:
        if id(node) in own:
            continue
        if isinstance(node, ast.stmt) and not isinstance(node, _ALLOWED_STMTS):
            raise NotRewritable(f"inserted {type(node).__name__} at line {node.lineno}")
        if isinstance(node, _FORBIDDEN_EXPRS):
            raise NotRewritable(f"inserted {type(node).__name__} at line {node.lineno}")
        if isinstance(node, ast.Name) and not node.id.startswith(PREFIX) and \
                (not isinstance(node.ctx, ast.Load) or node.id not in allowed_loads):
            raise NotRewritable(f"inserted code uses upstream's name {node.id!r}")
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and up(node.target):
            raise NotRewritable(f"inserted code updates {node.target.id!r} in place, an upstream value")
        if isinstance(node, (ast.Attribute, ast.Subscript)) and not isinstance(node.ctx, ast.Load):
            if isinstance(node, ast.Attribute) and node.attr.startswith(OWN_ATTR) and \
                    isinstance(node.value, ast.Name) and node.value.id in self_data:
                continue  # our own attribute on upstream's task (the enqueue's ``task._kvtrace``)
            root = node
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if not (isinstance(root, ast.Name) and root.id.startswith(PREFIX)) or up(node.value):
                raise NotRewritable(f"inserted code stores into {ast.unparse(node)!r}")
        if isinstance(node, ast.Call):
            _check_call(node, up)


def _check_call(node: ast.Call, up: _Upstream) -> None:
    func = node.func
    if _own_attr_dict_call(node):
        return
    if up(func.value if isinstance(func, ast.Attribute) else func):
        raise NotRewritable(f"inserted code calls {ast.unparse(func)!r} of an upstream object")
    if not isinstance(func, ast.Name):
        return  # a method of our own object (``__kvtrace_st.send_fifo.append``)
    name = func.id[len(PREFIX):]
    if name == "setattr" and not (len(node.args) == 3 and isinstance(node.args[1], ast.Constant) and
                                  str(node.args[1].value).startswith(OWN_ATTR)):
        raise NotRewritable(f"inserted {ast.unparse(node)!r}: setattr only with a constant {OWN_ATTR}* name")
    if name not in UPSTREAM_ARG_CALLS and any(up(a) for a in [*node.args, *(k.value for k in node.keywords)]):
        raise NotRewritable(f"inserted code hands an upstream value to {func.id!r}")


def _check_upstream_shape(fn: ast.FunctionDef) -> None:
    """Upstream shapes whose stamps would record wrong: a stamp under upstream's own ``try`` (the pending
    stage would stay open), ``continue``/``break`` in a stamped loop (skips the restart stamp), a generator
    or coroutine (the prelude's return), ``locals()``/``vars()`` (they would see the stamps' names)."""
    def walk(node: ast.AST, in_try: bool, in_stamped_loop: bool) -> None:
        for child in ast.iter_child_nodes(node):
            marked = getattr(child, _MARK, False)
            if marked and in_try and isinstance(child, ast.stmt):
                raise NotRewritable(f"line {child.lineno}: a stamped statement inside upstream's try")
            if not marked:
                if isinstance(child, (ast.Yield, ast.YieldFrom, ast.Await)):
                    raise NotRewritable(f"line {child.lineno}: {type(child).__name__} in the body")
                if isinstance(child, (ast.Continue, ast.Break)) and in_stamped_loop:
                    raise NotRewritable(f"line {child.lineno}: {type(child).__name__} in a stamped loop")
                if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and \
                        child.func.id in ("locals", "vars"):
                    raise NotRewritable(f"line {child.lineno}: calls {child.func.id}()")
            stamped = isinstance(child, (ast.While, ast.For)) and any(getattr(b, _MARK, False) for b in child.body)
            walk(child, in_try or (isinstance(child, ast.Try) and not marked),
                 stamped or (in_stamped_loop and not isinstance(child, (ast.While, ast.For))))
    walk(fn, False, False)


def _method_tree(fn: Callable) -> tuple[ast.FunctionDef, ast.FunctionDef, str]:
    """(the function definition to rewrite, a pristine copy, the file name) of a ``(self, data)`` method."""
    try:
        tree, filename = _parse_method(fn)
    except (OSError, TypeError, SyntaxError) as exc:
        raise NotRewritable(f"source not readable: {type(exc).__name__}: {exc}") from None
    node = _function_of(tree)
    original = copy.deepcopy(node)
    args = node.args
    if len(args.args) != 2 or args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs or args.defaults \
            or node.decorator_list:
        raise NotRewritable("signature is not (self, data)")
    return node, original, filename


def _wrap_and_prove(fn: Callable, node: ast.FunctionDef, original: ast.FunctionDef, filename: str, rw: _Rewriter,
                    body: list[ast.stmt], prelude_src: str, raise_src: str, exit_src: str | None,
                    fallback_return: bool = True) -> None:
    """``node.body = <prelude> try: <body> except BaseException: <raise_src>; raise [finally: <exit_src>]``,
    then the proof (the one mechanism of both compiled methods): inserted nodes checked, upstream's shape
    checked, the tree minus the inserted statements equal to upstream's, the source equal to the running code.
    ``fallback_return``: the prelude may return (``_handle_request``'s untraced ``return original(...)``)."""
    reraise = ast.Raise()
    handler = ast.ExceptHandler(ast.Name(PREFIX + "BaseException", ast.Load()), PREFIX + "exc",
                                rw.stmts(raise_src, node, guard=False) + [reraise])
    final = rw.stmts(exit_src, node, guard=False) if exit_src is not None else []
    wrap = ast.Try(body=body, handlers=[handler], orelse=[], finalbody=final)
    setattr(wrap, "_kvtrace_wrap", True)
    for n in (wrap, handler, handler.type, reraise):
        ast.copy_location(n, node)
    _mark_all(handler)
    setattr(wrap, _MARK, True)
    prelude = rw.stmts(prelude_src, node, guard=False)
    node.body = prelude + [wrap]
    ast.fix_missing_locations(node)
    fallback = [n for s in prelude for n in ast.walk(s) if isinstance(n, ast.Return)] if fallback_return else []
    _check_inserted(node, {id(n) for n in fallback + [reraise]}, rw.loads)
    _check_upstream_shape(node)
    stripped = _strip(copy.deepcopy(node))  # deepcopy keeps the marks (instance attributes)
    if ast.dump(stripped, include_attributes=False) != ast.dump(original, include_attributes=False):
        raise NotRewritable("proof failed: the rewritten body minus the stamps differs from upstream's")
    _check_loaded(fn, filename)  # last: it compiles the whole file (~20 ms), once per function and process


def rewrite_tree(fn: Callable) -> tuple[ast.FunctionDef, str, dict[str, int]]:
    """The rewritten ``_handle_request`` definition of ``fn``, its file name and what was stamped; raises
    ``NotRewritable`` when the shape differs, the source is not the running code, or the proof fails."""
    node, original, filename = _method_tree(fn)
    rw = _Rewriter(node)
    body = rw.block(node.body)
    _check_uncovered(node, rw)
    missing = [k for k in _REQUIRED if not rw.found.get(k)]
    if missing:
        raise NotRewritable(f"no {', '.join(missing)} statement found")
    if rw.found["gate wait"] != 1 or rw.found["batch copy"] != 1 or rw.found["stagger"] != 1:
        raise NotRewritable(f"expected one gate wait, stagger and batch copy, found {rw.found}")
    _wrap_and_prove(fn, node, original, filename, rw, body, _PRELUDE, _ON_RAISE, _ON_EXIT)
    return node, filename, rw.found


# ``add_request``: the enqueue's record set-up (``wrappers.enqueue_rule``, the wrapper's own definition) in
# front of upstream's body; no frame of ours on the forward thread.
def _enqueue_templates(capture: bool, native: bool) -> tuple[str, str]:
    """(prelude, raise handler) of the compiled enqueue. ``capture``: upstream's body rebinds its task
    parameter, so the undo must work on the task the prelude saw (``__kvtrace_item``), not the parameter.
    ``native``: the record take is the native ``__kvtrace_take`` call (``wrappers.enqueue_rule``)."""
    item = _T + "item" if capture else "DATA"
    prelude = f"""
{_T}st = None
if {_T}recorder.enabled and DATA is not None:
    try:
""" + (f"        {item} = DATA\n" if capture else "") + wrappers.indent_rule(
        wrappers.enqueue_rule(_T, "SELF", "DATA", native), 8) + f"""
    except {_T}Exception as {_T}e:
        {_T}fail({_T}e)
        {_T}st = None
"""
    on_raise = f"""
try:
""" + wrappers.indent_rule(wrappers.enqueue_undo(_T, item), 4) + f"""
except {_T}Exception as {_T}e:
    {_T}fail({_T}e)
"""
    return prelude, on_raise


_NATIVE = wrappers.NATIVE_TAKE is not None
_ENQUEUE_PRELUDE, _ENQUEUE_RAISE = _enqueue_templates(False, _NATIVE)
_ENQUEUE_PRELUDE_CAPTURE, _ENQUEUE_RAISE_CAPTURE = _enqueue_templates(True, _NATIVE)
# the record take's text inlined (no native take): what a process without the extension compiles
_ENQUEUE_PRELUDE_INLINE, _ENQUEUE_RAISE_INLINE = _enqueue_templates(False, False)

_TEMPLATES = tuple(name for name, value in globals().items()
                   if name.startswith("_") and name.isupper() and isinstance(value, str) and PREFIX in value)
"""The names of every stamp template (the module's strings that carry our prefix), read by the rewrite when it
runs: their current texts key the compile cache (:func:`_factory_code`), so a template replaced at run time
(a test's inlined rule, a bench's ablation) is never served another text's code."""


def _rebinds(fn: ast.FunctionDef, name: str) -> bool:
    """Whether ``fn``'s body may rebind (or delete) the local ``name``: any store or ``del`` of it, a
    ``global``/``nonlocal`` naming it, or a nested scope (which could declare it ``nonlocal``)."""
    for node in ast.walk(fn):
        if node is fn:
            continue
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
            return True
        if isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return True
    return False


def rewrite_add_request_tree(fn: Callable) -> tuple[ast.FunctionDef, str, dict[str, int]]:
    """The rewritten ``add_request`` of ``fn`` (any ``(self, task)`` body: nothing inside it is stamped), its
    file name and ``{}``; raises ``NotRewritable`` as :func:`rewrite_tree` does."""
    node, original, filename = _method_tree(fn)
    _check_names(node)
    rw = _Rewriter(node)
    if _rebinds(original, rw.data_name):  # the undo then needs the task the prelude saw (2 bytecodes more)
        prelude, on_raise = _ENQUEUE_PRELUDE_CAPTURE, _ENQUEUE_RAISE_CAPTURE
    else:
        prelude, on_raise = _ENQUEUE_PRELUDE, _ENQUEUE_RAISE
    _wrap_and_prove(fn, node, original, filename, rw, node.body, prelude, on_raise, None, fallback_return=False)
    return node, filename, {}


_BUILTINS = ("getattr", "len", "type", "int", "list", "id", "setattr", "BaseException", "Exception",
             "AttributeError", "IndexError")


def _closure(original: Callable, rt: Runtime | None) -> dict[str, Any]:
    """The stamps' free names (``__kvtrace_<key>``); builtins too, so upstream's globals never shadow them.
    Without ``rt`` (doctor) only the names matter."""
    import builtins

    recorder = rt.recorder if rt is not None else None
    return {
        "clock": getattr(recorder, "clock", None), "recorder": recorder, "rt": rt, "fail": getattr(rt, "fail", None),
        "original": original,
        "queue_state": attach.queue_state, "release_recv": wrappers.release_recv,
        "total_bytes": total_bytes, "BackendResultError": BackendResultError,
        "npu_done": _npu_done, "slot_done": _slot_done,
        "pool": getattr(recorder, "_pool", None), "new_record": TaskRecord,
        "take": wrappers.make_take(recorder) if recorder is not None else None,
        "gate_after": wrappers.make_gate_after() if recorder is not None else None,
        "save_after": make_save_after() if recorder is not None else None,
        **{name: getattr(builtins, name) for name in _BUILTINS},
    }


_COMPILED: weakref.WeakKeyDictionary[Callable, dict[tuple[Callable, tuple[str, ...], tuple[str, ...]], Any]] = \
    weakref.WeakKeyDictionary()
"""Per upstream function, per (rewrite, closure names, template texts): the proved and compiled factory code; a
session start re-runs only the exec."""


def _factory_code(original: Callable, names: tuple[str, ...], tree: Callable = rewrite_tree) -> Any:
    per_fn = _COMPILED.get(original)
    if per_fn is None:
        per_fn = _COMPILED[original] = {}
    # the text compiled is the templates' (the natives are in use or not through them): key on the texts
    templates = globals()
    key = (tree, names, tuple(templates[name] for name in _TEMPLATES))
    code = per_fn.get(key)
    if code is None:
        code = per_fn[key] = _compile_factory(original, names, tree)
    return code


def _compile_factory(original: Callable, names: tuple[str, ...], tree: Callable = rewrite_tree) -> Any:
    """``def __kvtrace_factory(<names>): <rewritten function>; return it``, compiled under upstream's file."""
    node, filename, _found = tree(original)
    factory = ast.FunctionDef(
        name=f"{PREFIX}factory",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(PREFIX + n) for n in names], kwonlyargs=[],
                           kw_defaults=[], defaults=[]),
        body=[node, ast.Return(ast.Name(node.name, ast.Load()))], decorator_list=[], returns=None, type_params=[])
    ast.copy_location(factory, node)
    ast.fix_missing_locations(factory)
    return compile(ast.Module([factory], type_ignores=[]), filename, "exec", flags=_future_flags(original),
                   dont_inherit=True)


def _prepared(original: Callable, rt: Runtime | None,
              tree: Callable = rewrite_tree) -> tuple[Any, Any, dict[str, Any]]:
    """(upstream's module, the factory code, the closure values): everything :func:`build` needs but the exec."""
    module = sys.modules.get(original.__module__)
    if module is None:
        raise NotRewritable(f"module {original.__module__} not loaded")
    values = _closure(original, rt)
    return module, _factory_code(original, tuple(values), tree), values


def build(original: Callable, rt: Runtime, tree: Callable = rewrite_tree) -> Callable:
    """The compiled ``_handle_request`` (``tree``: :func:`rewrite_tree`) or ``add_request``
    (:func:`rewrite_add_request_tree`) for ``original``; raises ``NotRewritable``."""
    module, code, values = _prepared(original, rt, tree)
    ns: dict[str, Any] = {}
    exec(code, module.__dict__, ns)  # noqa: S102 - upstream's own source, rewritten and proved above
    fn = ns[f"{PREFIX}factory"](*values.values())
    fn.__qualname__ = original.__qualname__
    fn.__doc__ = original.__doc__
    fn.__kvtrace_wrapped__ = original  # type: ignore[attr-defined]
    setattr(fn, attach.COMPILED_ATTR, True)
    return fn


TREES: dict[str, Callable] = {"_handle_request": rewrite_tree, "add_request": rewrite_add_request_tree}
"""The rewrite of each compiled member (``points.py`` P4, P3)."""


def check(cls: type, member: str = "_handle_request") -> str | None:
    """``None`` when ``cls.<member>`` (``_handle_request`` or ``add_request``) would be compiled, else the
    reason (for doctor): the same proof and compile as :func:`build`."""
    fn = inspect.getattr_static(cls, member, None)
    fn = getattr(fn, "__kvtrace_wrapped__", fn)
    if not inspect.isfunction(fn):
        return f"no plain {member} function"
    try:
        _prepared(fn, None, TREES[member])
    except NotRewritable as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - what install would log before falling back
        return f"{type(exc).__name__}: {exc}"
    return None


def _compiled_or_wrapper(original: Callable, rt: Runtime, tree: Callable, wrapper: Callable, what: str) -> Callable:
    """The compiled ``original`` (``tree``: the rewrite of its AST), else ``wrapper(original, rt)`` with one
    log line saying why (``OTEL_KVTRACE_PROBES=wrappers``, not a plain function, the proof refused)."""
    try:
        if config.probes_mode() == "wrappers":
            raise NotRewritable(f"{config.OTEL_KVTRACE_PROBES}=wrappers")
        if not inspect.isfunction(original):
            raise NotRewritable("not a plain function")
        return build(original, rt, tree)
    except Exception as exc:  # noqa: BLE001 - NotRewritable, or any failure to compile: the wrapper instead
        reason = str(exc) if isinstance(exc, NotRewritable) else f"{type(exc).__name__}: {exc}"
        logger.info("otel-kvtrace: %s uses %s: %s", getattr(original, "__qualname__", original), what, reason)
        fallback = wrapper(original, rt)
        setattr(fallback, attach.FALLBACK_ATTR, reason)  # for probe_paths
        return fallback


def compile_handle_request(original: Callable, rt: Runtime) -> Callable:
    """Patch-point factory (``points.py`` P4): compiled probes, else the wrapper (one log line why)."""
    return _compiled_or_wrapper(original, rt, rewrite_tree, wrappers.wrap_handle_request,
                                "the wrapper path (compiled probes off)")


def compile_add_request(original: Callable, rt: Runtime) -> Callable:
    """Patch-point factory (``points.py`` P3): the compiled enqueue, else the wrapper (one log line why)."""
    return _compiled_or_wrapper(original, rt, rewrite_add_request_tree, wrappers.wrap_add_request,
                                "the enqueue wrapper (compiled enqueue off)")


def is_compiled(fn: object) -> bool:
    """True for a ``_handle_request`` or ``add_request`` built by :func:`build`."""
    return getattr(fn, attach.COMPILED_ATTR, False) is True
