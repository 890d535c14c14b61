"""One truthful verdict (issue 17 item 3): the headline, --json's `result`, `feasible` and `verdict`,
and the exit code of `ctxmgr plan` always say the same thing. Before, "FEASIBLE: no memory information"
exited 6, a context above the derived maximum printed "NOT FEASIBLE" and then "verdict: fits" (JSON
`verdict: "fits"` beside `feasible: false`), and unknown weights printed "FEASIBLE: fits" with exit 0."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.ctxmgr_cli import ctxmgr_command

REPO = Path(__file__).resolve().parent.parent
GLM5 = str(REPO / "examples" / "models" / "glm-5")
LLAMA = str(REPO / "examples" / "models" / "llama-3.1-70b")
EIGHT = ("--gpu-memory", "95.6GiB", "--gpu-count", "8", "-tp", "8")
EXIT = {"feasible": 0, "infeasible": 3, "unknown": 6}
HEADLINE = {"feasible": "FEASIBLE:", "infeasible": "NOT FEASIBLE:", "unknown": "UNKNOWN:"}


def plan(*args: str) -> tuple[int, dict, str]:
    argv = [*ctxmgr_command(), "--state-dir", str(REPO / ".cache" / "verdict-state"), "plan", *args]
    as_json = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120)
    as_text = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert as_json.returncode == as_text.returncode
    return as_json.returncode, json.loads(as_json.stdout), as_text.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("100000", "--model", GLM5), "unknown"),  # no GPU, no NVML: no memory information
        (("200000", "--model", GLM5, *EIGHT), "unknown"),  # the GLM-5 config has no weights beside it
        (("300000", "--model", GLM5, *EIGHT, "--weights-bytes", "100GB"), "infeasible"),  # above 202,752
        (("200000", "--model", GLM5, *EIGHT, "--weights-bytes", "100GB"), "feasible"),
        (("131072", "--model", LLAMA, "--gpu-memory", "24GiB", "--gpu-count", "1"), "infeasible"),
        (("8192", "--model", LLAMA, "--gpu-memory", "80GiB", "--gpu-count", "4", "-tp", "4"), "feasible"),
    ],
)
def test_headline_result_feasible_verdict_and_exit_agree(args: tuple[str, ...], expected: str) -> None:
    code, data, text = plan(*args)
    assert data["result"] == data["verdict"] == expected, data
    assert data["feasible"] == {"feasible": True, "infeasible": False, "unknown": None}[expected]
    assert code == EXIT[expected]
    headlines = [line for line in text.splitlines() if line.startswith(tuple(HEADLINE.values()))]
    assert len(headlines) == 1 and headlines[0].startswith(HEADLINE[expected]), text
    assert "verdict: fits" not in text
