"""Helpers for connection URLs: masking passwords before anything is logged or shown.

:func:`mask_url` is for the URLs of the configuration (claim database, Redis,
broker, result backend) and for error messages of the drivers that may embed one:
it never raises and errs on the side of masking too much rather than too little.
It is **not** for names, descriptions or any other value a user chose: its
``user:secret@host`` rule would mangle ``xss:user:alice@example.com``. Messages of
our own that name a schedule use :func:`mask_urls_in`, which touches only what is
spelled as a URL (``scheme://user:password@...``).

Both run in time linear in the text's length (str.find and single passes; no
regular expression that can backtrack): they are called on values an outsider may
have made a megabyte long, on threads that share the interpreter with the
scheduling loop.
"""
from __future__ import annotations

import re
from typing import Callable, List, Tuple

__all__ = ["mask_url", "mask_urls_in", "MASK"]

#: What a password is replaced with.
MASK = "***"

_ALPHA = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
# RFC 3986 scheme characters (redis, rediss, unix, sentinel, redis+sentinel, postgresql+psycopg, ...).
_SCHEME_CHARS = _ALPHA | frozenset("0123456789+.-")
# What the key of a secret query parameter is made of (``password``, ``sentinel_password``, ``pwd``, ...).
_KEY_CHARS = _ALPHA | frozenset("0123456789_.-")
#: More ``://``, ``@`` or secret parameters than this in one text (or ``:secret@`` pieces in one
#: token) is not a configured URL nor a driver's message: it is masked whole (bounded work).
MAX_PIECES = 256
#: Longest scheme looked for: a longer run of scheme characters before ``://`` ends in one.
MAX_SCHEME = 64
_SECRET_KEYS = ("password=", "passwd=", "pwd=")
_QUERY_SEPARATORS = "?&;"
_VALUE_ENDS = "&;#"
# ASCII-only lower-casing keeps every index where it was (str.lower may change the length).
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_RUN = re.compile(r"\S*")  # one token's characters: one class, nothing after it, no backtracking


class _TooMany(Exception):
    """A token with more than :data:`MAX_PIECES` things to mask."""


def _find_any(text: str, chars: str, start: int) -> int:
    """Index of the first of *chars* in *text* at or after *start*, or len(text)."""
    end = len(text)
    for ch in chars:
        i = text.find(ch, start, end)
        if i >= 0:
            end = i
    return end


def _mask_query(text: str) -> str:
    """``...password=secret`` -> ``...password=***`` for keys that start the text or follow ``?&;``."""
    lowered = text.translate(_ASCII_LOWER)
    hits: List[int] = []  # index just past each '=' of a secret-looking key
    for key in _SECRET_KEYS:
        i = lowered.find(key)
        while i >= 0:
            hits.append(i + len(key))
            i = lowered.find(key, i + len(key))
    if not hits:
        return text
    if len(hits) > MAX_PIECES:
        raise _TooMany
    hits.sort()
    out: List[str] = []
    done = 0  # text[:done] is in out
    for value_start in hits:
        if value_start <= done:  # inside a value masked already
            continue
        # the key runs back over key characters (disjoint per '=': '=' is not one of them)
        k = value_start - 1
        while k > done and text[k - 1] in _KEY_CHARS:
            k -= 1
        if not (k == 0 or text[k - 1] in _QUERY_SEPARATORS):
            continue
        value_end = _find_any(text, _VALUE_ENDS, value_start)
        if value_end > value_start:
            out.append(text[done:value_start])
            out.append(MASK)
            done = value_end
    out.append(text[done:])
    return "".join(out)


def _mask_bare(text: str) -> str:
    """``user:secret@host`` -> ``user:***@host`` in whitespace-free text that is not a URL."""
    out: List[str] = []
    done = pos = 0
    while True:
        colon = text.find(":", pos)
        if colon < 0:
            break
        at = text.find("@", colon + 1)
        if at < 0:
            break  # no '@' left: nothing further can match
        if at == colon + 1:  # ':@' hides nothing; the next ':' comes after this '@'
            pos = at + 1
            continue
        if len(out) >= 2 * MAX_PIECES:
            raise _TooMany
        out.append(text[done:colon + 1])
        out.append(MASK)
        done = pos = at  # keep the '@'
    out.append(text[done:])
    return "".join(out)


def _mask_segment(body: str) -> str:
    """Mask the password in the part of one URL that follows ``scheme://``.

    The userinfo ends at the *last* ``@`` of the segment (an unencoded ``@``,
    ``/`` or ``;`` inside a password therefore stays masked), and the password
    starts at the first ``:`` of the userinfo.
    """
    at = body.rfind("@")
    if at > 0:
        colon = body.find(":", 0, at)
        if 0 <= colon < at - 1:
            body = body[:colon + 1] + MASK + body[at:]
    return _mask_query(body)


def _scheme_starts(token: str) -> List[tuple]:
    """``(start, end)`` of every ``scheme://`` in *token*, left to right, without overlaps."""
    found: List[tuple] = []
    floor = 0  # a scheme never reaches back into the previous match
    i = token.find("://")
    while i >= 0:
        k, lowest = i, max(floor, i - MAX_SCHEME)
        while k > lowest and token[k - 1] in _SCHEME_CHARS:
            k -= 1
        while k < i and token[k] not in _ALPHA:  # a scheme starts with a letter
            k += 1
        if k < i:
            found.append((k, i + 3))
            floor = i + 3
        i = token.find("://", i + 3 if k < i else i + 1)
    return found


def _mask_token(token: str, outside: Callable[[str], str]) -> str:
    """Mask one whitespace-free token: URL segments always, other text with *outside*."""
    if token.count("://") > MAX_PIECES:
        raise _TooMany
    schemes = _scheme_starts(token)
    if not schemes:
        return outside(token)
    out = [outside(token[:schemes[0][0]])]
    for n, (start, end) in enumerate(schemes):
        stop = schemes[n + 1][0] if n + 1 < len(schemes) else len(token)
        segment = token[end:stop]
        out.append(token[start:end])
        out.append(_mask_segment(segment) if "@" in segment or "=" in segment else segment)
    return "".join(out)


def _masked_token(token: str, outside: Callable[[str], str]) -> str:
    try:
        return _mask_token(token, outside)
    except _TooMany:
        return MASK


def _everything(text: str) -> str:
    return _mask_query(_mask_bare(text))


def _nothing(text: str) -> str:
    return text


def _positions(text: str, needles: Tuple[str, ...], lowered: str) -> List[int]:
    """Where *needles* occur (at most :data:`MAX_PIECES` + 1 of each: more is garbage)."""
    found: List[int] = []
    for needle in needles:
        hay = lowered if needle.endswith("=") else text
        i, n = hay.find(needle), 0
        while i >= 0 and n <= MAX_PIECES:
            found.append(i)
            n += 1
            i = hay.find(needle, i + len(needle))
        if n > MAX_PIECES:
            raise _TooMany
    return sorted(found)


def _mask(value: object, outside: Callable[[str], str], needles: Tuple[str, ...]) -> str:
    """Mask each whitespace-free token around one of *needles*; the text between stays as it is.

    Only tokens holding a needle are looked at (a token's ends are found with a
    regular expression of one character class, forward and on the reversed text), so
    the work is linear however many tokens, colons or at-signs the text holds."""
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # pragma: no cover - a __str__ that raises
        return "<unprintable url>"
    if ":" not in text and "=" not in text:  # nothing to hide: the common case, one C-level scan each
        return text
    try:
        hits = _positions(text, needles, text.translate(_ASCII_LOWER))
        if not hits:
            return text
        reverse, size = text[::-1], len(text)
        out: List[str] = []
        done = 0  # text[:done] is in out
        for p in hits:
            if p < done:  # in the token just masked
                continue
            start = size - _RUN.match(reverse, size - p).end()  # reverse[i] is text[size - 1 - i]
            end = _RUN.match(text, p).end()
            out.append(text[done:start])
            out.append(_masked_token(text[start:end], outside))
            done = end
        out.append(text[done:])
        return "".join(out)
    except _TooMany:
        return MASK
    except Exception:  # pragma: no cover - defensive: never raise from a log helper
        return "<unprintable url>"


def mask_url(url: object) -> str:
    """Return *url* with every password replaced by ``***``.

    Handles ``redis://``, ``rediss://``, ``unix://``, ``sentinel://`` (also several
    ``;``-separated), ``redis+sentinel://``, ``redis+cluster://``, SQLAlchemy URLs such as
    ``postgresql+psycopg://u:pw@h/db``, ``amqp://`` and ``?password=`` query
    parameters. URLs without a password come back unchanged. Never raises: any
    other text is returned with everything that looks like ``:secret@`` masked, so
    call it on configured URLs and driver messages, never on names (:func:`mask_urls_in`).
    """
    return _mask(url, _everything, ("://", "@") + _SECRET_KEYS)


def mask_urls_in(text: object) -> str:
    """Return *text* with the password of every ``scheme://`` URL in it masked, and
    everything else as it was: for messages that quote a name or a description."""
    return _mask(text, _nothing, ("://",))
