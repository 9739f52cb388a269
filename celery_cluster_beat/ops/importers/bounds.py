"""One-offs and start / end / run-count bounds of imported schedules: the one place that knows
whether the stored-schedule API has them.

django-celery-beat's clocked one-offs, ``one_off`` flag, ``start_time`` and ``expires`` map to the
agreed API: ``at(when)`` (``from celery_cluster_beat import at``) as the rule, and the keyword fields
``start_at``, ``end_at`` (aware datetimes) and ``max_runs`` (int >= 1) of
:meth:`StoredSchedules.add` / ``update``, read back as ``StoredSchedule.start_at`` / ``.end_at`` /
``.max_runs``. The mapping (:mod:`.djangobeat`) writes them into a schedule's spec as
:class:`OneOff` and those three keys whatever this release has; :func:`missing` says whether this
release can store them, and :func:`to_api` turns a spec into the API's arguments. Where the API
lacks them such a schedule is refused with :data:`NEEDS`, in the dry run and in the import alike.
Support is detected, not assumed: ``at`` on the package and the three parameters on ``add``.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, Mapping, Optional

#: The reason a schedule needing them is refused while the API lacks them.
NEEDS = "needs one-off/bounds support"
BOUND_FIELDS = ("start_at", "end_at", "max_runs")


@dataclass(frozen=True)
class OneOff:
    """A one-off at an aware instant: ``at(when)`` once the API has it."""

    when: datetime

    def __str__(self) -> str:
        return f"at {self.when.isoformat()}"


def uses_bounds(spec: Mapping[str, Any]) -> bool:
    """Whether *spec* needs a one-off or a bound."""
    return isinstance(spec.get("schedule"), OneOff) or any(spec.get(k) is not None for k in BOUND_FIELDS)


def _at() -> Any:
    """The API's ``at``, or None in a release without it (probed: an import of a name that may not exist)."""
    return getattr(importlib.import_module("celery_cluster_beat"), "at", None)


def supported() -> bool:
    """Whether this release's stored schedules take ``at(...)`` and ``start_at`` / ``end_at`` / ``max_runs``."""
    from ...dynamic import StoredSchedules

    try:
        params = inspect.signature(StoredSchedules.add).parameters
    except (TypeError, ValueError):  # pragma: no cover - a plain method has a signature
        return False
    return _at() is not None and all(k in params for k in BOUND_FIELDS)


def missing(spec: Mapping[str, Any]) -> Optional[str]:
    """Why *spec* cannot be stored by this release (:data:`NEEDS` and what it needs), or None."""
    if not uses_bounds(spec) or supported():
        return None
    needs = [str(spec["schedule"])] if isinstance(spec.get("schedule"), OneOff) else []
    needs += [f"{k}={_shown(spec[k])}" for k in BOUND_FIELDS if spec.get(k) is not None]
    return f"{NEEDS} ({', '.join(needs)}): this release's stored schedules have no at() one-offs, start_at, " \
           "end_at or max_runs yet"


def _shown(value: Any) -> str:
    return value.isoformat() if isinstance(value, datetime) else str(value)


def to_api(spec: Mapping[str, Any]) -> Dict[str, Any]:
    """*spec* as :meth:`StoredSchedules.add`'s keyword arguments: a :class:`OneOff` becomes
    ``at(when)``, bounds that are None are left out (a release without them never gets them)."""
    out = {k: v for k, v in spec.items() if not (k in BOUND_FIELDS and v is None)}
    if isinstance(out.get("schedule"), OneOff):
        at = _at()
        if at is None:  # callers ask missing() first
            raise RuntimeError(NEEDS)
        out["schedule"] = at(out["schedule"].when)
    return out


def recorded(record: Any) -> Dict[str, Any]:
    """The bounds a stored schedule has (None each on a release without them)."""
    return {k: getattr(record, k, None) for k in BOUND_FIELDS}
