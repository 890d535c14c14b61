"""A revision as record.json keeps it: Revision, its Steps and the unit files it changes (FileChange),
read back through one checked door (`Revision.load`) that names the file of anything it refuses."""

from __future__ import annotations

import errno
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import cast

from vllm_ctxmgr.core.json_types import JSONValue
from vllm_ctxmgr.core.records import RevisionRecord, StepRecord
from vllm_ctxmgr.store.safe_fs import StoreError, exists_at, read_at
from vllm_ctxmgr.store.transitions import State

RECORD_FORMAT = 3  # 1: epoch floats, the plan inline, no steps; 2: one file (`unit_path`); both read still


def iso(epoch: float | None) -> str | None:
    """Local time with its UTC offset, to the millisecond: what a person reading record.json wants."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="milliseconds")


def _epoch(value: JSONValue, path: Path, key: str) -> float | None:
    """An ISO-8601 time (format 2) or epoch seconds (format 1)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise StoreError(f"{path}: {key} is not a time: {value!r}")
    if isinstance(value, int | float):
        return float(value)
    try:
        return datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        raise StoreError(f"{path}: {key} is not an ISO-8601 time: {value!r}") from None


# The names a revision keeps a unit file's two copies under: `unit`/`previous` for its first file (as
# every format-2 revision did), `unit.N`/`previous.N` for the N-th further one. Nothing else is read
# from record.json's `files`: a name like `../x` would leave the checked revision directory.
STORED_NAME = re.compile(r"(unit|previous)(\.[1-9][0-9]{0,3})?")


@dataclass(frozen=True)
class FileChange:
    """One unit file a revision writes or removes, with its bytes before and after (None: absent). A
    revision is the list of them, written in order and put back in the reverse order."""

    path: Path
    previous: bytes | None
    unit: bytes | None


def stored_names(index: int) -> tuple[str, str]:
    """(unit, previous) names of a revision's `index`-th file."""
    suffix = f".{index}" if index else ""
    return f"unit{suffix}", f"previous{suffix}"


def _files_of_record(value: JSONValue, path: Path) -> list[dict[str, str | None]]:
    """record.json's `files`, checked: absolute unit paths, each copy named as stored_names names it."""
    if not isinstance(value, list) or not value:
        raise StoreError(f"{path}: `files` is not a list of unit files")
    out = []
    for item in value:
        if not isinstance(item, dict) or set(item) != {"path", "unit", "previous"}:
            raise StoreError(f"{path}: a file is not {{path, unit, previous}}: {item!r}")
        where = item["path"]
        if (
            not isinstance(where, str)
            or not where.startswith("/")
            or "\0" in where
            or ".." in where.split("/")
        ):
            raise StoreError(f"{path}: not an absolute unit file path: {where!r}")
        for which in ("unit", "previous"):
            name = item[which]
            if name is not None and not (isinstance(name, str) and STORED_NAME.fullmatch(name)):
                raise StoreError(f"{path}: {which} of {where} is not a stored copy's name: {name!r}")
        out.append({"path": where, "unit": item["unit"], "previous": item["previous"]})
    return out


@dataclass
class Step:
    """One line of a revision's story: the state it entered, when, and a note for a person."""

    state: State
    time: float
    note: str = ""

    def record(self) -> StepRecord:
        """The step as record.json keeps it: an ISO time a person reads, not epoch seconds."""
        return {"state": str(self.state), "time": iso(self.time), "note": self.note}


@dataclass
class Revision:
    """One change of a unit as recorded: what `history` shows, what `recover` resumes from and what
    `rollback` restores; epoch floats in memory, ISO 8601 in record.json."""

    number: int
    service: str
    state: State
    unit_path: str  # the file this revision changes (where ExecStart lives)
    created: float  # epoch seconds here; ISO 8601 in record.json
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    previous_max_model_len: int | None = None
    previous_gpu_memory_utilization: float | None = None
    action: str = "set-context"  # set-context | rollback | baseline
    rollback_of: int | None = None  # for a rollback: the revision whose unit it restores
    vllm_version: str | None = None
    reason: str = ""
    decisive_line: str = ""
    finished: float | None = None
    verified: bool = False
    plan: Mapping[str, object] = field(default_factory=dict)  # a PlanRecord, in plan.json beside the record
    capacity: dict[str, object] = field(default_factory=dict)  # change.observing.capacity and calibration
    user: str | None = None  # who made the change
    host: str | None = None  # where
    ctxmgr_version: str | None = None  # with which ctxmgr
    invocation_id: str | None = None  # the unit's InvocationID when the change was recorded
    # the multi-node change (the coordinator) this revision is one node's part of; None: a one-host change
    deployment: str | None = None
    steps: list[Step] = field(default_factory=list)
    # every unit file it changed, in the order written: {path, unit, previous}, each copy's name in the
    # revision directory or None where the file is (or was) absent (a format-2 record: `unit_path` only)
    files: list[dict[str, str | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = State(self.state)

    def to_json(self) -> RevisionRecord:
        """The revision as Python sees it (epoch seconds, the plan inline): for --json and verify."""
        data = asdict(self)
        data["state"] = str(self.state)
        data["steps"] = [step.record() for step in self.steps]
        return cast(RevisionRecord, data)  # its keys are the fields (tests/core/test_records.py)

    def record(self) -> dict[str, object]:
        """record.json: ISO times, the steps a person reads, no plan (plan.json holds it)."""
        data: dict[str, object] = {"format": RECORD_FORMAT}
        for f in fields(self):
            if f.name == "plan":
                continue
            value = getattr(self, f.name)
            if f.name in ("created", "finished"):
                value = iso(value)
            elif f.name == "state":
                value = str(value)
            elif f.name == "steps":
                value = [step.record() for step in self.steps]
            data[f.name] = value
        return data

    @classmethod
    def load(cls, directory: Path, dir_fd: int) -> Revision:
        """Read record.json (format 1 or 2) and plan.json from the revision's checked directory
        descriptor; anything else is a StoreError naming the file."""
        path = directory / "record.json"
        try:
            raw = read_at(dir_fd, "record.json", path)
            if raw is None:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory")
            data = json.loads(raw.decode())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise StoreError(f"{path}: not a readable revision record ({exc})") from None
        if not isinstance(data, dict):
            raise StoreError(f"{path}: not a revision record (a JSON object was expected)")
        data = dict(data)
        version = data.pop("format", 1)
        if version not in (1, 2, RECORD_FORMAT):
            raise StoreError(f"{path}: record format {version!r} is newer than this ctxmgr reads")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StoreError(f"{path}: unknown key {unknown[0]!r} (written by another ctxmgr version?)")
        required = ("number", "service", "state", "unit_path", "created")
        missing = [key for key in required if key not in data]
        if missing:
            raise StoreError(f"{path}: missing key {missing[0]!r}")
        try:
            data["state"] = State(data["state"])
        except ValueError:
            raise StoreError(f"{path}: unknown state {data['state']!r}") from None
        data["created"] = _epoch(data["created"], path, "created")
        data["finished"] = _epoch(data.get("finished"), path, "finished")
        steps = []
        for raw in data.get("steps") or []:
            try:
                steps.append(Step(State(raw["state"]), _epoch(raw["time"], path, "steps.time") or 0.0,
                                  str(raw.get("note", ""))))  # fmt: skip
            except (KeyError, TypeError, ValueError):
                raise StoreError(f"{path}: a step is not {{state, time, note}}: {raw!r}") from None
        data["steps"] = steps
        if "files" in data:
            data["files"] = _files_of_record(data["files"], path)
        else:  # format 1 and 2: one file, its copies `unit` and `previous` where they exist
            data["files"] = [
                {"path": str(data["unit_path"])}
                | {which: which if exists_at(dir_fd, which) else None for which in ("unit", "previous")}
            ]
        plan_path = directory / "plan.json"
        if "plan" not in data:
            plan = read_at(dir_fd, "plan.json", plan_path)
            try:
                if plan is not None:
                    data["plan"] = json.loads(plan.decode())
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                raise StoreError(f"{plan_path}: not readable JSON ({exc})") from None
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise StoreError(f"{path}: {exc}") from None
