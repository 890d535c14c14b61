"""The repository's folders, named once, so a test's place in tests/ is not path arithmetic in it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
DATA = TESTS / "data"  # real logs, sources and captures the tests read (kept in the repo)
