"""What a command prints and how it ends: text or one JSON object, an expected failure as one line
(or one JSON object) with its documented exit code."""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Mapping
from typing import NoReturn, ParamSpec, TypedDict, TypeVar

import click

from vllm_ctxmgr.errors import CtxmgrError, ExitCode, VerifyExit
from vllm_ctxmgr.masking import scrub

SCHEMA_VERSION = 2  # of every --json object; a field's meaning never changes without a new version
# 2: plan's `verdict` is its `result` (feasible | infeasible | unknown); the memory text is `memory`


# C0 controls but tab and newline, DEL, and C1: what a node's answer, a journal line or a unit may
# carry to move the cursor, recolour or rewrite the line above ("all nodes OK" printed over an error)
# (a whole escape sequence first, so no "[2K" is left behind: CSI, OSC to its terminator, ESC + one)
_CONTROLS = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?|[\x00-\x08\x0b-\x1f\x7f-\x9f]"
)


def printable(text: str) -> str:
    """`text` without terminal controls: ctxmgr itself prints none (LiveStatus draws its own line)."""
    return _CONTROLS.sub("", text)


def echo(message: object = "", err: bool = False) -> None:
    """The door every text leaves by (stdout and stderr): every key of every service read is masked
    here, whichever message quotes it (masking.scrub), and every terminal control is taken out, so what
    a node, a journal or a unit says cannot drive the operator's terminal (printable). JSON escapes its
    own controls (\u001b), so it passes unchanged."""
    click.echo(printable(scrub(str(message))), err=err)


def emit_json(data: Mapping[str, object]) -> None:
    """The one JSON object a command prints with --json: `schema` first, then the command's fields."""
    echo(json.dumps({"schema": SCHEMA_VERSION, **data}, indent=2, sort_keys=False, default=str))


def usage_exit(command: str | None) -> int:
    """verify speaks the monitoring-plugin convention: a check that could not run is UNKNOWN (3)."""
    return VerifyExit.UNKNOWN if command == "verify" else ExitCode.USAGE


class ErrorObject(TypedDict):
    """The one JSON object of a command that failed (before `schema` is added)."""

    command: str | None
    result: str  # error | locked
    changed: bool
    error: str
    exit_code: int


def error_object(command: str | None, message: str, exit_code: int) -> ErrorObject:
    result = "locked" if command != "verify" and exit_code == ExitCode.LOCKED else "error"
    return {"command": command, "result": result, "changed": False, "error": message, "exit_code": exit_code}


def fail(message: str, exit_code: int, *, as_json: bool, command: str | None) -> NoReturn:
    """Print an expected failure as the caller asked (one line on stderr, or one JSON object) and exit."""
    if as_json:
        emit_json(error_object(command, message, exit_code))
    else:
        echo(f"ctxmgr: {message.replace(chr(9), ' ')}", err=True)
    sys.exit(exit_code)


P = ParamSpec("P")
R = TypeVar("R")


def handle_errors(func: Callable[P, R]) -> Callable[P, R]:
    """Expected failures: one line on stderr (or one JSON object with --json) and the documented exit
    code; a permission problem names the path; tracebacks only with --debug."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        ctx = click.get_current_context()
        debug = bool(ctx.find_root().params.get("debug"))
        # verify's exit codes go by the command's own name (`deployment verify` too); the JSON names
        # the whole path under ctxmgr (`deployment set-context`, `node show`)
        command = ctx.info_name
        path = " ".join(ctx.command_path.split()[1:]) or command
        as_json = bool(ctx.params.get("as_json"))
        try:
            return func(*args, **kwargs)
        except (click.exceptions.Exit, click.ClickException, KeyboardInterrupt):
            raise
        except CtxmgrError as exc:
            if debug:
                raise
            code = usage_exit(command) if exc.exit_code == ExitCode.USAGE else exc.exit_code
            if command == "verify" and exc.exit_code == ExitCode.ERROR:
                code = VerifyExit.UNKNOWN
            fail(exc.message, code, as_json=as_json, command=path)
        except PermissionError as exc:
            if debug:
                raise
            where = exc.filename or "a file ctxmgr needs"
            fail(
                f"permission denied on {where}: changing services, their state directory and the journal "
                "needs root (run with sudo, or point --state-dir at a directory you own)",
                VerifyExit.UNKNOWN if command == "verify" else ExitCode.ERROR,
                as_json=as_json,
                command=path,
            )
        except Exception as exc:
            if debug:
                raise
            message = f"unexpected error: {type(exc).__name__}: {exc} (run with --debug)"
            fail(message, ExitCode.INTERNAL, as_json=as_json, command=path)

    return wrapper
