"""The dashboard's actions: run now, pause (with who and why) and resume, from a schedule's page.

Off unless ``cluster_beat_http_actions_token`` is set: without it the dashboard has no forms and
answers every POST ``405``, as the read-only page always did. With it, each schedule's page has
three small forms, and an action is carried out only when all of these hold:

* **POST** to ``/schedules/<name>/run|pause|resume``; a GET or HEAD of those paths is ``405``
  (nothing ever changes on a GET: a prefetch, a crawler or a link in a chat cannot act);
* **the actions token itself is in the request**, typed by the operator into the form (field
  ``token``) or sent by a script as the ``X-Cluster-Beat-Actions-Token`` header, compared in
  constant time. *Why the token itself, not a form token derived from it:* the page is shared
  (cached for everyone, readable by anyone who may see it, with or without
  ``cluster_beat_http_token``), so anything embedded in it, an HMAC of the token included, would
  let every reader act. There is no login and no session cookie here, so the classic CSRF attack
  (a foreign page making the operator's browser post with its ambient credentials) has no
  credential to ride on: a forged request lacks the token and is refused ``403``;
* **same origin**: a request whose ``Origin`` (or, without one, ``Referer``) names another host
  is refused ``403`` before the token is even looked at (defence in depth: a browser always sends
  ``Origin`` with a form's POST; a script sends neither and needs the token anyway);
* a bounded form: ``application/x-www-form-urlencoded``, at most :data:`MAX_FORM` bytes (the
  server reads no more than its small-body limit in any case), ``by`` (who, required) and ``note``
  (why, for a pause) as printable text.

Every action is logged at INFO with the operator's name and note as given (``%r``: quoted, so a
name with line breaks or escape sequences cannot forge log lines), the peer's address is not
known here and not claimed. A refused one is a WARNING at most every :data:`REFUSED_LOG_EVERY`
seconds (the others DEBUG lines, counted in the next WARNING). The action itself is the command
line's (``pause``, ``resume``, ``run-now``, :func:`.report.act_on_schedule`): the same store calls
on a store opened for writing for the one action and closed after it, on the HTTP server's pool
thread (never the scheduling loop's), then a change notice to the leader through Redis when there
is a lease, so it applies within a second.
"""
from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

from ..leader.urls import mask_url

logger = logging.getLogger("celery_cluster_beat")

__all__ = ["Actions", "ActionResult", "VERBS", "MAX_FORM", "TOKEN_HEADER"]

#: The actions, by the last part of their path.
VERBS = ("run", "pause", "resume")
#: Largest form accepted (bytes): a name, a note of 500 characters, a token.
MAX_FORM = 4096
#: The header a script may send the token in instead of the form field.
TOKEN_HEADER = "x-cluster-beat-actions-token"
#: Longest operator name kept.
MAX_BY = 100
#: A refused action is a WARNING line at most this often (seconds); those in between are DEBUG lines,
#: counted in the next WARNING: whoever reaches the port cannot flood beat's log (and the loop's handler).
REFUSED_LOG_EVERY = 10.0

#: (status, text for the operator, tone)
ActionResult = Tuple[int, str, str]


def _same_origin(headers: Dict[str, str]) -> bool:
    """Whether the request's ``Origin`` (else ``Referer``) names the host it was sent to; True when
    it has neither (not a browser's form: the token decides)."""
    host = headers.get("host", "").strip().lower()
    origin = headers.get("origin", "").strip()
    source = origin if origin and origin != "null" else headers.get("referer", "").strip()
    if origin == "null":  # a sandboxed frame, a data: URL: never the dashboard's own page
        return False
    if not source:
        return True
    try:
        parts = urlsplit(source)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(host) and parts.netloc.lower() == host


def _printable(text: str, limit: int) -> Optional[str]:
    text = text.strip()
    if not text or len(text) > limit or not text.isprintable():
        return None
    return text


class Actions:
    """Carries out the dashboard's actions for *app* (see the module docstring).

    *act* (tests) replaces how an action reaches the store: ``act(verb, name, by, note)``; by default
    a store is opened for writing for each action (:func:`.report.open_store`)."""

    def __init__(self, app: Any, settings: Any, token: str,
                 act: Optional[Callable[[str, str, str, Optional[str]], str]] = None) -> None:
        if not token:
            raise ValueError("the actions need a token")
        self.app, self.settings = app, settings
        self._token = token.encode()
        self._act = act or self._store_act
        self._refused_lock = threading.Lock()
        self._refused_at = float("-inf")
        self._refused_quiet = 0

    def _refused(self, fmt: str, *args: Any) -> None:
        """Log a refusal: a WARNING at most every :data:`REFUSED_LOG_EVERY` seconds, else DEBUG."""
        now = time.monotonic()
        with self._refused_lock:
            loud = now - self._refused_at >= REFUSED_LOG_EVERY
            if loud:
                quiet, self._refused_quiet, self._refused_at = self._refused_quiet, 0, now
            else:
                self._refused_quiet += 1
        if not loud:
            logger.debug(fmt, *args)
            return
        more = f" ({quiet} more refused since the last such warning)" if quiet else ""
        logger.warning(fmt + "%s", *args, more)

    def handle(self, verb: str, name: str, headers: Dict[str, str], body: bytes) -> ActionResult:
        """(status, text, tone) of POST *verb* for schedule *name*."""
        if verb not in VERBS:
            return 404, f"no such action: {verb[:40]!r} (run, pause or resume)", "bad"
        if not name.isprintable():  # as its page (a 404 too): and what the INFO line says stays one line
            return 404, "no schedule page has this name", "bad"
        if not _same_origin(headers):
            self._refused("cluster-beat http: refused a cross-origin %s of %r (Origin %r)", verb, name[:255],
                          headers.get("origin", headers.get("referer", ""))[:200])
            return 403, "refused: the request comes from another site", "bad"
        if len(body) > MAX_FORM:
            return 413, f"the form is larger than {MAX_FORM} bytes", "bad"
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if body and ctype != "application/x-www-form-urlencoded":
            return 415, "expected a form (application/x-www-form-urlencoded)", "bad"
        try:
            form = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=8, strict_parsing=False)
        except (UnicodeDecodeError, ValueError):
            return 400, "the form could not be read", "bad"
        given = headers.get(TOKEN_HEADER) or (form.get("token") or [""])[-1]
        if not given or not hmac.compare_digest(given.encode("utf-8", "replace"), self._token):
            self._refused("cluster-beat http: refused %s of %r: %s actions token", verb, name[:255],
                          "wrong" if given else "no")
            return 403, "refused: the actions token is missing or wrong", "bad"
        by = _printable((form.get("by") or [""])[-1], MAX_BY)
        if by is None:
            return 400, f"say who you are (1 to {MAX_BY} printable characters)", "bad"
        note: Optional[str] = None
        if verb == "pause":
            raw = (form.get("note") or [""])[-1].strip()
            if raw:
                note = _printable(raw, 500)
                if note is None:
                    return 400, "the note must be at most 500 printable characters", "bad"
        try:
            text = self._act(verb, name, by, note)
        except Exception as exc:
            from .report import NoSuchSchedule

            if isinstance(exc, NoSuchSchedule):
                return 404, str(exc), "bad"
            if isinstance(exc, ValueError):
                return 400, f"refused: {exc}", "bad"
            logger.warning("cluster-beat http: %s of %r by %r failed: %s", verb, name[:255], by,
                           mask_url(repr(exc)))
            return 503, f"the action failed: {type(exc).__name__}: {mask_url(exc)}"[:500], "bad"
        logger.info("cluster-beat http: %s of schedule %r by %r%s: %s", verb, name[:255], by,
                    f" (note {note!r})" if note else "", text)
        return 200, text, ""

    def _store_act(self, verb: str, name: str, by: str, note: Optional[str]) -> str:
        """The command line's action (``cluster-beat pause/resume/run-now``), by the same code
        (:func:`.report.act_on_schedule`): a store opened for it, then a notice to the leader."""
        from . import report

        by_text = f"{by} via dashboard"
        if verb == "run":
            (_, _, _, joined), _ = report.act_on_schedule(
                self.app, self.settings, name, lambda store: store.request_run(name, by=by_text), quiet_notice=True)
            return (f"a run of {name} is pending already: joined it, one run" if joined else
                    f"run of {name} requested; the leader sends it within a second or two")
        paused = verb == "pause"
        (_, changed), source = report.act_on_schedule(
            self.app, self.settings, name,
            lambda store: store.set_paused(name, paused, by=by_text, note=note if paused else None),
            paused_ok=not paused, quiet_notice=True)
        if changed:
            return f"{'paused' if paused else 'resumed'} {name} ({source}); the leader applies it within a second"
        if paused and note is not None:
            return f"{name} was paused already; its note is now: {note}"
        return f"{name} was {'paused' if paused else 'not paused'} already"
