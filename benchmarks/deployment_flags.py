"""Deployment flags: is every vLLM 0.33 flag that changes GPU memory modelled or named, never silent?

Two parts, both planned offline through the real planner (planning.plan_for, no GPU needed):

1. Every flag of `vllm serve` 0.33 (core/vllm_flag_list.py), each added alone to one Llama-3.1-70B
   TP 4 deployment on four 80 GiB H100s. Per flag family (vLLM's config class) it counts:
   modelled (core/vllm_flags.py MODELLED), no GPU effect, named (the plan lists it in
   not_modelled_flags), refused (vLLM's own config-time refusal, e.g. a value it rejects), and
   silent: a flag the table says changes memory that the plan neither counts nor names. Goal: 0.
2. A matrix of real deployments (the example configs, with the flags above alone and combined) with
   the per-GPU figures: weights, activation, KV needed, margin, the verdict and what is named.

Usage: python benchmarks/deployment_flags.py   (prints; asserts nothing)
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from vllm_ctxmgr.change.planning import PlanRequest, plan_for
from vllm_ctxmgr.core.deployment import LORA_FLAGS
from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.serve_args import parse_serve_argv
from vllm_ctxmgr.core.vllm_flag_list import VLLM_FLAGS
from vllm_ctxmgr.core.vllm_flags import MODELLED, classify
from vllm_ctxmgr.errors import CtxmgrError

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "examples" / "models"
QWEN25_VL = REPO / "tests" / "data" / "deployment" / "qwen2.5-vl-72b-instruct"
SAMPLE_VALUE = {"value": "1", "json": "{}", "list": "a", "optional": None, "bool": None, "switch": None}


def _request(context: int, gpus: int, memory: str = "80", name: str = "NVIDIA H100 80GB HBM3", **kw: object):
    return PlanRequest(context, gpu_memory=int(float(memory) * GIB), gpu_count=gpus, gpu_name=name, **kw)  # type: ignore[arg-type]


def every_flag() -> None:
    base = [str(MODELS / "llama-3.1-70b"), "-tp", "4", "--max-model-len", "32768"]
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    older: Counter[str] = Counter()  # the flags only older releases have, for a unit whose vLLM is unknown
    silent: list[str] = []
    for names, _dest, cls, kind, releases, _source in VLLM_FLAGS:
        name = names[0]
        # 0.33's flags by family (a unit on 0.33 is refused the older ones); the older ones in one row
        tally = counts[cls or "(parser)"] if releases.endswith("0.33") else older
        if name in ("--model", "--config"):
            continue
        value = SAMPLE_VALUE[kind]
        # the LoRA sizes take effect only with --enable-lora (config/lora.py is built only then)
        lora = ["--enable-lora"] if name in LORA_FLAGS and name != "--enable-lora" else []
        args = parse_serve_argv([*base, *lora, name, *([value] if value is not None else [])])
        effect = classify(name)
        assert effect is not None
        try:
            plan = plan_for(args, _request(32768, 4))
        except (CtxmgrError, ValueError):
            tally["refused"] += 1
            continue
        named = {n.flag for n in plan.not_modelled}
        counted = name in LORA_FLAGS and plan.gpus and "--enable-lora" in plan.gpus[0].weights.source
        if name in MODELLED or counted:
            tally["modelled"] += 1
        elif name in named:
            tally["named"] += 1
        elif effect.effect == "none":
            tally["no GPU effect"] += 1
        else:
            tally["silent"] += 1
            silent.append(name)
    columns = ("modelled", "named", "no GPU effect", "refused", "silent")
    print(f"{'flag family (vLLM config class)':32s}" + "".join(f"{c:>15s}" for c in columns))
    total: Counter[str] = Counter()
    for family in sorted(counts):
        total.update(counts[family])
        print(f"{family:32s}" + "".join(f"{counts[family][c]:>15d}" for c in columns))
    print(f"{'all 0.33 flags':32s}" + "".join(f"{total[c]:>15d}" for c in columns))
    print(f"{'flags only older releases have':32s}" + "".join(f"{older[c]:>15d}" for c in columns))
    print(f"silent: {', '.join(silent) or 'none'}")


MATRIX: list[tuple[str, list[str], int, int, str, str]] = [
    # label, vLLM argv, context, GPUs, GiB per GPU, GPU name
    ("GLM-5 TP 8", [str(MODELS / "glm-5"), "-tp", "8"], 65536, 8, "141", "NVIDIA H200"),
    (
        "GLM-5 TP 8 + MTP (dotted) + fp8 KV",
        [
            str(MODELS / "glm-5"),
            "-tp",
            "8",
            "--speculative-config.method",
            "mtp",
            "--speculative-config.num_speculative_tokens",
            "1",
            "--kv-cache-dtype",
            "fp8",
        ],
        65536,
        8,
        "141",
        "NVIDIA H200",
    ),
    (
        "DeepSeek-V3 TP 8 + MTP + fp8 KV",
        [
            str(MODELS / "deepseek-v3"),
            "-tp",
            "8",
            "--speculative-config",
            '{"method": "mtp", "num_speculative_tokens": 1}',
            "--kv-cache-dtype",
            "fp8",
        ],
        65536,
        8,
        "141",
        "NVIDIA H200",
    ),
    (
        "DeepSeek-V3 TP 8 + ngram",
        [
            str(MODELS / "deepseek-v3"),
            "-tp",
            "8",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
        ],
        65536,
        8,
        "141",
        "NVIDIA H200",
    ),
    (
        "Llama-3.1-70B TP 4",
        [str(MODELS / "llama-3.1-70b"), "-tp", "4"],
        65536,
        4,
        "80",
        "NVIDIA H100 80GB HBM3",
    ),
    (
        "Llama-3.1-70B TP 4 + LoRA 8 x r64",
        [
            str(MODELS / "llama-3.1-70b"),
            "-tp",
            "4",
            "--enable-lora",
            "--max-loras",
            "8",
            "--max-lora-rank",
            "64",
        ],
        65536,
        4,
        "80",
        "NVIDIA H100 80GB HBM3",
    ),
    (
        "Llama-3.1-70B TP 4 + fp8_per_tensor",
        [str(MODELS / "llama-3.1-70b"), "-tp", "4", "--quantization", "fp8_per_tensor"],
        65536,
        4,
        "80",
        "NVIDIA H100 80GB HBM3",
    ),
    (
        "Llama-3.1-70B TP 4 + cpu-offload 8 GiB",
        [str(MODELS / "llama-3.1-70b"), "-tp", "4", "--cpu-offload-gb", "8"],
        65536,
        4,
        "80",
        "NVIDIA H100 80GB HBM3",
    ),
    (
        "Llama-3.1-70B TP 4, chunked prefill off",
        [str(MODELS / "llama-3.1-70b"), "-tp", "4", "--no-enable-chunked-prefill"],
        65536,
        4,
        "80",
        "NVIDIA H100 80GB HBM3",
    ),
    (
        "Qwen3-32B TP 2 + YaRN hf-overrides",
        [
            str(MODELS / "qwen3-32b"),
            "-tp",
            "2",
            "--hf-overrides",
            '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
            '"original_max_position_embeddings": 32768},'
            ' "max_position_embeddings": 131072}',
        ],
        131072,
        2,
        "80",
        "NVIDIA H100 80GB HBM3",
    ),
    ("Qwen2.5-VL-72B TP 4", [str(QWEN25_VL), "-tp", "4"], 128000, 4, "80", "NVIDIA H100 80GB HBM3"),
    (
        "Qwen2.5-VL-72B TP 4, images",
        [str(QWEN25_VL), "-tp", "4", "--limit-mm-per-prompt", '{"image": 4, "video": 0}'],
        128000,
        4,
        "80",
        "NVIDIA H100 80GB HBM3",
    ),
    ("gpt-oss-120b", [str(MODELS / "gpt-oss-120b")], 131072, 1, "141", "NVIDIA H200"),
    (
        "gpt-oss-120b + LMCache",
        [
            str(MODELS / "gpt-oss-120b"),
            "--kv-transfer-config",
            '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}',
        ],
        131072,
        1,
        "141",
        "NVIDIA H200",
    ),
    (
        "Qwen3-Next-80B DP 2 + EP",
        [str(MODELS / "qwen3-next-80b-a3b"), "-tp", "2", "-dp", "2", "--enable-expert-parallel"],
        65536,
        4,
        "141",
        "NVIDIA H200",
    ),
]


def matrix() -> None:
    print()
    print(
        f"{'deployment':42s} {'weights':>8s} {'activ.':>7s} {'KV need':>8s} {'margin':>7s}  "
        f"(GiB per GPU)  verdict / named"
    )
    for label, argv, context, gpus, memory, name in MATRIX:
        args = parse_serve_argv(argv)
        try:
            plan = plan_for(args, _request(context, gpus, memory, name))
        except CtxmgrError as exc:
            print(f"{label:42s} refused: {exc.message}")
            continue
        line = plan.gpus[0] if plan.gpus else None

        def gib(figure: object) -> str:
            value = getattr(figure, "bytes", None)
            return f"{value / GIB:8.2f}" if value is not None else "       ?"

        named = ", ".join(dict.fromkeys(n.flag for n in plan.not_modelled)) or "-"
        verdict = "fits" if plan.feasible else "does not fit"
        figures = (
            f"{gib(line.weights)} {gib(line.activation_peak)[1:]} "
            f"{gib(line.kv_needed)} {gib(line.margin)[1:]}"
            if line
            else "?"
        )
        print(f"{label:42s} {figures}  {verdict}; named: {named}")


if __name__ == "__main__":
    every_flag()
    matrix()
