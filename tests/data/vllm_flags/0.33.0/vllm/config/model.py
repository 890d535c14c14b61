class ModelConfig:
    max_model_len: int | None = None
    hf_overrides: dict[str, object] | None = None
