"""Weights from a `vllm preload` daemon: the engine's `--load-format ipc_cache` (vLLM 0.33.0).

`vllm preload` starts one weight-cache daemon per GPU that holds its rank's post-quantized weights
(entrypoints/cli/preload.py:L1-L18); the engine maps them over CUDA IPC. In the default "zero_copy"
mode the weights stay the daemon's: vLLM counts them as external (model_loader/weight_cache/
ipc_loader.py:L138-L154, get_external_weight_memory) and its startup check asks for
ceil(total x utilisation) minus them in free memory (v1/worker/utils.py:L716-L772, request_memory;
gpu_worker.py:L535-L544); "copy" mode clones them into the engine (nothing external). The daemon's
key (WeightCacheKey, weight_cache/protocol.py:L308-L340) holds the checkpoint, dtype, quantization,
rope parameters, KV cache dtype, TP/PP/DP sizes and ranks, expert parallelism, MoE/linear backends
and the vLLM version, not max_model_len, gpu_memory_utilization or max_num_seqs. A mismatch makes
the engine load from disk (fallback on by default, ipc_loader.py:L87-L88) while the daemon keeps its
own copy on the GPU: a change to a key flag needs the daemon restarted with it first."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypedDict

from vllm_ctxmgr.core.downtime import WeightCache
from vllm_ctxmgr.core.memory import CUDA_CONTEXT_ESTIMATE
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.core.vllm_versions import VllmVersion

IPC_CACHE = "ipc_cache"
ZERO_COPY = "zero_copy"
# ctxmgr's ServeArgs fields that are in the daemon's WeightCacheKey, with the flag that sets each
KEY_FLAGS = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "data_parallel_size": "--data-parallel-size",
    "kv_cache_dtype": "--kv-cache-dtype",
    "quantization": "--quantization",
    "dtype": "--dtype",
}
KEY_CITATION = "model_loader/weight_cache/protocol.py:L308-L340"
# flags a unit's edit may write that reach the key beyond KEY_FLAGS: rope via --hf-overrides (the
# key's rope_parameters_hash), expert parallelism and the checkpoint's revision
_OTHER_KEY_FLAGS = frozenset({"--hf-overrides", "--enable-expert-parallel", "--revision"})


def weight_cache_mode(args: ServeArgs) -> str | None:
    """ "zero_copy" or "copy" where the engine maps a daemon's weights, else None."""
    if args.load_format != IPC_CACHE:
        return None
    return args.weight_cache_mode or ZERO_COPY


def holds_external_weights(args: ServeArgs) -> bool:
    """The daemon's weights stay on the GPU as its memory, which vLLM counts as external."""
    return weight_cache_mode(args) == ZERO_COPY


def _rope(args: ServeArgs) -> dict[str, object]:
    return {k: v for k, v in (args.hf_overrides or {}).items() if "rope" in k}


def key_changes(before: ServeArgs, after: ServeArgs) -> list[str]:
    """The flags whose change alters the daemon's key: the daemon must reload with them."""
    changed = [flag for name, flag in KEY_FLAGS.items() if getattr(before, name) != getattr(after, name)]
    if _rope(before) != _rope(after):
        changed.append("--hf-overrides (rope)")
    return changed


def reload_warning(changed: list[str]) -> str:
    """What an alternative that changes a key flag must say on a weight-cache deployment."""
    return (
        f"the `vllm preload` daemon must be restarted with {', '.join(changed)} first: its weight-cache key "
        f"holds them ({KEY_CITATION}); else the engine loads from disk next to the daemon's copy"
    )


def unchanged_key_note(args: ServeArgs) -> str:
    """The plan line of a weight-cache deployment: a context change keeps the daemon's weights."""
    external = (
        "its weights on each GPU are external to the engine: vLLM's startup check asks for the requested "
        "memory less them (v1/worker/utils.py:L716-L772), as the plan does"
        if holds_external_weights(args)
        else "copy mode: the engine clones the weights, nothing is external"
    )
    return (
        "weights from the `vllm preload` daemon (--load-format ipc_cache): max_model_len, "
        f"gpu_memory_utilization and max_num_seqs are not in its key ({KEY_CITATION}), so it keeps serving "
        f"them across this change; {external}"
    )


def restart_weights(args: ServeArgs, flag_changes: Iterable[str]) -> WeightCache | None:
    """How a restart with these flags written gets its weights (core/downtime.py): None where the unit
    reads them from disk itself; "reload" where a written flag is in the daemon's key; else "mapped"."""
    if weight_cache_mode(args) is None:
        return None
    key = set(KEY_FLAGS.values()) | _OTHER_KEY_FLAGS
    return "reload" if key & set(flag_changes) else "mapped"


def daemon_findings(engine: ServeArgs, daemon: ServeArgs | None, daemon_text: str) -> tuple[str, str | None]:
    """The plan's line on the `vllm preload` daemon an ipc_cache engine maps (`daemon_text`: its unit,
    model and GPUs), and a warning where the engine would not get its weights from it: vLLM then loads
    from disk (fallback on by default, ipc_loader.py:L249-L254), a cold load beside the daemon's copy."""
    fallback = "ipc_loader.py:L249-L254: the engine falls back to a cold load from disk"
    if daemon is None:
        return (
            "weight-cache daemon: no unit of this host's manager runs `vllm preload`",
            f"--load-format ipc_cache, but no `vllm preload` daemon was found ({fallback}, so a restart "
            "is not a short one)",
        )
    changed = key_changes(daemon, engine)
    if daemon.model != engine.model:
        changed.insert(0, f"the model ({daemon.model})")
    if not changed:
        return f"weight-cache daemon: {daemon_text}; its key matches this engine's", None
    return (
        f"weight-cache daemon: {daemon_text}",
        f"the `vllm preload` daemon's weight-cache key differs from this engine's in {', '.join(changed)} "
        f"({KEY_CITATION}; {fallback} next to the daemon's copy): restart the daemon with the engine's flags",
    )


# Where `vllm preload` can serve a unit that loads from disk today (vLLM 0.33.0's own limits):
PRELOAD_SINCE: VllmVersion = (0, 31)  # the release that added `vllm preload` (entrypoints/cli/preload.py)
# quant methods with supports_pre_processed_weights (layers/quantization/base_config.py:L36 is False):
# unquantized linear (linear.py:L169), fp8 (fp8.py:L239, L478), ModelOpt NVFP4 (modelopt.py:L848,
# L2600-L2611), MXFP4 MoE (mxfp4.py:L547); any other raises UnsupportedQuantForIPCError (protocol.py:L97)
PRELOAD_QUANTIZATION = frozenset({"fp8", "modelopt_fp4", "mxfp4"})
# the daemon loads with the default loader (preload.py:L233-L237); a unit on another load format
# (bitsandbytes, gguf, ...) is not one it serves as is
DISK_LOAD_FORMATS = frozenset({"auto", "safetensors"})


class PreloadOfferRecord(TypedDict):
    """PreloadOffer.to_json(), a plan's `preload_offer`."""

    saved_s: float
    source: str
    daemon_command: str
    engine_flag: str
    room_bytes: int


@dataclass(frozen=True)
class PreloadOffer:
    """A unit that loads its weights from disk at every restart, which a `vllm preload` daemon would
    serve: the time each restart would save and how to set it up."""

    saved_s: float  # the weight load of the last start (the loading phase), which the attach replaces
    source: str
    daemon_command: str
    room_bytes: int  # the least free memory per GPU above the request: the daemon's own CUDA context

    def text(self) -> str:
        return (
            f"a `vllm preload` daemon would save about {self.saved_s:.0f} s of each restart ({self.source}): "
            f"run `{self.daemon_command}` in its own unit (Before= this one, which Requires= it) and add "
            f"{IPC_FLAG} to this unit (vLLM 0.31+); the weights stay in the daemon's memory, mapped by the "
            "engine (ipc_loader.py:L138-L154)"
        )

    def to_json(self) -> PreloadOfferRecord:
        return {
            "saved_s": round(self.saved_s, 1),
            "source": self.source,
            "daemon_command": self.daemon_command,
            "engine_flag": IPC_FLAG,
            "room_bytes": self.room_bytes,
        }


IPC_FLAG = "--load-format ipc_cache"


def preload_fits(
    args: ServeArgs, quantization: str | None, version: VllmVersion, cpu: bool, room_bytes: int | None
) -> bool:
    """Whether a `vllm preload` daemon could serve this unit: vLLM 0.31+, a CUDA/ROCm GPU (protocol.py:
    L76-L93), no EPLB (ipc_loader.py:L224-L225), a quantization with pre-processed weights, the
    default loader, and room per GPU for the daemon's CUDA context (`room_bytes`: the least free memory
    above vLLM's request; the weights move to the daemon, counted once, external to the engine)."""
    quant = args.quantization or quantization
    return (
        weight_cache_mode(args) is None
        and version >= PRELOAD_SINCE
        and not cpu
        and "--enable-eplb" not in args.given_flags
        and (quant is None or quant in PRELOAD_QUANTIZATION)
        and (args.load_format is None or args.load_format in DISK_LOAD_FORMATS)
        and room_bytes is not None
        and room_bytes >= CUDA_CONTEXT_ESTIMATE
    )


def preload_command(args: ServeArgs) -> str:
    """The daemon's command: the model and the unit's flags that are in the key, as the unit sets them."""
    words = ["vllm", "preload", "--model", args.model]
    for name, flag in KEY_FLAGS.items():
        value = getattr(args, name)
        if value not in (None, 1, "auto"):  # vLLM's defaults: the daemon's are the same
            words += [flag, str(value)]
    return " ".join(words)
