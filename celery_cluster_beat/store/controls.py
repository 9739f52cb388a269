"""Operators' controls of a schedule: pause, resume and "run now", for config and stored schedules alike.

A control is a row of ``cluster_beat_controls`` keyed by the schedule's name.
Every change bumps the same change counter as stored schedules
(:mod:`.stored`), so the leader applies it with the same read of "what changed
since version N", within a second, and a paused schedule stays paused across
restarts and failovers.

"Run now" is keyed on the request, not on the wall clock alone: a request while
another for the same schedule is pending joins it, so two operators pressing it
at once give one run. The manual occurrence's instant is the database's time of
the first request, so its claim (and task id) is one of its own.
"""
from __future__ import annotations

import unicodedata
import uuid
from dataclasses import dataclass, fields
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Tuple

import sqlalchemy as sa

from ..base import MAX_NAME_LENGTH, clip
from .dialects.base import chunks
from .errors import database_errors
from .schema import controls_table, schedule_version_table

#: Longest pause note kept (characters): a sentence for the screen, not a document.
MAX_NOTE_LENGTH = 500


def pause_note(note: Optional[str]) -> Optional[str]:
    """*note* as stored: stripped, clipped to :data:`MAX_NOTE_LENGTH`, None when empty.

    ValueError for text a terminal would act on (control characters other than tab and line
    breaks, bidi controls, NUL, lone surrogates): the rule of a new description
    (``config.values.description_problem``, which this layer may not import), checked before
    anything is written."""
    if note is None:
        return None
    if not isinstance(note, str):
        raise ValueError(f"a pause note must be text, got {type(note).__name__}")
    note = note.strip()
    for i, ch in enumerate(note):
        if ch in _BIDI_CONTROLS:
            raise ValueError(f"the pause note contains a bidi control ({ch!r} at {i}), "
                             "which would change what operators read")
        if (unicodedata.category(ch) == "Cc" and ch not in "\t\n\r") or unicodedata.category(ch) == "Cs":
            raise ValueError(f"the pause note contains a control character ({ch!r} at {i}), "
                             "which would change what operators read")
    return clip(note, MAX_NOTE_LENGTH) or None


#: Bidi embeddings, overrides and isolates: they reorder what follows them on an operator's screen.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")

if TYPE_CHECKING:  # pragma: no cover
    from sqlalchemy.engine import Connection


@dataclass(frozen=True)
class ControlRow:
    """One row of ``cluster_beat_controls``."""

    name: str
    paused: bool
    paused_at: Optional[datetime]
    paused_by: Optional[str]
    resumed_at: Optional[datetime]
    run_request: Optional[str]
    run_requested_at: Optional[datetime]
    run_requested_by: Optional[str]
    version: int
    #: Why it was paused, in the operator's words (None: no note, or not paused). Last, with a
    #: default, so rows built by position before it existed still read right.
    paused_note: Optional[str] = None


_FIELDS = [f.name for f in fields(ControlRow)]


def control_row(r: Any) -> ControlRow:
    """A :class:`ControlRow` of a row selected with :func:`control_columns`."""
    return ControlRow(*(bool(v) if k == "paused" else v for k, v in zip(_FIELDS, r)))


_row = control_row


def control_columns() -> List[Any]:
    """The columns of ``cluster_beat_controls`` a :class:`ControlRow` holds, in its order."""
    return [controls_table.c[f] for f in _FIELDS]


def bump_version(conn: "Connection") -> int:
    """Take the next value of the change counter (its row lock is held until commit)."""
    v = schedule_version_table
    conn.execute(sa.update(v).where(v.c.id == 1).values(version=v.c.version + 1))
    return int(conn.execute(sa.select(v.c.version).where(v.c.id == 1)).scalar_one())


class ControlQueries:
    """Mixed into :class:`~.claims.ClaimStore`: it provides ``_run``, ``_now`` and ``_dialect``."""

    if TYPE_CHECKING:  # pragma: no cover
        url_masked: str
        _dialect: Any

        def _run(self, work: Callable[["Connection"], Any], *, write: bool = True) -> Any: ...

        def _now(self, conn: "Connection") -> datetime: ...

    def _control(self, conn: "Connection", name: str, version: int) -> Optional[ControlRow]:
        c = controls_table
        self._dialect.insert_if_absent(conn, c, [{"name": name, "paused": False, "version": version}], ["name"])
        r = conn.execute(sa.select(*(c.c[f] for f in _FIELDS)).where(c.c.name == name)).first()
        return None if r is None else _row(r)

    @database_errors
    def set_paused(self, name: str, paused: bool, *, by: Optional[str] = None,
                   note: Optional[str] = None, replace_note: bool = True,
                   resumed_at: Any = ...) -> Tuple[int, bool]:
        """Pause or resume schedule *name*; (the change counter's new value, whether it changed).

        *note*: why it is paused, shown to operators (clipped to :data:`MAX_NOTE_LENGTH`
        characters; ValueError for control or bidi characters). Pausing a schedule paused already
        with a note replaces the note (unless *replace_note* is False: the leader's own pause after
        failures leaves an operator's pause as it is); resuming clears it. *resumed_at* (given): change
        nothing unless the schedule's last resume is still that one (the leader judged its runs
        since then; a resume in between restarts the count)."""
        self._check(name)
        note = pause_note(note) if paused else None
        c = controls_table

        def work(conn: "Connection") -> Tuple[int, bool]:
            version = bump_version(conn)
            current = self._control(conn, name, version)
            if resumed_at is not ... and current is not None and current.resumed_at != resumed_at:
                return version, False  # resumed since the caller looked: its judgement is stale
            changed = current is None or current.paused != paused
            values: dict = {"paused": paused, "version": version}
            if changed:
                now = self._now(conn)
                values.update(paused_at=now if paused else None, paused_note=note,
                              paused_by=clip(by, MAX_NAME_LENGTH) if (paused and by) else None)
                if not paused:
                    values["resumed_at"] = now
            elif paused and note is not None and replace_note:
                # Paused already: the new reason replaces the old one, with its author (a note read
                # as "paused by alice: <bob's reason>" would put words in alice's mouth); when stays.
                values["paused_note"] = note
                if by:
                    values["paused_by"] = clip(by, MAX_NAME_LENGTH)
            conn.execute(sa.update(c).where(c.c.name == name).values(**values))
            return version, changed

        return self._run(work)

    @database_errors
    def request_run(self, name: str, *, by: Optional[str] = None) -> Tuple[int, str, datetime, bool]:
        """Ask the leader for one extra occurrence of *name* now.

        Returns (the change counter's value, the request id, the occurrence's instant,
        whether it joined a request already pending)."""
        self._check(name)
        c = controls_table

        def work(conn: "Connection") -> Tuple[int, str, datetime, bool]:
            version = bump_version(conn)
            current = self._control(conn, name, version)
            if current is not None and current.run_request and current.run_requested_at is not None:
                # Stamped anew, so a leader that lost the request from memory reads it again.
                conn.execute(sa.update(c).where(c.c.name == name).values(version=version))
                return version, current.run_request, current.run_requested_at, True
            request, at = str(uuid.uuid4()), self._now(conn)
            conn.execute(sa.update(c).where(c.c.name == name).values(
                run_request=request, run_requested_at=at, version=version,
                run_requested_by=clip(by, MAX_NAME_LENGTH) if by else None))
            return version, request, at, False

        return self._run(work)

    @database_errors
    def finish_run_request(self, name: str, request: str) -> bool:
        """The leader handled request *request* (sent it, or recorded why not): clear it."""
        c = controls_table
        return bool(self._run(lambda conn: conn.execute(
            sa.update(c).where(c.c.name == name, c.c.run_request == request)
            .values(run_request=None, run_requested_at=None, run_requested_by=None)).rowcount))

    @database_errors
    def control_changes(self, since: int, *, limit: int = 1000) -> List[ControlRow]:
        """Controls changed after version *since*, oldest change first."""
        c = controls_table
        stmt = sa.select(*(c.c[f] for f in _FIELDS)).where(c.c.version > since).order_by(c.c.version, c.c.name)
        return [_row(r) for r in self._run(lambda conn: conn.execute(stmt.limit(limit)).all(), write=False)]

    @database_errors
    def controls(self, names: Optional[Iterable[str]] = None, *, active_only: bool = False) -> List[ControlRow]:
        """Control rows (of *names*, if given); *active_only*: paused, resumed once, or with a
        pending request (what a new leader must know)."""
        c = controls_table
        stmt = sa.select(*(c.c[f] for f in _FIELDS))
        if active_only:
            stmt = stmt.where(sa.or_(c.c.paused == sa.true(), c.c.run_request.is_not(None),
                                     c.c.resumed_at.is_not(None)))
        if names is None:
            return [_row(r) for r in self._run(lambda conn: conn.execute(stmt.order_by(c.c.name)).all(),
                                               write=False)]
        wanted = sorted(set(names))

        def read(conn: "Connection") -> List[ControlRow]:
            out: List[ControlRow] = []
            for part in chunks(wanted, 500):
                out.extend(_row(r) for r in conn.execute(stmt.where(c.c.name.in_(list(part)))))
            return out

        return self._run(read, write=False)

    def _check(self, name: str) -> None:
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
            raise ValueError(f"schedule name must have 1 to {MAX_NAME_LENGTH} characters: {name!r}")
        self._dialect.check_name(name)
