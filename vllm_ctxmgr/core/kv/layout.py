"""KV cache groups, the shared block pool and what one request takes from it, per pipeline stage.

Mirrors vLLM 0.33.0's `vllm/v1/core/kv_cache_planning.py` (in 0.32 and before `kv_cache_utils.py`):
- `kv_cache_layout` builds every layer's spec (specs.py) on the backend's block size and dtype
  (backends.py), aligns the attention block to the mamba page (`Platform._align_hybrid_block_size`),
  then groups the layers (`get_kv_cache_groups`: `is_kv_cache_type_uniform` / UniformTypeKVCacheSpecs,
  `unify_kv_cache_spec_page_size`, `_get_kv_cache_groups_uniform_page_size`, and
  `_promote_local_specs` for --disable-hybrid-kv-cache-manager);
- `KVCacheLayout` is the pool: `_get_kv_cache_bytes_per_block` (largest group's bytes per block),
  `num_blocks = available // bytes_per_block` with the BlockPool's null block held back,
  `_max_memory_usage_bytes_from_groups` (bytes one request needs), `_check_enough_kv_cache_memory`
  (`fits`), `_estimate_max_model_len_from_groups` (`max_model_len_for`, also what
  `--max-model-len auto` picks) and `get_max_concurrency_for_kv_cache_config` (`max_concurrency`);
- `pp_stage_layers` is `get_pp_indices`: each pipeline stage's worker holds only its layers.
The numbers are vLLM's to the byte: `bytes_needed(L)` is what vLLM's startup check compares with
the KV budget.

What is assumed, not read from a live engine:
- the KV cache layout is vLLM's default layer-outer one (LBNHC/LBHNC), so blocks are not padded
  to a block-outermost stride;
- the attention backend is the one vLLM 0.33.0 picks first for the platform (no
  `--attention-backend`), which decides the default block size and the fp8 MLA format;
- speculative decoding with MTP adds `mtp_layers` copies of the last decoder layer [unverified].

Why ~780 lines: it mirrors one vLLM file (kv_cache_planning.py) step for step, the cache
configuration, the grouping and the pool, so that a reader can hold the two side by side.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, ModelFacts, dtype_bytes
from vllm_ctxmgr.core.hardware import GIB, Platform
from vllm_ctxmgr.core.kv.backends import (
    FLASHINFER_GDN_CHECKPOINT_ALIGNMENT,
    backend_block_size,
    backend_kv_cache_dtype,
    flashinfer_gdn_prefill,
    kv_dtype_bytes,
    resolve_kv_cache_dtype,
    resolve_model_dtype,
    select_attention_backend,
)
from vllm_ctxmgr.core.kv.specs import (
    AttentionSpec,
    CacheConfig,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SizingContext,
    SlidingWindowSpec,
    cdiv,
    kv_heads_per_gpu,
    layer_specs,
    mamba_state_dtype_sizes,
    mamba_state_shapes,
    round_up,
)
from vllm_ctxmgr.core.kv_connectors import hybrid_manager_off_by_connector
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.core.vllm_versions import NEWEST_VLLM, VllmVersion, rule
from vllm_ctxmgr.errors import UsageError

B200_CLASS_MEMORY = 160 * GIB  # get_batch_defaults: the tier whose max_num_batched_tokens is a version rule


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (vLLM's KVCacheGroupSpec).

    `layers` holds each cache's decoder-layer index: an MLA layer with a DSA indexer appears twice.
    """

    layers: tuple[int, ...]
    specs: tuple[KVCacheSpec, ...]

    @property
    def kind(self) -> str:
        """The group's spec kinds ("full", "mla+indexer"): how the plan's layout names it and which
        alternatives apply.
        """
        return "+".join(sorted({spec.kind for spec in self.specs}))

    @property
    def page_size_bytes(self) -> int:
        """vLLM's group page: one layer's page, or the sum for a merged uniform-type group."""
        first = self.specs[0]
        if all(spec == first for spec in self.specs):
            return first.page_size_bytes
        return sum(spec.page_size_bytes for spec in self.specs)

    @property
    def block_size(self) -> int:
        """vLLM's KVCacheGroupSpec: the group's layers share one block table, hence one block size."""
        return self.specs[0].block_size

    @property
    def grows_with_context(self) -> bool:
        """Full-attention (and MLA) groups keep every token: only they cost more per extra context token."""
        return any(isinstance(spec, FullAttentionSpec) for spec in self.specs)

    def blocks_per_request(self, ctx: SizingContext) -> int:
        """vLLM's UniformTypeKVCacheSpecs.max_memory_usage_bytes: the most pages any of its specs needs."""
        return max(spec.blocks_per_request(ctx) for spec in self.specs)

    def bytes_per_block(self, stage_layers: range | None = None) -> int:
        """This group's share of one pool block: its layers' pages, each padded to its stride alignment."""
        return sum(
            round_up(spec.page_size_bytes, spec.block_stride_alignment)
            for layer, spec in zip(self.layers, self.specs, strict=True)
            if stage_layers is None or layer in stage_layers
        )


@dataclass(frozen=True)
class KVCacheLayout:
    """vLLM's KV cache groups for one model + serve flags + platform, and the pool they share.

    Not vLLM's `KVCacheLayout` enum (the physical stride order); this is the planning view:
    groups, block size, bytes per block of the shared pool, per pipeline stage.
    """

    groups: tuple[KVCacheGroup, ...]
    block_size: int
    kv_cache_dtype: str  # resolved, as vLLM's cache_config.cache_dtype ends up
    model_dtype: str
    attention_backend: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    decode_context_parallel_size: int
    max_num_batched_tokens: int
    max_in_flight_tokens: int
    mamba_cache_mode: str
    stage_layers: tuple[range, ...]  # decoder layers of each PP stage
    notes: tuple[str, ...] = ()
    vllm_version: VllmVersion = NEWEST_VLLM  # whose startup check `fits` and `check_needed_bytes` follow

    # -- pool geometry --------------------------------------------------------------------------

    def stage_bytes_per_block(self, stage: int) -> int:
        """_pool_bytes_per_block on that stage's worker: the largest group's bytes per block."""
        if not self.groups:
            return 0
        return max(group.bytes_per_block(self.stage_layers[stage]) for group in self.groups)

    @property
    def bytes_per_block(self) -> int:
        """Bytes per block on the stage that needs the most (all stages when PP is 1)."""
        return max(self.stage_bytes_per_block(s) for s in range(self.pipeline_parallel_size))

    @property
    def page_size_bytes(self) -> int:
        """The largest single-layer page (the unified page of a hybrid model)."""
        return max((spec.page_size_bytes for g in self.groups for spec in g.specs), default=0)

    def _ctx(self, max_model_len: int) -> SizingContext:
        return SizingContext(
            max_model_len, self.max_in_flight_tokens, self.decode_context_parallel_size, self.mamba_cache_mode
        )

    # -- one request ----------------------------------------------------------------------------

    def group_blocks(self, max_model_len: int) -> tuple[int, ...]:
        """Each group's blocks for one request, in group order: the terms vLLM sums in
        _max_memory_usage_bytes_from_groups and get_max_concurrency_for_kv_cache_config.
        """
        ctx = self._ctx(max_model_len)
        return tuple(group.blocks_per_request(ctx) for group in self.groups)

    def blocks_needed(self, max_model_len: int, requests: int = 1) -> int:
        """Blocks `requests` requests of max_model_len take from the shared pool, all groups.

        vLLM checks one request; `requests` > 1 is what the same check would need for that many
        full-length requests at once (blocks are never shared between them without prefix hits).
        """
        return requests * sum(self.group_blocks(max_model_len))

    def bytes_needed(self, max_model_len: int, stage: int | None = None, requests: int = 1) -> int:
        """vLLM's `_max_memory_usage_bytes_from_groups`: blocks x bytes_per_block (largest stage)."""
        bytes_per_block = self.bytes_per_block if stage is None else self.stage_bytes_per_block(stage)
        return self.blocks_needed(max_model_len, requests) * bytes_per_block

    def bytes_per_token(self) -> int:
        """Marginal KV bytes per extra context token on the GPU that needs the most.

        Each group that keeps every token takes one pool block per block_size x DCP tokens.
        """
        dcp = self.decode_context_parallel_size
        per_token = sum(
            Fraction(self.bytes_per_block, group.block_size * dcp)
            for group in self.groups
            if group.grows_with_context
        )
        return math.ceil(per_token)

    # -- the pool -------------------------------------------------------------------------------

    def _stage_budgets(self, available_bytes: int | Sequence[int]) -> list[int]:
        if isinstance(available_bytes, int):
            return [available_bytes] * self.pipeline_parallel_size
        if len(available_bytes) != self.pipeline_parallel_size:
            raise ValueError("one available-bytes figure per pipeline stage expected")
        return list(available_bytes)

    def num_gpu_blocks(self, available_bytes: int | Sequence[int]) -> int:
        """Blocks in the pool (the null block included): the minimum over workers."""
        if not self.groups:
            return 1
        budgets = self._stage_budgets(available_bytes)
        return min(
            max(budget, 0) // self.stage_bytes_per_block(s)
            for s, budget in enumerate(budgets)
            if self.stage_bytes_per_block(s) > 0
        )

    def check_needed_bytes(self, max_model_len: int, stage: int | None = None, requests: int = 1) -> int:
        """What this vLLM version's startup check says `requests` requests need on a worker of `stage`.

        Rules `fit_check_needed_bytes` and `pp_fit_check`: a per-layer sum (no padding) up to 0.13, the
        first group's blocks x the largest group's bytes per block in 0.14-0.18, every group's from 0.19;
        0.14-0.16 check the whole model (every stage's layers) on each worker.
        """
        if not self.groups:
            return 0
        how = rule("fit_check_needed_bytes", self.vllm_version)
        stage_layers: range | None = None  # 0.14-0.16: the whole model on every worker
        if rule("pp_fit_check", self.vllm_version) != "whole_model_min_budget":
            if stage is None:
                stages = range(self.pipeline_parallel_size)
                return max(self.check_needed_bytes(max_model_len, s, requests) for s in stages)
            stage_layers = self.stage_layers[stage]
        ctx = self._ctx(max_model_len)
        if how == "per_layer_sum":
            return requests * sum(
                spec.max_memory_usage_bytes(ctx)
                for group in self.groups
                for layer, spec in zip(group.layers, group.specs, strict=True)
                if stage_layers is None or layer in stage_layers
            )
        bytes_per_block = max(group.bytes_per_block(stage_layers) for group in self.groups)
        if how == "first_group":
            return requests * self.groups[0].blocks_per_request(ctx) * bytes_per_block
        return requests * sum(self.group_blocks(max_model_len)) * bytes_per_block

    def null_block_reserve(self, stage: int | None = None) -> int:
        """Bytes the startup check holds back for the BlockPool's null block (rule fit_check_null_block)."""
        if not self.groups or not rule("fit_check_null_block", self.vllm_version):
            return 0
        if stage is None or rule("pp_fit_check", self.vllm_version) == "whole_model_min_budget":
            return self.bytes_per_block
        return self.stage_bytes_per_block(stage)

    def check_undercounts(self, max_model_len: int) -> bool:
        """Does this version's check count fewer bytes than one request's blocks really take?"""
        return self.check_needed_bytes(max_model_len) < self.bytes_needed(max_model_len)

    def fits(self, max_model_len: int, available_bytes: int | Sequence[int], requests: int = 1) -> bool:
        """vLLM's startup check on every worker: needed <= available (minus the null block from 0.29).

        0.14-0.16 compare the whole model with the smallest worker budget (rule pp_fit_check).
        """
        if not self.groups:
            return True
        budgets = self._stage_budgets(available_bytes)
        if rule("pp_fit_check", self.vllm_version) == "whole_model_min_budget":
            check = min(budgets) - self.null_block_reserve()
            return check > 0 and self.check_needed_bytes(max_model_len, None, requests) <= check
        for s, budget in enumerate(budgets):
            if self.stage_bytes_per_block(s) == 0:
                continue
            check = budget - self.null_block_reserve(s)
            if check <= 0 or self.check_needed_bytes(max_model_len, s, requests) > check:
                return False
        return True

    def max_model_len_for(self, available_bytes: int | Sequence[int], upper: int, requests: int = 1) -> int:
        """vLLM's estimated maximum model length: binary search in [1, upper], null block held back.

        With `requests` > 1: the longest length of which that many requests fit at once.
        """
        if not self.groups:
            return upper
        if upper < 1 or not self.fits(1, available_bytes, requests):
            return 0
        left, right, result = 1, upper, 1
        while left <= right:
            mid = (left + right) // 2
            if self.fits(mid, available_bytes, requests):
                result, left = mid, mid + 1
            else:
                right = mid - 1
        return result

    def max_concurrency(self, available_bytes: int | Sequence[int], max_model_len: int) -> float:
        """`get_max_concurrency_for_kv_cache_config`: pool blocks (null block included) / blocks one
        request of max_model_len needs, summed over the groups. Unrounded; vLLM logs it as %.2f."""
        needed = self.blocks_needed(max_model_len)
        return self.num_gpu_blocks(available_bytes) / needed if needed else math.inf

    def capacity_tokens(self, available_bytes: int | Sequence[int], max_model_len: int) -> int:
        """`_report_kv_cache_config`'s "KV cache size: N tokens" (rule capacity_line_tokens).

        From 0.20.1 int(max_concurrency x max_model_len), from the unrounded concurrency: on a hybrid
        model a concurrency in token units, not the pool's token count. Up to 0.20.0
        num_blocks // num_groups x the smallest block size (x DCP).
        """
        if rule("capacity_line_tokens", self.vllm_version).startswith("num_blocks"):
            if not self.groups:
                return 0
            # a mamba group outside "align" mode is one block of max_model_len tokens (MambaSpec's
            # block_size=max_model_len; 0 here)
            min_block = min(group.block_size or max_model_len for group in self.groups)
            blocks = self.num_gpu_blocks(available_bytes)
            return blocks // len(self.groups) * min_block * self.decode_context_parallel_size
        return int(self.max_concurrency(available_bytes, max_model_len) * max_model_len)

    def summary(self, max_model_len: int | None = None) -> dict:
        """The layout as a stored plan keeps it (PlanRecord["layout"]); blocks_per_request per group only
        when a max_model_len is given.
        """
        groups = []
        blocks = self.group_blocks(max_model_len) if max_model_len else (None,) * len(self.groups)
        for group, group_blocks in zip(self.groups, blocks, strict=True):
            entry: dict = {
                "kind": group.kind,
                "layers": len(set(group.layers)),
                "caches": len(group.layers),  # an MLA layer with a DSA indexer has two
                "page_size_bytes": group.page_size_bytes,
                "bytes_per_block": group.bytes_per_block(),
            }
            if group_blocks is not None:
                entry["blocks_per_request"] = group_blocks
            groups.append(entry)
        return {
            "block_size": self.block_size,
            "page_size_bytes": self.page_size_bytes,
            "bytes_per_block": self.bytes_per_block,
            "kv_cache_dtype": self.kv_cache_dtype,
            "model_dtype": self.model_dtype,
            "attention_backend": self.attention_backend,
            "mamba_cache_mode": self.mamba_cache_mode,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_in_flight_tokens": self.max_in_flight_tokens,
            "groups": groups,
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------------------------------
# Building the layout for a model
# --------------------------------------------------------------------------------------------------


def pp_stage_layers(num_layers: int, pp: int, partition: str | None = None) -> tuple[range, ...]:
    """get_pp_indices: remainder layers go to the stages before the last (or VLLM_PP_LAYER_PARTITION)."""
    if partition:
        try:
            sizes = [int(part) for part in partition.split(",")]
        except ValueError:
            raise UsageError(f"VLLM_PP_LAYER_PARTITION={partition!r} is not a list of integers") from None
        if len(sizes) != pp or sum(sizes) != num_layers:
            raise UsageError(
                f"VLLM_PP_LAYER_PARTITION={partition!r} does not split {num_layers} layers {pp} ways"
            )
    else:
        sizes = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            sizes[-i] += 1
    stages, start = [], 0
    for size in sizes:
        stages.append(range(start, start + size))
        start += size
    return tuple(stages)


def _with_mamba_dtypes(layer: LayerFacts, args: ServeArgs) -> LayerFacts:
    """--mamba-cache-dtype / --mamba-ssm-cache-dtype on a recurrent layer's state (mamba_utils.py
    MambaStateDtypeCalculator._mamba_state_dtype: the conv state takes mamba_cache_dtype, the SSM state
    mamba_ssm_cache_dtype, which "auto" leaves to the model's default or the conv state's dtype)."""
    if layer.state is None or (args.mamba_cache_dtype == "auto" and args.mamba_ssm_cache_dtype == "auto"):
        return layer
    state = layer.state
    if args.mamba_cache_dtype != "auto":
        state = replace(state, conv_dtype=args.mamba_cache_dtype)
    if args.mamba_ssm_cache_dtype != "auto":
        state = replace(state, ssm_dtype=args.mamba_ssm_cache_dtype)
    return replace(layer, state=state)


def _max_concurrent_batches(
    facts: ModelFacts, platform: Platform, args: ServeArgs, vllm_version: VllmVersion
) -> int:
    """VllmConfig.max_concurrent_batches: async scheduling (GPU default) overlaps one more batch.

    Which runner is the default is rule v2_model_runner_default ("dense": not MoE, not hybrid).
    """
    pp = args.pipeline_parallel_size
    if platform.is_cpu or args.async_scheduling is False:
        return pp  # the CPU platform turns async scheduling off; so does --no-async-scheduling
    runner_env = args.env.get("VLLM_USE_V2_MODEL_RUNNER")
    default = rule("v2_model_runner_default", vllm_version)
    dense = not facts.num_experts and facts.count(LayerKind.MAMBA) == 0
    v2_default = default == "all" or (default == "dense" and dense)
    v2_runner = runner_env in ("1", "true", "True") or (runner_env is None and v2_default)
    if v2_runner:
        return pp + 1
    return 2 if pp <= 1 else pp  # V1 runner: no async scheduling with PP


def kv_cache_layout(
    facts: ModelFacts, args: ServeArgs, platform: Platform, vllm_version: VllmVersion = NEWEST_VLLM
) -> KVCacheLayout:
    """Build vLLM's KV cache groups for `facts` served with `args` on `platform`."""
    tp, pp, dcp = args.tensor_parallel_size, args.pipeline_parallel_size, args.decode_context_parallel_size
    if min(tp, pp, dcp) < 1:
        raise UsageError("parallel sizes must be at least 1")
    if tp % dcp:
        raise UsageError(f"decode context parallel size {dcp} must divide tensor parallel size {tp}")
    if facts.num_attention_heads % tp:
        raise UsageError(
            f"Total number of attention heads ({facts.num_attention_heads}) must be divisible by "
            f"tensor parallel size ({tp})."
        )
    if args.env.get("VLLM_MLA_DISABLE") in ("1", "true") and facts.is_mla:
        raise UsageError("VLLM_MLA_DISABLE=1 is not modelled: ctxmgr sizes the MLA latent cache")
    notes: list[str] = []
    cache, layers, mnbt, in_flight = resolve_cache_config(facts, args, platform, vllm_version, notes)

    specs: list[tuple[int, KVCacheSpec]] = []
    for index, layer in enumerate(layers):
        specs.extend((index, spec) for spec in layer_specs(layer, index, cache))
    if args.disable_sliding_window and any(isinstance(s, SlidingWindowSpec) for _, s in specs):
        notes.append("--disable-sliding-window: sliding layers keep every token (full attention)")

    disable_hybrid = args.disable_hybrid_kv_cache_manager
    if hybrid_manager_off_by_connector(args, vllm_version):
        disable_hybrid = True
        notes.append(
            f"--kv-transfer-config {args.kv_transfer_config.get('kv_connector')}: the connector lacks "  # type: ignore[union-attr]
            "SupportsHMA, so vLLM turns the hybrid KV cache manager off (config/vllm.py)"
        )
    chunked_env = args.env.get("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE")
    if chunked_env in ("0", "false") and any(isinstance(s, ChunkedLocalAttentionSpec) for _, s in specs):
        disable_hybrid = True
        notes.append(
            "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0 disables the hybrid KV cache manager"
        )
    groups = _kv_cache_groups(specs, disable_hybrid, rule("hybrid_group_size_rule", vllm_version), notes)

    num_layers = len(facts.layers)
    stages = list(pp_stage_layers(num_layers, pp, args.env.get("VLLM_PP_LAYER_PARTITION")))
    if len(layers) > num_layers:  # MTP draft layers live on the last stage
        stages[-1] = range(stages[-1].start, len(layers))
    has_attention = any(layer.kind not in (LayerKind.MAMBA, LayerKind.NONE) for layer in facts.layers)
    return KVCacheLayout(
        groups=tuple(groups),
        block_size=cache.block_size,
        kv_cache_dtype=cache.kv_cache_dtype,
        model_dtype=cache.model_dtype,
        attention_backend=cache.backend.name if has_attention else "none",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        decode_context_parallel_size=dcp,
        max_num_batched_tokens=mnbt,
        max_in_flight_tokens=in_flight,
        mamba_cache_mode=cache.mamba_cache_mode,
        stage_layers=tuple(stages),
        notes=tuple(notes),
        vllm_version=vllm_version,
    )


def resolve_cache_config(
    facts: ModelFacts, args: ServeArgs, platform: Platform, vllm_version: VllmVersion, notes: list[str]
) -> tuple[CacheConfig, list[LayerFacts], int, int]:
    """vLLM's cache configuration for this deployment, resolved once: (CacheConfig, the layers that get
    a KV cache, max_num_batched_tokens, the tokens in flight a sliding window must keep). In vLLM's
    order, which is also the order of its log lines (notes): the model and KV dtypes, the attention
    backend (which may choose the KV format), the batch, the mamba cache mode, the backend's block size
    (phase 1), the layers (MTP draft layers added), then for a hybrid attention/mamba model the block
    size aligned to the mamba page (phase 2, Platform._align_hybrid_block_size)."""
    tp, pp, dcp = args.tensor_parallel_size, args.pipeline_parallel_size, args.decode_context_parallel_size
    model_dtype = resolve_model_dtype(facts, args, platform)
    kv_dtype = resolve_kv_cache_dtype(facts, args, platform, vllm_version, notes)
    backend = select_attention_backend(facts, kv_dtype, platform, tp, dcp, vllm_version)
    kv_dtype = backend_kv_cache_dtype(facts, kv_dtype, backend, dcp, platform, notes)
    kv_bytes = dtype_bytes(model_dtype) if kv_dtype == "auto" else kv_dtype_bytes(kv_dtype)

    mnbt = args.max_num_batched_tokens or platform.default_max_num_batched_tokens(tp * pp)
    memory = platform.total_memory_bytes
    if not args.max_num_batched_tokens and not platform.is_cpu and memory and memory >= B200_CLASS_MEMORY:
        mnbt = rule("default_max_num_batched_tokens", vllm_version)
    item = facts.mm_prefix_lm_item_tokens
    if (
        not args.max_num_batched_tokens
        and item
        and item > mnbt
        and rule("mm_prefix_lm_batched_tokens_floor", vllm_version)
    ):
        notes.append(
            f"Raising max_num_batched_tokens from {mnbt} to {item} to accommodate the largest multimodal "
            "item of a prefix-LM model (engine/arg_utils.py)"
        )
        mnbt = item
    in_flight = mnbt
    if rule("sliding_window_in_flight", vllm_version) == "max_concurrent_batches":
        in_flight = _max_concurrent_batches(facts, platform, args, vllm_version) * mnbt
    has_mamba = facts.count(LayerKind.MAMBA) > 0
    has_attention = any(layer.kind not in (LayerKind.MAMBA, LayerKind.NONE) for layer in facts.layers)
    mamba_cache_mode = _mamba_cache_mode(facts, args, has_mamba, has_attention, vllm_version)

    # Phase 1: the block size every backend takes.
    block_size = backend_block_size(facts, args, platform, backend, has_attention, notes)
    layers = [_with_mamba_dtypes(layer, args) for layer in facts.layers]
    # an MTP method drafts with the checkpoint's own MTP layers; ngram / suffix / a draft model do not
    # (config/speculative.py SpeculativeConfig.__post_init__); None: ServeArgs built without a method
    if args.num_speculative_tokens and facts.mtp_layers and args.speculative_method in (None, "mtp"):
        layers += [layers[-1]] * facts.mtp_layers
        notes.append(
            f"MTP speculative decoding adds {facts.mtp_layers} draft layer(s) to the KV cache [unverified]"
        )
    checkpoint_families = rule("mamba_prefill_checkpoint", vllm_version)
    cache = CacheConfig(
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        model_dtype=model_dtype,
        kv_cache_dtype=kv_dtype,
        kv_bytes=kv_bytes,
        backend=backend,
        block_size=block_size,
        mamba_cache_mode=mamba_cache_mode,
        mamba_page_padded=None,
        gdn_checkpoints="gdn" in checkpoint_families
        and all(
            layer.state is not None
            and layer.state.family == "gdn"
            and flashinfer_gdn_prefill(platform, layer.state)
            for layer in layers
            if layer.kind == LayerKind.MAMBA
        ),
        mamba2_checkpoints="mamba2" in checkpoint_families,
        disable_sliding_window=args.disable_sliding_window,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    # Phase 2: hybrid attention/mamba models align the block size to the mamba page.
    if has_mamba and has_attention:
        block_size, padded = _align_hybrid_block_size(facts, layers, cache, vllm_version, notes)
        cache = replace(cache, block_size=block_size, mamba_page_padded=padded)
    return cache, layers, mnbt, in_flight


def _mamba_cache_mode(
    facts: ModelFacts, args: ServeArgs, has_mamba: bool, has_attention: bool, vllm_version: VllmVersion
) -> str:
    """cache_config.mamba_cache_mode: rules hybrid_prefix_caching_default and hybrid_prefix_caching_mode."""
    if not has_mamba:
        return "none"
    prefix_caching = args.enable_prefix_caching
    if prefix_caching is None:  # attention-free models: off in every version
        prefix_caching = has_attention and rule("hybrid_prefix_caching_default", vllm_version)
    if not prefix_caching:
        return "none"
    mode = rule("hybrid_prefix_caching_mode", vllm_version)
    if mode == "unsupported":
        return "none"
    if mode == "all_or_align":
        families = {layer.state.family for layer in facts.layers if layer.state is not None}
        return "all" if families and families <= {"mamba1", "mamba2"} else "align"
    return "align"


def _align_hybrid_block_size(
    facts: ModelFacts,
    layers: list[LayerFacts],
    cache: CacheConfig,
    vllm_version: VllmVersion,
    notes: list[str],
) -> tuple[int, int | None]:
    """Platform._align_hybrid_block_size: attention page >= mamba page, then pad the mamba page."""
    tp, kv_bytes, block_size = cache.tensor_parallel_size, cache.kv_bytes, cache.block_size
    backend = cache.backend
    attention = next(layer for layer in layers if layer.kind not in (LayerKind.MAMBA, LayerKind.NONE))
    if facts.is_mla:
        # vLLM builds this MLAAttentionSpec without state_content_bytes: head_size x dtype even for ds_mla
        attn_page_1_token = attention.head_size * kv_bytes
    else:
        # FullAttentionSpec(head_size=model head size): head_size_v defaults to head_size here
        attn_page_1_token = (
            2 * kv_heads_per_gpu(attention.num_kv_heads, tp, 0) * attention.head_size * kv_bytes
        )
    mamba_pages = []
    for layer in layers:
        if layer.kind == LayerKind.MAMBA and layer.state is not None:
            shapes, conv_like = mamba_state_shapes(layer.state, tp, cache.num_speculative_tokens)
            sizes = mamba_state_dtype_sizes(layer.state, cache.model_dtype, conv_like)
            mamba_pages.append(sum(math.prod(s) * b for s, b in zip(shapes, sizes, strict=True)))
    mamba_page = max(mamba_pages, default=0)
    if mamba_page == 0:
        return block_size, None
    alignment_rule = rule("hybrid_mamba_block_alignment", vllm_version)
    if alignment_rule == "16":
        kernel_alignment = 16
    elif alignment_rule == "kernel":
        kernel_alignment = (128 if backend.name == "CUTLASS_MLA" else 64) if facts.is_mla else 16
    else:
        kernel_alignment = max(backend.min_kernel_block, block_size)
        if facts.is_mla and alignment_rule == "backend_block_mla128":
            kernel_alignment = max(kernel_alignment, 128)
    if cache.mamba_cache_mode == "align" and cache.gdn_checkpoints:
        kernel_alignment = math.lcm(kernel_alignment, FLASHINFER_GDN_CHECKPOINT_ALIGNMENT)
    attn_block_size = kernel_alignment * cdiv(mamba_page, kernel_alignment * attn_page_1_token)
    attn_block_size = round_up(attn_block_size, backend.min_kernel_block)
    if block_size < attn_block_size:
        block_size = attn_block_size
        notes.append(
            f"Setting attention block size to {block_size} tokens to ensure that attention page size is "
            ">= mamba page size."
        )
    attn_page = block_size * attn_page_1_token
    if attn_page == mamba_page:
        return block_size, None
    notes.append(
        f"Padding mamba page size by {100 * (attn_page - mamba_page) / mamba_page:.2f}% to ensure that mamba "
        "page size and attention page size are exactly equal."
    )
    return block_size, attn_page


# --------------------------------------------------------------------------------------------------
# Grouping (kv_cache_planning.get_kv_cache_groups)
# --------------------------------------------------------------------------------------------------


def _promote_local_specs(specs: list[tuple[int, KVCacheSpec]]) -> list[tuple[int, KVCacheSpec]]:
    """--disable-hybrid-kv-cache-manager: sliding/chunked layers are allocated as full attention."""
    has_full = any(isinstance(spec, FullAttentionSpec) for _, spec in specs)
    has_local = any(isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec) for _, spec in specs)
    if not (has_full and has_local):
        return specs
    full_block_sizes = {spec.block_size for _, spec in specs if isinstance(spec, FullAttentionSpec)}
    full_block_size = next(iter(full_block_sizes)) if len(full_block_sizes) == 1 else None
    promoted = []
    for index, spec in specs:
        if isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
            spec = FullAttentionSpec(
                block_size=full_block_size or spec.block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                head_size_v=spec.head_size_v,
                dtype_bytes=spec.dtype_bytes,
                state_content_bytes=spec.state_content_bytes,
                dcp_sharded=spec.dcp_sharded,
                stride_alignment=spec.stride_alignment,
            )
        promoted.append((index, spec))
    return promoted


def _is_uniform_type(specs: list[KVCacheSpec]) -> bool:
    """UniformTypeKVCacheSpecs.is_uniform_type: same block size and one registry base type."""
    if len({spec.block_size for spec in specs}) > 1:
        return False
    first = specs[0]
    if isinstance(first, FullAttentionSpec):
        return all(isinstance(spec, FullAttentionSpec) for spec in specs)
    if isinstance(first, SlidingWindowSpec):
        return all(
            isinstance(s, SlidingWindowSpec) and s.sliding_window == first.sliding_window for s in specs
        )
    if isinstance(first, ChunkedLocalAttentionSpec):
        return all(
            isinstance(s, ChunkedLocalAttentionSpec) and s.attention_chunk_size == first.attention_chunk_size
            for s in specs
        )
    if isinstance(first, MambaSpec):
        return all(
            isinstance(s, MambaSpec)
            and s.num_speculative_blocks == first.num_speculative_blocks
            and s.num_prefill_checkpoint_blocks == first.num_prefill_checkpoint_blocks
            and s.page_size_bytes == first.page_size_bytes
            for s in specs
        )
    return False


def _unify_page_size(specs: list[tuple[int, KVCacheSpec]]) -> list[tuple[int, KVCacheSpec]]:
    """unify_kv_cache_spec_page_size: scale smaller attention pages by block size, pad the rest."""
    pages = {spec.page_size_bytes for _, spec in specs}
    if len(pages) <= 1:
        return specs
    max_page = max(pages)
    unified: list[tuple[int, KVCacheSpec]] = []
    for index, spec in specs:
        page = spec.page_size_bytes
        if page == max_page:
            new = spec
        elif isinstance(spec, MambaSpec):
            new = replace(spec, page_size_padded=max_page)
        elif max_page % page == 0 and isinstance(spec, AttentionSpec) and spec.page_size_padded is None:
            new = replace(spec, block_size=spec.block_size * (max_page // page))
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            new = replace(spec, page_size_padded=max_page)
        else:
            raise NotImplementedError(f"layer {index}: page size cannot be unified")
        unified.append((index, new))
    return unified


def _kv_cache_groups(
    specs: list[tuple[int, KVCacheSpec]], disable_hybrid: bool, group_ratio: float | None, notes: list[str]
) -> list[KVCacheGroup]:
    """vLLM's get_kv_cache_groups: which layers share a block table, in its order of attempts.

    1. With the hybrid KV cache manager off (--disable-hybrid-kv-cache-manager, a connector without
       SupportsHMA), sliding-window and chunked layers are promoted to full attention
       (_promote_local_specs): they keep every token; a model whose specs still differ is refused.
    2. All layers the same spec, or the same type with different shapes (UniformTypeKVCacheSpecs:
       full attention with per-layer head sizes, MLA with its indexer): one group of every layer.
    3. Otherwise the page sizes are unified (unify_kv_cache_spec_page_size: smaller pages padded up to
       the largest, which must divide evenly) and the layers are grouped by spec into groups of equal
       size (step 4). Where pages cannot be unified and the model mixes MLA with sliding windows,
       vLLM promotes the sliding layers and makes one group, as in step 1.
    4. _get_kv_cache_groups_uniform_page_size: the group size is the fewest layers of one spec (or,
       by rule hybrid_group_size_rule, the most, where the counts are close); each spec's layers are
       dealt round-robin (layers[i::num_groups]) into that many groups, a short one padded.

    Worked example, gpt-oss-120b (36 layers alternating sliding window 128 / full attention, same head
    shape): steps 1-2 do not apply (two specs), the pages are equal already, 18 sliding and 18 full
    layers make a group size of 18: two groups, [0, 2, .., 34] sliding and [1, 3, .., 35] full, sharing
    one block pool; a request then needs cdiv(len, block) full blocks plus the window's few sliding
    blocks, which is why its KV per token is half that of an all-full model.
    """
    if disable_hybrid:
        promoted = _promote_local_specs(specs)
        if promoted != specs:
            notes.append("hybrid KV cache manager disabled: sliding/chunked layers keep every token")
            specs = promoted
        if not _is_uniform_type([spec for _, spec in specs]) and len({s for _, s in specs}) > 1:
            raise UsageError(
                "vLLM cannot serve this hybrid model with --disable-hybrid-kv-cache-manager "
                "(Failed to promote local KV cache specs to one unified type)"
            )
    if not specs:
        return []  # attention-free
    only_specs = [spec for _, spec in specs]
    if all(spec == only_specs[0] for spec in only_specs) or _is_uniform_type(only_specs):
        return [KVCacheGroup(tuple(i for i, _ in specs), tuple(only_specs))]
    try:
        specs = _unify_page_size(specs)
    except NotImplementedError:
        has_mla = any(isinstance(spec, MLAAttentionSpec) for spec in only_specs)
        has_swa = any(isinstance(spec, SlidingWindowSpec) for spec in only_specs)
        if not (has_mla and has_swa) or any(isinstance(s, ChunkedLocalAttentionSpec) for s in only_specs):
            raise UsageError("vLLM cannot unify this model's KV page sizes") from None
        notes.append(
            "KV cache page sizes cannot be unified; treating sliding-window layers as full attention "
            "for cache allocation."
        )
        specs = _promote_local_specs(specs)
        return [KVCacheGroup(tuple(i for i, _ in specs), tuple(s for _, s in specs))]
    return _group_uniform_page_size(specs, group_ratio, notes)


def _group_uniform_page_size(
    specs: list[tuple[int, KVCacheSpec]], group_ratio: float | None, notes: list[str]
) -> list[KVCacheGroup]:
    """_get_kv_cache_groups_uniform_page_size: equal-size groups, layers[i::num_groups], padding.

    `group_ratio` is rule hybrid_group_size_rule: the most layers of one type become the group size if
    that is below ratio x the fewest (None: always the fewest).
    """
    buckets: dict[KVCacheSpec, list[int]] = defaultdict(list)
    for index, spec in specs:
        buckets[spec].append(index)
    sizes = [len(layers) for layers in buckets.values()]
    group_size = min(sizes)
    if group_ratio is not None and max(sizes) < min(sizes) * group_ratio:
        group_size = max(sizes)
    groups: list[KVCacheGroup] = []
    for spec, layers in buckets.items():
        padding = group_size - len(layers) % group_size
        if padding != group_size:
            notes.append(
                f"Add {padding} padding layers, may waste at most "
                f"{padding / len(layers) * 100:.2f}% KV cache memory"
            )
        num_groups = cdiv(len(layers), group_size)
        for i in range(num_groups):
            members = layers[i::num_groups]
            groups.append(KVCacheGroup(tuple(members), (spec,) * len(members)))
    return groups
