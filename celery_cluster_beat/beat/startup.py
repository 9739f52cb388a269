"""How a configuration error ends the process that runs the scheduler: one ERROR
message listing every problem, exit status 1, no traceback.

Celery's beat turns an exception from the scheduler into a CRITICAL log line with a
traceback, and then prints the traceback again through its stdout redirection
(about 700 lines for one bad entry). Embedded in a worker (``celery worker -B``)
beat is a child process: its death is printed as a traceback and the worker goes
on *without* a scheduler. A configuration error is not a crash: nothing a restart
could fix. So when Celery's beat service builds the scheduler (and only then: a
scheduler built directly, in a test or a program of its own, raises
:class:`~..errors.ConfigError` as usual) :func:`refuse` logs the message and ends:

* ``celery beat``: ``SystemExit(1)``, which Celery does not catch where the
  scheduler is built (its banner's lazy instance, or ``Service.scheduler``);
* the child process of ``celery worker -B``: the worker is asked to stop as on
  Ctrl+C (SIGINT: a warm shutdown with exit status 1; running tasks finish), and
  the child ends with status 1;
* a beat thread (``EmbeddedService(thread=True)``): the worker's own "stop with
  status 1" flag is set (what its SIGINT handler sets), and the thread ends.

A configuration error found later, in ``tick()`` (the claim database was
unreachable at start-up, and once reached it holds a stored schedule named like
an entry, a newer schema, or the lease belongs to another cluster), cannot end
the process from ``tick()``: Celery's loop catches ``SystemExit`` there and ends
normally (status 0). The scheduler then raises ``SystemExit(1)`` from the
``close()`` that the loop's ``finally`` calls (see :meth:`.Scheduler.close`).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import NoReturn, Optional

from ..errors import ConfigError

__all__ = ["BEAT", "PROCESS", "THREAD", "EXIT_STATUS", "beat_host", "refuse", "report"]

#: Who runs the scheduler (None: it was built directly and errors are raised).
BEAT = "celery beat"
PROCESS = "celery worker -B (child process)"
THREAD = "embedded beat thread"

#: The exit status of a process stopped by a configuration error.
EXIT_STATUS = 1

#: Frames looked through for Celery's ``Service.get_scheduler`` (subclasses add a few).
_MAX_DEPTH = 25

#: Celery's log line format, for a message logged before Celery has set logging up.
_FALLBACK_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"


def _built_by_beat_service() -> bool:
    """Whether Celery's beat ``Service.get_scheduler`` is building the scheduler (on our stack)."""
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_name == "get_scheduler" and frame.f_globals.get("__name__") == "celery.beat":
            return True
        frame = frame.f_back
    return False


def beat_host() -> Optional[str]:
    """:data:`BEAT`, :data:`PROCESS` or :data:`THREAD` when Celery's beat service builds the
    scheduler (call from the scheduler's ``__init__``); None when something else does."""
    if not _built_by_beat_service():
        return None
    from celery import beat as celery_beat

    threaded = getattr(celery_beat, "_Threaded", None)
    if threaded is not None and isinstance(threading.current_thread(), threaded):
        return THREAD
    process = getattr(celery_beat, "_Process", None)
    if process is not None:
        from billiard.process import current_process

        if isinstance(current_process(), process):
            return PROCESS
    return BEAT


def _ending(host: str) -> str:
    if host == BEAT:
        return f"beat exits with status {EXIT_STATUS}"
    return f"the embedded beat stops, and the worker with it (exit status {EXIT_STATUS})"


def _log_error(logger: logging.Logger, message: str) -> None:
    """Log *message* at ERROR; with Celery's format on stderr when no logging is set up yet
    (beat builds the banner's scheduler before it configures logging)."""
    if logger.hasHandlers():
        logger.error(message)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FALLBACK_FORMAT))
    logger.addHandler(handler)
    try:
        logger.error(message)
    finally:
        logger.removeHandler(handler)
        handler.flush()


def report(exc: ConfigError, host: str, logger: logging.Logger) -> None:
    """Log the one message for *exc* and make the process that runs beat stop with status 1
    (what is left to do is raising ``SystemExit``: :func:`refuse`, or the scheduler's close())."""
    kind = type(exc).__name__  # ForeignClusterError, SchemaVersionError: a name to search for
    kind = "" if kind == "ConfigError" else f" ({kind})"
    _log_error(logger, f"cluster-beat: configuration error{kind}, {_ending(host)}: {exc}")
    if host == PROCESS:
        parent = os.getppid()
        if parent > 1:
            try:
                os.kill(parent, signal.SIGINT)  # the worker's warm shutdown with exit status 1
            except OSError as err:
                logger.warning("cluster-beat: could not ask the worker (pid %d) to stop: %s", parent, err)
    elif host == THREAD:
        from celery.worker import state

        state.should_stop = EXIT_STATUS  # what the worker's SIGINT handler sets: warm shutdown, status 1
        # The worker's shutdown waits for the beat service to say it stopped; a service whose
        # scheduler was never built would never say so.
        stopped = getattr(getattr(threading.current_thread(), "service", None), "_is_stopped", None)
        if stopped is not None:
            stopped.set()


def refuse(exc: ConfigError, host: Optional[str], logger: logging.Logger) -> NoReturn:
    """Raise *exc* when nothing of Celery's runs the scheduler; else :func:`report` it and
    end with ``SystemExit(1)`` (a thread ends quietly, the process goes on to stop)."""
    if host is None:
        raise exc
    report(exc, host, logger)
    raise SystemExit(EXIT_STATUS) from None
