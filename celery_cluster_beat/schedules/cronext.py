"""Extended cron day selectors: ``L``, ``W`` and ``#`` (croniter's syntax), parsed with croniter.

Pure: field text in, a :class:`DaySelector` out; no I/O. Only the two day fields carry
extensions, so the minute, hour, month and second fields keep :mod:`.cronexpr`'s value sets
and a selector answers one question: does the date (year, month, day, weekday) match?

What is accepted is what croniter accepts *and* reads the way we do. Each extended day
field is handed to ``croniter.expand`` (the peer users compare with), and its reading
(``'l'`` markers, the nearest-weekday day, the nth-weekday mapping, the plain day
numbers) must equal our own reading, which is what the selector is built from (so the
instants never depend on the croniter release a replica has); where croniter reads a
term differently (``1-1`` is the whole month to croniter, 1 to Vixie) the expression is
refused rather than given one of two meanings. croniter is imported on
first use only: a plain Vixie expression never loads it.

The meanings (croniter 6.2+, the first with ``W``):

* day-of-month ``L``: the last day of the month; ``15-L`` is 15-31; ``L`` may be listed
  with numbers (``1,L``);
* day-of-month ``15W`` (or ``W15``): the weekday (Mon-Fri) nearest the 15th, never in
  another month: a Saturday 1st moves to Monday the 3rd, a Sunday last day to the
  Friday before; a day past the month's end (``31W`` in April) is the last day first;
* day-of-week ``L5``: the last Friday of the month (Quartz writes ``5L``);
* day-of-week ``1#3``: the third Monday; ``mon-wed#2`` the second Monday, Tuesday and
  Wednesday; ``#5`` fires only in months with five such weekdays.

Combinations follow croniter. When one field's text starts with ``*`` both must match
(Vixie's rule, croniter's ``implement_cron_bug``). Otherwise croniter ORs two sides,
each of which keeps the *other* field's ``W`` or ``#``: (day-of-month AND the ``#``
selector, if any) OR (the ``W`` day, if any, AND day-of-week). So plain days and ``L``
with plain weekdays are Vixie's OR; with ``#`` the nth weekday decides
(``30 23 1-7 JAN MON-FRI#1``: the first Mon-Fri of January; ``0 0 13 * fri#2`` every
second Friday, never another 13th); with ``W`` the ``W`` day decides (``0 0 15W * 1``:
the weekday nearest the 15th, Monday or not); ``W`` with ``#`` needs both. Where a side
can never occur (``0 0 15 * fri#2``: a second Friday is never the 15th) croniter finds
no date at all, so the expression is refused here.
"""
from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Optional, Set, Tuple

from .errors import ScheduleError

__all__ = ["DaySelector", "has_day_extension", "parse_day_fields", "nearest_weekday"]

_LAST_NTH = -1  # "last <weekday> of the month" in DaySelector.nth
_W_TERM = re.compile(r"^(?:(\d+)w|w(\d+))$")
_NTH_TERM = re.compile(r"^([a-z0-9]+(?:-[a-z0-9]+)?)#(\d+)$")
_LAST_DOW = re.compile(r"^l(\d+)$")
_QUARTZ_LAST_DOW = re.compile(r"^([a-z0-9]+)l$")
_L_RANGE_END = re.compile(r"-l(?=$|/)")
_WEEKDAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")

#: Parses a plain (Vixie) field: (expr, field name, text) -> value set.
PlainParser = Callable[[str, str, str], FrozenSet[int]]


def _fail(expr: str, field: str, reason: str) -> ScheduleError:
    return ScheduleError(f"cron {expr!r}: {field} {reason}")


def has_day_extension(field: str, text: str) -> bool:
    """Whether day field *text* uses ``L``, ``W`` or ``#`` (outside month and weekday names)."""
    if not any(ch in text for ch in ("lLwW" if field == "day-of-month" else "lL#")):
        return False  # the common case, at no cost to plain expressions
    low = text.lower()
    for name in _WEEKDAY_NAMES:
        low = low.replace(name, "")
    if field == "day-of-month":
        return "l" in low or "w" in low
    return "l" in low or "#" in low


def nearest_weekday(year: int, month: int, day: int) -> int:
    """croniter's ``W``: the Mon-Fri day nearest *day* (clamped to the month), never leaving the month."""
    last = calendar.monthrange(year, month)[1]
    day = min(day, last)
    weekday = calendar.weekday(year, month, day)  # 0 = Monday
    if weekday < 5:
        return day
    if weekday == 5:  # Saturday: the Friday before, or Monday the 3rd for a Saturday 1st
        return day - 1 if day > 1 else day + 2
    return day + 1 if day < last else day - 2  # Sunday: the Monday after, or Friday for a Sunday last day


@dataclass(frozen=True)
class DaySelector:
    """Which dates an extended expression's two day fields select.

    ``dom``/``dow`` are the plain values (weekdays 0 = Sunday), ``last`` the day-of-month
    ``L``, ``nearest`` the ``W`` day, ``nth`` pairs of (weekday, occurrences) with
    occurrence -1 for ``L<n>``. ``dom_star``/``dow_star`` come from the text, as in Vixie.
    """

    dom: FrozenSet[int]
    last: bool
    nearest: Optional[int]
    dow: FrozenSet[int]
    nth: Tuple[Tuple[int, FrozenSet[int]], ...]
    dom_star: bool
    dow_star: bool

    def matches(self, year: int, month: int, day: int, weekday_sun0: int) -> bool:
        w_day = day == nearest_weekday(year, month, self.nearest) if self.nearest is not None else None
        nth = self._nth_matches(year, month, day, weekday_sun0) if self.nth else None
        dom = w_day if w_day is not None else (
            day in self.dom or (self.last and day == calendar.monthrange(year, month)[1]))
        dow = nth if nth is not None else weekday_sun0 in self.dow
        if self.dom_star or self.dow_star:  # Vixie: a '*' field means AND
            return dom and dow
        # croniter's OR: each side keeps the other field's W / '#' selector
        return (dom and (nth is None or nth)) or ((w_day is None or w_day) and dow)

    def _nth_matches(self, year: int, month: int, day: int, weekday_sun0: int) -> bool:
        for wd, occurrences in self.nth:
            if wd == weekday_sun0:
                if (day - 1) // 7 + 1 in occurrences:
                    return True
                return _LAST_NTH in occurrences and day + 7 > calendar.monthrange(year, month)[1]
        return False

    def sides_occur(self, months: Tuple[int, ...]) -> bool:
        """Whether each side of croniter's OR occurs in some month of *months* (else croniter finds no date).

        Checked over 2001-2028, a full cycle of weekdays and leap years within 1901-2099."""
        if self.dom_star or self.dow_star:  # AND: the selector itself must occur
            sides: Tuple[DaySelector, ...] = (self,)
        elif self.nearest is None and not self.nth:  # Vixie's OR of two plain sides: a weekday always occurs
            return True
        else:
            sides = (DaySelector(self.dom, self.last, self.nearest, frozenset(range(7)), self.nth, False, True),
                     DaySelector(frozenset(range(1, 32)), False, self.nearest, self.dow, self.nth, True, False))
        return all(any(side.matches(y, m, d, (calendar.weekday(y, m, d) + 1) % 7)
                       for y in range(2001, 2029) for m in months
                       for d in range(1, calendar.monthrange(y, m)[1] + 1)) for side in sides)


def _croniter_expand(expr: str, field: str, text: str, probe: str):
    """croniter's reading of one day field (in *probe*, an expression around it), or a ScheduleError."""
    try:
        from croniter import croniter
    except ImportError as exc:  # pragma: no cover - croniter is an install requirement
        raise _fail(expr, field, f"{text!r} needs croniter (pip install 'croniter>=6.2')") from exc
    try:
        expanded, nth = croniter.expand(probe)
    except Exception as exc:  # croniter's own words: CroniterBadCronError, NotAlpha, Unsupported...
        reason = str(exc).replace(f"[{probe}]", "").replace(probe, "").strip(" .:")
        raise _fail(expr, field, f"{text!r} is not accepted: {reason or type(exc).__name__}") from None
    return expanded, nth


def _dom_selector_parts(expr: str, text: str, plain: PlainParser) -> Tuple[FrozenSet[int], bool, Optional[int]]:
    low = text.lower()
    terms = low.split(",")
    last = False
    nearest: Optional[int] = None
    plain_terms = []
    for term in terms:
        if term == "l":
            last = True
        elif term in ("lw", "wl"):
            raise _fail(expr, "day-of-month", f"{text!r}: 'LW' (last weekday of the month) is not supported "
                                              "(croniter does not accept it)")
        elif re.fullmatch(r"l-\d+", term):
            raise _fail(expr, "day-of-month", f"{text!r}: {term.upper()!r} (Quartz's days before the last) is not "
                                              "supported (croniter does not accept it)")
        elif _W_TERM.match(term):
            m = _W_TERM.match(term)
            day = int(m.group(1) or m.group(2))
            if not 1 <= day <= 31:
                raise _fail(expr, "day-of-month", f"{text!r}: nearest-weekday day {day} is out of range 1-31")
            if len(terms) > 1:
                raise _fail(expr, "day-of-month", f"{text!r}: 'W' (nearest weekday) takes a single day, "
                                                  "not a list (as in croniter)")
            nearest = day
        elif "w" in term or ("l" in term and not _L_RANGE_END.search(term)):
            raise _fail(expr, "day-of-month", f"{text!r}: {term!r} is not supported; 'L' is the last day "
                                              "(also as a range end, '15-L'), 'W' follows one day ('15W')")
        else:
            plain_terms.append(_L_RANGE_END.sub("-31", term))
    days = plain(expr, "day-of-month", ",".join(plain_terms)) if plain_terms else frozenset()
    return days, last, nearest


def _dow_nth(expr: str, text: str, plain: PlainParser) -> Tuple[Tuple[int, FrozenSet[int]], ...]:
    """The (weekday, occurrences) pairs of a day-of-week field of ``n#k`` / ``Ln`` terms.

    Read by our own parser (each term's weekday part is a plain day-of-week value or range)
    and only *checked* against croniter's reading: the instants never depend on which
    croniter release a replica has installed; a release reading a term otherwise refuses it.
    """
    low = text.lower()
    ours: Dict[int, Set[int]] = {}
    for term in low.split(","):
        m = _QUARTZ_LAST_DOW.match(term)
        if m:
            raise _fail(expr, "day-of-week", f"{text!r}: {term.upper()!r} (Quartz's last weekday) is not supported; "
                                             f"croniter writes the last one of the month as 'L{m.group(1)}'")
        if term == "l":
            raise _fail(expr, "day-of-week", f"{text!r}: 'L' alone is not supported in day-of-week; "
                                             "'L5' is the last Friday of the month")
        m = _NTH_TERM.match(term)
        if m and not 1 <= int(m.group(2)) <= 5:
            raise _fail(expr, "day-of-week", f"{text!r}: nth weekday {m.group(2)} in {term!r} is out of range 1-5")
        last = _LAST_DOW.match(term)
        if not (m or last):
            raise _fail(expr, "day-of-week", f"{text!r}: {term!r} cannot be listed with '#' or 'L<n>' terms "
                                             "(as in croniter: write each weekday as 'n#k' or 'Ln')")
        weekdays, occurrence = (plain(expr, "day-of-week", m.group(1)), int(m.group(2))) if m else (
            plain(expr, "day-of-week", last.group(1)), _LAST_NTH)
        for weekday in weekdays:
            ours.setdefault(weekday, set()).add(occurrence)
    expanded, nth = _croniter_expand(expr, "day-of-week", text, f"0 0 * * {text}")
    try:
        theirs = {weekday: {_LAST_NTH if n == "l" else int(n) for n in occurrences}
                  for weekday, occurrences in nth.items()}
    except (TypeError, ValueError):  # pragma: no cover - croniter's contract
        theirs = None
    if theirs != ours or set(expanded[4]) - set(ours):
        raise _fail(expr, "day-of-week", f"{text!r} is not accepted: croniter reads it otherwise "
                                         f"({nth!r}); write each weekday as 'n#k' or 'Ln'")
    return tuple((weekday, frozenset(ours[weekday])) for weekday in sorted(ours))


def parse_day_fields(expr: str, dom_text: str, dow_text: str, months: Tuple[int, ...],
                     plain: PlainParser) -> DaySelector:
    """The selector of day fields of which at least one uses ``L``, ``W`` or ``#``."""
    dom_ext = has_day_extension("day-of-month", dom_text)
    dow_ext = has_day_extension("day-of-week", dow_text)
    if dom_ext:
        days, last, nearest = _dom_selector_parts(expr, dom_text, plain)
        expanded, _ = _croniter_expand(expr, "day-of-month", dom_text, f"0 0 {dom_text} * *")
        theirs = expanded[2]
        ints = set(range(1, 32)) if theirs == ["*"] else {v for v in theirs if isinstance(v, int)}
        ours = set(days) | ({nearest} if nearest is not None else set())
        if ints != ours or ("l" in theirs) != last:
            raise _fail(expr, "day-of-month", f"{dom_text!r} means {sorted(ints)} to croniter but "
                                              f"{sorted(ours)} here; write it without '1-1'-style ranges")
    else:
        days, last, nearest = plain(expr, "day-of-month", dom_text), False, None
    nth: Tuple[Tuple[int, FrozenSet[int]], ...] = ()
    if dow_ext:
        nth = _dow_nth(expr, dow_text, plain)
        weekdays: FrozenSet[int] = frozenset()
    else:
        weekdays = plain(expr, "day-of-week", dow_text)
    selector = DaySelector(dom=days, last=last, nearest=nearest, dow=weekdays, nth=nth,
                           dom_star=dom_text.startswith("*"), dow_star=dow_text.startswith("*"))
    if not selector.sides_occur(months):
        raise _fail(expr, "day-of-month", f"{dom_text!r} never falls on day-of-week {dow_text!r}"
                                          f"{'' if len(months) == 12 else ' in the months given'} (croniter "
                                          "finds no date for it)")
    return selector
