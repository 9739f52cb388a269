"""The stop hold of the send path (celery_cluster_beat.beat.stophold), in-process.

Beat's SIGTERM handler raises SystemExit wherever the loop is; between a chunk's publish
and the moment its messages are owed a 'sent' mark the handler must wait, then run once,
exactly as installed. (The real-process proof is tests/beat/test_faults_stop.py.)
"""
from __future__ import annotations

import os
import signal
import threading

import pytest

from celery_cluster_beat.beat.stophold import stop_held


@pytest.fixture
def beat_handler():
    """Beat's handler, as Celery installs it: it records the call, then raises SystemExit."""
    calls = []

    def _sync(signum, frame):
        calls.append(signum)
        raise SystemExit()

    previous = signal.signal(signal.SIGTERM, _sync)
    try:
        yield _sync, calls
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_inside_the_hold_runs_beats_handler_once_after_the_block(beat_handler):
    handler, calls = beat_handler
    done = []
    with pytest.raises(SystemExit):
        with stop_held():
            os.kill(os.getpid(), signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)  # a second one: the stop is one stop
            done.append("recorded")  # what the publish owes: reached although the signal came first
            assert calls == []
    assert done == ["recorded"] and calls == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is handler


def test_without_a_signal_the_hold_changes_nothing(beat_handler):
    handler, calls = beat_handler
    with stop_held():
        assert signal.getsignal(signal.SIGTERM) is not handler  # held meanwhile
    assert calls == [] and signal.getsignal(signal.SIGTERM) is handler
    with pytest.raises(SystemExit):  # and the handler is in force again
        signal.raise_signal(signal.SIGTERM)


def test_an_error_inside_the_hold_still_restores_the_handler(beat_handler):
    handler, calls = beat_handler
    with pytest.raises(RuntimeError):
        with stop_held():
            raise RuntimeError("the broker went away")
    assert calls == [] and signal.getsignal(signal.SIGTERM) is handler


def test_a_default_disposition_is_not_held_and_other_threads_hold_nothing(beat_handler):
    handler, _ = beat_handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a kill, the crash window: left as it is
    with stop_held():
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    signal.signal(signal.SIGTERM, handler)
    seen = []

    def in_thread():
        with stop_held():  # beat in a worker's thread: handlers only ever run in the main thread
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(5)
    assert seen == [handler]
