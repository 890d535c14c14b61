"""What a unit's ExecStart may say (issue 29, round three): the sizes, the words the unit editor meets,
and the values that used to end in "unexpected error". A unit's flags are held to the bounds of the same
flags on ctxmgr's own command line, and every refusal is one line with exit 2."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.cli import run_merged
from tests.support.paths import REPO

MODEL = str(REPO / "examples" / "models" / "qwen3-32b")
OFFLINE = ("--gpu-memory", "80GiB", "--gpu-count", "1", "--gpu-name", "NVIDIA H100 80GB HBM3")


def unit(directory: Path, flags: str) -> Path:
    path = directory / "vllm-x.service"
    path.write_text(f"[Service]\nExecStart=/opt/vllm/bin/vllm serve {MODEL} --max-model-len 8192 {flags}\n")
    return path


def refused_one_line(directory: Path, flags: str, match: str) -> str:
    code, out = run_merged("plan", "8192", "--unit", str(unit(directory, flags)), *OFFLINE)
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
    code, out = run_merged("plan", "8192", "--model", MODEL, *OFFLINE, "-pp", "100000000")
    assert code == 2 and "1<=x<=1024" in out.replace(" ", ""), out


def test_sizes_in_range_still_plan(tmp_path: Path) -> None:
    code, out = run_merged(
        "plan", "8192", "--unit", str(unit(tmp_path, "--max-num-seqs 256 --block-size 16")), *OFFLINE
    )
    assert code == 0, out


# ---- item 9: the unit editor reads the words as vLLM's argparse does ---------------------------


def edited(line: str, changes: dict[str, str | None] | None = None) -> str:
    from vllm_ctxmgr.systemd.unit_edit import edit_unit
    from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile

    text = f"[Service]\nExecStart=/opt/vllm/bin/vllm serve {line}\n"
    unit = ServiceUnit("vllm-x.service", (UnitFile.parse("/etc/systemd/system/vllm-x.service", text),))
    new = edit_unit(unit, changes or {"--max-model-len": "16384"}).new_text
    return new.splitlines()[1].removeprefix("ExecStart=/opt/vllm/bin/vllm serve ")


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("/m --max-model-len --enforce-eager", "argument --max-model-len: expected one argument"),
        ("/m --enforce-eager --max-model-len", "argument --max-model-len: expected one argument"),
        ("/m --max-model-len -- 2048", "argument --max-model-len: expected one argument"),
    ],
)
def test_the_editor_refuses_a_flag_left_without_its_value(line: str, match: str) -> None:
    from vllm_ctxmgr.errors import UnitError

    with pytest.raises(UnitError, match=match):
        edited(line)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("/m --max-model-len -1 --enforce-eager", "/m --max-model-len 16384 --enforce-eager"),
        ("--enforce-eager -- /m", "--enforce-eager --max-model-len 16384 -- /m"),
        ("--max-model-len 5 -- /m", "--max-model-len 16384 -- /m"),
        ("/m --enforce-eager", "/m --enforce-eager --max-model-len 16384"),
        # words after `--` are positionals, never flags: kept, and the plan refuses them (below)
        ("/m -- --max-model-len 2048", "/m --max-model-len 16384 -- --max-model-len 2048"),
        (
            "/m --max-model-len 1024 -- --max-model-len 2048",
            "/m --max-model-len 16384 -- --max-model-len 2048",
        ),
    ],
)
def test_the_editor_never_drops_a_word(line: str, expected: str) -> None:
    assert edited(line) == expected


def test_the_plan_refuses_a_flag_with_no_value(tmp_path: Path) -> None:
    # the plan had counted eager mode while --max-model-len took --enforce-eager as its value
    refused_one_line(
        tmp_path, "--max-num-seqs --enforce-eager", "argument --max-num-seqs: expected one argument"
    )
    refused_one_line(tmp_path, "-- --max-model-len 2048", "unrecognized arguments: --max-model-len 2048")


def test_the_plan_refuses_a_word_no_flag_takes_as_argparse_does(tmp_path: Path) -> None:
    # a switch takes no value: 1024 is a second positional, which `vllm serve` refuses
    refused_one_line(tmp_path, "--enforce-eager 1024", "unrecognized arguments: 1024")


def test_the_editor_leaves_what_an_environment_variable_may_hold_to_the_plan() -> None:
    assert (
        edited("${MODEL} $VLLM_ARGS --enforce-eager")
        == "${MODEL} $VLLM_ARGS --enforce-eager --max-model-len 16384"
    )
