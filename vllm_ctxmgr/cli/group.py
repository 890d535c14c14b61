"""The group under every command: vLLM's spelling of a flag, click's own usage errors as one line that
obeys --json and verify's codes, the group's --state-dir checked."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from vllm_ctxmgr.cli.output import echo, fail, usage_exit
from vllm_ctxmgr.errors import CtxmgrError, ExitCode, UsageError

GLOBAL_OPTIONS_WITH_VALUE = ("--state-dir", "--systemd-pid", "--unit-dir")


def wants_json(args: Sequence[str]) -> bool:
    return "--json" in args


def command_of(args: Sequence[str]) -> str | None:
    """The subcommand named in a command line (global options and their values skipped)."""
    i = 0
    while i < len(args):
        word = args[i]
        if word in GLOBAL_OPTIONS_WITH_VALUE:
            i += 2
            continue
        if not word.startswith("-"):
            return word
        i += 1
    return None


def vllm_spelling(argv: list[str]) -> list[str]:
    """`--max_model_len 64k` as `--max-model-len 64k`: vLLM's argparse takes either spelling of every
    flag (FlexibleArgumentParser), and a unit's ExecStart may use it, so the command line takes it too.
    Only option names change (the part before `=`, and before the first dot: a dotted
    `--hf-overrides.max_position_embeddings` keeps its key, as vLLM's parser does), and nothing after a
    bare `--`."""
    out: list[str] = []
    for index, word in enumerate(argv):
        if word == "--":
            return out + argv[index:]
        name, eq, value = word.partition("=")
        head, dot, key = name.partition(".")
        if word.startswith("--") and "_" in head:
            word = head.replace("_", "-") + dot + key + eq + value
        out.append(word)
    return out


NO_ARGS_IS_HELP: type[click.UsageError] = getattr(click.exceptions, "NoArgsIsHelpError", ())  # type: ignore[assignment]


class CtxmgrGroup(click.Group):
    """click's own usage errors (a bad option, a missing argument) obey --json and verify's codes too."""

    def main(self, args: Sequence[str] | None = None, *pos: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        argv = vllm_spelling(list(sys.argv[1:] if args is None else args))
        try:
            return super().main(argv, *pos, standalone_mode=False, **kwargs)
        except NO_ARGS_IS_HELP as exc:  # a bare `ctxmgr`: the help, as asked for, not a usage error
            click.echo(exc.ctx.get_help() if exc.ctx else "")
            sys.exit(0)
        except click.exceptions.Abort:
            echo("ctxmgr: aborted", err=True)
            sys.exit(ExitCode.ERROR)
        except CtxmgrError as exc:  # from the group's own options (--state-dir)
            command = command_of(argv)
            code = usage_exit(command) if exc.exit_code == ExitCode.USAGE else exc.exit_code
            fail(exc.message, code, as_json=wants_json(argv), command=command)
        except click.ClickException as exc:
            command = command_of(argv)
            code = usage_exit(command) if isinstance(exc, click.UsageError) else exc.exit_code
            fail(click_message(exc), code, as_json=wants_json(argv), command=command)
        except Exception as exc:  # a bug outside any command (the group's own options): exit 70 too
            if "--debug" in argv:
                raise
            message = f"unexpected error: {type(exc).__name__}: {exc} (run with --debug)"
            fail(message, ExitCode.INTERNAL, as_json=wants_json(argv), command=command_of(argv))


def click_message(exc: click.ClickException) -> str:
    """click's own usage error as one line, like every other error (not click's four-line usage block):
    the command, what is wrong, the closest option of that command, where to read more."""
    ctx = exc.ctx if isinstance(exc, click.UsageError) else None
    where = " ".join(ctx.command_path.split()[1:]) if ctx is not None else ""
    if isinstance(exc, click.NoSuchOption) and ctx is not None:
        guess = closest_option(exc.option_name, ctx.command)
        message = f"no such option {exc.option_name}" + (f"; did you mean {guess}?" if guess else "")
    else:
        message = exc.format_message().rstrip(".")
    help_hint = f" (ctxmgr {where + ' ' if where else ''}--help)" if ctx is not None else ""
    return (f"{where}: " if where else "") + message + help_hint


def closest_option(name: str, command: click.Command) -> str | None:
    """The command's own option closest to a misspelt `name`, as its long name (with the short spelling
    that matched: `--tp` finds `-tp`, answered as `--tensor-parallel-size (-tp)`); None if none is close.
    ctxmgr's options answer first; vLLM's flags are for the caller to try next."""
    spellings: dict[str, click.Option] = {}
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            for opt in (*param.opts, *param.secondary_opts):
                spellings[opt] = param
    matches = difflib.get_close_matches(name, list(spellings), n=1, cutoff=0.75)
    if not matches:
        return None
    option = spellings[matches[0]]
    long = max(option.opts, key=len)
    return long if matches[0] == long else f"{long} ({matches[0]})"


def check_state_dir(value: str) -> str:
    """An empty --state-dir would silently be the current directory; a file cannot hold revisions."""
    if not value.strip():
        raise UsageError("--state-dir cannot be empty (default /var/lib/ctxmgr)")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--state-dir {value}: not a directory")
    resolved = path.resolve()
    if len(resolved.parts) > 1 and resolved.parts[1] in ("proc", "sys", "dev"):
        # the kernel's own trees: nothing ctxmgr writes can live there (and /proc/self is a link)
        raise UsageError(f"--state-dir {value}: in /{resolved.parts[1]}, the kernel's tree, not a directory "
                         "for ctxmgr's revisions (default /var/lib/ctxmgr)")  # fmt: skip
    return value
