"""The pure core: model facts, vLLM's arguments, KV specs and layout, the planner.

Nothing here does I/O (no files, subprocesses, NVML or HTTP): it imports only core/ and errors.
"""
