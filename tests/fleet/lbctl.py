"""The bed's load balancer as "your own commands" (the role's `rolling_context_lb: command`): one HAProxy
runtime-API step per run, with a way to make a step fail as a real LB's API sometimes does.

    python tests/fleet/lbctl.py SOCKET BACKEND SERVER drain|idle|undrain|up [--faults FILE]

drain / undrain set the server's state; idle / up check once (the role retries them). FILE holds lines
`SERVER:STEP:COUNT`: that step of that server fails COUNT more times (each failure takes one off), so a
test can break the first undrain of h2 and let the rollback's undrain through.
"""

from __future__ import annotations

import argparse
import fcntl
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ansible_collections.vllm.ctxmgr.plugins.module_utils.haproxy_runtime import (
    HaproxyError,
    Runtime,
)

STEPS = ("drain", "idle", "undrain", "up")


def take_fault(faults: Path, server: str, step: str) -> bool:
    """True when FILE says this step of this server fails now (and counts the failure off)."""
    if not faults.exists():
        return False
    with faults.open("r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        lines, hit = [], False
        for line in handle.read().split():
            name, what, count = line.rsplit(":", 2)
            if not hit and (name, what) == (server, step) and int(count) > 0:
                hit, count = True, str(int(count) - 1)
            lines.append(f"{name}:{what}:{count}")
        handle.seek(0)
        handle.truncate()
        handle.write("\n".join(lines) + "\n")
    return hit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("socket")
    parser.add_argument("backend")
    parser.add_argument("server")
    parser.add_argument("step", choices=STEPS)
    parser.add_argument("--faults", type=Path)
    args = parser.parse_args(argv)
    if args.faults and take_fault(args.faults, args.server, args.step):
        print(f"lbctl: {args.step} {args.backend}/{args.server}: the load balancer's API refused (injected)")
        return 1
    runtime = Runtime(args.socket)
    try:
        if args.step in ("drain", "undrain"):
            runtime.set_state(args.backend, args.server, "drain" if args.step == "drain" else "ready")
        else:
            runtime.wait(args.backend, args.server, args.step, timeout=0)
    except HaproxyError as exc:
        print(f"lbctl: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
