"""The kinds of value a setting and a ``beat_schedule`` entry share: policies and durations.

Validated in one place, so a setting and an entry key of the same kind accept
exactly the same input and say the same thing when it is wrong.
"""
from __future__ import annotations

import math
import re
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


#: Longest duration a setting or an entry may name (a century). Durations are added to and taken
#: from today's instants (a catch-up window reaches back, a jitter forward): beyond this the
#: arithmetic leaves what ``datetime`` holds and one schedule's plan would fail, not its input.
MAX_SECONDS = 100 * 365 * 86400.0
#: Most occurrences one catch-up may send per schedule and pass.
MAX_CATCHUP = 100_000
#: Longest text a ``TEXT`` column holds on MySQL/MariaDB (bytes, UTF-8): JSON and descriptions.
MAX_TEXT_BYTES = 65535

#: Control characters and lone surrogates: no name column holds them the same on every server
#: (PostgreSQL refuses NUL, UTF-8 cannot encode a surrogate), and a log line with them lies.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
#: What free text (a description) may not hold: NUL and lone surrogates.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def shown(value: Any, limit: int = 80) -> str:
    """*value*'s repr for an error message, cut to *limit* characters; never raises (a huge int's
    repr does, and a megabyte string would flood the log)."""
    try:
        text = repr(value)
    except Exception:  # an int past Python's digit limit, a repr that fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def seconds_problem(value: Any, *, zero_ok: bool = False) -> Optional[str]:
    """Why *value* is not a number of seconds (positive, or zero when *zero_ok*, finite and at most
    :data:`MAX_SECONDS`); None when it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return f"expected a number of seconds, got {shown(value)}"
    if isinstance(value, float) and math.isinf(value):
        return f"expected a finite number of seconds, got {shown(value)}"
    if value < 0 or (value == 0 and not zero_ok):
        return f"must be {'zero or ' if zero_ok else ''}positive, got {shown(value)}"
    if value > MAX_SECONDS:
        return f"must be at most {MAX_SECONDS:.0f} s (100 years), got {shown(value)}"
    return None


def count_problem(value: Any, *, limit: int) -> Optional[str]:
    """Why *value* is not a whole number from 1 to *limit*; None when it is."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        return f"expected a whole number from 1 to {limit}, got {shown(value)}"
    return None


def text_problem(value: Any, *, limit: int, what: str = "a string", free: bool = False) -> Optional[str]:
    """Why *value* cannot be stored as a name (or, *free*, as free text) of at most *limit*
    characters; None when it can. Names hold no control character; free text holds no NUL."""
    if not isinstance(value, str):
        return f"expected {what}, got {shown(value)}"
    if not value and not free:
        return f"expected {what}, got ''"
    if len(value) > limit:
        return f"longer than {limit} characters ({len(value)})"
    bad = (_UNSTORABLE if free else _CONTROL).search(value)
    if bad is not None:
        kind = "a lone surrogate" if "\ud800" <= bad.group() <= "\udfff" else "a control character"
        return f"contains {kind} ({bad.group()!r} at {bad.start()}), which the claim database cannot store as is"
    if free and len(value.encode("utf-8")) > MAX_TEXT_BYTES:
        return f"longer than {MAX_TEXT_BYTES} bytes in UTF-8"
    return None


def choice_problem(value: Any, kind: Type[E]) -> Optional[str]:
    """Why *value* is not one of *kind*'s values; None when it is."""
    try:
        kind(value)
    except (ValueError, TypeError):
        return f"expected one of {', '.join(m.value for m in kind)}, got {shown(value)}"
    return None
