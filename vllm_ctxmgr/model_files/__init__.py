"""Model files as vLLM reads them (HF config.json, the HF cache, safetensors headers, GGUF) -> core.facts."""
