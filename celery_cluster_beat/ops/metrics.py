"""Prometheus metrics (``prometheus-client``) fed by the package's own signals, bounded whatever the schedule count.

Off by default: beat builds a :class:`ClusterBeatMetrics` only when
``cluster_beat_http_port`` is set, and serves it on ``/metrics`` (see
:mod:`.http`). Every instance has a registry of its own, never the global
one, so two schedulers in one process (tests, an embedded beat) do not
collide and each counts only what its own scheduler reports.

What is measured, and where it comes from:

===========================================  ======================================================
``cluster_beat_occurrences_total``           ``occurrence_handled``: ``outcome`` (sent, resent,
                                             backfilled, skipped-overlap, buffered, replaced, missed,
                                             claim-lost, failed) and ``schedule``; plus
                                             ``duplicate-skipped`` from ``run_handled`` in a worker
                                             process that installs metrics (see below)
``cluster_beat_send_lateness_seconds``       histogram of (time of the send) - (nominal instant)
                                             for sent and resent occurrences, by ``schedule``, by
                                             the node's database-corrected clock; includes
                                             deliberate jitter and catch-up sends
``cluster_beat_leader``                      1 while this node holds the lease (or schedules
                                             without a lease), else 0
``cluster_beat_lease_term``                  the latest fencing term this node knows of: its own
                                             holding's, on a standby the leader's (read from the
                                             lease at scrape time); 0: none seen yet
``cluster_beat_lease_events_total``          ``lease_changed`` by ``event``
``cluster_beat_lease_renew_seconds``         histogram of lease renewal calls (Redis round trip)
``cluster_beat_claim_store_seconds``         histogram of claim-store transactions (retries included)
``cluster_beat_claim_store_errors_total``    claim-store transactions that failed (database
                                             unreachable, timed out, ...) once the store is open;
                                             waiting for the database at start-up is in beat's log
``cluster_beat_watchdog_fired_total``        ``watchdog_fired``, by ``schedule``
``cluster_beat_paused_after_failures_total``  ``paused_after_failures``: schedules the leader paused
                                             after ``pause_after_failures`` consecutive failed runs
                                             (no ``schedule`` label: the signal and the pause note
                                             name it, and a paused stored schedule's series go)
``cluster_beat_runs_total``                  worker side, ``run_handled`` by ``outcome`` and ``schedule``
``cluster_beat_node_info``                   constant 1 with ``node`` and ``cluster`` labels
``cluster_beat_schedule_series``             schedules whose ``schedule`` label is their name, by
                                             ``source`` (config, stored)
``cluster_beat_schedule_series_refused_total``  outcomes counted under :data:`OVERFLOW` because every
                                             slot for stored schedules was taken
===========================================  ======================================================

**The ``schedule`` label** is what it was before the bound (alerts such as
``increase(cluster_beat_occurrences_total{outcome="failed",schedule="billing"}[1h])`` keep
working), but a schedule's name is its value only for:

* every config entry (``beat_schedule`` and Celery's defaults: as many as the config has);
* at most ``cluster_beat_metrics_stored_max`` other schedules (default 500; 0: none), the
  first to report an outcome while a slot is free, in the order they report (deterministic
  for a sequence of events, and stable: Prometheus pays for every new series). A stored
  schedule keeps its slot until it goes: removed, disabled, paused or unreadable (beat
  tells :meth:`ClusterBeatMetrics.schedule_gone`), or this node stops scheduling (it no
  longer follows their changes); its series are then removed and the slot is free again.

Every other schedule is counted under one value, :data:`OVERFLOW`, the empty string: no
schedule can have it (names are non-empty), and Prometheus reads a label with an empty value
as no label, so ``sum by (outcome) (rate(cluster_beat_occurrences_total[5m]))`` counts every
occurrence and ``{schedule=""}`` selects the rest. One series per schedule forever made
100,000 stored schedules a 180 MB exposition that took 28 s to build, inside beat's process;
with the slots it stays about 1 MB (the lateness histogram is 20 lines a schedule; measured in
``tests/ops/test_metrics_bounds.py``).

A worker process knows no config: every schedule takes a slot there, and keeps it.
``cluster_beat_metrics_per_schedule = False`` leaves the ``schedule`` label out (as before
the bound: to Prometheus, the same as every schedule under :data:`OVERFLOW`).

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
import threading
import time
from datetime import datetime, timezone
from enum import Enum
from typing import Any, Callable, Collection, Dict, Iterable, Optional, Set, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .. import signals

logger = logging.getLogger("celery_cluster_beat")

__all__ = ["ClusterBeatMetrics", "CONTENT_TYPE", "LATENESS_BUCKETS", "LATENCY_BUCKETS", "DEFAULT_STORED_MAX",
           "OVERFLOW", "SeriesKind"]

#: Content type of the text exposition format (what ``generate_latest`` writes).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Seconds late: on time is a few milliseconds; jitter and catch-up make minutes.
LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
#: Seconds a Redis or SQL round trip takes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: ``cluster_beat_metrics_stored_max``'s default: schedules besides the config's with series of their own.
DEFAULT_STORED_MAX = 500
#: The ``schedule`` label of every schedule without series of its own: no schedule has an empty
#: name, and Prometheus reads an empty label value as no label.
OVERFLOW = ""
#: The worker outcome of a delivery the ledger refused (signals.RunOutcome.REFUSED).
_REFUSED = "refused"

#: Lease events after which this node holds the lease / no longer holds it.
_HOLDING = {"acquired"}
_NOT_HOLDING = {"lost", "released", "stepped_down"}
#: The worker-side outcome counted with the beat-side occurrence outcomes.
_DUPLICATE_SKIPPED = "duplicate-skipped"


class SeriesKind(Enum):
    """Which metric a schedule's series belongs to: what :meth:`ClusterBeatMetrics.schedule_gone` removes."""

    OCCURRENCES = "occurrences"
    RUNS = "runs"
    LATENESS = "lateness"
    WATCHDOG = "watchdog"


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class ClusterBeatMetrics:
    """Collectors in a registry of their own, subscribed to the package's signals.

    :param node: this node's id (``node_info`` label).
    :param cluster: the cluster name (``node_info`` label).
    :param per_schedule: keep the ``schedule`` label (``cluster_beat_metrics_per_schedule``).
    :param stored_max: at most this many schedules besides the config's have a ``schedule`` label
        value of their own (``cluster_beat_metrics_stored_max``; 0: none); the rest share :data:`OVERFLOW`.
    :param sender: count only signals sent by this object or by one of *also_from*
        (beat passes its scheduler and its overlap guard); ``None`` counts every
        sender (a worker process).
    :param now: the clock lateness is measured with (beat passes its database-corrected clock).
    """

    def __init__(self, *, node: str = "", cluster: str = "", per_schedule: bool = True,
                 stored_max: int = DEFAULT_STORED_MAX, sender: Any = None, also_from: Iterable[Any] = (),
                 now: Callable[[], datetime] = _utcnow) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.per_schedule = bool(per_schedule)
        self.stored_max = max(0, int(stored_max))
        self._senders = None if sender is None else {id(s) for s in (sender, *also_from) if s is not None}
        self._now = now
        self._connected = False
        #: Names of the config's entries: they always have series of their own (:meth:`set_config`).
        self._config: Collection[str] = frozenset()
        #: Schedules with series of their own -> the (kind, outcome) label sets made for them (to remove
        #: exactly those).
        self._series: Dict[str, Set[Tuple[SeriesKind, Optional[str]]]] = {}
        self._stored = 0  # how many of them are not the config's
        # A worker's threads pool reports from several threads; a series is made and counted under it,
        # so one removed by schedule_gone is never made again behind its back.
        self._lock = threading.Lock()
        reg = self.registry
        by_schedule = ["schedule"] if self.per_schedule else []
        self.occurrences = Counter("cluster_beat_occurrences", "Occurrences by what happened to them",
                                   ["outcome", *by_schedule], registry=reg)
        self.lateness = Histogram("cluster_beat_send_lateness_seconds",
                                  "Time of each send (sent, resent) minus its nominal instant",
                                  by_schedule, buckets=LATENESS_BUCKETS, registry=reg)
        self.leader = Gauge("cluster_beat_leader", "1 while this node schedules (holds the lease), else 0",
                            registry=reg)
        self.term = Gauge("cluster_beat_lease_term",
                          "Latest fencing term this node knows of: its own holding's, or the leader's (0: none)",
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
        self.auto_paused = Counter("cluster_beat_paused_after_failures",
                                   "Schedules paused after pause_after_failures consecutive failed runs",
                                   registry=reg)
        self.runs = Counter("cluster_beat_runs", "Worker side: deliveries by what the ledger did",
                            ["outcome", *by_schedule], registry=reg)
        self.series = Gauge("cluster_beat_schedule_series",
                            "Schedules whose schedule label is their name, by source", ["source"], registry=reg)
        self.refused = Counter("cluster_beat_schedule_series_refused",
                               'Outcomes counted under schedule="": every slot for stored schedules was taken',
                               registry=reg)
        self.node_info = Gauge("cluster_beat_node_info", "This node's id and cluster (always 1)",
                               ["node", "cluster"], registry=reg)
        self.node_info.labels(node=node, cluster=cluster).set(1)
        self.leader.set(0)
        self.term.set(0)
        self._held_term = 0  # the latest term a holding event reported (the gauge never goes below it)
        self.store_errors.inc(0)  # exported from the start, so a rate() has a baseline
        self.auto_paused.inc(0)
        self.refused.inc(0)
        self._count_series()

    # -- wiring ----------------------------------------------------------------------
    def connect(self) -> "ClusterBeatMetrics":
        """Subscribe to the signals (strong references; :meth:`close` unsubscribes)."""
        if not self._connected:
            signals.occurrence_handled.connect(self._on_occurrence, weak=False)
            signals.lease_changed.connect(self._on_lease, weak=False)
            signals.watchdog_fired.connect(self._on_watchdog, weak=False)
            signals.paused_after_failures.connect(self._on_auto_paused, weak=False)
            signals.run_handled.connect(self._on_run, weak=False)
            self._connected = True
        return self

    def close(self) -> None:
        if self._connected:
            signals.occurrence_handled.disconnect(self._on_occurrence)
            signals.lease_changed.disconnect(self._on_lease)
            signals.watchdog_fired.disconnect(self._on_watchdog)
            signals.paused_after_failures.disconnect(self._on_auto_paused)
            signals.run_handled.disconnect(self._on_run)
            self._connected = False

    def also_count(self, sender: Any) -> None:
        """Count signals *sender* sends too (beat's overlap guard, built once the store answers)."""
        if self._senders is not None and sender is not None:
            self._senders.add(id(sender))

    def set_config(self, names: Collection[str]) -> None:
        """The config's entries (beat passes them once set up): each has series of its own, outside
        the slots for stored schedules."""
        with self._lock:
            self._config = frozenset(names)
            self._stored = sum(1 for n in self._series if n not in self._config)
            self._count_series()

    def schedule_gone(self, name: str) -> None:
        """Stored schedule *name* stopped for good (removed, disabled, paused, unreadable): its series
        go and its slot is free. The config's entries keep theirs."""
        with self._lock:
            if name not in self._config:
                self._drop_series(name)
                self._count_series()

    def instrument_lease(self, lease: Any) -> None:
        """Time the lease's renewals: wraps *lease*'s ``renew`` on this instance only. The term gauge
        then reads the lease's latest known term at each scrape: a standby learns the leader's term
        from the lease (no event of its own says so), and would otherwise show 0."""
        known = getattr(lease, "known_term", None)
        if known is not None:
            self.term.set_function(lambda: max(lease.known_term, self._held_term))
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

    # -- which schedules have series of their own ---------------------------------------
    def _label(self, schedule: Any, kind: SeriesKind, outcome: Optional[str] = None) -> Optional[str]:
        """*schedule*'s label value, recording *kind* (and *outcome*) as made for it: its name when it has
        (or now gets) a slot, else :data:`OVERFLOW`; None without the label. Called under the lock."""
        if not self.per_schedule:
            return None
        name = OVERFLOW if schedule is None else str(schedule)
        if name == OVERFLOW:
            return OVERFLOW
        made = self._series.get(name)
        if made is None:
            config = name in self._config
            if not config and self._stored >= self.stored_max:
                self.refused.inc()
                return OVERFLOW
            made = self._series[name] = set()
            if not config:
                self._stored += 1
            self._count_series()
        made.add((kind, outcome))
        return name

    def _also(self, label: Optional[str], kind: SeriesKind, outcome: Optional[str] = None) -> Optional[str]:
        """*label* (from :meth:`_label`) used for another series too: recorded as made. Under the lock."""
        if label:
            self._series[label].add((kind, outcome))
        return label

    @staticmethod
    def _of(metric: Any, label: Optional[str], **labels: str) -> Any:
        """*metric*'s series of *labels* and the schedule *label* (None: no schedule label)."""
        if label is not None:
            labels["schedule"] = label
        return metric.labels(**labels) if labels else metric

    def _drop_series(self, name: str) -> None:
        made = self._series.pop(name, None)
        if made is None:
            return
        if name not in self._config:
            self._stored -= 1
        for kind, outcome in made:
            metric = {SeriesKind.OCCURRENCES: self.occurrences, SeriesKind.RUNS: self.runs,
                      SeriesKind.LATENESS: self.lateness, SeriesKind.WATCHDOG: self.watchdog}[kind]
            try:
                metric.remove(*((outcome,) if outcome is not None else ()), name)
            except KeyError:  # prometheus-client before 0.20 raises for a label set it does not have
                pass

    def _drop_stored(self) -> None:
        """This node stopped scheduling: it no longer follows the stored schedules' changes, so their
        series would go stale (a schedule removed meanwhile would keep its slot): they go."""
        with self._lock:
            for name in [n for n in self._series if n not in self._config]:
                self._drop_series(name)
            self._count_series()

    def _count_series(self) -> None:
        self.series.labels(source="config").set(len(self._series) - self._stored)
        self.series.labels(source="stored").set(self._stored)

    # -- receivers -------------------------------------------------------------------
    def _ours(self, sender: Any) -> bool:
        return self._senders is None or id(sender) in self._senders

    def _on_occurrence(self, sender: Any = None, outcome: Any = None, schedule: Any = None,
                       scheduled_at: Optional[datetime] = None, **_: Any) -> None:
        if not self._ours(sender):
            return
        try:
            value = str(getattr(outcome, "value", outcome))
            late = None
            if value in ("sent", "resent") and scheduled_at is not None:
                late = max(0.0, (self._now() - scheduled_at).total_seconds())
            with self._lock:
                label = self._label(schedule, SeriesKind.OCCURRENCES, value)
                self._of(self.occurrences, label, outcome=value).inc()
                if late is not None:
                    self._of(self.lateness, self._also(label, SeriesKind.LATENESS)).observe(late)
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
                self._held_term = max(self._held_term, int(term))
                self.term.set(int(term))
        elif value in _NOT_HOLDING:
            self.leader.set(0)
            self._drop_stored()

    def _on_watchdog(self, sender: Any = None, schedule: Any = None, **_: Any) -> None:
        if self._ours(sender):
            with self._lock:
                self._of(self.watchdog, self._label(schedule, SeriesKind.WATCHDOG)).inc()

    def _on_auto_paused(self, sender: Any = None, **_: Any) -> None:
        if self._ours(sender):
            self.auto_paused.inc()

    def _on_run(self, sender: Any = None, outcome: Any = None, schedule: Any = None, **_: Any) -> None:
        # Worker side: the task instance sends it, never the scheduler, so this is not filtered
        # by sender (a beat process sees none: no task runs there).
        if self._senders is not None:
            return
        value = str(getattr(outcome, "value", outcome))
        with self._lock:
            # A refused delivery's schedule name is whatever a forger wrote: it takes no slot.
            label = self._label(None if value == _REFUSED else schedule, SeriesKind.RUNS, value)
            self._of(self.runs, label, outcome=value).inc()
            if value == _DUPLICATE_SKIPPED:
                self._of(self.occurrences, self._also(label, SeriesKind.OCCURRENCES, value), outcome=value).inc()
