"""Units built in a test: one service unit from an ExecStart= line, read as ctxmgr reads a file."""

from __future__ import annotations

from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile


def unit_with(exec_start: str, extra: str = "") -> ServiceUnit:
    """t.service with `extra` lines (Environment=, ...) before its ExecStart=."""
    text = f"[Service]\n{extra}ExecStart={exec_start}\n"
    return ServiceUnit("t.service", (UnitFile.parse("/etc/systemd/system/t.service", text),))
