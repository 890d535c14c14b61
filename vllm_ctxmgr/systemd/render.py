"""Jinja rendering of the units ctxmgr writes, from templates/, with systemd-quoting filters."""

from __future__ import annotations

import os
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from vllm_ctxmgr import files
from vllm_ctxmgr.errors import CtxmgrError, UnsafePathError
from vllm_ctxmgr.systemd.quoting import quote_env_assignment, quote_exec_word

TEMPLATES_PACKAGE = "vllm_ctxmgr.templates"


def template_dir() -> Path:
    """The top-level templates/, which the wheel installs as the package `vllm_ctxmgr.templates`.

    CTXMGR_TEMPLATE_DIR overrides it (an operator's own templates); a source checkout that was
    never installed falls back to the repository's templates/ beside the package.
    """
    override = os.environ.get("CTXMGR_TEMPLATE_DIR")
    if override:
        return Path(override)
    try:
        # templates/ has no __init__.py, so in a wheel it is a namespace package: join a file name to
        # get a real path (a MultiplexedPath has none), then take its directory
        installed: Path | None = Path(str(resources.files(TEMPLATES_PACKAGE) / "unit.j2")).parent
    except ModuleNotFoundError:
        installed = None
    checkout = Path(__file__).resolve().parents[2] / "templates"
    for candidate in (installed, checkout):
        if candidate is not None and (candidate / "unit.j2").is_file():
            return candidate
    raise CtxmgrError(
        "ctxmgr's templates were not found (the package vllm_ctxmgr.templates is missing from this "
        "install); reinstall vllm-ctxmgr or set CTXMGR_TEMPLATE_DIR"
    )


@cache
def _environment(directory: str):  # type: ignore[no-untyped-def]
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(directory),
        autoescape=False,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["exec_quote"] = quote_exec_word
    env.filters["env_quote"] = lambda value, name: quote_env_assignment(name, value)
    return env


def render(name: str, **context: Any) -> str:
    directory = template_dir()
    if os.environ.get("CTXMGR_TEMPLATE_DIR"):
        # an operator's templates become units root installs: trusted only as the state directory is
        for path in (directory, directory / name):
            files.check_trusted(path, what="CTXMGR_TEMPLATE_DIR", error=UnsafePathError)
    return _environment(str(directory)).get_template(name).render(**context)
