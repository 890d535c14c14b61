"""One truthful verdict (issue 17 item 3): the headline, --json's `result`, `feasible` and `verdict`,
and the exit code of `ctxmgr plan` always say the same thing. Before, "FEASIBLE: no memory information"
exited 6, a context above the derived maximum printed "NOT FEASIBLE" and then "verdict: fits" (JSON
`verdict: "fits"` beside `feasible: false`), and unknown weights printed "FEASIBLE: fits" with exit 0."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.ctxmgr_cli import ctxmgr_command
from tests.support.paths import REPO

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


def test_alternatives_past_the_trained_length_say_what_they_need_and_what_limits_them() -> None:
    """Issue 35: Qwen3-32B at 65,536 (max_position_embeddings 40,960): the "[fits]" lines printed only
    flags, VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 only in JSON; the fp8 line named DeepSeek's fp8_ds_mla for a
    Qwen model; and a memory limit was called "the derived maximum"."""
    qwen = str(REPO / "examples" / "models" / "qwen3-32b")
    code, data, text = plan(
        "65536", "--model", qwen, "--gpu-memory", "80GiB", "--gpu-count", "1", "--weights-bytes", "61GiB"
    )
    assert code == 3 and data["derived_max_model_len"] == 40960
    lines = {alt["rank"]: line for alt in data["alternatives"] for line in text.splitlines()
             if line.lstrip().startswith(f"{alt['rank']}. [")}  # fmt: skip
    for alt in data["alternatives"]:
        for name, value in alt["env_changes"].items():
            assert f"Environment={name}={value}" in lines[alt["rank"]], lines[alt["rank"]]
    fp8 = next(alt for alt in data["alternatives"] if alt["name"] == "fp8-kv-cache")
    assert fp8["feasible"] and fp8["env_changes"] == {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    assert "fp8_ds_mla" not in text and "DeepSeek" not in text
    shorter = next(alt for alt in data["alternatives"] if alt["name"] == "shorter-context")
    assert shorter["max_context"] < 40960
    fits = shorter["max_context"]
    assert shorter["description"] == (
        f"the longest context that fits: {fits} tokens (memory; the derived maximum is 40960)"
    )
    assert "the derived maximum: " not in text
    # GLM-5 has DeepSeek sparse attention: there the fp8 line names fp8_ds_mla
    _, glm, _ = plan("200000", "--model", GLM5, *EIGHT, "--weights-bytes", "700GB")
    fp8 = next(alt for alt in glm["alternatives"] if alt["name"] == "fp8-kv-cache")
    assert "fp8_ds_mla for DeepSeek sparse attention" in fp8["description"]
    assert fp8["kv_cache_dtype"] == "fp8_ds_mla"
