"""Expected failures carry a one-line message and the exit code the CLI returns.

Exit codes (documented in README.md):
  0 success / feasible / nothing to do
  1 other errors (I/O, systemd, a failed start that was rolled back)
  2 usage errors (bad input: arguments, files, units)
  3 infeasible plan (the target context does not fit)
  4 the service is locked by another ctxmgr run
  5 a change failed and the rollback failed too: the service needs a human
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INFEASIBLE = 3
EXIT_LOCKED = 4
EXIT_ROLLBACK_FAILED = 5


class CtxmgrError(Exception):
    """An expected failure: the CLI prints `message` on one line, no traceback."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def message(self) -> str:
        return " ".join(str(self).split("\n"))


class UsageError(CtxmgrError):
    """Bad input from the user: arguments, a model path, a unit file."""

    exit_code = EXIT_USAGE


class ModelFactsError(UsageError):
    """A config.json or GGUF file that cannot be read or lacks what vLLM needs."""


class UnitError(UsageError):
    """A unit file that cannot be parsed or holds no vLLM command."""


class LockedError(CtxmgrError):
    exit_code = EXIT_LOCKED


class SystemdError(CtxmgrError):
    exit_code = EXIT_ERROR
