"""Holding a stop signal while a publish is on its way to the broker and not yet owed a 'sent' mark.

Celery's beat answers SIGTERM and SIGINT with a handler that calls ``Scheduler.close()``
and raises ``SystemExit`` wherever the loop happens to be. Everywhere but one place that
is harmless: what it interrupts rolls back, and ``close()`` records what went out
(:attr:`~.pipeline.SendPipeline.unmarked`) before it hands the unsent claims over. The one
place is a publish itself: raised after the broker took a message (kombu's flush waiting
for its reply, the per-message results being collected) and before the pipeline knows it
went out, the stop leaves that message neither marked ``sent`` nor owed a mark, so
``close()`` hands its row over as unsent and the next leader resends it at once. A clean
stop would cause a resend (same task id, but a second message), and the stopping node
would have published a claim it then gave away. It cannot be repaired afterwards either:
what an interrupted flush did is not known.

So :func:`stop_held` defers the handler for that stretch: a signal arriving in it is
remembered, and once the chunk's outcome is known (and what went out is owed its mark)
the handler that was installed runs, as if the signal had just arrived. The stretch is
bounded by the broker's time-outs and the ownership re-checks (``cluster_beat_db_timeout``),
so a stop is delayed by at most that, never lost. Only Python handlers are held, and only
in the main thread (where Python runs them): a default SIGTERM disposition kills the
process, the crash window the delivery contract leaves to the same-id resend.
"""
from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Tuple

logger = logging.getLogger("celery_cluster_beat")

#: The signals Celery's beat stops on (``install_sync_handler``) and Python's Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_held() -> Iterator[None]:
    """Run the block with SIGTERM/SIGINT handlers deferred until it ends (see the module)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers run in the main thread only: nothing can interrupt this one
        return
    caught: List[Tuple[int, Any]] = []

    def hold(signum: int, frame: Any) -> None:
        caught.append((signum, frame))

    held: Dict[int, Any] = {}
    try:
        for sig in STOP_SIGNALS:
            current = signal.getsignal(sig)
            if callable(current):
                held[sig] = current
                signal.signal(sig, hold)
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
        if caught:
            signum, frame = caught[0]
            logger.info("cluster-beat: %s held until the messages on their way to the broker were recorded",
                        signal.Signals(signum).name)
            held[signum](signum, frame)  # beat's: close() (deferred inside tick) and SystemExit
