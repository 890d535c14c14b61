"""vLLM's KV-cache accounting in plain Python (no torch, no I/O), in vLLM's own files.

- `specs.py`: one spec per layer kind (v1/kv_cache_interface.py) and how a layer becomes one;
- `backends.py`: the attention backend vLLM picks, its block sizes, KV dtypes and their bytes, per-model
  quirks (GLM-5 DSA, DeepSeek-V3.2);
- `layout.py`: groups, page-size unification, the shared block pool, blocks per request, PP stages
  (v1/core/kv_cache_planning.py, kv_cache_utils.py before 0.33).

Import from the submodule that owns a name: this package re-exports nothing.
"""
