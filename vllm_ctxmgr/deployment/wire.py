"""What the coordinator of a multi-node deployment and `ctxmgr node STEP` say to each other.

Every message is one of the dataclasses here, with the wire's version: a request on a step's stdin
(PlanStdin, PrepareStdin, StartStdin, VerifyStdin, ReasonStdin) and a step's answer on its stdout
(ShowAnswer ... VerifyAnswer).
Each is checked at the door, where it arrives (`from_json`): every field of its type, numbers finite and
in range, the memory figures within what `observe --import` accepts (core/observations.py), the flags
within what a context change may change. A message that is not what the wire carries is refused with
one line naming the field (the coordinator puts the node's name in front), never a traceback, so a
node's bad answer is that node's failure like any other.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from enum import StrEnum
from typing import ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

from vllm_ctxmgr.core.bounds import MAX_BYTES, MAX_CONTEXT
from vllm_ctxmgr.core.facts import ALLOW_LONG_ENV
from vllm_ctxmgr.core.json_types import JSONObject
from vllm_ctxmgr.core.observations import ObservationRecord
from vllm_ctxmgr.core.plan_record import PLAN_SCHEMA, PlanResult
from vllm_ctxmgr.core.verdict import Verdict
from vllm_ctxmgr.errors import UsageError

# bump when a message's fields change meaning, or a step reads a request it did not read before (2:
# `node start` takes StartStdin, the probe's options; a node of 1 would start the head without them,
# so the coordinator refuses its answers; 3: `node verify` takes VerifyStdin, --long-probe); both ends
# must speak the same one
WIRE_VERSION = 3
MAX_TEXT = 4 << 20  # one text field (a diff, a plan's text)
MAX_ITEMS = 1 << 16  # one list or object (argv words, GPU lines, environment items)
MAX_INT = 1 << 62
MAX_CHANGES_SHOWN = 256  # a node's deployment revisions `node show` lists, the newest

# what a context change may write on a node, and nothing else: a head's plan that names another flag
# (a --worker-extension-cls, a --model) is refused at both ends
CONTEXT_FLAGS = ("--max-model-len", "--gpu-memory-utilization", "--kv-cache-memory-bytes")
CONTEXT_ENV = (ALLOW_LONG_ENV,)

T = TypeVar("T", bound="Message")
D = TypeVar("D")  # a message or a dataclass inside one


class WireError(UsageError):
    """A message that is not one the wire carries (the message names the step and the field)."""


@dataclass(frozen=True)
class Message:
    """One message of the wire: `to_json` puts the version in, `from_json` is the door."""

    step: ClassVar[str] = ""  # the node step it belongs to, for the refusal's words

    def to_json(self) -> JSONObject:
        return {"wire": WIRE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls: type[T], data: object, what: str | None = None) -> T:
        """The message, every field checked; WireError naming `what` (default: the step's answer)."""
        what = what or f"`node {cls.step}` answer"
        if not isinstance(data, dict):
            raise WireError(f"{what} is not a JSON object")
        version = data.get("wire")
        if type(version) is not int or version != WIRE_VERSION:  # 3.0 == 3, True == 1: neither is it
            raise WireError(
                f"{what} speaks wire version {version!r}, this ctxmgr {WIRE_VERSION}: "
                "install the same ctxmgr on every node"
            )
        message = _decode(cls, data, what)
        try:
            message.check(what)
        except WireError:
            raise
        except UsageError as exc:  # another door's refusal (an observation's bounds): the wire's
            raise WireError(exc.message) from None
        return message

    def check(self, what: str) -> None:
        """Ranges beyond the fields' types (each message its own)."""


def _decode(cls: type[D], data: Mapping[str, object], what: str) -> D:
    hints = get_type_hints(cls)
    values: dict[str, object] = {}
    for f in fields(cls):  # type: ignore[arg-type]  # a message is a dataclass
        if f.name in data:
            values[f.name] = _value(hints[f.name], data[f.name], f"{what}: {f.name}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise WireError(f"{what}: no {f.name}")
    return cls(**values)


def _value(hint: object, value: object, where: str) -> object:
    """`value` as the field's type `hint` (bool, int, float, str, a StrEnum's word, X | None,
    tuple[X, ...], dict[str, X], a dataclass, or `object` for a JSON object checked by its own door)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, value, where)
    shown = repr(value)[:60]
    if hint is bool:
        if not isinstance(value, bool):
            raise WireError(f"{where}={shown} is not true or false")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool) or not -MAX_INT <= value <= MAX_INT:
            raise WireError(f"{where}={shown} is not an integer in range")
        return value
    if hint is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or abs(value) > MAX_INT or not math.isfinite(value):  # type: ignore[arg-type]
            raise WireError(f"{where}={shown} is not a finite number")
        return float(value)  # type: ignore[arg-type]
    if hint is str:
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise WireError(f"{where}={shown} is not text of at most {MAX_TEXT} characters")
        return value
    if isinstance(hint, type) and issubclass(hint, StrEnum):  # one of the vocabulary's words
        text = _value(str, value, where)
        words = [str(member) for member in hint]
        if text not in words:
            raise WireError(f"{where} {str(text)[:40]!r} is not {', '.join(words[:-1])} or {words[-1]}")
        return hint(text)
    if hint is object:  # a JSON object another door checks (a plan record, GPUs, an observation)
        if not isinstance(value, dict):
            raise WireError(f"{where}={shown} is not a JSON object")
        return value
    if origin is tuple:
        if not isinstance(value, list) or len(value) > MAX_ITEMS:
            raise WireError(f"{where}={shown} is not a list of at most {MAX_ITEMS} items")
        return tuple(_value(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict) or len(value) > MAX_ITEMS:
            raise WireError(f"{where}={shown} is not an object of at most {MAX_ITEMS} items")
        return {str(k): _value(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if is_dataclass(hint):
        if not isinstance(value, dict):
            raise WireError(f"{where}={shown} is not a JSON object")
        return _decode(hint, value, where)  # type: ignore[arg-type]
    raise TypeError(f"the wire has no rule for {hint!r}")  # a field declared here without a rule


def _in_range(
    what: str, name: str, value: float | None, low: float, high: float, low_open: bool = False
) -> None:
    if value is None:
        return
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise WireError(f"{what}: {name}={value!r} is not in {bracket}{low:g}, {high:g}]")


# ---- what a context change writes -----------------------------------------------------------------


_DECIMAL = re.compile(r"(?:[0-9]{1,20}\.?[0-9]{0,20}|\.[0-9]{1,20})(?:[eE][-+]?[0-9]{1,3})?")


def check_context_flags(flags: dict[str, str], env: dict[str, str], what: str) -> None:
    """Only the flags a context change may change, each with a value in range: refused otherwise, at
    the coordinator (the head's plan) and at each node (what it is asked to write)."""
    for name, value in flags.items():
        if name not in CONTEXT_FLAGS:
            raise WireError(
                f"{what}: {name[:60]!r} is not a flag a context change writes ({', '.join(CONTEXT_FLAGS)})"
            )
        if name == "--gpu-memory-utilization":
            # a decimal number as the planner writes it: float() alone also takes " 0.9", "0.9\n" (a
            # line break written into the unit) and other scripts' digits ("٠.٩")
            number = float(value) if _DECIMAL.fullmatch(value) else math.nan
            if not 0 < number <= 1:
                raise WireError(f"{what}: {name} {value[:40]!r} is not in (0, 1]")
            continue
        limit = MAX_CONTEXT if name == "--max-model-len" else MAX_BYTES
        if not re.fullmatch(r"[1-9][0-9]{0,15}", value) or int(value) > limit:
            raise WireError(f"{what}: {name} {value[:40]!r} is not a whole number in [1, {limit}]")
    for name, value in env.items():
        if name not in CONTEXT_ENV:
            raise WireError(
                f"{what}: {name[:60]!r} is not an environment variable a context change writes "
                f"({', '.join(CONTEXT_ENV)})"
            )
        if value not in ("0", "1"):
            raise WireError(f"{what}: {name}={value[:40]!r} is not 0 or 1")


# ---- requests, on a step's stdin --------------------------------------------------------------------


@dataclass(frozen=True)
class PlanningOptions:
    """What the operator gave the deployment's plan beyond the context (`deployment plan`'s options)."""

    weights_bytes: int | None = None
    vllm_version: str | None = None
    allow_long: bool = False


@dataclass(frozen=True)
class NodeStart:
    """A headless node's last start as its journal logged it, with the global ranks it holds (the
    record passes ObservationRecord's door on the head, planning.node_observations_from_json)."""

    node: str
    ranks: tuple[int, ...]
    record: object


@dataclass(frozen=True)
class PlanStdin(Message):
    """`node plan`'s request: every node's GPUs in rank order and every other node's last start."""

    step: ClassVar[str] = "plan"
    planning: PlanningOptions = field(default_factory=PlanningOptions)
    world_gpus: object | None = None  # `ctxmgr gpus --json`'s object (nvml.gpus_from_json's door)
    node_observations: tuple[NodeStart, ...] = ()

    def check(self, what: str) -> None:
        _in_range(what, "planning.weights_bytes", self.planning.weights_bytes, 0, 1 << 56)


@dataclass(frozen=True)
class PrepareStdin(Message):
    """`node prepare`'s request: the flags (and the long-context variable) every node gets."""

    step: ClassVar[str] = "prepare"
    flag_changes: dict[str, str] = field(default_factory=dict)
    env_changes: dict[str, str] = field(default_factory=dict)

    def check(self, what: str) -> None:
        check_context_flags(self.flag_changes, self.env_changes, what)
        if "--max-model-len" not in self.flag_changes:
            raise WireError(f"{what}: the flag changes do not set --max-model-len")


@dataclass(frozen=True)
class StartStdin(Message):
    """`node start`'s request: the head's probe as the operator asked for it (set-context's
    --probe-tokens and --long-probe; a headless rank is not probed and ignores it)."""

    step: ClassVar[str] = "start"
    probe_tokens: int | None = None
    long_probe: bool = False

    def check(self, what: str) -> None:
        _in_range(what, "probe_tokens", self.probe_tokens, 1, MAX_CONTEXT)


@dataclass(frozen=True)
class VerifyStdin(Message):
    """`node verify`'s request: the head's verify as the operator asked for it (deployment verify's
    --long-probe)."""

    step: ClassVar[str] = "verify"
    long_probe: bool = False


@dataclass(frozen=True)
class ReasonStdin(Message):
    """`node restore` / `node settle`'s request: why (it goes into the node's revision)."""

    step: ClassVar[str] = "restore"
    reason: str = ""


# ---- answers, on a step's stdout ----------------------------------------------------------------------


@dataclass(frozen=True)
class InProgress:
    """A node's revision still under way (the lock across machines)."""

    revision: int
    state: str
    change: str | None = None


@dataclass(frozen=True)
class LastChange:
    """A node's newest revision made by a deployment change."""

    change: str | None
    revision: int
    state: str
    max_model_len: int | None = None
    previous_max_model_len: int | None = None


@dataclass(frozen=True)
class Logged:
    """What a node's vLLM logged at its last start (node.LOGGED_KEYS): Observation's own fields."""

    max_model_len: int | None = None
    available_kv_gib: float | None = None
    kv_cache_tokens: int | None = None
    model_loading_gib: float | None = None
    cuda_graph_gib: float | None = None
    ready: bool = False
    failure: str | None = None


_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ShowAnswer(Message):
    """`node show`: the unit's vLLM arguments (keys masked), its digest, the GPUs and any change."""

    step: ClassVar[str] = "show"
    service: str
    unit_digest: str
    active_state: str
    ray_worker: bool = False
    unit_path: str = ""
    argv: tuple[str, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    vllm_version: str | None = None
    gpus: object | None = None  # NVML's GPUs there (nvml.gpus_from_json's door, at planning)
    in_progress: InProgress | None = None
    last_change: LastChange | None = None
    # its revisions made by deployment changes, oldest first (the newest MAX_CHANGES_SHOWN)
    deployment_changes: tuple[LastChange, ...] = ()
    logged: Logged | None = None
    observation: object | None = None  # the last start as an observation record

    def check(self, what: str) -> None:
        if not _DIGEST.fullmatch(self.unit_digest):
            raise WireError(f"{what}: unit_digest is not a SHA-256 digest")
        if self.in_progress is not None:
            _in_range(what, "in_progress.revision", self.in_progress.revision, 0, MAX_INT)
        changes = [("last_change", self.last_change)]
        changes += [(f"deployment_changes[{i}]", c) for i, c in enumerate(self.deployment_changes)]
        for name, change in changes:
            if change is None:
                continue
            _in_range(what, f"{name}.revision", change.revision, 0, MAX_INT)
            for key in ("max_model_len", "previous_max_model_len"):
                _in_range(what, f"{name}.{key}", getattr(change, key), 1, MAX_CONTEXT)
        if self.logged is not None:
            ObservationRecord.from_json(asdict(self.logged), f"{what}: logged")
        if self.observation is not None:
            ObservationRecord.from_json(self.observation, f"{what}: observation")  # type: ignore[arg-type]


@dataclass(frozen=True)
class GpuFigure:
    """One figure of a planned GPU line: bytes (None: unknown) and where they came from."""

    bytes: int | None = None
    source: str = ""


@dataclass(frozen=True)
class PlannedGpu:
    """One GPU line of the head's plan (rank order): the figures the coordinator splits per node."""

    total: GpuFigure | None = None
    weights: GpuFigure | None = None
    kv_budget: GpuFigure | None = None
    kv_needed: GpuFigure | None = None
    headroom: GpuFigure | None = None


@dataclass(frozen=True)
class PlannedDeployment:
    """The head's plan of the deployment: its verdict and GPU lines typed; `record` is the plan as
    `--json` prints it (Plan.to_json()), shown to the operator and never read."""

    result: PlanResult
    reason: str
    max_context: int
    gpus: tuple[PlannedGpu, ...]
    record: JSONObject

    @classmethod
    def from_record(cls, record: object, what: str) -> PlannedDeployment:
        if not isinstance(record, dict):
            raise WireError(f"{what}: plan is not a JSON object")
        if record.get("schema") != PLAN_SCHEMA:
            raise WireError(f"{what}: plan has schema {record.get('schema')!r}, not {PLAN_SCHEMA}")
        typed = {"result": PlanResult, "reason": str, "max_context": int, "gpus": tuple[PlannedGpu, ...]}
        values = {k: _value(hint, record.get(k), f"{what}: plan.{k}") for k, hint in typed.items()}
        made = cls(record=record, **values)  # type: ignore[arg-type]  # each value checked as its hint
        _in_range(what, "plan.max_context", made.max_context, 0, MAX_CONTEXT)
        for i, line in enumerate(made.gpus):
            for name in ("total", "weights", "kv_budget", "kv_needed", "headroom"):
                figure = getattr(line, name)
                if figure is not None and figure.bytes is not None and name != "headroom":
                    _in_range(what, f"plan.gpus[{i}].{name}", figure.bytes, 0, 1 << 56)
        return made


@dataclass(frozen=True)
class PlanAnswer(Message):
    """`node plan`: the head's plan of the whole deployment and the flags every node gets."""

    step: ClassVar[str] = "plan"
    service: str
    plan: object  # Plan.to_json(): read through `planned`
    text: str
    result: PlanResult
    max_model_len: int
    flag_changes: dict[str, str]
    env_changes: dict[str, str] = field(default_factory=dict)
    gpu_memory_utilization: float | None = None
    least_gpu_memory_utilization: float | None = None
    applies: str = ""
    learned: str | None = None

    @property
    def planned(self) -> PlannedDeployment:
        return PlannedDeployment.from_record(self.plan, "`node plan` answer")

    def check(self, what: str) -> None:
        PlannedDeployment.from_record(self.plan, what)
        _in_range(what, "max_model_len", self.max_model_len, 1, MAX_CONTEXT)
        for name in ("gpu_memory_utilization", "least_gpu_memory_utilization"):
            _in_range(what, name, getattr(self, name), 0, 1, low_open=True)
        check_context_flags(self.flag_changes, self.env_changes, what)


@dataclass(frozen=True)
class PrepareAnswer(Message):
    """`node prepare`: the node's diff, and its revision when it was written (None: a dry run)."""

    step: ClassVar[str] = "prepare"
    service: str
    unit_path: str
    changed: bool
    diff: str
    revision: int | None = None

    def check(self, what: str) -> None:
        _in_range(what, "revision", self.revision, 0, MAX_INT)


@dataclass(frozen=True)
class StopAnswer(Message):
    """`node stop`: the unit's state once its vLLM has exited."""

    step: ClassVar[str] = "stop"
    service: str
    active_state: str


@dataclass(frozen=True)
class StartAnswer(Message):
    """`node start`: a headless rank started (judged later by `check`); the head watched and probed."""

    step: ClassVar[str] = "start"
    service: str
    ok: bool
    cursor: str = ""
    revision: int | None = None
    reason: str = ""
    decisive_line: str = ""
    observation: object | None = None
    probe: object | None = None

    def check(self, what: str) -> None:
        _in_range(what, "revision", self.revision, 0, MAX_INT)


@dataclass(frozen=True)
class CheckAnswer(Message):
    """`node check`: a headless rank since its start: active, no failure, the shared max_model_len."""

    step: ClassVar[str] = "check"
    service: str
    ok: bool
    reason: str = ""
    decisive_line: str = ""
    active_state: str | None = None
    max_model_len: int | None = None

    def check(self, what: str) -> None:
        _in_range(what, "max_model_len", self.max_model_len, 1, MAX_CONTEXT)


@dataclass(frozen=True)
class StepAnswer(Message):
    """`node finish`, `node restore`, `node settle`: the revision and the state it reached."""

    step: ClassVar[str] = "finish"
    service: str
    ok: bool
    revision: int | None = None
    state: str = ""
    reason: str = ""

    def check(self, what: str) -> None:
        _in_range(what, "revision", self.revision, 0, MAX_INT)


@dataclass(frozen=True)
class VerifyAnswer(Message):
    """`node verify`: the head's `ctxmgr verify` (the coordinator reads the verdict, the context served,
    the probe and the reasons; the rest is the node's own report)."""

    step: ClassVar[str] = "verify"
    service: str
    result: Verdict
    reasons: tuple[str, ...] = ()
    max_model_len: int | None = None
    probe_ok: bool | None = None
    # the node's whole verification as `ctxmgr verify --json` prints it: what `node verify` prints, of
    # which the coordinator reads only the fields above
    report: object | None = field(default=None, compare=False)

    def to_json(self) -> JSONObject:
        if isinstance(self.report, dict):
            return {"wire": WIRE_VERSION, **self.report}
        return super().to_json()

    def check(self, what: str) -> None:
        _in_range(what, "max_model_len", self.max_model_len, 1, MAX_CONTEXT)


@dataclass(frozen=True)
class ErrorAnswer:
    """A step that failed: its one-line error and its exit code (every command's --json failure)."""

    error: str
    exit_code: object  # as the node said it: remote.py passes on only ctxmgr's documented codes

    @classmethod
    def from_json(cls, data: object) -> ErrorAnswer | None:
        """The failure the object says, or None where it is not one (no error text)."""
        if not isinstance(data, dict) or not isinstance(data.get("error"), str):
            return None
        return cls(data["error"][:MAX_TEXT], data.get("exit_code"))
