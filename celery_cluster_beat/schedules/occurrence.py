"""The identity of one scheduled occurrence: (schedule name, nominal instant).

Everything that must agree across replicas (the claim key, the task id, the
headers a worker reads) is derived from this pair, never from wall-clock "now".
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime

from .instants import UTC, require_aware, utc_iso

#: Fixed namespace for task ids: the same occurrence gets the same id on every
#: host and on every resend, so a worker or a result backend can recognise it.
TASK_ID_NAMESPACE = uuid.UUID("6f1c1b7e-3c38-5d2a-9a57-1f0d2c7c9b41")


def occurrence_task_id(schedule: str, at: datetime) -> str:
    """The Celery task id of the occurrence of *schedule* at *at* (uuid5)."""
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{schedule}\x00{utc_iso(at)}"))


@dataclass(frozen=True)
class Occurrence:
    """One nominal fire of one schedule entry."""

    schedule: str
    at: datetime  # aware, UTC
    task_id: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.at.tzinfo is not UTC:
            object.__setattr__(self, "at", require_aware(self.at, f"occurrence of {self.schedule!r}"))
        if not self.task_id:
            object.__setattr__(self, "task_id", occurrence_task_id(self.schedule, self.at))
