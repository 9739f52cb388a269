"""Helpers for connection URLs: masking passwords before anything is logged.

:func:`mask_url` is deliberately forgiving: it is called on URLs taken from
configuration *and* on error messages that may embed a URL, so it never raises
and errs on the side of masking too much rather than too little.
"""
from __future__ import annotations

import re

__all__ = ["mask_url", "MASK"]

#: What a password is replaced with.
MASK = "***"

# ``scheme://`` as in RFC 3986 (redis, rediss, unix, sentinel, redis+sentinel,
# postgresql+psycopg, mysql+pymysql, amqp, sqla+postgresql, ...).
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")

# Query parameters that carry a secret (redis-py accepts ``?password=``, as do
# several SQLAlchemy dialects; ``sentinel_password`` and friends end the same way).
_SECRET_QUERY = re.compile(
    r"(?P<key>(?:^|(?<=[?&;]))[A-Za-z0-9_.\-]*(?:password|passwd|pwd)=)(?P<value>[^&;#\s]*)",
    re.IGNORECASE,
)

# Outside anything that looks like a URL: ``user:secret@host``.
_BARE_USERINFO = re.compile(r":(?P<secret>[^\s@]+)@")


def _mask_query(text: str) -> str:
    return _SECRET_QUERY.sub(lambda m: m.group("key") + (MASK if m.group("value") else ""), text)


def _mask_url_segment(body: str) -> str:
    """Mask the password in the part of one URL that follows ``scheme://``.

    The userinfo ends at the *last* ``@`` of the segment (an unencoded ``@``,
    ``/`` or ``;`` inside a password therefore stays masked), and the password
    starts at the first ``:`` of the userinfo.
    """
    at = body.rfind("@")
    if at > 0:
        userinfo = body[:at]
        colon = userinfo.find(":")
        if colon >= 0 and colon < len(userinfo) - 1:
            body = userinfo[:colon + 1] + MASK + body[at:]
    return _mask_query(body)


def _mask_token(token: str) -> str:
    """Mask one whitespace-free token (one or several URLs, or plain text)."""
    schemes = list(_SCHEME.finditer(token))
    if not schemes:
        return _mask_query(_BARE_USERINFO.sub(":" + MASK + "@", token))
    out = [_mask_query(_BARE_USERINFO.sub(":" + MASK + "@", token[:schemes[0].start()]))]
    for i, match in enumerate(schemes):
        end = schemes[i + 1].start() if i + 1 < len(schemes) else len(token)
        out.append(match.group(0))
        out.append(_mask_url_segment(token[match.end():end]))
    return "".join(out)


def mask_url(url: str) -> str:
    """Return *url* with every password replaced by ``***``.

    Handles ``redis://``, ``rediss://``, ``unix://``, ``sentinel://`` (also several
    ``;``-separated), ``redis+sentinel://``, SQLAlchemy URLs such as
    ``postgresql+psycopg://u:pw@h/db``, ``amqp://`` and ``?password=`` query
    parameters. URLs without a password come back unchanged. Never raises: any
    other text is returned with everything that looks like ``:secret@`` masked.
    """
    try:
        text = url if isinstance(url, str) else str(url)
    except Exception:  # pragma: no cover - a __str__ that raises
        return "<unprintable url>"
    try:
        parts = re.split(r"(\s+)", text)
        return "".join(part if not part or part.isspace() else _mask_token(part) for part in parts)
    except Exception:  # pragma: no cover - defensive: never raise from a log helper
        try:
            return _BARE_USERINFO.sub(":" + MASK + "@", text)
        except Exception:
            return "<unprintable url>"
