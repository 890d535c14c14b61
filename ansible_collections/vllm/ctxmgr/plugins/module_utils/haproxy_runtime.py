# Copyright: vllm-ctxmgr contributors
# Apache License 2.0 (see LICENSE at the collection's root, or https://www.apache.org/licenses/LICENSE-2.0)
"""A small client for HAProxy's runtime API (the "stats socket"), with no dependency beyond the stdlib.

Why our own and not community.general.haproxy: that module comes only with the full `ansible` package
or Galaxy, and it cannot wait until a drained server has no request in flight, which is the step that
makes a rolling restart lose nothing. Each command opens the socket, sends one line and reads the
answer until HAProxy closes it (the non-interactive mode of the runtime API), within one deadline
for the whole answer and up to a size cap: a socket that drips a byte a second or answers without end
is an HaproxyError, as is an answer that is not what the command returns.
"""

from __future__ import annotations

import csv
import io
import re
import socket
import time

# `show stat` status words per server, as HAProxy 2.x prints them
SERVING = ("UP",)
# `show stat` of a large configuration is a few MiB; nothing this client asks for is near this
MAX_ANSWER = 16 << 20
# srv_admin_state bits of `show servers state` (HAProxy's SRV_ADMF_*): forced maintenance, forced drain
ADMIN_MAINT = 0x01
ADMIN_DRAIN = 0x08
# HAProxy's own rule for proxy and server names (cfgparse invalid_char): letters, digits, - _ . :
# A space or `;` would split the runtime API's command line into other commands.
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,100}")


class HaproxyError(Exception):
    """The runtime API could not be reached, or refused a command."""


class Runtime:
    """One HAProxy runtime API endpoint: a unix socket path or host:port (ipv4@ prefixes are accepted)."""

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        self.address = address
        self.timeout = timeout

    def _connect(self) -> socket.socket:
        address = self.address.removeprefix("unix@")
        try:
            if address.startswith("/"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                sock.connect(address)
            else:
                host, _colon, port = address.removeprefix("ipv4@").rpartition(":")
                sock = socket.create_connection((host, int(port)), timeout=self.timeout)
                sock.settimeout(self.timeout)
        except (OSError, ValueError) as exc:
            raise HaproxyError(f"cannot reach the HAProxy runtime API at {self.address}: {exc}") from None
        return sock

    def command(self, line: str) -> str:
        """Send one command, return HAProxy's whole answer: within `timeout` seconds for the whole
        exchange (not per read) and at most MAX_ANSWER bytes."""
        line = line.strip()
        if not line or any(ch in line for ch in ";\n\r\0"):
            raise HaproxyError(f"not one runtime API command: {line!r}")
        deadline = time.monotonic() + self.timeout
        sock = self._connect()
        chunks: list[bytes] = []
        size = 0
        try:
            sock.sendall(line.encode() + b"\n")
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HaproxyError(
                        f"HAProxy runtime API at {self.address}: {line!r}: no whole answer within "
                        f"{self.timeout:g} s ({size} bytes read)"
                    )
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_ANSWER:
                    raise HaproxyError(
                        f"HAProxy runtime API at {self.address}: {line!r}: an answer larger than "
                        f"{MAX_ANSWER >> 20} MiB"
                    )
                chunks.append(chunk)
        except TimeoutError:
            raise HaproxyError(
                f"HAProxy runtime API at {self.address}: {line!r}: no whole answer within {self.timeout:g} s"
            ) from None
        except OSError as exc:
            raise HaproxyError(f"HAProxy runtime API at {self.address}: {line!r}: {exc}") from None
        finally:
            sock.close()
        return b"".join(chunks).decode(errors="replace")

    def servers(self, backend: str | None = None) -> dict[tuple[str, str], dict[str, str]]:
        """(backend, server) -> that server's `show stat` row (status, scur, qcur, ...)."""
        if backend is not None:
            _check_name(backend, "backend")
        text = self.command("show stat")
        if not text.startswith("# pxname,svname,"):
            raise HaproxyError(f"HAProxy runtime API at {self.address}: 'show stat' answered {text[:80]!r}")
        rows: dict[tuple[str, str], dict[str, str]] = {}
        try:
            for row in csv.DictReader(io.StringIO(text.lstrip("# ")), strict=True):
                name = row.get("svname") or ""
                if name in ("FRONTEND", "BACKEND", "") or (backend and row.get("pxname") != backend):
                    continue
                rows[(row.get("pxname") or "", name)] = row
        except csv.Error as exc:
            raise HaproxyError(
                f"HAProxy runtime API at {self.address}: 'show stat' is not CSV ({exc})"
            ) from None
        return rows

    def server(self, backend: str, server: str) -> dict[str, str]:
        _check_name(backend, "backend")
        _check_name(server, "server")
        row = self.servers(backend).get((backend, server))
        if row is None:
            raise HaproxyError(f"HAProxy has no server {backend}/{server}")
        return row

    def admin_state(self, backend: str, server: str) -> str:
        """ready | drain | maint, from `show servers state BACKEND` (show stat folds admin and health
        together). The names are checked before anything is sent (a space would be other arguments);
        an admin state that is not HAProxy's integer bit field is an HaproxyError naming it."""
        _check_name(backend, "backend")
        _check_name(server, "server")
        for line in self.command(f"show servers state {backend}").splitlines():
            fields = line.split()
            if len(fields) > 6 and not line.startswith("#") and fields[1] == backend and fields[3] == server:
                raw = fields[6]
                if not (raw.isascii() and raw.isdigit()) or len(raw) > 6:
                    raise HaproxyError(
                        f"HAProxy's 'show servers state' gives {backend}/{server} admin state "
                        f"{_shown(raw)}, not a number"
                    )
                bits = int(raw)
                return "maint" if bits & ADMIN_MAINT else "drain" if bits & ADMIN_DRAIN else "ready"
        raise HaproxyError(f"HAProxy has no server {backend}/{server}")

    def set_state(self, backend: str, server: str, state: str) -> None:
        """state: ready | drain | maint. HAProxy answers nothing on success, a message otherwise."""
        if state not in ("ready", "drain", "maint"):
            raise HaproxyError(f"unknown server state {state!r}")
        _check_name(backend, "backend")
        _check_name(server, "server")
        answer = self.command(f"set server {backend}/{server} state {state}").strip()
        if answer:
            said = " / ".join(line.strip() for line in answer.splitlines() if line.strip())
            raise HaproxyError(f"HAProxy refused 'set server {backend}/{server} state {state}': {said[:300]}")

    def wait(
        self, backend: str, server: str, until: str, timeout: float, interval: float = 0.1
    ) -> dict[str, str]:
        """Wait until the server is `idle` (no session in flight and none queued) or `up` (HAProxy's own
        health checks say UP and it takes traffic). Returns the last row; raises on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            row = self.server(backend, server)
            if until == "idle":
                done = _count(row, "scur", backend, server) == 0 and _count(row, "qcur", backend, server) == 0
            elif until == "up":
                done = row.get("status") in SERVING
            else:
                raise HaproxyError(f"unknown wait condition {until!r}")
            if done:
                return row
            if time.monotonic() >= deadline:
                raise HaproxyError(
                    f"{backend}/{server} was not {until} within {timeout:g} s "
                    f"(status {_shown(row.get('status'))}, {_shown(row.get('scur'))} in flight, "
                    f"{_shown(row.get('qcur'))} queued)"
                )
            time.sleep(interval)


def _check_name(name: str, what: str) -> None:
    """A backend or server name as HAProxy allows it: anything else would be other commands."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise HaproxyError(
            f"{what} name {name!r}: HAProxy names hold only letters, digits, '-', '_', '.', ':'"
        )


def _count(row: dict[str, str], column: str, backend: str, server: str) -> int:
    """A `show stat` counter (scur, qcur): a non-negative integer, or an HaproxyError naming it."""
    raw = row.get(column)
    if raw is None:  # a short row: the column is missing, not zero
        raise HaproxyError(f"HAProxy's 'show stat' row of {backend}/{server} has no {column} column")
    value = raw.strip() or "0"
    # ASCII digits only: str.isdigit() takes '²' (int() then raises ValueError) and int() takes '١٢'
    if not (value.isascii() and value.isdigit()) or len(value) > 12:
        raise HaproxyError(
            f"HAProxy's 'show stat' gives {backend}/{server} {column} {value[:20]!r}, not a count"
        )
    return int(value)


def _shown(value: str | None) -> str:
    """A `show stat` value in a one-line message: as is when it is a plain word, quoted otherwise."""
    text = value or ""
    return text if text.isprintable() and " " not in text and len(text) <= 20 else repr(text[:20])
