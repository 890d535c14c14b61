"""Repo ids in the local Hugging Face cache: resolved offline, never downloaded.

huggingface_hub's own `try_to_load_from_cache` resolves `refs/main` to its snapshot (imported
lazily: the hub package costs ~0.15 s and only repo ids need it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from vllm_ctxmgr.errors import ModelFactsError

HF_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# What refs/main may hold: one snapshot folder name (a commit hash), never a path out of the repo
REVISION = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")


def _check_ref(repo: Path) -> None:
    """refs/main names a folder under snapshots/: a `../../..` there would send the lookup (ours and
    huggingface_hub's, which joins it unchecked) outside the cache."""
    ref = repo / "refs" / "main"
    try:
        if not ref.is_file():
            return
        with ref.open("rb") as handle:
            text = handle.read(4096).decode("utf-8", errors="replace").strip()
    except OSError:
        return
    if not REVISION.match(text):
        raise ModelFactsError(f"{ref}: refs/main is {text[:80]!r}, not a revision")


def hub_cache_dirs(hf_home: str | None) -> list[Path]:
    """Where huggingface_hub keeps repos, in the order it would look.

    Read from the environment at call time by hand: `huggingface_hub.constants.HF_HUB_CACHE` is
    fixed when the hub is first imported, and the legacy HUGGINGFACE_HUB_CACHE is still honoured.
    """
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
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.file_download import repo_folder_name

    searched = hub_cache_dirs(hf_home)
    for cache in searched:
        _check_ref(cache / repo_folder_name(repo_id=repo_id, repo_type="model"))
        try:
            cached = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
        except (OSError, ValueError):  # HFValidationError is a ValueError
            cached = None
        if isinstance(cached, str):
            return Path(cached).parent
        repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
        snapshot = _newest_snapshot(repo)
        if snapshot is not None:
            return snapshot
    where = ", ".join(str(c) for c in searched)
    raise ModelFactsError(
        f"{repo_id}: no such local path, and not in the local Hugging Face cache ({where}); "
        f"download it first (hf download {repo_id}) or pass a local path"
    )


def _newest_snapshot(repo: Path) -> Path | None:
    """refs/main's snapshot even without config.json, else the newest snapshot (with config.json first).

    Hand-written: the hub's offline lookups answer only for one revision, and a cache filled by
    `snapshot_download(revision=...)` or copied by hand may have no refs/main.
    """
    if not repo.is_dir():
        return None
    ref = repo / "refs" / "main"
    try:
        if ref.is_file():
            snapshot = repo / "snapshots" / ref.read_text()[:200].strip()
            if snapshot.is_dir():
                return snapshot
        snapshots = sorted((repo / "snapshots").glob("*/"), key=lambda p: p.stat().st_mtime, reverse=True)
    except (OSError, ValueError):
        return None
    with_config = [s for s in snapshots if (s / "config.json").is_file()]
    return (with_config or snapshots or [None])[0]
