"""Running ctxmgr from a test, one way each: in process through click's CliRunner (the quick tier), or
as an operator does, a subprocess against the private systemd (tests/ctxmgr_cli.py's run_ctxmgr)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from click.testing import CliRunner, Result

from tests.ctxmgr_cli import Run, run_ctxmgr
from vllm_ctxmgr.cli.main import main

if TYPE_CHECKING:
    from tests.support.sandbox import Sandbox


def invoke(*args: str) -> Result:
    """ctxmgr's command line in this process, its stdout and stderr apart."""
    return CliRunner().invoke(main, list(args))


def run(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr)."""
    result = invoke(*args)
    return result.exit_code, result.stdout, result.stderr


def run_merged(*args: str) -> tuple[int, str]:
    """(exit code, stdout then stderr): for a check that the message is said at all, wherever."""
    result = invoke(*args)
    return result.exit_code, result.stdout + result.stderr


def run_stdout(*args: str) -> tuple[int, str]:
    """(exit code, stdout): for a check of what a script reading stdout gets."""
    result = invoke(*args)
    return result.exit_code, result.stdout


def ctxmgr(
    host: Sandbox | int, state: Path, *args: str, timeout: float = 120, unit_dir: str | None = None
) -> tuple[int, dict[str, Any], str]:
    """ctxmgr as a subprocess against `host`'s systemd (a Sandbox or its PID): (exit code, its --json
    object, stderr). `unit_dir` goes before the command's arguments as --unit-dir."""
    ran = _run(host, state, args, timeout, unit_dir)
    return ran.code, ran.data, ran.stderr


def ctxmgr_said(
    host: Sandbox | int, state: Path, *args: str, timeout: float = 120, unit_dir: str | None = None
) -> tuple[int, dict[str, Any], str]:
    """As ctxmgr, with stderr then stdout as the third: everything a person at the terminal reads."""
    ran = _run(host, state, args, timeout, unit_dir)
    return ran.code, ran.data, ran.stderr + ran.stdout


def _run(
    host: Sandbox | int, state: Path, args: tuple[str, ...], timeout: float, unit_dir: str | None
) -> Run:
    pid = host if isinstance(host, int) else host.pid
    before = ("--unit-dir", unit_dir) if unit_dir is not None else ()
    return run_ctxmgr(pid, state, *before, *args, timeout=timeout)
