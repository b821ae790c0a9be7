"""Released vLLM engine-loop sources, imported on CPU with their heavy dependencies stubbed.

The wheel is fetched with ``pip download --no-deps vllm==X`` at test time; only its ``.py`` files are
unpacked, into ``.venv/kvtrace-cache/vllm-X/`` (the venv is what CI caches), never into the repository.
``vllm_modules(version)`` imports the listed real modules (engine core, executors, output classes,
``ParallelConfig``) from those files; every other ``vllm.*`` module and the heavy third-party packages
(torch, pydantic, msgspec, ...) are served as inert stand-ins. On exit every module is removed again.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ("0.23.0", "0.33.0")
#: Real modules; everything else under vllm.* is a stand-in.
REAL = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.abstract",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.outputs",
    "vllm.v1.worker.gpu.async_utils",
    "vllm.config.parallel",
    "vllm.v1.serial_utils",
)
OPTIONAL_REAL = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_worker")
STUBBED = ("vllm", "torch", "pydantic", "pydantic_core", "msgspec", "cloudpickle", "transformers", "triton",
           "psutil", "cbor2", "regex", "tqdm", "prometheus_client", "huggingface_hub", "safetensors", "ray",
           "numba", "xgrammar", "outlines_core", "llguidance", "blake3", "pybase64", "openai", "fastapi",
           "setproctitle", "gguf", "tokenizers", "einops", "compressed_tensors", "flashinfer", "mistral_common")


class VllmUnavailable(RuntimeError):
    """The vLLM wheel could not be fetched; the message says why."""


def cache_root() -> Path:
    return Path(sys.prefix) / "kvtrace-cache"


def vllm_source(version: str) -> Path:
    """Directory holding ``vllm/`` (``.py`` files only) of the released wheel; fetched once, file-locked."""
    target = cache_root() / f"vllm-{version}"
    marker = target / ".complete"
    if marker.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file():
            return target
        dl = target.parent / f"dl-{version}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(dl),
               f"vllm=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
        wheels = sorted(dl.glob(f"vllm-{version}*.whl"))
        if not wheels:
            raise VllmUnavailable(f"`{' '.join(cmd)}` exit {proc.returncode}: {proc.stderr.strip()[-800:]}")
        with zipfile.ZipFile(wheels[0]) as whl:
            for name in whl.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    whl.extract(name, target)
        for wheel in wheels:
            wheel.unlink()
        marker.write_text(version)
    return target


class _PlaceholderMeta(type):
    """Class attributes of a stand-in class (``Registry.capture(...)`` decorators) are no-op decorators."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _identity_decorator


class _Placeholder(metaclass=_PlaceholderMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __class_getitem__(cls, item: Any) -> Any:
        return cls


def _identity_decorator(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


class _Logger:
    """``vllm.logger.init_logger`` stand-in: the std logger plus vLLM's ``*_once`` helpers."""

    def __init__(self, name: str) -> None:
        import logging

        self._log = logging.getLogger(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name.removesuffix("_once"))


OVERRIDES: dict[str, Any] = {
    "vllm.logger.init_logger": _Logger,
    "vllm.config.utils.config": _identity_decorator,
    "vllm.tracing.instrument": _identity_decorator,
    "vllm.utils.import_utils.resolve_obj_by_qualname": lambda q: importlib.import_module(q.rpartition(".")[0]),
}


REEXPORTS = {"vllm.config.ParallelConfig": "vllm.config.parallel"}


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        key = f"{self.__name__}.{name}"
        if key in OVERRIDES:
            value = OVERRIDES[key]
        elif key in REEXPORTS:  # a package re-exporting a real module's class (``vllm.config.ParallelConfig``)
            value = getattr(importlib.import_module(REEXPORTS[key]), name)
        elif self.__name__ == "vllm.envs":
            value = None  # every VLLM_* setting unset
        elif name[:1].isupper():
            value = type(name, (_Placeholder,), {"__module__": self.__name__})
        else:
            value = mock.MagicMock(name=key)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: Path, real: tuple[str, ...]) -> None:
        self.root = root
        self.real = set(real)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.real:
            rel = Path(*fullname.split("."))
            file = self.root / rel.with_suffix(".py")
            if not file.is_file():
                file = self.root / rel / "__init__.py"
            return importlib.util.spec_from_file_location(fullname, file)
        if any(fullname == p or fullname.startswith(p + ".") for p in STUBBED):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _owned(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in STUBBED)


@contextlib.contextmanager
def vllm_modules(version: str, torch_setup: Any = None) -> Iterator[types.SimpleNamespace]:
    """The real engine-loop modules of vLLM ``version`` (attributes named by their last two parts)."""
    import importlib.util

    root = vllm_source(version)
    saved = {n: m for n, m in sys.modules.items() if _owned(n)}
    for name in saved:
        del sys.modules[name]
    finder = _Finder(root, REAL + OPTIONAL_REAL)
    sys.meta_path.insert(0, finder)
    try:
        torch = importlib.import_module("torch")
        if torch_setup is not None:
            torch_setup(torch)
        mods = types.SimpleNamespace(version=version, torch=torch, errors={})
        for name in REAL:
            setattr(mods, name.rsplit(".", 1)[-1], importlib.import_module(name))
        for name in OPTIONAL_REAL:
            try:
                setattr(mods, name.rsplit(".", 1)[-1], importlib.import_module(name))
            except Exception as exc:  # noqa: BLE001 - reported by the test that needs it
                mods.errors[name] = repr(exc)
        yield mods
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if _owned(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
        importlib.invalidate_caches()
