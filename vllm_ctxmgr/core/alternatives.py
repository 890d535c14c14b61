"""What would help when a context does not fit: the ranked alternatives of an infeasible plan.

An operator told "does not fit" needs the next step: fp8 KV cache, an exact KV budget, smaller prefill
batches, decode context parallel, more GPUs, the longest context that fits, or (last) serving past the
model's derived maximum. Each candidate is the operator's flags with one change, evaluated by the
planner's own rules, so its numbers are as good as the plan's; they are ranked by whether they fit on
the GPUs the service has, then by how little they change.

Each kind of candidate is one small function, kept in the `CANDIDATES` tuple that find_alternatives
walks in order (as vllm_log/patterns.py keeps its line patterns): a new kind is one function and one
entry.

Its own module, apart from core/plan.py: the search only proposes flag changes and ranks them. The
evaluation stays in the planner, which hands it in as `Search.evaluate`, so this module never
imports core/plan.py and the planner imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from vllm_ctxmgr.core.budget import MIB, explicit_budget, kv_needed_bytes
from vllm_ctxmgr.core.facts import ALLOW_LONG_ENV, LayerKind, ModelFacts
from vllm_ctxmgr.core.hardware import GIB, GpuState, Platform
from vllm_ctxmgr.core.kv.backends import is_quantized_kv_cache
from vllm_ctxmgr.core.kv.layout import KVCacheLayout
from vllm_ctxmgr.core.kv.specs import cdiv, round_up
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.core.vllm_versions import VllmVersion
from vllm_ctxmgr.core.weight_cache import key_changes, reload_warning, weight_cache_mode
from vllm_ctxmgr.errors import UsageError

SMALL_BATCH_TOKENS = 2048


@dataclass(frozen=True)
class Alternative:
    """Another way to reach (or approach) the target, with its own numbers."""

    name: str
    description: str
    flag_changes: dict[str, str]
    env_changes: dict[str, str]
    feasible: bool
    max_context: int
    gpu_memory_utilization: float | None
    kv_cache_dtype: str
    kv_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    verdict: str
    needs_gpus: int = 0  # GPUs it needs beyond those the service sees
    rank: int = 0

    def to_json(self) -> dict:
        """One entry of PlanRecord["alternatives"]: another way to the target, with its flags and figures."""
        return {
            "rank": self.rank,
            "name": self.name,
            "description": self.description,
            "feasible": self.feasible,
            "max_context": self.max_context,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_bytes_per_gpu": self.kv_bytes_per_gpu,
            "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu,
            "flag_changes": dict(self.flag_changes),
            "env_changes": dict(self.env_changes),
            "verdict": self.verdict,
            "needs_gpus": self.needs_gpus,
        }


@dataclass(frozen=True)
class Trial:
    """The planner's evaluation of one candidate: what an Alternative reports of it."""

    layout: KVCacheLayout
    feasible: bool
    verdict: str
    utilization: float | None
    max_context: int
    flag_changes: dict[str, str]  # what the planner would set for it (--max-model-len, utilisation, ...)


# (args, target, allow_long, GPUs or None for the service's own) -> Trial; UsageError where vLLM refuses
Evaluate = Callable[[ServeArgs, int, bool, GpuState | None], Trial]


@dataclass(frozen=True)
class Search:
    """What stays the same across the candidates, and the planner's evaluation to try each with."""

    facts: ModelFacts
    args: ServeArgs
    gpus: GpuState | None
    platform: Platform
    derived: int | None  # the model's derived maximum; None: no ceiling
    target: int
    allow_long: bool
    concurrency: int
    evaluate: Evaluate
    vllm_version: VllmVersion


_PREFERENCE = {
    "max-num-batched-tokens": 1,
    "kv-cache-memory-bytes": 2,
    "fp8-kv-cache": 3,
    "decode-context-parallel": 4,
    "tensor-parallel": 5,
    "shorter-context": 9,
    "allow-long": 10,  # last: positions past the trained length are a quality risk
}


def _alternative(
    search: Search,
    name: str,
    description: str,
    args: ServeArgs,
    extra_flags: dict[str, str],
    target: int | None = None,
    allow_long: bool | None = None,
    gpus: GpuState | None = None,
    extra_env: dict[str, str] | None = None,
    needs_gpus: int = 0,
) -> Alternative | None:
    """One candidate: `args` evaluated at `target`; None where vLLM would refuse the configuration."""
    target = target or search.target
    allow = search.allow_long if allow_long is None else allow_long
    try:
        trial = search.evaluate(args, target, allow, gpus)
    except UsageError:
        return None  # vLLM would reject this configuration for this model
    refused = search.derived is not None and target > search.derived and not allow
    env: dict[str, str] = dict(extra_env or {})
    if search.derived is not None and target > search.derived and allow:
        env[ALLOW_LONG_ENV] = "1"
    flags = {**extra_flags, **trial.flag_changes}
    changed = key_changes(search.args, args) if weight_cache_mode(search.args) else []
    if changed:  # the weight-cache daemon's copy no longer matches: it must reload (core/weight_cache.py)
        description = f"{description}; {reload_warning(changed)}"
    return Alternative(
        name=name,
        description=description,
        flag_changes=flags,
        env_changes=env,
        feasible=trial.feasible and not refused,
        max_context=trial.max_context,
        gpu_memory_utilization=trial.utilization,
        kv_cache_dtype=trial.layout.kv_cache_dtype,
        kv_bytes_per_gpu=trial.layout.bytes_needed(target),
        kv_bytes_per_token_per_gpu=trial.layout.bytes_per_token(),
        verdict=trial.verdict,
        needs_gpus=needs_gpus,
    )


def _more_gpus(gpus: GpuState | None, count: int) -> GpuState | None:
    """The service's GPUs, repeated when the host shows fewer than `count` (same model, same tenants)."""
    if gpus is None or not gpus.gpus:
        return gpus
    chosen = list(gpus.gpus[:count])
    while len(chosen) < count:
        template = gpus.gpus[len(chosen) % len(gpus.gpus)]
        chosen.append(replace(template, index=len(chosen), processes=()))
    return GpuState(tuple(chosen), gpus.source, gpus.driver_version)


# Candidate(search, layout, max_context, refused) -> the candidate, or None where it does not apply
Candidate = Callable[[Search, KVCacheLayout, int, bool], Alternative | None]


def _kv_needed(search: Search, layout: KVCacheLayout) -> int:
    """The KV bytes the target needs on the most loaded pipeline stage."""
    return max(
        kv_needed_bytes(layout, search.target, s, search.concurrency)
        for s in range(layout.pipeline_parallel_size)
    )


def _raised_explicit_budget(
    search: Search, layout: KVCacheLayout, max_context: int, refused: bool
) -> Alternative | None:
    """Where the KV budget is set outright (VLLM_CPU_KVCACHE_SPACE, or --kv-cache-memory-bytes without
    GPUs to check), the plan is short only because that number is: raising it to what the target needs
    is the smallest change, though the memory behind it is not checked here."""
    args = search.args
    explicit, source = explicit_budget(args, search.platform, search.vllm_version)
    if explicit is None or not (search.gpus is None or search.platform.is_cpu):
        return None
    needed = _kv_needed(search, layout)
    if source == "VLLM_CPU_KVCACHE_SPACE":
        space = str(cdiv(needed, GIB))
        raised = replace(args, env={**args.env, "VLLM_CPU_KVCACHE_SPACE": space})
        return _alternative(
            search,
            "kv-cache-memory-bytes",
            f"a {space} GiB KV cache (host memory not checked)",
            raised,
            {},
            extra_env={"VLLM_CPU_KVCACHE_SPACE": space},
        )
    raised = replace(args, kv_cache_memory_bytes=round_up(needed, MIB))
    return _alternative(
        search, "kv-cache-memory-bytes", "a larger explicit KV budget (memory not checked)", raised, {}
    )


def _smaller_prefill_batches(
    search: Search, layout: KVCacheLayout, max_context: int, refused: bool
) -> Alternative | None:
    """Sliding-window and chunked layers hold the window plus the tokens in flight, not the context:
    fewer batched tokens shrink them, so a smaller prefill batch frees KV memory for the target."""
    args = search.args
    bounded = any(
        not group.grows_with_context and group.kind in (LayerKind.SLIDING, LayerKind.CHUNKED)
        for group in layout.groups
    )
    if not bounded or layout.max_num_batched_tokens <= SMALL_BATCH_TOKENS:
        return None
    small = replace(
        args,
        max_num_batched_tokens=SMALL_BATCH_TOKENS,
        max_num_seqs=min(args.max_num_seqs, SMALL_BATCH_TOKENS) if args.max_num_seqs else None,
    )
    flags = {"--max-num-batched-tokens": str(SMALL_BATCH_TOKENS)}
    if small.max_num_seqs != args.max_num_seqs:
        flags["--max-num-seqs"] = str(small.max_num_seqs)
    return _alternative(
        search,
        "max-num-batched-tokens",
        "smaller prefill batches: sliding-window layers hold the window plus the tokens in flight",
        small,
        flags,
    )


def _exact_kv_budget(
    search: Search, layout: KVCacheLayout, max_context: int, refused: bool
) -> Alternative | None:
    """On GPUs, --kv-cache-memory-bytes gives the KV cache what the target needs instead of what is
    left under the utilisation fraction (it skips the cap); offered only where that then fits."""
    args = search.args
    if search.gpus is None or args.kv_cache_memory_bytes is not None or search.platform.is_cpu:
        return None
    exact = replace(args, kv_cache_memory_bytes=round_up(_kv_needed(search, layout), MIB))
    alt = _alternative(
        search,
        "kv-cache-memory-bytes",
        "give the KV cache an exact budget instead of a utilisation fraction (skips the cap)",
        exact,
        {},
    )
    return alt if alt is not None and alt.feasible else None


def _fp8_kv_cache(
    search: Search, layout: KVCacheLayout, max_context: int, refused: bool
) -> Alternative | None:
    """An fp8 KV cache holds each token in half the bytes of bf16: about twice the context in the same
    memory, where the model has attention layers and the cache is not quantized already."""
    has_attention = any(
        g.grows_with_context or g.kind in (LayerKind.SLIDING, LayerKind.CHUNKED) for g in layout.groups
    )
    if not has_attention or is_quantized_kv_cache(layout.kv_cache_dtype):
        return None
    # vLLM stores an MLA cache with an indexer (DeepSeek sparse attention) as fp8_ds_mla; named only
    # there, never for a model without an indexer (a Qwen model was told of it)
    sparse = " (stored as fp8_ds_mla for DeepSeek sparse attention)" if search.facts.has_indexer else ""
    return _alternative(
        search,
        "fp8-kv-cache",
        f"fp8 KV cache: about half the bytes of a 16-bit cache{sparse}",
        replace(search.args, kv_cache_dtype="fp8"),
        {"--kv-cache-dtype": "fp8"},
    )


def _decode_context_parallel(
    search: Search, layout: KVCacheLayout, max_context: int, refused: bool
) -> Alternative | None:
    """With tensor parallel, each rank keeps a full replica of the KV heads it cannot split (all of
    MLA's latent, or KV heads fewer than the ranks); decode context parallel gives each rank 1/DCP of
    the tokens instead (MLA with an indexer also needs an fp8 cache there)."""
    args, facts = search.args, search.facts
    tp = args.tensor_parallel_size
    if tp <= 1 or args.decode_context_parallel_size != 1:
        return None
    dcp_args: ServeArgs | None = None
    if facts.is_mla:
        dcp_args = replace(args, decode_context_parallel_size=tp)
        if facts.has_indexer and not is_quantized_kv_cache(layout.kv_cache_dtype):
            dcp_args = replace(dcp_args, kv_cache_dtype="fp8")
    else:
        kv_heads = next((lf.num_kv_heads for lf in facts.layers if lf.kind == LayerKind.FULL), 0)
        if kv_heads and tp // kv_heads >= 2:
            dcp_args = replace(args, decode_context_parallel_size=tp // kv_heads)
    if dcp_args is None:
        return None
    flags = {"--decode-context-parallel-size": str(dcp_args.decode_context_parallel_size)}
    if dcp_args.kv_cache_dtype != args.kv_cache_dtype:
        flags["--kv-cache-dtype"] = dcp_args.kv_cache_dtype
    return _alternative(
        search,
        "decode-context-parallel",
        "decode context parallel: each rank keeps 1/DCP of the tokens instead of a full replica",
        dcp_args,
        flags,
    )


def _more_tensor_parallel(
    search: Search, layout: KVCacheLayout, max_context: int, refused: bool
) -> Alternative | None:
    """Twice the tensor parallel spreads the weights and KV heads over twice the GPUs, leaving each
    more room for the KV cache; sized on the service's GPUs repeated where the host shows fewer, and
    says how many more it needs."""
    args = search.args
    tp = args.tensor_parallel_size
    more_tp = replace(args, tensor_parallel_size=tp * 2)
    ranks_needed = more_tp.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size
    have = len(search.gpus.gpus) if search.gpus is not None else 0
    description = f"tensor parallel {tp * 2}: weights and KV heads spread over twice the GPUs"
    if search.gpus is not None and have < ranks_needed:
        description += f" (needs {ranks_needed} GPUs; this service sees {have})"
    return _alternative(
        search,
        "tensor-parallel",
        description,
        more_tp,
        {"--tensor-parallel-size": str(tp * 2)},
        gpus=_more_gpus(search.gpus, ranks_needed),
        needs_gpus=max(0, ranks_needed - have) if search.gpus is not None else 0,
    )


def _longest_context_that_fits(
    search: Search, layout: KVCacheLayout, max_context: int, refused: bool
) -> Alternative | None:
    """Changing nothing but the context: the longest one that fits as the service is (where the target
    is past the derived maximum, _past_the_derived_maximum offers that maximum instead)."""
    if max_context <= 0 or refused:
        return None
    return _alternative(
        search,
        "shorter-context",
        f"the longest context that fits: {max_context} tokens",
        search.args,
        {},
        target=max_context,
    )


# The memory and parallelism candidates, in the order they are tried (ties in _ranked keep it)
CANDIDATES: tuple[Candidate, ...] = (
    _raised_explicit_budget,
    _smaller_prefill_batches,
    _exact_kv_budget,
    _fp8_kv_cache,
    _decode_context_parallel,
    _more_tensor_parallel,
    _longest_context_that_fits,
)


def _past_the_derived_maximum(search: Search, max_context: int) -> tuple[list[Alternative | None], bool]:
    """A target past the model's derived maximum without allow-long: the derived maximum itself, and
    serving past it with ALLOW_LONG_ENV; True where the latter fits, so nothing else need be tried."""
    allow_long = _alternative(
        search,
        "allow-long",
        f"serve past the derived maximum with {ALLOW_LONG_ENV}=1 (RoPE positions beyond training)",
        search.args,
        {},
        allow_long=True,
    )
    found: list[Alternative | None] = []
    shorter = min(max_context, search.derived or max_context)
    if shorter > 0:
        # the derived maximum only where memory holds it; else memory is what limits, and is named
        what = (
            f"the derived maximum: {shorter} tokens"
            if shorter == search.derived
            else f"the longest context that fits: {shorter} tokens (memory; the derived maximum is "
            f"{search.derived})"
        )
        found.append(_alternative(search, "shorter-context", what, search.args, {}, shorter))
    found.append(allow_long)
    return found, allow_long is not None and allow_long.feasible


def find_alternatives(
    search: Search, layout: KVCacheLayout, max_context: int, refused: bool
) -> tuple[Alternative, ...]:
    """The ranked alternatives of a plan that does not fit `layout` (its KV layout) with `max_context`.

    `refused`: the target is above the derived maximum without allow-long; then serving past it
    comes first if it fits, else the memory alternatives are sized as if it were allowed.
    """
    found: list[Alternative | None] = []
    if refused:
        found, allow_long_fits = _past_the_derived_maximum(search, max_context)
        if allow_long_fits:
            return _ranked(found)
        search = replace(search, allow_long=True)  # memory alternatives past the limit
    for candidate in CANDIDATES:
        found.append(candidate(search, layout, max_context, refused))
    return _ranked(found)


def _ranked(found: Sequence[Alternative | None]) -> tuple[Alternative, ...]:
    """Feasible on the GPUs the service has first, then by how little they change, then by context."""
    ranked = sorted(
        (alt for alt in found if alt is not None),
        key=lambda alt: (
            not alt.feasible,
            alt.needs_gpus > 0,
            _PREFERENCE.get(alt.name, 8),
            -alt.max_context,
        ),
    )
    return tuple(replace(alt, rank=i + 1) for i, alt in enumerate(ranked))
