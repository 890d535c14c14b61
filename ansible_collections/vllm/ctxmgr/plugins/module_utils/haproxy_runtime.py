# Copyright: vllm-ctxmgr contributors
# Apache License 2.0 (see LICENSE at the collection's root, or https://www.apache.org/licenses/LICENSE-2.0)
"""A small client for HAProxy's runtime API (the "stats socket"), with no dependency beyond the stdlib.

Why our own and not community.general.haproxy: that module comes only with the full `ansible` package
or Galaxy, and it cannot wait until a drained server has no request in flight, which is the step that
makes a rolling restart lose nothing. Each command opens the socket, sends one line and reads the
answer until HAProxy closes it (the non-interactive mode of the runtime API).
"""

from __future__ import annotations

import csv
import io
import socket
import time

# `show stat` status words per server, as HAProxy 2.x prints them
SERVING = ("UP",)


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
        """Send one command, return HAProxy's whole answer."""
        sock = self._connect()
        try:
            sock.sendall(line.strip().encode() + b"\n")
            chunks = []
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError as exc:
            raise HaproxyError(f"HAProxy runtime API at {self.address}: {line!r}: {exc}") from None
        finally:
            sock.close()
        return b"".join(chunks).decode(errors="replace")

    def servers(self, backend: str | None = None) -> dict[tuple[str, str], dict[str, str]]:
        """(backend, server) -> that server's `show stat` row (status, scur, qcur, ...)."""
        text = self.command("show stat").lstrip("# ")
        rows: dict[tuple[str, str], dict[str, str]] = {}
        for row in csv.DictReader(io.StringIO(text)):
            name = row.get("svname", "")
            if name in ("FRONTEND", "BACKEND", "") or (backend and row.get("pxname") != backend):
                continue
            rows[(row["pxname"], name)] = row
        return rows

    def server(self, backend: str, server: str) -> dict[str, str]:
        row = self.servers(backend).get((backend, server))
        if row is None:
            raise HaproxyError(f"HAProxy has no server {backend}/{server}")
        return row

    def set_state(self, backend: str, server: str, state: str) -> None:
        """state: ready | drain | maint. HAProxy answers nothing on success, a message otherwise."""
        if state not in ("ready", "drain", "maint"):
            raise HaproxyError(f"unknown server state {state!r}")
        answer = self.command(f"set server {backend}/{server} state {state}").strip()
        if answer:
            raise HaproxyError(f"HAProxy refused 'set server {backend}/{server} state {state}': {answer}")

    def wait(
        self, backend: str, server: str, until: str, timeout: float, interval: float = 0.1
    ) -> dict[str, str]:
        """Wait until the server is `idle` (no session in flight and none queued) or `up` (HAProxy's own
        health checks say UP and it takes traffic). Returns the last row; raises on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            row = self.server(backend, server)
            if until == "idle":
                done = int(row.get("scur") or 0) == 0 and int(row.get("qcur") or 0) == 0
            elif until == "up":
                done = row.get("status") in SERVING
            else:
                raise HaproxyError(f"unknown wait condition {until!r}")
            if done:
                return row
            if time.monotonic() >= deadline:
                raise HaproxyError(
                    f"{backend}/{server} was not {until} within {timeout:g} s "
                    f"(status {row.get('status')}, {row.get('scur')} in flight, {row.get('qcur')} queued)"
                )
            time.sleep(interval)
