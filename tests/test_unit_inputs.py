"""What a unit's ExecStart may say (issue 29, round three): the sizes, the words the unit editor meets,
and the values that used to end in "unexpected error". A unit's flags are held to the bounds of the same
flags on ctxmgr's own command line, and every refusal is one line with exit 2."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from vllm_ctxmgr.cli.main import main

REPO = Path(__file__).resolve().parent.parent
MODEL = str(REPO / "examples" / "models" / "qwen3-32b")
OFFLINE = ("--gpu-memory", "80GiB", "--gpu-count", "1", "--gpu-name", "NVIDIA H100 80GB HBM3")


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout + result.stderr


def unit(directory: Path, flags: str) -> Path:
    path = directory / "vllm-x.service"
    path.write_text(f"[Service]\nExecStart=/opt/vllm/bin/vllm serve {MODEL} --max-model-len 8192 {flags}\n")
    return path


def refused_one_line(directory: Path, flags: str, match: str) -> str:
    code, out = run("plan", "8192", "--unit", str(unit(directory, flags)), *OFFLINE)
    assert code == 2, out
    assert "unexpected error" not in out and match in out, out
    assert len(out.strip().splitlines()) == 1, out
    return out


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (
            "--pipeline-parallel-size 100000000",
            "--pipeline-parallel-size '100000000': must be a whole number",
        ),
        ("-pp 0", "--pipeline-parallel-size '0': must be a whole number from 1 to 1024"),
        ("-tp 1025", "--tensor-parallel-size '1025'"),
        ("--data-parallel-size 100000000", "--data-parallel-size"),
        ("-dcp 99999", "--decode-context-parallel-size"),
        ("--max-num-seqs 0", "--max-num-seqs '0'"),
        ("--max-num-batched-tokens 99999999999", "--max-num-batched-tokens"),
        ("--num-gpu-blocks-override 1000000000000", "--num-gpu-blocks-override"),
        ("--block-size 7", "vLLM's block sizes are 1, 8 or a multiple of 16"),
        ("--max_model_len=99999999999999", "--max-model-len"),
        ("--kv-cache-memory-bytes -5", "--kv-cache-memory-bytes"),
    ],
)
def test_a_units_sizes_have_the_bounds_of_the_same_cli_flags(tmp_path: Path, flags: str, match: str) -> None:
    started = time.perf_counter()
    refused_one_line(tmp_path, flags, match)
    assert time.perf_counter() - started < 10  # -pp 100000000 took 26 s and 3 GiB


def test_the_cli_refuses_the_same_sizes(tmp_path: Path) -> None:
    code, out = run("plan", "8192", "--model", MODEL, *OFFLINE, "-pp", "100000000")
    assert code == 2 and "1<=x<=1024" in out.replace(" ", ""), out


def test_sizes_in_range_still_plan(tmp_path: Path) -> None:
    code, out = run(
        "plan", "8192", "--unit", str(unit(tmp_path, "--max-num-seqs 256 --block-size 16")), *OFFLINE
    )
    assert code == 0, out
