"""vLLM's `--hf-overrides` applied to a config.json, before anything reads the config.

config/model.py (0.33.0) `ModelConfig.__post_init__` splits the overrides: a flat value goes to
`config.update(...)` on the top-level config (transformers_utils/config.py get_config), a dict value
to `_apply_dict_overrides`, which merges it into a nested sub-config (text_config, vision_config ...)
and sets any other dict-valued parameter (rope_scaling, rope_parameters) whole. Then
`patch_rope_parameters` reads rope_scaling / rope_parameters as usual, so the derived maximum length
(max_position_embeddings x the RoPE factor) follows the overrides.
"""

from __future__ import annotations

import json
from typing import TypeVar

from vllm_ctxmgr.core.json_types import JSONObject, JSONValue

_J = TypeVar("_J", bound=JSONValue)


def apply_hf_overrides(config: JSONObject, overrides: JSONObject | None) -> JSONObject:
    """A copy of `config` with the overrides applied as vLLM applies them; `config` itself is kept."""
    if not overrides:
        return config
    out = _copy(config)
    for key, value in overrides.items():
        current = out.get(key)
        if isinstance(value, dict) and isinstance(current, dict) and _is_sub_config(key, current):
            _update_nested(current, value)
        else:
            out[key] = _copy(value)
    return out


def _is_sub_config(key: str, value: JSONObject) -> bool:
    """A nested PreTrainedConfig in config.json: a `*_config` mapping (text_config, vision_config,
    llm_config ...) that is not a parameter dict such as quantization_config."""
    return key.endswith("_config") and key != "quantization_config"


def _update_nested(target: JSONObject, update: JSONObject) -> None:
    """config/model.py _update_nested: dicts merge key by key, anything else replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(nested := target.get(key), dict):
            _update_nested(nested, value)
        else:
            target[key] = _copy(value)


def _copy(value: _J) -> _J:
    """A deep copy of JSON data (config.json and the overrides are JSON)."""
    return json.loads(json.dumps(value))
