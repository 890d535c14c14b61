"""How many first restarts succeed with the cold-boot rule on and off (issue 34, section 1).

A series of set-context changes on the stand-in's model (GLM-5 FP8, TP 8, H200: the stand-in's
defaults), each planned by the pure planner as set-context plans it (the least utilisation that holds
the target with the margin, or the unit's own where that holds it: core/change_policy.py) from the
starts before it, then booted by the stand-in's own accounting of vLLM 0.33.0 (tests/support/standin.py
plan_kv: a first boot at a length compiles cold and its profiling peak is higher by the cold peak). A
change the plan refuses is not restarted; a boot that fails is rolled back to the length before (warm).

The series is run for each unit utilisation, each cold peak (1.64 GiB: ~5% as vLLM #54383 measured;
4 and 8 GiB: what #54122 reports on other GPUs) and three journals: "cold+warm" (the first boot and a
reboot at the first length: the extra peak is learned), "cold only" (no reboot: every start the
journal holds compiled, and calibration takes a cold budget), "warm only" (the first boot is not in
the journal, the reboot is: the 5% estimate stands). Prints figures; asserts nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.standin import GIB, plan_kv, settings_from  # noqa: E402
from vllm_ctxmgr.core.change_policy import flags_to_apply, kept_utilization  # noqa: E402
from vllm_ctxmgr.core.hardware import GpuInfo, GpuState  # noqa: E402
from vllm_ctxmgr.core.observations import Observation  # noqa: E402
from vllm_ctxmgr.core.plan import Plan, PlanOptions, make_plan  # noqa: E402
from vllm_ctxmgr.core.serve_args import ServeArgs  # noqa: E402
from vllm_ctxmgr.model_files.load import load_model_facts  # noqa: E402

MODEL = str(REPO / "examples" / "models" / "glm-5")
TOTAL_GIB = 139.81  # the stand-in's H200
USED_GIB = 0.55  # what the driver holds before vLLM starts (the stand-in's "Initial free memory")
FIRST_LENGTH = 8192
SERIES = (131_072, 150_000, 180_000, 195_000, 202_752, 150_000, 202_752)
UTILISATIONS = (0.8, 0.85, 0.9, 0.92)
COLD_PEAKS_GIB = (1.64, 4.0, 8.0)
VERSION = (0, 33, 0)


@dataclass
class Service:
    """The unit's flags and its journal's starts, as the change walk leaves them."""

    utilization: float
    max_model_len: int = FIRST_LENGTH
    starts: list[Observation] = field(default_factory=list)
    compiled: set[int] = field(default_factory=set)  # the lengths in the compile cache


@dataclass
class Tally:
    succeeded: int = 0
    failed: int = 0
    refused: int = 0  # the plan said it does not fit: no restart


def gpus() -> GpuState:
    total, used = int(TOTAL_GIB * GIB), int(USED_GIB * GIB)
    return GpuState(
        tuple(
            GpuInfo(i, "NVIDIA H200", total, total - used, used, compute_capability=(9, 0)) for i in range(8)
        ),
        "given",
    )


def boot(service: Service, length: int, utilization: float, cold_peak: float) -> Observation:
    """One start, as the stand-in accounts it (vLLM 0.33.0's budget, fit check and null block)."""
    argv = ["zai-org/GLM-5-FP8", "-tp", "8", "--max-model-len", str(length)]
    argv += ["--gpu-memory-utilization", str(utilization)]
    settings = settings_from(argv, {"CTXMGR_STANDIN_COLD_PEAK_GIB": str(cold_peak)})
    cold = length not in service.compiled
    settings.compiled_cold = cold
    kv = plan_kv(settings, length)
    service.compiled.add(length)  # the compile runs before the fit check: a failed boot compiled too
    return Observation(
        vllm_version="0.33.0",
        platform="GPU",
        max_model_len=length,
        gpu_memory_utilization=utilization,
        model_loading_gib=settings.weights_gib,
        available_kv_gib=round(kv.available_bytes / GIB, 2),
        cuda_graph_gib=settings.cuda_graph_gib,
        estimated_max_model_len=None if kv.fits else kv.estimated_max_model_len,
        ready=kv.fits,
        failure=None if kv.fits else "kv_cache_too_small",
        gpu_name="NVIDIA H200",
        compile_cache="miss" if cold else "hit",
    )


def planned(service: Service, target: int, rule: bool) -> tuple[Plan, float]:
    """The plan set-context applies, and the utilisation the unit then runs with."""
    facts = load_model_facts(MODEL)
    args = ServeArgs(
        MODEL, tensor_parallel_size=8, max_model_len=service.max_model_len,
        gpu_memory_utilization=service.utilization,
    )  # fmt: skip
    options = PlanOptions(target, vllm_version=VERSION, cold_boot_rule=rule)
    plan = make_plan(facts, args, gpus(), options, service.starts)
    kept = kept_utilization(args, plan)
    if kept is not None:
        at_kept = replace(
            options, fixed_gpu_memory_utilization=kept, fixed_gpu_memory_utilization_is="the unit's"
        )
        plan = make_plan(facts, args, gpus(), at_kept, service.starts)
    applied = flags_to_apply(args, plan, target)
    return plan, applied.gpu_memory_utilization or service.utilization


JOURNALS = ("cold+warm", "cold only", "warm only")


def run_series(utilization: float, cold_peak: float, journal: str, rule: bool) -> Tally:
    service = Service(utilization)
    first = boot(service, FIRST_LENGTH, utilization, cold_peak)  # the first boot: cold
    if journal != "warm only":
        service.starts.append(first)
    if journal != "cold only":
        service.starts.append(boot(service, FIRST_LENGTH, utilization, cold_peak))  # a reboot: warm
    tally = Tally()
    for target in SERIES:
        plan, u = planned(service, target, rule)
        if not plan.feasible:
            tally.refused += 1
            continue
        start = boot(service, target, u, cold_peak)
        service.starts.append(start)
        if start.ready:
            tally.succeeded += 1
            service.max_model_len, service.utilization = target, u
        else:
            tally.failed += 1  # rolled back: the old length, warm (its graphs are in the cache)
            service.starts.append(boot(service, service.max_model_len, service.utilization, cold_peak))
    return tally


def main() -> None:
    print(
        f"series from {FIRST_LENGTH}: {', '.join(map(str, SERIES))} (first restarts: ok / failed / refused)"
    )
    print(f"{'unit u':>6} {'cold peak':>9} {'journal':>12}   {'rule off':>14}   {'rule on':>14}")
    totals = {False: Tally(), True: Tally()}
    for utilization in UTILISATIONS:
        for cold_peak in COLD_PEAKS_GIB:
            for journal in JOURNALS:
                row = []
                for rule in (False, True):
                    t = run_series(utilization, cold_peak, journal, rule)
                    total = totals[rule]
                    total.succeeded += t.succeeded
                    total.failed += t.failed
                    total.refused += t.refused
                    row.append(f"{t.succeeded:>4} / {t.failed:>2} / {t.refused:>2}")
                print(
                    f"{utilization:>6.2f} {cold_peak:>5.2f} GiB {journal:>12}   {row[0]:>14}   {row[1]:>14}"
                )
    for rule in (False, True):
        t = totals[rule]
        attempted = t.succeeded + t.failed
        print(
            f"rule {'on ' if rule else 'off'}: {t.succeeded} of {attempted} first restarts succeeded "
            f"({t.failed} failed), {t.refused} changes refused by the plan"
        )


if __name__ == "__main__":
    main()
