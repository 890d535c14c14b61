"""The automation contract and validation at the door, as a script (Ansible, a monitoring check) meets it.

Each case is a finding of issue 8 (contract) or issue 9 (hostile values, names): every command with
--json prints exactly one JSON object on stdout, errors included; bad values are one line and exit 2
(verify: 3, UNKNOWN); never a traceback, a hang or a plan from garbage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.cli import run
from tests.support.paths import REPO
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.cli.output import SCHEMA_VERSION
from vllm_ctxmgr.errors import ExitCode, UsageError, VerifyExit
from vllm_ctxmgr.systemd.names import unit_name

GLM5 = str(REPO / "examples" / "models" / "glm-5")
LLAMA70B = str(REPO / "examples" / "models" / "llama-3.1-70b")
OFFLINE = ("-tp", "8", "--gpu-memory", "95.6GiB", "--gpu-count", "8", "--weights-bytes", "406.7GiB")


def one_json_object(stdout: str) -> dict:
    data = json.loads(stdout)  # exactly one object: json.loads refuses trailing text
    assert isinstance(data, dict)
    assert data["schema"] == SCHEMA_VERSION
    return data


# ---- one JSON object, errors included ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("plan", "0", "--model", GLM5, "--json"), ExitCode.USAGE),  # click's own usage error
        (("plan", "1000", "--model", "/nonexistent/model", "--json"), ExitCode.USAGE),  # ours
        (("plan", "1000", "--json"), ExitCode.USAGE),  # no --model / --unit / --service
        (("--state-dir", "", "history", "--service", "x", "--json"), ExitCode.USAGE),  # the group's option
        (("verify", "--service", "a/b", "--json"), VerifyExit.UNKNOWN),  # verify: usage is UNKNOWN
    ],
)
def test_errors_under_json_are_one_object_on_stdout_with_the_exit_code(
    args: tuple[str, ...], code: int
) -> None:
    exit_code, out, err = run(*args)
    assert exit_code == code
    data = one_json_object(out)
    assert data["exit_code"] == code and data["result"] == "error" and data["changed"] is False
    assert data["error"] and "\n" not in data["error"]
    assert "Traceback" not in out + err


def test_errors_without_json_are_one_line_on_stderr_and_nothing_on_stdout() -> None:
    code, out, err = run("plan", "1000", "--model", "/nonexistent/model")
    assert code == ExitCode.USAGE
    assert out == ""
    assert err.startswith("ctxmgr: ") and err.count("\n") == 1


def test_every_json_object_says_its_command_result_and_changed() -> None:
    code, out, _ = run("plan", "200000", "--model", GLM5, *OFFLINE, "--json")
    data = one_json_object(out)
    assert code == 0
    assert (data["command"], data["result"], data["changed"], data["feasible"]) == (
        "plan",
        "feasible",
        False,
        True,
    )
    code, out, _ = run("facts", GLM5, "--json")
    data = one_json_object(out)
    assert (data["command"], data["result"], data["changed"]) == ("facts", "ok", False)


def test_a_plan_without_memory_information_is_unknown_not_feasible() -> None:
    """Before: "FEASIBLE: no memory information", exit 0, so a script gating on it went ahead."""
    code, out, _ = run("plan", "8192", "--model", LLAMA70B, "-tp", "4", "--json")
    data = one_json_object(out)
    assert code == ExitCode.UNKNOWN
    assert data["result"] == "unknown" and data["feasible"] is None


def test_an_infeasible_plan_exits_3_with_the_largest_context_that_fits() -> None:
    # 64 GiB: room for some context beside 50.8 GiB of weights per GPU, not for 200,000 tokens
    code, out, _ = run("plan", "200000", "--model", GLM5, *OFFLINE[:-4], "--gpu-memory", "64GiB",
                       "--gpu-count", "8", "--weights-bytes", "406.7GiB", "--json")  # fmt: skip
    data = one_json_object(out)
    assert code == ExitCode.INFEASIBLE
    assert data["result"] == "infeasible" and data["feasible"] is False
    assert 0 < data["max_context"] < 200000


# ---- flags as vLLM spells them -----------------------------------------------------------------


def test_max_model_len_is_accepted_beside_the_positional_and_must_agree() -> None:
    code, out, _ = run("plan", "--max-model-len", "32k", "--model", GLM5, *OFFLINE, "--json")
    assert code == 0 and one_json_object(out)["max_model_len"] == 32000
    code, out, err = run("plan", "32000", "--max-model-len", "32768", "--model", GLM5, *OFFLINE)
    assert code == ExitCode.USAGE and "disagree" in err


def test_k_is_binary_and_lowercase_k_is_decimal_as_vllm_reads_them() -> None:
    _, lower, _ = run("plan", "128k", "--model", GLM5, *OFFLINE, "--json")
    _, upper, _ = run("plan", "128K", "--model", GLM5, *OFFLINE, "--json")
    assert one_json_object(lower)["max_model_len"] == 128_000
    assert one_json_object(upper)["max_model_len"] == 131_072


def test_auto_plans_the_largest_context_that_fits() -> None:
    _, out, _ = run("plan", "200000", "--model", GLM5, *OFFLINE, "--json")
    largest = one_json_object(out)["max_context"]
    code, out, _ = run("plan", "auto", "--model", GLM5, *OFFLINE, "--json")
    data = one_json_object(out)
    assert code == 0 and data["max_model_len"] == largest and data["feasible"] is True
    code, out, _ = run("plan", "-1", "--model", GLM5, *OFFLINE, "--json")
    assert code == 0 and one_json_object(out)["max_model_len"] == largest


def test_kv_cache_memory_bytes_is_parsed_as_vllm_parses_it() -> None:
    """Before: 20g meant 20 GiB to ctxmgr's command line but 20,000,000,000 to vLLM."""
    _, decimal, _ = run(
        "plan", "8192", "--model", LLAMA70B, "-tp", "4", "--kv-cache-memory-bytes", "20g", "--json"
    )
    _, binary, _ = run(
        "plan", "8192", "--model", LLAMA70B, "-tp", "4", "--kv-cache-memory-bytes", "20G", "--json"
    )
    assert one_json_object(decimal)["kv_cache_memory_bytes"] == 20_000_000_000
    assert one_json_object(binary)["kv_cache_memory_bytes"] == 20 * (1 << 30)


def test_any_vllm_flag_a_unit_can_hold_is_accepted_and_a_typo_is_refused() -> None:
    code, out, _ = run("plan", "8192", "--model", LLAMA70B, "-tp", "4", "--kv-cache-memory-bytes", "20G",
                       "--enforce-eager", "--dtype", "float16", "--json")  # fmt: skip
    assert code == 0, out
    code, _, err = run("plan", "8192", "--model", LLAMA70B, "--enforce-eagr")
    assert code == ExitCode.USAGE and "--enforce-eagr" in err


def test_data_parallel_is_accepted_on_the_command_line() -> None:
    code, out, _ = run("plan", "8192", "--model", LLAMA70B, "-tp", "4", "-dp", "2", "--gpu-memory", "80GiB",
                       "--gpu-count", "8", "--json")  # fmt: skip
    assert code == 0, out
    # -dp 2 over 8 GPUs at TP 4: two engines, each its own KV pool, as vLLM logs one line per engine
    assert [engine["gpus"] for engine in one_json_object(out)["capacity"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]


# ---- hostile values (issue 9, item 8) ----------------------------------------------------------


HOSTILE = [
    ("plan", "8192", "--model", GLM5, "--gpu-memory-utilization", "nan"),
    ("plan", "8192", "--model", GLM5, "--gpu-memory-utilization", "inf"),
    ("plan", "8192", "--model", GLM5, "--gpu-memory-utilization", "0"),
    ("plan", "8192", "--model", GLM5, "--max-gpu-memory-utilization", "nan"),
    ("plan", "8192", "--model", GLM5, "--gpu-count", "1000000000", "--gpu-memory", "80GiB"),
    ("plan", "8192", "--model", GLM5, "--block-size", "0"),
    ("plan", "8192", "--model", GLM5, "--block-size", "-1"),
    ("plan", "8192", "--model", GLM5, "--block-size", "7"),
    ("plan", "8192", "--model", GLM5, "--kv-cache-memory-bytes", "0"),
    ("plan", "8192", "--model", GLM5, "--max-num-seqs", "0"),
    ("plan", "8192", "--model", GLM5, "--max-num-seqs", "-1"),
    ("plan", "8192", "--model", GLM5, "--weights-bytes", "-1"),
    ("plan", "8192", "--model", GLM5, "--vllm-version", "abc"),
    ("plan", "8192", "--model", GLM5, "-tp", "0"),
    ("plan", "99999999999999", "--model", GLM5),
    ("facts", GLM5, "--vllm-version", "abc"),
    ("set-context", "8192", "--service", "x", "--timeout", "0"),
    ("set-context", "8192", "--service", "x", "--timeout", "-1"),
    ("set-context", "8192", "--service", "x", "--wait-lock", "nan"),
    ("set-context", "8192", "--service", "x", "--wait-lock", "inf"),
    ("set-context", "8192", "--service", "x", "--probe-tokens", "-5"),
    ("set-context", "8192", "--service", "x", "--probe-tokens", "0"),
    ("set-context", "8192", "--service", "x" * 10_000),
    ("set-context", "8192", "--service", ".."),
    ("set-context", "8192", "--service", "."),
    ("set-context", "8192", "--service", "...service"),
    ("set-context", "8192", "--service", "../../etc/passwd"),
    ("set-context", "8192", "--service", "vllm@.service"),
    ("set-context", "8192", "--service", "vllm.timer"),
    ("rollback", "--service", "x", "--to", "-1"),
    ("--state-dir", "", "history", "--service", "x"),
    ("--state-dir", "/dev/null", "history", "--service", "x"),
]


@pytest.mark.parametrize("args", HOSTILE, ids=lambda a: " ".join(a)[:60])
def test_a_hostile_value_is_one_line_and_exit_2_before_anything_is_touched(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    full = args if args[0] == "--state-dir" else ("--state-dir", str(state), *args)
    code, out, err = run(*full)
    assert code == ExitCode.USAGE, (out, err)
    assert err.startswith(("ctxmgr: ", "Usage:", "Error:")) and "Traceback" not in err
    assert not state.exists(), "nothing is written for a refused command"


def test_a_state_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("")
    code, _, err = run("--state-dir", str(afile), "history", "--service", "x")
    assert code == ExitCode.USAGE and "not a directory" in err


# ---- unit names by systemd's rules (issue 9, item 1) ------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("vllm-glm5", "vllm-glm5.service"),
        ("vllm-glm5.service", "vllm-glm5.service"),
        ("vllm@gpu0", "vllm@gpu0.service"),
        ("a:b_c.d\\x2d", "a:b_c.d\\x2d.service"),
    ],
)
def test_service_names_are_completed_and_kept(given: str, expected: str) -> None:
    assert unit_name(given) == expected


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        "...service",
        ".service",
        "a/b",
        "a b",
        "ü",
        "x" * 256,
        "@x",
        "vllm@.service",
        "vllm.timer",
        "a\x00b",
    ],
)
def test_names_systemd_would_refuse_or_that_would_be_a_path_are_refused(name: str) -> None:
    with pytest.raises(UsageError, match=r"unit name|service name|\.service units|dots|template unit"):
        unit_name(name)


def test_nan_is_refused_as_not_finite() -> None:
    """A plain FloatRange lets nan through: every comparison with nan is false."""
    code, _, err = run("plan", "8192", "--model", GLM5, "--gpu-memory-utilization", "nan")
    assert code == ExitCode.USAGE and "finite" in err


# ---- fuzz: any value of any plan option (issue 9: exit 0, 2, 3 or 6 only; never unhandled) --------

VALUE = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "auto", "-1", "0", "1e30", "20g", "20G", "7", "nan", "inf", "1.5", "abc", "--json"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
)
OPTIONS = ["--gpu-memory-utilization", "--block-size", "--max-num-seqs", "--max-num-batched-tokens",
           "--kv-cache-memory-bytes", "--gpu-memory", "--gpu-count", "--weights-bytes", "--vllm-version",
           "-tp", "-pp", "-dcp", "--kv-cache-dtype", "--max-gpu-memory-utilization", "--concurrency",
           "--max-model-len"]  # fmt: skip


@settings(max_examples=150, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(context=VALUE, picks=st.lists(st.tuples(st.sampled_from(OPTIONS), VALUE), max_size=4))
def test_any_plan_values_give_a_verdict_or_a_one_line_error(
    context: str, picks: list[tuple[str, str]]
) -> None:
    args = ["plan", context, "--model", LLAMA70B]
    for option, value in picks:
        args += [option, value]
    code, out, err = run(*args)
    assert code in (0, 2, 3, 6), (args, code, out, err)
    assert "unexpected error" not in out + err and "Traceback" not in out + err


def test_a_gpu_far_smaller_than_the_weights_draws_a_full_bar_not_a_gigabyte_one() -> None:
    """Found by the fuzz test above: `--gpu-memory 1B` scaled the memory bar to 1 byte (MemoryError)."""
    code, out, err = run("plan", "1", "--model", LLAMA70B, "--gpu-memory", "1B", "--weights-bytes", "1GiB")
    assert code == ExitCode.INFEASIBLE, err
    assert max(len(line) for line in out.splitlines()) < 300


# ---- a crash has an exit code of its own (issue 29, item 7) -----------------------------------------
# A bug in ctxmgr exited 1, which `verify` means as "degraded" (monitoring: WARNING, the collection: a
# pass). The bug is planted here (no input is known to crash today): what is checked is the door.


def crash(*_: object, **__: object) -> None:
    raise ZeroDivisionError("a planted bug")


def test_an_unexpected_error_exits_70_which_no_verdict_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_ctxmgr.cli.facts as cli_facts
    import vllm_ctxmgr.cli.ops as cli_ops

    monkeypatch.setattr(cli_ops, "systemd_for", crash)
    monkeypatch.setattr(cli_facts, "load_model_facts", crash)
    verdicts = {int(code) for code in (*ExitCode, *VerifyExit)} - {ExitCode.INTERNAL}
    assert ExitCode.INTERNAL == VerifyExit.INTERNAL == 70 and 70 not in verdicts
    for args in (("verify", "--service", "vllm-x"), ("facts", GLM5)):
        code, out, err = run(*args)
        assert code == 70, (args, code, out, err)
        assert "unexpected error: ZeroDivisionError: a planted bug (run with --debug)" in err
        code, out, _ = run(*args, "--json")
        data = one_json_object(out)
        assert code == data["exit_code"] == 70 and data["result"] == "error"


def test_a_crash_in_the_groups_own_options_exits_70_too(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_ctxmgr.cli.main as cli_main

    monkeypatch.setattr(cli_main, "check_state_dir", crash)
    result = CliRunner().invoke(main, ["--state-dir", "/x", "history", "--service", "vllm-x", "--json"])
    assert result.exit_code == 70, result.output
    assert one_json_object(result.stdout)["exit_code"] == 70


def test_exit_70_is_documented_where_exit_codes_are() -> None:
    readme = (REPO / "README.md").read_text()
    assert "| 70 | ctxmgr crashed" in readme
    _, out, _ = run("--help")
    assert "70 ctxmgr crashed" in out
    _, out, _ = run("verify", "--help")
    assert "70 ctxmgr crashed" in out
