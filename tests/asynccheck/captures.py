"""Capture files for the tests, built from the text fixtures under ``fixtures/``."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
EPOCH_NS = 1_767_225_600_000_000_000  # the fixtures' time origin, 2026-01-01T00:00:00Z


def build_db(sql_name: str, db_path: Path) -> Path:
    """A SQLite file made from one ``fixtures/*.sql`` script (binary files stay out of git)."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(db_path)
    con.executescript((FIXTURES / sql_name).read_text())
    con.commit()
    con.close()
    return db_path


def copy_fixture(name: str, dst: Path) -> Path:
    """Copy a fixture under a chosen name (importers dispatch on file names)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / name, dst)
    return dst
