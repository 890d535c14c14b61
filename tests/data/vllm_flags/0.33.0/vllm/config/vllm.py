from vllm.config.compilation import CompilationConfig


class VllmConfig:
    compilation_config: CompilationConfig | None = None
    optimization_level: int = 2
