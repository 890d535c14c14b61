"""Repo ids in the local Hugging Face cache: resolved offline, never downloaded."""

from __future__ import annotations

import os
import re
from pathlib import Path

from vllm_ctxmgr.errors import ModelFactsError

HF_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_cache_dirs(hf_home: str | None) -> list[Path]:
    """Where huggingface_hub keeps repos, in the order it would look."""
    if hf_home:
        return [Path(hf_home).expanduser() / "hub", Path(hf_home).expanduser()]
    dirs = [os.environ.get("HF_HUB_CACHE"), os.environ.get("HUGGINGFACE_HUB_CACHE")]
    if os.environ.get("HF_HOME"):
        dirs.append(os.path.join(os.environ["HF_HOME"], "hub"))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    dirs.append(os.path.join(xdg, "huggingface", "hub"))
    return [Path(d).expanduser() for d in dirs if d]


def hf_cache_snapshot(repo_id: str, hf_home: str | None = None) -> Path:
    """The snapshot directory `refs/main` points at (offline; never downloads)."""
    folder = "models--" + repo_id.replace("/", "--")
    searched = hub_cache_dirs(hf_home)
    for cache in searched:
        repo = cache / folder
        if not repo.is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.is_file():
            snapshot = repo / "snapshots" / ref.read_text().strip()
            if snapshot.is_dir():
                return snapshot
        snapshots = sorted((repo / "snapshots").glob("*/"), key=lambda p: p.stat().st_mtime, reverse=True)
        with_config = [s for s in snapshots if (s / "config.json").is_file()]
        if with_config or snapshots:
            return (with_config or snapshots)[0]
    where = ", ".join(str(c) for c in searched)
    raise ModelFactsError(
        f"{repo_id}: no such local path, and not in the local Hugging Face cache ({where}); "
        "download it first (huggingface-cli download) or pass a local path"
    )
