"""`make fleet-demo`: a fleet roll-out of a larger context under load, from real parts.

Boots the fleet bed (tests/fleet/bed.py: 3 hosts in network namespaces, each with a private systemd
running a real sshd and the vLLM stand-in; HAProxy in front; ansible-core 2.19 in .venv-ansible-2.19),
installs the collection from the tarball `ansible-galaxy collection build` makes, then, with the bounded load
client streaming 1.5 s completions at 20 req/s through HAProxy:

  1. check mode: what would change on each host (nothing is touched),
  2. the roll-out of max_model_len 200,000 (drain -> wait idle -> ctxmgr set-context -> undrain -> UP),
  3. the same roll-out with no load-balancer step (rolling_context_lb=none), to show what the drain saves,
  4. the roll-out with a failure injected on host 2 (its vLLM refuses 200,000 tokens).

and prints the figures: requests sent / failed, each host's time out of rotation, roll-out time.
Everything is torn down at the end (by PID and namespace name). Needs root.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fleet.bed import BASELINE_CONTEXT, FleetBed, RollOut, build_collection, fleet_available, roll_out  # noqa: E402

TARGET = 200_000
RATE = 20.0
FAILURE_ON_H2 = {"h2": {"CTXMGR_STANDIN_MAX_POSITION": "100000"}}


def say(text: str = "") -> None:
    print(text, flush=True)


def figures(title: str, run: RollOut, bed: FleetBed) -> dict[str, object]:
    load, report = run.load, run.report
    contexts = {h.name: bed.served_context(h) for h in bed.hosts}
    say(f"\n== {title}")
    say(f"   ansible-playbook exit {run.returncode}, roll-out {run.seconds:.1f} s")
    if load:
        say(
            f"   requests sent {load['sent']}, failed {load['failed']}, truncated {load['truncated']}"
            f" (lost {load['lost']}); served by {load['served_by']}"
        )
        say(
            "   out of rotation in HAProxy: "
            + ", ".join(f"{h} {s:.1f} s" for h, s in load["lb_downtime_s"].items())
        )
    for key in ("changed", "would_change", "unchanged", "rolled_back", "failed", "untouched"):
        if report.get(key):
            say(f"   {key.replace('_', ' ')}: {', '.join(report[key])}")
    for name, host in report.get("hosts", {}).items():
        if host["outcome"] == "failed":
            say(f"   why {name} failed: {host['detail'].get('reason', '')[:300]}")
    if report.get("hosts"):
        say(
            "   report, before -> after (out of service): "
            + ", ".join(
                f"{name} {host['before']} -> {host['after']} ({host['out_of_service_s']} s)"
                for name, host in report["hosts"].items()
            )
        )
    for name, why in report.get("not_restored", {}).items():
        say(f"   NOT brought back: {name}: {why[:300]}")
    say(
        "   max_model_len served now (/v1/models on each host): "
        + ", ".join(f"{h} {c}" for h, c in contexts.items())
    )
    return {
        "returncode": run.returncode,
        "rollout_s": round(run.seconds, 1),
        "sent": load.get("sent"),
        "failed": load.get("failed"),
        "truncated": load.get("truncated"),
        "lost": load.get("lost"),
        "lb_downtime_s": load.get("lb_downtime_s"),
        "served": contexts,
        "report": {
            k: report.get(k) for k in ("changed", "would_change", "rolled_back", "failed", "untouched")
        },
    }


def main() -> int:
    reason = fleet_available()
    if reason:
        say(f"fleet-demo cannot run here: {reason}")
        return 1
    directory = REPO / ".cache" / "fleet" / "demo"
    began = time.monotonic()
    tarball = build_collection(directory / "build")
    say(f"built {tarball.relative_to(REPO)}")
    bed = FleetBed.up(directory)
    results: dict[str, object] = {}
    try:
        bed.install_collection(tarball)
        say(f"fleet up in {time.monotonic() - began:.1f} s: HAProxy {bed.lb_url} (netns {bed.client_netns})")
        for host in bed.hosts:
            pid = host.sandbox.pid if host.sandbox else "?"
            say(f"   {host.name} {host.address} (netns {host.netns}, systemd pid {pid})")

        run = roll_out(bed, TARGET, "check", rate=0, check=True)
        results["check"] = figures(
            f"1. check mode: set-context {TARGET} on each host, touching none", run, bed
        )

        run = roll_out(bed, TARGET, "rollout", rate=RATE)
        results["rollout"] = figures(f"2. roll-out of max_model_len {TARGET} under {RATE:g} req/s", run, bed)

        bed.reset()
        run = roll_out(bed, TARGET, "no-drain", rate=RATE, extra_vars={"rolling_context_lb": "none"})
        results["no_drain"] = figures(
            "3. the same roll-out without the load-balancer step (rolling_context_lb=none)", run, bed
        )

        bed.reset(host_environment=FAILURE_ON_H2)
        run = roll_out(bed, TARGET, "failure", rate=RATE)
        results["failure"] = figures(
            "4. roll-out with a failure injected on h2 (its vLLM refuses the context)", run, bed
        )
    finally:
        bed.down()
    (directory / "figures.json").write_text(json.dumps(results, indent=2) + "\n")
    say(f"\nfleet torn down; figures in {(directory / 'figures.json').relative_to(REPO)}; "
        f"{time.monotonic() - began:.0f} s in all (baseline context {BASELINE_CONTEXT})")  # fmt: skip
    ok = (
        results["rollout"]["lost"] == 0  # type: ignore[index]
        and results["failure"]["lost"] == 0  # type: ignore[index]
        and set(results["rollout"]["served"].values()) == {TARGET}  # type: ignore[index]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
