"""The kinds of value a setting and a ``beat_schedule`` entry share: policies and durations.

Validated in one place, so a setting and an entry key of the same kind accept
exactly the same input and say the same thing when it is wrong.
"""
from __future__ import annotations

from typing import Any, Optional, Type, TypeVar

from ..base import StrEnum

E = TypeVar("E", bound=StrEnum)


class CatchupPolicy(StrEnum):
    """What to send of the occurrences that fell due while nobody could (see :mod:`..beat.catchup`)."""

    LATEST = "latest"
    ALL = "all"
    NONE = "none"


class OverlapPolicy(StrEnum):
    """What to do when a fire comes while the previous run is in flight (Temporal's names in brackets)."""

    SKIP = "skip"  # [Skip]
    ALLOW = "allow"  # [AllowAll]
    BUFFER_ONE = "buffer_one"  # [BufferOne]
    REPLACE = "replace"  # [TerminateOther]


def seconds_problem(value: Any, *, zero_ok: bool = False) -> Optional[str]:
    """Why *value* is not a number of seconds (positive, or zero when *zero_ok*); None when it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return f"expected a number of seconds, got {value!r}"
    if value < 0 or (value == 0 and not zero_ok):
        return f"must be {'zero or ' if zero_ok else ''}positive, got {value!r}"
    return None


def choice_problem(value: Any, kind: Type[E]) -> Optional[str]:
    """Why *value* is not one of *kind*'s values; None when it is."""
    try:
        kind(value)
    except (ValueError, TypeError):
        return f"expected one of {', '.join(m.value for m in kind)}, got {value!r}"
    return None
