"""The package's layout is a rule, not a convention: one folder per concern, arrows
pointing down only, and schedules free of the rest of the package and of Celery
outside its conversion module. Read from the source with ``ast``, nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "celery_cluster_beat"

#: Each concern and the concerns it may import (besides the shared top-level modules).
ALLOWED = {
    "schedules": set(),
    "store": {"schedules"},
    "leader": set(),
    "config": {"leader", "schedules"},
    "messages": set(),
    "beat": {"config", "store", "leader", "schedules", "worker", "dynamic", "ops", "messages"},
    "worker": {"store", "config", "schedules"},
    "dynamic": {"store", "config", "leader", "schedules"},
    "ops": {"store", "config", "leader", "dynamic", "schedules", "messages", "worker"},
}
SHARED = {"errors", "signals", "base", "faults"}


def concern_of(module: str) -> str:
    """'celery_cluster_beat.store.claims' -> 'store'; top-level modules are themselves."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path) -> Set[str]:
    """Absolute names of the package modules *path* imports (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        module = module.rsplit(".", 1)[0]
        package = module
    else:
        package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("celery_cluster_beat"):
                if node.module is None or target.count(".") == 0:
                    found.update(f"{target}.{alias.name}" for alias in node.names)
                else:
                    found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("celery_cluster_beat"))
    return found


def all_modules() -> Dict[Path, Set[str]]:
    return {p: imports_of(p) for p in PACKAGE.rglob("*.py")}


def test_every_concern_is_a_folder_that_says_what_it_owns():
    for concern in ALLOWED:
        init = PACKAGE / concern / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "May import" in doc, f"{concern}/__init__.py must say what it owns and may import"


def test_arrows_point_down_only():
    wrong = []
    for path, targets in all_modules().items():
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1:  # top-level modules
            if rel.stem in SHARED:
                for t in targets:
                    c = concern_of(t)
                    if c not in SHARED and c != "schedules":  # errors re-exports ScheduleError
                        wrong.append(f"{rel} imports {t}")
            continue
        concern = rel.parts[0]
        for t in targets:
            c = concern_of(t)
            if c in (concern, "") or c in SHARED and concern != "schedules":
                continue
            if c not in ALLOWED[concern]:
                wrong.append(f"{rel} imports {t}")
    assert wrong == []


def test_schedules_import_celery_only_in_the_conversion_module():
    offenders = []
    for path in (PACKAGE / "schedules").glob("*.py"):
        if path.name == "celery_types.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("celery", "kombu", "sqlalchemy", "redis")]
    assert offenders == []


@pytest.mark.parametrize("module", ["celery_cluster_beat.schedules", "celery_cluster_beat"])
def test_importing_the_schedules_pulls_in_neither_sqlalchemy_nor_redis(module):
    import subprocess
    import sys

    code = (f"import sys, {module}; "
            "print(sorted(m for m in ('sqlalchemy', 'redis', 'celery.beat') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=PACKAGE.parent, check=True).stdout.strip()
    assert out == "[]"


# ---------------------------------------------------------------- no import cycles
# A cycle works only while every module in it happens to be imported in one order,
# and it is how a folder's "imports point down" rule quietly erodes. The graph counts
# imports inside functions too (a deferred import is still an arrow, and the last cycle
# this package had, schema <-> dialects, hid in one); it leaves out those under
# ``if TYPE_CHECKING:``, which never run.


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_time_imports(node: ast.AST):
    """Every import statement under *node* that can run, at any depth."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _run_time_imports(ast.Module(body=[stmt], type_ignores=[]))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _run_time_imports(child)


def import_graph(package: Path) -> Dict[str, Set[str]]:
    """Module -> the package's modules importing it runs (dotted names, packages by their name).

    ``from a.b import c`` is an arrow to ``a.b.c`` when that is a module, else to ``a.b``.
    Importing ``a.b.c`` runs ``a`` and ``a.b`` first, so those are arrows too, except the
    importer's own enclosing packages: they are already being imported when it runs.
    """
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = []
        for node in _run_time_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets += [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        arrows = set()
        for target in targets:
            while target and target not in modules:  # a name inside a module, or not ours
                target = target.rpartition(".")[0]
            while target:
                if target != module and not module.startswith(target + "."):
                    arrows.add(target)
                target = target.rpartition(".")[0]
        graph[module] = arrows
    return graph


def import_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle (a path back to its start) per group of modules that import each other."""
    # Tarjan's strongly connected components, iteratively.
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    groups: List[Set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, arrows = work[-1]
            for nxt in arrows:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
    cycles = []
    for group in groups:  # a shortest way round from the group's first module, for the message
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in {t for f in frontier for t in graph[f]}:
            nxt = []
            for f in frontier:
                for t in sorted(graph[f] & group):
                    if t not in paths:
                        paths[t] = paths[f] + [t]
                        nxt.append(t)
            frontier = nxt
        last = min(f for f in frontier if start in graph[f])
        cycles.append(paths[last] + [start])
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(import_graph(PACKAGE))
    assert cycles == [], "modules that import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_deferred_import_and_ignores_type_checking(tmp_path):
    """The check above must be able to fail: the shape this package once had, built in a scratch package."""
    pkg = tmp_path / "pkg"
    (pkg / "store" / "dialects").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "store" / "__init__.py").write_text("from .schema import table\n")
    (pkg / "store" / "schema.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .claims import Store\n"
        "table = 1\n"
        "def column_type():\n    from .dialects import types_for\n    return types_for()\n")
    (pkg / "store" / "dialects" / "__init__.py").write_text("from .base import types_for\n")
    (pkg / "store" / "dialects" / "base.py").write_text("from ..schema import table\ndef types_for(): return table\n")
    (pkg / "store" / "claims.py").write_text("from .schema import table\nfrom .dialects.base import types_for\n")
    graph = import_graph(pkg)
    assert graph["pkg.store.claims"] == {"pkg.store.schema", "pkg.store.dialects", "pkg.store.dialects.base"}
    assert graph["pkg.store.schema"] == {"pkg.store.dialects"}  # deferred import counted, TYPE_CHECKING not
    assert import_cycles(graph) == [
        ["pkg.store.dialects", "pkg.store.dialects.base", "pkg.store.schema", "pkg.store.dialects"]]
    (pkg / "store" / "schema.py").write_text("table = 1\n")
    assert import_cycles(import_graph(pkg)) == []


#: A room holds one idea: past this many lines a module is doing two things (README: Layout).
MAX_MODULE_LINES = 500


def test_every_module_is_a_room_of_at_most_500_lines():
    big = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert big == {}, f"split these along their seams: {big}"


@pytest.mark.parametrize("room", [
    "beat/scheduler.py", "beat/state.py", "beat/bringup.py", "beat/leadership.py", "beat/duepass.py",
    "beat/stored.py", "beat/controls.py", "beat/upkeep.py", "beat/prepare.py", "beat/stophold.py",
    "messages/celerysend.py", "messages/template.py", "messages/selfcheck.py", "messages/templates.py",
    "messages/dryrun.py", "messages/support.py",
    "store/engine.py", "store/prepare.py", "store/claiming.py", "store/takeover.py", "store/reads.py",
    "store/pruning.py", "store/types.py",
    "leader/lease.py", "leader/scripts.py", "leader/standby.py", "leader/fencing.py", "leader/events.py",
    "leader/identity.py", "leader/clusterconn.py", "leader/channels.py",
])
def test_each_room_says_what_it_owns(room):
    doc = ast.get_docstring(ast.parse((PACKAGE / room).read_text()))
    assert doc and len(doc.split()) >= 12, f"{room} needs a docstring saying what it owns and why"


def test_the_scheduler_is_thin_glue():
    """Scheduler wires the rooms into Celery's beat; the work lives in the rooms."""
    assert len((PACKAGE / "beat" / "scheduler.py").read_text().splitlines()) <= 400
