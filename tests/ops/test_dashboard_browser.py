"""The dashboard in a real headless Chromium, at a laptop's width (1280 px) and a phone's (390 px).

Served in process by beat's own server (:func:`start_beat_server`) from a temp SQLite claim store
holding real history (:mod:`dashdata`: runs through the worker's ledger, one schedule's latest run
failed, another's running). Chromium is driven over the DevTools protocol (:mod:`headless`), which
sets the viewport exactly and reads the laid-out page without a script of ours on it (the page's
Content-Security-Policy forbids scripts). For the main page, a schedule's page and the nodes panel:

* no horizontal overflow at either width (the document is no wider than the viewport, and no
  element sticks out on the right);
* the health line is there and says what is wrong (a failed run in the last hour);
* the failed run is on the main table (a red ``failed`` badge and its error) and on the schedule's
  page (its row, the error, the chart), the running one says ``running``;
* the hostile description and name are text, not markup: the page has no script element at all;
* the actions' forms work from the browser: pausing with a note through the form (a real same-origin
  POST, allowed by ``form-action 'self'``) pauses the schedule in the store, with the note.

Screenshots are kept under ``test-artefacts/`` (their paths are printed).
"""
from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import quote

import pytest

from celery_cluster_beat.config import load_settings
from celery_cluster_beat.ops import http as ops_http
from celery_cluster_beat.ops.http import start_beat_server
from celery_cluster_beat.store import ClaimStore
from dashdata import ACTIONS_TOKEN, ARTEFACTS, ERROR, FAILING, HOSTILE, LONG, RUNNING, fill, make_app
from headless import Browser

WIDTHS = ((1280, 900), (390, 844))


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.setattr(ops_http, "PAGE_CACHE", 0.05)  # the test loads several views in a row
    url = f"sqlite:///{tmp_path}/claims.sqlite3"
    fill(url)
    app = make_app(url, cluster_beat_http_actions_token=ACTIONS_TOKEN)
    ops = start_beat_server(app, load_settings(app.conf, has_result_backend=lambda: False), sender=object())
    ops.health.ticked(1.0)
    try:
        yield ops.server.url.rstrip("/"), url
    finally:
        ops.stop()


@pytest.fixture
def browser(tmp_path):
    b = Browser(tmp_path / "chromium")
    yield b
    b.close()


def _text(browser: Browser) -> str:
    """The page's text; "" while a navigation replaces the document (no body yet, or its context gone)."""
    try:
        return browser.evaluate("(document.body && document.body.innerText) || ''") or ""
    except RuntimeError:
        return ""


def _load(browser: Browser, url: str, width: int, height: int) -> None:
    """Load *url*; asked again while the server says it is busy building another view (503)."""
    deadline = time.monotonic() + 30
    while True:
        browser.open(url, width, height, mobile=width < 500)
        if "busy:" not in _text(browser)[:40] or time.monotonic() > deadline:
            return
        time.sleep(0.3)


def _check_layout(browser: Browser, label: str, width: int, shots: list) -> None:
    facts = browser.overflow()
    assert facts["clientWidth"] == width, facts
    assert facts["scrollWidth"] <= facts["clientWidth"] and not facts["wide"], (label, width, facts)
    assert browser.evaluate("document.querySelectorAll('script').length") == 0  # nothing from the data runs
    shots.append(browser.screenshot(ARTEFACTS / f"dashboard-{label}-{width}.png"))


@pytest.mark.timeout(240)
def test_the_dashboard_in_a_real_browser_at_laptop_and_phone_widths(served, browser, capsys):
    base, _ = served
    shots: list = []
    for width, height in WIDTHS:
        # -- the main page: health line first, then the schedules
        _load(browser, base + "/", width, height)
        health = browser.evaluate("document.getElementById('health').textContent")
        for word in ("Leader", "beat-a@host-1:4242", "Lease", "Nodes", "2 of 2 up", "Late", "Failed 1 h", "Loop"):
            assert word in health, (word, health)
        failed_chip = browser.evaluate("[...document.querySelectorAll('#health .chip.bad')].map(c => c.innerText)")
        assert any("FAILED 1 H" in c.upper() and "2" in c for c in failed_chip), failed_chip
        row = browser.evaluate(f"[...document.querySelectorAll('#schedules tbody tr')]"
                               f".find(r => r.querySelector('a.name').textContent === {FAILING!r}).innerText")
        assert "failed" in row and "ConnectionError: database refused the connection <b>x</b>" in row, row
        first = browser.evaluate("document.querySelector('#schedules tbody tr a.name').textContent")
        assert first == FAILING, first  # failing first
        names = browser.evaluate("[...document.querySelectorAll('#schedules a.name')].map(a => a.textContent)")
        assert set(names) == {FAILING, RUNNING, LONG, HOSTILE, "tick"}, names
        running = browser.evaluate(f"[...document.querySelectorAll('#schedules tbody tr')]"
                                   f".find(r => r.querySelector('a.name').textContent === {RUNNING!r}).innerText")
        assert "running" in running, running
        text = _text(browser)
        assert "<script>alert(1)</script>" in text and "<img src=x onerror=alert(1)>" in text  # shown as text
        assert browser.evaluate("document.querySelectorAll('img').length") == 0
        nodes = browser.evaluate("document.getElementById('nodes').innerText")
        assert "beat-a@host-1:4242" in nodes and "beat-b@host-2:4343" in nodes and "leader" in nodes, nodes
        _check_layout(browser, "main", width, shots)

        # -- the nodes panel (on the main page, linked from the health line)
        _load(browser, base + "/#nodes", width, height)
        _check_layout(browser, "nodes", width, shots)

        # -- a filter in the URL: failing ones only, by name
        _load(browser, base + "/?state=failing&sort=name", width, height)
        names = browser.evaluate("[...document.querySelectorAll('#schedules a.name')].map(a => a.textContent)")
        assert names == [FAILING], names

        # -- the failing schedule's page: its runs, the failed one with its error, a chart, next fires
        _load(browser, base + "/schedules/" + quote(FAILING, safe=""), width, height)
        runs = browser.evaluate("document.getElementById('runs').innerText")
        assert "failed" in runs and "ConnectionError: database refused the connection" in runs, runs
        assert "succeeded" in runs and "worker-1@host-3:77" in (runs if width > 500 else runs + browser.dom())
        assert browser.evaluate("document.querySelectorAll('#runs tbody tr').length") == 12
        assert browser.evaluate("document.querySelectorAll('svg.chart rect').length") >= 24  # runtime + lateness bars
        assert browser.evaluate("document.querySelectorAll('#upcoming li').length") == 10
        assert browser.evaluate("document.getElementById('last-error').textContent") == ERROR
        assert browser.evaluate("document.querySelectorAll('#actions form[method=post]').length") == 2
        _check_layout(browser, "schedule", width, shots)

        # -- the long name's page wraps it
        _load(browser, base + "/schedules/" + quote(LONG, safe=""), width, height)
        _check_layout(browser, "schedule-long-name", width, shots)
    with capsys.disabled():
        print("\ndashboard screenshots:\n" + "\n".join(f"  {p}" for p in shots))


@pytest.mark.timeout(180)
def test_pausing_from_the_browser_with_a_note_pauses_the_schedule_in_the_store(served, browser):
    base, url = served
    page = base + "/schedules/" + quote(LONG, safe="")
    _load(browser, page, 1280, 900)
    assert "Pause" in browser.evaluate("document.getElementById('actions').innerText")
    browser.evaluate(f"""(() => {{
        const f = document.querySelector('form[action$="/pause"]');
        f.querySelector('[name=by]').value = 'alice';
        f.querySelector('[name=note]').value = 'deploy <b>v2</b> first';
        f.querySelector('[name=token]').value = {ACTIONS_TOKEN!r};
        f.submit();
    }})()""")
    deadline = time.monotonic() + 30
    while "paused" not in _text(browser):
        assert time.monotonic() < deadline, _text(browser)
        time.sleep(0.1)
    store = ClaimStore(url, node_id="check", read_only=True, prepare=False)
    store.open()
    try:
        control = store.controls([LONG])[0]
    finally:
        store.close()
    assert control.paused and control.paused_by == "alice via dashboard"
    if hasattr(control, "paused_note"):
        assert control.paused_note == "deploy <b>v2</b> first"
    # the message page goes back to the schedule's page, which now says who paused it and why
    deadline = time.monotonic() + 30
    while "Resume" not in _text(browser):
        assert time.monotonic() < deadline, _text(browser)
        time.sleep(0.2)
        if "busy:" in _text(browser)[:40]:
            _load(browser, page, 1280, 900)
    about = browser.evaluate("document.getElementById('about').innerText")
    assert "alice via dashboard" in about, about
    if hasattr(control, "paused_note"):
        assert browser.evaluate("document.getElementById('paused-note').textContent") == "deploy <b>v2</b> first"
    _check_layout(browser, "schedule-paused", 1280, [])
