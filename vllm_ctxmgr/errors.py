"""Exit codes and the expected failures that carry them; imports nothing of the project.

Expected failures are exceptions with a one-line message and the exit code the CLI returns (the
README's table is this file in prose). Anything else is a bug and keeps its traceback behind
--debug.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What every ctxmgr command but `verify` returns."""

    OK = 0  # success; plan feasible; nothing to do
    ERROR = 1  # a change that failed and was rolled back; systemd or I/O errors
    USAGE = 2  # bad arguments, unreadable model or unit, an unknown service
    INFEASIBLE = 3  # the target context does not fit (the plan names the largest that does)
    LOCKED = 4  # another ctxmgr run holds the service
    ROLLBACK_FAILED = 5  # a change failed and its rollback failed too: the service needs a human
    UNKNOWN = 6  # the plan cannot decide: no memory information (no NVML, no --gpu-memory), weights unknown
    INTERNAL = 70  # a bug (an unexpected exception, traceback behind --debug), every command's, verify's too


class VerifyExit(IntEnum):
    """`ctxmgr verify` speaks the monitoring-plugin convention, so a check runner reads it as is."""

    OK = 0
    DEGRADED = 1  # it serves, but something drifted (WARNING)
    FAILED = 2  # not active, or the probe fails (CRITICAL)
    UNKNOWN = 3  # the check could not run: bad arguments, unreadable unit (UNKNOWN)
    LOCKED = 4  # another ctxmgr run holds the service
    INTERNAL = ExitCode.INTERNAL  # a bug: no verdict (sysexits' EX_SOFTWARE; 1 would read "degraded")


# every exit code ctxmgr documents: what a node's answer may carry (anything else is not ctxmgr's)
DOCUMENTED_EXIT_CODES = frozenset(int(code) for code in (*ExitCode, *VerifyExit))


def documented_exit_code(value: object) -> int | None:
    """`value` where it is one of ctxmgr's exit codes, else None (a node answering 256 would exit 0)."""
    if isinstance(value, int) and not isinstance(value, bool) and value in DOCUMENTED_EXIT_CODES:
        return value
    return None


class CtxmgrError(Exception):
    """An expected failure: the CLI prints `message` on one line (or one JSON object), no traceback."""

    exit_code: int = ExitCode.ERROR

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def message(self) -> str:
        return " ".join(str(self).split("\n"))


class UsageError(CtxmgrError):
    """Bad input from the user: arguments, a model path, a unit file, a service that does not exist."""

    exit_code = ExitCode.USAGE


class UnsafePathError(UsageError):
    """A path ctxmgr will not trust (sshd's StrictModes): another user owns it or may write it, or it is
    a symbolic link where ctxmgr follows none. The message names the path and what to run."""


class ModelFactsError(UsageError):
    """A config.json or GGUF file that cannot be read or lacks what vLLM needs."""


class UnitError(UsageError):
    """A unit file that cannot be parsed or holds no vLLM command."""


class LockedError(CtxmgrError):
    """Another ctxmgr run holds the service's lock: waiting longer or later is the answer."""

    exit_code = ExitCode.LOCKED


class SystemdError(CtxmgrError):
    """systemctl, journalctl or systemd-analyze failed or did not answer."""

    exit_code = ExitCode.ERROR
