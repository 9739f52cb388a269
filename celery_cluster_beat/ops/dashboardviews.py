"""The dashboard's views: which page a URL asks for, as the key the server caches it under.

Apart from the server (:mod:`.http`) so its bounds stay readable: a view is the dashboard's
(limit, filter, state, sort) or one schedule's page; every parameter is checked here
(:func:`.schedulepage.page_params`, :func:`.schedulepage.view_params`), so a view that reaches the
cache is one the page can build, and a bad URL is a 400 before anything is read.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple
from urllib.parse import parse_qs, unquote

__all__ = ["View", "DEFAULT_VIEW", "SCHEDULE_PREFIX", "page_view", "schedule_view"]

#: A schedule's page is this prefix and its name, URL-quoted; its actions add ``/run``, ``/pause``, ``/resume``.
SCHEDULE_PREFIX = "/schedules/"


class View(NamedTuple):
    """One cached page: the dashboard's (limit, filter, state, sort), or one schedule's page."""

    limit: int
    query: Optional[str] = None
    state: Optional[str] = None
    sort: Optional[str] = None
    schedule: Optional[str] = None  #: the schedule page of this name


#: The page's view when the URL asks for nothing.
DEFAULT_VIEW = View(100, None)


def page_view(query: str) -> View:
    """The dashboard's view from the URL's query string: ``limit`` (capped), ``q`` (see
    :func:`.schedulepage.page_params`), ``state`` and ``sort`` (:func:`.schedulepage.view_params`);
    other parameters are ignored. ValueError when bad."""
    if not query:
        return DEFAULT_VIEW
    from .schedulepage import page_params, view_params

    try:
        fields = parse_qs(query, keep_blank_values=True, max_num_fields=16)
    except ValueError:
        raise ValueError("too many parameters") from None
    last = lambda key: (fields.get(key) or [None])[-1]  # noqa: E731
    limit, q = page_params(last("limit"), last("q"))
    state, order = view_params(last("state"), last("sort"))
    return View(limit, q, state.value if state else None, order.value if order.value != "attention" else None)


def schedule_view(path: str) -> Tuple[Optional[str], Optional[str]]:
    """(schedule name, action verb or None) of a path under :data:`SCHEDULE_PREFIX`; (None, None)
    for any other path. The name is the URL-quoted rest (a ``/`` in a name is ``%2F``)."""
    if not path.startswith(SCHEDULE_PREFIX):
        return None, None
    rest = path[len(SCHEDULE_PREFIX):]
    quoted, _, verb = rest.partition("/")
    name = unquote(quoted, errors="strict") if quoted else ""
    return (name or None), (verb or None)
