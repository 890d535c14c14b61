"""How fast ctxmgr decides, and what it costs on top of vLLM's own start (needs root: a private systemd).

1. Verdict latency: the time from the decisive journal line being written (its __REALTIME_TIMESTAMP,
   stamped by journald on receipt) to ctxmgr's verdict, for a start vLLM refuses (KV cache too small)
   and a start that serves (ready line). Goal: under 1 s. journald itself publishes new entries to
   followers on a 250 ms timer, which sets the floor.
2. Rollback overhead: the wall time of a failed set-context with its automatic rollback, minus the
   time the two vLLM starts themselves took in the journal (first line of each start to its decisive
   line). Runs against the stand-in, so the vLLM part is short and ctxmgr's share is visible.
Prints figures; asserts nothing.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.demo import make_vllm_wrapper, offline_gpu_args, standin_unit  # noqa: E402
from tests.support.sandbox import Sandbox, sandbox_available  # noqa: E402
from tests.support.standin import free_port  # noqa: E402
from vllm_ctxmgr.change.planning import PlanRequest  # noqa: E402
from vllm_ctxmgr.change.restart import Restarter  # noqa: E402
from vllm_ctxmgr.change.walk import SetContextRequest, set_context  # noqa: E402
from vllm_ctxmgr.cli.params import SIZE  # noqa: E402
from vllm_ctxmgr.probe import wait_until_serving  # noqa: E402
from vllm_ctxmgr.store import ServiceStore  # noqa: E402

ROUNDS = 3


def planning() -> PlanRequest:
    """The seeds' GPUs, as offline flags (no NVML here)."""
    flags = offline_gpu_args()
    return PlanRequest(
        200000,
        gpu_memory=SIZE.convert(flags[1], None, None),
        gpu_count=int(flags[3]),
        weights_bytes=SIZE.convert(flags[5], None, None),
    )


def one_round(sandbox: Sandbox, work: Path, capacity: int | None) -> dict[str, float]:
    name = f"bench-{uuid.uuid4().hex[:6]}"
    port = free_port()
    env = {"CTXMGR_STANDIN_KV_CAPACITY_TOKENS": str(capacity)} if capacity else {}
    unit_text = standin_unit(make_vllm_wrapper(work), port=port, environment=env)
    unit = f"{name}.service"
    (sandbox.systemd.host_unit_dir / unit).write_text(unit_text)
    sandbox.systemd.daemon_reload()
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    marks: list[tuple[float, str]] = []
    restarter = Restarter(
        sandbox.systemd,
        ServiceStore(work / "state", name),
        name,
        on_step=lambda text: marks.append((time.time(), text)),
    )
    cursor = sandbox.systemd.journal_cursor()
    started = time.time()
    result = set_context(restarter, SetContextRequest(context=200000, planning=planning()))
    finished = time.time()
    entries = sandbox.systemd.journal(unit, after_cursor=cursor)
    sandbox.systemd.stop(unit)
    (sandbox.systemd.host_unit_dir / unit).unlink()
    sandbox.systemd.daemon_reload()
    out: dict[str, float] = {"total_s": finished - started}
    # starts in the journal: from the banner's first line to the ready / error line
    starts: list[tuple[float, float]] = []
    begin = None
    for entry in entries:
        ts = entry.realtime_us / 1e6
        if "non-default args" in entry.message and begin is None:
            begin = ts
        if begin is not None and (
            "Starting vLLM server on" in entry.message or "estimated maximum model length" in entry.message
        ):
            starts.append((begin, ts))
            begin = None
    out["vllm_start_s"] = sum(end - start for start, end in starts)
    decisive_word = "estimated maximum model length" if capacity else "Starting vLLM server on"
    decisive = next(e for e in entries if decisive_word in e.message)
    step = "the change failed" if capacity else "vLLM is serving"
    verdict_time = next(t for t, text in marks if text.startswith(step))
    out["verdict_latency_s"] = verdict_time - decisive.realtime_us / 1e6
    out["overhead_s"] = out["total_s"] - out["vllm_start_s"]
    out["result"] = result.result  # type: ignore[assignment]
    return out


def main() -> int:
    reason = sandbox_available()
    if reason:
        print(f"needs a private systemd: {reason}")
        return 0
    work = REPO / ".cache" / "bench-verdict"
    work.mkdir(parents=True, exist_ok=True)
    with Sandbox.start() as sandbox:
        for label, capacity in (
            ("start refused (KV too small) + rollback", 150000),
            ("start that serves", None),
        ):
            rounds = [one_round(sandbox, work, capacity) for _ in range(ROUNDS)]
            latencies = [r["verdict_latency_s"] for r in rounds]
            overheads = [r["overhead_s"] for r in rounds]
            print(f"{label} ({ROUNDS} rounds, result {rounds[0]['result']}):")
            print(
                f"  decisive journal line -> verdict: median {statistics.median(latencies) * 1000:.0f} ms, "
                f"max {max(latencies) * 1000:.0f} ms (goal < 1000 ms)"
            )
            total = statistics.median([r["total_s"] for r in rounds])
            vllm = statistics.median([r["vllm_start_s"] for r in rounds])
            print(
                f"  whole command {total:.2f} s, of which vLLM's own start(s) {vllm:.2f} s: "
                f"ctxmgr's overhead "
                f"{statistics.median(overheads):.2f} s (planning, install, reload, restart job, probe)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
