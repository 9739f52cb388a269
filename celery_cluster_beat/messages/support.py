"""The Celery and kombu versions CI proves this package against (README: Support).

``.ci/run`` runs the whole suite on the newest pair and, in a virtual environment
per older Celery minor, the message-equality tests and a real beat + worker run
(``ci/constraints/``). Outside this range the fast path still checks itself per shape of
message and falls back to Celery's own path on any difference, but nobody has watched
that Celery send: ``cluster-beat check`` says so.
"""
from __future__ import annotations

from typing import List, Tuple

#: (oldest minor, newest minor) tested, inclusive.
TESTED = {
    "celery": ((5, 3), (5, 7)),
    "kombu": ((5, 3), (5, 7)),
}


def minor(version: str) -> Tuple[int, ...]:
    """(major, minor) of a version string: '5.6.3' -> (5, 6); '5.7.0rc1' -> (5, 7)."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def installed() -> List[Tuple[str, str]]:
    """(package, version) of what this process runs."""
    import celery
    import kombu

    return [("celery", celery.__version__), ("kombu", kombu.__version__)]


def outside_tested_range() -> List[str]:
    """One sentence per package whose installed minor CI does not test."""
    out = []
    for package, version in installed():
        low, high = TESTED[package]
        if not low <= minor(version) <= high:
            out.append(f"{package} {version} is outside the tested range "
                       f"{'.'.join(map(str, low))}-{'.'.join(map(str, high))}")
    return out


def describe() -> str:
    """'celery 5.7.0, kombu 5.7.0 (tested: celery 5.3-5.7, kombu 5.3-5.7)'."""
    have = ", ".join(f"{p} {v}" for p, v in installed())
    tested = ", ".join(f"{p} {'.'.join(map(str, lo))}-{'.'.join(map(str, hi))}" for p, (lo, hi) in TESTED.items())
    return f"{have} (tested: {tested})"
