"""Running systemd's command-line tools: an environment meant for parsers, and killing what they fork."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any


def one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def tool_env() -> dict[str, str]:
    """No pager, no colours, no hyperlinks: output meant for a parser."""
    env = dict(os.environ)
    # SYSTEMD_LOG_COLOR: systemd-analyze's own log lines (247 colours them even into a pipe)
    env.update(SYSTEMD_PAGER="", SYSTEMD_COLORS="0", SYSTEMD_LOG_COLOR="0", SYSTEMD_URLIFY="0", PAGER="cat")
    return env


def kill_group(process: subprocess.Popen[Any]) -> None:
    """Kill the command and what it forked: the container launcher (enter.py) forks into the manager's
    PID namespace, and its child would go on running if the launcher alone were killed."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
