"""What vLLM spends on one GPU besides weights and KV cache, before any start has been observed.

Pure: model facts, serve args, platform and version in; one `NonKvMemory` of named terms out. The
planner uses these only until a start of the same service logged its own figures (core/plan.py).

vLLM's budget (v1/worker/gpu_worker.py:determine_available_memory, utils/mem_utils.py:memory_profiling):

    KV budget = ceil(total x u) - weights - profile peak - non-torch growth [- CUDA graph estimate]

Each term below mirrors the vLLM code that allocates it (0.33 sources unless a version is named):

- profile peak: `GPUModelRunner.profile_run` runs `_dummy_run(max_num_tokens)` (one forward pass of
  max_num_batched_tokens tokens) and then `_dummy_sampler_run` on the last rank. The two do not
  overlap (the forward's activations are freed before the sampler runs), so the torch peak is the
  larger of the two: `ACTIVATION` and `SAMPLER` below.
- forward activations: the residual stream, the attention projections and the MLP (dense: gate_up +
  activation; MoE: fused_moe's three intermediate caches, [T, top_k, 2N], [T x top_k, N] and
  [T, top_k, H] in model_executor/layers/fused_moe), each at the model dtype, divided over TP where
  vLLM shards them. A shape model: attention-backend workspaces and quantised-kernel scratch are
  not in it, so it is an estimate.
- dummy sampler pass: `compute_logits` returns [num_reqs, vocab] in the model dtype (gathered to the
  whole vocabulary on every TP rank); `Sampler.forward` casts it to float32; the dummy metadata sets
  top_k = vocab - 1 and top_p = 0.9 on every row, so top-k/top-p run on the whole matrix. Which
  kernel does it is `TopKTopPSampler`'s choice (see `uses_flashinfer_sampler`): FlashInfer's
  `top_k_top_p_sampling_from_logits` masks into a new float32 tensor and takes a float32 softmax of
  it; otherwise, up to 0.16, `apply_top_k_top_p` in PyTorch (a sort: float32 values + int64
  indices and the radix sort's double buffers of both, then a float32 softmax and a bool mask), and
  from 0.17 a Triton kernel that masks in place, then `forward_native`'s float32 softmax and
  `random_sample`'s float32 exponential noise. num_reqs = min(max_num_seqs, max_num_batched_tokens)
  (`_dummy_run` splits the tokens over at most max_num_seqs requests). The tensor sizes are exact;
  which tensors are alive together is read from the code (the sort's scratch is an estimate), and
  two public 0.10 starts on an A100 (tests/data/public-logs) leave 0.04 GiB beside FlashInfer's pass.
- CUDA graphs (vLLM >= 0.18 measures them in `profile_cudagraph_memory`): per capture mode, the first
  (largest) capture's memory plus (n - 1) x the second capture's; FULL and PIECEWISE share one pool,
  so the largest first capture counts once. Here the first capture is the forward activation at the
  largest capture size and each further capture `PIECEWISE_GRAPH_BYTES_PER_LAYER` per layer
  (piecewise graphs are one per layer split) or `FULL_GRAPH_BYTES` (vLLM's own 1 MiB floor). Capture
  sizes follow `VllmConfig._set_cudagraph_sizes`: [1, 2, 4] + range(8, 256, 8) + range(256, max+1,
  16) up to min(2 x max_num_seqs, 512) (1024 on SM100), FULL for decode sizes <= max_num_seqs.
- MoE scratch: the experts' workspaces at the profile run's token count (`moe_workspace_width`), part
  of the forward pass; where vLLM keeps them in its WorkspaceManager (rule moe_workspace_persistent)
  they are still held during the sampler pass, so that pass's peak is the sampler's tensors on top.
- non-torch growth: cuBLAS/cuBLASLt workspaces and (TP > 1) NCCL's buffers connected lazily by the
  profile run's large all-reduces, counted by memory_profiling as non_torch_increase (utils/
  mem_utils.py:306; from 0.27 inside total_consumed, mem_utils.py:312): estimates by interconnect
  (NVLink peers or PCIe, `nvlink_peers`), from public starts' logged non-torch figures.
- startup overhead (before vLLM's snapshot, so outside the budget but inside the free-memory check):
  the CUDA context and, with more than one rank, NCCL communicators and the custom all-reduce's
  buffers (gpu_worker.py:504 init_worker_distributed_environment, then the snapshot at :541): an
  estimate. Before 0.11 the snapshot preceded the distributed init (rule
  budget_snapshot_after_dist_init), so NCCL's share counts as non-torch growth inside the budget.

Every term says whether it is an estimate and how far it may be off (`spread`); the planner widens
its margin by the spreads of the estimated terms it counts (see `margin_widening`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_ctxmgr.core.facts import DTYPE_BYTES, LayerKind, ModelFacts
from vllm_ctxmgr.core.hardware import GIB, Platform
from vllm_ctxmgr.core.kv.backends import VllmVersion
from vllm_ctxmgr.core.vllm_versions import rule

MIB = 1 << 20
CUDA_CONTEXT_ESTIMATE = 512 * MIB  # CUDA context + cuBLAS handles on a Hopper-class GPU
# NCCL communicators and the all-reduce buffers vLLM makes at its distributed init, more than one rank:
# with NVLink peers (NCCL's P2P transport, many channels) and over PCIe (few channels, shared memory)
NCCL_ESTIMATE = 512 * MIB
NCCL_PCIE_ESTIMATE = 128 * MIB
# cuBLAS/cuBLASLt workspaces allocated outside torch's pool: public 0.10 starts on A100s leave about
# 0.04 GiB (one GPU) and 0.19 GiB (TP 4 over Ray, no custom all-reduce) beside the sampler's pass
NON_TORCH_ESTIMATE = 128 * MIB
# NCCL's buffers connected lazily by the profile run's first large all-reduce (TP > 1), inside the
# budget on every version: vLLM warms NCCL with one float (distributed/device_communicators/
# pynccl.py:188 "A small all_reduce for warmup"), and an all-reduce of tokens x hidden model-dtype
# values above the custom all-reduce's and symmetric memory's limits (custom_all_reduce.py:138
# max_size 8 MiB; all_reduce_utils.py SYMM_MEM_ALL_REDUCE_MAX_SIZES: 64 MiB at TP 2 on SM 9.0, 8192 x
# 8192 x 2 B = 128 MiB for a 70B model's profile run) goes to NCCL, which connects the channels of
# the algorithm it picks for that size then (NCCL_RUNTIME_CONNECT). With NVLink peers that is the
# bulk of NCCL's memory: vllm-project/vllm#10511 shows an H100 at TP 2 with 1.79 GiB more non-torch
# memory than at TP 1, and the public Qwen3-Next start on two H200s (tests/data/public-logs, 0.10.2,
# communicators inside the budget) logs 1.38 GiB of non-torch memory in all. Over PCIe (custom
# all-reduce off beyond two PCIe GPUs, custom_all_reduce.py:267) the public Qwen3-235B start on eight
# L40S logs 0.21 GiB in all. After 0.11 (communicators before the snapshot), a public 0.26.0 start of
# GLM-5.2-NVFP4 at TP 4 with NVLink (search index file 61511710941, its repository not named; no
# config here to plan it whole) logs 0.95 GiB of non-torch memory, its FlashInfer all-reduce
# workspace made lazily during the profile run's compile included: under this 1.25 + 0.125 GiB.
NCCL_LAZY_NVLINK_ESTIMATE = 1280 * MIB
NCCL_LAZY_PCIE_ESTIMATE = 128 * MIB
ACTIVATION_FLOOR = 256 * MIB  # what a tiny model's profile run still reserves (allocator segments)
ACTIVATION_FALLBACK = 2 * GIB  # no hidden_size: the model's shapes are unknown
CUDA_GRAPH_FALLBACK = 1 * GIB  # no layer count or shapes to size graphs by
PIECEWISE_GRAPH_BYTES_PER_LAYER = MIB // 2  # one piecewise capture's pool growth per layer (estimate)
FULL_GRAPH_BYTES = MIB  # profile_cudagraph_memory: "at least 1 MiB per graph for driver overhead"
# How far each estimated term may be off, as a fraction of it: the margin grows by these.
ACTIVATION_SPREAD = 0.25  # a shape model: backend workspaces and kernel scratch are not in it
SAMPLER_SPREAD = 0.10  # exact tensor sizes; only which of them overlap is read, not measured
CUDA_GRAPH_SPREAD = 0.50  # the per-graph figure is fitted to public logs, not derived
NON_TORCH_SPREAD = 0.50  # flat guesses


@dataclass(frozen=True)
class Term:
    """One non-KV figure per GPU, where it comes from, and how far it may be off."""

    bytes: int
    source: str  # the vLLM code it mirrors, or "estimate (...)"
    estimated: bool = True
    spread: int = 0  # bytes it may be off by; 0 for a figure vLLM logged or the files state

    @classmethod
    def estimate(cls, value: int, source: str, spread: float) -> Term:
        """A guessed term: `spread` is the fraction it may be off, kept in bytes for the plan's margin."""
        return cls(int(value), source, True, int(value * spread))


@dataclass(frozen=True)
class NonKvMemory:
    """Everything but weights and KV on one GPU of a rank, as vLLM's profiling will find it."""

    forward_activation: Term  # _dummy_run(max_num_batched_tokens)
    sampler: Term  # _dummy_sampler_run (zero on ranks without the sampler)
    non_torch: Term
    cuda_graphs: Term
    startup_overhead: Term  # before the snapshot: CUDA context (+ NCCL)

    @property
    def activation_peak(self) -> Term:
        """The profile run's torch peak: the forward or the sampler, whichever is larger."""
        peak = max(self.forward_activation, self.sampler, key=lambda t: t.bytes)
        bytes_ = max(ACTIVATION_FLOOR, peak.bytes)
        return Term(bytes_, peak.source, peak.estimated, peak.spread)

    def estimated_terms(self, graphs_in_budget: bool) -> tuple[str, ...]:
        """The guessed, nonzero terms (CUDA graphs where counted): the ones a plan must name as estimates."""
        names = ["activation_peak", "non_torch", "startup_overhead"]
        if graphs_in_budget or self.cuda_graphs.bytes:
            names.append("cuda_graphs")
        terms = {
            "activation_peak": self.activation_peak,
            "non_torch": self.non_torch,
            "startup_overhead": self.startup_overhead,
            "cuda_graphs": self.cuda_graphs,
        }
        return tuple(n for n in names if terms[n].estimated and terms[n].bytes)


def margin_widening(memory: NonKvMemory, graphs_in_budget: bool) -> int:
    """The KV budget a plan keeps spare on top of its base margin for the terms it had to guess.

    The sum of the spreads of the estimated terms that enter vLLM's budget: the activation peak
    (25% of the forward, 10% of the sampler pass), non-torch growth (50%) and, where vLLM subtracts
    them, CUDA graphs (50%). Each is how far that term's model can be off; with a logged start
    they are replaced by vLLM's own figures and the widening is 0.
    """
    widening = memory.activation_peak.spread + memory.non_torch.spread
    if graphs_in_budget:
        widening += memory.cuda_graphs.spread
    return widening


def default_max_num_seqs(platform: Platform) -> int:
    """EngineArgs.get_batch_defaults (OpenAI server): 1024 on >= 70 GiB GPUs but A100/GB10, else 256."""
    memory = platform.total_memory_bytes
    if platform.is_cpu or memory is None:
        return 256 if platform.is_cpu else 1024
    is_gb10 = platform.compute_capability == (12, 1)
    if memory >= 70 * GIB and "a100" not in platform.device_name.lower() and not is_gb10:
        return 1024
    return 256


def _dtype_bytes(facts: ModelFacts) -> int:
    return DTYPE_BYTES.get(facts.dtype, 2)


def _attention_width(facts: ModelFacts, tp: int) -> int:
    """q + k + v + attention output per token on one rank, in elements (qkv_proj, o_proj inputs)."""
    head = next((layer for layer in facts.layers if layer.kind != LayerKind.NONE and layer.head_size), None)
    head_size = head.head_size if head is not None else (facts.hidden_size or 0) // facts.num_attention_heads
    kv_heads = facts.num_attention_heads  # MLA expands its latent to every head for prefill
    if head is not None and head.kind != LayerKind.MLA:
        kv_heads = head.num_kv_heads
    q = facts.num_attention_heads * head_size
    return (2 * q + 2 * kv_heads * head_size) // max(1, tp)


def _mlp_width(facts: ModelFacts, tp: int) -> int:
    """The MLP's intermediates per token on one rank, in elements."""
    hidden = facts.hidden_size or 0
    if facts.num_experts and facts.num_experts_per_tok:
        return moe_workspace_width(facts, tp)
    intermediate = facts.intermediate_size or 4 * hidden
    return 3 * intermediate // max(1, tp)  # gate_up [T, 2I] + act [T, I]


def moe_workspace_width(facts: ModelFacts, tp: int) -> int:
    """The MoE layer's scratch per token on one rank, in elements: TritonExperts.workspace_shapes
    (model_executor/layers/fused_moe/experts/triton_moe.py:240 @0.33.0): workspace13 [M, topk,
    max(N / 2, K)] (also the output [M, K]: modular_kernel.py:1188 reuses it) and workspace2 [M, topk,
    max(N, K)], N = w13's rows = 2 x the expert's width on this rank, K = hidden. One chunk of all the
    profile run's tokens (modular_kernel.py:1354 passes M_full as the chunk). fused_moe.py:1749's
    non-modular path (cache13 [M x topk x max(N, K)] + cache2 [M x topk, N / 2]) is no larger."""
    hidden = facts.hidden_size or 0
    expert = (facts.moe_intermediate_size or facts.intermediate_size or hidden) // max(1, tp)
    return facts.num_experts_per_tok * (max(expert, hidden) + max(2 * expert, hidden))


def moe_workspace_bytes(facts: ModelFacts, tokens: int, tp: int) -> int:
    """The MoE scratch of a forward pass of `tokens` tokens; 0 for a dense model."""
    if not (facts.num_experts and facts.num_experts_per_tok and facts.hidden_size):
        return 0
    return tokens * moe_workspace_width(facts, tp) * _dtype_bytes(facts)


def nvlink_peers(platform: Platform) -> bool:
    """Whether a board's GPUs reach each other over NVLink, which decides how much NCCL takes.

    vLLM asks NVML (platforms/cuda.py is_fully_connected, custom_all_reduce.py:266); a plan has only
    the board's name: PCIe-only families (GeForce/RTX, L4/L20/L40(S), A2/A10/A16/A40, T4, Quadro,
    TITAN) and boards named PCIe are PCIe; any other name (SXM boards: A100-SXM4, H100 80GB HBM3,
    H200, B200, ...) or none is planned as NVLink, the costlier.
    """
    words = set(re.split(r"[\s\-_/]+", platform.device_name.lower()))
    pcie_only = {"pcie", "geforce", "rtx", "l4", "l20", "l40", "l40s", "a2", "a10", "a16", "a40", "t4"}
    return not (words & pcie_only or {"quadro", "titan"} & words)


def forward_activation_bytes(facts: ModelFacts, tokens: int, tp: int) -> int | None:
    """One forward pass of `tokens` tokens: residual + normed + output stream, then attention or MLP."""
    if not facts.hidden_size:
        return None
    width = 3 * facts.hidden_size + max(_attention_width(facts, tp), _mlp_width(facts, tp))
    return tokens * width * _dtype_bytes(facts)


def uses_flashinfer_sampler(
    version: VllmVersion, platform: Platform, env: dict[str, str], installed: bool | None
) -> bool:
    """TopKTopPSampler.__init__'s choice on this version (v1/sample/ops/topk_topp_sampler.py).

    0.10-0.11: FlashInfer whenever it is installed, unless VLLM_USE_FLASHINFER_SAMPLER=0; 0.12-0.20:
    only with VLLM_USE_FLASHINFER_SAMPLER=1; from 0.21 by default again (envs.py's default turned
    True; FlashInfer is a dependency), on SM 8.0 and up. `installed` None (a venv ctxmgr cannot
    see): taken as not installed, the choice whose pass costs more.
    """
    if not platform.is_cuda:
        return False
    flag = env.get("VLLM_USE_FLASHINFER_SAMPLER")
    setting = None if flag is None else flag.strip() not in ("0", "", "false", "False")
    if setting is False:
        return False
    when = rule("sampler_flashinfer", version)
    if when == "when_installed":
        return bool(installed)
    if when == "opt_in":
        return setting is True and installed is not False
    capability = platform.compute_capability
    return capability is None or capability >= (8, 0)


def sampler_bytes_per_element(facts: ModelFacts, version: VllmVersion, flashinfer: bool = False) -> int:
    """Bytes alive per logit at the dummy sampler pass's peak (see the module docstring)."""
    model_logits = _dtype_bytes(facts)
    float32_logits = 4
    if flashinfer:
        # top_k_mask_logits writes a new float32 tensor; its softmax is another
        return model_logits + float32_logits + 4 + 4
    if rule("sampler_top_k_top_p", version) == "pytorch_sort":
        # apply_top_k_top_p (PyTorch): logits.sort() returns values f32 + indices i64; while it runs,
        # PyTorch's segmented sort feeds cub an int64 index input of its own (an arange, 8 B) and cub's
        # radix sort holds a second (double-buffer) copy of keys and values (4 + 8); the softmax f32 and
        # the top-p mask come after the sort's scratch is freed, so the sort is the peak. The scratch is
        # an estimate from how the sort pairs keys and indices; two public 0.10.2 starts whose logged
        # peak is this pass alone (Qwen3-Next on two H200s: 5.58 GiB over 1,024 x 151,936 logits;
        # Qwen3-235B on eight L40S: 1.40 GiB over 256 x 151,936; tests/data/public-logs) put it at
        # 38.5 B a logit, these 38 B
        return model_logits + float32_logits + (4 + 8) + 8 + (4 + 8)
    # Triton top-k/top-p in place; forward_native: softmax f32; random_sample: exponential noise f32
    return model_logits + float32_logits + 4 + 4


def sampler_bytes(
    facts: ModelFacts, num_reqs: int, version: VllmVersion, flashinfer: bool = False
) -> int | None:
    """`_dummy_sampler_run`'s peak over num_reqs x vocab_size logits; None without a vocab_size, so
    the pass is left out rather than guessed.
    """
    if not facts.vocab_size:
        return None
    return num_reqs * facts.vocab_size * sampler_bytes_per_element(facts, version, flashinfer)


def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, platform: Platform) -> list[int]:
    """VllmConfig._set_cudagraph_sizes with no --cuda-graph-sizes / max_cudagraph_capture_size given."""
    ceiling = 1024 if platform.is_capability_family(100) else 512
    largest = min(max_num_seqs * 2, ceiling, max_num_batched_tokens)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)]
    return [s for s in sizes if s <= largest] or [1]


def cuda_graph_bytes(
    facts: ModelFacts, max_num_seqs: int, max_num_batched_tokens: int, tp: int, platform: Platform
) -> tuple[int, str]:
    """profile_cudagraph_memory's estimate: max first capture + (n - 1) x per graph, per mode."""
    sizes = cudagraph_capture_sizes(max_num_seqs, max_num_batched_tokens, platform)
    full = [s for s in sizes if s <= max_num_seqs]
    first = forward_activation_bytes(facts, sizes[-1], tp)
    if first is None:
        return CUDA_GRAPH_FALLBACK, "estimate (flat: the model's shapes are unknown)"
    layers = facts.num_hidden_layers
    piecewise_each = max(FULL_GRAPH_BYTES, layers * PIECEWISE_GRAPH_BYTES_PER_LAYER)
    total = first + (len(sizes) - 1) * piecewise_each + max(0, len(full) - 1) * FULL_GRAPH_BYTES
    source = (
        f"estimate (profile_cudagraph_memory: PIECEWISE={len(sizes)} FULL={len(full)} "
        f"(largest={sizes[-1]}), {layers} layers)"
    )
    return total, source


def non_kv_memory(
    facts: ModelFacts,
    *,
    version: VllmVersion,
    platform: Platform,
    max_num_batched_tokens: int,
    max_num_seqs: int | None,
    tensor_parallel_size: int,
    world_size: int,
    enforce_eager: bool,
    last_pipeline_stage: bool = True,
    flashinfer_sampler: bool = False,
) -> NonKvMemory:
    """The non-KV terms of one GPU, each with the vLLM code it mirrors and its spread."""
    tp = max(1, tensor_parallel_size)
    seqs = max_num_seqs or default_max_num_seqs(platform)
    num_reqs = min(seqs, max_num_batched_tokens)

    forward = forward_activation_bytes(facts, max_num_batched_tokens, tp)
    if forward is None:
        forward_term = Term.estimate(ACTIVATION_FALLBACK, "estimate (flat: hidden_size unknown)", 0.5)
    else:
        forward_term = Term.estimate(
            forward, f"estimate (_dummy_run of {max_num_batched_tokens} tokens)", ACTIVATION_SPREAD
        )
    sampled = sampler_bytes(facts, num_reqs, version, flashinfer_sampler) if last_pipeline_stage else 0
    # the MoE scratch outlives the forward where vLLM keeps it (v1/worker/workspace.py's WorkspaceManager,
    # grown during the profile run and locked after it, gpu_model_runner.py:6508): it is still held
    # while the sampler pass runs, so that pass's peak stands on it
    kept = 0
    if sampled and rule("moe_workspace_persistent", version):
        kept = moe_workspace_bytes(facts, max_num_batched_tokens, tp)
    if sampled is None:
        sampler_term = Term.estimate(0, "estimate (vocab_size unknown: sampler pass not counted)", 0)
    else:
        sampler_term = Term.estimate(
            sampled + kept,
            f"estimate (_dummy_sampler_run: {num_reqs} x {facts.vocab_size} logits, "
            f"{sampler_bytes_per_element(facts, version, flashinfer_sampler)} B each"
            f"{', FlashInfer' if flashinfer_sampler else ''}"
            f"{f', over the kept MoE workspace of {max_num_batched_tokens} tokens' if kept else ''})",
            SAMPLER_SPREAD,
        )
    nvlink = nvlink_peers(platform)
    lazy_nccl = 0
    if tp > 1 and not platform.is_cpu:
        lazy_nccl = NCCL_LAZY_NVLINK_ESTIMATE if nvlink else NCCL_LAZY_PCIE_ESTIMATE
    nccl_init = NCCL_ESTIMATE if nvlink else NCCL_PCIE_ESTIMATE
    # before 0.11 vLLM took its memory snapshot before the distributed init, so NCCL's communicators
    # grow the profiled non-torch memory (inside the budget) rather than sit before the snapshot
    nccl_in_budget = (
        world_size > 1 and not platform.is_cpu and not rule("budget_snapshot_after_dist_init", version)
    )
    link = "NVLink" if nvlink else "PCIe"
    source = "estimate (cuBLAS workspaces"
    if lazy_nccl:
        source += f", NCCL buffers of the profile run's all-reduces over {link}"
    non_torch_term = Term.estimate(
        NON_TORCH_ESTIMATE + lazy_nccl + (nccl_init if nccl_in_budget else 0),
        source + (f", NCCL communicators ({link}))" if nccl_in_budget else ")"),
        NON_TORCH_SPREAD,
    )
    if enforce_eager:
        graphs_term = Term(0, "--enforce-eager", estimated=False)
    else:
        graphs, source = cuda_graph_bytes(facts, seqs, max_num_batched_tokens, tp, platform)
        graphs_term = Term.estimate(graphs, source, CUDA_GRAPH_SPREAD)
    if platform.is_cpu:
        overhead_term = Term(0, "CPU build", estimated=False)
    else:
        overhead = CUDA_CONTEXT_ESTIMATE + (nccl_init if world_size > 1 and not nccl_in_budget else 0)
        overhead_term = Term.estimate(overhead, "estimate (CUDA context, NCCL)", NON_TORCH_SPREAD)
    return NonKvMemory(forward_term, sampler_term, non_torch_term, graphs_term, overhead_term)
