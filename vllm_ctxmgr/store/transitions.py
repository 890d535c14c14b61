"""The states a revision walks through and the only moves between them (see the package docstring
for what each state means on disk). Pure: the walk (change/states.py) checks each move against it."""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    """The states of a revision; the package docstring says what each means on disk."""

    PLANNED = "planned"
    RECORDED = "recorded"
    INSTALLED = "installed"
    RESTARTING = "restarting"
    SERVING = "serving"
    PROBED = "probed"
    FINAL = "final"
    ROLLING_BACK = "rolling-back"
    ROLLED_BACK = "rolled-back"
    ROLLBACK_FAILED = "rollback-failed"
    BASELINE = "baseline"
    IN_PROGRESS = "in-progress"  # format 1 only; never entered now


# The only moves a revision makes. Any state between recorded and probed may fail into rolling-back;
# a probed one that was interrupted is finished forward by recovery; rolling-back may be entered again
# when a recovery resumes a rollback an interrupted run left.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.PLANNED: frozenset({State.RECORDED}),
    State.RECORDED: frozenset({State.INSTALLED, State.ROLLING_BACK}),
    State.INSTALLED: frozenset({State.RESTARTING, State.ROLLING_BACK}),
    State.RESTARTING: frozenset({State.SERVING, State.ROLLING_BACK}),
    State.SERVING: frozenset({State.PROBED, State.ROLLING_BACK}),
    State.PROBED: frozenset({State.FINAL, State.ROLLING_BACK}),
    State.ROLLING_BACK: frozenset({State.ROLLING_BACK, State.ROLLED_BACK, State.ROLLBACK_FAILED}),
    State.IN_PROGRESS: frozenset({State.ROLLING_BACK}),
    State.FINAL: frozenset(),
    State.ROLLED_BACK: frozenset(),
    State.ROLLBACK_FAILED: frozenset(),
    State.BASELINE: frozenset(),
}
FINISHED = frozenset({State.FINAL, State.ROLLED_BACK, State.ROLLBACK_FAILED, State.BASELINE})
PENDING = frozenset(TRANSITIONS) - FINISHED - {State.PLANNED}  # what `recover` must finish

# A revision whose unit served and passed its probe, or the unit as ctxmgr first found it: what a
# rollback may return to and what verify counts as a known-good unit (core.verdict keeps the same two
# names as strings, since the core cannot import the store; a test ties them)
GOOD = frozenset({State.FINAL, State.BASELINE})
