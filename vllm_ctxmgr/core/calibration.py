"""What earlier starts of the same service tell the planner about its non-KV memory.

vLLM logs the KV budget it found ("Available KV cache memory"), the weights and CUDA graphs of a
start, or the estimated maximum model length of a failed one. An earlier start of the same vLLM
version on the same device replaces core/memory.py's estimates with those figures; core/plan.py's
docstring says how a logged budget moves to another utilisation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypedDict

from vllm_ctxmgr.core.budget import default_gpu_memory_utilization
from vllm_ctxmgr.core.hardware import GIB, Platform
from vllm_ctxmgr.core.kv.layout import KVCacheLayout
from vllm_ctxmgr.core.observations import Observation, figure_above_the_device
from vllm_ctxmgr.core.vllm_versions import VllmVersion, parse_vllm_version


class CalibrationRecord(TypedDict, total=False):
    """A change's predicted against observed KV capacity (change.observing.calibration): the planner's
    calibration error on one start; {} where the plan predicted no budget, without the observed keys
    where vLLM logged none."""

    predicted_kv_budget_bytes: int
    predicted_num_gpu_blocks: int
    predicted_at_gpu_memory_utilization: float | None
    observed_num_gpu_blocks: int
    observed_source: str
    predicted_capacity_tokens: int
    observed_capacity_tokens: int
    error_percent: float


@dataclass(frozen=True)
class Observed:
    """What an earlier start of the same service tells about non-KV memory."""

    available_kv: int | None  # the KV budget it had, at `utilization`
    utilization: float | None
    budget_source: str
    weights: int | None
    cuda_graphs: int | None
    estimated_max_model_len: int | None
    requested_at_start: int | None = None  # ceil(total x u) at that start, where its total is known
    origin: str = ""  # whose journal: "" for this service's own store, "node 1" for a headless node's
    start: Observation | None = None  # the start whose KV budget this is (the plan's confidence names it)

    @property
    def source(self) -> str:
        """The source of a figure read from this start's log, naming the node it came from."""
        return f"vllm log ({self.origin})" if self.origin else "vllm log"


@dataclass(frozen=True)
class NodeObservation:
    """The last start one node of a multi-node deployment logged in its own journal, and the global
    ranks it holds: every rank logs its own memory lines, and the head's journal has only its own."""

    node: str  # "node 1": named in each figure's source
    ranks: tuple[int, ...]
    observation: Observation


def _applicable(obs: Observation, version: VllmVersion, platform: Platform) -> bool:
    """Same vLLM release, same GPU model, same kind of device: its figures hold here."""
    observed_version = parse_vllm_version(obs.vllm_version)
    if observed_version is not None and observed_version[:3] != tuple(version[:3]):
        return False
    if obs.gpu_name and platform.device_name and not platform.is_cpu and obs.gpu_name != platform.device_name:
        return False  # another GPU model: its memory figures say nothing about this one
    return obs.platform is None or (obs.platform.upper() == "CPU") == platform.is_cpu


def _fits_the_device(obs: Observation, platform: Platform) -> bool:
    """No start can log more memory than its GPU has: weights, the KV budget and CUDA graphs each
    (and weights with the KV budget together) within one device's total. A record that says otherwise
    was not logged by a start (an echo of a client's text, a tampered file) and would move the plan."""
    total = platform.total_memory_bytes
    if not total or platform.is_cpu:
        return True
    return figure_above_the_device(obs, total) is None


def observed_memory(
    observations: Sequence[Observation],
    layout: KVCacheLayout,
    version: VllmVersion,
    platform: Platform,
    origin: str = "",
    own_budget: bool = False,
) -> tuple[Observed | None, list[str]]:
    """The latest applicable start's KV budget, weights and CUDA graphs; notes: what was used, ignored.

    `own_budget`: the ranks' own logged budget before /metrics' num_gpu_blocks, which is the engine's
    pool, cut to the smallest worker's (kv_cache_planning.py get_kv_cache_configs): where every other
    node's ranks have their own figures, the head's GPU lines take the head's, and the smallest
    still decides."""
    notes: list[str] = []
    usable = [obs for obs in observations if _applicable(obs, version, platform)]
    if len(usable) < len(observations):
        notes.append(
            f"ignored {len(observations) - len(usable)} earlier start(s) of another vLLM version or device"
        )
    possible = [obs for obs in usable if _fits_the_device(obs, platform)]
    if len(possible) < len(usable):
        total = platform.total_memory_bytes or 0
        notes.append(
            f"ignored {len(usable) - len(possible)} earlier start(s) whose logged figures exceed the "
            f"{total / GIB:.2f} GiB of the GPU they were measured on"
        )
    usable = possible
    if not usable:
        return None, notes
    with_budget = [
        obs
        for obs in usable
        if obs.kv_cache_memory_bytes is None
        and (obs.available_kv_gib is not None or obs.estimated_max_model_len or obs.num_gpu_blocks)
    ]
    # a cold boot (torch.compile compiled) peaks higher while profiling, so its budget is smaller than a
    # warm start's: the latest warm (or not said) start's budget is the one taken, a cold one only
    # where no other start has a budget
    warm = [obs for obs in with_budget if obs.compile_cache != "miss"]
    latest = warm[-1] if warm else with_budget[-1] if with_budget else usable[-1]
    if with_budget and with_budget[-1] is not latest:
        notes.append(
            "a later cold boot's KV budget (its torch.compile compiled) is not taken as a warm start's"
        )
    elif latest in with_budget and latest.compile_cache == "miss":
        notes.append(
            "KV budget from a cold boot (torch.compile compiled): a warm start gets at least as much"
        )
    u_obs = latest.gpu_memory_utilization or default_gpu_memory_utilization(version)
    available: int | None = None
    source = ""
    estimated = None
    if latest in with_budget:
        if latest.estimated_max_model_len:
            # the failed check: needed(est) <= available - one block < needed(est + 1)
            estimated = latest.estimated_max_model_len
            available = layout.check_needed_bytes(estimated) + layout.null_block_reserve()
            source = f"vllm log (estimated maximum model length {estimated})"
        elif latest.num_gpu_blocks is not None and not (own_budget and latest.available_kv_gib is not None):
            # exact to one block: vLLM made floor(budget / bytes_per_block) blocks
            available = latest.num_gpu_blocks * layout.bytes_per_block + layout.bytes_per_block // 2
            source = "vllm metrics (num_gpu_blocks)"
        elif latest.available_kv_gib is not None:
            available = int(latest.available_kv_gib * GIB)
            source = "vllm log"
        if origin:  # the node whose journal logged it, for the per-node report
            source = f"vllm log ({origin})" if source == "vllm log" else f"{source} ({origin})"
        notes.append(f"KV budget from an earlier start at gpu_memory_utilization {u_obs:.2f}: {source}")
    weights = next(
        (int(o.model_loading_gib * GIB) for o in reversed(usable) if o.model_loading_gib is not None), None
    )
    graphs = next(
        (int(o.cuda_graph_gib * GIB) for o in reversed(usable) if o.cuda_graph_gib is not None), None
    )
    if available is None and weights is None and graphs is None:
        return None, notes
    requested_at_start = (
        math.ceil(latest.total_memory_gib * GIB * u_obs)
        if available is not None and latest.total_memory_gib is not None
        else None
    )
    return Observed(
        available,
        u_obs if available is not None else None,
        source,
        weights,
        graphs,
        estimated,
        requested_at_start,
        origin,
        latest if available is not None else None,
    ), notes


def node_observed(
    nodes: Sequence[NodeObservation],
    gpu_names: Sequence[str],
    layout: KVCacheLayout,
    version: VllmVersion,
    platform: Platform,
) -> tuple[dict[int, Observed], list[str]]:
    """Per global rank, what its own node logged (the same rules as the head's own starts: same vLLM
    release, same GPU model as that rank's); ranks of no node, or of one whose start does not apply,
    are absent and keep the head's. `gpu_names`: every rank's GPU model, in rank order."""
    out: dict[int, Observed] = {}
    notes: list[str] = []
    for node in nodes:
        ranks = [r for r in node.ranks if 0 <= r < len(gpu_names)]
        by_model: dict[str, list[int]] = {}
        for rank in ranks:
            by_model.setdefault(gpu_names[rank], []).append(rank)
        for name, on_model in by_model.items():
            here = replace(platform, device_name=name) if name else platform
            observed, found = observed_memory([node.observation], layout, version, here, node.node)
            notes.extend(f"{node.node}: {note}" for note in found)
            if observed is not None:
                out.update(dict.fromkeys(on_model, observed))
    return out, list(dict.fromkeys(notes))
