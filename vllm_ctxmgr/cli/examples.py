"""Each command's examples, shown as its epilog."""

from __future__ import annotations


def examples(*lines: str) -> str:
    """A command's epilog: its examples, one per line, kept as written."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


EXAMPLES = {
    "facts": examples(
        "ctxmgr facts /srv/models/Llama-3.1-70B-Instruct",
        "ctxmgr facts Qwen/Qwen3-8B --json            # a repo in the HF cache",
    ),
    "gpus": examples(
        "ctxmgr gpus", "ctxmgr gpus --json > h200.json     # for plan --gpus-from on another host"
    ),
    "plan": examples(
        "ctxmgr plan 200000 --service vllm-glm5         # what set-context would do to a service",
        "ctxmgr plan auto --service vllm-glm5          # the largest context that fits",
        "ctxmgr plan --unit units/vllm-llama70b.service --model examples/models/llama-3.1-70b \\",
        "    --gpu-memory 80GiB --gpu-count 4            # a shipped unit against a local model",
        "ctxmgr plan 128k --model /srv/models/X -tp 8 --gpu-memory 141GiB --gpu-count 8 --kv-cache-dtype fp8",
    ),
    "set-context": examples(
        "ctxmgr set-context 200000 vllm-glm5 --dry-run  # the plan and the unit diff",
        "sudo ctxmgr set-context 200k vllm-glm5 --yes",
        "sudo ctxmgr set-context auto --service vllm-glm5 --timeout 45min --json",
    ),
    "rollback": examples(
        "ctxmgr rollback vllm-glm5 --dry-run", "sudo ctxmgr rollback vllm-glm5 --to 3 --yes"
    ),
    "recover": examples("sudo ctxmgr recover vllm-glm5"),
    "history": examples("ctxmgr history vllm-glm5", "ctxmgr history --service vllm-glm5 --json"),
    "observe": examples(
        "sudo ctxmgr observe vllm-glm5",
        "sudo ctxmgr observe vllm-glm5 --json > start.json",
        "sudo ctxmgr observe vllm-glm5 --import start.json   # on another host, same GPU and vLLM",
    ),
    "verify": examples(
        "sudo ctxmgr verify vllm-glm5",
        "sudo ctxmgr verify vllm-glm5 --on-failure rollback --textfile /var/lib/node_exporter/glm5.prom",
    ),
    "schedule": examples(
        "sudo ctxmgr schedule vllm-glm5 --every 15min",
        "sudo ctxmgr schedule vllm-glm5 --every '*:0/30' --on-failure restart",
    ),
    "unschedule": examples("sudo ctxmgr unschedule vllm-glm5"),
    "status": examples("ctxmgr status", "ctxmgr status --json"),
}
