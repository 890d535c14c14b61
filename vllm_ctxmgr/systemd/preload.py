"""The `vllm preload` daemon an ipc_cache engine maps its weights from: which unit runs it on this host.

vLLM 0.31+ starts one weight-cache daemon per GPU with `vllm preload` (entrypoints/cli/preload.py:
L1-L18), its flags EngineArgs' own (L140-L141); each rank sits on the local device of its index (L307,
"Local index == device index"), so its GPUs are the first ones its CUDA_VISIBLE_DEVICES shows. The
engine's unit usually names the daemon's with After=/Requires=; where it does not, the host's running
services are read. Found by ExecStart (`systemctl show`), read as systemd runs it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from vllm_ctxmgr.core.serve_args import ServeArgs, parse_serve_argv
from vllm_ctxmgr.errors import CtxmgrError
from vllm_ctxmgr.systemd.systemctl import Systemd

_ORDERING = ("Requires", "BindsTo", "Wants", "After")
_ARGV = re.compile(r"argv\[\]=(?P<argv>[^;]*)")


@dataclass(frozen=True)
class PreloadDaemon:
    """A unit that runs `vllm preload`, with the engine arguments it was given."""

    unit: str
    args: ServeArgs
    gpus: str  # in words: its CUDA_VISIBLE_DEVICES, or the first devices it sees
    named_by_engine: bool  # the engine's unit names it (After=/Requires=/Wants=/BindsTo=)

    def text(self) -> str:
        return f"{self.unit} runs `vllm preload` for {self.args.model} on {self.gpus}"


def preload_argv(argv: list[str]) -> list[str] | None:
    """vLLM's arguments after `vllm preload` (or `python -m vllm.entrypoints.cli.main preload`)."""
    for i, word in enumerate(argv):
        if os.path.basename(word) == "vllm" and argv[i + 1 : i + 2] == ["preload"]:
            return argv[i + 2 :]
        if word == "-m" and argv[i + 1 : i + 3] == ["vllm.entrypoints.cli.main", "preload"]:
            return argv[i + 3 :]
    return None


def _daemon(systemd: Systemd, unit: str, named: bool) -> PreloadDaemon | None:
    found = _ARGV.search(systemd.show(unit, "ExecStart").get("ExecStart", ""))
    words = preload_argv(found.group("argv").split()) if found else None
    if words is None:
        return None
    env = systemd.environment(unit)
    try:
        args = parse_serve_argv(words, env)
    except CtxmgrError:
        return None  # a preload command ctxmgr cannot read is not the daemon it can report
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size
    visible = env.get("CUDA_VISIBLE_DEVICES")
    shown = (
        [d for d in visible.split(",") if d.strip()][:ranks] if visible else [str(i) for i in range(ranks)]
    )
    gpus = f"GPU{'s' if ranks > 1 else ''} {','.join(shown)}" + (
        "" if visible else " (no CUDA_VISIBLE_DEVICES)"
    )
    return PreloadDaemon(unit, args, gpus, named)


def find_preload_daemon(systemd: Systemd, engine_unit: str) -> PreloadDaemon | None:
    """The `vllm preload` unit an ipc_cache engine takes its weights from: one its unit names first,
    else a running service of this host's manager (None: no unit runs it)."""
    props = systemd.show(engine_unit, *_ORDERING)
    named = list(
        dict.fromkeys(u for p in _ORDERING for u in props.get(p, "").split() if u.endswith(".service"))
    )
    for unit in named:
        daemon = _daemon(systemd, unit, True)
        if daemon is not None:
            return daemon
    for listed in systemd.list_units("*.service", all_units=False):
        if listed.unit != engine_unit and listed.unit not in named:
            daemon = _daemon(systemd, listed.unit, False)
            if daemon is not None:
                return daemon
    return None
