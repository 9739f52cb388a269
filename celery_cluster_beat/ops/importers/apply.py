"""The import's plan against the stored schedules, shown (dry run) or applied.

Each planned schedule ends as one :class:`Outcome`:

* ``created`` (dry run: ``would create``): no stored schedule of that name; it is checked by
  :meth:`StoredSchedules.validate` (every stored-schedule check: names, option allow-list,
  printable text, sizes; a ``beat_schedule`` entry's name), then all are added in one
  transaction (:meth:`StoredSchedules.add_many`);
* ``unchanged``: a stored schedule of that name is the same definition (imported before);
* ``differs``: one of that name is stored with another definition; left as it is, naming the
  fields, unless ``--update`` is given: then ``updated`` (``would update``) through
  :meth:`StoredSchedules.update`;
* ``refused``: cannot be carried over as it is (the mapping's or the API's reason);
* ``skipped``: nothing to carry over (a one-off that already ran, an expired task, a static entry).

Nothing is ever duplicated: a name is stored once, and a name given twice by the source is refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ...errors import ConfigError
from . import bounds
from .mapping import Planned, rule_words

ORDER = ("created", "would create", "updated", "would update", "unchanged", "differs", "skipped", "refused")


@dataclass
class Outcome:
    name: Any
    status: str
    what: str
    becomes: Optional[str] = None
    reason: Optional[str] = None
    notes: List[str] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "status": self.status, "what": self.what, "becomes": self.becomes,
                "reason": self.reason, "notes": list(self.notes)}


def becomes(spec: Dict[str, Any]) -> str:
    words = rule_words(spec["schedule"])
    extra = [f"{k}={v.isoformat() if hasattr(v, 'isoformat') else v}" for k in bounds.BOUND_FIELDS
             if (v := spec.get(k)) is not None]
    if not spec.get("enabled", True):
        extra.append("disabled")
    return words + (f" ({', '.join(extra)})" if extra else "")


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _expected_rule(schedule: Any):
    """``(text, zone)`` the API stores for *schedule*; zone None: the app's zone or none, either."""
    from ...schedules.text import schedule_text

    return schedule_text(schedule)


def differences(app: Any, record: Any, api: Dict[str, Any]) -> List[str]:
    """The fields in which the stored *record* differs from the API arguments *api*."""
    from ...schedules.celery_types import app_zone
    from ...schedules.tzwall import zone_name

    diff = []
    try:
        text, zone = _expected_rule(api["schedule"])
    except Exception:  # a rule with no text form cannot equal a stored one
        text, zone = None, None
    if record.schedule != text:
        diff.append("schedule")
    elif record.zone != zone and not (zone is None and record.zone == zone_name(app_zone(app))):
        diff.append("zone")
    if record.task != api.get("task"):
        diff.append("task")
    for key in ("args", "kwargs", "options"):
        if _plain(getattr(record, key)) != _plain(api.get(key) or ([] if key == "args" else {})):
            diff.append(key)
    if (record.description or "") != (api.get("description") or ""):
        diff.append("description")
    if bool(record.enabled) != bool(api.get("enabled", True)):
        diff.append("enabled")
    for key, value in bounds.recorded(record).items():
        if value != api.get(key):
            diff.append(key)
    return diff


def _problems(exc: ConfigError) -> str:
    return "; ".join(p.replace("\n", " ") for p in exc.problems)


def run(app: Any, planned: Sequence[Planned], *, dry_run: bool, update: bool) -> List[Outcome]:
    """Plan *planned* against *app*'s stored schedules and, unless *dry_run*, apply the plan."""
    from ...dynamic import StoredSchedules

    outcomes: List[Outcome] = []
    to_add: List[Dict[str, Any]] = []
    to_update: List[Dict[str, Any]] = []
    seen = set()
    with StoredSchedules(app) as schedules:
        stored = {s.name: s for s in schedules.list()}
        for item in planned:
            out = Outcome(item.name, "refused", item.what, reason=item.reason, notes=list(item.notes))
            outcomes.append(out)
            if item.spec is None:
                out.status = "skipped" if item.skipped else "refused"
                continue
            out.becomes = becomes(item.spec)
            if item.name in seen:
                out.reason = "its name is given twice by the source (stored schedule names are unique)"
                continue
            seen.add(item.name)
            out.reason = None
            api = bounds.to_api(item.spec)
            old = stored.get(item.name) if isinstance(item.name, str) else None
            if old is not None:
                diff = differences(app, old, api)
                if not diff:
                    out.status = "unchanged"
                    continue
                if not update:
                    out.status = "differs"
                    out.reason = (f"a stored schedule of this name differs in {', '.join(diff)}: left as it is "
                                  "(--update replaces it)")
                    continue
            try:
                schedules.validate({"name": item.name, **api})
            except ConfigError as exc:
                out.reason = _problems(exc)
                continue
            if old is None:
                out.status = "would create" if dry_run else "created"
                to_add.append({"name": item.name, **api})
            else:
                out.status = "would update" if dry_run else "updated"
                to_update.append({"name": item.name, **api})
        if not dry_run:
            if to_add:
                schedules.add_many(to_add)
            for spec in to_update:
                _update(app, schedules, spec)
    return outcomes


def _update(app: Any, schedules: Any, spec: Dict[str, Any]) -> None:
    fields = dict(spec)
    name = fields.pop("name")
    _, zone = _expected_rule(fields["schedule"])
    fields["tz"] = zone  # the rule's own zone, or the app's: never the replaced schedule's
    for key in bounds.BOUND_FIELDS:
        fields.setdefault(key, None)  # a bound the source no longer has is cleared
    schedules.update(name, **fields)


def counts(outcomes: Sequence[Outcome]) -> Dict[str, int]:
    found = {status: 0 for status in ORDER}
    for out in outcomes:
        found[out.status] = found.get(out.status, 0) + 1
    return {k: v for k, v in found.items() if v}


def failed(outcomes: Sequence[Outcome]) -> bool:
    """Whether a schedule was not carried over (refused) or left different (exit status 1)."""
    return any(o.status in ("refused", "differs") for o in outcomes)


def render(outcomes: Sequence[Outcome], shown: Any) -> List[str]:
    """One line per schedule (status, name, what it is, what it becomes or why not, notes);
    *shown* escapes stored text for the terminal."""
    width = max((len(o.status) for o in outcomes), default=0)
    lines = []
    for o in outcomes:
        line = f"{o.status:<{width}}  {shown(o.name)}: {shown(o.what)}"
        if o.becomes and o.status not in ("refused", "skipped"):
            line += f" -> {shown(o.becomes)}"
        if o.reason:
            line += f": {shown(o.reason)}"
        if o.notes and o.status not in ("refused", "skipped"):
            line += "; note: " + "; ".join(shown(n) for n in o.notes)
        lines.append(line)
    return lines
