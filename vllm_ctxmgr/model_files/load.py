"""What a model string means: a local HF directory, a config.json, a GGUF file or a cached repo id."""

from __future__ import annotations

from pathlib import Path

from vllm_ctxmgr.core.facts import ModelFacts
from vllm_ctxmgr.core.json_types import JSONObject
from vllm_ctxmgr.errors import ModelFactsError
from vllm_ctxmgr.model_files.expert_weights import expert_weight_bytes
from vllm_ctxmgr.model_files.hf import load_hf_facts
from vllm_ctxmgr.model_files.hf_cache import HF_REPO_ID, hf_cache_snapshot


def load_model_facts(
    model: str, *, hf_home: str | None = None, hf_overrides: JSONObject | None = None
) -> ModelFacts:
    """Facts for MODEL: a local HF directory, a GGUF file (or split part) or a cached HF repo id.

    Never downloads. Raises ModelFactsError with a one-line message for anything unreadable.
    `hf_overrides` (vLLM's --hf-overrides) apply to a config.json; a GGUF has none to change.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return load_hf_facts(path, source=model, hf_overrides=hf_overrides)
    if path.is_file():
        if path.name == "config.json":
            return load_hf_facts(path.parent, source=model, hf_overrides=hf_overrides)
        from vllm_ctxmgr.model_files.gguf import load_gguf_facts  # a GGUF's reader only for a GGUF

        return load_gguf_facts(path, source=model)
    if path.exists():  # a FIFO, a device, a socket: never opened
        raise ModelFactsError(f"{model}: not a regular file or a directory")
    if model.startswith((".", "/", "~")) or not HF_REPO_ID.match(model):
        raise ModelFactsError(f"model path not found: {model}")
    return load_hf_facts(hf_cache_snapshot(model, hf_home), source=model, hf_overrides=hf_overrides)


def load_expert_weight_bytes(model: str, *, hf_home: str | None = None) -> int | None:
    """The routed experts' bytes of MODEL's safetensors shards (model_files/expert_weights.py);
    None for a GGUF, a config-only directory, or a repo id that is not cached."""
    path = Path(model).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not path.is_dir():
        if path.exists() or model.startswith((".", "/", "~")) or not HF_REPO_ID.match(model):
            return None
        try:
            path = hf_cache_snapshot(model, hf_home)
        except ModelFactsError:
            return None
    return expert_weight_bytes(path)
