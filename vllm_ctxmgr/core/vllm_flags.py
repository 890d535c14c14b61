"""Every `vllm serve` flag, and what each does to GPU memory as ctxmgr plans it.

The flag list is data generated from the parser of every vLLM minor release 0.10 .. 0.33
(core/vllm_flag_list.py, written by benchmarks/vllm_flags_table.py from each release's engine/arg_utils.py
add_cli_args and the cli_args.py make_arg_parser `vllm serve` uses), with the releases each flag is in.
Each flag is classified here, by hand, in one of three ways:

- modelled: the plan counts it; `MODELLED` names the term it moves;
- no GPU-memory effect: the API server, logging, networking, tokenizer, parsers, timeouts ...;
- not modelled: it changes what vLLM holds on a GPU and ctxmgr does not count it. The plan names it
  ("changes GPU memory, not modelled: --foo") and widens every GPU's margin by its family's share of
  the GPU (`FAMILIES`): the plan cannot say how much the flag takes, so it keeps that much spare
  instead of a silent "fits". A flag that can only lower vLLM's memory is named without widening.

`flag(name)` reads the union of every release: a unit may run an older vLLM. Where the unit's vLLM is
known, `flag_in` / `unrecognized` read its release only, so a flag that release lacks is refused the
way its argparse refuses it. tests/core/test_vllm_flags.py checks that every flag of the union is
classified and that every entry here names a real flag.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from vllm_ctxmgr.core.vllm_flag_list import ALIAS_RELEASES, RELEASES, VLLM_FLAGS
from vllm_ctxmgr.core.vllm_versions import VllmVersion

FLAG_LIST_VERSION: VllmVersion = tuple(int(p) for p in RELEASES[-1].split("."))
_LISTED_MINORS = frozenset(int(v.split(".")[1]) for v in RELEASES)


@dataclass(frozen=True)
class VllmFlag:
    """One option of vLLM's parser: its option strings, the config field it sets, how it takes a value.

    kind: json (a dataclass or dict: JSON, or the dotted `--flag.key value` form), bool
    (BooleanOptionalAction: `--no-flag` too), switch (store_true), optional (bare, or one value),
    list (nargs "+"), value (one word). Option strings, dest, class and kind are those of the newest
    release that has the flag.
    """

    name: str
    aliases: tuple[str, ...]
    dest: str
    config_class: str
    kind: str
    releases: str  # the minor releases whose parser has it: "0.10-0.16", "0.10-0.12,0.20-0.33"
    source: str  # file:line under vllm/ in the newest of those releases

    @property
    def minors(self) -> frozenset[int]:
        return _minors(self.releases)


def _minors(releases: str) -> frozenset[int]:
    """'0.10-0.12,0.20' -> {10, 11, 12, 20}."""
    out: set[int] = set()
    for part in releases.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low.split(".")[1]), int((high or low).split(".")[1]) + 1))
    return frozenset(out)


def _table() -> tuple[dict[str, VllmFlag], dict[str, str]]:
    flags: dict[str, VllmFlag] = {}
    aliases: dict[str, str] = {}
    for names, dest, cls, kind, releases, source in VLLM_FLAGS:
        flag = VllmFlag(names[0], tuple(names[1:]), dest, cls, kind, releases, source)
        flags[flag.name] = flag
        for alias in flag.aliases:
            # an alias the newest release dropped is not read as one: 0.10 - 0.11's `-O` for
            # --compilation-config is FlexibleArgumentParser's -O (--optimization-level) since 0.12
            if FLAG_LIST_VERSION[1] in _minors(ALIAS_RELEASES.get(alias, releases)):
                aliases[alias] = flag.name
    return flags, aliases


FLAGS, ALIASES = _table()


def canonical_name(word: str) -> str:
    """`--max_model_len=5` -> `--max-model-len`, `-tp` -> `--tensor-parallel-size`, as vLLM's parser
    reads them (FlexibleArgumentParser turns underscores before the first dot into dashes); a dotted
    `--x.key` keeps its key. An unknown word comes back normalised but otherwise as given."""
    name = word.split("=", 1)[0]
    head, dot, tail = name.partition(".")
    if head.startswith("--"):
        head = "--" + head[2:].replace("_", "-")
    head = ALIASES.get(head, head)
    return head + dot + tail


def flag(name: str) -> VllmFlag | None:
    """The flag a canonical name means (a dotted `--x.key` means `--x`), None where vLLM has none."""
    base = name.split(".", 1)[0]
    if base.startswith("--no-") and base not in FLAGS:
        positive = FLAGS.get("--" + base[5:])
        return positive if positive is not None and positive.kind == "bool" else None
    return FLAGS.get(base)


def in_release(known: VllmFlag, version: VllmVersion | None) -> bool:
    """Whether the parser of vLLM `version` has this flag. Unknown (None), or a release outside the ones
    read (before 0.10, after the newest): True, as the union reads it. A patch release (0.11.2) may have
    a flag its minor's .0 lacked and the next minor has, so either admits it: ctxmgr must never refuse
    a flag the unit's vLLM has, and only the .0 releases were read."""
    if version is None or version[0] != 0 or version[1] not in _LISTED_MINORS:
        return True
    minors = known.minors
    patched = len(version) > 2 and version[2] > 0
    return version[1] in minors or (patched and version[1] + 1 in minors)


def flag_in(name: str, version: VllmVersion | None) -> VllmFlag | None:
    """`flag(name)` as the parser of vLLM `version` has it: None where that release has no such flag
    (argparse: "unrecognized arguments"). Where the version is unknown, as `flag(name)`: any release's."""
    known = flag(name)
    return known if known is not None and in_release(known, version) else None


def unrecognized(
    flags: dict[str, str | bool], version: VllmVersion | None, shown: str = "", whose: str = "this unit runs"
) -> str | None:
    """argparse's refusal, as `vllm serve` prints it, of the flags that some release has but the parser of
    vLLM `version` does not, with the releases that do have each; None where there are none. `flags`:
    canonical name -> value as given (ServeArgs.flags). A flag no release has is left alone: a plugin's
    parser hook may add it. `shown`: the version as the unit reports it ("0.33.0+cpu"); `whose`: where that
    version came from, as the message says it."""
    missing = [
        (name, value, known)
        for name, value in flags.items()
        if (known := flag(name)) is not None and not in_release(known, version)
    ]
    if not missing:
        return None
    # argparse lists every word it could not place: the flag and its value
    words = [_as_given(name, value) for name, value, _known in missing]
    where = ", ".join(f"{name} is in vLLM {known.releases}" for name, _value, known in missing)
    running = shown or ".".join(map(str, version or ()))
    return f"vllm serve: error: unrecognized arguments: {' '.join(words)} ({where}; {whose} {running})"


def _as_given(name: str, value: str | bool) -> str:
    if value is False:
        return "--no-" + name[2:]
    return name if value is True else f"{name} {value}"


def closest(name: str, version: VllmVersion | None = None) -> str | None:
    """The real flag a typo most likely meant (difflib), for "not a vLLM flag" messages; among the flags
    of vLLM `version` where that is known."""
    names = [n for n, known in FLAGS.items() if in_release(known, version)]
    matches = difflib.get_close_matches(name.split(".", 1)[0], names, n=1, cutoff=0.6)
    return matches[0] if matches else None


# --------------------------------------------------------------------------------------------------
# What each flag does to GPU memory
# --------------------------------------------------------------------------------------------------

# flag -> the term of the plan it moves (and where vLLM does it)
MODELLED: dict[str, str] = {
    "--model": "the checkpoint: layers, KV geometry, weights",
    "--max-model-len": "KV need per request (config/model.py)",
    "--tensor-parallel-size": "KV heads and weights per GPU",
    "--pipeline-parallel-size": "layers and weights per stage",
    "--decode-context-parallel-size": "KV tokens per rank",
    "--data-parallel-size": "engines planned; routed experts split over DP x TP (fused_moe/config.py)",
    "--enable-expert-parallel": "whole experts per GPU instead of shards: the same bytes over DP x TP",
    "--kv-cache-dtype": "KV bytes per token",
    "--dtype": "KV bytes per token; weights cast to it (model_executor/model_loader/utils.py)",
    "--block-size": "KV block rounding",
    "--max-num-batched-tokens": "profile-run activation, sliding-window in-flight tokens",
    "--max-num-seqs": "sampler pass and CUDA-graph capture sizes",
    "--gpu-memory-utilization": "the requested memory",
    "--kv-cache-memory-bytes": "the KV budget",
    "--enable-prefix-caching": "mamba cache mode (align: extra state blocks)",
    "--enforce-eager": "CUDA graphs (none)",
    "--disable-sliding-window": "sliding layers keep every token; the derived maximum",
    "--disable-hybrid-kv-cache-manager": "sliding/chunked layers allocated as full attention",
    "--enable-chunked-prefill": "off: max_num_batched_tokens = max(max_model_len, default)",
    "--speculative-config": "MTP draft layers' KV, speculative mamba state (config/speculative.py)",
    "--spec-method": "as --speculative-config method",
    "--spec-tokens": "as --speculative-config num_speculative_tokens",
    "--quantization": "weights: online quantization of a 16-bit checkpoint",
    "--load-format": "weights: bitsandbytes quantizes them in place",
    "--cpu-offload-gb": "weights on the GPU drop by that much (model_executor/offloader/uva.py)",
    "--hf-overrides": "max_position_embeddings / rope_scaling / rope_parameters / use_sliding_window "
    "before the derived maximum (config/model.py _apply_dict_overrides)",
    "--rope-scaling": "the derived maximum (vLLM before 0.11: config/model.py)",
    "--rope-theta": "no memory: RoPE base only",
    "--kv-transfer-config": "a connector without SupportsHMA: no hybrid KV manager (config/vllm.py)",
    "--mamba-cache-dtype": "conv state dtype (model_executor/layers/mamba/mamba_utils.py)",
    "--mamba-ssm-cache-dtype": "SSM / delta-net state dtype (mamba_utils.py)",
    "--async-scheduling": "max_concurrent_batches: sliding-window in-flight tokens (config/vllm.py)",
    "--performance-mode": "throughput doubles the default max_num_batched_tokens (engine/arg_utils.py)",
    "--served-model-name": "none (read for the probe)",
    "--host": "none (read for the probe)",
    "--port": "none (read for the probe)",
    "--api-key": "none (read for the probe)",
    "--config": "vLLM's YAML: its flags are read as if on the command line",
}

# families of not-modelled flags: (share of each GPU's memory added to the margin, why that much)
FAMILIES: dict[str, tuple[float, str]] = {
    "lora": (
        0.05,
        "the stacked LoRA A/B buffers of every wrapped linear (max_loras x max_lora_rank per layer) "
        "are loaded with the weights",
    ),
    "multimodal": (0.05, "the encoder's profile run and encoder cache at the limits given"),
    "speculative draft": (0.10, "a draft model's weights, KV cache, graphs and dummy run"),
    "cuda graphs": (0.03, "graph memory is in the KV budget from vLLM 0.21"),
    "kv layout": (0.02, "a changed KV page or state layout"),
    "expert parallel": (0.05, "expert placement, redundant experts or all2all buffers"),
    "kernels": (0.01, "kernel workspaces"),
    "model code": (0.05, "another model implementation or config than the one ctxmgr reads"),
    "allocator": (0.02, "another allocator's pool and fragmentation"),
    "lowers memory": (0.0, "it can only lower what vLLM holds, so the plan stays on the safe side"),
    "other": (0.02, "a buffer ctxmgr does not size"),
}

# flag -> (family, what it changes). The LoRA flags are counted for dense attention models
# (core/deployment.py lora_bytes) and named for the others.
NOT_MODELLED: dict[str, tuple[str, str]] = {
    # LoRA (config/lora.py; lora/layers)
    "--enable-lora": ("lora", "LoRA buffers"),
    "--max-loras": ("lora", "LoRA slots"),
    "--max-lora-rank": ("lora", "LoRA rank"),
    "--lora-dtype": ("lora", "LoRA buffer dtype"),
    "--enable-tower-connector-lora": ("lora", "LoRA on the vision tower"),
    "--fully-sharded-loras": ("lora", "LoRA sharding"),
    "--lora-target-modules": ("lora", "which linears get LoRA"),
    "--specialize-active-lora": ("lora", "LoRA graph variants"),
    "--enable-mixed-moe-lora-format": ("lora", "MoE LoRA buffers"),
    "--enable-moe-shared-loras": ("lora", "MoE LoRA buffers"),
    "--max-lora-cls-labels": ("lora", "LoRA classifier heads"),
    "--lora-modules": ("lora", "adapters loaded at start"),
    # multimodal (config/multimodal.py)
    "--limit-mm-per-prompt": ("multimodal", "the encoder's profile run"),
    "--mm-processor-kwargs": ("multimodal", "encoder input sizes"),
    "--mm-encoder-tp-mode": ("multimodal", "encoder weights per GPU"),
    "--mm-encoder-attn-backend": ("multimodal", "encoder attention workspace"),
    "--mm-encoder-attn-dtype": ("multimodal", "encoder attention dtype"),
    "--mm-encoder-fp8-scale-path": ("multimodal", "fp8 encoder attention"),
    "--mm-encoder-only": ("multimodal", "no language model"),
    "--skip-mm-profiling": ("multimodal", "the encoder's profile run skipped"),
    "--video-pruning-rate": ("multimodal", "encoder tokens per video"),
    "--video-pruning-method": ("multimodal", "encoder tokens per video"),
    "--mm-tensor-ipc": ("multimodal", "multimodal tensors over GPU IPC"),
    "--mm-processor-device": ("multimodal", "preprocessing on a GPU"),
    "--mm-ipc-gpu-memory-gb": ("multimodal", "reserved out of the KV budget (multimodal/gpu_ipc_memory.py)"),
    "--enable-mm-embeds": ("multimodal", "embedding inputs"),
    "--language-model-only": ("lowers memory", "the vision tower is not built"),
    "--ec-transfer-config": ("multimodal", "encoder cache transfer buffers"),
    "--ec-manager-config": ("multimodal", "encoder cache manager"),
    "--enable-flash-late-interaction": ("other", "MaxSim scoring on a GPU in the API server"),
    # speculative decoding with a draft model
    "--spec-model": ("speculative draft", "a draft model"),
    # CUDA graphs and compilation (config/compilation.py)
    "--compilation-config": ("cuda graphs", "cudagraph_mode, capture sizes"),
    "--cudagraph-capture-sizes": ("cuda graphs", "graph capture sizes"),
    "--max-cudagraph-capture-size": ("cuda graphs", "graph capture sizes"),
    "--optimization-level": ("cuda graphs", "compilation and graph mode"),
    "--sleep-mode-offload-cudagraph": ("cuda graphs", "graph pool handling"),
    # KV and state layout (config/cache.py)
    "--num-gpu-blocks-override": ("kv layout", "the number of KV blocks"),
    "--kv-cache-dtype-skip-layers": ("kv layout", "per-layer KV dtype"),
    "--kv-sharing-fast-prefill": ("kv layout", "KV sharing"),
    "--swa-bounded-replay": ("kv layout", "sliding-window blocks kept"),
    "--mamba-block-size": ("kv layout", "mamba state blocks"),
    "--mamba-cache-mode": ("kv layout", "mamba state blocks per request"),
    "--enable-mamba-shared-prefix-checkpoint": ("kv layout", "mamba checkpoints"),
    "--prefix-match-unit": ("kv layout", "mamba checkpoint unit"),
    "--use-replayssm": ("kv layout", "SSM replay buffers"),
    "--replayssm-buffer-len": ("kv layout", "SSM replay buffers"),
    "--mamba-backend": ("kv layout", "mamba state layout"),
    "--attention-backend": ("kv layout", "block size and page layout of the backend"),
    "--attention-config": ("kv layout", "attention backend options"),
    "--prefill-context-parallel-size": ("kv layout", "KV split across prefill context parallel ranks"),
    "--kv-offloading-size": ("kv layout", "KV offloading through a connector"),
    "--kv-offloading-backend": ("kv layout", "KV offloading through a connector"),
    "--max-num-active-seqs": ("other", "active sequences"),
    "--max-num-scheduled-tokens": ("other", "tokens per step"),
    "--scheduler-cls": ("other", "a custom scheduler"),
    # weights (quantization, offload, loaders)
    "--quantization-config": ("model code", "quantization options"),
    "--cpu-offload-params": ("lowers memory", "which parameters are offloaded"),
    "--offload-backend": ("lowers memory", "weight offloading"),
    "--offload-group-size": ("lowers memory", "prefetch offloading of weights"),
    "--offload-num-in-group": ("lowers memory", "prefetch offloading of weights"),
    "--offload-prefetch-step": ("other", "prefetch buffers"),
    "--offload-params": ("lowers memory", "prefetch offloading of weights"),
    "--weight-transfer-config": ("other", "weight transfer buffers"),
    # another model or model implementation than the files ctxmgr reads
    "--hf-config-path": ("model code", "another config.json"),
    "--revision": ("model code", "another revision of the checkpoint"),
    "--config-format": ("model code", "another config format"),
    "--model-impl": ("model code", "another model implementation"),
    "--model-class-overrides": ("model code", "another model class"),
    "--runner": ("model code", "pooling runner: other profile and KV"),
    "--convert": ("model code", "converted model head"),
    "--pooler-config": ("model code", "pooling head"),
    "--worker-cls": ("model code", "a custom worker"),
    "--additional-config": ("model code", "platform-specific options"),
    "--diffusion-config": ("model code", "diffusion decoding"),
    "--engram-config": ("model code", "engram memory"),
    "--logits-processors": ("other", "custom logits processors"),
    "--aux-output-config": ("other", "auxiliary output buffers"),
    "--enable-return-routed-experts": ("other", "routed-expert capture buffer"),
    "--return-sampling-mask": ("other", "sampling mask buffer"),
    "--logprobs-mode": ("other", "processed logits kept for logprobs"),
    "--use-fp64-gumbel": ("other", "float64 sampling noise"),
    "--enable-trace-replay": ("other", "trace replay buffers"),
    "--enable-prompt-embeds": ("other", "prompt embedding inputs"),
    "--watermark-config": ("other", "watermark logits processing"),
    # allocators
    "--enable-sleep-mode": ("allocator", "CuMem allocator pool"),
    "--sleep-mode-backend": ("allocator", "sleep mode allocator"),
    "--enable-cumem-allocator": ("allocator", "CuMem allocator pool"),
    # expert and data parallelism
    "--enable-eplb": ("expert parallel", "redundant experts"),
    "--eplb-config": ("expert parallel", "redundant experts"),
    "--all2all-backend": ("expert parallel", "all2all buffers"),
    "--enable-elastic-ep": ("expert parallel", "elastic EP buffers"),
    "--elastic-ep-max-dp-size": ("expert parallel", "elastic EP buffers"),
    "--enable-dbo": ("expert parallel", "dual-batch overlap micro-batches"),
    "--ubatch-size": ("expert parallel", "micro-batches"),
    "--enable-hc-sp": ("expert parallel", "sequence parallel buffers"),
    "--enable-batch-sharded-sampling": ("other", "sampler sharding"),
    "--data-parallel-size-local": ("other", "engines on this host"),
    "--device-ids": ("other", "which GPUs"),
    "--disable-custom-all-reduce": ("lowers memory", "custom all-reduce buffers dropped"),
    # kernels
    "--moe-backend": ("kernels", "MoE kernel workspace"),
    "--linear-backend": ("kernels", "linear kernel workspace"),
    "--kernel-config": ("kernels", "kernel options"),
    "--monokernel": ("kernels", "fused kernel workspace"),
    "--gdn-prefill-backend": ("kernels", "GDN prefill workspace"),
    "--kda-prefill-backend": ("kernels", "KDA prefill workspace"),
    "--kda-decode-backend": ("kernels", "KDA decode workspace"),
    "--sparse-indexer-topk-backend": ("kernels", "indexer top-k workspace"),
    # flags of older releases only (their releases: vllm_flag_list.py) that changed GPU memory there
    "--max-seq-len-to-capture": ("cuda graphs", "graph capture sizes"),
    "--cuda-graph-sizes": ("cuda graphs", "graph capture sizes"),
    "--swap-space": ("lowers memory", "CPU swap space"),
    "--enable-mamba-fine-grained-prefix-cache": ("kv layout", "mamba state blocks per request"),
    "--enable-bf16x3-router-gemm": ("kernels", "router GEMM workspace"),
    "--override-attention-dtype": ("kv layout", "attention dtype"),
    "--use-gpu-for-pooling-score": ("other", "pooling scores on a GPU in the API server"),
    "--override-pooler-config": ("model code", "pooling head"),
    "--num-redundant-experts": ("expert parallel", "redundant experts"),
    "--enable-lora-bias": ("lora", "LoRA bias buffers"),
    "--lora-extra-vocab-size": ("lora", "LoRA extra vocabulary"),
    "--enable-prompt-adapter": ("other", "prompt adapter buffers"),
}

# config classes whose every flag leaves the GPU alone (unless listed above)
NO_EFFECT_CLASSES: dict[str, str] = {
    "BaseFrontendArgs": "the API server process (CPU)",
    "FrontendArgs": "the API server process (CPU)",
    "ObservabilityConfig": "metrics and tracing",
    "StructuredOutputsConfig": "output parsing",
    "LoadConfig": "where and how weights are read",
}

# flags of other classes that leave the GPU alone: why
NO_EFFECT: dict[str, str] = {
    "--headless": "process layout",
    "--api-server-count": "API server processes (CPU)",
    "--grpc": "server protocol",
    "--tokenizer": "tokenizer",
    "--tokenizer-mode": "tokenizer",
    "--tokenizer-revision": "tokenizer",
    "--skip-tokenizer-init": "tokenizer",
    "--trust-remote-code": "permission to run the checkpoint's code (the config is read either way)",
    "--seed": "random seed",
    "--allowed-local-media-path": "media access",
    "--allowed-media-domains": "media access",
    "--code-revision": "code revision",
    "--allow-deprecated-quantization": "a check",
    "--max-logprobs": "a request limit",
    "--disable-cascade-attn": "kernel choice, no buffer",
    "--hf-token": "credentials",
    "--generation-config": "sampling defaults",
    "--override-generation-config": "sampling defaults",
    "--sleep-preserve-parameter-names": "sleep mode bookkeeping",
    "--enable-nccl-comm-suspend": "sleep mode behaviour",
    "--io-processor-plugin": "request processing (CPU)",
    "--renderer-num-workers": "request rendering (CPU)",
    "--mamba-ssu-algorithm": "kernel algorithm",
    "--enable-mamba-cache-stochastic-rounding": "rounding mode",
    "--mamba-cache-philox-rounds": "rounding mode",
    "--distributed-executor-backend": "process launcher",
    "--master-addr": "networking",
    "--master-port": "networking",
    "--nnodes": "multi-node layout",
    "--node-rank": "multi-node layout",
    "--distributed-timeout-seconds": "timeout",
    "--cpu-distributed-timeout-seconds": "timeout",
    "--numa-bind": "CPU affinity",
    "--numa-bind-nodes": "CPU affinity",
    "--numa-bind-cpus": "CPU affinity",
    "--dcp-comm-backend": "communication pattern",
    "--dcp-q-replicate": "communication pattern",
    "--dcp-kv-cache-interleave-size": "token interleaving, same bytes",
    "--cp-kv-cache-interleave-size": "token interleaving, same bytes",
    "--data-parallel-rank": "which rank this process is",
    "--data-parallel-start-rank": "which ranks this host runs",
    "--data-parallel-address": "networking",
    "--data-parallel-rpc-port": "networking",
    "--data-parallel-backend": "process launcher",
    "--data-parallel-hybrid-lb": "load balancing",
    "--data-parallel-external-lb": "load balancing",
    "--data-parallel-multi-port-external-lb": "load balancing",
    "--enable-ep-weight-filter": "loading speed",
    "--enable-shm-tensor-arena": "host shared memory",
    "--dbo-decode-token-threshold": "a threshold",
    "--dbo-prefill-token-threshold": "a threshold",
    "--dp-sync-interval": "synchronisation",
    "--disable-nccl-for-dp-synchronization": "synchronisation",
    "--expert-placement-strategy": "which experts, same count",
    "--max-parallel-loading-workers": "loading speed",
    "--ray-workers-use-nsight": "profiling",
    "--worker-extension-cls": "worker methods",
    "--enable-fault-tolerance": "restarts",
    "--fault-tolerance-config": "restarts",
    "--prefix-caching-hash-algo": "hashing (CPU)",
    "--prefix-cache-retention-interval": "eviction policy",
    "--media-io-kwargs": "media decoding (CPU)",
    "--mm-processor-cache-gb": "processor cache (host memory)",
    "--mm-processor-cache-type": "processor cache (host memory)",
    "--mm-hasher-algorithm": "hashing (CPU)",
    "--mm-shm-cache-max-object-size-mb": "host shared memory",
    "--mm-encoder-fp8-scale-save-path": "a file to write",
    "--mm-encoder-fp8-scale-save-margin": "a file to write",
    "--interleave-mm-strings": "prompt format",
    "--mm-device-do-normalize": "preprocessing option",
    "--max-cpu-loras": "host memory",
    "--default-mm-loras": "request defaults",
    "--logging-config": "logging",
    "--log-level": "logging",
    "--log-config-file": "logging",
    "--max-num-queued-reqs": "queue limit",
    "--max-num-queued-tokens": "queue limit",
    "--long-prefill-token-threshold": "scheduling policy",
    "--long-prefill-token-threshold-adaptive": "scheduling policy",
    "--scheduling-policy": "scheduling policy",
    "--disable-chunked-mm-input": "scheduling policy",
    "--scheduler-reserve-full-isl": "scheduling policy",
    "--watermark": "scheduling policy",
    "--prefill-schedule-interval": "scheduling policy",
    "--stream-interval": "streaming",
    "--ir-op-priority": "kernel choice",
    "--enable-flashinfer-autotune": "start-up tuning",
    "--kv-events-config": "event publishing (CPU)",
    "--reasoning-config": "output parsing",
    "--structured-outputs-config": "output parsing (a token bitmask of max_num_seqs x vocab / 32 words)",
    "--profiler-config": "profiling, when asked",
    "--watchdog-config": "watchdog",
    "--disable-log-stats": "logging",
    "--aggregate-engine-logging": "logging",
    "--fail-on-environ-validation": "a check",
    "--shutdown-timeout": "timeout",
    "--enable-log-requests": "logging",
    # flags of older releases only (their releases: vllm_flag_list.py) that leave the GPU alone
    "--disable-log-requests": "logging",
    "--num-scheduler-steps": "scheduling",
    "--preemption-mode": "scheduling",
    "--scheduler-delay-factor": "scheduling",
    "--multi-step-stream-outputs": "streaming",
    "--max-num-partial-prefills": "scheduling policy",
    "--max-long-partial-prefills": "scheduling policy",
    "--guided-decoding-backend": "output parsing",
    "--guided-decoding-disable-fallback": "output parsing",
    "--guided-decoding-disable-any-whitespace": "output parsing",
    "--guided-decoding-disable-additional-properties": "output parsing",
    "--logits-processor-pattern": "a request option",
    "--task": "the runner: read as --runner",
    "--num-lookahead-slots": "scheduling",
    "--disable-async-output-proc": "output processing",
    "--disable-mm-preprocessor-cache": "processor cache (host memory)",
    "--override-neuron-config": "Neuron only",
    "--enable-multimodal-encoder-data-parallel": "encoder placement",
    "--calculate-kv-scales": "fp8 KV scales computed in the first passes, no buffer",
    "--eplb-window-size": "EPLB schedule",
    "--eplb-step-interval": "EPLB schedule",
    "--eplb-log-balancedness": "logging",
}


@dataclass(frozen=True)
class FlagClass:
    """How the plan treats a flag: effect is "modelled", "none" or "not modelled"."""

    effect: str
    detail: str
    family: str | None = None  # not modelled: the family whose share widens the margin


def classify(name: str) -> FlagClass | None:
    """The class of a canonical flag name (`--no-x` is `--x`); None for a flag vLLM does not have."""
    known = flag(name)
    if known is None:
        return None
    base = known.name
    if base in MODELLED:
        return FlagClass("modelled", MODELLED[base])
    if base in NOT_MODELLED:
        family, detail = NOT_MODELLED[base]
        return FlagClass("not modelled", detail, family)
    if base in NO_EFFECT:
        return FlagClass("none", NO_EFFECT[base])
    if known.config_class in NO_EFFECT_CLASSES:
        return FlagClass("none", NO_EFFECT_CLASSES[known.config_class])
    return FlagClass("not modelled", "unclassified", "other")


def widening_fraction(families: set[str]) -> float:
    """The margin added, as a share of each GPU, for the families of the not-modelled flags given."""
    return sum(FAMILIES[f][0] for f in families)
