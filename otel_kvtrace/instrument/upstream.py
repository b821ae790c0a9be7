"""Bind the patch points to the real vLLM-Ascend classes, whatever the version.

vLLM-Ascend main and release 0.23.0.post1 keep the layerwise KV pool in the same package but differ in
module names (``metadata`` vs ``config_data``, ``attention_fence`` vs ``memcache_comm_fence``), in
constructor signatures (main's GVA recv thread takes ``sync_save_events``, ``external_slot_release_waiter``
and ``save_failure_checker``) and in error handling (main has ``raise_if_failed``). This module finds
each class by candidate module paths, checks the members the wrappers rely on, and returns the same
:class:`~otel_kvtrace.instrument.targets.Targets` the replica provides, plus a per-point report that
``kvtrace doctor`` prints.

Nothing here imports torch, torch_npu or vllm by itself: :func:`resolve_installed` imports the installed
vLLM-Ascend (which brings its own dependencies), and :func:`source_tree` imports a source checkout with
those heavy dependencies replaced by inert stand-ins, only for the duration of a ``with`` block.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import logging
import re
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from otel_kvtrace.instrument import points
from otel_kvtrace.instrument.targets import Targets

ASCEND_STORE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store"

#: Candidate modules per role, newest layout first.
MODULE_CANDIDATES: dict[str, tuple[str, ...]] = {
    "kv_transfer": (f"{ASCEND_STORE}.kv_transfer",),
    "pool_worker": (f"{ASCEND_STORE}.pool_worker",),
    "metadata": (f"{ASCEND_STORE}.metadata", f"{ASCEND_STORE}.config_data"),
    "gate": (f"{ASCEND_STORE}.attention_fence", "vllm_ascend.memcache_comm_fence"),
    "backend": (f"{ASCEND_STORE}.backend.base", f"{ASCEND_STORE}.backend.backend"),
}

#: Role -> (module role, class name).
CLASS_ROLES: dict[str, tuple[str, str]] = {
    "worker": ("pool_worker", "KVPoolWorker"),
    "recv_gva": ("kv_transfer", "KVCacheStoreLayerRecvingThread"),
    "recv_key": ("kv_transfer", "KVCacheStoreKeyLayerRecvingThread"),
    "send_gva": ("kv_transfer", "KVCacheStoreLayerSendingThread"),
    "send_key": ("kv_transfer", "KVCacheStoreKeyLayerSendingThread"),
    "thread_base": ("kv_transfer", "KVTransferThread"),
    "builder": ("kv_transfer", "LayerBatchBuilder"),
    "gate": ("gate", "AttentionComputeStartGate"),
    "load_task": ("metadata", "LayerLoadTask"),
    "transfer_task": ("metadata", "LayerTransferTask"),
    "shared_block_data": ("metadata", "SharedBlockData"),
    "backend": ("backend", "Backend"),
}


# The one patch-point table (instrument/points.py): ``kvtrace doctor`` checks every row, the patcher
# (instrument/patches.py) wraps the rows that name a wrapper.
PATCH_POINTS = points.PATCH_POINTS
PatchPoint = points.PatchPoint


FOUND = "found"
MISSING = "missing"
SIGNATURE_CHANGED = "signature changed"


class UpstreamNotFound(ImportError):
    """vLLM-Ascend (or the layerwise KV pool inside it) cannot be imported."""


@dataclass(slots=True)
class PointStatus:
    """What :func:`bind` found for one patch point."""

    point: PatchPoint
    status: str  # FOUND | MISSING | SIGNATURE_CHANGED
    where: str  # "module.Class.member" (or the module/class that is missing)
    signature: str = ""
    missing_params: tuple[str, ...] = ()


@dataclass(slots=True)
class UpstreamBinding:
    """The resolved upstream classes, the detected version and layout, and the per-point report."""

    version: str
    layout: str  # "main" | "v0.23" | "unknown"
    source: str  # "installed" or the source-tree path
    modules: dict[str, str] = field(default_factory=dict)  # module role -> module name found
    classes: dict[str, type] = field(default_factory=dict)  # class role -> class
    flags: dict[str, Any] = field(default_factory=dict)
    points: list[PointStatus] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # module role -> import error text

    @property
    def ok(self) -> bool:
        """True when every required patch point was found with the expected signature."""
        return all(p.status == FOUND for p in self.points if p.point.required)

    def missing_required(self) -> list[PointStatus]:
        return [p for p in self.points if p.point.required and p.status != FOUND]

    def to_targets(self) -> Targets:
        """The classes to patch, in the shape the instrumentation layer takes (same as the replica's)."""
        recv = tuple(c for c in (self.classes.get("recv_gva"), self.classes.get("recv_key")) if c is not None)
        send = tuple(c for c in (self.classes.get("send_gva"), self.classes.get("send_key")) if c is not None)
        return Targets(
            worker_class=self.classes.get("worker"),
            recv_thread_classes=recv,
            send_thread_classes=send,
            gate_class=self.classes.get("gate"),
            source="upstream",
            version=self.version,
            flags={**self.flags, "layout": self.layout},
        )


# ---- binding ------------------------------------------------------------------------------------


def bind(
    import_module: Callable[[str], types.ModuleType] = importlib.import_module,
    *,
    version: str = "",
    source: str = "installed",
) -> UpstreamBinding:
    """Import the candidate modules, find the classes, check every patch point.

    Never raises for a missing module or class: the binding records it, and ``ok`` says whether tracing
    can work. ``import_module`` is replaceable so that a source tree can be imported under stubs.
    """
    binding = UpstreamBinding(version=version, layout="unknown", source=source)
    loaded: dict[str, types.ModuleType] = {}
    for role, candidates in MODULE_CANDIDATES.items():
        errors = []
        for name in candidates:
            try:
                loaded[role] = import_module(name)
            except Exception as exc:  # moved module, missing dependency, or an error at import time
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            binding.modules[role] = name
            break
        else:
            binding.errors[role] = "; ".join(errors)
    for role, (module_role, class_name) in CLASS_ROLES.items():
        module = loaded.get(module_role)
        cls = getattr(module, class_name, None) if module is not None else None
        if isinstance(cls, type):
            binding.classes[role] = cls
    binding.points = [_check_point(point, binding) for point in PATCH_POINTS]
    binding.flags = _feature_flags(binding)
    binding.layout = _layout(binding)
    if not binding.version:
        binding.version = "unknown"
    return binding


def _check_point(point: PatchPoint, binding: UpstreamBinding) -> PointStatus:
    cls = binding.classes.get(point.role)
    module_role, class_name = CLASS_ROLES[point.role]
    module_name = binding.modules.get(module_role, "|".join(MODULE_CANDIDATES[module_role]))
    where = f"{module_name}.{class_name}.{point.member}"
    if cls is None:
        return PointStatus(point, MISSING, f"{module_name}.{class_name}")
    member = inspect.getattr_static(cls, point.member, None)
    if member is None or not callable(getattr(cls, point.member, None)):
        return PointStatus(point, MISSING, where)
    try:
        signature = inspect.signature(getattr(cls, point.member))
    except (TypeError, ValueError):
        return PointStatus(point, FOUND, where, "(signature unavailable)")
    params = signature.parameters
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if point.member == "__init__":
        # Constructor arguments are named features: absent means the version lacks the feature.
        absent = tuple(n for n in point.params if n not in params)
        if absent and not has_var_kw:
            return PointStatus(point, MISSING, where, str(signature), absent)
        return PointStatus(point, FOUND, where, str(signature))
    names = list(params)
    absent = tuple(n for n in point.params if n not in names)
    if absent and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
        return PointStatus(point, SIGNATURE_CHANGED, where, str(signature), absent)
    return PointStatus(point, FOUND, where, str(signature))


def _init_params(cls: type | None) -> set[str]:
    if cls is None:
        return set()
    try:
        return set(inspect.signature(getattr(cls, "__init__")).parameters)  # noqa: B009 (mypy: unsound access)
    except (TypeError, ValueError):
        return set()


def _feature_flags(binding: UpstreamBinding) -> dict[str, Any]:
    """Version differences the wrappers and the tests branch on (research note section 5)."""
    base = binding.classes.get("thread_base")
    gva = binding.classes.get("recv_gva")
    gva_init = _init_params(gva)
    return {
        # main: the thread stores _fatal_error and dies; callers poll raise_if_failed()
        "raise_if_failed": base is not None and hasattr(base, "raise_if_failed"),
        # main: the GVA recv thread synchronizes sync_save_events[src] after the CPU save wait
        "recv_save_npu_sync": "sync_save_events" in gva_init,
        "slot_release_waiter": "external_slot_release_waiter" in gva_init,
        "save_failure_checker": "save_failure_checker" in gva_init,
        # release: the GVA builder takes (my_key_index, num_ranks_per_layer) and the thread passes them
        "builder_key_index": "my_key_index" in _init_params(binding.classes.get("builder")),
        "gva_add_request_override": gva is not None and "add_request" in vars(gva),
        "gate_module": binding.modules.get("gate", ""),
        "metadata_module": binding.modules.get("metadata", ""),
    }


def _layout(binding: UpstreamBinding) -> str:
    gate_module = binding.modules.get("gate", "")
    if gate_module.endswith(".attention_fence") and binding.flags.get("raise_if_failed"):
        return "main"
    if gate_module == "vllm_ascend.memcache_comm_fence" and not binding.flags.get("raise_if_failed"):
        return "v0.23"
    return "unknown"


def installed_version() -> str | None:
    """Version of the installed vllm-ascend distribution, or None when it is not installed."""
    for dist in ("vllm-ascend", "vllm_ascend"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def resolve_installed() -> UpstreamBinding:
    """Bind to the vLLM-Ascend installed in this interpreter.

    Raises :class:`UpstreamNotFound` with the import error when ``vllm_ascend`` is not importable.
    """
    try:
        importlib.import_module("vllm_ascend")
    except ImportError as exc:
        raise UpstreamNotFound(
            f"vllm_ascend is not importable in {sys.executable} ({exc}); install vllm-ascend "
            "(pip install 'otel-kvtrace[ascend]') or point at a source tree (kvtrace doctor --source DIR)"
        ) from exc
    return bind(version=installed_version() or "unknown", source="installed")


def resolve_targets() -> Targets:
    """The installed vLLM-Ascend's classes, ready for ``start_tracing``.

    Raises :class:`UpstreamNotFound` when vLLM-Ascend is not importable or lacks a required patch point
    (the message lists them; ``kvtrace doctor`` shows the full report).
    """
    binding = resolve_installed()
    if not binding.ok:
        missing = ", ".join(f"{p.point.id} {p.where} ({p.status})" for p in binding.missing_required())
        raise UpstreamNotFound(f"vLLM-Ascend {binding.version} lacks required patch points: {missing}")
    return binding.to_targets()


# ---- source trees ------------------------------------------------------------------------------


def source_tree_version(root: Path) -> str:
    """Version of a vllm-ascend source tree: sdist PKG-INFO, then the generated _version.py."""
    pkg_info = root / "PKG-INFO"
    if pkg_info.is_file():
        match = re.search(r"^Version:\s*(\S+)", pkg_info.read_text(errors="replace"), re.MULTILINE)
        if match:
            return match.group(1)
    version_py = root / "vllm_ascend" / "_version.py"
    if version_py.is_file():
        match = re.search(r"""version\s*=\s*['"]([^'"]+)['"]""", version_py.read_text(errors="replace"))
        if match:
            return match.group(1)
    return "unknown"


def _check_source_root(root: Path) -> Path:
    root = root.expanduser().resolve()
    if (root / "vllm_ascend").is_dir():
        return root
    if root.name == "vllm_ascend" and (root / "__init__.py").is_file():
        return root.parent
    raise UpstreamNotFound(
        f"--source {root}: no vllm_ascend/ package directory in it; pass the root of a vllm-ascend checkout "
        "or unpacked sdist (the directory that contains vllm_ascend/)"
    )


#: Top-level packages replaced by stand-ins when importing a source tree.
STUBBED_ROOTS = ("torch", "torch_npu", "vllm", "mooncake", "memcache_hybrid", "yr", "zmq")
#: vllm_ascend modules replaced by stand-ins (heavy package-level imports, not on the recv path).
STUBBED_ASCEND = (
    "vllm_ascend.utils",
    "vllm_ascend.envs",
    "vllm_ascend.ascend_config",
    "vllm_ascend.distributed.parallel_state",
    "vllm_ascend.distributed.utils",
    "vllm_ascend.distributed.kv_transfer.utils",
)
#: Packages registered bare (``__path__`` only) so that their ``__init__`` does not run.
BARE_PACKAGES = (
    "vllm_ascend",
    "vllm_ascend.distributed",
    "vllm_ascend.distributed.kv_transfer",
    "vllm_ascend.distributed.kv_transfer.kv_pool",
    ASCEND_STORE,
)


class _Placeholder:
    """Stand-in for a class imported from a stubbed package: accepts any arguments, usable as a base."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def _stub_attribute(module_name: str, name: str) -> Any:
    if name[:1].isupper():
        return type(name, (_Placeholder,), {"__module__": module_name})
    return mock.MagicMock(name=f"{module_name}.{name}")


#: Attributes of stubbed modules that must behave like the real thing for the recv path to run.
_STUB_OVERRIDES: dict[str, Callable[[], Any]] = {
    "vllm.logger.logger": lambda: logging.getLogger("vllm"),
    "vllm.logger.init_logger": lambda: logging.getLogger,
    "vllm.utils.math_utils.cdiv": lambda: (lambda a, b: -(-a // b)),
    "vllm.v1.core.kv_cache_utils.BlockHash": lambda: bytes,
    "vllm.v1.core.kv_cache_utils.BlockHashList": lambda: list,
    "vllm.v1.core.kv_cache_utils.maybe_convert_block_hash": lambda: (lambda x: x),
}


class _StubModule(types.ModuleType):
    """A package whose every attribute is a placeholder created on first access (PEP 562 style)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        factory = _STUB_OVERRIDES.get(f"{self.__name__}.{name}")
        value = factory() if factory is not None else _stub_attribute(self.__name__, name)
        setattr(self, name, value)
        return value


class _StubImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta-path finder that serves stand-in modules for the stubbed package prefixes."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes

    def _matches(self, fullname: str) -> bool:
        return any(fullname == p or fullname.startswith(p + ".") for p in self.prefixes)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not self._matches(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []  # a package, so submodules resolve through this finder too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "torch":
            module.Tensor = type("Tensor", (_Placeholder,), {})  # type: ignore[attr-defined]
            module.npu = _stub_npu()  # type: ignore[attr-defined]


def _stub_npu() -> types.SimpleNamespace:
    """``torch.npu`` stand-in: events complete at once (tests replace ``Event`` with a timed fake)."""

    class ImmediateEvent:
        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
            self.enable_timing = enable_timing

        def record(self, stream: Any = None) -> None:
            pass

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

        def wait(self, stream: Any = None) -> None:
            pass

    return types.SimpleNamespace(
        Event=ImmediateEvent,
        Stream=type("Stream", (_Placeholder,), {}),
        current_stream=lambda device=None: None,
        set_device=lambda device: None,
        current_device=lambda: 0,
        synchronize=lambda device=None: None,
        is_available=lambda: False,
    )


def _regex_alias() -> types.ModuleType | None:
    """``regex`` (a vllm-ascend dependency) when missing: the stdlib ``re`` covers the patterns used."""
    if importlib.util.find_spec("regex") is not None:
        return None
    return re


@contextmanager
def source_tree(root: str | Path) -> Iterator[UpstreamBinding]:
    """Import a vllm-ascend source tree's KV-pool modules under stubs and bind to them.

    Inside the block, ``torch``, ``torch_npu``, ``vllm`` and the external backends are stand-ins (the real
    ones are hidden), the ``vllm_ascend`` package ``__init__`` files are bypassed, and the KV-pool leaf
    modules (``kv_transfer``, ``pool_worker``, the metadata and gate modules) are imported from ``root``.
    On exit every module added or replaced is restored, so nothing leaks into the rest of the process.
    """
    src = _check_source_root(Path(root))
    pkg_dir = src / "vllm_ascend"
    prefixes = STUBBED_ROOTS + STUBBED_ASCEND
    saved = {
        name: module
        for name, module in sys.modules.items()
        if any(name == p or name.startswith(p + ".") for p in (*prefixes, "vllm_ascend", "regex"))
    }
    for name in saved:
        del sys.modules[name]
    finder = _StubImporter(prefixes)
    sys.meta_path.insert(0, finder)
    importlib.invalidate_caches()
    try:
        for name in BARE_PACKAGES:
            package = types.ModuleType(name)
            location = str(pkg_dir.joinpath(*name.split(".")[1:]))
            package.__path__ = [location]  # type: ignore[attr-defined]
            package.__package__ = name
            package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            package.__spec__.submodule_search_locations = [location]
            sys.modules[name] = package
        regex_alias = _regex_alias()
        if regex_alias is not None:
            sys.modules["regex"] = regex_alias
        yield bind(importlib.import_module, version=source_tree_version(src), source=str(src))
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if any(n == p or n.startswith(p + ".")
                                                   for p in (*prefixes, "vllm_ascend", "regex"))]:
            del sys.modules[name]
        sys.modules.update(saved)
        importlib.invalidate_caches()


# ---- per-worker resource attributes --------------------------------------------------------------


def _first_int(owner: Any, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def worker_resource_attributes(worker: Any, layout: str = "") -> dict[str, Any]:
    """Resource attributes (docs/schema.md) of one ``KVPoolWorker``: ranks, role, layerwise config.

    Read from the worker's own fields once its transfer threads exist (the P0 post-hook), never on the
    hot path. ``num_shared_buffers`` comes from the ``layerwise_num_shared_buffers`` extra config, else
    the reuse layout's slot count, else main's ``build_layerwise_cache_layout`` default, else
    ``num_layers`` (no reuse). 0.23 has no
    buffer reuse, so its independent layers are empty and ``buffer_reuse`` is false.
    """
    num_layers = _first_int(worker, "num_layers")
    extra = getattr(worker, "_extra_config", None)
    extra = extra if isinstance(extra, dict) else {}
    reuse_layout = getattr(worker, "_layerwise_reuse_layout", None)
    shared = extra.get("layerwise_num_shared_buffers")
    build_layout = getattr(sys.modules.get(type(worker).__module__), "build_layerwise_cache_layout", None)
    if isinstance(shared, int) and shared > 0:
        num_shared = shared
    elif reuse_layout is not None and getattr(reuse_layout, "buffer_slots", None):
        num_shared = len(reuse_layout.buffer_slots)
    elif callable(build_layout) and getattr(worker, "use_gva_layerwise", False):
        try:  # main's own default (min(B, N) rules live there, not here)
            num_shared = int(build_layout(num_layers, extra).num_shared_buffers)
        except Exception:
            num_shared = num_layers
    else:
        num_shared = num_layers
    independent = getattr(worker, "independent_layers", None) or []
    if extra.get("layerwise_independent_layers") == "all":
        independent_text = "all"
    else:
        independent_text = ",".join(str(int(x)) for x in independent)
    reuse = bool(getattr(worker, "layerwise_offload", False) or getattr(reuse_layout, "has_layer_reuse", False))
    prefetch = _first_int(worker, "num_prefetch_layers", default=1)
    path = "gva" if getattr(worker, "use_gva_layerwise", False) else "key"
    label = f"{layout or 'upstream'} {path} N={num_layers} B={num_shared} P={prefetch}"
    if independent_text:
        label += f" indep={independent_text}"
    return {
        "kvtrace.cfg.label": label,
        "kvtrace.cfg.num_layers": num_layers,
        "kvtrace.cfg.prefetch_layers": prefetch,
        "kvtrace.cfg.num_shared_buffers": num_shared,
        "kvtrace.cfg.independent_layers": independent_text,
        "kvtrace.cfg.buffer_reuse": reuse,
        "kvtrace.rank.tp": _first_int(worker, "tp_rank"),
        "kvtrace.rank.tp_size": _first_int(worker, "tp_size", default=1),
        "kvtrace.rank.dp": _first_int(worker, "dp_rank"),
        "kvtrace.rank.pp": _first_int(worker, "pp_rank"),
        "kvtrace.rank.pcp": _first_int(worker, "pcp_rank"),
        "kvtrace.rank.dcp": _first_int(worker, "dcp_rank"),
        "kvtrace.role": str(getattr(worker, "kv_role", "") or ""),
    }
