"""The package's layout is a rule, not a convention: one folder per concern, arrows
pointing down only, and schedules free of the rest of the package and of Celery
outside its conversion module. Read from the source with ``ast``, nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Set

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
