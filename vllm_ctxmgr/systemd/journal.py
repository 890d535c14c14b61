"""The journal as `journalctl -o json` gives it: entries, cursors, and a follower that reads without
blocking. The `Systemd` class (systemctl.py) runs journalctl through its wrapper with these arguments."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_ctxmgr.errors import SystemdError
from vllm_ctxmgr.systemd.tools import kill_group, one_line, tool_env


def _field_bytes(value: object) -> bytes | None:
    """journalctl -o json gives a field as a string, as an array of byte values (not UTF-8, or control
    characters), as null (too large without --all), or as an array of those when the field repeats."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):
        if all(isinstance(item, int) for item in value):
            return bytes(value)
        parts = [_field_bytes(item) for item in value]
        return b"\n".join(part for part in parts if part is not None)
    return str(value).encode()


def field_text(value: object) -> str | None:
    """A journal field as text; bytes that are not UTF-8 become U+FFFD."""
    raw = _field_bytes(value)
    return None if raw is None else raw.decode("utf-8", errors="replace")


def _field_int(fields: Mapping[str, object], name: str) -> int | None:
    text = field_text(fields.get(name))
    if text is None:
        return None
    try:
        return int(text.split("\n")[-1])
    except ValueError:
        return None


@dataclass(frozen=True)
class JournalEntry:
    """One journal entry as `journalctl -o json` gives it.

    `pid` is the _PID field: the process that wrote the line (journald reads the writer's credentials
    on a service's stdout too, so a vLLM EngineCore child shows its own PID), numbered in journald's PID
    namespace. `unit` is the unit the entry is about: the UNIT= of the manager's own messages
    ("Started ...", "Start request repeated too quickly."), else the unit that logged it.
    """

    message: str
    realtime_us: int
    pid: int | None
    cursor: str
    unit: str | None
    fields: Mapping[str, object] = field(repr=False)
    monotonic_us: int | None = None
    invocation_id: str | None = None

    @property
    def from_manager(self) -> bool:
        """Written by systemd about the unit, not by the unit's processes."""
        return "UNIT" in self.fields or "USER_UNIT" in self.fields

    @property
    def identifier(self) -> str | None:
        return field_text(self.fields.get("SYSLOG_IDENTIFIER"))

    @classmethod
    def from_json(cls, line: str | bytes | Mapping[str, object]) -> JournalEntry:
        fields: Mapping[str, object] = line if isinstance(line, Mapping) else json.loads(line)
        unit = None
        for name in ("UNIT", "USER_UNIT", "_SYSTEMD_USER_UNIT", "_SYSTEMD_UNIT"):
            unit = field_text(fields.get(name))
            if unit:
                break
        invocation_id = field_text(fields.get("INVOCATION_ID")) or field_text(
            fields.get("_SYSTEMD_INVOCATION_ID")
        )
        return cls(
            message=field_text(fields.get("MESSAGE")) or "",
            realtime_us=_field_int(fields, "__REALTIME_TIMESTAMP") or 0,
            pid=_field_int(fields, "_PID"),
            cursor=field_text(fields.get("__CURSOR")) or "",
            unit=unit,
            fields=fields,
            monotonic_us=_field_int(fields, "__MONOTONIC_TIMESTAMP"),
            invocation_id=invocation_id,
        )


def parse_journal_json(text: str | bytes) -> list[JournalEntry]:
    """Entries from `journalctl -o json` output (one JSON object a line)."""
    lines = text.splitlines() if isinstance(text, str) else text.decode().splitlines()
    return [JournalEntry.from_json(line) for line in lines if line.strip()]


class JournalFollower:
    """A running `journalctl -f -o json`, read without blocking.

    `poll(timeout)` returns as soon as at least one entry has arrived, so a caller can decide on the
    line that settles a start the moment journald has stored it.
    """

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = tuple(argv)
        self._stderr_fd = os.memfd_create("journalctl-stderr")
        self._process = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr_fd,
            env=tool_env(),
            start_new_session=True,
        )
        assert self._process.stdout is not None
        self._fd = self._process.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._buffer = b""
        self._eof = False

    @property
    def running(self) -> bool:
        return not self._eof and self._process.poll() is None

    def _read_available(self) -> None:
        while True:
            try:
                chunk = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                self._eof = True
                return
            self._buffer += chunk

    def _take_entries(self) -> list[JournalEntry]:
        head, newline, tail = self._buffer.rpartition(b"\n")
        if not newline:
            return []
        self._buffer = tail
        return parse_journal_json(head)

    def poll(self, timeout: float) -> list[JournalEntry]:
        """Entries that arrived, waiting at most `timeout` seconds for the first one.

        Raises SystemdError once journalctl has ended and every entry it wrote was returned.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        poller = select.poll()
        poller.register(self._fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while True:
            if not self._eof:
                self._read_available()
            entries = self._take_entries()
            if entries:
                return entries
            if self._eof:
                self._process.wait()
                raise SystemdError(self._ended())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            poller.poll(max(1, int(remaining * 1000)))

    def _ended(self) -> str:
        stderr = one_line(os.pread(self._stderr_fd, 4096, 0).decode(errors="replace"))
        status = f"journalctl -f ended (exit status {self._process.returncode})"
        return f"{status}: {stderr}" if stderr else status

    def close(self) -> None:
        if self._process.poll() is None:
            kill_group(self._process)
        self._process.wait()
        if self._process.stdout:
            self._process.stdout.close()
        if self._stderr_fd >= 0:
            os.close(self._stderr_fd)
            self._stderr_fd = -1

    def __enter__(self) -> JournalFollower:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------
# Journal cursors and journalctl arguments


def unit_match(unit: str | None, user: bool) -> list[str]:
    if unit is None:
        return []
    return ["--user-unit", unit] if user else ["--unit", unit]


def last_cursor(output: str) -> str:
    """The cursor of the entry `journalctl -o json -n 1` printed: pass it as after_cursor to see only
    what follows."""
    entries = parse_journal_json(output)
    if not entries or not entries[-1].cursor:
        raise SystemdError("journalctl -n 1 gave no entry: the journal is empty or unreadable")
    return entries[-1].cursor


def journal_args(
    unit: str | None,
    user: bool,
    after_cursor: str | None = None,
    lines: int | None = None,
    follow: bool = False,
) -> list[str]:
    """journalctl's arguments for a unit's entries (with systemd's messages about it). Following without a
    cursor starts at the end: only new entries come."""
    args = ["--no-pager", "-o", "json", "--all", *(["--follow"] if follow else []), *unit_match(unit, user)]
    if after_cursor:
        args += ["--after-cursor", after_cursor]
    elif follow:
        args += ["-n", "0"]
    if lines is not None:
        args += ["-n", str(lines)]
    return args
