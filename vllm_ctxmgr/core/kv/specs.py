"""One frozen spec per KV cache layer kind, as in vLLM 0.33.0's `vllm/v1/kv_cache_interface.py`.

Each spec knows its `page_size_bytes` (one block of one layer) and `max_memory_usage_bytes` (what one
request of max_model_len tokens costs that layer); a subclass overrides only what differs from its
base and says why. The bottom half builds a model layer's specs the way the layers' own
`get_kv_cache_spec` do (attention.py, mla_attention.py, mamba_utils.py), on the block size and cache
dtype that `backends.py` chose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, StateFacts, dtype_bytes
from vllm_ctxmgr.core.kv.backends import (
    PACKED_MLA_BYTES,
    AttentionBackend,
    attention_content_bytes,
    mla_content_bytes,
)
from vllm_ctxmgr.errors import UsageError


def cdiv(a: int, b: int) -> int:
    """vllm.utils.math_utils.cdiv: ceiling division on ints (no float rounding at 10^12 bytes)."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """vllm.utils.math_utils.round_up."""
    return cdiv(a, b) * b


@dataclass(frozen=True)
class SizingContext:
    """The VllmConfig values a spec reads to size one request."""

    max_model_len: int
    max_in_flight_tokens: int
    decode_context_parallel_size: int = 1
    mamba_cache_mode: str = "none"


@dataclass(frozen=True)
class KVCacheSpec:
    """vLLM's KVCacheSpec: a page per block of `block_size` tokens; subclasses say what a request costs.

    `blocks_per_request` is vLLM's `cdiv(max_memory_usage_bytes, page_size_bytes)` and holds for every
    kind, so only the page and the per-request bytes are abstract here.
    """

    block_size: int

    kind = "?"

    @property
    def page_size_bytes(self) -> int:
        """vLLM's KVCacheSpec.page_size_bytes: one block of one layer, what the pool's blocks are built of."""
        raise NotImplementedError

    @property
    def block_stride_alignment(self) -> int:
        """Bytes a layer-outer block stride must be a multiple of (backend customize_spec)."""
        return 1

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        """vLLM's KVCacheSpec.max_memory_usage_bytes: one request of max_model_len on this layer."""
        raise NotImplementedError

    def blocks_per_request(self, ctx: SizingContext) -> int:
        """vLLM's cdiv(max_memory_usage_bytes, page_size_bytes): the pages one request takes here."""
        return cdiv(self.max_memory_usage_bytes(ctx), self.page_size_bytes)


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """K and V of `num_kv_heads` heads per token: the page is heads x block x (K + V) bytes.

    `page_size_padded` lets page-size unification pad a smaller page; `stride_alignment` is the
    sparse-MLA backends' whole-row block stride. The request cost is left to the kinds below: it is
    what tells full, sliding and chunked attention apart.
    """

    num_kv_heads: int  # per GPU
    head_size: int
    head_size_v: int
    dtype_bytes: int
    state_content_bytes: int | None = None  # packed formats (fp8_ds_mla) set it directly
    page_size_padded: int | None = None
    dcp_sharded: bool = True
    stride_alignment: int = 1

    @property
    def state_content_size_bytes(self) -> int:
        """vLLM's state_content_bytes: K + V of one head for one token; packed formats (fp8_ds_mla) set it."""
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        return (self.head_size + self.head_size_v) * self.dtype_bytes

    @property
    def page_size_bytes(self) -> int:
        """vLLM's AttentionSpec.page_size_bytes: heads x block_size x state_content_bytes, or the padded
        page that page-size unification set.
        """
        unpadded = self.num_kv_heads * self.block_size * self.state_content_size_bytes
        return self.page_size_padded if self.page_size_padded is not None else unpadded

    @property
    def block_stride_alignment(self) -> int:
        """The sparse-MLA backends' customize_spec (align_blocks_to_rows): blocks a whole row apart."""
        return self.stride_alignment


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token of the request stays: cdiv(L, block_size) pages (cdiv(L, DCP) tokens per rank).

    Overrides only the request cost: the page is AttentionSpec's.
    """

    kind = LayerKind.FULL

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        """vLLM's FullAttentionSpec.max_memory_usage_bytes: cdiv(max_model_len, block_size) pages, with
        the tokens split over the DCP ranks first.
        """
        tokens = ctx.max_model_len
        if self.dcp_sharded and ctx.decode_context_parallel_size > 1:
            tokens = cdiv(tokens, ctx.decode_context_parallel_size)
        return cdiv(tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """One latent per token, replicated on every TP rank (num_kv_heads 1, max_tp_shards 1).

    The DSA indexer K cache is an MLAAttentionSpec too (cache_role "indexer", uint8). Overrides only
    `kind`, so the planner can tell latent and indexer caches apart; page and request cost are a full
    attention layer's (built with num_kv_heads 1, head_size_v 0, or a packed state_content_bytes).
    """

    cache_role: str = "sparse"
    cache_dtype_str: str = "auto"

    @property
    def kind(self) -> str:  # type: ignore[override]
        """The latent cache is "mla", the DSA indexer K cache "indexer": vLLM groups both as full
        attention, the plan reports them apart.
        """
        return "indexer" if self.cache_role == "indexer" else LayerKind.MLA


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Bounded per request: the window plus the tokens in flight (+1 for a window that straddles).

    Overrides only the request cost: older tokens leave the window, so blocks are freed behind it.
    """

    sliding_window: int = 0
    extra_retained_tokens: int = 0

    kind = LayerKind.SLIDING

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        """vLLM's SlidingWindowSpec.max_memory_usage_bytes: window - 1 + tokens in flight (at most
        max_model_len), plus one block for a window that straddles a block boundary.
        """
        tokens = min(
            self.sliding_window - 1 + self.extra_retained_tokens + ctx.max_in_flight_tokens, ctx.max_model_len
        )
        return (cdiv(tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Bounded per request: one chunk plus the tokens in flight.

    Overrides only the request cost: attention never looks back past the current chunk; unlike the
    sliding window, vLLM counts no extra straddling block here.
    """

    attention_chunk_size: int = 0

    kind = LayerKind.CHUNKED

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        """vLLM's ChunkedLocalAttentionSpec.max_memory_usage_bytes: one chunk + tokens in flight (at most
        max_model_len), with no straddling block.
        """
        tokens = min(self.attention_chunk_size + ctx.max_in_flight_tokens, ctx.max_model_len)
        return cdiv(tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """Constant state per request; pages per request depend on the mamba cache mode.

    Not an attention spec: the page is the state tensors' bytes (conv + ssm), not per-token K/V, and the
    cost does not grow with max_model_len ("align" mode keeps two pages plus checkpoints for prefix
    caching, speculative tokens one page each).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtype_sizes: tuple[int, ...]
    page_size_padded: int | None = None
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    family: str = "mamba2"

    kind = LayerKind.MAMBA

    @property
    def real_page_size_bytes(self) -> int:
        """vLLM's MambaSpec page before padding: the state tensors' bytes (conv + ssm) on one TP rank."""
        return sum(math.prod(shape) * size for shape, size in zip(self.shapes, self.dtype_sizes, strict=True))

    @property
    def page_size_bytes(self) -> int:
        """vLLM's MambaSpec.page_size_bytes: the padded page where the hybrid block alignment set
        mamba_page_size_padded, else the real state bytes.
        """
        return self.page_size_padded if self.page_size_padded is not None else self.real_page_size_bytes

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        """vLLM's MambaSpec.max_memory_usage_bytes: a fixed count of state pages per request by mamba cache
        mode ("all": a page per block, as attention).
        """
        if ctx.mamba_cache_mode == "all":  # 0.15-0.31 opt-in prefix caching of Mamba1/2: a page per block
            return cdiv(ctx.max_model_len, self.block_size) * self.page_size_bytes
        if ctx.mamba_cache_mode == "align":
            pages = 2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks
        else:
            pages = 1 + self.num_speculative_blocks
        return self.page_size_bytes * pages


# --------------------------------------------------------------------------------------------------
# From a model layer to its specs (the layers' get_kv_cache_spec)
# --------------------------------------------------------------------------------------------------


def kv_heads_per_gpu(total: int, tp: int, layer: int) -> int:
    """get_num_kv_heads, with the models' own divisibility asserts."""
    if total <= 0:
        raise UsageError(f"layer {layer}: no KV heads")
    if tp >= total:
        if tp % total:
            raise UsageError(
                f"tensor parallel size {tp} is not a multiple of the {total} KV heads (layer {layer})"
            )
    elif total % tp:
        raise UsageError(f"{total} KV heads are not divisible by tensor parallel size {tp} (layer {layer})")
    return max(1, total // tp)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise UsageError(f"{what} ({numerator}) is not divisible by tensor parallel size {denominator}")
    return numerator // denominator


def mamba_state_shapes(state: StateFacts, tp: int, num_spec: int) -> tuple[tuple[tuple[int, ...], ...], int]:
    """(state shapes per TP rank, number of conv-like leading tensors) from mamba_utils.py."""
    if state.family == "mamba2":
        n_groups = state.n_groups + (0 if state.n_groups % tp == 0 else tp - state.n_groups)
        conv_dim = state.intermediate_size + 2 * n_groups * state.state_size
        conv = (state.conv_kernel - 1 + num_spec, _divide(conv_dim, tp, "mamba2 conv dim"))
        ssm = (_divide(state.num_heads, tp, "mamba2 heads"), state.head_dim, state.state_size)
        return (conv, ssm), 1
    if state.family == "mamba1":
        inner = _divide(state.intermediate_size, tp, "mamba intermediate size")
        return ((state.conv_kernel - 1, inner), (inner, state.state_size)), 1
    if state.family == "gdn":
        conv_dim = state.k_head_dim * state.num_k_heads * 2 + state.v_head_dim * state.num_v_heads
        conv = (state.conv_kernel - 1 + num_spec, _divide(conv_dim, tp, "gated delta net conv dim"))
        ssm = (_divide(state.num_v_heads, tp, "gated delta net V heads"), state.v_head_dim, state.k_head_dim)
        return (conv, ssm), 1
    if state.family == "linear":
        return ((_divide(state.num_heads, tp, "linear attention heads"), state.head_dim, state.head_dim),), 0
    raise UsageError(f"unknown recurrent state family {state.family!r}")


def mamba_state_dtype_sizes(state: StateFacts, model_dtype: str, conv_like: int) -> tuple[int, ...]:
    """MambaStateDtypeCalculator: conv follows the model (or mamba_cache_dtype), ssm follows conv."""
    conv_dtype = state.conv_dtype or model_dtype
    ssm_dtype = state.ssm_dtype or conv_dtype
    if conv_like == 0:  # linear attention: one state tensor in the mamba cache dtype
        return (dtype_bytes(conv_dtype),)
    return (dtype_bytes(conv_dtype), dtype_bytes(ssm_dtype))


@dataclass(frozen=True)
class CacheConfig:
    """vLLM's cache configuration of one deployment, resolved once by kv_cache_layout (the parts of
    vLLM's CacheConfig, ParallelConfig and the chosen backend that every layer's spec reads): what a
    layer's get_kv_cache_spec sees, so a spec needs the layer and this, nothing else."""

    tensor_parallel_size: int
    decode_context_parallel_size: int
    model_dtype: str  # the weights' torch dtype: a mamba state and an "auto" KV cache follow it
    kv_cache_dtype: str  # cache_config.cache_dtype after the backend's own choice ("auto", "fp8", ...)
    kv_bytes: int  # bytes of one KV element in that dtype
    backend: AttentionBackend
    block_size: int  # tokens per block, after the hybrid alignment to the mamba page
    mamba_cache_mode: str  # cache_config.mamba_cache_mode: "none" | "align" | "all"
    mamba_page_padded: int | None  # the attention page a mamba page is padded to (hybrid models)
    gdn_checkpoints: bool  # FlashInfer GDN prefill keeps one checkpoint block per request
    mamba2_checkpoints: bool  # MambaMixer2 keeps one (rule mamba_prefill_checkpoint)
    disable_sliding_window: bool
    num_speculative_tokens: int


def layer_specs(layer: LayerFacts, index: int, cache: CacheConfig) -> list[KVCacheSpec]:
    """One decoder layer's specs as its get_kv_cache_spec builds them (attention.py, mla_attention.py,
    mamba layers); [] for a layer that reads another's cache, UsageError where vLLM refuses.
    Long because it is one branch per layer kind, each the constructor call vLLM's layer makes."""
    tp = cache.tensor_parallel_size
    kind = layer.kind
    if kind == LayerKind.NONE:
        return []  # kv_sharing_target_layer_name: reads another layer's cache
    if kind == LayerKind.SLIDING and cache.disable_sliding_window:
        kind = LayerKind.FULL
    if kind in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED):
        if cache.decode_context_parallel_size > 1:
            if kind == LayerKind.SLIDING:
                raise UsageError("vLLM does not support decode context parallel with sliding-window layers")
            _check_gqa_dcp(layer, tp, cache.decode_context_parallel_size)
        # each layer's own geometry (Gemma-4's global layers differ from its sliding ones), and the
        # scales a quantized format packs with each head (backends.attention_content_bytes)
        head_size_v = layer.head_size_v or layer.head_size
        common = dict(
            block_size=cache.block_size,
            num_kv_heads=kv_heads_per_gpu(layer.num_kv_heads, tp, index),
            head_size=layer.head_size,
            head_size_v=head_size_v,
            dtype_bytes=cache.kv_bytes,
            state_content_bytes=attention_content_bytes(layer.head_size, head_size_v, cache.kv_cache_dtype),
        )
        if kind == LayerKind.SLIDING:
            if not layer.window:
                raise UsageError(f"layer {index} is sliding-window but has no window")
            return [SlidingWindowSpec(**common, sliding_window=layer.window)]
        if kind == LayerKind.CHUNKED:
            if not layer.window:
                raise UsageError(f"layer {index} is chunked-local but has no chunk size")
            return [ChunkedLocalAttentionSpec(**common, attention_chunk_size=layer.window)]
        return [FullAttentionSpec(**common)]
    if kind == LayerKind.MLA:
        content = mla_content_bytes(layer, cache.kv_cache_dtype, cache.kv_bytes)
        sparse_backend = "SPARSE" in cache.backend.name
        specs: list[KVCacheSpec] = [
            MLAAttentionSpec(
                block_size=cache.block_size,
                num_kv_heads=1,
                head_size=layer.head_size,
                head_size_v=0,
                dtype_bytes=cache.kv_bytes,
                state_content_bytes=content if cache.kv_cache_dtype in PACKED_MLA_BYTES else None,
                cache_dtype_str=cache.kv_cache_dtype,
                # sparse backends read flat rows, so blocks must be whole rows apart (align_blocks_to_rows)
                stride_alignment=content if sparse_backend else 1,
            )
        ]
        if layer.indexer_head_dim:
            indexer_bytes = layer.indexer_head_dim + layer.indexer_head_dim // 128 * 4
            specs.append(
                MLAAttentionSpec(
                    block_size=cache.block_size,
                    num_kv_heads=1,
                    head_size=indexer_bytes,
                    head_size_v=0,
                    dtype_bytes=1,  # fp8 values + one fp32 scale per 128, stored as uint8
                    cache_role="indexer",
                )
            )
        return specs
    if kind == LayerKind.MAMBA:
        if layer.state is None:
            raise UsageError(f"layer {index} is a mamba/linear layer without state dimensions")
        shapes, conv_like = mamba_state_shapes(layer.state, tp, cache.num_speculative_tokens)
        checkpoint_blocks = 0
        if (layer.state.family == "mamba2" and cache.mamba2_checkpoints) or (
            layer.state.family == "gdn" and cache.gdn_checkpoints
        ):
            checkpoint_blocks = 1  # MambaMixer2 (0.32+) / FlashInfer GDN (0.33+) keep a prefill checkpoint
        return [
            MambaSpec(
                block_size=cache.block_size if cache.mamba_cache_mode in ("align", "all") else 0,
                shapes=shapes,
                dtype_sizes=mamba_state_dtype_sizes(layer.state, cache.model_dtype, conv_like),
                page_size_padded=cache.mamba_page_padded,
                num_speculative_blocks=cache.num_speculative_tokens,
                num_prefill_checkpoint_blocks=checkpoint_blocks,
                family=layer.state.family,
            )
        ]
    raise UsageError(f"layer {index}: unknown layer kind {layer.kind!r}")


def _check_gqa_dcp(layer: LayerFacts, tp: int, dcp: int) -> None:
    """ModelConfig.verify_with_parallel_config for decode context parallel on GQA/MQA."""
    kv = layer.num_kv_heads
    if tp <= kv:
        raise UsageError(
            f"Decode context parallelism for GQA/MQA requires --tensor-parallel-size ({tp}) to be greater "
            f"than the model's total number of KV heads ({kv})."
        )
    if dcp > tp // kv:
        raise UsageError(f"--decode-context-parallel-size ({dcp}) exceeds the maximum ({tp // kv})")
