"""Why two leaders never act at once: the term (fencing token) and the local deadline of a holding.

A lock alone is not enough for a scheduler: a leader can stall (a GC pause, a frozen VM,
a lost network) past its key's expiry and wake up believing it still leads. Two things
stop it, and this module holds the arithmetic of both, with no Redis in it.

* **The term.** Every acquisition takes a number from a Redis counter (``INCR``) in the
  same Lua script that sets the key (:mod:`.scripts`), so terms strictly increase across
  holdings. Every claim row carries its leader's term and the SQL claim store refuses a
  term lower than one it has seen; :meth:`RedisLease.step_down` is the reaction. A Redis
  restarted without its data (or a cluster replica promoted before it received the last
  ``INCR``) could hand a term out again, so each node remembers the highest term it has
  seen anywhere (:class:`TermFloor`: its own holdings, other holders, the claim store's
  refusal) and the acquire script first raises the counter to it.
* **The local deadline.** ``valid_until`` is the time the acquire/renew command was
  *sent* plus ``ttl - safety_margin`` (:class:`LeaseTiming`); the key cannot expire in
  Redis before ``sent + ttl``, so a leader that stops acting at ``valid_until`` never
  overlaps with the next one, whether or not Redis answers. Reading it needs only the
  clock, never Redis: :attr:`RedisLease.is_leader` cannot block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

__all__ = ["Holding", "LeaseTiming", "TermFloor"]


@dataclass
class Holding:
    """One holding of the lease by this node: our token in the key, its term and deadlines."""

    token: str
    term: int
    last_renewed: float  # send time of the last successful acquire/renew
    valid_until: float
    next_renew_at: float


@dataclass(frozen=True)
class LeaseTiming:
    """The ttl and safety margin of a lease, and the deadlines they give a holding.

    Renewals come every ``ttl / 3`` so that two can fail before the holding runs out;
    after a failed one the next comes sooner (:attr:`renew_retry`), never after ``valid_until``.
    """

    ttl: float
    safety_margin: float

    @classmethod
    def checked(cls, ttl: Any, safety_margin: Any, problems: List[str]) -> "LeaseTiming":
        """The timing from user input; what is wrong is appended to *problems* (a usable stand-in is kept)."""
        try:
            ttl = float(ttl)
        except (TypeError, ValueError):
            problems.append(f"lease ttl must be a number of seconds, not {ttl!r}")
            ttl = 5.0
        if not ttl >= 0.1:
            problems.append(f"lease ttl must be at least 0.1 s, not {ttl!r}")
        if safety_margin is None:
            safety_margin = min(1.0, max(0.05, ttl / 10.0))
        try:
            safety_margin = float(safety_margin)
        except (TypeError, ValueError):
            problems.append(f"lease safety_margin must be a number of seconds, not {safety_margin!r}")
            safety_margin = 0.0
        if not 0.0 <= safety_margin <= ttl / 2.0:
            problems.append(
                f"lease safety_margin must be between 0 and ttl/2 ({ttl / 2.0:g} s), not {safety_margin!r}"
            )
        return cls(ttl, safety_margin)

    @property
    def ttl_ms(self) -> int:
        """The key's time to live as the scripts set it (``PX``)."""
        return max(1, int(round(self.ttl * 1000)))

    @property
    def renew_retry(self) -> float:
        """Seconds to the next renewal after one that Redis did not answer."""
        return min(0.25, self.ttl / 10.0)

    def hold(self, token: str, term: int, sent: float) -> Holding:
        """The holding granted by an acquire command sent at *sent*."""
        return Holding(
            token=token,
            term=term,
            last_renewed=sent,
            valid_until=sent + self.ttl - self.safety_margin,
            next_renew_at=sent + self.ttl / 3.0,
        )

    def extend(self, holding: Holding, sent: float) -> float:
        """*holding* was renewed by a command sent at *sent*; seconds since the previous renewal."""
        since = sent - holding.last_renewed
        holding.last_renewed = sent
        holding.valid_until = sent + self.ttl - self.safety_margin
        holding.next_renew_at = sent + self.ttl / 3.0
        return since

    def is_late(self, since: float) -> bool:
        """A renewal this long after the previous one leaves less than a third of the ttl to spare."""
        return since > self.ttl * 2.0 / 3.0

    def retry_renewal(self, holding: Holding, now: float) -> None:
        """A renewal failed at *now*: try again soon, at the latest when the holding runs out."""
        holding.next_renew_at = min(now + self.renew_retry, holding.valid_until)


class TermFloor:
    """The highest term this node has seen anywhere; the next acquisition's term is above it."""

    def __init__(self) -> None:
        self.value = 0

    def observe(self, term: Optional[int]) -> None:
        if term is not None and term > self.value:
            self.value = term
