"""Named fault points in the send path, switched on only by the fault tests.

A real ``celery beat`` process started with ``CCB_FAULTS`` set stops dead,
pauses or fails at an exact place, so a test can hit the window it claims to
cover (after the claim commit, between the broker flush and the 'sent' mark,
in the middle of a burst or of one chunk, inside a claim transaction) instead of hoping a
signal lands there. Without the variable :func:`hit` is one dict lookup.

``CCB_FAULTS="point=action[@n][,point=action[@n]...]"``; actions:

* ``kill``: SIGKILL this process (nothing after the point runs);
* ``stop``: SIGSTOP this process (the test sends SIGCONT);
* ``sleep:S``: sleep S seconds (a pause the process itself does not notice);
* ``error``: raise the exception the call site names (e.g. a lost reply);
* ``term``: SIGTERM this process (a clean stop arriving exactly here: beat's
  handler runs before the point returns, unless the send path holds the stop).

``@n`` fires on the n-th hit of the point (default the first), once. With
``CCB_FAULT_ARM_DIR`` set, a point counts hits only while the file
``<dir>/<point>`` or ``<dir>/<point>-<pid>`` exists (the test arms it when the
scene is set, for every process or for one), and the file is removed when the
point fires.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Dict, Optional, Tuple, Type

#: Points the package calls; tests name them in CCB_FAULTS.
POINTS = frozenset({
    "before-claim",  # the lease was checked, the claim statement not yet sent
    "claimed-ahead",  # occurrences claimed ahead of their instant, waiting for it, none published
    "claim-committed",  # a claim transaction committed; its reply not yet handled
    "claim-in-transaction",  # inside the claim transaction, after the fence, before the insert
    "before-publish",  # a publish chunk passed its ownership check, nothing sent yet
    "mid-chunk",  # between two messages of a publish chunk (on Redis: buffered, not yet flushed)
    "published",  # a publish chunk is on the broker, not yet owed a 'sent' mark (stop held here)
    "after-flush",  # a publish chunk is on the broker, its rows not yet marked sent
    "after-mark",  # a publish chunk's rows are marked sent
})


def _parse(text: str) -> Dict[str, Tuple[str, int]]:
    points: Dict[str, Tuple[str, int]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        point, _, action = item.partition("=")
        action, _, nth = action.partition("@")
        if point not in POINTS or not action:
            raise ValueError(f"CCB_FAULTS: unknown fault point or missing action in {item!r}; "
                             f"points: {', '.join(sorted(POINTS))}")
        points[point] = (action, int(nth or 1))
    return points


_points = _parse(os.environ.get("CCB_FAULTS", ""))
_arm_dir = os.environ.get("CCB_FAULT_ARM_DIR")
_hits: Dict[str, int] = {}


def hit(point: str, error: Optional[Type[BaseException]] = None) -> None:
    """Mark that the send path reached *point*; act if a test asked for a fault here."""
    if not _points:
        return
    spec = _points.get(point)
    if spec is None:
        return
    flag = None
    if _arm_dir is not None:
        armed = [f for f in (os.path.join(_arm_dir, point), os.path.join(_arm_dir, f"{point}-{os.getpid()}"))
                 if os.path.exists(f)]
        if not armed:
            return
        flag = armed[0]
    count = _hits[point] = _hits.get(point, 0) + 1
    action, nth = spec
    if count != nth:
        return
    if flag is not None:
        try:
            os.unlink(flag)
        except FileNotFoundError:
            pass
    print(f"cluster-beat fault point {point}: {action}", file=sys.stderr, flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action.startswith("sleep:"):
        time.sleep(float(action.split(":", 1)[1]))
    elif action == "term":
        signal.raise_signal(signal.SIGTERM)  # the handler runs before this returns (PyErr_CheckSignals)
    elif action == "error":
        raise (error or RuntimeError)(f"fault point {point}")
    else:
        raise ValueError(f"CCB_FAULTS: unknown action {action!r} at {point}")
