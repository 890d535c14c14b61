"""Reaching the nodes of a multi-node deployment: `ctxmgr node STEP` on each, over ssh (or here).

The transport is the operator's own ssh (keys, config, jump hosts as they already have them), run with
BatchMode so that a missing key fails at once instead of asking for a password nobody will type. Every
node step answers one JSON object on stdout (the same `--json` contract as every command), so a node's
failure arrives as its own one-line error, with the host in front.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_ctxmgr.errors import CtxmgrError, UsageError, documented_exit_code

LOCAL_HOSTS = frozenset({"local", "localhost"})
DEFAULT_SSH = ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
MAX_ANSWER_BYTES = 16 << 20  # a node's answer (a plan with its GPUs and diff) is far below this


class NodeError(CtxmgrError):
    """A node could not be reached, or its step failed: the message starts with the host."""


@dataclass(frozen=True)
class NodeAddress:
    """One node as the operator names it: `HOST:UNIT` (HOST `local` is this machine, without ssh)."""

    host: str
    service: str

    @classmethod
    def parse(cls, text: str, source: str = "--node") -> NodeAddress:
        """The one door a node's name comes in by (--node, a deployment file's [[node]]): what would
        reach ssh as an option (a leading `-`), split into two words, or carry a control is refused.
        `source` names where it was written, for the message."""
        host, sep, service = text.rpartition(":")
        if (
            not sep
            or not host
            or not service
            or any(c.isspace() or not c.isprintable() for c in text)
            or host.startswith("-")
            or service.startswith("-")
        ):
            raise UsageError(f"{source} {text!r}: expected HOST:UNIT, e.g. gpu-b:vllm-glm5.service")
        return cls(host, service)

    def __str__(self) -> str:
        return f"{self.host}:{self.service}"


@dataclass(frozen=True)
class Link:
    """How this machine runs ctxmgr on a node: `ssh` for the others, this Python for `local`."""

    ssh: tuple[str, ...] = DEFAULT_SSH
    remote_ctxmgr: tuple[str, ...] = ("ctxmgr",)
    local_ctxmgr: tuple[str, ...] = field(default_factory=lambda: (sys.executable, "-m", "vllm_ctxmgr"))
    # a node whose ctxmgr is elsewhere, or keeps its state elsewhere (`ctxmgr = [...]` in its [[node]])
    per_host: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def argv(self, host: str, args: Sequence[str]) -> list[str]:
        """The command line for `ctxmgr ARGS` on `host`; ssh joins its words, so each is quoted."""
        if host in LOCAL_HOSTS:
            return [*self.per_host.get(host, self.local_ctxmgr), *args]
        ctxmgr = self.per_host.get(host, self.remote_ctxmgr)
        return [*self.ssh, "--", host, " ".join(shlex.quote(w) for w in (*ctxmgr, *args))]

    def call(
        self,
        host: str,
        args: Sequence[str],
        timeout: float,
        stdin: dict[str, Any] | None = None,
        label: str | None = None,
    ) -> dict[str, Any]:
        """Run one node step and return its JSON answer; NodeError (`label`, default the host, first)
        when it failed."""
        label = label or host
        argv = self.argv(host, [*args, "--json"])
        try:
            done = subprocess.run(
                argv,
                input=json.dumps(stdin) if stdin is not None else "",
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise NodeError(
                f"{host}: `ctxmgr {args[0] if args else ''}` did not answer within {timeout:.0f} s"
            ) from None
        except OSError as exc:
            raise NodeError(f"{label}: cannot run {argv[0]}: {exc.strerror or exc}") from None
        answer = _answer(done.stdout)
        if done.returncode != 0 or answer is None:
            why = (answer or {}).get("error") or _last_line(done.stderr) or f"exit status {done.returncode}"
            if answer is None and done.returncode == 255 and host not in LOCAL_HOSTS:
                why = f"ssh failed: {_last_line(done.stderr) or 'no answer'}"
            said = (answer or {}).get("exit_code")
            code = documented_exit_code(said)
            if said is not None and code is None:
                why = f"{why} (and an exit code ctxmgr never uses: {str(said)[:40]!r})"
            raise NodeError(f"{label}: {why}", exit_code=code or None)
        return answer


def _answer(stdout: str) -> dict[str, Any] | None:
    """The one JSON object a `--json` command prints (stdout holds nothing else)."""
    if len(stdout) > MAX_ANSWER_BYTES:
        return None
    try:
        value = json.loads(stdout)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
