"""Issue 28 item 3: a typo is answered with ctxmgr's own options first, then vLLM's, and every error
is one line (`ctxmgr: ...`), click's own usage errors included; an unknown --gpu-name is refused with
the GPUs ctxmgr knows."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run
from tests.support.paths import REPO

GLM5 = str(REPO / "examples" / "models" / "glm-5")


@pytest.mark.parametrize(
    ("typo", "answer"),
    [
        (["--gpu-memroy", "95.6GiB"], "did you mean --gpu-memory?"),
        (["--tp", "8"], "did you mean --tensor-parallel-size (-tp)?"),
        (["--weights-byte", "400GiB"], "did you mean --weights-bytes?"),
        (["--gpu-cuont", "8"], "did you mean --gpu-count?"),
        (
            ["--enforce-eagre"],
            "--enforce-eagre: not a vLLM flag nor an option of ctxmgr; did you mean --enforce-eager?",
        ),
    ],
)
def test_plan_answers_a_typo_with_its_own_option_first(typo: list[str], answer: str) -> None:
    code, out, err = run("plan", "1000", "--model", GLM5, *typo)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("ctxmgr: ") and answer in err, err


def test_a_misspelt_model_option_is_named_not_read_as_a_missing_model() -> None:
    code, _, err = run("plan", "1000", "--modle", GLM5)
    assert code == 2
    assert err == "ctxmgr: --modle: not a vLLM flag nor an option of ctxmgr; did you mean --model?\n"


@pytest.mark.parametrize(
    ("argv", "code", "answer"),
    [
        (["set-context", "1000", "--servcie", "x"], 2,
         "set-context: no such option --servcie; did you mean --service? (ctxmgr set-context --help)"),
        (["set-context", "1000", "x", "--gpu-memroy", "8GiB"], 2, "did you mean --gpu-memory?"),
        (["verify", "x", "--bogus"], 3, "ctxmgr: verify: no such option --bogus (ctxmgr verify --help)"),
        (["plna"], 2, "No such command 'plna'. Did you mean 'plan'?"),
        (["history", "x", "--json-out"], 2, "did you mean --json?"),
        (["plan", "--gpu-count", "many"], 2, "'many'"),
    ],
)  # fmt: skip
def test_clicks_usage_errors_are_one_line_too(argv: list[str], code: int, answer: str) -> None:
    got, out, err = run(*argv)
    assert got == code and out == ""
    assert err.count("\n") == 1 and err.startswith("ctxmgr: "), err
    assert "Usage:" not in err and answer in err, err


def test_a_usage_error_with_json_is_one_object_with_the_same_line() -> None:
    code, out, _ = run("set-context", "1000", "x", "--gpu-memroy", "8GiB", "--json")
    data = json.loads(out)
    assert code == 2 and data["result"] == "error" and data["exit_code"] == 2
    assert "did you mean --gpu-memory?" in data["error"]


def test_an_unknown_gpu_name_is_refused_with_the_known_ones() -> None:
    code, _, err = run("plan", "1000", "--model", GLM5, "--gpu-memory", "95GiB", "--gpu-name", "NVIDIA Z9000")
    assert code == 2 and err.count("\n") == 1
    assert "--gpu-name 'NVIDIA Z9000': not a GPU ctxmgr knows; known: " in err
    assert "H200" in err and "RTX PRO 6000 Blackwell" in err
    code, _, _ = run("plan", "1000", "--model", GLM5, "-tp", "8", "--gpu-memory", "95GiB", "--gpu-count", "8",
                     "--gpu-name", "NVIDIA H200", "--weights-bytes", "400GiB")  # fmt: skip
    assert code == 0
