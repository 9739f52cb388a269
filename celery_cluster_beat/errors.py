"""Exceptions raised for bad input, shared by every concern.

Both are ``ValueError`` subclasses so callers that already guard against bad
configuration with ``except ValueError`` keep working.
"""
from __future__ import annotations

from .schedules.errors import ScheduleError

__all__ = ["ConfigError", "ScheduleError", "UnknownSchedule"]


class ConfigError(ValueError):
    """A ``cluster_beat_*`` setting or a ``beat_schedule`` entry is invalid.

    Raised at start-up, before anything is opened, with every problem found
    listed in one message (not only the first).
    """

    def __init__(self, problems: "list[str] | str") -> None:
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = "%d problems in the celery-cluster-beat configuration:\n  - %s" % (
                len(self.problems),
                "\n  - ".join(self.problems),
            )
        super().__init__(message)


class UnknownSchedule(KeyError):
    """No stored schedule has this name (or it was removed)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(name)

    def __str__(self) -> str:
        return f"no stored schedule is named {self.name!r}"
