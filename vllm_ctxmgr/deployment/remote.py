"""Reaching the nodes of a multi-node deployment: `ctxmgr node STEP` on each, over ssh (or here).

The transport is the operator's own ssh (keys, config, jump hosts as they already have them), run with
BatchMode so that a missing key fails at once instead of asking for a password nobody will type. Every
node step answers one JSON object on stdout (the same `--json` contract as every command), so a node's
failure arrives as its own one-line error, with the host in front.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from vllm_ctxmgr.deployment.wire import ErrorAnswer
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
        return cls._checked(host if sep else "", service, text, source)

    @classmethod
    def of(cls, host: str, service: str, source: str) -> NodeAddress:
        """A node from its host and unit given apart (a deployment file's [[node]]): the same checks,
        and a unit with `:` is refused, since HOST:UNIT would split it elsewhere."""
        if ":" in service:
            raise UsageError(f"{source} service {service[:80]!r}: a unit name with ':' cannot be a node's")
        return cls._checked(host, service, f"{host}:{service}", source)

    @classmethod
    def _checked(cls, host: str, service: str, text: str, source: str) -> NodeAddress:
        if (
            not host
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
        stdin: Mapping[str, object] | None = None,
        label: str | None = None,
    ) -> dict[str, object]:
        """Run one node step and return its JSON answer (wire.Message.from_json checks it); NodeError
        (`label`, default the host, first) when it failed."""
        label = label or host
        argv = self.argv(host, [*args, "--json"])
        request = json.dumps(stdin).encode() if stdin is not None else b""
        try:
            code, stdout, stderr = _run_bounded(argv, request, timeout, MAX_ANSWER_BYTES)
        except subprocess.TimeoutExpired:
            raise NodeError(
                f"{label}: `ctxmgr {' '.join(args[:2])}` did not answer within {timeout:.0f} s"
            ) from None
        except OSError as exc:
            raise NodeError(f"{label}: cannot run {argv[0]}: {exc.strerror or exc}") from None
        except _TooLarge:
            raise NodeError(f"{label}: its answer is larger than {MAX_ANSWER_BYTES} bytes") from None
        answer, fault = _answer(stdout)
        if answer is None and code == 0 and not fault:  # a login banner, a shell's words: never "exit 0"
            fault = "its answer is not JSON (exit status 0)"
        if code != 0 or answer is None:
            error = ErrorAnswer.from_json(answer)
            why = (error.error if error else "") or _last_line(stderr) or fault or f"exit status {code}"
            if answer is None and code == 255 and host not in LOCAL_HOSTS:
                why = f"ssh failed: {_last_line(stderr) or 'no answer'}"
            said = error.exit_code if error else None
            documented = documented_exit_code(said)
            if said is not None and documented is None:
                why = f"{why} (and an exit code ctxmgr never uses: {str(said)[:40]!r})"
            raise NodeError(f"{label}: {why}", exit_code=documented or None)
        return answer


class _TooLarge(Exception):
    """A node's answer went past the cap while it was being read."""


def _run_bounded(argv: list[str], request: bytes, timeout: float, cap: int) -> tuple[int, bytes, str]:
    """Run `argv` with `request` on its stdin; its stdout read up to `cap` bytes while reading (past
    that it is killed: a node's answer is never held whole before it is judged), its stderr's last
    64 KiB kept, as text (ssh's and a crashed step's words, quoted in the error). TimeoutExpired past
    `timeout`."""
    deadline = time.monotonic() + timeout
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    writer = threading.Thread(target=_feed, args=(proc.stdin, request), daemon=True)
    writer.start()
    out, err = bytearray(), bytearray()
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ, out)
            selector.register(proc.stderr, selectors.EVENT_READ, err)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(argv, timeout)
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    key.data.extend(chunk)
                    if key.data is out and len(out) > cap:
                        raise _TooLarge
                    if key.data is err and len(err) > 1 << 17:
                        del err[: len(err) - (1 << 16)]
        code = proc.wait(max(deadline - time.monotonic(), 0.001))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    writer.join(1)
    return code, bytes(out), err.decode("utf-8", "replace")


def _feed(pipe: IO[bytes], data: bytes) -> None:
    with contextlib.suppress(OSError):  # a node step that exits without reading its request
        pipe.write(data)
    with contextlib.suppress(OSError):
        pipe.close()


def _answer(stdout: bytes) -> tuple[dict[str, object] | None, str]:
    """The one JSON object a `--json` command prints (stdout holds nothing else), or None and why not:
    any fault in it (not UTF-8, not JSON, nested past the parser's depth) is the node's failure."""
    if len(stdout) > MAX_ANSWER_BYTES:
        return None, f"its answer is larger than {MAX_ANSWER_BYTES} bytes"
    try:
        value = json.loads(stdout.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "its answer is not UTF-8"
    except RecursionError:
        return None, "its answer is JSON nested too deeply"
    except ValueError:
        return None, ""
    return (value, "") if isinstance(value, dict) else (None, "its answer is not a JSON object")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
