"""`ctxmgr history`'s reason column: broken between words, never mid-word (issue 28 item 7), so a row
reads as the reason that was recorded."""

from __future__ import annotations

from typing import Any

from vllm_ctxmgr.report import HISTORY_REASON_LINES, HISTORY_REASON_WIDTH, history_text

# the reason the demo's forced change records (revision 2), longer than the column
KV_REASON = (
    "the KV cache is too small for max_model_len 202752: one request needs 18.91 GiB but 7.43 GiB is "
    "available per GPU; vLLM estimates the largest max_model_len that fits is 79680"
)


def row(reason: str, revision: int = 2) -> dict[str, Any]:
    return {
        "revision": revision, "time": 1_790_000_000.0, "action": "set-context", "state": "rolled-back",
        "max_model_len": 202_752, "gpu_memory_utilization": 0.8, "reason": reason,
    }  # fmt: skip


def reason_column(text: str) -> tuple[int, list[str]]:
    """Where the header puts the reason column, and each line's text from there."""
    header, *lines = text.splitlines()
    start = header.index("reason")
    return start, [line[start:] for line in lines]


def test_a_long_reason_wraps_between_words_under_its_column_and_keeps_every_word() -> None:
    text = history_text("vllm-glm5", [row(KV_REASON)])
    start, parts = reason_column(text)
    assert len(parts) == 2  # wrapped, not cut
    assert all(len(part) <= HISTORY_REASON_WIDTH for part in parts)
    assert " ".join(parts) == KV_REASON  # every word whole, in order, none split across lines
    continuation = text.splitlines()[2]
    assert continuation[:start] == " " * start  # under the reason column, no other column repeated


def test_a_reason_past_the_last_line_is_cut_at_a_word_with_an_ellipsis() -> None:
    words = [f"word{i:03d}" for i in range(200)]
    text = history_text("vllm-glm5", [row(" ".join(words))])
    _, parts = reason_column(text)
    assert len(parts) == HISTORY_REASON_LINES
    assert parts[-1].endswith(" ...")
    shown = " ".join(parts)[: -len(" ...")].split()
    assert shown == words[: len(shown)]  # whole words only, the first ones, in order
    assert len(shown) < len(words)


def test_short_reasons_stay_on_their_row_and_rows_keep_their_order() -> None:
    text = history_text("vllm-glm5", [row("the unit as ctxmgr first found it", 0), row(KV_REASON, 1)])
    lines = text.splitlines()
    assert lines[1].endswith("the unit as ctxmgr first found it")
    assert lines[1].split()[0] == "0" and lines[2].split()[0] == "1"
    assert len(lines) == 4  # header, a one-line row, a two-line row
