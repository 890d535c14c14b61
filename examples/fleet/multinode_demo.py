"""`make fleet-demo-multinode`: two multi-node deployments behind one HAProxy, taken from 8K to 200K
under load by the collection's multinode play, from real parts.

Boots tests/fleet/multinode_fleet.py's bed: 4 hosts in network namespaces (each a private systemd with
a real sshd); deployment A = h1 (head) + h2 (headless), B = h3 + h4, each node the stand-in's
multi-node mode (GLM-5, TP 8 over two 4-GPU nodes); HAProxy sends requests to the two heads. It
installs the collection from its tarball and runs `ansible-playbook vllm.ctxmgr.multinode_context`
(serial 1 over the heads: one deployment drained and changed at a time, ctxmgr on the head changing
both its nodes as one) while the bounded load client streams 1.5 s completions through HAProxy.

Prints: requests sent / failed, each deployment's time out of the load balancer, the roll-out time,
and per node what ctxmgr planned against what that node's vLLM logged at its new start. Everything is
torn down at the end (by PID and namespace name). Needs root.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fleet.bed import build_collection, fleet_available, roll_out  # noqa: E402
from tests.fleet.multinode_fleet import DEPLOYMENTS, MultinodeFleet  # noqa: E402

TARGET = 200_000
RATE = 10.0


def say(text: str = "") -> None:
    print(text, flush=True)


def gib(value: object) -> str:
    return f"{int(value) / 2**30:.2f} GiB" if isinstance(value, (int, float)) else "?"


def planned_line(planned: dict | None) -> str:
    """ctxmgr's plan for one of the node's GPUs, in the words vLLM logs them."""
    if not planned:
        return "-"
    return (
        f"weights {gib(planned.get('weights_bytes'))}, KV cache needed {gib(planned.get('kv_needed_bytes'))}"
        f" of a {gib(planned.get('kv_budget_bytes'))} budget ({planned.get('gpus')} GPUs)"
    )


def logged_line(logged: dict | None) -> str:
    """What the node's vLLM logged at its new start (its own journal, read over ssh)."""
    if not logged:
        return "-"
    tokens = f", KV cache {logged['kv_cache_tokens']} tokens" if logged.get("kv_cache_tokens") else ""
    return (
        f"weights {logged.get('model_loading_gib')} GiB, available KV cache "
        f"{logged.get('available_kv_gib')} GiB, max_model_len {logged.get('max_model_len')}{tokens}"
    )


def main() -> int:
    reason = fleet_available()
    if reason:
        say(f"fleet-demo-multinode cannot run here: {reason}")
        return 1
    directory = REPO / ".cache" / "fleet" / "demo-mn"
    began = time.monotonic()
    tarball = build_collection(directory / "build")
    bed = MultinodeFleet.up(directory)
    try:
        bed.fleet.install_collection(tarball)
        say(f"bed up in {time.monotonic() - began:.1f} s: HAProxy {bed.fleet.lb_url} -> heads h1, h3")
        for name, members in DEPLOYMENTS.items():
            say(f"   deployment {name}: " + " + ".join(f"{m} {bed.host(m).address}" for m in members))
        say(f"   served before: {bed.served()}; units: {bed.unit_contexts()}")
        run = roll_out(bed.fleet, TARGET, "mn-rollout", rate=RATE, playbook="vllm.ctxmgr.multinode_context")
        load, report = run.load, run.report
        say(f"\n== roll-out of max_model_len {TARGET} over 2 deployments under {RATE:g} req/s")
        say(f"   ansible-playbook exit {run.returncode}, roll-out {run.seconds:.1f} s")
        say(
            f"   requests sent {load.get('sent')}, failed {load.get('failed')}, truncated "
            f"{load.get('truncated')} (lost {load.get('lost')}); served by {load.get('served_by')}"
        )
        heads = {members[0]: name for name, members in DEPLOYMENTS.items()}
        downtime = load.get("lb_downtime_s", {})
        say(
            "   out of the load balancer (HAProxy's view): "
            + ", ".join(f"deployment {heads.get(h, h)} {s:.1f} s" for h, s in downtime.items())
        )
        for head, host in report.get("hosts", {}).items():
            say(
                f"   deployment {heads.get(head, head)} ({head}): {host['outcome']}, {host['before']} -> "
                f"{host['after']}, out of service {host['out_of_service_s']} s (the role's report)"
            )
            for node in host["detail"].get("nodes", []):
                say(f"     node {node.get('node_rank')} {node.get('host')} ({node.get('role')}):")
                say(f"       planned: {planned_line(node.get('planned'))}")
                say(f"       logged:  {logged_line(node.get('logged'))}")
        say(f"   served now: {bed.served()}; units: {bed.unit_contexts()}")
        figures = {
            "returncode": run.returncode,
            "rollout_s": round(run.seconds, 1),
            "load": {k: load.get(k) for k in ("sent", "failed", "truncated", "lost", "lb_downtime_s")},
            "report": report,
            "served": bed.served(),
            "units": bed.unit_contexts(),
        }
    finally:
        bed.down()
    (directory / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    say(f"\nbed torn down; figures in {(directory / 'figures.json').relative_to(REPO)}; "
        f"{time.monotonic() - began:.0f} s in all")  # fmt: skip
    uniform = all(v == TARGET for units in figures["units"].values() for v in units.values())
    return 0 if run.returncode == 0 and load.get("lost") == 0 and uniform else 1


if __name__ == "__main__":
    sys.exit(main())
