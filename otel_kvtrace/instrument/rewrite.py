"""Compiled probes: upstream's recv ``_handle_request`` recompiled with its stamps inline.

Every recv stage of vLLM-Ascend's GVA ``KVCacheStoreLayerRecvingThread._handle_request`` (0.23 and main)
is a statement of that one function: the save wait loop (main: plus the NPU ``synchronize``), the address
build, the attention-gate wait loop, the H2D stagger, the slot-release wait (main), the batch copy and the
load event ``set()``. At install the installed method's own source (``inspect.getsourcelines``: never a
copy in this repository) is parsed, stamp statements are inserted at those statements, and the result is
compiled under upstream's file name and line numbers, in upstream's module globals (the names we add are
closure variables called ``__kvtrace_*``). The stamps write straight into the task's ``TaskRecord``,
exactly what ``wrappers.py`` + ``proxies.py`` write: no wrapper frame, no proxy, no thread lookup per
stage.

Semantics are proved at install, not trusted: the inserted statements (all marked) are stripped from
the rewritten tree, which must then dump equal to the original (``ast.dump(include_attributes=False)``),
and every call of a stamped method must sit in a recognised statement. Otherwise (another upstream
version, a patched method) :func:`compile_handle_request` logs ONE line with the reason and returns the
wrapper of ``wrappers.wrap_handle_request`` (the other wrappers then stay on, see ``patches.install``).

The body runs in ``try: ... except BaseException: <mark>; raise`` (bare ``raise``: the same exception
object and traceback lines) ``finally: <release>``; ``task_done()``, ``_fatal_error`` and shutdown are
upstream's statements, untouched. A stamp that fails turns tracing off (``rt.fail``), never the thread.
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
from otel_kvtrace.record.model import NO_TIME, BackendResultError, Dep, Outcome, Stage

logger = logging.getLogger("otel_kvtrace")

PREFIX = "__kvtrace_"
COMPILED_ATTR = "__kvtrace_compiled__"
_MARK = "_kvtrace_inserted"  # on every AST node we insert (stripped by the proof)

_S = {s.name: int(s) for s in Stage}
_D = {d.name: int(d) for d in Dep}
_ERROR = int(Outcome.ERROR)
_EMPTY = int(Outcome.EMPTY)


class NotRewritable(Exception):
    """The source is not the shape the probes know; the message says what differs."""


# ---- stamp templates (``ARG``: the statement's own index / argument expression, re-read) -------------------

_T = PREFIX
_PRELUDE = f"""
{_T}t = {_T}clock()
{_T}rec = None
if {_T}recorder.enabled and DATA is not None:
    try:
        {_T}st = SELF.__dict__.get({_T}STATE) or {_T}queue_state(SELF, {_T}rt)
        try:
            {_T}rec = DATA.__dict__.pop("_kvtrace", None)
        except AttributeError:
            {_T}rec = None
        if {_T}rec is not None and {_T}rec.queue is not {_T}st.info and \\
                getattr({_T}rec.queue, "run_id", None) != {_T}st.info.run_id:
            {_T}rec = None
        if {_T}rec is None:
            {_T}st.untraced += 1
        else:
            {_T}rec.t_dequeue = {_T}t
            {_T}st.dequeued += 1
    except Exception as {_T}e:
        {_T}fail({_T}e)
        {_T}rec = None
if {_T}rec is None:
    return {_T}original(SELF, DATA)
{_T}stages = {_T}rec.stages
{_T}pend = -1
"""

_ON_RAISE = f"""
try:
    if {_T}pend >= 0:
        {_T}stages.extend(({_T}pend, {_T}p0, {_T}clock()))
        if {_T}pend == {_S['BACKEND_SUBMIT']}:
            {_T}rec.backend_result = -1
        elif {_T}pend == {_S['SLOT_RELEASE_WAIT']}:
            {_T}slot_done({_T}rec, SELF, {_T}slot_arg, {_T}stages[-1])
    {_T}rec.outcome = {_ERROR}
    {_T}rec.error = {_T}exc
    if {_T}rec.t_complete == {NO_TIME}:
        {_T}rec.t_complete = {_T}clock()
except Exception as {_T}e:
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
    if len({_T}holds) < 2:
        if {_T}holds and {_T}holds.pop() == 0:
            {_T}recorder.submit({_T}rec)
    else:
        {_T}release_recv({_T}rt, {_T}rec)
except Exception as {_T}e:
    {_T}fail({_T}e)
"""



def _wait_loop(start: str, stage: str) -> tuple[str, str, str]:
    """Stamps of a ``while not <wait>(timeout=10): ...`` loop: before it, at the top of its body (the wait
    timed out: one stage per call, as the wrappers record it) and at the end of its body (the next call)."""
    return (f"{_T}{start} = {_T}clock()", f"{_T}stages.extend(({_S[stage]}, {_T}{start}, {_T}clock()))",
            f"{_T}{start} = {_T}clock()")


_SAVE_BEFORE, _SAVE_TIMED_OUT, _SAVE_RESTART = _wait_loop("w0", "SAVE_CPU_WAIT")
_SAVE_AFTER = f"""
{_T}w1 = {_T}clock()
try:
    {_T}stages.extend(({_S['SAVE_CPU_WAIT']}, {_T}w0, {_T}w1))
    {_T}set_ns = getattr(SELF.layer_save_finished_events[ARG], "set_ns", -1)
    {_T}deps = {_T}rec.deps
    {_T}rec.has_dep |= {1 << _D['SAVE_CPU']}
    if {_T}set_ns >= 0:
        {_T}deps[{2 * _D['SAVE_CPU']}] = {_T}deps[{2 * _D['SAVE_CPU'] + 1}] = {_T}set_ns
    else:
        {_T}deps[{2 * _D['SAVE_CPU']}] = {_T}rec.t_enqueue
        {_T}deps[{2 * _D['SAVE_CPU'] + 1}] = {_T}w1
except Exception as {_T}e:
    {_T}fail({_T}e)
"""

_GATE_BEFORE, _GATE_TIMED_OUT, _GATE_RESTART = _wait_loop("g0", "GATE_COND_WAIT")
_GR, _GN = 2 * _D["GATE_RECORD"], 2 * _D["GATE_NPU"]
_GATE_BITS = (1 << _D["GATE_RECORD"]) | (1 << _D["GATE_NPU"])
# After the last (successful) gate ``wait()``: ``wrappers.wrap_gate_wait``'s stamps for ``ok``, inlined.
_GATE_AFTER = f"""
{_T}g1 = {_T}clock()
try:
    {_T}gstamp = ARG.__dict__.get({wrappers.GATE_STAMP_ATTR!r})
    {_T}deps = {_T}rec.deps
    {_T}rec.has_dep |= {_GATE_BITS}
    if {_T}gstamp is None:
        {_T}stages.extend(({_S['GATE_NPU_SYNC']}, {_T}g0, {_T}g1))
        {_T}deps[{_GR}] = {_T}deps[{_GN}] = {_T}rec.t_enqueue
        {_T}deps[{_GR + 1}] = {_T}g0
        {_T}deps[{_GN + 1}] = {_T}g1
    else:
        {_T}grec, {_T}gpos, {_T}gmark = {_T}gstamp
        {_T}gcond = max({_T}g0, min({_T}grec, {_T}g1))
        if {_T}gcond > {_T}g0:
            {_T}stages.extend(({_S['GATE_COND_WAIT']}, {_T}g0, {_T}gcond, {_S['GATE_NPU_SYNC']}, {_T}gcond, {_T}g1))
        else:
            {_T}stages.extend(({_S['GATE_NPU_SYNC']}, {_T}gcond, {_T}g1))
        {_T}glog = {_T}gpos.log
        {_T}gp = {_T}gpos.position
        if {_T}g1 < {_T}glog.done_by[{_T}gp]:
            {_T}glog.done_by[{_T}gp] = {_T}g1
        if {_T}gp > {_T}glog.observed:
            {_T}glog.observed = {_T}gp
        {_T}deps[{_GR}] = {_T}deps[{_GR + 1}] = {_T}deps[{_GN}] = {_T}grec
        {_T}deps[{_GN + 1}] = {_T}g1
        {_T}rec.npu_marks.append(({_D['GATE_NPU']}, {_T}gpos))
        if {_T}gmark is not None:
            {_T}rec.npu_marks.append(({_D['GATE_NPU']}, {_T}gmark))
except Exception as {_T}e:
    {_T}fail({_T}e)
"""

_SPAN_BEFORE = f"{_T}k0 = {_T}clock()"
_BUILD_AFTER = f"{_T}stages.extend(({_S['META_BUILD']}, {_T}k0, {_T}clock()))"

_PENDING = f"""
{_T}pend = STAGE
{_T}p0 = {_T}clock()
"""
_STAGGER_AFTER = f"""
{_T}stages.extend(({_S['H2D_STAGGER']}, {_T}p0, {_T}clock()))
{_T}pend = -1
"""
_SLOT_BEFORE = f"""
{_T}pend = {_S['SLOT_RELEASE_WAIT']}
{_T}slot_arg = ARG
{_T}p0 = {_T}clock()
"""
_SLOT_AFTER = f"""
{_T}pend = -1
{_T}stages.extend(({_S['SLOT_RELEASE_WAIT']}, {_T}p0, {_T}clock()))
try:
    {_T}slot_done({_T}rec, SELF, {_T}slot_arg, {_T}stages[-1])
except Exception as {_T}e:
    {_T}fail({_T}e)
"""
_COPY_AFTER = f"""
{_T}b1 = {_T}clock()
{_T}pend = -1
{_T}stages.extend(({_S['BACKEND_SUBMIT']}, {_T}p0, {_T}b1))
{_T}rec.t_backend_return = {_T}b1
if type(RESULT) is int:
    {_T}rec.backend_result = RESULT
try:
    {_T}rec.nbytes += {_T}total_bytes(ARG)
except Exception as {_T}e:
    {_T}fail({_T}e)
"""
_LOAD_SET_BEFORE = f"{_T}rec.t_complete = {_T}clock()"
_NPU_AFTER = f"""
{_T}n1 = {_T}clock()
try:
    {_T}npu_done({_T}rec, SELF.sync_save_events[ARG], {_T}k0, {_T}n1)
except Exception as {_T}e:
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

    def stmts(self, source: str, **subst: ast.AST) -> list[ast.stmt]:
        tree = ast.parse(source.strip("\n"))
        names = {"SELF": ast.Name(self.self_name, ast.Load()), "DATA": ast.Name(self.data_name, ast.Load()), **subst}

        class Sub(ast.NodeTransformer):
            def visit_Name(self, node: ast.Name) -> ast.AST:
                if node.id in names:
                    new = ast.parse(ast.unparse(names[node.id]), mode="eval").body
                    return new
                return node

        body = [Sub().visit(s) for s in tree.body]
        for s in body:
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
            for new in before + after:
                ast.copy_location(new, s)
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
                s.body = self.stmts(_SAVE_TIMED_OUT) + s.body + self.stmts(_SAVE_RESTART)
                return self.stmts(_SAVE_BEFORE), self.stmts(_SAVE_AFTER, ARG=arg)
            m = _method_call(call)
            if m is not None and m[1] == "wait" and isinstance(m[0], ast.Name):
                self._hit("gate wait", call)
                s.body = self.stmts(_GATE_TIMED_OUT) + s.body + self.stmts(_GATE_RESTART)
                return self.stmts(_GATE_BEFORE), self.stmts(_GATE_AFTER, ARG=m[0])
        value = s.value if isinstance(s, (ast.Expr, ast.Assign, ast.AnnAssign)) else None
        if value is None:
            return [], []
        m = _method_call(value)
        if isinstance(s, (ast.Assign, ast.AnnAssign)) and m is not None and m[1] in ("build_addrs", "build") \
                and isinstance(m[0], ast.Name):
            self._hit("build", value)
            return self.stmts(_SPAN_BEFORE), self.stmts(_BUILD_AFTER)
        if isinstance(s, ast.Expr) and m is not None and m[1] == "_stagger_h2d_submit" and \
                isinstance(m[0], ast.Name) and m[0].id == sn:
            self._hit("stagger", value)
            return (self.stmts(_PENDING, STAGE=ast.Constant(_S["H2D_STAGGER"])), self.stmts(_STAGGER_AFTER))
        if isinstance(s, ast.Assign) and m is not None and m[1] == "_batch_copy_with_limits" and \
                isinstance(m[0], ast.Name) and m[0].id == sn and len(s.targets) == 1 and \
                isinstance(s.targets[0], ast.Name) and len(value.args) >= 3 and isinstance(value.args[2], ast.Name):
            self._hit("batch copy", value)
            result = ast.Name(s.targets[0].id, ast.Load())
            return (self.stmts(_PENDING, STAGE=ast.Constant(_S["BACKEND_SUBMIT"])),
                    self.stmts(_COPY_AFTER, RESULT=result, ARG=value.args[2]))
        if isinstance(s, ast.Expr):
            arg = _event_call(value, sn, "layer_load_finished_events", "set")
            if arg is not None:
                self._hit("load set", value)
                return self.stmts(_LOAD_SET_BEFORE), []
            arg = _event_call(value, sn, "sync_save_events", "synchronize")
            if arg is not None:
                self._hit("npu sync", value)
                return self.stmts(_SPAN_BEFORE), self.stmts(_NPU_AFTER, ARG=arg)
            if isinstance(value, ast.Call) and _is_self_attr(value.func, sn, "external_slot_release_waiter") and \
                    len(value.args) == 1 and not value.keywords and isinstance(value.args[0], (ast.Name, ast.Constant)):
                self._hit("slot release", value)
                return self.stmts(_SLOT_BEFORE, ARG=value.args[0]), self.stmts(_SLOT_AFTER)
        return [], []


_SINGLETONS = (ast.expr_context, ast.boolop, ast.operator, ast.unaryop, ast.cmpop)


def _mark_all(node: ast.AST) -> None:
    """Mark ``node`` and its children as ours (not the parser's shared operator singletons)."""
    for n in ast.walk(node):
        if not isinstance(n, _SINGLETONS):
            setattr(n, _MARK, True)


_REQUIRED = ("save wait", "build", "gate wait", "stagger", "batch copy", "load set")


def _check_uncovered(fn: ast.FunctionDef, rw: _Rewriter) -> None:
    """Every call of a stamped method must be one the stamps cover; no name the recompile would change."""
    for node in ast.walk(fn):
        if getattr(node, _MARK, False):
            continue
        if isinstance(node, ast.Name) and (node.id.startswith(PREFIX) or node.id in ("super", "__class__")):
            raise NotRewritable(f"line {node.lineno}: uses {node.id!r}")
        if isinstance(node, (ast.Attribute, ast.Name)):
            ident = node.attr if isinstance(node, ast.Attribute) else node.id
            if ident.startswith("__") and not ident.endswith("__"):
                raise NotRewritable(f"line {node.lineno}: private name {ident!r} (would not be mangled)")
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


def rewrite_tree(fn: Callable) -> tuple[ast.FunctionDef, str, dict[str, int]]:
    """The rewritten function definition of ``fn``, its file name and what was stamped; raises
    ``NotRewritable`` when the shape differs or the proof fails."""
    try:
        tree, filename = _parse_method(fn)
        original = _function_of(_parse_method(fn)[0])
    except (OSError, TypeError, SyntaxError) as exc:
        raise NotRewritable(f"source not readable: {type(exc).__name__}: {exc}") from None
    node = _function_of(tree)
    args = node.args
    if len(args.args) != 2 or args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs or args.defaults \
            or node.decorator_list:
        raise NotRewritable("signature is not (self, data)")
    rw = _Rewriter(node)
    body = rw.block(node.body)
    _check_uncovered(node, rw)
    missing = [k for k in _REQUIRED if not rw.found.get(k)]
    if missing:
        raise NotRewritable(f"no {', '.join(missing)} statement found")
    if rw.found["gate wait"] != 1 or rw.found["batch copy"] != 1 or rw.found["stagger"] != 1:
        raise NotRewritable(f"expected one gate wait, stagger and batch copy, found {rw.found}")
    wrap = ast.Try(body=body, handlers=[ast.ExceptHandler(ast.Name("BaseException", ast.Load()), PREFIX + "exc",
                                                          rw.stmts(_ON_RAISE) + [ast.Raise()])],
                   orelse=[], finalbody=rw.stmts(_ON_EXIT))
    setattr(wrap, _MARK, True)
    setattr(wrap, "_kvtrace_wrap", True)
    _mark_all(wrap.handlers[0])
    node.body = rw.stmts(_PRELUDE) + [wrap]
    for new in node.body:
        ast.copy_location(new, node.body[-1].body[0] if new is wrap else node)
    ast.copy_location(wrap, body[0])
    ast.fix_missing_locations(node)
    stripped = _strip(copy.deepcopy(node))  # deepcopy keeps the marks (instance attributes)
    if ast.dump(stripped, include_attributes=False) != ast.dump(original, include_attributes=False):
        raise NotRewritable("proof failed: the rewritten body minus the stamps differs from upstream's")
    return node, filename, rw.found


_NAMES = ("clock", "recorder", "rt", "fail", "original", "queue_state", "STATE", "release_recv", "total_bytes",
          "BackendResultError", "npu_done", "slot_done")


def _closure(original: Callable, rt: Runtime) -> dict[str, Any]:
    recorder = rt.recorder
    clock = recorder.clock

    return {
        "clock": clock, "recorder": recorder, "rt": rt, "fail": rt.fail, "original": original,
        "queue_state": attach.queue_state, "STATE": attach.STATE_ATTR, "release_recv": wrappers.release_recv,
        "total_bytes": total_bytes, "BackendResultError": BackendResultError,
        "npu_done": _npu_done, "slot_done": _slot_done,
    }


_COMPILED: weakref.WeakKeyDictionary[Callable, Any] = weakref.WeakKeyDictionary()
"""Per upstream function: the proved and compiled factory code (a session start re-runs only the exec)."""


def _factory_code(original: Callable) -> Any:
    code = _COMPILED.get(original)
    if code is None:
        code = _COMPILED[original] = _compile_factory(original)
    return code


def _compile_factory(original: Callable) -> Any:
    """``def __kvtrace_factory(<names>): <rewritten function>; return it``, compiled under upstream's file."""
    node, filename, _found = rewrite_tree(original)
    factory = ast.FunctionDef(
        name=f"{PREFIX}factory",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(PREFIX + n) for n in _NAMES], kwonlyargs=[],
                           kw_defaults=[], defaults=[]),
        body=[node, ast.Return(ast.Name(node.name, ast.Load()))], decorator_list=[], returns=None, type_params=[])
    ast.copy_location(factory, node)
    ast.fix_missing_locations(factory)
    # upstream's own future flags (``from __future__ import annotations`` keeps annotations unevaluated)
    module = sys.modules.get(original.__module__)
    flags = __future__.annotations.compiler_flag \
        if getattr(module, "annotations", None) is __future__.annotations else 0
    return compile(ast.Module([factory], type_ignores=[]), filename, "exec", flags=flags, dont_inherit=True)


def build(original: Callable, rt: Runtime) -> Callable:
    """The compiled ``_handle_request`` for ``original``; raises ``NotRewritable``."""
    module = sys.modules.get(original.__module__)
    if module is None:
        raise NotRewritable(f"module {original.__module__} not loaded")
    code = _factory_code(original)
    ns: dict[str, Any] = {}
    exec(code, module.__dict__, ns)  # noqa: S102 - upstream's own source, rewritten and proved above
    values = _closure(original, rt)
    fn = ns[f"{PREFIX}factory"](*(values[n] for n in _NAMES))
    fn.__qualname__ = original.__qualname__
    fn.__doc__ = original.__doc__
    fn.__kvtrace_wrapped__ = original  # type: ignore[attr-defined]
    setattr(fn, COMPILED_ATTR, True)
    return fn


def check(cls: type) -> str | None:
    """``None`` when ``cls._handle_request`` can take compiled probes, else the reason (for doctor)."""
    fn = inspect.getattr_static(cls, "_handle_request", None)
    fn = getattr(fn, "__kvtrace_wrapped__", fn)
    if not inspect.isfunction(fn):
        return "no plain _handle_request function"
    try:
        rewrite_tree(fn)
    except NotRewritable as exc:
        return str(exc)
    return None


def compile_handle_request(original: Callable, rt: Runtime) -> Callable:
    """Patch-point factory (``points.py`` P4): compiled probes, else the wrapper (one log line why)."""
    try:
        if config.probes_mode() == "wrappers":
            raise NotRewritable(f"{config.OTEL_KVTRACE_PROBES}=wrappers")
        if not inspect.isfunction(original):
            raise NotRewritable("not a plain function")
        fn = build(original, rt)
    except Exception as exc:  # noqa: BLE001 - NotRewritable, or any failure to compile: the wrappers instead
        reason = str(exc) if isinstance(exc, NotRewritable) else f"{type(exc).__name__}: {exc}"
        logger.info("otel-kvtrace: %s uses the wrapper path (compiled probes off): %s",
                    getattr(original, "__qualname__", original), reason)
        return wrappers.wrap_handle_request(original, rt)
    return fn


def is_compiled(fn: object) -> bool:
    """True for a ``_handle_request`` built by :func:`build`."""
    return getattr(fn, COMPILED_ATTR, False) is True
