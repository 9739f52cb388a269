"""How the suite is spread over pytest-xdist workers (``-n 10 --dist loadgroup`` in setup.cfg).

Most of the suite's time is real processes waiting on real time (claim grace,
lease ttl, grid boundaries), not CPU: ten workers on two cores finish it in a
fraction of the serial time. What this module adds to xdist:

* **Longest first.** Each worker sorts the collection by the expected duration of
  its tests, longest first, so the slow process tests start at once, one per
  worker, and the many short tests fill the gaps at the end (xdist hands out one
  unit at a time with ``loadgroup``). Expected durations come from the last run on
  this checkout (pytest's cache, ``ccb/durations``) over the committed hints in
  ``tests/durations.json`` (tests of 2 s or more; refresh it from the cache with
  ``python tests/parallel.py``). A test without a figure counts as short. The
  controller reads them once and hands the same table to every worker, so all
  workers collect the same order even while another suite rewrites the cache.
* **Tests that share a costly fixture stay together.** Tests using a fixture of
  module, class or package scope (e.g. the three-beat race of
  ``test_scheduler_claims.py``, run once per dialect and read by two tests) form a
  group per fixture and parameter (as do tests marked ``xdist_group``): the group
  runs on one worker, in collection order, so the fixture is built once, as in a
  serial run. (xdist 3.8's own ``loadgroup`` renames ``item._nodeid``, which pytest
  9.2 ignores; the workers hand the groups to the scheduler in a file instead.)

Serial runs (``-n 0``) keep the file order; durations are recorded either way.
Isolation between concurrently running tests is not done here: every test already
uses names of its own (databases, queues, app and cluster names, Redis key
prefixes, throwaway servers on free ports; see conftest.py and procs.py).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import pytest

HINTS = Path(__file__).with_name("durations.json")
CACHE_KEY = "ccb/durations"
_WORKER_KEY = "ccb_durations"
_GROUPS_KEY = "ccb_groups_file"
_SHARED_SCOPES = {"module", "class", "package"}


def _load_hints(config: pytest.Config) -> Dict[str, float]:
    table: Dict[str, float] = {}
    try:
        table.update(json.loads(HINTS.read_text()))
    except (OSError, ValueError):
        pass
    cache = getattr(config, "cache", None)
    if cache is not None:
        cached = cache.get(CACHE_KEY, {})
        if isinstance(cached, dict):
            table.update({k: float(v) for k, v in cached.items() if isinstance(v, (int, float))})
    return table


def _shared_group(item: pytest.Item) -> str:
    """The xdist group of a test that uses a fixture wider than the test, else ''."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return ""
    params = getattr(getattr(item, "callspec", None), "params", {})
    parts = []
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name)
        if not defs or defs[-1].scope not in _SHARED_SCOPES:
            continue
        parts.append(f"{name}={params[name]}" if name in params else name)
    if not parts:
        return ""
    module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return f"{module}:{','.join(sorted(parts))}".replace("@", "_")


def _base(nodeid: str) -> str:
    """*nodeid* without the ``@group`` suffix xdist appends under ``--dist loadgroup``."""
    head, at, tail = nodeid.rpartition("@")
    return head if at and "]" not in tail and "::" not in tail else nodeid


def _group_of(item: pytest.Item) -> str:
    return "_".join(sorted(str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                           for m in item.iter_markers("xdist_group")))


class _Recorder:
    """Sums setup, call and teardown time per test and stores it in the cache at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.took: Dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        key = _base(report.nodeid)
        self.took[key] = self.took.get(key, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        cache = getattr(self.config, "cache", None)
        if cache is None or not self.took:
            return
        table = cache.get(CACHE_KEY, {})
        if not isinstance(table, dict):
            table = {}
        table.update({k: round(v, 2) for k, v in self.took.items()})
        cache.set(CACHE_KEY, table)


class _Controller:
    """xdist's side: one durations table for every worker, and a loadgroup that works on pytest 9.2.

    xdist 3.8 marks a group by appending ``@group`` to the item's ``_nodeid``, which pytest
    9.2 no longer reads (its node ids are structured): every test became a group of its own.
    The workers write their groups to a file instead (same collection, same groups), and the
    scheduler reads it.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.table = _load_hints(config)
        self.groups_dir = tempfile.mkdtemp(prefix="ccb-xdist-groups-")

    def pytest_configure_node(self, node) -> None:
        node.workerinput[_WORKER_KEY] = self.table
        node.workerinput[_GROUPS_KEY] = os.path.join(self.groups_dir, "groups.json")

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log):
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadGroupScheduling

        path = os.path.join(self.groups_dir, "groups.json")

        class FileGroupScheduling(LoadGroupScheduling):
            groups: Optional[Dict[str, str]] = None

            def _split_scope(self, nodeid: str) -> str:
                if self.groups is None:
                    try:
                        with open(path) as f:
                            self.groups = json.load(f)
                    except (OSError, ValueError):
                        self.groups = {}
                return self.groups.get(nodeid) or super()._split_scope(nodeid)

        return FileGroupScheduling(config, log)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        shutil.rmtree(self.groups_dir, ignore_errors=True)


class _Worker:
    """A worker's side: group tests that share a wide fixture, then longest first."""

    def __init__(self, table: Dict[str, float], groups_file: Optional[str]) -> None:
        self.table = table
        self.groups_file = groups_file

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # After every modifyitems hook (pytest orders items for its fixtures there), before xdist
        # reports the collection to the controller.
        units: Dict[str, List[pytest.Item]] = {}
        groups: Dict[str, str] = {}
        for item in session.items:
            group = _group_of(item) or _shared_group(item)
            if group:
                groups[item.nodeid] = "group:" + group
            units.setdefault(group or item.nodeid, []).append(item)
        # Longest units first; stable, so equal estimates keep the file order.
        ordered = sorted(units.values(), key=lambda unit: -sum(self.table.get(_base(i.nodeid), 0.0) for i in unit))
        session.items[:] = [item for unit in ordered for item in unit]
        if self.groups_file:  # every worker writes the same map; the last rename wins
            tmp = f"{self.groups_file}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(groups, f)
            os.replace(tmp, self.groups_file)


def configure(config: pytest.Config) -> None:
    """Register what applies to this process: recorder (controller or serial), controller, worker."""
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        if not config.getvalue("loadgroup"):  # e.g. --dist load sends contiguous chunks: keep the file order
            return
        config.pluginmanager.register(_Worker(worker.get(_WORKER_KEY, {}), worker.get(_GROUPS_KEY)),
                                      "ccb-parallel-worker")
        return
    config.pluginmanager.register(_Recorder(config), "ccb-durations")
    if config.pluginmanager.hasplugin("xdist") and getattr(config.option, "numprocesses", None):
        config.pluginmanager.register(_Controller(config), "ccb-parallel-controller")


if __name__ == "__main__":  # refresh the committed hints from this checkout's last run
    cache_file = Path(__file__).resolve().parent.parent / ".pytest_cache" / "v" / CACHE_KEY
    measured = json.loads(cache_file.read_text())
    hints = {k: round(v) for k, v in sorted(measured.items()) if v >= 2.0}
    HINTS.write_text(json.dumps(hints, indent=0, sort_keys=True) + "\n")
    print(f"{len(hints)} tests of 2 s or more written to {os.path.relpath(HINTS)}")
