"""Human and JSON views of facts, GPUs, plans, changes and verifications. No I/O: strings only."""

from __future__ import annotations

import shutil
import textwrap
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Protocol

from vllm_ctxmgr.core.budget import DEFAULT_MARGIN_FRACTION, DEFAULT_MARGIN_MIN_BYTES, margin_bytes
from vllm_ctxmgr.core.calibration import CalibrationRecord
from vllm_ctxmgr.core.downtime import DowntimeRecord, downtime_text
from vllm_ctxmgr.core.facts import LayerKind, ModelFacts, derived_max_model_len
from vllm_ctxmgr.core.hardware import GpuState, gib
from vllm_ctxmgr.core.json_types import JSONObject
from vllm_ctxmgr.core.kv.backends import NEWEST_VLLM
from vllm_ctxmgr.core.observations import ObservationFigures
from vllm_ctxmgr.core.plan_record import PlanResult
from vllm_ctxmgr.core.records import HistoryRow, ProbeRecord
from vllm_ctxmgr.core.vllm_versions import known_version, rules_line

if TYPE_CHECKING:  # types only: a plan's text should not load the verdict (verify's text reads one)
    from collections.abc import Mapping, Sequence

    from vllm_ctxmgr.core.plan import Figure, GpuMemory, Plan
    from vllm_ctxmgr.core.verdict import Verification


def _layer_summary(model: ModelFacts) -> list[str]:
    lines = []
    counts = Counter(
        (
            layer.kind,
            layer.num_kv_heads,
            layer.head_size,
            layer.head_size_v,
            layer.window,
            layer.indexer_head_dim,
        )
        for layer in model.layers
    )
    for (kind, heads, head, head_v, window, indexer), n in counts.items():
        if kind == LayerKind.MLA:
            text = f"MLA latent {head} (kv_lora_rank {model.kv_lora_rank} + rope {model.qk_rope_head_dim})"
        elif kind == LayerKind.MAMBA:
            state = next(layer.state for layer in model.layers if layer.kind == kind)
            text = f"recurrent state ({state.family if state else '?'})"
        elif kind == LayerKind.NONE:
            text = "shares another layer's KV (no memory)"
        else:
            text = f"{heads} KV heads x {head}" + (f"/{head_v}" if head_v != head else "")
            if window:
                text += f", {'window' if kind == LayerKind.SLIDING else 'chunk'} {window}"
        if indexer:
            text += f" + DSA indexer {indexer}"
        lines.append(f"  {n:4d} x {kind.value:8s} {text}")
    return lines


def facts_text(model: ModelFacts, version: tuple[int, int, int] = NEWEST_VLLM) -> str:

    derived, key = derived_max_model_len(model, version)
    out = [
        f"model        {model.source} ({model.source_format})",
        f"architecture {model.model_type} {', '.join(model.architectures)}".rstrip(),
        f"dtype        {model.dtype}"
        + (f", quantization {model.quantization}" if model.quantization else ""),
        f"weights      {gib(model.weight_bytes)} ({model.provenance.get('weight_bytes', 'model files')})"
        if model.weight_bytes is not None
        else "weights      unknown (no weight files next to the config; pass --weights-bytes to plan)",
        f"max length   {derived:,} (derived by vLLM {'.'.join(map(str, version))} from {key})",
        f"layers       {model.num_hidden_layers}"
        + (f" (+{model.mtp_layers} MTP)" if model.mtp_layers else ""),
        *_layer_summary(model),
    ]
    if model.kv_cache_scheme:
        out.append(f"kv scheme    {model.kv_cache_scheme} (declared by the checkpoint)")
    out.extend(f"note         {note}" for note in model.notes)
    _, unknown_version = known_version(version)  # older or newer than any release whose rules are known
    if unknown_version:
        out.append(f"warning      {unknown_version}")
    return "\n".join(out)


def facts_json(model: ModelFacts, version: tuple[int, int, int] = NEWEST_VLLM) -> JSONObject:

    derived, key = derived_max_model_len(model, version)
    data = asdict(model)
    data["layers"] = [
        {k: (v.value if isinstance(v, LayerKind) else v) for k, v in asdict(layer).items()}
        for layer in model.layers
    ]
    data["num_hidden_layers"] = model.num_hidden_layers
    data["layer_kinds"] = {kind.value: model.count(kind) for kind in LayerKind if model.count(kind)}
    data["derived_max_model_len"] = derived
    data["derived_max_model_len_key"] = key
    _, unknown_version = known_version(version)
    data["warnings"] = [unknown_version] if unknown_version else []
    return data


def gpus_text(state: GpuState) -> str:
    out = [
        f"{len(state.gpus)} GPU(s) via {state.source}"
        + (f", driver {state.driver_version}" if state.driver_version else "")
    ]
    for gpu in state.gpus:
        out.append(
            f"  GPU {gpu.index}: {gpu.name}  total {gib(gpu.total_bytes)}  used {gib(gpu.used_bytes)}  "
            f"free {gib(gpu.free_bytes)}"
            + (f"  (+{gib(gpu.reserved_bytes)} reserved by the driver)" if gpu.reserved_bytes else "")
        )
        for proc in gpu.processes:
            used = gib(proc.used_bytes) if proc.used_bytes is not None else "?"
            out.append(f"      pid {proc.pid:>7}  {used:>10}  {proc.name[:80]}")
    out.extend(f"  note: {note}" for note in state.notes)
    return "\n".join(out)


def bar(parts: list[tuple[str, int]], total: int, width: int | None = None) -> str:
    """A stacked bar: one character class per part, scaled to `total`."""
    width = width or max(20, min(60, shutil.get_terminal_size((100, 20)).columns - 50))
    cells: list[str] = []
    for char, size in parts:
        # a part larger than the whole (a GPU too small for its weights) fills the bar, never more
        cells.extend(char * min(width, round(width * max(size, 0) / total)) if total > 0 else "")
    text = "".join(cells)[:width]
    return "[" + text.ljust(width, ".") + "]"


def _fig(figure: Figure) -> str:
    return gib(figure.bytes)


HEADLINE = {
    PlanResult.FEASIBLE: "FEASIBLE",
    PlanResult.INFEASIBLE: "NOT FEASIBLE",
    PlanResult.UNKNOWN: "UNKNOWN",
}


def plan_text(plan: Plan, command_change: str = "") -> str:
    """The memory table per GPU, a stacked bar each, the chosen flags and the verdict.
    Long because it is the plan's text top to bottom, a line or a table per part."""
    out: list[str] = []
    layout = plan.layout
    out.append(
        f"KV cache: {plan.kv_bytes_per_token_per_gpu:,} B/token/GPU (marginal), "
        f"{gib(plan.kv_bytes_per_gpu)} for one request of {plan.max_model_len:,} tokens "
        f"[{layout.kv_cache_dtype}, block {layout.block_size}, {layout.bytes_per_block:,} B/block, "
        f"{len(layout.groups)} group(s), backend {layout.attention_backend}]"
    )
    if plan.derived_max_model_len:
        out.append(
            f"model limit: {plan.derived_max_model_len:,} ({plan.derived_max_model_len_key}); "
            f"vLLM {'.'.join(map(str, plan.vllm_version))} rules on {plan.platform.device_type}"
        )
    out.append(rules_line(plan.vllm_version))
    if plan.platform.is_cuda:  # the GPU the backend and the KV dtype were chosen for
        out.append(
            f"GPU: {plan.platform.decided_by()}: decides the backend {layout.attention_backend} and the KV "
            f"dtype {layout.kv_cache_dtype}"
        )
    if plan.gpus:
        out.extend(_gpu_table(plan))
    out.append("")
    out.append(f"{HEADLINE[plan.result]}: {plan.reason}")
    if plan.confidence is not None and plan.gpus:
        out += _wrapped(_confidence_line(plan), "")
    if plan.verdict not in plan.reason:
        out.append(f"memory: {plan.verdict}")
    out.append(f"largest context that fits: {plan.max_context:,}{_context_limit(plan)}")
    least, runs = plan.least_gpu_memory_utilization, plan.gpu_memory_utilization
    if least is not None and runs is not None and abs(least - runs) > 1e-9:
        why = "" if least < runs or not plan.feasible else "; the unit's holds the target, not the margin"
        out.append(f"least gpu_memory_utilization that fits: {least:.2f} (planned at {runs:.2f}{why})")
    if plan.concurrency > 1:
        out.append(f"sized for {plan.concurrency} requests of {plan.max_model_len:,} tokens at once")
    for capacity in plan.capacity:
        # vLLM's own capacity line (_report_kv_cache_config), as this engine will log it
        engine = f" [GPUs {','.join(map(str, capacity.gpus))}]" if len(plan.capacity) > 1 else ""
        out.append(
            f"vLLM will report: KV cache size: {capacity.kv_cache_tokens:,} tokens, Maximum concurrency for "
            f"{plan.max_model_len:,} tokens per request: {capacity.max_concurrency:.2f}x{engine}"
        )
    if plan.feasible:
        flags = " ".join(f"{k} {v}" for k, v in plan.flag_changes.items())
        out.append(f"flags: {flags or '(none)'}")
        for name, value in plan.env_changes.items():
            out.append(f"environment: {name}={value}")
    if command_change:
        out.append(command_change)
    for warning in plan.warnings:
        out.append(f"warning: {warning}")
    if not plan.feasible and plan.alternatives:
        out.append("")
        out.append("what would make it fit (ranked):")
        for alt in plan.alternatives:
            mark = "fits" if alt.feasible else "no  "
            # the environment it needs too (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 past the trained length), as
            # set-context's suggestion writes it: flags alone would be refused by vLLM
            env = [f"Environment={k}={v}" for k, v in alt.env_changes.items()]
            flags = " ".join([*env, *(f"{k} {v}" for k, v in alt.flag_changes.items())])
            out.append(
                f"  {alt.rank:>2}. [{mark}] {alt.description}: max context {alt.max_context:,}, "
                f"{alt.kv_bytes_per_token_per_gpu:,} B/token/GPU" + (f"  ({flags})" if flags else "")
            )
    for note in plan.notes:
        out.append(f"note: {note}")
    return "\n".join(out)


def _gpu_rows(plan: Plan) -> list[tuple[str, list[GpuMemory]]]:
    """GPUs whose every figure is the same, one row ("0-7"): eight identical lines hide the one that
    differs. Consecutive GPUs only, so a row's label reads as a range."""
    rows: list[tuple[list[int], tuple[int | None, ...], list[GpuMemory]]] = []
    for g in plan.gpus:
        key = tuple(
            getattr(g, name).bytes
            for name in ("total", "used_by_others", "startup_overhead", "weights", "non_kv", "kv_budget",
                         "kv_needed", "margin", "headroom")
        )  # fmt: skip
        if rows and rows[-1][1] == key and rows[-1][0][-1] + 1 == g.index:
            rows[-1][0].append(g.index)
            rows[-1][2].append(g)
        else:
            rows.append(([g.index], key, [g]))
    return [(f"{idx[0]}-{idx[-1]}" if len(idx) > 1 else str(idx[0]), gpus) for idx, _key, gpus in rows]


def _gpu_table(plan: Plan) -> list[str]:
    """The memory table: weights apart from the rest of the non-KV memory, the margin in its own column
    (headroom = KV budget - KV needed - margin), identical GPUs as one row, and a bar per row."""
    rows = _gpu_rows(plan)
    width = max(4, *(len(label) for label, _ in rows))
    out = [
        "",
        f"{'GPU':>{width}} {'total':>11} {'others':>10} {'weights':>10} {'other non-KV':>13} "
        f"{'KV budget':>11} {'KV needed':>11} {'margin':>10} {'headroom':>10}",
    ]
    for label, gpus in rows:
        g = gpus[0]
        weights = g.weights.bytes
        other = (
            None if g.non_kv.bytes is None else max(g.non_kv.bytes - (weights or 0), 0)
        )  # the non-KV memory besides the weights: activation peak, non-torch, CUDA graphs
        out.append(
            f"{label:>{width}} {_fig(g.total):>11} {_fig(g.used_by_others):>10} {_fig(g.weights):>10} "
            f"{gib(other):>13} {_fig(g.kv_budget):>11} {_fig(g.kv_needed):>11} {_fig(g.margin):>10} "
            f"{_fig(g.headroom):>10}"
        )
    out.append("")
    for label, gpus in rows:
        g = gpus[0]
        total = g.total.bytes or 1
        weights = g.weights.bytes or 0
        parts = [
            ("o", g.used_by_others.bytes or 0),
            ("#", g.startup_overhead.bytes or 0),
            ("W", weights),
            ("n", max((g.non_kv.bytes or 0) - weights, 0)),
            ("K", g.kv_needed.bytes or 0),
            ("m", min(g.margin.bytes or 0, max((g.kv_budget.bytes or 0) - (g.kv_needed.bytes or 0), 0))),
            ("k", max((g.headroom.bytes or 0), 0)),
        ]
        out.append(f"{label:>{width}} {bar(parts, total)}")
    pad = " " * (width + 1)
    out.append(
        f"{pad}o other processes  # startup overhead  W weights  n other non-KV  K KV needed  m margin  "
        "k KV spare  . free"
    )
    out += _wrapped(_margin_line(plan.gpus[0]), pad)
    sources = sorted(
        {f"{name}: {getattr(plan.gpus[0], name).source}" for name in ("weights", "non_kv", "kv_budget")}
    )
    out.append(f"{pad}sources: " + "; ".join(sources))
    return out


def _wrapped(text: str, indent: str, width: int = 110) -> list[str]:
    """A sentence of the table's notes as lines a terminal shows whole, continued two columns in."""
    import textwrap

    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent + "  ")


def _margin_line(g: GpuMemory) -> str:
    """What the margin is and what it is for, in the GPU's own figures."""
    margin = g.margin.bytes or 0
    if not margin:
        return "margin: none in the KV budget (an explicit budget: vLLM's check is exact)"
    total = g.total.bytes or 0
    base = margin_bytes(total, DEFAULT_MARGIN_FRACTION, DEFAULT_MARGIN_MIN_BYTES)
    text = (
        f"margin: {gib(margin)} of KV budget kept spare beyond what the requests need: "
        f"{gib(min(base, margin))} (max(512 MiB, 2% of the GPU)) for allocator fragmentation and "
        "the rounding of logged figures"
    )
    if margin > base:
        text += (
            f", + {gib(margin - base)} widened for what is not known exactly (the spread of the estimated "
            "terms, flags not modelled: the notes and warnings name them)"
        )
    return text


def _confidence_line(plan: Plan, now: float | None = None) -> str:
    """calibrated (from which start, how old) or estimated, with the error band in this plan's GiB."""
    import time

    c = plan.confidence
    line = f"confidence: {c.level}: {c.basis}"
    if c.started_at is not None:
        age_h = max(0.0, ((now if now is not None else time.time()) - c.started_at) / 3600)
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(c.started_at))
        age = f"{age_h:.1f} h" if age_h < 48 else f"{age_h / 24:.0f} days"
        line += f" (vLLM {c.vllm_version or '?'}, recorded {when}, {age} old)"
    if c.band is not None:
        line += f"; {c.band.text()}"
        budget = min((g.kv_budget.bytes or 0 for g in plan.gpus), default=0)
        margin = min((g.margin.bytes or 0 for g in plan.gpus), default=0)
        guessed = any("without weights" in g.kv_budget.source for g in plan.gpus)
        if c.level != "calibrated" and budget > 0 and not guessed:
            miss = abs(c.band.worst) * budget
            within = "inside" if miss <= margin else "MORE than"
            line += (
                f": {abs(c.band.worst):.1%} of this plan's {gib(budget)} is {gib(miss)}, {within} its "
                f"{gib(margin)} margin"
            )
    return line


def _context_limit(plan: Plan) -> str:
    """What sets the largest context: the model's limit, the target (no limit known), or memory."""
    limit = plan.max_context_limit
    if limit == "model":
        return f" (the model's limit: {plan.derived_max_model_len_key})"
    if limit == "target":
        return " (the target: the model states no limit)"
    if limit == "memory":
        return " (memory: the KV budget at the most utilisation the GPUs allow holds no more)"
    return ""


class ChangeReport(Protocol):
    """What the text of a change reads: change.states.ChangeResult, said here as a shape since report
    sits under the change layer and imports only the core."""

    service: str
    action: str  # set-context | rollback | recover
    result: str  # a change.states.Result (a StrEnum)
    revision: int | None
    previous_max_model_len: int | None
    max_model_len: int | None
    previous_gpu_memory_utilization: float | None
    gpu_memory_utilization: float | None
    reason: str
    decisive_line: str
    suggestion: str
    diff: str
    plan: Mapping[str, object]  # a core.plan_record.PlanRecord; empty where no plan was made
    probe: ProbeRecord
    observation: ObservationFigures
    calibration: CalibrationRecord  # predicted vs observed KV capacity
    expected_downtime: DowntimeRecord
    pending_recovery: int | None
    warnings: Sequence[str]


def change_text(result: ChangeReport, shown_before: bool = False) -> str:
    """What a set-context / rollback / recover did, in plain words. `shown_before`: the diff and the plan
    were printed before the restart (as "planned"), so a change that went ahead is not shown twice.
    Long because it is one headline per result of the one vocabulary, plus the plan and diff parts."""
    out = []
    went_ahead = (
        result.result in ("applied", "rolled-back", "rollback-failed") and result.revision is not None
    )
    shows_diff = result.result in ("dry-run", "planned", "applied", "rolled-back", "rollback-failed")
    if result.diff and shows_diff and not (shown_before and went_ahead):
        out.append(result.diff.rstrip("\n"))
    if result.plan and result.result in ("infeasible", "dry-run", "planned"):
        plan = result.plan
        # the plan is at the utilisation the unit runs with; the least that fits is one more figure (a
        # plan stored before it was, is at the least)
        least = plan.get("least_gpu_memory_utilization", plan["gpu_memory_utilization"])
        applied = (
            result.gpu_memory_utilization if result.result != "infeasible" else plan["gpu_memory_utilization"]
        )
        kept = f" (the least that fits: {least:g})" if applied != least and least is not None else ""
        out.append(
            f"plan: max_model_len {plan['max_model_len']:,}, gpu_memory_utilization "
            f"{applied if applied is not None else 'vLLM default'}{kept}, "
            f"KV {plan['kv_bytes_per_token_per_gpu']:,} B/token/GPU, "
            f"{gib(plan['kv_bytes_per_gpu'])} per request; largest context that fits {plan['max_context']:,}"
        )
    if result.action in ("set-context", "rollback") and result.result in ("dry-run", "planned"):
        out += downtime_text(result.expected_downtime)
    before = _len_util(result.previous_max_model_len, result.previous_gpu_memory_utilization)
    after = _len_util(result.max_model_len, result.gpu_memory_utilization)
    headline = {
        "unchanged": f"{result.service}: unchanged. {result.reason}",
        "dry-run": f"{result.service}: would change {before} -> {after}. {result.reason}",
        "planned": f"{result.service}: will change {before} -> {after} (revision to be recorded)",
        "applied": (
            f"{result.service}: changed {before} -> {after} (revision {result.revision}). {result.reason}"
        ),
        "infeasible": f"{result.service}: NOT changed: {result.reason}",
        "rolled-back": (
            # the revision is the change that failed; what is back is the unit from before it
            f"{result.service}: the change to {after} (revision {result.revision}) FAILED and was rolled "
            f"back: the unit from before it is in place again, {before}. Why: {result.reason}"
        ),
        "rollback-failed": (
            f"{result.service}: the change to {after} FAILED and the rollback FAILED too "
            f"(revision {result.revision}): {result.reason}. The service needs a human; the previous unit "
            f"is in the revision store (`ctxmgr history --service {result.service}`)."
        ),
    }.get(result.result, f"{result.service}: {result.result}. {result.reason}")
    if result.action == "recover" and result.result in ("rolled-back", "applied"):
        # an interrupted change that recover finished: it did not fail here, it was undone or completed
        done = "was undone" if result.result == "rolled-back" else "had passed its probe and is finished"
        now = before if result.result == "rolled-back" else after
        headline = (
            f"{result.service}: recovered revision {result.revision}: the interrupted change "
            f"{before} -> {after} {done}; it runs {now}. {result.reason}"
        )
    if result.pending_recovery is not None:
        headline = f"{result.service}: a recovery is pending. {result.reason}"
    out.append(headline)
    if result.decisive_line:
        out.append(f"decisive line: {result.decisive_line}")
    if result.suggestion:
        out.append(f"{'note' if result.result == 'unchanged' else 'what to try'}: {result.suggestion}")
    out.extend(f"warning: {warning}" for warning in result.warnings)
    if result.plan:  # the unit's flags that change GPU memory and that the plan did not count
        out.extend(
            f"warning: {warning}"
            for warning in result.plan.get("warnings", ())
            if warning.startswith("changes GPU memory, not modelled")
        )
    if result.observation:
        obs = result.observation
        facts = [
            f"{name} {obs[key]}"
            for key, name in (
                ("vllm_version", "vLLM"),
                ("available_kv_gib", "KV budget GiB"),
                ("kv_cache_tokens", "KV tokens"),
                ("max_concurrency", "concurrency"),
            )
            if obs.get(key) is not None
        ]
        if facts:
            out.append("measured: " + ", ".join(facts))
    cal = result.calibration
    if "observed_num_gpu_blocks" in cal:
        unit = "tokens" if "observed_capacity_tokens" in cal else "blocks"
        predicted = cal.get("predicted_capacity_tokens", cal["predicted_num_gpu_blocks"])
        observed = cal.get("observed_capacity_tokens", cal["observed_num_gpu_blocks"])
        out.append(
            f"KV capacity: predicted {predicted:,} {unit}, observed {observed:,} {unit} "
            f"(calibration error {cal.get('error_percent', 0):+.2f}%, from {cal['observed_source']})"
        )
    if result.probe and result.probe.get("steps"):
        steps = ", ".join(
            f"{s['name']} {s.get('status') or '-'} ({s['latency_s']:.2f} s)" for s in result.probe["steps"]
        )
        out.append(f"probe: {'ok' if result.probe.get('ok') else 'FAILED'}: {steps}")
    return "\n".join(out)


def _len_util(length: int | None, util: float | None) -> str:
    text = f"max_model_len {length:,}" if length else "max_model_len (vLLM's default)"
    return text + (f" / gpu_memory_utilization {util:g}" if util else "")


def history_text(service: str, rows: list[HistoryRow]) -> str:
    import time

    if not rows:
        return f"{service}: no revisions yet"
    out = [f"{'rev':>4}  {'time':19}  {'action':12} {'state':15} {'context':>9} {'util':>5}  reason"]
    for row in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["time"]))
        context = f"{row['max_model_len']:,}" if row["max_model_len"] else "-"
        util = f"{row['gpu_memory_utilization']:g}" if row["gpu_memory_utilization"] else "-"
        action = row["action"] + (f" {row['rollback_of']}" if row.get("rollback_of") is not None else "")
        first, *more = _reason_lines(row["reason"])
        line = f"{row['revision']:>4}  {when}  {action:12} {row['state']:15} {context:>9} {util:>5}  "
        out.append(line + first)
        out.extend(" " * len(line) + text for text in more)
    return "\n".join(out)


HISTORY_REASON_WIDTH = 90
HISTORY_REASON_LINES = 3


def _reason_lines(reason: str) -> list[str]:
    """A history reason in lines of the reason column's width, broken between words (a reason cut
    mid-word reads as a different one); past the last line it ends in ' ...', whole in --json."""
    lines = textwrap.wrap(
        reason,
        HISTORY_REASON_WIDTH,
        max_lines=HISTORY_REASON_LINES,
        placeholder=" ...",
        break_long_words=False,
        break_on_hyphens=False,
    )
    return lines or [""]


def verification_text(v: Verification) -> str:
    """One headline (the journal's summary line), then a line per reason and note."""
    parts = []
    if v.max_model_len is not None:
        parts.append(f"max_model_len {v.max_model_len}")
    if v.probe_latency_s is not None:
        parts.append(f"probe {v.probe_latency_s:.2f} s")
    if v.kv_cache_tokens is not None:
        parts.append(f"KV cache {v.kv_cache_tokens:,} tokens")
    if v.margin_bytes is not None:
        parts.append(f"margin {gib(v.margin_bytes)}")
    if v.vllm_version:
        parts.append(f"vLLM {v.vllm_version}")
    unchecked = ", GPU memory not checked" if v.gpu_memory_checked is False else ""
    lines = [f"{v.service}: {v.result}{unchecked}" + (f" ({', '.join(parts)})" if parts else "")]
    lines += [f"  {v.result}: {reason}" for reason in v.reasons]
    lines += [f"  note: {note}" for note in v.notes]
    if v.action:
        lines.append(
            f"  on failure: {v.action.get('kind')}: {v.action.get('result')}: {v.action.get('reason', '')}"
        )
    return "\n".join(lines)
