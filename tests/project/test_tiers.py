"""The tiers and the parallel groups the suite's 30-minute budget rests on (docs/testing.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO


def test_xdist_keeps_a_group_on_one_worker(workdir: Path) -> None:
    """--dist loadgroup sends a group's tests to one worker, so a bed is booted once: with pytest 9 it
    silently did not (pytest-xdist's nodeid tag is ignored there) and every worker booted every bed."""
    (workdir / "pytest.ini").write_text("[pytest]\n")
    (workdir / "test_grouped.py").write_text(
        "import os, pytest\n\n\n"
        "@pytest.mark.xdist_group('bed')\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_in_the_group(i):\n"
        "    assert os.environ['PYTEST_XDIST_WORKER']\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
         "test_grouped.py"],
        capture_output=True, text=True, cwd=workdir, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:]
    ran = re.findall(r"\[(gw\d+)\] .*PASSED test_grouped.py::test_in_the_group\[\d\]@bed", run.stdout)
    assert len(ran) == 8 and len(set(ran)) == 1, run.stdout[-2000:]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("tests/test_probe.py", {"quick"}),
        ("tests/fleet/test_fleet_units.py", {"fleet"}),
        ("tests/e2e/test_e2e_calibration.py", {"vllm"}),
    ],
)
def test_each_test_gets_its_tier_from_what_it_uses(path: str, expected: set[str]) -> None:
    markers = {"quick": "not systemd and not vllm and not fleet", "fleet": "fleet", "vllm": "vllm"}
    for tier, expression in markers.items():
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             "-m", expression, path],
            capture_output=True, text=True, cwd=REPO, timeout=300,
        )  # fmt: skip
        collected = re.search(r"(\d+)(?:/\d+)? tests? collected", run.stdout)
        count = int(collected.group(1)) if collected else 0
        assert (count > 0) is (tier in expected), (tier, run.stdout[-800:])
