"""Installing the package costs other Celery processes nothing.

Celery imports every ``celery.commands`` entry point when any ``celery`` command starts
(``import celery.bin.celery`` loads them through click-plugins), so our ``cluster-beat``
plugin is imported by every worker, beat and ``inspect`` of every app on a host where the
package is installed. It used to pull in SQLAlchemy, the store and the stored-schedule API
there: about 0.2 s more CPU and 23 MiB more memory per process. Now the command group is
declared with click alone and the report loads in the command that reads it.

What is bounded here is what gets imported, in a fresh interpreter, not how long it takes
(that would flake on a loaded machine):

* the plugin: none of the heavy modules, only a handful of our light ones, and few modules in
  all beyond what Celery imports without the plugin;
* ``import celery_cluster_beat`` (what ``-S celery_cluster_beat.Scheduler`` and every user's
  ``from celery_cluster_beat import cron`` start with): not even Celery;
* a worker that imports ``LedgerTask``: the store and SQLAlchemy load with it, on purpose. A
  worker that imports the class runs ledger tasks, and the prefork pool forks its children
  after the app's modules are imported, so SQLAlchemy loaded at import is loaded once and
  shared, where loading it on the first ledger task would cost every child its own copy. What
  the worker never needs stays out: the stored-schedule API, the ops report, metrics and the
  HTTP server, the scheduler, and the database drivers (they load when the store first opens
  an engine, after the fork).
"""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Dict, List

import pytest

#: Never imported by loading the plugin.
HEAVY = ["sqlalchemy", "celery_cluster_beat.store", "celery_cluster_beat.dynamic", "celery_cluster_beat.ops.report",
         "celery_cluster_beat.ops.metrics", "celery_cluster_beat.ops.http", "celery_cluster_beat.config",
         "celery_cluster_beat.beat", "celery_cluster_beat.worker", "prometheus_client", "psycopg", "pymysql",
         "http.server", "redis", "celery.schedules"]

#: Everything of ours the plugin may import: the command declarations and what their error
#: lines need (ConfigError, mask_url), and the lazy loader (base), each free of third-party imports.
PLUGIN_OURS = {"celery_cluster_beat", "celery_cluster_beat.base", "celery_cluster_beat.errors",
               "celery_cluster_beat.schedules",
               "celery_cluster_beat.schedules.errors", "celery_cluster_beat.leader", "celery_cluster_beat.leader.urls",
               "celery_cluster_beat.ops", "celery_cluster_beat.ops.cli", "celery_cluster_beat.ops.adopt",
               "celery_cluster_beat.ops.importcmd",
               "celery_cluster_beat.ops.clierrors"}

#: How many modules the plugin may add to a ``celery`` start, ours included. It adds 11 today
#: (our 9, getpass, termios); SQLAlchemy alone is 83, the old plugin added 242.
PLUGIN_EXTRA_MODULES = 25

#: Never imported by a worker's ``from celery_cluster_beat import LedgerTask`` (see the module docstring).
NOT_FOR_WORKERS = ["celery_cluster_beat.dynamic", "celery_cluster_beat.ops.report", "celery_cluster_beat.ops.metrics",
                   "celery_cluster_beat.ops.http", "celery_cluster_beat.beat", "celery.beat", "prometheus_client",
                   "http.server", "psycopg", "pymysql"]

_PROBE = r"""
import json, sys
import importlib.metadata as md

hide = sys.argv[1] == "without-plugin"
_entry_points = md.entry_points


def entry_points(**kw):
    found = _entry_points(**kw)
    if hide and kw.get("group") == "celery.commands":
        found = md.EntryPoints([e for e in found if not e.value.startswith("celery_cluster_beat")])
    return found


md.entry_points = entry_points  # before Celery's `from importlib.metadata import entry_points`
exec(sys.argv[2])
modules = sorted(sys.modules)
plugin = None
if "celery.bin.celery" in sys.modules:
    cmd = sys.modules["celery.bin.celery"].celery.commands.get("cluster-beat")
    cli = sys.modules.get("celery_cluster_beat.ops.cli")
    plugin = "missing" if cmd is None else "ours" if cli is not None and cmd is cli.cluster_beat else repr(cmd)
print(json.dumps({"modules": modules, "plugin": plugin}))
"""


def probe(code: str, *, plugin: bool = True) -> Dict[str, object]:
    """The modules a fresh interpreter holds after running *code* (and what ``cluster-beat`` is)."""
    done = subprocess.run([sys.executable, "-c", _PROBE, "with-plugin" if plugin else "without-plugin", code],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def loaded(modules: List[str], names: List[str]) -> List[str]:
    """The *names* present in *modules*, a package counting as present when any module under it is."""
    return [n for n in names if any(m == n or m.startswith(n + ".") for m in modules)]


def test_loading_the_celery_plugin_imports_nothing_heavy():
    found = probe("import celery.bin.celery")
    # A plugin that fails to import is registered as click-plugins' BrokenCommand: not loading
    # anything heavy would then prove nothing.
    assert found["plugin"] == "ours", (
        f"celery's cluster-beat command is {found['plugin']}, not celery_cluster_beat.ops.cli:cluster_beat: "
        "is the package installed (pip install -e .) and does its CLI import?")
    assert loaded(found["modules"], HEAVY) == [], "loading the cluster-beat plugin imported these"


def test_the_plugin_adds_only_a_few_light_modules_to_every_celery_start():
    with_plugin = probe("import celery.bin.celery")
    without = probe("import celery.bin.celery", plugin=False)
    assert with_plugin["plugin"] == "ours" and without["plugin"] == "missing"
    extra = sorted(set(with_plugin["modules"]) - set(without["modules"]))
    ours = {m for m in extra if m.split(".")[0] == "celery_cluster_beat"}
    assert ours <= PLUGIN_OURS, f"the plugin imports more of the package than it needs: {sorted(ours - PLUGIN_OURS)}"
    assert len(extra) <= PLUGIN_EXTRA_MODULES, f"the plugin adds {len(extra)} modules to every celery start: {extra}"


def test_importing_the_package_imports_neither_celery_nor_anything_heavy():
    found = probe("import celery_cluster_beat")
    assert loaded(found["modules"], ["celery", "kombu"] + HEAVY) == []


def test_cron_and_every_bring_celery_schedules_only():
    found = probe("from celery_cluster_beat import cron, every; cron('*/5 * * * *'); every(30)")
    assert "celery.schedules" in found["modules"]
    assert loaded(found["modules"], [m for m in HEAVY if m != "celery.schedules"]) == []


def test_a_worker_importing_ledger_task_loads_the_store_and_nothing_it_never_needs():
    found = probe("import celery.bin.celery\nfrom celery_cluster_beat import LedgerTask")
    assert found["plugin"] == "ours"
    assert "celery_cluster_beat.worker.task" in found["modules"]
    assert loaded(found["modules"], NOT_FOR_WORKERS) == [], "importing LedgerTask on a worker imported these"


@pytest.mark.parametrize("package", ["celery_cluster_beat", "celery_cluster_beat.schedules",
                                     "celery_cluster_beat.leader"])
def test_every_lazily_imported_name_resolves(package):
    """The names a package loads on first use (PEP 562) are the ones it lists, and each resolves."""
    module = __import__(package, fromlist=["__all__"])
    for name in module.__all__:
        assert getattr(module, name) is not None, name
        assert name in dir(module), name
    with pytest.raises(AttributeError):
        getattr(module, "no_such_name")


def test_the_cli_s_report_is_the_real_module_once_used():
    from celery_cluster_beat.ops import cli, report

    assert cli.report.cluster_status is report.cluster_status
    assert cli.report.NoSuchSchedule is report.NoSuchSchedule
    with pytest.raises(AttributeError):
        cli.report.no_such_name
