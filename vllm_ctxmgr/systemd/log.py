"""ctxmgr's own record in the journal: every change, rollback and verification, with fields to match.

`journalctl -t ctxmgr CTXMGR_SERVICE=vllm-glm5.service` is then a service's history on the host,
beside vLLM's own lines. Written with journald's native protocol (systemd.journal-fields(7),
"Native Journal Protocol") over its datagram socket: a few lines, where python-systemd would need
libsystemd headers to build. Logging never fails a command: without a journal it does nothing.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Mapping
from enum import IntEnum
from pathlib import Path

from vllm_ctxmgr.masking import scrub, scrub_json
from vllm_ctxmgr.systemd.systemctl import Systemd

JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
IDENTIFIER = "ctxmgr"


class Priority(IntEnum):
    """syslog(3) levels, as journald's PRIORITY= field takes them."""

    CRIT = 2
    ERR = 3
    WARNING = 4
    NOTICE = 5
    INFO = 6
    DEBUG = 7


def encode(fields: Mapping[str, str]) -> bytes:
    """One native-protocol datagram: KEY=value lines; a value with a newline goes length-prefixed."""
    out = bytearray()
    for key, value in fields.items():
        data = value.encode()
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


def journal_fields(message: str, priority: Priority, fields: Mapping[str, object]) -> dict[str, str]:
    """MESSAGE, PRIORITY and SYSLOG_IDENTIFIER, then CTXMGR_* fields (None values left out)."""
    out = {"MESSAGE": message, "PRIORITY": str(int(priority)), "SYSLOG_IDENTIFIER": IDENTIFIER}
    for key, value in fields.items():
        if value is not None:
            out[f"CTXMGR_{key.upper()}"] = str(value)
    return out


def send(systemd: Systemd, message: str, priority: Priority, **fields: object) -> bool:
    """Log to the journal of the systemd ctxmgr drives (the host's, or a container's through its root)."""
    path = systemd.host_path(JOURNAL_SOCKET)
    data = encode(scrub_json(journal_fields(scrub(message), priority, fields)))
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(data, str(path))
        return True
    return False
