"""A unit whose engine maps a `vllm preload` daemon's weights (--load-format ipc_cache, issue 34 §3).

vLLM 0.33.0's own accounting, read in its wheel: in zero_copy mode (the default) the daemon's weights
are external to the engine (model_loader/weight_cache/ipc_loader.py:L138-L154), and the startup check
asks for ceil(total x utilisation) less them in free memory (v1/worker/utils.py:L716-L772); the daemon's
key (weight_cache/protocol.py:L308-L340) holds the KV dtype, TP/PP/DP, quantization, dtype and rope
parameters, not max_model_len or the utilisation. The planner is pure: GPUs and flags come in as data."""

from __future__ import annotations

from pathlib import Path

from tests.support.paths import REPO
from vllm_ctxmgr.change.observing import expected_downtime
from vllm_ctxmgr.change.planning import _with_preload_offer, weights_at_restart
from vllm_ctxmgr.core.downtime import LOADING, estimate_downtime
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuProcess, GpuState
from vllm_ctxmgr.core.memory import CUDA_CONTEXT_ESTIMATE
from vllm_ctxmgr.core.observations import Observation
from vllm_ctxmgr.core.plan import Plan, PlanOptions, make_plan
from vllm_ctxmgr.core.serve_args import parse_serve_argv
from vllm_ctxmgr.core.weight_cache import (
    daemon_findings,
    key_changes,
    preload_fits,
    restart_weights,
    weight_cache_mode,
)
from vllm_ctxmgr.model_files.load import load_model_facts
from vllm_ctxmgr.systemd.journal import JournalEntry
from vllm_ctxmgr.systemd.preload import find_preload_daemon
from vllm_ctxmgr.systemd.systemctl import ListedUnit
from vllm_ctxmgr.vllm_log.timeline import TimedLine, start_timings

MODEL = str(REPO / "examples" / "models" / "llama-3.1-70b")
TOTAL = 80 * GIB
WEIGHTS = 141 * GIB // 4  # bf16 Llama-3.1-70B over TP 4: what the daemon holds per GPU
DAEMON_PID = 4242


def gpus(daemon: bool = True) -> GpuState:
    """Four H100s; where a daemon runs, each holds its rank's weights (another process to NVML)."""
    used = GIB // 2 + (WEIGHTS if daemon else 0)
    procs = (GpuProcess(DAEMON_PID, "python3", WEIGHTS),) if daemon else ()
    return GpuState(
        tuple(
            GpuInfo(
                i,
                "NVIDIA H100 80GB HBM3",
                TOTAL,
                TOTAL - used,
                used,
                compute_capability=(9, 0),
                processes=procs,
            )
            for i in range(4)
        ),
        "nvml",
    )


def plan(*flags: str, target: int = 65_536, daemon: bool = True, concurrency: int = 1) -> Plan:
    args = parse_serve_argv([MODEL, "-tp", "4", "--max-model-len", "8192", *flags])
    options = PlanOptions(target, weights_bytes=141 * GIB, concurrency=concurrency)
    return make_plan(load_model_facts(MODEL), args, gpus(daemon), options)


def test_the_load_format_and_its_mode_are_read_as_vllm_reads_them() -> None:
    assert weight_cache_mode(parse_serve_argv([MODEL, "--load-format", "ipc_cache"])) == "zero_copy"
    copy = [MODEL, "--load-format", "ipc_cache", "--model-loader-extra-config", '{"mode": "copy"}']
    assert weight_cache_mode(parse_serve_argv(copy)) == "copy"
    assert weight_cache_mode(parse_serve_argv([MODEL, "--load-format", "safetensors"])) is None


def test_the_daemons_weights_are_external_to_the_startup_check_as_vllm_counts_them() -> None:
    mapped = plan("--load-format", "ipc_cache")
    # without the rule the daemon's 35 GiB count as another tenant's and the engine's own weights again:
    # the free-memory check then caps the utilisation near (80 - 35.75) / 80
    disk_beside_daemon = plan()
    assert disk_beside_daemon.gpus[0].max_gpu_memory_utilization < 0.56
    assert mapped.gpus[0].max_gpu_memory_utilization > 0.95  # requested - weights <= free (request_memory)
    assert mapped.feasible and not disk_beside_daemon.feasible
    assert "preload daemon's weights" in mapped.gpus[0].used_by_others.source
    # the KV budget is vLLM's either way: requested less weights and the rest of the non-KV memory
    line = mapped.gpus[0]
    assert line.kv_budget.bytes == (line.requested.bytes or 0) - (line.non_kv.bytes or 0)
    assert any("not in its key" in note for note in mapped.notes)
    # copy mode: the engine clones the weights, nothing is external, the daemon's copy is a tenant's
    copied = plan("--load-format", "ipc_cache", "--model-loader-extra-config", '{"mode": "copy"}')
    assert copied.gpus[0].max_gpu_memory_utilization < 0.56


def test_an_alternative_that_changes_the_daemons_key_says_the_daemon_must_reload() -> None:
    crowded = plan("--load-format", "ipc_cache", target=131_072, concurrency=8)  # 80 GiB of KV per GPU
    assert not crowded.feasible
    names = {alt.name: alt for alt in crowded.alternatives}
    reload = "the `vllm preload` daemon must be restarted with --kv-cache-dtype first"
    assert reload in names["fp8-kv-cache"].description
    assert "preload" not in names["shorter-context"].description  # max_model_len is not in the key
    before = parse_serve_argv([MODEL, "-tp", "4", "--load-format", "ipc_cache"])
    after = parse_serve_argv([MODEL, "-tp", "8", "--load-format", "ipc_cache", "--max-model-len", "9999"])
    assert key_changes(before, after) == ["--tensor-parallel-size"]


# The lines of one start as vLLM 0.33.0 prints them (format strings, not a log here): a disk load prints
# "Loading weights took" (model_loader/default_loader.py:L506-L509); an ipc_cache load prints "Mapped N
# tensors from the weight cache daemon" instead (weight_cache/ipc_loader.py:L321-L325); both print
# "Starting to load model" and "Model loading took" (v1/worker/gpu_model_runner.py:L4978-L4982, L5088-L5092).
_PREFIX = "(Worker_TP0 pid=7) INFO 12-07 10:00:00 [x.py:1] "
DISK_START = (
    (10.0, "Starting to load model /m..."),
    (190.0, "Loading weights took 180.00 seconds"),
    (195.0, "Model loading took 35.25 GiB memory and 185.120000 seconds"),
)
IPC_START = (
    (10.0, "Starting to load model /m..."),
    (14.0, "Mapped 963 tensors from the weight cache daemon (zero_copy mode)"),
    (16.0, "Model loading took 0.01 GiB memory and 6.010000 seconds"),
)


def _entries(*starts: tuple[tuple[float, str], ...]) -> list[JournalEntry]:
    """A unit's journal, one invocation per start: systemd's Started, the weights' lines, 5 s of KV
    profiling, then uvicorn's ready line."""
    entries: list[JournalEntry] = []
    for number, weights in enumerate(starts):
        began = 1000.0 * (number + 1)
        end = weights[-1][0]
        timed = [
            (0.0, "Started vllm-x.service - vLLM."),
            *((at, _PREFIX + text) for at, text in weights),
            (end + 5.0, _PREFIX + "Available KV cache memory: 20.00 GiB"),
            (end + 5.0, "INFO:     Application startup complete."),
        ]
        for at, message in timed:
            fields = {"MESSAGE": message, "__REALTIME_TIMESTAMP": str(int((began + at) * 1e6)),
                      "_SYSTEMD_INVOCATION_ID": f"i{number}", "_SYSTEMD_UNIT": "vllm-x.service"}  # fmt: skip
            entries.append(JournalEntry.from_json(fields))
    return entries


class _Journal:
    """The unit's journal, as observing.expected_downtime reads it from Systemd."""

    def __init__(self, entries: list[JournalEntry]) -> None:
        self.entries = entries

    def journal(self, unit: str, lines: int = 0, **_: object) -> list[JournalEntry]:
        return self.entries


def _timeline(entries: list[JournalEntry]) -> list[TimedLine]:
    return [(e.realtime_us / 1e6, e.invocation_id, e.message) for e in entries]


def test_a_start_that_mapped_the_daemons_weights_is_told_from_a_disk_load() -> None:
    disk, mapped = start_timings(_timeline(_entries(DISK_START, IPC_START)))
    assert not disk.weights_mapped and disk.weights_read_s == 180.0 and disk.seconds(LOADING) == 185.0
    assert mapped.weights_mapped and mapped.weights_read_s is None and mapped.seconds(LOADING) == 6.0


def test_a_context_change_of_an_ipc_cache_unit_counts_the_attach_not_a_cold_load() -> None:
    """Issue 34 §3: the median of the recent starts took the cold loads of the days before the daemon
    (185 s each) as the restart's; the restart maps the daemon's weights (6 s, the attach)."""
    args = parse_serve_argv([MODEL, "-tp", "4", "--max-model-len", "8192", "--load-format", "ipc_cache"])
    weights = restart_weights(args, {"--max-model-len": "65536", "--gpu-memory-utilization": "0.93"})
    assert weights == "mapped"
    journal = _Journal(_entries(DISK_START, DISK_START, IPC_START))
    expected = expected_downtime(journal, "vllm-x.service", "miss", 65536, weights)  # type: ignore[arg-type]
    assert expected is not None
    loading = next(p for p in expected.phases if p.phase == LOADING)
    assert loading.seconds == 6.0 and "mapped the daemon's weights" in loading.source
    assert any("not a cold load" in note and "vllm preload" in note for note in expected.notes)
    # the unit as it was: the median of the three starts, two of them cold loads
    as_before = expected_downtime(journal, "vllm-x.service", "miss", 65536)  # type: ignore[arg-type]
    assert as_before is not None and dict((p.phase, p.seconds) for p in as_before.phases)[LOADING] == 185.0


def test_a_unit_just_moved_to_ipc_cache_takes_the_weight_read_off_its_last_disk_load() -> None:
    estimate = estimate_downtime(start_timings(_timeline(_entries(DISK_START))), "miss", 65536, "mapped")
    assert estimate is not None
    loading = next(p for p in estimate.phases if p.phase == LOADING)
    assert loading.seconds == 5.0  # 185 s of loading less the 180 s read from disk
    assert any("less its 180 s weight read" in note for note in estimate.notes)


def test_a_change_to_the_daemons_key_counts_a_cold_load_and_says_so() -> None:
    args = parse_serve_argv([MODEL, "-tp", "4", "--load-format", "ipc_cache"])
    assert restart_weights(args, {"--max-model-len": "65536", "--kv-cache-dtype": "fp8"}) == "reload"
    assert restart_weights(parse_serve_argv([MODEL, "-tp", "4"]), {"--kv-cache-dtype": "fp8"}) is None
    starts = start_timings(_timeline(_entries(DISK_START, IPC_START, IPC_START)))
    estimate = estimate_downtime(starts, "miss", 65536, "reload")
    assert estimate is not None and dict((p.phase, p.seconds) for p in estimate.phases)[LOADING] == 185.0
    assert any("weight-cache key" in note and "cold load" in note for note in estimate.notes)
    only_mapped = estimate_downtime(starts[1:], "miss", 65536, "reload")
    assert only_mapped is not None and any("lower bound" in note for note in only_mapped.notes)


def _exec_start(argv: str) -> str:
    """`systemctl show -p ExecStart` as systemd prints it (the argv[] field, words joined by spaces)."""
    return (
        f"{{ path={argv.split()[0]} ; argv[]={argv} ; ignore_errors=no ; start_time=[n/a] ; "
        "stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }"
    )


class _Units:
    """The manager's side find_preload_daemon reads: `systemctl show` and list-units."""

    def __init__(self, units: dict[str, dict[str, str]], running: tuple[str, ...]) -> None:
        self.units, self.running = units, running

    def show(self, unit: str, *props: str) -> dict[str, str]:
        return {p: v for p, v in self.units.get(unit, {}).items() if p in props}

    def environment(self, unit: str) -> dict[str, str]:
        env = self.units.get(unit, {}).get("Environment", "")
        return dict(word.split("=", 1) for word in env.split())

    def list_units(self, pattern: str = "*", all_units: bool = True) -> list[ListedUnit]:
        return [ListedUnit(u, "loaded", "active", "running", "") for u in self.running]


DAEMON = f"/opt/vllm/bin/vllm preload --model {MODEL} --tensor-parallel-size 4"
ENGINE = {"After": "network-online.target vllm-preload.service", "Requires": "vllm-preload.service"}


def test_the_daemon_named_by_the_engines_unit_is_found_with_its_model_and_gpus() -> None:
    units = _Units(
        {
            "vllm-x.service": ENGINE,
            "vllm-preload.service": {
                "ExecStart": _exec_start(DAEMON),
                "Environment": "CUDA_VISIBLE_DEVICES=4,5,6,7",
            },
        },
        ("sshd.service", "vllm-x.service", "vllm-preload.service"),
    )
    daemon = find_preload_daemon(units, "vllm-x.service")  # type: ignore[arg-type]
    assert daemon is not None and daemon.named_by_engine and daemon.unit == "vllm-preload.service"
    assert daemon.args.model == MODEL and daemon.args.tensor_parallel_size == 4
    assert daemon.text() == f"vllm-preload.service runs `vllm preload` for {MODEL} on GPUs 4,5,6,7"
    engine = parse_serve_argv([MODEL, "-tp", "4", "--load-format", "ipc_cache"])
    note, warning = daemon_findings(engine, daemon.args, daemon.text())
    assert warning is None and "vllm-preload.service" in note and "key matches" in note
    # a daemon not named by the engine's unit is found among the running services
    del units.units["vllm-x.service"]
    unnamed = find_preload_daemon(units, "vllm-x.service")  # type: ignore[arg-type]
    assert unnamed is not None and not unnamed.named_by_engine and "(no CUDA" not in unnamed.gpus


def test_a_daemon_with_another_key_or_none_at_all_is_a_warning_that_the_load_is_cold() -> None:
    fp8 = parse_serve_argv([MODEL, "-tp", "4", "--load-format", "ipc_cache", "--kv-cache-dtype", "fp8"])
    daemon = parse_serve_argv(["--model", MODEL, "--tensor-parallel-size", "4"])
    _, warning = daemon_findings(fp8, daemon, "vllm-preload.service runs `vllm preload`")
    assert warning is not None and "--kv-cache-dtype" in warning and "cold load" in warning
    units = _Units({"vllm-x.service": {}}, ("sshd.service",))
    assert find_preload_daemon(units, "vllm-x.service") is None  # type: ignore[arg-type]
    note, warning = daemon_findings(fp8, None, "")
    assert "no unit" in note and warning is not None and "not a short one" in warning


def test_a_restart_counts_the_attach_only_where_a_daemon_with_the_engines_key_runs() -> None:
    engine = parse_serve_argv([MODEL, "-tp", "4", "--load-format", "ipc_cache"])
    daemon = {"ExecStart": _exec_start(DAEMON)}
    serving = _Units({"vllm-x.service": ENGINE, "vllm-preload.service": daemon}, ())
    context = {"--max-model-len": "65536"}
    assert weights_at_restart(serving, "vllm-x.service", engine, context) == "mapped"  # type: ignore[arg-type]
    none = _Units({"vllm-x.service": {}}, ())
    assert weights_at_restart(none, "vllm-x.service", engine, context) == "reload"  # type: ignore[arg-type]
    other = _Units(
        {"vllm-x.service": ENGINE, "vllm-preload.service": {"ExecStart": _exec_start(DAEMON + " -tp 2")}}, ()
    )
    assert weights_at_restart(other, "vllm-x.service", engine, context) == "reload"  # type: ignore[arg-type]


class _Host(_Units, _Journal):
    """A unit's manager as plan_service's offer reads it: its journal, at the root `/`."""

    root = Path("/")

    def __init__(self, entries: list[JournalEntry]) -> None:
        _Units.__init__(self, {}, ())
        _Journal.__init__(self, entries)


def test_a_unit_loading_from_disk_is_offered_the_daemon_with_the_weight_load_it_would_save() -> None:
    """Issue 34 §3: a bf16 70B over TP 4 on vLLM 0.33 that loaded for 185 s at its last start: the plan
    offers `vllm preload` with the time saved and how to set it up, in its notes and its JSON."""
    args = parse_serve_argv([MODEL, "-tp", "4", "--max-model-len", "8192"])
    disk = plan(daemon=False)
    assert disk.preload_offer is None  # the planner alone reads no journal
    offered = _with_preload_offer(_Host(_entries(DISK_START)), "vllm-x.service", args, disk)  # type: ignore[arg-type]
    offer = offered.preload_offer
    assert offer is not None and offer.saved_s == 185.0
    assert offer.daemon_command == f"vllm preload --model {MODEL} --tensor-parallel-size 4"
    assert offer.room_bytes >= CUDA_CONTEXT_ESTIMATE
    record = offered.to_json()["preload_offer"]
    assert (
        record is not None
        and record["engine_flag"] == "--load-format ipc_cache"
        and record["saved_s"] == 185.0
    )
    assert offer.text() in offered.notes and "185 s" in offer.text()
    # nothing offered where the journal holds no start to say what it would save
    assert _with_preload_offer(_Host([]), "vllm-x.service", args, disk).preload_offer is None  # type: ignore[arg-type]


def test_the_daemon_is_offered_only_where_vllm_0_33_would_serve_it() -> None:
    args = parse_serve_argv([MODEL, "-tp", "4"])
    room = GIB
    assert preload_fits(args, None, (0, 33, 0), False, room)
    assert not preload_fits(args, None, (0, 30, 0), False, room)  # before `vllm preload`
    assert not preload_fits(args, None, (0, 33, 0), True, room)  # the CPU build: no CUDA IPC
    assert not preload_fits(args, "awq", (0, 33, 0), False, room)  # no pre-processed weights
    assert preload_fits(args, "fp8", (0, 33, 0), False, room)
    assert not preload_fits(args, None, (0, 33, 0), False, 100 * 2**20)  # no room for its CUDA context
    eplb = parse_serve_argv([MODEL, "-tp", "4", "--enable-eplb"])
    assert not preload_fits(eplb, None, (0, 33, 0), False, room)
    mapped = parse_serve_argv([MODEL, "-tp", "4", "--load-format", "ipc_cache"])
    assert not preload_fits(mapped, None, (0, 33, 0), False, room)  # it maps a daemon's already
    gguf = parse_serve_argv([MODEL, "--load-format", "bitsandbytes"])
    assert not preload_fits(gguf, None, (0, 33, 0), False, room)


def test_the_next_plan_keeps_the_daemons_weights_though_a_mapped_start_logged_next_to_none() -> None:
    """vLLM's "Model loading took 0.01 GiB" of a start that mapped the weights (max_memory_allocated does
    not see the daemon's tensors) is not the weights' size: taken as such, the daemon's 35 GiB per GPU
    were another tenant's and the engine's own weights nothing."""
    args = parse_serve_argv([MODEL, "-tp", "4", "--max-model-len", "8192", "--load-format", "ipc_cache"])
    mapped = Observation(
        vllm_version="0.33.0", platform="GPU", max_model_len=8192, gpu_memory_utilization=0.9,
        model_loading_gib=0.01, available_kv_gib=30.0, ready=True, total_memory_gib=80.0,
        gpu_name="NVIDIA H100 80GB HBM3",
    )  # fmt: skip
    options = PlanOptions(65_536, weights_bytes=141 * GIB)
    planned = make_plan(load_model_facts(MODEL), args, gpus(), options, (mapped,))
    gpu = planned.gpus[0]
    assert gpu.weights.bytes == WEIGHTS, gpu.weights
    assert "the preload daemon's weights among them" in gpu.used_by_others.source
