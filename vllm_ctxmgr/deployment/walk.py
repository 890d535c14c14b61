"""The restart walk over a deployment's nodes, as change/walk.py is for one service: write every node
(`node prepare`), stop them all, start the headless ranks then the head (watched and probed), check every
rank, then every revision final; on any failure after the first write the one way back (every previous
unit restored, every node restarted together, settled). How a node is reached is nodes.py's; what is
read and planned first, and each command's flow, is the coordinator's (coordinator.py)."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field

from vllm_ctxmgr.change.states import ChangeResult, Interrupted, Result, guard_signals
from vllm_ctxmgr.core.hardware import GpuState
from vllm_ctxmgr.core.json_types import JSONObject, JSONScalar
from vllm_ctxmgr.core.plan_record import PlanResult
from vllm_ctxmgr.core.topology import NodeStep
from vllm_ctxmgr.deployment.nodes import SHOW_TIMEOUT, STEP_TIMEOUT, Node, NodeOutcome, Nodes
from vllm_ctxmgr.deployment.remote import Link, NodeAddress, NodeError
from vllm_ctxmgr.deployment.wire import (
    CheckAnswer,
    PlanningOptions,
    PrepareAnswer,
    PrepareStdin,
    ReasonStdin,
    ShowAnswer,
    StartAnswer,
    StartStdin,
    StepAnswer,
    StopAnswer,
)
from vllm_ctxmgr.errors import ExitCode, UsageError
from vllm_ctxmgr.store import ServiceStore

Printer = Callable[[str], None]

WATCH_INTERVAL = 3.0  # s between looks at every headless rank while the head starts


@dataclass
class DeploymentResult(ChangeResult):
    """What a deployment command did: a change's result (its `service` the deployment's name) that
    carries its nodes, printed by --json in the deployment's shape (`to_json`)."""

    result: Result | PlanResult  # a change's Result; a plan's own word (`deployment plan`)
    change_id: str | None = None
    least_gpu_memory_utilization: float | None = None  # the least that fits, one more figure
    backend: str = ""
    nodes: list[NodeOutcome] = field(default_factory=list)
    plan_text: str = ""

    @property
    def deployment(self) -> str:
        return self.service

    def to_json(self) -> JSONObject:
        """The deployment's fields in their order: a change's, less those of one unit (its revision, unit
        file, probe, observation), and every node's diff in one text, as a one-host change has one `diff`.
        gpu_memory_utilization is what every node's unit runs with after the change."""
        data = super().to_json()
        return {
            "deployment": self.service,
            **{name: data[name] for name in DEPLOYMENT_FIELDS},
            "diff": "\n".join(
                f"# node {n.node_rank}: {n.host}:{n.service}\n{n.diff}" for n in self.nodes if n.diff
            ),
        }


DEPLOYMENT_FIELDS = (
    "action", "result", "changed", "exit_code", "change_id", "max_model_len", "previous_max_model_len",
    "gpu_memory_utilization", "least_gpu_memory_utilization", "reason", "decisive_line", "suggestion",
    "backend", "nodes", "plan", "plan_text", "timings",
)  # fmt: skip


@dataclass
class DeploymentRequest:
    """What the operator asked of a deployment; the CLI fills it."""

    context: int
    nodes: tuple[NodeAddress, ...]
    link: Link = field(default_factory=Link)
    name: str | None = None
    gpu_memory_utilization: float | None = None
    # each node's GPUs where its NVML cannot say (a `ctxmgr gpus --json` object), by host
    node_gpus: Mapping[str, GpuState] = field(default_factory=dict)
    default_gpus: GpuState | None = None  # every node's, from --gpu-memory / --gpu-count
    planning: PlanningOptions = field(default_factory=PlanningOptions)
    dry_run: bool = False
    force: bool = False
    dropin: bool = False
    start_timeout: float = 1800.0
    confirm: Callable[[DeploymentResult], bool] | None = None
    on_step: Printer = lambda _text: None
    wait_lock: float = 0.0  # seconds to wait for another run on the deployment's lock
    probe_tokens: int | None = None  # the head's probe after a change (set-context's --probe-tokens)
    long_probe: bool = False  # ... and its 90%-of-the-context prompt (--long-probe; verify's too)


def _refused(node: Node, step: str, answer: StepAnswer) -> StepAnswer:
    """A restore or settle answer that says `ok: false` is that node's failure, never read as rolled back: its
    previous unit is not back (or not recorded), never counted as rolled back."""
    if answer.ok:
        return answer
    said = answer.reason[:200] or f"its revision is {answer.state[:40] or 'in no state'}"
    raise NodeError(f"{node.address}: `node {step}` failed: {said}")


def _logged(shown: ShowAnswer) -> dict[str, JSONScalar]:
    """A node's logged figures as the result prints them ({} for a Ray node, which logs none here)."""
    return asdict(shown.logged) if shown.logged is not None else {}


class Walk:
    """One deployment change walked over its nodes: the state every step shares (the request, the
    nodes, the result, the coordinator's record) and the steps themselves."""

    def __init__(
        self,
        request: DeploymentRequest,
        name: str,
        store: ServiceStore,
        reach: Nodes,
        result: DeploymentResult,
    ) -> None:
        self.request = request
        self.name = name
        self.store = store
        self.reach = reach
        self.result = result
        self.say = request.on_step
        self.undo: str | None = None  # a rollback: the change whose previous units go back
        self.back_to: str | None = None  # a rollback --to: the change whose units go back
        self.drift = ""  # what was found where the nodes' units give different max_model_len
        self.not_back: list[Node] = []  # nodes that did not stop or start on the way back

    def change(
        self,
        flags: dict[str, str],
        env: dict[str, str],
        context: int,
        unchanged: str,
        reason: str = "",
        keep_previous: int | None = None,
    ) -> DeploymentResult:
        """The one flow of set-context and rollback once planned: every node's diff, unchanged where
        none changes, the dry run's end, the operator's confirmation, then the walk. `reason` is what was
        found on the way (a drift reconciled), said by the dry run and the confirmation too."""
        request, result = self.request, self.result
        if not self._diffs(flags, env, context):
            result.result, result.reason = Result.UNCHANGED, unchanged
            return result
        if reason:
            result.reason = reason
        if request.dry_run:  # what was found is said (the reconciling diffs are the dry run's)
            result.result = Result.DRY_RUN
            result.reason = "dry run: nothing was written or restarted" + (f"; {reason}" if reason else "")
            return result
        if request.confirm is not None and not request.confirm(result):
            raise UsageError("nothing was changed")
        return self.apply(flags, context, keep_previous=keep_previous, env=env)

    def _diffs(self, flags: dict[str, str], env: dict[str, str], context: int) -> bool:
        """Every node's diff (a dry run of its write), before anything is written: whether any changes."""
        diffs = self.reach.each(self.reach.changing, lambda n: self._prepare(n, flags, context, True, env))
        for node, diff in zip(self.reach.changing, diffs, strict=True):
            if isinstance(diff, NodeError):
                raise NodeError(f"nothing was changed: {diff.message}")
            assert node.outcome is not None
            node.outcome.diff = diff.diff
        return any(not isinstance(d, NodeError) and d.changed for d in diffs)

    def _prepare(
        self, node: Node, flags: dict[str, str], context: int, dry_run: bool, env: dict[str, str]
    ) -> PrepareAnswer:
        args = [
            "prepare",
            "--change",
            self.result.change_id or "dry-run",
            "--max-model-len",
            str(context),
            "--expect-digest",
            node.show.unit_digest,
        ]
        if self.undo is not None:
            args += ["--undo", self.undo]
        elif self.back_to is not None:
            args += ["--back-to", self.back_to]
        elif self.request.dropin:
            args.append("--dropin")
        if dry_run:
            args.append("--dry-run")
        return self.reach.call(node, PrepareAnswer, *args, stdin=PrepareStdin(flags, env))

    def record(self, state: str) -> None:
        """The coordinator's own record: which node reached which step (a person reads it first)."""
        if self.request.dry_run:
            return
        data = self.result.to_json()
        data.pop("plan", None)
        self.store.write_json("last-change.json", {"state": state, "time": time.time(), **data})

    def apply(
        self,
        flags: dict[str, str],
        context: int,
        keep_previous: int | None = None,
        env: dict[str, str] | None = None,
    ) -> DeploymentResult:
        result = self.result
        t0 = time.monotonic()
        if keep_previous is not None:
            result.previous_max_model_len = keep_previous
        result.change_id = f"{self.name}-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(2)}"
        result.max_model_len = context
        self.record("writing")

        def left(signal: str) -> str:
            return (
                f"interrupted again by {signal} while rolling back: change {result.change_id} is left "
                "in progress on its nodes; run `ctxmgr deployment recover` with the same nodes"
            )

        # a signal fails the deployment change: every node is put back; a second one stops at once,
        # leaving `deployment recover` to finish
        with guard_signals(lambda: False, left):
            try:
                return self._walk(flags, env or {}, context, t0)
            except Interrupted as exc:
                result.reason = f"ctxmgr was interrupted by {exc.name}"
                self.say(f"{result.reason}; rolling every node back")
                self.roll_back_all(result.reason)
                result.timings["total_s"] = round(time.monotonic() - t0, 3)
                return result

    def _walk(self, flags: dict[str, str], env: dict[str, str], context: int, t0: float) -> DeploymentResult:
        result = self.result
        written: list[Node] = []
        for node in self.reach.changing:
            assert node.outcome is not None
            try:
                answer = self._prepare(node, flags, context, False, env)
            except NodeError as exc:
                node.outcome.ok, node.outcome.reason = False, exc.message
                self._undo_unanswered(node, exc.message)
                return self._put_back_unrestarted(written, exc.message)
            node.outcome.revision, node.outcome.step = answer.revision, NodeStep.WRITTEN
            written.append(node)
        result.timings["write_s"] = round(time.monotonic() - t0, 3)
        failure = self._restart_all(back=False)
        result.timings["start_s"] = round(time.monotonic() - t0, 3)
        if failure is None:
            self.record("finishing")
            unfinished = self.finish_all(self.reach.changing)
            result.result, result.changed = Result.APPLIED, True
            self._read_logged()
            found = f"found {self.drift}; " if self.drift else ""
            result.reason = (
                f"{found}every node runs max_model_len {context}; the head served the context-sized probe"
            )
            if unfinished:
                result.exit_code = ExitCode.ERROR
                result.reason += f"; {unfinished}"
            self.record("unfinished" if unfinished else "final")
            result.timings["total_s"] = round(time.monotonic() - t0, 3)
            return result
        result.reason, result.decisive_line = failure
        self.say(f"the change failed: {result.reason}; rolling every node back")
        self.roll_back_all(result.reason)
        result.timings["total_s"] = round(time.monotonic() - t0, 3)
        return result

    def finish_all(self, nodes: list[Node]) -> str:
        """Every node's revision final, once the deployment served and every rank was checked. Any fault
        in a node's answer is that node's failure: nothing more is asked of it, so its
        revision stays as that answer left it, and `deployment recover` (or the next change's refusal)
        finds it there. "" where every node finished, else what failed, each node named."""
        change = str(self.result.change_id)
        finished = self.reach.each(
            nodes, lambda n: self.reach.call(n, StepAnswer, "finish", "--change", change)
        )
        faults: list[str] = []
        for node, done in zip(nodes, finished, strict=True):
            assert node.outcome is not None
            if isinstance(done, NodeError):
                fault = done.message
            elif not done.ok or done.state not in ("final", "not written"):
                said = done.reason or f"its revision is {done.state[:40] or 'in no state'}, not final"
                fault = f"{node.address}: `node finish` failed: {said}"
            else:
                node.outcome.step = NodeStep.FINAL
                continue
            node.outcome.ok, node.outcome.reason = False, fault
            faults.append(fault)
        if not faults:
            return ""
        return (
            "but not every node recorded it final: "
            + "; ".join(faults)
            + ": its revision is left as that answer left it; `ctxmgr deployment recover` with the same "
            "nodes finishes it"
        )

    def _read_logged(self) -> None:
        """What every rank logged at the start just made (each node's own memory lines)."""
        shown = self.reach.each(
            self.reach.changing, lambda n: self.reach.call(n, ShowAnswer, "show", timeout=SHOW_TIMEOUT)
        )
        for node, answer in zip(self.reach.changing, shown, strict=True):
            if not isinstance(answer, NodeError) and node.outcome is not None:
                node.outcome.logged = _logged(answer)

    def _settle_all(self, nodes: list[Node], ok: bool, reason: str) -> None:
        """Every node's revision rolled-back (or rollback-failed). A node that could not record it is
        named in the result: its revision stays in progress there, and the next change will say so."""
        change = str(self.result.change_id)
        verdict = "--ok" if ok else "--failed"
        stdin = ReasonStdin(reason)

        def settle(node: Node) -> StepAnswer:
            answer = self.reach.call(node, StepAnswer, "settle", "--change", change, verdict, stdin=stdin)
            return _refused(node, "settle", answer)

        settled = self.reach.each(nodes, settle)
        for node, answer in zip(nodes, settled, strict=True):
            if isinstance(answer, NodeError):
                self.result.reason += f"; the rollback is not recorded on {answer.message}"
                if node.outcome is not None:
                    node.outcome.ok, node.outcome.reason = False, answer.message

    def _restore_all(self, nodes: list[Node], reason: str) -> list[StepAnswer | NodeError]:
        change, stdin = str(self.result.change_id), ReasonStdin(reason)

        def restore(node: Node) -> StepAnswer:
            answer = self.reach.call(node, StepAnswer, "restore", "--change", change, stdin=stdin)
            return _refused(node, "restore", answer)

        return self.reach.each(nodes, restore)

    def _undo_unanswered(self, node: Node, reason: str) -> None:
        """A node whose write failed may have recorded and written it all the same (its ctxmgr killed
        mid-step): it is put back too. Where it cannot be reached, what it holds is left to
        `deployment recover`, which the next change names."""
        back = self._restore_all([node], reason)[0]
        if not isinstance(back, NodeError) and back.revision is not None:
            self._settle_all([node], True, reason)

    def _put_back_unrestarted(self, written: list[Node], reason: str) -> DeploymentResult:
        """A write failed before anything restarted: the nodes already written get their unit back."""
        result = self.result
        result.reason = f"nothing was restarted: {reason}"
        back = self._restore_all(written, reason)
        ok = not any(isinstance(b, NodeError) for b in back)
        self._settle_all(written, ok, reason)
        result.settled(ok)
        self.record(str(result.result))
        return result

    def _restart_all(self, back: bool) -> tuple[str, str] | None:
        """Stop every node (head first), start the headless ranks, then the head, watched and probed;
        then check every headless rank's journal. None when the deployment serves, else (reason, line)."""
        change = str(self.result.change_id)
        head, workers = self.reach.head(), self.reach.workers()
        self.say("stopping every node: " + ", ".join(str(n.address) for n in self.reach.changing))
        stopped = self.reach.each([head], lambda n: self.reach.call(n, StopAnswer, "stop"))
        stopped += self.reach.each(workers, lambda n: self.reach.call(n, StopAnswer, "stop"))
        # on the way back one node that fails must not leave every other node stopped:
        # each node that can start is started, and what failed is said with the rest
        early: list[tuple[str, str]] = []
        for node, answer in zip([head, *workers], stopped, strict=True):
            assert node.outcome is not None
            if isinstance(answer, NodeError):
                if not back:
                    return f"{node.address} did not stop: {answer.message}", ""
                node.outcome.ok, node.outcome.reason = False, answer.message
                early.append((f"{node.address} did not stop: {answer.message}", ""))
                self.not_back.append(node)
                continue
            node.outcome.step = NodeStep.STOPPED
        extra = ["--back"] if back else []
        cursors: dict[NodeAddress, str] = {}
        started = self.reach.each(
            workers, lambda n: self.reach.call(n, StartAnswer, "start", "--change", change, *extra)
        )
        for node, answer in zip(workers, started, strict=True):
            assert node.outcome is not None
            if isinstance(answer, NodeError):
                if not back:
                    return f"{node.address} did not start: {answer.message}", ""
                node.outcome.ok, node.outcome.reason = False, answer.message
                early.append((f"{node.address} did not start: {answer.message}", ""))
                self.not_back.append(node)
                continue
            cursors[node.address] = answer.cursor
            node.outcome.step = NodeStep.STARTED
        workers = [n for n in workers if n.address in cursors]
        self.say(f"starting the head {head.address}; following its journal and every node's unit")
        expected = str(self._expected(back))

        def check(node: Node) -> CheckAnswer:
            cursor = cursors[node.address]
            return self.reach.call(
                node, CheckAnswer, "check", "--cursor", cursor, "--max-model-len", expected
            )

        with ThreadPoolExecutor(max_workers=1) as pool:
            head_start = pool.submit(self._start_head, head, change, extra)
            first = self._watch(workers, check, head_start)
            if first is not None:  # the deployment failed there: the head would wait for it in vain
                self.say(f"{first[0]}: stopping the head")
                with contextlib.suppress(NodeError):
                    self.reach.call(head, StopAnswer, "stop")
            answer = head_start.result()
        assert head.outcome is not None
        head.outcome.step = NodeStep.STARTED
        checks = self.reach.each(workers, check)
        failures: list[tuple[str, str]] = list(
            early
        )  # (node: reason, vLLM's decisive line), first failed first
        if first is not None:
            failures.append((first[0], first[1]))
        if not answer.ok:
            head.outcome.ok, head.outcome.reason = False, answer.reason
            failures.append((f"{head.address}: {answer.reason}", answer.decisive_line))
        for node, checked in zip(workers, checks, strict=True):
            assert node.outcome is not None
            if first is not None and node is first[2]:
                node.outcome.ok, node.outcome.reason = False, first[0].removeprefix(f"{node.address}: ")
            elif isinstance(checked, NodeError):
                node.outcome.ok, node.outcome.reason = False, checked.message
                failures.append((checked.message, ""))
            elif not checked.ok:
                node.outcome.ok, node.outcome.reason = False, checked.reason
                failures.append((f"{node.address}: {checked.reason}", checked.decisive_line))
        if not failures:
            return None
        # every node that failed says why (vLLM's KV check runs in the head's engine; a rank's own OOM is
        # in its journal); the first decisive line vLLM printed is the one quoted
        line = next((line for _, line in failures if line), "")
        return "; ".join(reason for reason, _ in failures), line

    def _start_head(self, head: Node, change: str, extra: list[str]) -> StartAnswer:
        """The head's start, watched until it serves and probed as the operator asked (a rollback's
        start: the plain probe); its failure, as any, an answer."""
        request = self.request
        probe = StartStdin() if extra else StartStdin(request.probe_tokens, request.long_probe)
        try:
            return self.reach.call(
                head,
                StartAnswer,
                "start",
                "--change",
                change,
                "--head",
                *extra,
                # the head's own watch is bounded by the operator's --timeout (not its 30 minutes), the wait
                # for its answer by that and a step's time on top
                "--timeout",
                f"{request.start_timeout:g}",
                timeout=request.start_timeout + STEP_TIMEOUT,
                stdin=probe,
            )
        except NodeError as exc:  # its own words: the reason is put after the head's name
            return StartAnswer(
                head.address.service, False, reason=exc.message.removeprefix(f"{head.address}: ")
            )

    def _watch(
        self, workers: list[Node], check: Callable[[Node], CheckAnswer], head_start: Future[StartAnswer]
    ) -> tuple[str, str, Node] | None:
        """Every headless rank's unit and journal while the head starts: the first that failed (its unit
        failed or stopped, or its journal holds vLLM's failure) as (node: reason, decisive line, node),
        at once, rather than after the head gave up waiting for it; None once the head's start ended."""
        while workers and not head_start.done():
            wait([head_start], timeout=WATCH_INTERVAL)
            if head_start.done():
                return None
            for node, checked in zip(workers, self.reach.each(workers, check), strict=True):
                if isinstance(checked, NodeError) or checked.ok:
                    continue  # a check that could not be made is made again; the final one decides
                if checked.active_state == "failed" or checked.decisive_line:
                    return f"{node.address}: {checked.reason}", checked.decisive_line, node
        return None

    def _expected(self, back: bool) -> int:
        return int((self.result.previous_max_model_len if back else self.result.max_model_len) or 0)

    def roll_back_all(self, reason: str) -> None:
        """Every node's previous unit back, every node restarted together, the old deployment probed:
        the one way back, for a failed change, an interrupted one and `deployment recover`."""
        result = self.result
        self.record("rolling-back")
        restored = self._restore_all(self.reach.changing, reason)
        failure: tuple[str, str] | None = next(
            (
                (f"{n.address}: {r.message}", "")
                for n, r in zip(self.reach.changing, restored, strict=True)
                if isinstance(r, NodeError)
            ),
            None,
        )
        if failure is None:
            failure = self._restart_all(back=True)
        ok = failure is None
        settle_reason = "" if failure is None else failure[0]
        # a node whose restore did not answer may not have its previous unit back: its revision stays
        # in progress there, for `deployment recover` to put back, not settled as if it had
        unanswered = [
            n for n, r in zip(self.reach.changing, restored, strict=True) if isinstance(r, NodeError)
        ]
        for node, answer in zip(self.reach.changing, restored, strict=True):
            if isinstance(answer, NodeError) and node.outcome is not None:
                node.outcome.ok, node.outcome.reason = False, answer.message
        # a node that did not stop or start on the way back is left in progress too, for `recover`
        unanswered += [n for n in self.not_back if n not in unanswered]
        self._settle_all([n for n in self.reach.changing if n not in unanswered], ok, settle_reason)
        result.settled(ok, settle_reason)
        if unanswered:
            result.reason += (
                f"; {', '.join(str(n.address) for n in unanswered)} may still hold the new unit, or not run "
                "the previous one: run `ctxmgr deployment recover` with the same nodes"
            )
        if ok:
            self.say("every node runs its previous unit again; the head passed its probe")
        self.record(str(result.result))
