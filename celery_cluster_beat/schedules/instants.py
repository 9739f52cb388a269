"""Aware-UTC instants: the one representation every replica compares.

Every module that takes a datetime from outside checks it here, so a naive
value (local? UTC?) is refused in one way everywhere instead of guessed.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: The smallest step between two instants: "strictly after" as "at or after + TINY".
TINY = timedelta(microseconds=1)


def utcnow() -> datetime:
    return datetime.now(UTC)


def require_aware(value: datetime, what: str = "after") -> datetime:
    """*value* as aware UTC; TypeError / ValueError (naming *what*) for anything else."""
    if not isinstance(value, datetime):
        raise TypeError(f"{what} must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{what} must be an aware datetime (got naive {value.isoformat()}); attach a tzinfo")
    return value.astimezone(UTC)


def utc_iso(at: datetime) -> str:
    """ISO 8601 in UTC with a ``Z`` suffix, microseconds only when present."""
    at = at.astimezone(UTC)
    return at.replace(tzinfo=None).isoformat() + "Z"
