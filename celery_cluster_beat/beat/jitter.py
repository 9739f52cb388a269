"""Deterministic jitter: the same delay for an occurrence on every replica.

Derived from a hash of (schedule name, nominal instant), as Temporal does, so
a resend or a new leader computes the identical delay, and capped below the
gap to the next occurrence so jitter can never reorder two fires.
"""
from __future__ import annotations

import hashlib
from datetime import datetime

from ..schedules.instants import utc_iso

#: Never use more than this share of the gap to the next occurrence.
GAP_SHARE = 0.9


def jitter_delay(schedule: str, at: datetime, jitter: float, next_at: datetime) -> float:
    """Seconds to delay the occurrence of *schedule* at *at* (0 <= delay < cap)."""
    if not jitter or jitter <= 0:
        return 0.0
    cap = min(float(jitter), (next_at - at).total_seconds() * GAP_SHARE)
    if cap <= 0:
        return 0.0
    cap_us = int(cap * 1_000_000)  # whole microseconds: integer arithmetic, identical on every host
    digest = hashlib.sha256(f"{schedule}\x00{utc_iso(at)}".encode()).digest()
    # floor(fraction * cap): strictly below the cap (rounding to microseconds could reach it)
    return (int.from_bytes(digest[:8], "big") * cap_us >> 64) / 1_000_000
