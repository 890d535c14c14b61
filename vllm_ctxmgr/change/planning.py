"""Gathering what the planner needs from the outside world: the model, the GPUs, earlier starts.

Everything here does I/O (files, NVML, the revision store); `plan.make_plan` stays pure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_ctxmgr.core.budget import effective_args, is_cpu_deployment
from vllm_ctxmgr.core.calibration import NodeObservation
from vllm_ctxmgr.core.change_policy import kept_utilization
from vllm_ctxmgr.core.downtime import WeightCache
from vllm_ctxmgr.core.hardware import (
    GIB,
    GpuInfo,
    GpuState,
    capability_for_name,
    check_cuda_capability,
    platform_for,
    uniform_gpus,
    unknown_gpu_name,
)
from vllm_ctxmgr.core.kv.backends import NEWEST_VLLM
from vllm_ctxmgr.core.observations import (
    Observation,
    ObservationError,
    ObservationRecord,
    figure_above_the_device,
)
from vllm_ctxmgr.core.plan import Plan, PlanOptions, make_plan
from vllm_ctxmgr.core.serve_args import AUTO_CONTEXT, ServeArgs, with_overrides
from vllm_ctxmgr.core.vllm_versions import parse_vllm_version
from vllm_ctxmgr.core.weight_cache import (
    PreloadOffer,
    daemon_findings,
    preload_command,
    preload_fits,
    restart_weights,
    weight_cache_mode,
)
from vllm_ctxmgr.errors import CtxmgrError, ExitCode, UsageError
from vllm_ctxmgr.model_files.load import load_expert_weight_bytes, load_model_facts
from vllm_ctxmgr.nvml import gpus_from_file, read_nvml

if TYPE_CHECKING:  # a service's plan reads the unit, the store and the running vLLM: imported there
    from vllm_ctxmgr.core.upgrade import CapacityMove
    from vllm_ctxmgr.store import ServiceStore
    from vllm_ctxmgr.systemd.service import ServiceView
    from vllm_ctxmgr.systemd.systemctl import Systemd


def gather_gpus(
    gpu_memory: int | None = None,
    gpu_count: int | None = None,
    gpu_name: str | None = None,
    gpus_from: str | None = None,
    visible_devices: str | None = None,
    required: bool = False,
    compute_capability: tuple[int, int] | None = None,
) -> tuple[GpuState | None, str | None]:
    """(GPU state, note) from flags, a file, or NVML; None with a note when none can be had.
    `compute_capability` (--compute-capability) is every GPU's where it reports none (a GPU the name
    table lacks)."""
    capability = _offline_capability(gpu_name, compute_capability)
    if gpus_from:
        state = gpus_from_file(gpus_from).select(visible_devices)
    elif gpu_memory is not None or gpu_count is not None:
        if gpu_memory is None:
            raise UsageError("--gpu-count needs --gpu-memory SIZE")
        state = uniform_gpus(gpu_count or 1, gpu_memory, name=gpu_name or "GPU")
    else:
        try:
            state = read_nvml().select(visible_devices)
        except CtxmgrError as exc:
            if required:
                raise
            return None, exc.message
    if compute_capability is not None:
        gpus = tuple(
            g if g.compute_capability else replace(g, compute_capability=capability) for g in state.gpus
        )
        state = replace(state, gpus=gpus)
    return state, None


def _offline_capability(
    gpu_name: str | None, compute_capability: tuple[int, int] | None
) -> tuple[int, int] | None:
    """The compute capability an offline plan is made for: --compute-capability, else --gpu-name's in
    NVIDIA's list (matched whole); an unknown name, a name and a capability that disagree, and a GPU
    vLLM's CUDA build does not run on (below 7.0) are refused, each in one line."""
    by_name = capability_for_name(gpu_name) if gpu_name is not None else None
    if compute_capability is not None:
        given = f"{compute_capability[0]}.{compute_capability[1]}"
        check_cuda_capability(compute_capability, "--compute-capability")
        if by_name is not None and by_name != compute_capability:
            raise UsageError(
                f"--gpu-name {gpu_name!r} is compute capability {by_name[0]}.{by_name[1]} (NVIDIA's CUDA "
                f"GPUs list), not {given}: leave one out"
            )
        return compute_capability
    if gpu_name is not None and by_name is None:
        # the name decides backends and defaults: one ctxmgr does not know would be planned as no GPU
        raise UsageError(unknown_gpu_name(gpu_name))
    if by_name is not None:
        check_cuda_capability(by_name, f"--gpu-name {gpu_name!r}")
    return by_name


def cpu_node_memory(node: int = 0) -> GpuState | None:
    """NUMA node memory as the vLLM CPU build sizes against it (utils/cpu_resource_utils.py).

    On the CPU backend --gpu-memory-utilization is a fraction of this node's MemTotal, and the KV
    allocation must fit in its free + file + reclaimable memory. None where the kernel does not say.
    """

    path = Path(f"/sys/devices/system/node/node{node}/meminfo")
    try:
        text = path.read_text()
    except OSError:
        return None
    info: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[3].isdigit():
            info[parts[2].rstrip(":")] = int(parts[3]) * 1024
    try:
        total = info["MemTotal"]
        available = info["MemFree"] + info["Active(file)"] + info["Inactive(file)"] + info["SReclaimable"]
    except KeyError:
        return None
    gpu = GpuInfo(node, f"CPU (NUMA node {node})", total, available, total - available)
    return GpuState((gpu,), "numa")


def observations_from_store(records: Iterable[Mapping[str, object] | ObservationRecord]) -> list[Observation]:
    """Stored observation records (newest last) as the planner takes them. A line that is not a record
    a start can log (a tampered or damaged file) is left out, never trusted and never fatal: one bad
    line must not wedge every later plan of the service."""
    out = []
    for record in records:
        if not isinstance(record, ObservationRecord):
            try:
                record = ObservationRecord.from_json(record, "observations.jsonl")
            except ObservationError:
                continue
        out.append(record.planned())
    return out


MAX_IMPORT_BYTES = 1 << 20


def imported_observation(
    text: str,
    source: str,
    *,
    service: str | None = None,
    vllm_version: str | None = None,
    gpu_names: Iterable[str] | None = None,
    gpu_total_bytes: float | None = None,
) -> dict[str, object]:
    """An observation exported by `ctxmgr observe --json` on another host, checked before it is stored.

    Hosts 2..N of a fleet then plan from host 1's real start. The record must say which vLLM it ran:
    the planner applies it only to that version, and only to the GPU model it names (a record from a
    host without NVML names none and applies to any, as the host's own records do). Where the caller
    knows this service, its vLLM and this host's GPUs, a record of another is refused here rather
    than ignored by every later plan; so is a failed start's (it would cap every plan of the fleet at
    what that failure saw). Returns the line to store.
    """
    if len(text) > MAX_IMPORT_BYTES:
        raise UsageError(f"{source}: larger than an observation can be")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise UsageError(f"{source}: not JSON ({reason})") from None
    if isinstance(data, dict) and isinstance(data.get("record"), dict):
        data = data["record"]  # the whole `observe --json` object
    if not isinstance(data, dict):
        raise UsageError(f"{source}: not an observation record (a JSON object)")
    record = ObservationRecord.from_json(data, source)
    obs = record.observation
    if obs.failure or data.get("ok") is False:
        raise UsageError(
            f"{source}: the record of a failed start ({obs.failure or 'not ok'}); only a start that served "
            "is imported"
        )
    if not obs.vllm_version:
        raise UsageError(f"{source}: the observation does not say its vllm_version, so it cannot be matched")
    theirs = record.service
    if (
        service is not None
        and theirs is not None
        and theirs.removesuffix(".service") != service.removesuffix(".service")
    ):
        raise UsageError(f"{source}: an observation from service {theirs}, not {service}")
    if vllm_version is not None and parse_vllm_version(vllm_version) != parse_vllm_version(obs.vllm_version):
        raise UsageError(f"{source}: its start ran vLLM {obs.vllm_version}, this service runs {vllm_version}")
    names = sorted(set(gpu_names or ()))
    if names and obs.gpu_name and obs.gpu_name not in names:
        raise UsageError(f"{source}: its start ran on {obs.gpu_name}, this host has {', '.join(names)}")
    if gpu_total_bytes and obs.platform != "CPU":
        _within_this_hosts_gpu(obs, gpu_total_bytes, obs.gpu_name or (names[0] if names else "GPU"), source)
    imported = replace(record, imported_from=str(record.host or source))
    return {k: v for k, v in imported.to_json().items() if v is not None}


def _within_this_hosts_gpu(obs: Observation, total_bytes: float, gpu: str, source: str) -> None:
    """An imported start's figures against the GPU it claims, as this host's NVML gives it: as a watched
    start's are (observing.within_the_gpu), not only against the record's own total_memory_gib, which
    the same record sets. vLLM's total (torch's) is NVML's, give or take 1%."""
    found = figure_above_the_device(obs, total_bytes)
    if found is None and obs.total_memory_gib is not None and obs.total_memory_gib * GIB > total_bytes * 1.01:
        found = ("total_memory_gib", obs.total_memory_gib)
    if found is not None:
        name, gib = found
        raise UsageError(
            f"{source}: {name} {gib:,.2f} GiB is more than the {total_bytes / GIB:.2f} GiB of this host's "
            f"{gpu[:60]} (NVML): not imported"
        )


MAX_NODES = 1024  # more nodes than any deployment has: a request above it is not one
MAX_RANKS = 1 << 16


def node_observations_from_json(data: object, world_size: int) -> tuple[NodeObservation, ...]:
    """Every headless node's last start as the coordinator passes it to the head's plan, checked at
    the door `observe --import` uses (ObservationRecord.from_json: each figure typed and bounded):
    a list of {"node": "node N", "ranks": [global ranks], "record": the node's observation record}.
    A failed start's figures (the ranks' own budget is missing or cut short) are left out."""
    if data is None:
        return ()
    if not isinstance(data, list) or len(data) > MAX_NODES:
        raise UsageError("node_observations: not a list of at most 1024 nodes")
    out: list[NodeObservation] = []
    for index, item in enumerate(data):
        where = f"node_observations[{index}]"
        if not isinstance(item, dict):
            raise UsageError(f"{where}: not a JSON object")
        node, ranks, record = item.get("node"), item.get("ranks"), item.get("record")
        if not isinstance(node, str) or not re.fullmatch(r"node \d{1,4}", node):
            raise UsageError(f"{where}: node is not 'node N'")
        if (
            not isinstance(ranks, list)
            or len(ranks) > MAX_RANKS
            or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size for r in ranks)
        ):
            raise UsageError(f"{where}: ranks are not global ranks below the world size {world_size}")
        if not isinstance(record, dict):
            raise UsageError(f"{where}: record is not an observation record (a JSON object)")
        checked = ObservationRecord.from_json(record, f"{node}'s observation")
        if checked.observation.failure is None:
            out.append(NodeObservation(node, tuple(ranks), checked.planned()))
    return tuple(out)


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is asked for beyond the unit's own vLLM arguments.

    The target, and where the GPUs' memory comes from when NVML is not the answer (offline flags or
    a `ctxmgr gpus --json` file from the target host); `plan`, `set-context` and `verify` share it.
    """

    context: int
    gpu_memory: int | None = None
    gpu_count: int | None = None
    gpu_name: str | None = None
    compute_capability: tuple[int, int] | None = None  # --compute-capability: a GPU the name table lacks
    gpus_from: str | None = None
    weights_bytes: int | None = None
    vllm_version: str | None = None  # plan by this vLLM's rules instead of the unit's own
    allow_long: bool = False
    max_gpu_memory_utilization: float = 0.95
    fixed_gpu_memory_utilization: float | None = None  # the operator's choice, not the planner's
    concurrency: int = 1  # requests of the full context the KV cache must hold at once
    # --pin-kv-cache-memory: the pool pinned at the calibrated warm budget (core/cold_boot.py)
    pin_kv_cache_memory: bool = False
    cuda_version: str | None = None  # CUDA runtime of the unit's vLLM ("12.8"); None: unknown
    # every node's GPUs of a multi-node deployment in rank order (core.topology.world_gpus), instead of
    # this host's: the coordinator gathered them from each node
    world_gpus: GpuState | None = None
    # what each other node's own journal logged at its last start, with its global ranks: those
    # ranks' GPU lines are calibrated from it (node_observations_from_json checks them)
    node_observations: tuple[NodeObservation, ...] = ()


def in_managers_root(args: ServeArgs, root: Path) -> ServeArgs:
    """The model path and HF_HOME as found from here when the unit's manager has a root of its own
    (--systemd-pid: /proc/PID/root, a container's or another tree's): vLLM under that manager reads
    them in its root, so ctxmgr reads them through it. The unit's paths are already the manager's view
    (a docker/podman volume mapped back by service.view_from_unit); a model id stays an id."""
    if str(root) == "/":
        return args
    changes: dict[str, Any] = {}
    if args.model.startswith("/"):
        changes["model"] = str(root / args.model.lstrip("/"))
    hf_home = args.env.get("HF_HOME", "")
    if hf_home.startswith("/"):
        changes["env"] = {**args.env, "HF_HOME": str(root / hf_home.lstrip("/"))}
    return replace(args, **changes) if changes else args


def plan_for(
    args: ServeArgs,
    request: PlanRequest,
    service_pids: tuple[int, ...] = (),
    observations: Iterable[Observation] = (),
    root: Path = Path("/"),
    whose: str = "the chosen",
) -> Plan:
    """Model facts + GPUs + earlier starts -> a Plan: the I/O is here, the planner (core.plan) is pure.
    `root`: the unit's manager's root as seen from here (Systemd.root); its paths are read under it.
    `whose`: whose a fixed utilisation is, as the verdict says it."""
    args = in_managers_root(effective_args(args), root)
    cpu = is_cpu_deployment(args)
    model_facts = load_model_facts(
        args.model, hf_home=args.env.get("HF_HOME"), hf_overrides=args.hf_overrides
    )
    gpu_state = request.world_gpus
    if gpu_state is not None:
        pass  # the deployment's GPUs, each node's already selected by its CUDA_VISIBLE_DEVICES
    elif cpu and not args.kv_cache_memory_bytes:
        gpu_state = cpu_node_memory()  # on the CPU build the utilisation is a fraction of node memory
    elif not cpu:
        gpu_state, _note = gather_gpus(
            request.gpu_memory,
            request.gpu_count,
            request.gpu_name,
            request.gpus_from,
            args.env.get("CUDA_VISIBLE_DEVICES"),
            compute_capability=request.compute_capability,
        )
    version = parse_vllm_version(request.vllm_version) or parse_vllm_version(args.vllm_version) or NEWEST_VLLM
    options = PlanOptions(
        target_context=request.context,
        allow_long=request.allow_long,
        vllm_version=version,
        max_gpu_memory_utilization=request.max_gpu_memory_utilization,
        weights_bytes=request.weights_bytes,
        fixed_gpu_memory_utilization=request.fixed_gpu_memory_utilization,
        fixed_gpu_memory_utilization_is=whose,
        concurrency=request.concurrency,
        pin_kv_cache_memory=request.pin_kv_cache_memory,
        service_pids=service_pids,
        cpu=cpu,
        whole_deployment=request.world_gpus is not None,
    )
    if model_facts.num_experts and args.data_parallel_size > 1:  # experts split over DP x TP
        experts = load_expert_weight_bytes(args.model, hf_home=args.env.get("HF_HOME"))
        options = replace(options, expert_weight_bytes=experts)
    cuda = request.cuda_version or args.cuda_version  # the flag, else what the unit's venv's torch says
    if cuda is not None and not cpu:
        platform = platform_for(gpu_state, cpu)
        options = replace(options, platform=replace(platform, cuda_runtime_major=cuda_runtime_major(cuda)))
    return make_plan(model_facts, args, gpu_state, options, tuple(observations), request.node_observations)


def plan_as_run(
    args: ServeArgs,
    request: PlanRequest,
    service_pids: tuple[int, ...] = (),
    observations: Iterable[Observation] = (),
    root: Path = Path("/"),
) -> Plan:
    """A unit's plan at the utilisation set-context would run it with: where the unit's own holds the
    target and stays (core.change_policy), the plan is made again at it, the least that fits one more
    figure (Plan.least_gpu_memory_utilization), so its table and capacity are what vLLM will report."""
    observations = tuple(observations)
    plan = plan_for(args, request, service_pids, observations, root=root)
    kept = kept_utilization(args, plan, request.fixed_gpu_memory_utilization)
    if kept is None:
        return plan
    at_kept = replace(request, context=plan.max_model_len, fixed_gpu_memory_utilization=kept)
    as_run = plan_for(args, at_kept, service_pids, observations, root=root, whose="the unit's")
    return replace(as_run, least_gpu_memory_utilization=plan.gpu_memory_utilization)


def cuda_runtime_major(version: str) -> int:
    """The major of a CUDA runtime version as torch writes it (torch.version.cuda, "12.8" / "13.0")."""
    match = re.fullmatch(r"\s*(\d{1,3})\.(\d{1,3})(?:\.\d{1,5})?\s*", version)
    if match is None:
        raise UsageError(f"--cuda-version {version!r}: expected X.Y, e.g. 12.8 or 13.0")
    return int(match.group(1))


def largest_context(args: ServeArgs, request: PlanRequest, **kwargs: object) -> int:
    """`--max-model-len auto` resolved before the restart: the largest context the plan says fits."""
    probe = plan_for(args, replace(request, context=1), **kwargs)  # type: ignore[arg-type]
    if not probe.gpus and probe.kv_cache_memory_bytes is None:
        raise UsageError("auto needs memory information: NVML, or --gpu-memory SIZE --gpu-count N")
    if probe.max_context <= 0:
        raise CtxmgrError("auto: not even one block of KV cache fits", exit_code=ExitCode.INFEASIBLE)
    return probe.max_context


@dataclass(frozen=True)
class ServicePlan:
    """A service's plan with what it was made from: the unit as systemd loads it, and what ctxmgr said
    about the running instance on the way."""

    view: ServiceView
    plan: Plan
    learned: str | None = None  # what was learned from the running instance's last start (or why not)


def plan_service(
    systemd: Systemd,
    store: ServiceStore,
    service: str,
    request: PlanRequest,
    keep_observation: Callable[[ObservationRecord], None],
    unsaved_observations: Iterable[ObservationRecord] = (),
    overrides: Mapping[str, Any] | None = None,
    argv_check: bool = True,
) -> ServicePlan:
    """The one way a service is planned, for `plan --service` and `set-context` alike.

    Reads the unit as systemd loads it, learns from the running instance's last start where no
    observation of it is stored yet (`keep_observation` stores it; a dry run keeps it in memory and
    passes it back as `unsaved_observations`), and plans with every observation of the service and
    the PIDs of its own processes (whose GPU memory a restart frees). `overrides` replaces unit
    arguments (plan's vLLM flags); `argv_check` warns where the running vLLM got other arguments.
    """
    from vllm_ctxmgr.change.observing import learn_from_running_instance
    from vllm_ctxmgr.systemd.service import read_service, read_stop_path, running_argv_mismatch

    view = read_service(systemd, service)
    learned = learn_from_running_instance(systemd, store, service, view, keep_observation)
    observations = observations_from_store([*store.observations(), *unsaved_observations])
    pids = tuple(systemd.unit_processes(view.name))
    args = with_overrides(view.args, overrides) if overrides else view.args
    if request.context == AUTO_CONTEXT:
        root = systemd.root
        largest = largest_context(args, request, service_pids=pids, observations=observations, root=root)
        request = replace(request, context=largest)
    plan = plan_as_run(args, request, pids, observations, root=systemd.root)
    mismatch = running_argv_mismatch(systemd, view) if argv_check else None
    if mismatch:
        plan = replace(plan, warnings=(mismatch, *plan.warnings))
    try:  # what a restart's stop could leave on the GPUs (core.stop_path): said before any restart
        risks = read_stop_path(systemd, view).risks()
    except CtxmgrError:
        risks = []
    if risks:
        plan = replace(plan, warnings=(*plan.warnings, *risks))
    if weight_cache_mode(args):  # the daemon it maps its weights from: its unit, GPUs, model, key
        plan = _with_preload_daemon(systemd, view.name, args, plan)
    else:  # where a daemon would serve it: the weight load each restart would save
        plan = _with_preload_offer(systemd, view.name, in_managers_root(args, systemd.root), plan)
    if learned:
        plan = replace(plan, notes=(learned, *plan.notes))
    return ServicePlan(view, plan, learned)


def weights_at_restart(
    systemd: Systemd, unit: str, args: ServeArgs, flag_changes: Iterable[str]
) -> WeightCache | None:
    """How the restart's engine gets its weights (core/weight_cache.restart_weights): an ipc_cache unit
    maps the daemon's only where a `vllm preload` unit runs with its key; else the load is cold."""
    from vllm_ctxmgr.systemd.preload import find_preload_daemon

    weights = restart_weights(args, flag_changes)
    if weights != "mapped":
        return weights
    try:
        daemon = find_preload_daemon(systemd, unit)
    except CtxmgrError:
        return weights  # the manager cannot list its units: the unit's own flags are all there is
    if daemon is None or daemon_findings(args, daemon.args, daemon.text())[1] is not None:
        return "reload"
    return weights


def _with_preload_offer(systemd: Systemd, unit: str, args: ServeArgs, plan: Plan) -> Plan:
    """A unit that reads its weights from disk at each restart, which a `vllm preload` daemon would
    serve (core/weight_cache.preload_fits): the plan offers it with the last start's weight load."""
    from vllm_ctxmgr.change.observing import last_weight_load

    sizes = [(g.free_at_start.bytes or 0) - (g.requested.bytes or 0) for g in plan.gpus]
    room = min(sizes) if sizes else None
    try:
        quantization = load_model_facts(args.model, hf_home=args.env.get("HF_HOME")).quantization
    except CtxmgrError:
        return plan
    if not preload_fits(args, quantization, plan.vllm_version, is_cpu_deployment(args), room):
        return plan
    try:
        loading = last_weight_load(systemd, unit)
    except CtxmgrError:
        return plan
    if loading is None or room is None:
        return plan
    offer = PreloadOffer(loading, "the loading-weights phase of the last start in the journal",
                         preload_command(args), room)  # fmt: skip
    return replace(plan, notes=(*plan.notes, offer.text()), preload_offer=offer)


def _with_preload_daemon(systemd: Systemd, unit: str, args: ServeArgs, plan: Plan) -> Plan:
    """An ipc_cache unit's plan with the `vllm preload` unit it maps (systemd/preload.py)."""
    from vllm_ctxmgr.systemd.preload import find_preload_daemon

    try:
        daemon = find_preload_daemon(systemd, unit)
    except CtxmgrError:
        return plan  # the manager cannot list its units: nothing said rather than a guess
    note, warning = daemon_findings(args, daemon.args if daemon else None, daemon.text() if daemon else "")
    return replace(
        plan, notes=(*plan.notes, note), warnings=(*plan.warnings, *([warning] if warning else []))
    )


def upgrade_move(
    systemd: Systemd,
    store: ServiceStore,
    service: str,
    from_version: str,
    to_version: str,
    request: PlanRequest,
    overrides: Mapping[str, Any] | None = None,
) -> CapacityMove:
    """The service's unit planned under `from_version`'s rules and under `to_version`'s, at the same
    context on the same GPUs, so what differs is the rules alone: both plans take the weights the
    last start under `from_version` logged (a checkpoint weighs the same under any release) and
    neither is calibrated by a start's KV budget (a start under the new release has not happened;
    the planner takes a start's figures only for its own release). Stores nothing."""
    from vllm_ctxmgr.core.upgrade import CapacityMove
    from vllm_ctxmgr.systemd.service import read_service

    view = read_service(systemd, service)
    args = with_overrides(view.args, overrides) if overrides else view.args
    pids, root = tuple(systemd.unit_processes(view.name)), systemd.root
    observations = observations_from_store(store.observations())
    if request.weights_bytes is None:
        at_old = replace(request, context=1, vllm_version=from_version)
        measured = plan_for(args, at_old, pids, observations, root)
        per_gpu = measured.gpus[0].weights if measured.gpus else None
        if per_gpu is not None and per_gpu.bytes is not None and per_gpu.source.startswith("vllm log"):
            ranks = args.tensor_parallel_size * args.pipeline_parallel_size
            request = replace(request, weights_bytes=per_gpu.bytes * ranks)

    def planned(version: str) -> Plan:
        at = replace(request, vllm_version=version)
        if at.context == AUTO_CONTEXT:
            at = replace(at, context=largest_context(args, at, service_pids=pids, root=root))
        return plan_as_run(args, at, pids, (), root=root)

    return CapacityMove.between(planned(from_version), planned(to_version))
