"""Time spans as systemd reads and prints them (systemd.time(7)): `--every 15min`, TimeoutStopUSec."""

from __future__ import annotations

import re

_SPAN_UNITS: dict[str, float] = {
    "usec": 1e-6, "us": 1e-6, "µs": 1e-6, "μs": 1e-6,
    "msec": 1e-3, "ms": 1e-3,
    "seconds": 1, "second": 1, "sec": 1, "s": 1,
    "minutes": 60, "minute": 60, "min": 60, "m": 60,
    "hours": 3600, "hour": 3600, "hr": 3600, "h": 3600,
    "days": 86400, "day": 86400, "d": 86400,
    "weeks": 604800, "week": 604800, "w": 604800,
    "months": 2629800, "month": 2629800, "M": 2629800,
    "years": 31557600, "year": 31557600, "y": 31557600,
}  # fmt: skip
_SPAN_PART = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-zµμ]*)")


def parse_timespan(text: str) -> float | None:
    """Seconds in a systemd time span ("15min", "1h 30min", "2.5s", "90"), or None if it is not one."""
    text = text.strip()
    if not text:
        return None
    total, position = 0.0, 0
    while position < len(text):
        match = _SPAN_PART.match(text, position)
        if not match or match.end() == position:
            return None
        number, unit = match.groups()
        if unit not in _SPAN_UNITS and unit != "":
            return None
        total += float(number) * _SPAN_UNITS.get(unit, 1)
        position = match.end()
        while position < len(text) and text[position].isspace():
            position += 1
    return total
