"""JSON as the project reads and writes it: one alias for values whose shape is not ours to fix.

A model's config.json, a stored record of an older ctxmgr, a node's answer before the wire checks it:
their values are JSON of unknown shape, so a reader narrows them (isinstance) before it trusts one.
Records whose keys ctxmgr itself defines are TypedDicts (core.records, core.plan_record, core.verdict).
"""

from __future__ import annotations

from typing import TypeAlias

JSONScalar: TypeAlias = str | int | float | bool | None
JSONValue: TypeAlias = JSONScalar | list["JSONValue"] | dict[str, "JSONValue"]
JSONObject: TypeAlias = dict[str, JSONValue]
