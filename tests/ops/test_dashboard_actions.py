"""The dashboard's actions (run now, pause with a note, resume): off by default, and when on, only a
same-origin POST carrying the actions token changes anything.

In process (beat's own server, :func:`start_beat_server`) on a temp SQLite claim store with real
history (:mod:`dashdata`); every check reads the store afterwards:

* without ``cluster_beat_http_actions_token`` the pages have no POST form and a POST is ``405``;
* with it: a GET of an action's path is ``405`` and changes nothing; a POST without the token, with
  a wrong one, or from another origin (``Origin``, or ``Referer`` without one) is ``403`` and changes
  nothing; with the token and a same-origin ``Origin``, pause records who and why (the note), resume
  clears it, run-now records the request; each action is logged at INFO with the operator's name
  quoted (a name with a line break is refused, ``400``);
* a bad or equal-to-the-page token setting is refused, naming the setting, never printing it.
"""
from __future__ import annotations

import http.client
import logging
from typing import Dict, Optional, Tuple
from urllib.parse import quote, urlencode

import pytest
from celery import Celery

from celery_cluster_beat.config import load_settings
from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.ops.http import start_beat_server
from celery_cluster_beat.store import ClaimStore
from dashdata import ACTIONS_TOKEN, LONG, fill, make_app

NAME = LONG


def _serve(tmp_path, **conf):
    url = f"sqlite:///{tmp_path}/claims.sqlite3"
    fill(url)
    app = make_app(url, **conf)
    return start_beat_server(app, load_settings(app.conf, has_result_backend=lambda: False), sender=object()), url


def _request(port: int, method: str, path: str, body: Optional[Dict[str, str]] = None,
             headers: Optional[Dict[str, str]] = None) -> Tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        data = urlencode(body).encode() if body is not None else None
        extra = {"Content-Type": "application/x-www-form-urlencoded"} if data is not None else {}
        conn.request(method, path, body=data, headers={**extra, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _control(url: str):
    store = ClaimStore(url, node_id="check", read_only=True, prepare=False)
    store.open()
    try:
        rows = store.controls([NAME])
    finally:
        store.close()
    return rows[0] if rows else None


@pytest.mark.timeout(120)
def test_actions_are_off_by_default_no_forms_and_every_post_is_405(tmp_path):
    ops, url = _serve(tmp_path)
    try:
        port = ops.server.port
        status, body = _request(port, "GET", "/schedules/" + quote(NAME, safe=""))
        assert status == 200 and 'method="post"' not in body and "read-only" in body
        for verb in ("pause", "run", "resume"):
            status, _ = _request(port, "POST", f"/schedules/{quote(NAME, safe='')}/{verb}",
                                 {"token": ACTIONS_TOKEN, "by": "mallory"})
            assert status == 405
        assert _request(port, "POST", "/", {"x": "1"})[0] == 405
        assert _control(url) is None  # nothing was written
    finally:
        ops.stop()


@pytest.mark.timeout(120)
def test_only_a_same_origin_post_with_the_token_acts_and_each_action_is_logged(tmp_path, caplog):
    ops, url = _serve(tmp_path, cluster_beat_http_actions_token=ACTIONS_TOKEN)
    caplog.set_level(logging.INFO, logger="celery_cluster_beat")
    try:
        port = ops.server.port
        host = f"127.0.0.1:{port}"
        same = {"Origin": f"http://{host}"}
        path = f"/schedules/{quote(NAME, safe='')}"
        status, body = _request(port, "GET", path)
        assert status == 200 and body.count('method="post"') == 2  # run now, pause

        # nothing changes on a GET, without the token, with a wrong one, or from another origin
        assert _request(port, "GET", path + "/pause")[0] == 405
        assert _request(port, "HEAD", path + "/pause")[0] == 405
        assert _request(port, "POST", path + "/pause", {"by": "alice", "note": "x"}, same)[0] == 403
        assert _request(port, "POST", path + "/pause", {"by": "alice", "token": ACTIONS_TOKEN[:-1] + "x"}, same)[0] == 403
        assert _request(port, "POST", path + "/pause", {"by": "alice", "token": ACTIONS_TOKEN},
                        {"Origin": "http://evil.example"})[0] == 403
        assert _request(port, "POST", path + "/pause", {"by": "alice", "token": ACTIONS_TOKEN},
                        {"Referer": "http://evil.example/page"})[0] == 403
        assert _request(port, "POST", path + "/pause", {"by": "alice", "token": ACTIONS_TOKEN},
                        {"Origin": "null"})[0] == 403
        assert _request(port, "POST", path + "/pause", {"by": "al\nice", "token": ACTIONS_TOKEN}, same)[0] == 400
        assert _control(url) is None

        # pause with a note, by the form's operator
        status, body = _request(port, "POST", path + "/pause",
                                {"by": "alice <ops>", "note": "deploy <b>v2</b> first", "token": ACTIONS_TOKEN}, same)
        assert status == 200 and "paused" in body and "<b>v2</b>" not in body, body
        control = _control(url)
        assert control.paused and control.paused_by == "alice <ops> via dashboard"
        assert control.paused_note == "deploy <b>v2</b> first"
        logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "pause of schedule" in r.getMessage()]
        assert logged and "'alice <ops>'" in logged[0] and "'deploy <b>v2</b> first'" in logged[0], logged

        # the token may come as a header (a script); resume clears the pause
        status, _ = _request(port, "POST", path + "/resume", {"by": "bob"},
                             {"X-Cluster-Beat-Actions-Token": ACTIONS_TOKEN})
        assert status == 200 and not _control(url).paused

        # run now records the request, for the leader to send
        status, body = _request(port, "POST", path + "/run", {"by": "carol", "token": ACTIONS_TOKEN}, same)
        assert status == 200 and "requested" in body, body
        control = _control(url)
        assert control.run_request and control.run_requested_by == "carol via dashboard"

        # an unknown schedule is a 404, an unknown verb too; nothing is created for them
        assert _request(port, "POST", "/schedules/nope/pause", {"by": "a", "token": ACTIONS_TOKEN}, same)[0] == 404
        assert _request(port, "POST", path + "/delete", {"by": "a", "token": ACTIONS_TOKEN}, same)[0] == 404
        assert not [r for r in caplog.records if r.exc_info]
    finally:
        ops.stop()


@pytest.mark.parametrize("value", ["short", 12345678901234567890, "with spaces in the token value",
                                   "same-as-the-page-token-0123456789"])
def test_a_bad_actions_token_setting_is_refused_naming_it_and_never_printing_it(value):
    app = Celery("actions-settings", broker="memory://")
    app.conf.update(cluster_beat_http_actions_token=value, cluster_beat_http_token="same-as-the-page-token-0123456789")
    with pytest.raises(ConfigError) as err:
        load_settings(app.conf, has_result_backend=lambda: False)
    assert "setting cluster_beat_http_actions_token:" in str(err.value)
    assert str(value) not in str(err.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("actions", [False, True], ids=["read-only", "actions-on"])
def test_a_schedule_path_that_is_not_utf8_is_a_400_never_a_500_with_a_traceback(tmp_path, caplog, actions):
    """``%FF`` unquotes to no UTF-8: the page's route says 400; the dispatcher before it must not
    raise (a 500 and an ERROR traceback in beat's log, for anyone who can reach the port)."""
    ops, url = _serve(tmp_path, **({"cluster_beat_http_actions_token": ACTIONS_TOKEN} if actions else {}))
    caplog.set_level(logging.DEBUG, logger="celery_cluster_beat")
    try:
        port = ops.server.port
        assert _request(port, "GET", "/schedules/%FF")[0] == 400
        assert _request(port, "HEAD", "/schedules/ok%FF")[0] == 400
        status, _ = _request(port, "POST", "/schedules/%FF/pause", {"by": "a", "token": ACTIONS_TOKEN},
                             {"Origin": f"http://127.0.0.1:{port}"})
        assert status == 405  # no schedule is named by it: nothing to act on
        assert _control(url) is None
    finally:
        ops.stop()
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [(r.levelname, r.getMessage()) for r in bad]


@pytest.mark.timeout(120)
def test_a_new_note_on_a_paused_schedule_is_said_to_have_replaced_the_old_one(tmp_path):
    """The dashboard's actions take the command line's path (report.act_on_schedule): pausing a
    paused schedule with a note replaces its note, and the answer says so (not "paused already")."""
    ops, url = _serve(tmp_path, cluster_beat_http_actions_token=ACTIONS_TOKEN)
    try:
        port = ops.server.port
        same = {"Origin": f"http://127.0.0.1:{port}"}
        path = f"/schedules/{quote(NAME, safe='')}/pause"
        assert _request(port, "POST", path, {"by": "alice", "note": "first", "token": ACTIONS_TOKEN}, same)[0] == 200
        status, body = _request(port, "POST", path, {"by": "bob", "note": "second", "token": ACTIONS_TOKEN}, same)
        assert status == 200 and "its note is now: second" in body, body
        assert _control(url).paused_note == "second"
        status, body = _request(port, "POST", path, {"by": "bob", "token": ACTIONS_TOKEN}, same)
        assert status == 200 and "was paused already" in body and _control(url).paused_note == "second"
    finally:
        ops.stop()


def test_an_action_on_a_name_no_page_can_have_never_reaches_the_store():
    """A name with a line break or a separator (``%0A``, ``%E2%80%A8`` in the path) has no page; its
    action is a 404 before the token is even looked at, so the INFO line of an action stays one line."""
    from celery_cluster_beat.ops.dashboardactions import Actions

    done = []
    actions = Actions(object(), object(), ACTIONS_TOKEN, act=lambda *a: done.append(a) or "done")
    body = urlencode({"by": "alice", "token": ACTIONS_TOKEN}).encode()
    headers = {"content-type": "application/x-www-form-urlencoded"}
    assert actions.handle("pause", "ok", headers, body)[0] == 200 and len(done) == 1  # the hook acts
    for name in ("a\nb", "a\u2028INFO forged", "tab\there"):
        assert actions.handle("pause", name, headers, body)[0] == 404
    assert len(done) == 1


def test_refused_actions_cannot_flood_the_log(caplog, monkeypatch):
    """Anyone who reaches the port can post a wrong token or come from another origin: one WARNING
    per period, the rest DEBUG lines counted in the next WARNING."""
    from celery_cluster_beat.ops import dashboardactions
    from celery_cluster_beat.ops.dashboardactions import Actions

    caplog.set_level(logging.DEBUG, logger="celery_cluster_beat")
    actions = Actions(object(), object(), ACTIONS_TOKEN, act=lambda *a: pytest.fail("acted"))
    headers = {"content-type": "application/x-www-form-urlencoded"}
    wrong = urlencode({"by": "mallory", "token": "x" * 32}).encode()
    for _ in range(25):
        assert actions.handle("pause", "ok", headers, wrong)[0] == 403
    for _ in range(5):
        assert actions.handle("run", "ok", {**headers, "origin": "http://evil.example", "host": "h:1"}, wrong)[0] == 403
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "wrong actions token" in warnings[0], warnings
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG and "refused" in r.getMessage()]) == 29

    monkeypatch.setattr(dashboardactions, "REFUSED_LOG_EVERY", 0.0)  # the period is over
    assert actions.handle("pause", "ok", headers, wrong)[0] == 403
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "(29 more refused since the last such warning)" in warnings[1], warnings
