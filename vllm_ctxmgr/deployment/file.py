"""A deployment file: the deployment's name, how its nodes are reached (ssh, ctxmgr there) and its
nodes, read and checked before anything is asked of a node. Its commands run as the operator, root
included, so the file is trusted only as the state directory is."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from vllm_ctxmgr.core import nesting
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.files import read_regular

MAX_DEPLOYMENT_FILE_BYTES = 1 << 20


def beside(deployment_file: Path, gpus_from: str) -> Path:
    """A [[node]]'s gpus_from: beside the deployment file (or absolute), never up through `..`."""
    name = Path(gpus_from)
    if ".." in name.parts:
        raise UsageError(
            f"{deployment_file}: gpus_from {gpus_from!r} goes up through '..': name the file beside "
            "the deployment file, or by its absolute path"
        )
    return deployment_file.parent / name


@dataclass(frozen=True)
class FileNode:
    """A [[node]] of a deployment file."""

    host: str
    service: str
    gpus_from: str | None = None  # its `ctxmgr gpus --json` file, beside the deployment file
    ctxmgr: tuple[str, ...] | None = None  # ctxmgr's command on this node (instead of remote_ctxmgr)


@dataclass(frozen=True)
class DeploymentFile:
    """A deployment file, checked: its name, how to reach its nodes, and the nodes."""

    name: str | None = None
    ssh: tuple[str, ...] = ()
    remote_ctxmgr: tuple[str, ...] = ()
    nodes: tuple[FileNode, ...] = ()


def read_deployment_file(path: Path) -> DeploymentFile:
    """A small TOML file: name, ssh, remote_ctxmgr, and [[node]] host / service / gpus_from. Its
    commands (ssh, ctxmgr) run as the operator, root included: the file and its directory are trusted
    only as the state directory is (sshd's StrictModes): a file another user may write could name the
    ssh command root runs."""
    from vllm_ctxmgr.store import check_trusted

    try:
        check_trusted(os.stat(path.parent), path.parent, sticky_ok=True)  # nobody else swaps the file
        raw = read_regular(path, MAX_DEPLOYMENT_FILE_BYTES, what="deployment file")  # a regular file
        check_trusted(os.stat(path), path)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    try:
        data = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{path}: not TOML ({exc})") from None
    except RecursionError:  # tomllib recurses once per level of an inline array or table
        raise UsageError(f"{path}: nested deeper than a deployment file can be") from None
    if not nesting.depth_ok(data):
        raise UsageError(f"{path}: nested deeper than {nesting.MAX_DEPTH} levels; not a deployment file")
    unknown = set(data) - {"name", "ssh", "remote_ctxmgr", "node"}
    if unknown:
        raise UsageError(f"{path}: unknown key {sorted(unknown)[0]!r} (name, ssh, remote_ctxmgr, node)")
    nodes = data.get("node")
    if not isinstance(nodes, list) or not all(
        isinstance(n, dict) and isinstance(n.get("host"), str) and isinstance(n.get("service"), str)
        for n in nodes
    ):
        raise UsageError(f"{path}: expected [[node]] tables, each with host and service (strings)")
    for entry in nodes:
        unknown_keys = set(entry) - {"host", "service", "gpus_from", "ctxmgr"}
        if unknown_keys:
            raise UsageError(f"{path}: [[node]] {entry['host']}: unknown key {sorted(unknown_keys)[0]!r}")
        words = entry.get("ctxmgr")
        if words is not None and not (
            isinstance(words, list) and words and all(isinstance(w, str) for w in words)
        ):
            raise UsageError(f"{path}: [[node]] {entry['host']}: ctxmgr must be a list of words")
    for key in ("ssh", "remote_ctxmgr"):
        value = data.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(w, str) for w in value)):
            raise UsageError(f'{path}: {key} must be a list of words, e.g. ["ssh", "-F", "ssh_config"]')
    return DeploymentFile(
        name=str(data["name"]) if data.get("name") else None,
        ssh=tuple(data.get("ssh") or ()),
        remote_ctxmgr=tuple(data.get("remote_ctxmgr") or ()),
        nodes=tuple(
            FileNode(
                entry["host"],
                entry["service"],
                gpus_from=str(entry["gpus_from"]) if entry.get("gpus_from") else None,
                ctxmgr=tuple(entry["ctxmgr"]) if entry.get("ctxmgr") else None,
            )
            for entry in nodes
        ),
    )
