"""Unit names by systemd's own rules, and the canonical name behind an alias.

A name from the command line ends up in a state-directory path, a journal match and a lock; so it
is checked here exactly as systemd's unit_name_is_valid() (src/basic/unit-name.c) checks it and
never used as a path before that. Hand-written: systemd ships no library call for it, and calling
`systemd-escape` per name would fork for a check this small.
"""

from __future__ import annotations

import string

from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.systemd.systemctl import Systemd

UNIT_NAME_MAX = 255  # UNIT_NAME_MAX is 256 with the terminating NUL
# VALID_CHARS in unit-name.h: no "/", so a valid name is always one path component
VALID_CHARS = frozenset(string.ascii_letters + string.digits + ":-_.\\")
UNIT_TYPES = ("service", "socket", "target", "device", "mount", "automount", "swap", "timer", "path",
              "slice", "scope")  # fmt: skip


def unit_name(name: str) -> str:
    """`vllm-glm5` -> `vllm-glm5.service`; a service name that systemd would refuse is a UsageError.

    Only services are vLLM's to run; a template without an instance (`vllm@.service`) runs nothing.
    """
    if not name:
        raise UsageError("a service name cannot be empty")
    if len(name) > UNIT_NAME_MAX:
        raise UsageError(f"{name[:40]}...: a unit name has at most {UNIT_NAME_MAX} characters")
    stem, dot, suffix = name.rpartition(".")
    if not dot or suffix not in UNIT_TYPES:
        name, stem, suffix = f"{name}.service", name, "service"
        if len(name) > UNIT_NAME_MAX:
            raise UsageError(f"{name[:40]}...: a unit name has at most {UNIT_NAME_MAX} characters")
    if suffix != "service":
        raise UsageError(f"{name}: ctxmgr manages .service units (vLLM servers), not .{suffix} units")
    if not stem:
        raise UsageError(f"{name!r} is not a unit name: nothing before .service")
    if set(stem) <= {"."}:
        # systemd would take "...service", but its name is ctxmgr's state-directory path ("..")
        raise UsageError(f"{name!r}: ctxmgr refuses a service named only with dots")
    prefix, at, instance = stem.partition("@")
    bad = sorted({c for c in prefix + instance if c not in VALID_CHARS} - ({"@"} if at else set()))
    if bad:
        shown = ", ".join(repr(c) for c in bad[:5])
        raise UsageError(
            f"{name!r} is not a unit name: systemd allows only letters, digits and ':-_.\\' ({shown})"
        )
    if at and not prefix:
        raise UsageError(f"{name!r} is not a unit name: nothing before '@'")
    if at and not instance:
        raise UsageError(
            f"{name}: a template unit runs nothing; name an instance (e.g. {prefix}@NAME.service)"
        )
    return name


def canonical_unit(systemd: Systemd, name: str) -> str:
    """The unit's own name (systemd's `Id`) when `name` is an alias: one lock, one journal, one history.

    A unit systemd cannot find is a UsageError here, before ctxmgr writes anything for it.
    """
    unit = unit_name(name)
    props = systemd.show(unit, "Id", "LoadState")
    if props.get("LoadState") in ("not-found", "", None) or not props.get("Id"):
        raise UsageError(
            f"{unit}: no such unit (systemctl show says LoadState={props.get('LoadState') or '?'}); "
            "`ctxmgr status` lists the vLLM services, `systemctl list-units --type=service --all` every one"
        )
    return unit_name(props["Id"])
