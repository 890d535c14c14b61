"""CLI commands for operating services over time: verify, schedule, unschedule, status, observe."""

from __future__ import annotations
