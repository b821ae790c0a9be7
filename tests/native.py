"""The optional C extensions must be in use wherever they can be built, so a suite run cannot silently test
only the Python fallbacks."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sysconfig
from pathlib import Path

import pytest


def require_built(module: str, fallback: str) -> None:
    """Skip (saying ``fallback`` is in use) where no compiler or Python headers exist; else assert that
    ``pip install -e .`` built ``module``."""
    built = importlib.util.find_spec(module) is not None
    can_build = shutil.which(os.environ.get("CC", "gcc")) is not None and (
        Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()
    if not (built or can_build):
        pytest.skip(f"no compiler or Python headers here: {fallback} is the one in use")
    assert built, f"a compiler is here but {module.replace('.', '/')}*.so is not: pip install -e ."
