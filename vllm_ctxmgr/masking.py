"""API keys out of everything ctxmgr prints or stores: one masker, and every place a key comes from.

vLLM takes several keys (`--api-key K1 K2`, argparse nargs="+"; `--api-key=K` too) and, without
`--api-key`, VLLM_API_KEY from its environment. A unit may assign VLLM_API_KEY even where --api-key
wins, and a drop-in may override an earlier value that the fragment still shows in a diff: every one
of them is a secret. Keys shorter than MIN_SECRET_LEN are not masked: replacing "a" everywhere would
hide far more than it protects.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

MASK = "***"
MIN_SECRET_LEN = 4
_ENV_NAME = "VLLM_API_KEY"


def _variants(secret: str) -> list[str]:
    """The key as written, and as it reads inside a JSON string (quotes, backslashes escaped)."""
    escaped = json.dumps(secret)[1:-1]
    return [secret] if escaped == secret else [secret, escaped]


def mask(text: str, secrets: Iterable[str]) -> str:
    """`text` with each secret (of at least MIN_SECRET_LEN characters) replaced by `***`."""
    found = {v for s in secrets if s and len(s) >= MIN_SECRET_LEN for v in _variants(s)}
    for secret in sorted(found, key=len, reverse=True):  # a key inside a longer key: the longer first
        text = text.replace(secret, MASK)
    return text


def mask_json(data: Any, secrets: Iterable[str]) -> Any:
    """A JSON-like value (dicts, lists, strings) with every string masked, keys of dicts too."""
    secrets = [s for s in secrets if s]
    if not secrets:
        return data
    if isinstance(data, str):
        return mask(data, secrets)
    if isinstance(data, Mapping):
        return {mask_json(k, secrets): mask_json(v, secrets) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [mask_json(v, secrets) for v in data]
    return data


def api_keys_in_args(args: Sequence[str]) -> list[str]:
    """Every --api-key value: all words after the flag up to the next flag (argparse's nargs="+")."""
    keys: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        name, eq, value = word.partition("=")
        if name in ("--api-key", "--api_key"):
            if eq:
                keys.append(value)
            else:
                while i + 1 < len(args) and not args[i + 1].startswith("-"):
                    keys.append(args[i + 1])
                    i += 1
        i += 1
    return keys


def secrets_of(args: Sequence[str], env: Mapping[str, str], assignments: Iterable[str] = ()) -> list[str]:
    """Every key a service can hold: --api-key values, VLLM_API_KEY of its environment (Environment=,
    EnvironmentFile=, drop-ins merged), and each `VLLM_API_KEY=...` word its Environment= lines
    assign, in any letter case, whether or not --api-key overrides it."""
    found = list(api_keys_in_args(args))
    found += [value for name, value in env.items() if name.upper() == _ENV_NAME]
    for word in assignments:
        name, eq, value = word.partition("=")
        if eq and name.upper() == _ENV_NAME:
            found.append(value)
    return list(dict.fromkeys(s for s in found if s))
