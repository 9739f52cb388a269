"""What ``celery ... cluster-beat status / list / history`` print: the report's records as tables.

Apart from :mod:`.cli` (the commands, their options and errors) so the command declarations stay
small and cheap to import: Celery imports the plugin in every ``celery`` process, and this module
loads only in a command that prints a table.

The tables say what operators asked for in words and fit a terminal:

* ``list`` fits :data:`LIST_WIDTH` columns by default: the rule in words with its zone, the next
  fire and the last outcome relative to the database's clock ("in 3 min", "sent 12 s ago"), the
  overlap policy, the state. Cells that do not fit are cut with an ellipsis, the widest first;
  ``--wide`` prints every column uncut (exact rule text, task, counters, UTC times).
* ``status`` says ``stopped`` for a node that shut down cleanly and ``gone`` for one whose
  heartbeat lapsed, neither of which schedules; heartbeats in human units.
* A paused schedule is shown with who paused it, when and why, in ``list``, ``status`` and ``history``.

Every cell of stored text goes through :func:`for_terminal` (control and format characters as
escapes) before it is measured or cut, so a cut never leaves half an escape sequence live.
"""
from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Sequence

from ..config.values import printable
from .records import NodeStatus
from .words import duration, relative

if TYPE_CHECKING:  # pragma: no cover
    from ..store.backfill import BackfillRequest
    from .backfill import Plan
    from .records import ClusterStatus, HistoryRow, PausedInfo, ScheduleInfo

#: Width ``list`` fits by default (a terminal of 120 columns); ``--wide`` ignores it.
LIST_WIDTH = 120
#: The mark of a cut cell.
ELLIPSIS = "\u2026"
#: Most characters of a pause note ``status`` and ``history`` print on one line (all in ``--json``).
NOTE_SHOWN = 100
_GAP = "  "


def for_terminal(value: Any) -> str:
    """*value* as the terminal gets it: stored text with its control and format characters
    escaped (:func:`~celery_cluster_beat.config.values.printable`); None as ``-``."""
    return "-" if value is None else printable(str(value))


def cut(text: str, width: int) -> str:
    """*text* in at most *width* characters, marked with an ellipsis when cut."""
    if len(text) <= width:
        return text
    return text[: max(width - 1, 0)] + ELLIPSIS if width > 0 else ""


def when(value: Optional[datetime]) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


def ago(seconds: Optional[float]) -> str:
    """``3.2 s ago``, ``4 min 10 s ago``, ``2 h 5 min ago``; ``-`` for None."""
    return "-" if seconds is None else f"{duration(max(seconds, 0.0))} ago"


def secs(seconds: Optional[float], signed: bool = False) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:+.3f}s" if signed else f"{seconds:.3f}s"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, width: Optional[int] = None,
          flexible: Optional[Dict[int, int]] = None) -> str:
    """Plain text columns, left-aligned, two spaces apart; each cell :func:`for_terminal`.

    *width*: fit the lines in that many characters by cutting the columns of *flexible*
    (column index -> the narrowest it may become), the widest first; the others keep their width."""
    body = [[for_terminal(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]
    if width is not None and flexible:
        over = sum(widths) + len(_GAP) * (len(widths) - 1) - width
        while over > 0:  # one character at a time off the widest: the cuts spread evenly
            shrinkable = [i for i in flexible if widths[i] > max(flexible[i], len(headers[i]))]
            if not shrinkable:
                break
            widths[max(shrinkable, key=lambda i: (widths[i], -i))] -= 1
            over -= 1
        body = [[cut(v, w) for v, w in zip(r, widths)] for r in body]
    lines = [_GAP.join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += [_GAP.join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in body]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- status


def render_status(st: "ClusterStatus") -> str:
    lease = st.lease
    if not lease.enabled:
        leader = f"no lease (every replica schedules); last term {st.store_term}" + (
            f" raised by {st.leader}" if st.leader else "")
        lease_line = "off"
    elif lease.error:
        leader = "unknown"
        lease_line = f"{lease.redis_url}: cannot read the lease: {lease.error}"
    elif lease.holder is None:
        leader = "none (nobody holds the lease)"
        lease_line = f"{lease.redis_url} key {lease.key}"
    else:
        leader = f"{lease.holder} (term {lease.term})"
        lease_line = f"{lease.redis_url} key {lease.key}, expires in {secs(lease.expires_in)}"
    schema = f"schema {st.schema_version}" + (
        "" if st.schema_version == st.code_schema_version else f" (this release: {st.code_schema_version})")
    late = f"{st.unsent} claimed more than {st.claim_grace:g}s ago and not sent"
    summary = [
        ("cluster", st.cluster_name),
        ("leader", leader),
        ("lease", lease_line),
        ("claim store", f"{st.db_url} ({schema})"),
        ("database time", f"{when(st.now)} UTC"),
        ("schedules", f"{st.schedules} ({st.config_schedules} config, {st.stored_schedules} stored), "
                      f"{len(st.paused)} paused" + (f": {', '.join(st.paused[:10])}" if st.paused else "")),
        ("late or unsent", late),
    ]
    width = max(len(k) for k, _ in summary)
    out = [f"{k.ljust(width)}  {for_terminal(v)}" for k, v in summary]
    out.append("")
    if st.nodes:
        running = (NodeStatus.LEADER, NodeStatus.UP)
        out.append(table(["NODE", "STATE", "SCHEDULING", "STARTED (UTC)", "HEARTBEAT", "CLOCK OFFSET"],
                         [(n.node, NodeStatus(n.state).value,
                           ("yes" if n.scheduling else "no") if n.state in running else "-",
                           when(n.started_at), ago(n.heartbeat_age), secs(n.clock_offset, signed=True))
                          for n in st.nodes]))
    else:
        out.append("no node heartbeated in the last hour")
    if st.paused_details:
        out.append("")
        out.append(paused_table(st.paused_details, st.now))
    if st.unsent_shown:
        out.append("")
        out.append(table(["UNSENT", "SCHEDULED (UTC)", "CLAIMED BY", "CLAIMED", "ATTEMPTS", "REASON"],
                         [(u.schedule, when(u.scheduled_at), u.node, ago(u.age), u.attempts, u.reason)
                          for u in st.unsent_shown]))
    out.append("")
    if any(n.state in (NodeStatus.STOPPED, NodeStatus.GONE) for n in st.nodes):
        out.append("(stopped: shut down cleanly, its claims handed over; gone: heartbeat lost without a clean stop)")
    out.append("(occurrences due but never claimed, as while no leader runs, leave no row and are not counted)")
    return "\n".join(out)


def paused_table(paused: Sequence["PausedInfo"], now: datetime) -> str:
    """PAUSED, BY, SINCE, NOTE: who paused each schedule, when, and why."""
    return table(["PAUSED", "BY", "SINCE", "NOTE"],
                 [(p.name, p.paused_by, relative(p.paused_at, now) if p.paused_at else "-",
                   cut(for_terminal(p.paused_note), NOTE_SHOWN)) for p in paused])


def pause_line(name: str, paused: "PausedInfo", now: datetime) -> str:
    """``NAME is paused by alice@host since 2026-12-01 09:31:08 UTC (3 min ago): deploying v2``."""
    since = f" since {when(paused.paused_at)} UTC ({relative(paused.paused_at, now)})" if paused.paused_at else ""
    note = f": {cut(for_terminal(paused.paused_note), NOTE_SHOWN)}" if paused.paused_note else ""
    return f"{for_terminal(name)} is paused by {for_terminal(paused.paused_by)}{since}{note}"


# ----------------------------------------------------------------------------- list


def last_words(s: "ScheduleInfo", now: datetime) -> str:
    """The last occurrence's outcome and how long ago it fell due: ``sent 12 s ago``."""
    if s.last_occurrence is None:
        return "-"
    at = relative(s.last_occurrence, now)
    return f"{s.outcome} {at}" if s.outcome else at


def rule_cell(s: "ScheduleInfo") -> str:
    if s.rule:
        return s.rule
    return f"{s.schedule} ({s.zone})" if s.zone else s.schedule


def render_list(schedules: Sequence["ScheduleInfo"], now: Optional[datetime] = None, *, wide: bool = False,
                width: int = LIST_WIDTH) -> str:
    """The schedules as a table in *width* columns (cells cut), or, *wide*, every column uncut.
    *now*: the database's time the relative times are read against (default: each schedule's
    own next fire is shown as a UTC time instead, as with *wide*)."""
    if not schedules:
        return "no schedules"
    note = "\n\n(next fire is computed from the rule and the database's clock; jitter may delay the send)"
    if wide or now is None:
        rows = [(s.name, s.task, s.state, s.source, s.overlap, s.schedule, s.zone, rule_cell(s), s.bounds or None,
                 when(s.next_fire), when(s.last_occurrence), s.outcome, _counters(s), s.paused_by, s.paused_note)
                for s in schedules]
        out = table(["NAME", "TASK", "STATE", "SOURCE", "POLICY", "SCHEDULE", "ZONE", "RULE", "BOUNDS",
                     "NEXT FIRE (UTC)", "LAST (UTC)", "OUTCOME", "SENT/SKIP/MISS/FAIL", "PAUSED BY", "NOTE"], rows)
        return out + note
    rows = [(s.name, s.state, rule_cell(s), relative(s.next_fire, now), last_words(s, now), s.overlap, s.source)
            for s in schedules]
    # NAME, RULE and LAST give way, the widest first; a cut name is still found by its start.
    out = table(["NAME", "STATE", "RULE", "NEXT", "LAST", "POLICY", "SOURCE"], rows, width=width,
                flexible={0: 16, 2: 20, 4: 14})
    paused = [s for s in schedules if s.paused]
    if paused:
        out += "\n\n" + table(
            ["PAUSED", "BY", "SINCE", "NOTE"],
            [(s.name, s.paused_by, relative(s.paused_at, now) if s.paused_at else "-", s.paused_note) for s in paused],
            width=width, flexible={0: 16, 1: 12, 3: 20})
    return out + note


def _counters(s: "ScheduleInfo") -> str:
    c = s.counters
    return f"{c.sent}/{c.skipped}/{c.missed}/{c.failed}"


# ----------------------------------------------------------------------------- history


def render_history(rows: Sequence["HistoryRow"]) -> str:
    return table(
        ["SCHEDULED (UTC)", "STATUS", "RUN", "KIND", "NODE", "SENT", "STARTED", "FINISHED", "RUNTIME", "ERROR"],
        [(when(r.scheduled_at), r.status, r.run_state or "-", r.kind, r.node,
          when(r.sent_at), when(r.started_at), when(r.finished_at),
          "-" if r.runtime is None else f"{r.runtime:.3f}s", (r.error or "-")[:80]) for r in rows])


def backfill_plan(plan: "Plan") -> str:
    """``backfill --dry-run``: every occurrence of the range, whether it would be sent and why not."""
    rows = [(when(at), "would send" if why is None else "not sent", "-" if why is None else why.value)
            for at, why in plan.items]
    left = plan.not_sent()
    head = (f"dry run: backfill of {for_terminal(plan.name)} ({plan.source}) from {when(plan.start)} to "
            f"{when(plan.end)} UTC: {len(plan.items)} occurrence(s), {len(plan.to_send)} would be sent"
            + (f", {', '.join(f'{n} {why}' for why, n in sorted(left.items()))}" if left else "")
            + "; nothing written")
    head += "".join(f"\nwarning: {for_terminal(w)}" for w in plan.warnings)
    if not rows:
        return head
    return head + "\n\n" + table(("INSTANT (UTC)", "ACTION", "REASON"), rows)


def backfill_result(found: "BackfillRequest", planned: int) -> str:
    """``backfill``: what the leader did with the request (or that it still waits for one)."""
    from ..store.schema import BackfillState

    span = f"{for_terminal(found.schedule)} from {when(found.from_at)} to {when(found.to_at)} UTC"
    if found.state == BackfillState.PENDING and found.node is None:
        return (f"backfill of {span} requested (request {found.id}, {planned} occurrence(s) in the range); "
                "no leader has served it yet: it stays pending and the leader sends it when it reads it "
                "(is a beat running?)")
    if found.state == BackfillState.REFUSED:
        return f"backfill of {span} refused by the leader (request {found.id}): {for_terminal(found.error)}"
    left = found.not_sent or {}
    ended = "done" if found.state == BackfillState.DONE else "stopped part way"
    if found.state == BackfillState.PENDING:  # still served (a large range goes out slice by slice)
        ended = f"being served (up to {when(found.done_to)} UTC so far)" if found.done_to else "being served"
    return (f"backfill of {span} {ended} by {for_terminal(found.node)} (request {found.id}): {found.sent or 0} "
            "sent"
            + (f"; {found.retrying} still being sent (publish retried, or left to the next sender)"
               if found.retrying else "")
            + "".join(f"; {n} failed to publish ({for_terminal(why)})" for why, n in sorted(found.failed.items()))
            + (f"; not sent: {', '.join(f'{n} {why}' for why, n in sorted(left.items()))}" if left else "")
            + (f"; stopped: {for_terminal(found.error)}" if found.state == BackfillState.FAILED and found.error else ""))
