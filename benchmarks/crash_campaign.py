"""Crash campaign as figures (needs root: a private systemd): kill ctxmgr at every recorded step of
set-context, of a refused set-context's own rollback, of `rollback` and of `recover` (the test hook
tests/support/crash_run.py, which sets vllm_ctxmgr.store.step_hook), recover, and count per command the
crash points tried, those recovered whole (unit one of the good revisions byte for byte, serving
what it says, nothing unfinished, no leftovers) and those that failed, with the recovery times.
Prints figures; asserts nothing. The same cases run as tests in tests/campaigns/test_crash_campaign.py.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.campaigns.test_crash_campaign import CASES, run_case, start, stop  # noqa: E402
from tests.support.sandbox import Sandbox, sandbox_available  # noqa: E402


def main() -> int:
    reason = sandbox_available()
    if reason is not None:
        print(f"crash campaign: no private systemd here ({reason})")
        return 0
    work = REPO / ".cache" / "bench-crash" / uuid.uuid4().hex[:8]
    work.mkdir(parents=True)
    sandbox = Sandbox.start()
    try:
        service = start(sandbox, work, "bench-crash")
        first = service.set_context(next(service.contexts))
        if first.returncode != 0:
            print(f"the first change failed: {first.stderr.strip()}")
            return 1
        tried: dict[str, int] = defaultdict(int)
        recovered: dict[str, int] = defaultdict(int)
        seconds: dict[str, list[float]] = defaultdict(list)
        failures: list[str] = []
        for command, crash_at, then in CASES:
            started = time.monotonic()
            problems = run_case(service, command, crash_at, then)
            seconds[command].append(time.monotonic() - started)
            tried[command] += 1
            if problems:
                failures.append(f"{command} killed at {crash_at}, then {then}: {'; '.join(problems)}")
            else:
                recovered[command] += 1
        stop(service)
    finally:
        sandbox.stop()
    print(f"{'command':14} {'crash points':>12} {'recovered':>9} {'failed':>6} {'median s':>8}")
    for command in tried:
        failed = tried[command] - recovered[command]
        median = statistics.median(seconds[command])
        print(f"{command:14} {tried[command]:>12} {recovered[command]:>9} {failed:>6} {median:>8.1f}")
    total = sum(tried.values())
    print(f"{'all':14} {total:>12} {sum(recovered.values()):>9} {total - sum(recovered.values()):>6}")
    for line in failures:
        print(f"FAILED: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
