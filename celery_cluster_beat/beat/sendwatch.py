"""Never silent: when every send fails the same way, say so loudly and make health fail.

A scheduler that keeps running while sending nothing is the worst failure it can
have: each failed publish is retried and logged, but a node whose every send fails
(a broker it cannot reach, a message no Celery of this version can build) must be
seen from outside. :class:`SendWatch` follows the publisher's results: after
:data:`THRESHOLD` failed sends in a row with the same error and none sent since, it
logs one ERROR a minute with the count and holds a :attr:`~SendWatch.problem` that
``/healthz`` reports (503) until a send goes through.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

logger = logging.getLogger("celery_cluster_beat")

#: Failed sends in a row, all with the same error, before the node counts as unable to send.
THRESHOLD = 3
#: At most one ERROR line this often (seconds) while the problem lasts.
LOG_EVERY = 60.0
#: An error's text is cut to this many characters (it may carry a whole message repr).
MAX_ERROR_TEXT = 300


class SendWatch:
    """Counts failed sends in a row with the same error; says so once a minute."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, threshold: int = THRESHOLD,
                 log_every: float = LOG_EVERY) -> None:
        self._clock = clock
        self.threshold = threshold
        self.log_every = log_every
        self._error: Optional[str] = None
        self.failed_in_a_row = 0
        self._logged_at: Optional[float] = None

    @property
    def problem(self) -> Optional[str]:
        """Why this node sends nothing (None while sends go through)."""
        if self._error is None or self.failed_in_a_row < self.threshold:
            return None
        return f"the last {self.failed_in_a_row} sends all failed with {self._error}"

    def record(self, errors: Sequence[Optional[BaseException]]) -> None:
        """Take one publish's results (None: sent) in order."""
        for err in errors:
            if err is None:
                if self.problem is not None:
                    logger.warning("cluster-beat: sending works again after %d failed sends", self.failed_in_a_row)
                self._error, self.failed_in_a_row, self._logged_at = None, 0, None
                continue
            text = f"{type(err).__name__}: {err}"[:MAX_ERROR_TEXT]
            if text != self._error:
                self._error, self.failed_in_a_row, self._logged_at = text, 0, None
            self.failed_in_a_row += 1
        problem = self.problem
        now = self._clock()
        if problem is not None and (self._logged_at is None or now - self._logged_at >= self.log_every):
            self._logged_at = now
            logger.error("cluster-beat: this node sends nothing: %s (health fails until a send succeeds; "
                         "`celery cluster-beat check` shows which entries cannot be sent)", problem)
