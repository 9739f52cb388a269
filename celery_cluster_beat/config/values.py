"""The kinds of value a setting and a ``beat_schedule`` entry share: policies and durations.

Validated in one place, so a setting and an entry key of the same kind accept
exactly the same input and say the same thing when it is wrong.
"""
from __future__ import annotations

import math
import re
import unicodedata
from typing import Any, Optional, Tuple, Type, TypeVar

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
#: Unicode categories that names and new descriptions may not hold and that operators' output
#: escapes: control characters (C0, DEL, C1), format characters (bidi overrides such as U+202E,
#: zero-width joiners, the BOM), lone surrogates, line and paragraph separators. In a terminal they
#: clear the screen, recolour it, reorder what follows or start a fake row; in a log line they lie.
_UNPRINTABLE = {"Cc": "a control character", "Cf": "a format character", "Cs": "a lone surrogate",
                "Zl": "a line separator", "Zp": "a paragraph separator"}
_SHORT_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


#: What a new description may hold besides printable text: it may run over lines, with tabs.
DESCRIPTION_KEEPS = "\n\t"
#: Bidi embeddings, overrides and isolates: they reorder what follows them on the operator's screen.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def description_problem(text: str) -> Optional[str]:
    """Why *text* cannot be a new description; None when it can. Free text as people write it
    (lines, tabs, CRLF, emoji sequences, soft hyphens, direction marks) is accepted; refused are
    the control characters a terminal acts on and the bidi controls that reorder what an operator
    reads, and more than the claim database keeps. Everything shown is escaped anyway."""
    reason = text_problem(text, limit=MAX_TEXT_BYTES, what="a string", free=True)
    if reason:
        return reason
    for i, ch in enumerate(text):
        if (unicodedata.category(ch) == "Cc" and ch not in "\t\n\r") or ch in _BIDI_CONTROLS:
            kind = "a bidi control" if ch in _BIDI_CONTROLS else "a control character"
            return f"contains {kind} ({ch!r} at {i}), which would change what operators read"
    return None


def _first_unprintable(text: str, keep: str = "") -> Optional[Tuple[int, str]]:
    """(offset, character) of *text*'s first character of :data:`_UNPRINTABLE`'s categories not in *keep*."""
    if text.isprintable():  # in C: the common case costs next to nothing
        return None
    for i, ch in enumerate(text):  # spaces other than " " are not printable to Python, but are kept
        if ch not in keep and unicodedata.category(ch) in _UNPRINTABLE:
            return i, ch
    return None


def _escape(ch: str) -> str:
    if ch in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """*text* as operators see it: each control or format character, lone surrogate and line or
    paragraph separator written as an escape (``\\x1b``, ``\\n``, ``\\u202e``), the rest as is.

    Every command-line output of stored text goes through this: a row written past the API
    (or by an older release) cannot clear the terminal, recolour it or draw a fake row."""
    if text.isprintable():
        return text
    return "".join(_escape(ch) if unicodedata.category(ch) in _UNPRINTABLE else ch for ch in text)


def printable_problem(text: str, *, keep: str = "") -> Optional[str]:
    """Why *text* is not printable text (see :data:`_UNPRINTABLE`), the characters of *keep* aside
    (a description's :data:`DESCRIPTION_KEEPS`); None when it is."""
    found = _first_unprintable(text, keep)
    if found is None:
        return None
    at, ch = found
    return f"contains {_UNPRINTABLE[unicodedata.category(ch)]} ('{_escape(ch)}' at {at}): printable text only"


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


def text_problem(value: Any, *, limit: int, what: str = "a string", free: bool = False,
                 printable_only: bool = True) -> Optional[str]:
    """Why *value* cannot be stored as a name (or, *free*, as free text) of at most *limit*
    characters; None when it can. Names hold no control character, and with *printable_only* (where a
    name enters: the API, ``beat_schedule``, settings) printable text only (:func:`printable_problem`);
    a name read back from the claim database passes ``printable_only=False``: one stored before the rule
    stays readable (and removable), shown escaped. Free text holds no NUL (a new description is also
    checked with :func:`printable_problem` where it enters, as above, keeping
    :data:`DESCRIPTION_KEEPS`; one stored before is shown escaped, never refused)."""
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
    if printable_only and not free:
        reason = printable_problem(value)
        if reason:
            return reason
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
