"""Jinja rendering from the repository's templates/ with systemd-quoting filters."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any


def template_dir() -> Path:
    override = os.environ.get("CTXMGR_TEMPLATE_DIR")
    if override:
        return Path(override)
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "templates", here / "data" / "templates"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("ctxmgr's templates/ directory was not found; set CTXMGR_TEMPLATE_DIR")


@cache
def _environment(directory: str):  # type: ignore[no-untyped-def]
    import jinja2

    from .unit import quote_env_assignment, quote_exec_word

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
    return _environment(str(template_dir())).get_template(name).render(**context)
