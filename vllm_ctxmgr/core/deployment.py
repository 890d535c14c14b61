"""The deployment around the model: the vLLM flags that move GPU memory outside the KV layout.

Pure. The planner (core/plan.py) calls these hooks:

- `vllm_refusals`: what vLLM refuses at config time for these flags and this context, with vLLM's
  own message, so a plan refuses it before anything is touched;
- `not_modelled_flags` / `widening_bytes`: the unit's flags that change GPU memory and that the plan
  does not count (core/vllm_flags.py's table), named in the plan, and the margin they add;
- `gpu_weights`: the weights a GPU holds after `--cpu-offload-gb`, online quantization
  (`--quantization fp8_per_tensor` ..., bitsandbytes) and a `--dtype` cast;
- `scheduler_args`: `--no-enable-chunked-prefill` and `--performance-mode throughput` as vLLM turns
  them into max_num_batched_tokens (engine/arg_utils.py `_set_default_max_num_seqs_and_batched_tokens_args`);
- core/kv_connectors.py: a KV connector without SupportsHMA turns the hybrid KV cache manager off
  (config/vllm.py), per version as data; core/kv/layout.py applies it.

Every rule cites the vLLM 0.33.0 file it mirrors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_ctxmgr.core.facts import DTYPE_BYTES, ModelFacts
from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.json_types import JSONObject
from vllm_ctxmgr.core.kv_connectors import connector_supports_hma
from vllm_ctxmgr.core.plan_record import NotModelledFlagRecord
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.core.vllm_flags import FAMILIES, classify, flag, unrecognized
from vllm_ctxmgr.core.vllm_versions import parse_vllm_version

VllmVersion = tuple[int, int, int]

# ---- refusals ------------------------------------------------------------------------------------

# online quantization names of 0.33 (config/quantization.py _ONLINE_SHORTHANDS) and the bytes per
# weight of a quantized linear (payload + scales); embeddings and lm_head are not LinearBase, so stay
ONLINE_QUANT_BYTES_PER_WEIGHT: dict[str, float] = {
    "fp8_per_tensor": 1.0,
    "fp8_per_block": 1.0 + 4 / (128 * 128),
    "fp8_per_channel": 1.0,
    "int8_per_channel_weight_only": 1.0,
    "mxfp8": 1.0 + 1 / 32,
    "nvfp4_per_token": 0.5 + 1 / 16,
    "fp8": 1.0,  # before 0.33: --quantization fp8 quantized a 16-bit checkpoint online
    # bitsandbytes in-flight 4-bit: nf4 payload + one float32 absmax per 64 weights
    "bitsandbytes": 0.5 + 4 / 64,
}
FP8_ONLINE_REFUSED_SINCE: VllmVersion = (0, 33, 0)


def vllm_refusals(
    args: ServeArgs,
    target: int,
    facts: ModelFacts,
    version: VllmVersion,
    default_mnbt: int,
    *,
    gpu: bool = True,
) -> list[str]:
    """vLLM's config-time ValueErrors for these flags at `target` tokens, in vLLM's words (`gpu`: a
    CUDA/ROCm platform, whose check_and_update_config adds its own)."""
    out = list(args.refusals)
    # the unit's release's argparse refuses a flag of another release (core/vllm_flag_list.py: the
    # releases each flag is in); an unknown version reads every release's. A flag in no release at all
    # may come from a plugin's parser hook: that one is only named (not_modelled_flags).
    given = {**args.flags, **{name: True for name in args.given_flags if name not in args.flags}}
    unknown = unrecognized(given, parse_vllm_version(args.vllm_version), args.vllm_version or "")
    if unknown:
        out.append(unknown)
    chunked = args.enable_chunked_prefill is not False
    mnbt = args.max_num_batched_tokens
    if mnbt is not None and mnbt < target and not chunked:
        # config/scheduler.py SchedulerConfig.verify_max_model_len
        out.append(
            f"max_num_batched_tokens ({mnbt}) is smaller than max_model_len ({target}). This effectively "
            "limits the maximum sequence length to max_num_batched_tokens and makes vLLM reject longer "
            "sequences. Please increase max_num_batched_tokens or decrease max_model_len."
        )
    effective_mnbt = mnbt if mnbt is not None else default_mnbt
    if mnbt is None and not chunked:
        effective_mnbt = max(target, default_mnbt)
    if args.max_num_seqs is not None and effective_mnbt < args.max_num_seqs:
        # config/scheduler.py SchedulerConfig.verify_max_model_len
        out.append(
            f"max_num_batched_tokens ({effective_mnbt}) must be greater than or equal to max_num_seqs "
            f"({args.max_num_seqs})."
        )
    item = facts.mm_prefix_lm_item_tokens
    limits = args.limit_mm_per_prompt or {}
    video_off = limits.get("video") == 0  # then the largest item left (an image, audio) is not known
    if gpu and item and effective_mnbt < item and not video_off:
        # platforms/cuda.py (rocm.py) check_and_update_config forces disable_chunked_mm_input for a
        # multimodal prefix-LM model; v1/core/encoder_cache_manager.py compute_mm_encoder_budget then
        # refuses an item (facts: Gemma-4's 2496-token video) larger than a batch
        out.append(
            f"Chunked MM input disabled but max_tokens_per_mm_item ({item}) is larger than "
            f"max_num_batched_tokens ({effective_mnbt}). Please increase max_num_batched_tokens."
        )
    active = args.max_num_active_seqs
    if active is not None and args.max_num_seqs is not None and active > args.max_num_seqs:
        # config/scheduler.py SchedulerConfig.verify_max_model_len
        out.append(
            f"max_num_active_seqs ({active}) cannot be greater than max_num_seqs ({args.max_num_seqs})."
        )
    threshold = args.long_prefill_token_threshold
    if threshold is not None and threshold > target:
        # config/scheduler.py SchedulerConfig.verify_max_model_len
        out.append(
            f"long_prefill_token_threshold ({threshold}) cannot be greater than the max_model_len ({target})."
        )
    if (
        args.hybrid_kv_cache_manager_forced
        and args.kv_transfer_config
        and connector_supports_hma(args.kv_transfer_config, version) is False
    ):
        # config/vllm.py VllmConfig.__post_init__
        out.append(
            "Hybrid KV cache manager was explicitly enabled but is not supported in this configuration. "
            "Consider omitting the --enable-hybrid-kv-cache-manager flag to let vLLM decide automatically."
        )
    unquantized = facts.quantization is None and facts.source_format == "hf"
    if args.quantization == "fp8" and unquantized and version >= FP8_ONLINE_REFUSED_SINCE:
        # model_executor/layers/quantization/fp8.py Fp8Config.__init__
        out.append(
            "The `fp8` quantization method no longer supports online quantization. Please use "
            "`--quantization fp8_per_tensor` instead."
        )
    if (
        args.quantization
        and facts.quantization
        and facts.source_format == "hf"
        and args.quantization in ONLINE_QUANT_BYTES_PER_WEIGHT
        and args.quantization != facts.quantization
    ):
        # config/model.py ModelConfig._verify_quantization
        out.append(
            f"Quantization method specified in the model config ({facts.quantization}) does not match the "
            f"quantization method specified in the `quantization` argument ({args.quantization})."
        )
    return out


# ---- weights -------------------------------------------------------------------------------------


def embedding_bytes(facts: ModelFacts, dtype_size: int) -> int:
    """embed_tokens + lm_head (VocabParallelEmbedding / ParallelLMHead: never quantized online),
    counted untied; 0 where the config does not give vocabulary and hidden size."""
    if not facts.vocab_size or not facts.hidden_size:
        return 0
    return 2 * facts.vocab_size * facts.hidden_size * dtype_size


@dataclass(frozen=True)
class GpuWeights:
    """Weights per GPU after the deployment's flags, and what changed them."""

    bytes: int
    notes: tuple[str, ...] = ()


def gpu_weights(per_gpu: int, facts: ModelFacts, args: ServeArgs, model_dtype: str, ranks: int) -> GpuWeights:
    """The checkpoint's bytes per GPU as vLLM holds them.

    - `--dtype` other than the checkpoint's on an unquantized checkpoint: every weight is cast
      (model_executor/model_loader/utils.py set_default_torch_dtype);
    - online quantization of a 16-bit checkpoint (`--quantization fp8_per_tensor` ...,
      `--quantization bitsandbytes` / `--load-format bitsandbytes`): each LinearBase and routed-expert
      weight is stored at the method's bytes per weight (quantization/online/*.py, bitsandbytes.py),
      embeddings and lm_head stay;
    - `--cpu-offload-gb N`: N GiB per GPU stay in host memory (model_executor/offloader/uva.py).
    """
    notes: list[str] = []
    weights = per_gpu
    checkpoint_size = DTYPE_BYTES.get(facts.dtype)
    unquantized = facts.quantization is None and facts.source_format == "hf"
    model_size = DTYPE_BYTES.get(model_dtype)
    if (
        args.dtype.lower() != "auto"
        and unquantized
        and checkpoint_size
        and model_size
        and model_size != checkpoint_size
    ):
        weights = weights * model_size // checkpoint_size
        notes.append(
            f"--dtype {args.dtype}: weights cast from {facts.dtype}, "
            f"{per_gpu / GIB:.2f} -> {weights / GIB:.2f} GiB per GPU"
        )
        checkpoint_size = model_size
    method = args.quantization or ("bitsandbytes" if args.load_format == "bitsandbytes" else None)
    per_weight = ONLINE_QUANT_BYTES_PER_WEIGHT.get(method or "")
    if per_weight is not None and unquantized and checkpoint_size and checkpoint_size >= 2:
        embeddings = min(weights, embedding_bytes(facts, checkpoint_size) // max(ranks, 1))
        quantized = int((weights - embeddings) * per_weight / checkpoint_size) + embeddings
        notes.append(
            f"--quantization {method}: linear weights at {per_weight:.3f} B each, embeddings and lm_head "
            f"kept: {weights / GIB:.2f} -> {quantized / GIB:.2f} GiB per GPU"
        )
        weights = quantized
    lora = lora_bytes(facts, args, model_dtype)
    if lora:
        weights += lora
        notes.append(
            f"--enable-lora: {args.max_loras} x rank {args.max_lora_rank} A/B buffers of every wrapped "
            f"linear, {lora / GIB:.2f} GiB per GPU"
        )
    if args.cpu_offload_gb > 0:
        offloaded = min(weights, int(args.cpu_offload_gb * GIB))
        notes.append(
            f"--cpu-offload-gb {args.cpu_offload_gb:g}: "
            f"{offloaded / GIB:.2f} GiB of weights per GPU in host memory"
        )
        weights -= offloaded
    return GpuWeights(weights, tuple(notes))


# ---- LoRA ----------------------------------------------------------------------------------------

LORA_FLAGS = ("--enable-lora", "--max-loras", "--max-lora-rank", "--lora-dtype", "--fully-sharded-loras")


def lora_bytes(facts: ModelFacts, args: ServeArgs, model_dtype: str) -> int | None:
    """The stacked LoRA buffers one GPU allocates at load (counted in "Model loading took"), for a
    dense attention model: None where the model is not one (MoE experts, MLA, mamba: named instead).

    lora/layers/base_linear.py create_lora_weights: per wrapped linear and output slice,
    lora_a_stacked [max_loras, 1, rank, input_size] and lora_b_stacked [max_loras, 1, output_size,
    rank] in lora_dtype (auto: the model dtype, config/lora.py). Column-parallel layers (qkv_proj:
    3 slices, gate_up_proj: 2; column_parallel_linear.py) take the whole input and their output
    shard; row-parallel ones (o_proj, down_proj; row_parallel_linear.py) their input shard and the
    whole output. fully_sharded_loras shards A's rank (column) or B's output (row) over TP too.
    """
    if not args.enable_lora:
        return 0
    dense = facts.layers and all(layer.kind.value == "full" for layer in facts.layers)
    if not dense or facts.num_experts or not facts.hidden_size or not facts.intermediate_size:
        return None
    tp, rank, loras = args.tensor_parallel_size, args.max_lora_rank, args.max_loras
    size = DTYPE_BYTES.get(
        model_dtype if args.lora_dtype == "auto" else args.lora_dtype.replace("torch.", "")
    )
    if size is None:
        return None
    hidden, inter = facts.hidden_size, facts.intermediate_size
    head = facts.layers[0].head_size
    q_out = facts.num_attention_heads * head
    kv_out = max(1, facts.layers[0].num_kv_heads // tp) * head
    col_rank = rank // tp if args.fully_sharded_loras else rank

    def column(slices: list[int]) -> int:
        return sum(col_rank * hidden + out * rank for out in slices)

    def row(in_shard: int) -> int:
        out = hidden // tp if args.fully_sharded_loras else hidden
        return rank * in_shard + out * rank

    per_layer = column([q_out // tp, kv_out, kv_out]) + row(q_out // tp)
    per_layer += column([inter // tp, inter // tp]) + row(inter // tp)
    return loras * per_layer * len(facts.layers) * size


# ---- the scheduler's batch ------------------------------------------------------------------------


def scheduler_args(args: ServeArgs, target: int, default_mnbt: int) -> ServeArgs:
    """max_num_batched_tokens as vLLM sets it when the unit leaves it unset (engine/arg_utils.py
    `_set_default_max_num_seqs_and_batched_tokens_args`): `--performance-mode throughput` doubles
    the defaults; with chunked prefill off it is max(max_model_len, default), so the profile run
    is a forward pass of the whole context."""
    if args.max_num_batched_tokens is not None:
        return args
    mnbt = default_mnbt
    if args.performance_mode == "throughput":
        mnbt *= 2
    if args.enable_chunked_prefill is False:
        mnbt = max(target, mnbt)
    if mnbt == default_mnbt:
        return args
    return replace(args, max_num_batched_tokens=mnbt)


# ---- the flags the plan does not count ---------------------------------------------------------

MODELLED_HF_OVERRIDES = frozenset(
    {"max_position_embeddings", "rope_scaling", "rope_parameters", "rope_theta", "use_sliding_window"}
)
DRAFT_METHODS = ("draft_model", "eagle", "eagle3", "dflash", "dspark", "custom_class")


@dataclass(frozen=True)
class NamedFlag:
    """A flag of the unit that changes GPU memory and is not counted: named in the plan."""

    flag: str
    family: str
    detail: str

    def to_json(self) -> NotModelledFlagRecord:
        """One entry of the plan's `not_modelled_flags`."""
        share, why = FAMILIES[self.family]
        return {
            "flag": self.flag,
            "family": self.family,
            "detail": self.detail,
            "margin_share": share,
            "why": why,
        }


def not_modelled_flags(
    args: ServeArgs, facts: ModelFacts, version: VllmVersion, experts_known: bool = False
) -> list[NamedFlag]:
    """Every flag of the unit that moves GPU memory the plan does not count (core/vllm_flags.py),
    plus the modelled flags used in a way that is not modelled (a draft model, an hf-override key
    ctxmgr does not read, a connector whose HMA support this release's table does not know)."""
    named: list[NamedFlag] = []
    lora_modelled = bool(lora_bytes(facts, args, facts.dtype))
    for name in args.given_flags:
        if name in LORA_FLAGS and (lora_modelled or not args.enable_lora):
            continue  # counted in the weights (lora_bytes), or no LoRA at all without --enable-lora
        known = flag(name)
        kind = classify(name)
        if known is None or kind is None:
            named.append(NamedFlag(name, "other", "not a flag of vLLM 0.10 - 0.33: its effect is unknown"))
            continue
        if kind.effect == "not modelled":
            graphs = _graphs_flag(known.name, args)
            if graphs is not None:
                if graphs:
                    named.append(NamedFlag(known.name, *graphs))
                continue
            if known.name == "--limit-mm-per-prompt" and _all_zero(args.limit_mm_per_prompt):
                # config/multimodal.py: a limit of 0 on every modality is --language-model-only
                named.append(NamedFlag(known.name, "lowers memory", "every modality at 0: no encoder"))
                continue
            named.append(NamedFlag(known.name, kind.family or "other", kind.detail))
    if args.speculative_method in DRAFT_METHODS:
        model = f" {args.speculative_model}" if args.speculative_model else ""
        named.append(
            NamedFlag("--speculative-config", "speculative draft", f"method {args.speculative_method}{model}")
        )
    if args.hf_overrides:
        others = sorted(set(args.hf_overrides) - MODELLED_HF_OVERRIDES)
        if others:
            named.append(NamedFlag("--hf-overrides", "model code", f"keys {', '.join(others)}"))
        if facts.source_format == "gguf":
            named.append(NamedFlag("--hf-overrides", "model code", "on a GGUF checkpoint"))
    if args.kv_transfer_config and connector_supports_hma(args.kv_transfer_config, version) is None:
        connector = args.kv_transfer_config.get("kv_connector")
        named.append(
            NamedFlag(
                "--kv-transfer-config", "kv layout", f"{connector}: hybrid KV manager support unknown here"
            )
        )
    if facts.num_experts and args.data_parallel_size > 1 and not experts_known:
        named.append(
            NamedFlag(
                "--data-parallel-size",
                "expert parallel",
                "routed experts split over DP x TP; their bytes need the safetensors shard headers",
            )
        )
    method = args.quantization
    if (
        method
        and facts.quantization is None
        and facts.source_format == "hf"
        and method not in ONLINE_QUANT_BYTES_PER_WEIGHT
    ):
        named.append(NamedFlag("--quantization", "model code", f"{method} on an unquantized checkpoint"))
    return list({(n.flag, n.detail): n for n in named}.values())


# what a start logged with the same flags does not calibrate: the KV layout itself
FAMILIES_BEYOND_A_LOGGED_START = frozenset({"kv layout"})


def _widened_families(named: list[NamedFlag], calibrated: bool) -> set[str]:
    families = {n.family for n in named}
    return families & FAMILIES_BEYOND_A_LOGGED_START if calibrated else families


def _graphs_flag(name: str, args: ServeArgs) -> tuple[str, str] | tuple[()] | None:
    """-O / --compilation-config as config/vllm.py reads them: () where the plan counts them (-O0 and
    cudagraph_mode NONE are --enforce-eager; -O2 is the default, -O3 the same graphs), (family,
    detail) where they are named, None for any other flag."""
    if name == "--optimization-level":
        if args.optimization_level in ("0", "2", "3"):
            return ()
        if args.optimization_level == "1":
            return ("lowers memory", "-O1: PIECEWISE graphs only")
        return ("cuda graphs", f"optimization level {args.optimization_level}")
    if name == "--compilation-config":
        config = args.compilation_config or {}
        if set(config) <= {"cudagraph_mode"} and str(config.get("cudagraph_mode", "")).upper() == "NONE":
            return ()
        return ("cuda graphs", "cudagraph_mode, capture sizes")
    return None


def _all_zero(limits: JSONObject | None) -> bool:
    """--limit-mm-per-prompt with every modality's count 0 (`{"image": 0}` or `{"image": {"count": 0}}`)."""
    if not limits:
        return False
    counts = [v.get("count") if isinstance(v, dict) else v for v in limits.values()]
    return all(c == 0 for c in counts)


def widening_bytes(named: list[NamedFlag], total_bytes: int, calibrated: bool = False) -> int:
    """The margin the named flags add on one GPU: each family's share of it, once per family. A
    budget logged by an earlier start (`calibrated`) already holds their weights, buffers and
    activations, so then only a changed KV layout widens it."""
    return int(sum(FAMILIES[f][0] for f in _widened_families(named, calibrated)) * total_bytes)


def named_flags_warning(
    named: list[NamedFlag], total_bytes: int | None, calibrated: bool = False
) -> str | None:
    """The plan's one line for them: which flags, and how much margin they added and why."""
    if not named:
        return None
    flags = ", ".join(dict.fromkeys(n.flag for n in named))
    families = sorted(_widened_families(named, calibrated))
    shares = ", ".join(f"{f} +{FAMILIES[f][0]:.0%} ({FAMILIES[f][1]})" for f in families)
    widened = ""
    if total_bytes:
        widened = (
            f"; margin widened by {widening_bytes(named, total_bytes, calibrated) / GIB:.2f} GiB per GPU"
        )
    if calibrated:
        widened += " (the logged start of this service already holds the rest)"
    return f"changes GPU memory, not modelled: {flags}{widened}" + (f": {shares}" if shares else "")
