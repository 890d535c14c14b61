"""Running ctxmgr as an operator does: a subprocess against the private systemd, with --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def ctxmgr_command() -> list[str]:
    """The ctxmgr under test: the installed wheel's console script where CTXMGR_BIN names it (make test
    and CI), else this checkout's package."""
    binary = os.environ.get("CTXMGR_BIN")
    return [binary] if binary else [sys.executable, "-m", "vllm_ctxmgr"]


def ctxmgr_argv(pid: int, state: Path, *args: str) -> list[str]:
    return [*ctxmgr_command(), "--systemd-pid", str(pid), "--state-dir", str(state), *args]


@dataclass(frozen=True)
class Run:
    code: int
    data: dict[str, Any]  # the --json object, {} when stdout held none
    stdout: str
    stderr: str


def run_ctxmgr(pid: int, state: Path, *args: str, timeout: float = 600) -> Run:
    proc = subprocess.run(ctxmgr_argv(pid, state, *args), capture_output=True, text=True, timeout=timeout)
    data = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    return Run(proc.returncode, data, proc.stdout, proc.stderr)


def crashing_argv(pid: int, state: Path, crash_at: str, *args: str) -> list[str]:
    """ctxmgr_argv, run so that it dies (os._exit(137)) right after step `crash_at` is recorded
    (tests/support/crash_run.py), with the same interpreter and package as ctxmgr_command()."""
    binary = os.environ.get("CTXMGR_BIN")
    python = str(Path(binary).parent / "python") if binary else sys.executable
    runner = Path(__file__).resolve().parent / "support" / "crash_run.py"
    return [python, str(runner), crash_at, "--systemd-pid", str(pid), "--state-dir", str(state), *args]
