"""One-offs and start / end / run-count bounds of imported schedules.

django-celery-beat's clocked one-offs, ``one_off`` flag, ``start_time`` and ``expires`` map to
``at(when)`` as the rule and the stored-schedule fields ``start_at``, ``end_at`` (aware
datetimes) and ``max_runs``. The mapping (:mod:`.djangobeat`) writes them into a schedule's spec
as :class:`OneOff` and those three keys, so a plan can be shown without building rules;
:func:`to_api` turns a spec into :meth:`StoredSchedules.add`'s arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, Mapping

BOUND_FIELDS = ("start_at", "end_at", "max_runs")


@dataclass(frozen=True)
class OneOff:
    """A one-off at an aware instant: ``at(when)``."""

    when: datetime

    def __str__(self) -> str:
        return f"at {self.when.isoformat()}"


def uses_bounds(spec: Mapping[str, Any]) -> bool:
    """Whether *spec* needs a one-off or a bound."""
    return isinstance(spec.get("schedule"), OneOff) or any(spec.get(k) is not None for k in BOUND_FIELDS)


def to_api(spec: Mapping[str, Any]) -> Dict[str, Any]:
    """*spec* as :meth:`StoredSchedules.add`'s keyword arguments: a :class:`OneOff` becomes
    ``at(when)``; bounds that are None are left out."""
    out = {k: v for k, v in spec.items() if not (k in BOUND_FIELDS and v is None)}
    if isinstance(out.get("schedule"), OneOff):
        from ...schedules import at

        out["schedule"] = at(out["schedule"].when)
    return out


def recorded(record: Any) -> Dict[str, Any]:
    """The bounds a stored schedule has."""
    return {k: getattr(record, k) for k in BOUND_FIELDS}
