"""Whether a delivery may be the message beat sent for the occurrence its headers name: the worker's part.

The ``cluster_beat_*`` headers are whatever the publisher wrote: a message for task A carrying
schedule B's headers would otherwise start B's occurrence in the ledger (a row for a future
instant, or a run of the wrong task), and beat would count B's real occurrence as claimed
elsewhere and never send it. The ledger checks what it is told, in its own transaction
(:mod:`..store.provenance`: a future instant only when no claim row exists, a stored schedule's
task only when its row has not changed since the instant). A config entry's task is read here
from the worker's own Celery config (the same app as beat, trusted like the rest of it). A
delivery whose task cannot be checked runs, with one WARNING per schedule: refusing it would drop
the runs of a config entry beat has and this worker lacks (a rolling deploy), or of a stored
schedule's occurrence sent before its task changed, and a name no beat schedules cancels nothing.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from ..config.celeryconf import default_entries
from ..config.values import shown
from ..store.ledger import FUTURE_MARGIN, Refusal, RunStart, Unchecked

#: Celery's own default entry (config.celeryconf.default_entries): the only name looked up there.
_DEFAULT_ENTRY = "celery.backend_cleanup"


def configured_task(app: Any, schedule: str) -> Optional[str]:
    """The task the Celery config's ``beat_schedule`` (or Celery's default entry) gives
    *schedule*; None when it has no entry of that name (a stored schedule, or nobody's)."""
    beat_schedule = app.conf.beat_schedule or {}
    spec = beat_schedule.get(schedule) if isinstance(beat_schedule, Mapping) else None
    if spec is None and schedule == _DEFAULT_ENTRY:
        spec = default_entries(app, beat_schedule).get(schedule)
    task = spec.get("task") if isinstance(spec, Mapping) else None
    return task if isinstance(task, str) else None


def refusal_text(start: RunStart, task: str, schedule: str) -> str:
    """Why the ledger refused a delivery of *task* for *schedule*, for the one WARNING line."""
    if start.refusal is Refusal.FUTURE:
        now = start.db_now.isoformat() if start.db_now else "?"
        return (f"its instant is ahead of the claim database's clock ({now}) by more than "
                f"{FUTURE_MARGIN.total_seconds():g}s and it has no claim row; beat claims an occurrence "
                "before it sends it")
    return f"schedule {shown(schedule, 300)} runs task {shown(start.schedule_task, 300)}, not {shown(task, 300)}"


_unchecked_warned: set[tuple[str, str]] = set()


def warn_unchecked(logger: Any, schedule: str, task: str, why: Unchecked = Unchecked.UNKNOWN) -> None:
    """One WARNING per schedule, reason and process for a delivery whose task could not be checked
    (*why*): no entry of this worker's ``beat_schedule`` and no stored schedule has its name, or the
    stored schedule changed after the occurrence's instant. It runs (a config entry beat has and this
    worker lacks, as in a rolling deploy, or an occurrence sent before its schedule's task changed,
    must not lose its runs)."""
    key = (schedule, str(why))
    if key in _unchecked_warned or len(_unchecked_warned) >= 10_000:
        return
    _unchecked_warned.add(key)
    if why is Unchecked.CHANGED:
        logger.warning("cluster-beat ledger: %s: stored schedule %s changed after this occurrence's instant (its "
                       "task may have changed since it was sent), so its task cannot be checked against the "
                       "delivered one; run", shown(task, 300), shown(schedule, 300))
        return
    logger.warning("cluster-beat ledger: %s: schedule %s is in neither this worker's beat_schedule nor the stored "
                   "schedules, so its task cannot be checked against the delivered one; run. Load the same "
                   "beat_schedule in workers as in beat", shown(task, 300), shown(schedule, 300))
