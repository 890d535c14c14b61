from typing import Optional


class SchedulerConfig:
    max_num_seqs: Optional[int] = None
    num_scheduler_steps: int = 1
    cuda_graph_sizes: list[int] = []


class CompilationConfig:
    level: int = 0


class ModelConfig:
    rope_scaling: Optional[dict] = None
    max_model_len: Optional[int] = None
    compilation_config: Optional["CompilationConfig"] = None
