"""Prometheus metrics (``prometheus-client``) fed by the package's own signals.

Off by default: beat builds a :class:`ClusterBeatMetrics` only when
``cluster_beat_http_port`` is set, and serves it on ``/metrics`` (see
:mod:`.http`). Every instance has a registry of its own, never the global
one, so two schedulers in one process (tests, an embedded beat) do not
collide and each counts only what its own scheduler reports.

What is measured, and where it comes from:

===========================================  ======================================================
``cluster_beat_occurrences_total``           ``occurrence_handled``: ``outcome`` (sent, resent,
                                             skipped-overlap, buffered, replaced, missed,
                                             claim-lost, failed) and ``schedule``; plus
                                             ``duplicate-skipped`` from ``run_handled`` in a worker
                                             process that installs metrics (see below)
``cluster_beat_send_lateness_seconds``       histogram of (time of the send) - (nominal instant)
                                             for sent and resent occurrences, by the node's
                                             database-corrected clock; includes deliberate jitter
                                             and catch-up sends
``cluster_beat_leader``                      1 while this node holds the lease (or schedules
                                             without a lease), else 0
``cluster_beat_lease_term``                  the fencing term of this node's latest holding
                                             (0: never held one)
``cluster_beat_lease_events_total``          ``lease_changed`` by ``event``
``cluster_beat_lease_renew_seconds``         histogram of lease renewal calls (Redis round trip)
``cluster_beat_claim_store_seconds``         histogram of claim-store transactions (retries included)
``cluster_beat_claim_store_errors_total``    claim-store transactions that failed (database
                                             unreachable, timed out, ...) once the store is open;
                                             waiting for the database at start-up is in beat's log
``cluster_beat_watchdog_fired_total``        ``watchdog_fired``, by ``schedule``
``cluster_beat_runs_total``                  worker side, ``run_handled`` by ``outcome`` and ``schedule``
``cluster_beat_node_info``                   constant 1 with ``node`` and ``cluster`` labels
===========================================  ======================================================

``cluster_beat_metrics_per_schedule = False`` drops the ``schedule`` label from
every metric (one series per outcome, not per outcome and schedule), for large
schedule sets.

**duplicate-skipped** is decided by the worker-side ledger, in the worker process
that received the duplicate, so beat's ``/metrics`` never shows it. A worker
process counts it when it builds its own metrics (``ClusterBeatMetrics(...)`` with
``sender=None``, which counts ``run_handled`` of every task) and exposes that
registry itself (e.g. :func:`prometheus_client.start_http_server` with
``registry=metrics.registry``); otherwise it is only seen through the
``run_handled`` signal.
"""
from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .. import signals

logger = logging.getLogger("celery_cluster_beat")

__all__ = ["ClusterBeatMetrics", "CONTENT_TYPE", "LATENESS_BUCKETS", "LATENCY_BUCKETS"]

#: Content type of the text exposition format (what ``generate_latest`` writes).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Seconds late: on time is a few milliseconds; jitter and catch-up make minutes.
LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
#: Seconds a Redis or SQL round trip takes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: Lease events after which this node holds the lease / no longer holds it.
_HOLDING = {"acquired"}
_NOT_HOLDING = {"lost", "released", "stepped_down"}
#: The worker-side outcome counted with the beat-side occurrence outcomes.
_DUPLICATE_SKIPPED = "duplicate-skipped"


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class ClusterBeatMetrics:
    """Collectors in a registry of their own, subscribed to the package's signals.

    :param node: this node's id (``node_info`` label).
    :param cluster: the cluster name (``node_info`` label).
    :param per_schedule: keep the ``schedule`` label (``cluster_beat_metrics_per_schedule``).
    :param sender: count only signals sent by this object or by one of *also_from*
        (beat passes its scheduler and its overlap guard); ``None`` counts every
        sender (a worker process).
    :param now: the clock lateness is measured with (beat passes its database-corrected clock).
    """

    def __init__(self, *, node: str = "", cluster: str = "", per_schedule: bool = True,
                 sender: Any = None, also_from: Iterable[Any] = (),
                 now: Callable[[], datetime] = _utcnow) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.per_schedule = bool(per_schedule)
        self._senders = None if sender is None else {id(s) for s in (sender, *also_from) if s is not None}
        self._now = now
        self._connected = False
        reg = self.registry
        by_schedule = ["schedule"] if self.per_schedule else []
        self.occurrences = Counter("cluster_beat_occurrences", "Occurrences by what happened to them",
                                   ["outcome", *by_schedule], registry=reg)
        self.lateness = Histogram("cluster_beat_send_lateness_seconds",
                                  "Time of each send (sent, resent) minus its nominal instant",
                                  by_schedule, buckets=LATENESS_BUCKETS, registry=reg)
        self.leader = Gauge("cluster_beat_leader", "1 while this node schedules (holds the lease), else 0",
                            registry=reg)
        self.term = Gauge("cluster_beat_lease_term", "Fencing term of this node's latest lease holding (0: none)",
                          registry=reg)
        self.lease_events = Counter("cluster_beat_lease_events", "Lease transitions by event", ["event"],
                                    registry=reg)
        self.lease_renew = Histogram("cluster_beat_lease_renew_seconds", "Duration of lease renewal calls",
                                     buckets=LATENCY_BUCKETS, registry=reg)
        self.store_latency = Histogram("cluster_beat_claim_store_seconds",
                                       "Duration of claim-store transactions (retries included)",
                                       buckets=LATENCY_BUCKETS, registry=reg)
        self.store_errors = Counter("cluster_beat_claim_store_errors", "Claim-store transactions that failed",
                                    registry=reg)
        self.watchdog = Counter("cluster_beat_watchdog_fired",
                                "Fires let through because the previous run exceeded max_run_time",
                                by_schedule, registry=reg)
        self.runs = Counter("cluster_beat_runs", "Worker side: deliveries by what the ledger did",
                            ["outcome", *by_schedule], registry=reg)
        self.node_info = Gauge("cluster_beat_node_info", "This node's id and cluster (always 1)",
                               ["node", "cluster"], registry=reg)
        self.node_info.labels(node=node, cluster=cluster).set(1)
        self.leader.set(0)
        self.term.set(0)
        self.store_errors.inc(0)  # exported from the start, so a rate() has a baseline

    # -- wiring ----------------------------------------------------------------------
    def connect(self) -> "ClusterBeatMetrics":
        """Subscribe to the signals (strong references; :meth:`close` unsubscribes)."""
        if not self._connected:
            signals.occurrence_handled.connect(self._on_occurrence, weak=False)
            signals.lease_changed.connect(self._on_lease, weak=False)
            signals.watchdog_fired.connect(self._on_watchdog, weak=False)
            signals.run_handled.connect(self._on_run, weak=False)
            self._connected = True
        return self

    def close(self) -> None:
        if self._connected:
            signals.occurrence_handled.disconnect(self._on_occurrence)
            signals.lease_changed.disconnect(self._on_lease)
            signals.watchdog_fired.disconnect(self._on_watchdog)
            signals.run_handled.disconnect(self._on_run)
            self._connected = False

    def also_count(self, sender: Any) -> None:
        """Count signals *sender* sends too (beat's overlap guard, built once the store answers)."""
        if self._senders is not None and sender is not None:
            self._senders.add(id(sender))

    def instrument_lease(self, lease: Any) -> None:
        """Time the lease's renewals: wraps *lease*'s ``renew`` on this instance only."""
        original = lease.renew
        observe = self.lease_renew.observe

        def renew(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                observe(time.monotonic() - started)

        lease.renew = renew

    def store_observer(self, duration: float, ok: bool) -> None:
        """``ClaimStore.observer``: one transaction took *duration* seconds and succeeded or not."""
        self.store_latency.observe(duration)
        if not ok:
            self.store_errors.inc()

    def set_leader(self, leader: bool, term: Optional[int] = None) -> None:
        """Beat without a lease schedules at once: it says so here (no lease event comes)."""
        self.leader.set(1 if leader else 0)
        if term is not None:
            self.term.set(term)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

    # -- receivers -------------------------------------------------------------------
    def _ours(self, sender: Any) -> bool:
        return self._senders is None or id(sender) in self._senders

    def _labels(self, metric: Any, schedule: Any, **labels: str) -> Any:
        if self.per_schedule:
            labels["schedule"] = str(schedule)
        return metric.labels(**labels) if labels else metric

    def _on_occurrence(self, sender: Any = None, outcome: Any = None, schedule: Any = None,
                       scheduled_at: Optional[datetime] = None, **_: Any) -> None:
        if not self._ours(sender):
            return
        try:
            value = str(getattr(outcome, "value", outcome))
            self._labels(self.occurrences, schedule, outcome=value).inc()
            if value in ("sent", "resent") and scheduled_at is not None:
                late = (self._now() - scheduled_at).total_seconds()
                self._labels(self.lateness, schedule).observe(max(0.0, late))
        except Exception:  # metrics must never disturb the send path
            logger.exception("cluster-beat metrics: recording an occurrence failed")

    def _on_lease(self, sender: Any = None, event: Any = None, term: Any = None, **_: Any) -> None:
        if not self._ours(sender):
            return
        value = str(getattr(event, "value", event))
        self.lease_events.labels(event=value).inc()
        if value in _HOLDING:
            self.leader.set(1)
            if term is not None:
                self.term.set(int(term))
        elif value in _NOT_HOLDING:
            self.leader.set(0)

    def _on_watchdog(self, sender: Any = None, schedule: Any = None, **_: Any) -> None:
        if self._ours(sender):
            self._labels(self.watchdog, schedule).inc()

    def _on_run(self, sender: Any = None, outcome: Any = None, schedule: Any = None, **_: Any) -> None:
        # Worker side: the task instance sends it, never the scheduler, so this is not filtered
        # by sender (a beat process sees none: no task runs there).
        if self._senders is not None:
            return
        value = str(getattr(outcome, "value", outcome))
        self._labels(self.runs, schedule, outcome=value).inc()
        if value == _DUPLICATE_SKIPPED:
            self._labels(self.occurrences, schedule, outcome=value).inc()
