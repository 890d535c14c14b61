"""One hostile input at a time, for the campaigns in benchmarks/ (campaign_hardening.py, round three's
campaign_round3_local.py and campaign_round3_inputs.py): each trial runs in a forked child with a
timeout, so a hang or a crash is one trial's finding, not the campaign's end; a Tally per section
prints `tried` and `failed`. What counts as a failure beyond these (a victim file changed, a value
read that was planted, ...) is each section's own oracle.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from vllm_ctxmgr.errors import CtxmgrError


def isolated(fn: Callable[[], Any], timeout: float) -> tuple[str, Any]:
    """("ok", result) | ("refused", message) | ("unhandled", repr) | ("hang", ...), from a fork."""

    def child(conn: Any) -> None:
        try:
            conn.send(("ok", fn()))
        except CtxmgrError as exc:
            conn.send(("refused", str(exc)))
        except BaseException as exc:
            conn.send(("unhandled", f"{type(exc).__name__}: {str(exc)[:200]}"))

    ctx = multiprocessing.get_context("fork")
    parent, conn = ctx.Pipe(duplex=False)
    process = ctx.Process(target=child, args=(conn,))
    process.start()
    conn.close()
    if parent.poll(timeout):
        try:
            outcome = parent.recv()
        except EOFError:
            outcome = ("unhandled", "child died")
        process.join(5)
        return outcome
    process.kill()
    process.join()
    return ("hang", f"over {timeout:g} s")


class Tally:
    def __init__(self, name: str, show: int) -> None:
        self.name, self.show, self.tried, self.failures = name, show, 0, []  # type: ignore[var-annotated]
        self.started = time.perf_counter()

    def add(self, label: str, problem: str | None) -> None:
        self.tried += 1
        if problem:
            self.failures.append(f"{label[:120]}: {problem[:300]}")

    def report(self) -> int:
        seconds = time.perf_counter() - self.started
        print(f"{self.name:<10} tried {self.tried:>5}  failed {len(self.failures):>3}  ({seconds:.1f} s)")
        for line in self.failures[: self.show]:
            print(f"    {line}")
        return len(self.failures)


def outcome_problem(outcome: tuple[str, Any]) -> str | None:
    kind, value = outcome
    if kind in ("unhandled", "hang"):
        return f"{kind}: {value}"
    if kind == "refused" and "\n" in value.strip():
        return f"an error of more than one line: {value[:120]!r}"
    return None


def run_sections(
    parser: argparse.ArgumentParser,
    sections: Mapping[str, Callable[[argparse.Namespace], int]],
    work: Path,
    args: argparse.Namespace | None = None,
) -> NoReturn:
    """A campaign's main: the sections named on the command line (every one by default), each given the
    parsed arguments (`args`, where the campaign parsed them already) and returning its failures, in a
    work folder of this run's own; exits 1 on any."""
    args = args if args is not None else parser.parse_args()
    unknown = [name for name in args.sections if name not in sections]
    if unknown:
        parser.error(f"no section {unknown[0]!r} (sections: {', '.join(sections)})")
    work.mkdir(parents=True, exist_ok=True)
    failed = sum(sections[name](args) for name in args.sections or sections)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{'total':<16} failed {failed}")
    sys.exit(1 if failed else 0)
