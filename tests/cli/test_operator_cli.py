"""The command line as an SRE meets it first (issue 17): sizes in one grammar, the unit as an argument,
vLLM's own flag spellings, systemd time spans, help with examples, a shipped unit planned against a
local model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.ctxmgr_cli import ctxmgr_command, run_ctxmgr
from tests.support.paths import REPO
from tests.support.sandbox import Sandbox
from vllm_ctxmgr.core.serve_args import parse_serve_argv, parse_size
from vllm_ctxmgr.errors import UsageError

LLAMA70B = str(REPO / "examples" / "models" / "llama-3.1-70b")
UNITS = REPO / "units"
GIB = 1 << 30
OFFLINE_70B = ("--gpu-memory", "80GiB", "--gpu-count", "4", "--weights-bytes", "131.5GiB")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The console script (or this checkout's package) as a user runs it."""
    return subprocess.run([*ctxmgr_command(), *args], capture_output=True, text=True, timeout=120)


# ---- 4: sizes -------------------------------------------------------------------------------------


def test_a_bare_number_for_a_gpu_size_is_a_usage_error_that_names_the_unit_to_add() -> None:
    done = cli("plan", "8192", "--model", LLAMA70B, "-tp", "4", "--gpu-memory", "24", "--gpu-count", "4")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "24GiB" in done.stderr and "24GB" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    done = cli("plan", "8192", "--model", LLAMA70B, "--weights-bytes", "140")
    assert done.returncode == 2 and "140GiB" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20g", 20 * 10**9),  # vLLM's human_readable_int: lower case is decimal
        ("20G", 20 * GIB),  # upper case is binary
        ("20GiB", 20 * GIB),
        ("20GB", 20 * 10**9),
        ("81920MiB", 80 * GIB),
        ("95.6GiB", int(95.6 * GIB)),
        ("25.6k", 25_600),
        ("1048576", 1_048_576),  # a bare number is bytes where vLLM reads it so
    ],
)
def test_one_size_grammar_reads_vllms_letters_as_vllm_does(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_a_decimal_with_a_binary_letter_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(UsageError, match="decimals are not allowed with binary suffixes like G"):
        parse_size("95.6G")


def test_g_means_the_same_in_gpu_memory_and_kv_cache_memory_bytes() -> None:
    """`g` was GiB in --gpu-memory and 10^9 in --kv-cache-memory-bytes: now 10^9 in both, as vLLM."""
    small = cli("plan", "8192", "--model", LLAMA70B, "-tp", "4", "--gpu-memory", "80g", "--gpu-count", "4",
                "--weights-bytes", "131.5GiB", "--json")  # fmt: skip
    big = cli("plan", "8192", "--model", LLAMA70B, "-tp", "4", "--gpu-memory", "80G", "--gpu-count", "4",
              "--weights-bytes", "131.5GiB", "--json")  # fmt: skip
    assert small.returncode == 0 and big.returncode == 0, small.stderr + big.stderr
    totals = [json.loads(d.stdout)["gpus"][0]["total"]["bytes"] for d in (small, big)]
    assert totals == [80 * 10**9, 80 * GIB]


def test_kv_cache_memory_bytes_takes_gib_as_it_takes_gb() -> None:
    for text, expected in (("20GiB", 20 * GIB), ("20GB", 20 * 10**9), ("20g", 20 * 10**9)):
        done = cli("plan", "8192", "--model", LLAMA70B, *OFFLINE_70B, "-tp", "4",
                   "--kv-cache-memory-bytes", text, "--json")  # fmt: skip
        assert done.returncode in (0, 3), done.stderr
        assert json.loads(done.stdout)["kv_cache_memory_bytes"] == expected, text


# ---- 6: vLLM's own flag forms -----------------------------------------------------------------------


def test_underscored_vllm_flags_are_read_from_a_shipped_unit_and_from_the_command_line() -> None:
    """`--max_model_len` (vLLM's argparse takes underscores): units/vllm-llama70b.service uses it."""
    args = parse_serve_argv(["--model", "m", "--max_model_len", "64k", "--gpu_memory_utilization", "0.9"])
    assert (args.max_model_len, args.gpu_memory_utilization) == (64_000, 0.9)
    done = cli("plan", "--model", LLAMA70B, *OFFLINE_70B, "-tp", "4", "--max_model_len", "64k", "--json")
    assert done.returncode in (0, 3), done.stderr
    assert json.loads(done.stdout)["max_model_len"] == 64_000


def test_a_kv_cache_dtype_vllm_does_not_have_names_vllms_choices() -> None:
    done = cli("plan", "8192", "--model", LLAMA70B, *OFFLINE_70B, "-tp", "4", "--kv-cache-dtype", "fp9")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "vLLM 0.33.0 has no such kv-cache dtype: fp9 (choices: auto, " in done.stderr, done.stderr
    assert "fp8_e5m2" in done.stderr and "not modelled" not in done.stderr


@pytest.mark.parametrize("command", ["set-context", "rollback", "recover", "verify"])
def test_timeout_takes_a_systemd_time_span_as_every_does(command: str) -> None:
    """--timeout 10min was refused while --every 15min was accepted; a bad span is still refused."""
    first = ["8192"] if command == "set-context" else []
    args = [command, *first, "no-such-svc-xyz", "--timeout"]
    good, bad = cli(*args, "10min", "--json"), cli(*args, "10 fortnights", "--json")
    assert "10min" not in good.stdout + good.stderr, good.stdout + good.stderr  # parsed, not refused
    assert "time span" in bad.stdout + bad.stderr, bad.stdout + bad.stderr


# ---- 5: the unit as an argument, help, completion ---------------------------------------------------


def test_a_bare_ctxmgr_prints_its_help_and_exits_0() -> None:
    done = cli()
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout and "set-context" in done.stdout


COMMANDS = ["facts", "gpus", "plan", "set-context", "rollback", "recover", "history", "observe", "verify",
            "schedule", "unschedule", "status", "deployment", "deployment plan", "deployment set-context",
            "deployment rollback", "deployment recover", "deployment verify"]  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_examples_in_its_help(command: str) -> None:
    done = cli(*command.split(), "--help")
    assert done.returncode == 0, done.stderr
    assert "Examples:" in done.stdout, done.stdout
    example_lines = done.stdout.split("Examples:", 1)[1]
    assert f"ctxmgr {command}" in example_lines


def test_a_service_given_twice_differently_is_a_usage_error() -> None:
    done = cli("history", "vllm-a", "--service", "vllm-b", "--json")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "vllm-a" in json.loads(done.stdout)["error"] and "vllm-b" in json.loads(done.stdout)["error"]
    done = cli("history")
    assert done.returncode == 2 and "ctxmgr status" in done.stderr, done.stderr


def test_the_unit_as_an_argument_and_completion_of_vllm_services(  # type: ignore[no-untyped-def]
    sandbox: Sandbox, install_unit, workdir: Path
) -> None:
    text = (UNITS / "vllm-llama70b.service").read_text()
    install_unit("vllm-opargs.service", text)
    install_unit("not-vllm-opargs.service", "[Service]\nExecStart=/bin/sleep 600\n")
    state = workdir / "state"

    by_arg = run_ctxmgr(sandbox.pid, state, "history", "vllm-opargs", "--json")
    by_option = run_ctxmgr(sandbox.pid, state, "history", "--service", "vllm-opargs", "--json")
    assert by_arg.code == 0 and by_option.code == 0, by_arg.stdout + by_arg.stderr
    assert by_arg.data == by_option.data
    same = run_ctxmgr(sandbox.pid, state, "history", "vllm-opargs", "--service", "vllm-opargs.service")
    assert same.code == 0, same.stderr

    unknown = run_ctxmgr(sandbox.pid, state, "verify", "vllm-nosuch")
    assert unknown.code == 3, unknown.stderr
    assert "ctxmgr status" in unknown.stderr and "systemctl list-units" in unknown.stderr

    env = {
        "_CTXMGR_COMPLETE": "bash_complete",
        "COMP_WORDS": f"ctxmgr --systemd-pid {sandbox.pid} history vllm-op",
        "COMP_CWORD": "4",
        "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
    }
    done = subprocess.run([*ctxmgr_command()], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "plain,vllm-opargs" in done.stdout.splitlines(), done.stdout
    assert "not-vllm-opargs" not in done.stdout


# ---- 7: a shipped unit against a local model ----------------------------------------------------------


def test_plan_a_shipped_unit_against_a_local_copy_of_the_model() -> None:
    """Every units/*.service names a model path absent on a fresh clone: --model overrides it."""
    done = cli("plan", "--unit", str(UNITS / "vllm-llama70b.service"), "--model", LLAMA70B,
               "--gpu-memory", "80GiB", "--gpu-count", "4", "--json")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    # the unit's own flags are kept: --max_model_len=32768 (no CONTEXT: the unit's), -tp 4, fp8 KV:
    # 80 layers x 8 KV heads x 128 x (K, V) x 1 byte / 4 ranks
    assert data["max_model_len"] == 32768
    assert data["kv_bytes_per_token_per_gpu"] == 80 * 8 * 128 * 2 // 4
