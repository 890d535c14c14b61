"""API keys out of everything ctxmgr prints or stores: one masker, and every place a key comes from.

vLLM takes several keys (`--api-key K1 K2`, argparse nargs="+"; `--api-key=K` too) and, without
`--api-key`, VLLM_API_KEY from its environment. A unit may assign VLLM_API_KEY even where --api-key
wins, and a drop-in may override an earlier value that the fragment still shows in a diff: every one
of them is a secret. Keys shorter than MIN_SECRET_LEN are not masked: replacing "a" everywhere would
hide far more than it protects.
"""

from __future__ import annotations

import json
import re
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
        if name.replace("_", "-") in _API_KEY_SPELLINGS:
            if eq:
                keys.append(value)
            else:
                while i + 1 < len(args) and not args[i + 1].startswith("-"):
                    keys.append(args[i + 1])
                    i += 1
        i += 1
    return keys


# argparse's _negative_number_matcher: a word like "-5" or "-.5" is an argument, not an option, in a
# parser (vLLM's) that has no option looking like a negative number
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _is_option(word: str) -> bool:
    """argparse's _parse_optional, as vLLM's parser answers it: a word that starts with '-' is an
    option unless it is '-' alone, a negative number, or (not being a known flag) holds a space."""
    if not word.startswith("-") or word == "-" or _NEGATIVE_NUMBER.match(word):
        return False
    return not (" " in word and "=" not in word.split(" ", 1)[0])


# argparse's allow_abbrev (vLLM leaves it on): a unique prefix names the flag; `--api` is ambiguous
# with --api-server-count, `--api-k` is not
_API_KEY_SPELLINGS = ("--api-k", "--api-ke", "--api-key")


def api_key_values(args: Sequence[str]) -> list[str] | None:
    """vLLM's `args.api_key`: `api_key: list[str] | None` (entrypoints/common/cli_args.py), which
    get_kwargs makes `nargs="+"` with argparse's default "store" action, so the LAST --api-key wins
    and its words run up to the next option. `--api_key` is the same flag (FlexibleArgumentParser
    turns underscores into dashes); `--` ends the options. None where no --api-key is given."""
    found: list[str] | None = None
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            break
        name, eq, value = word.partition("=")
        if name.replace("_", "-") in _API_KEY_SPELLINGS:
            if eq:
                found = [value]
            else:
                found = []
                while i + 1 < len(args) and not _is_option(args[i + 1]) and args[i + 1] != "--":
                    found.append(args[i + 1])
                    i += 1
        i += 1
    return found


def vllm_api_keys(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The keys vLLM's server accepts (entrypoints/serve/middleware/register.py):
    `[key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]`. `args` are the arguments vLLM
    parses (its --config YAML pulled in, the command line after it), `env` the environment the vLLM
    process gets (inside a container: the container's, see systemd.vllm_command.container_environment)."""
    values = api_key_values(args)
    return [key for key in (values or [env.get(_ENV_NAME, "")]) if key]


def probe_key(args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The one key the probe sends: any key vLLM accepts works; the first of them."""
    keys = vllm_api_keys(args, env)
    return keys[0] if keys else None


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


# ---- the one masker at the doors ---------------------------------------------------------------
# Every key ctxmgr finds (each service it reads registers all its key sources) is remembered for the
# process, and everything that leaves it (stdout, stderr, the JSON objects, the records in the state
# directory) goes through `scrub`: a message that quotes a key from a source nobody thought of when
# writing that message is masked all the same.

_REMEMBERED: set[str] = set()


def remember(secrets: Iterable[str]) -> None:
    """Add keys to what every later `scrub` masks (for the rest of the process)."""
    _REMEMBERED.update(s for s in secrets if s and len(s) >= MIN_SECRET_LEN)


def scrub(text: str) -> str:
    """`text` with every remembered key masked: call it where text leaves the program."""
    return mask(text, _REMEMBERED) if _REMEMBERED else text


def scrub_json(data: Any) -> Any:
    """A JSON-like value with every remembered key masked in its strings."""
    return mask_json(data, _REMEMBERED) if _REMEMBERED else data
