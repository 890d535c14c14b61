"""vllm-ctxmgr: change a systemd-run vLLM's context length safely."""

__version__ = "0.1.0"
