"""The parts of the CLI a service's change and a deployment's share: one question before a restart, one
end (text or one JSON object, the exit code, a dry run's `changed`)."""

from __future__ import annotations

import io
import json

import pytest

from vllm_ctxmgr.change.states import ChangeResult, Result
from vllm_ctxmgr.cli.confirm import confirmation
from vllm_ctxmgr.cli.deployment import _confirmation, _finish
from vllm_ctxmgr.cli.finish import finish
from vllm_ctxmgr.deployment.coordinator import DeploymentResult, NodeOutcome
from vllm_ctxmgr.errors import ExitCode, UsageError


def deployment_result(result: Result, exit_code: int = ExitCode.OK) -> DeploymentResult:
    node = NodeOutcome("gpu-a", "vllm-glm5.service", "head", 0, diff="-A\n+B\n")
    return DeploymentResult(
        "glm5", "set-context", result, True, exit_code, max_model_len=200000, previous_max_model_len=131072,
        nodes=[node],
    )  # fmt: skip


def service_result(result: Result) -> ChangeResult:
    return ChangeResult(
        "vllm-glm5.service", "set-context", result, True, max_model_len=200000, diff="-A\n+B\n"
    )


def test_without_a_terminal_both_confirmations_show_the_change_and_refuse_with_the_same_words(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO())  # not a terminal
    service_ask = confirmation(False, False, "vllm-glm5.service")
    assert service_ask is not None
    asks = [
        (lambda: service_ask(service_result(Result.PLANNED)), "restart vllm-glm5.service with"),
        (lambda: _confirmation(False)(deployment_result(Result.PLANNED)), "restart every node of glm5 with"),
    ]
    for ask, question in asks:
        with pytest.raises(UsageError) as refused:
            ask()
        assert refused.value.message == (
            f"{question} max_model_len 200000: not a terminal, so nothing was changed; pass --yes to "
            "apply without a prompt"
        )
        shown = capsys.readouterr()
        assert "+B" in shown.err and shown.out == ""  # the diff was on the screen before the question


def test_under_json_the_deployments_question_shows_no_text(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO())
    with pytest.raises(UsageError):
        _confirmation(True)(deployment_result(Result.PLANNED))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("result", "changed"), [(Result.DRY_RUN, True), (Result.UNCHANGED, False)])
def test_a_dry_run_of_a_service_or_a_deployment_says_would_change_in_changed(
    capsys: pytest.CaptureFixture[str], result: Result, changed: bool
) -> None:
    for end, command in (
        (lambda: finish(service_result(result), True, dry_run=True), "set-context"),
        (lambda: _finish(deployment_result(result), True, dry_run=True), "deployment set-context"),
    ):
        with pytest.raises(SystemExit) as exited:
            end()
        assert exited.value.code == ExitCode.OK
        data = json.loads(capsys.readouterr().out)
        assert (data["command"], data["dry_run"], data["changed"]) == (command, True, changed)


def test_a_deployment_ends_with_its_exit_code_and_its_report(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _finish(deployment_result(Result.ROLLED_BACK, ExitCode.ERROR), False)
    assert exited.value.code == ExitCode.ERROR
    out = capsys.readouterr().out
    assert out.startswith("glm5: set-context rolled-back (max_model_len 131072 -> 200000)")
    assert "--- node 0 (gpu-a):" in out
