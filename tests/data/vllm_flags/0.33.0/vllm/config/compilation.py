class CompilationConfig:
    mode: int = 0
