"""The built wheel is what the metadata says: ``py.typed`` (PEP 561), the LICENSE of the
declared BSD-3-Clause licence, one version (``celery_cluster_beat.__version__``, read by
setup.cfg), and the Python versions the pinned Celery supports (3.10-3.13) in the
classifiers and in tox.

A real ``pip wheel`` of a copy of the source tree (so no ``build/`` lands in the working
tree other engineers use), bounded to 120 s. Built without build isolation, with the
setuptools and wheel the ``test`` extra installs: an isolated build downloads and installs
both into a throwaway environment first, which took most of this module's 20-46 s.
"""
from __future__ import annotations

import configparser
import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import celery_cluster_beat

REPO = Path(__file__).resolve().parent.parent
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.cfg", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "celery_cluster_beat", src / "celery_cluster_beat",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("*.whl")
    with zipfile.ZipFile(built) as zf:
        yield zf


def _metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(name))


@pytest.mark.timeout(180)
def test_the_wheel_carries_py_typed(wheel):
    assert "celery_cluster_beat/py.typed" in wheel.namelist()


@pytest.mark.timeout(180)
def test_the_wheel_carries_the_bsd_3_clause_licence_it_declares(wheel):
    meta = _metadata(wheel)
    assert "BSD-3-Clause" in (meta.get("License-Expression") or meta.get("License") or "")
    licences = [n for n in wheel.namelist() if ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE"]
    assert licences, wheel.namelist()
    text = wheel.read(licences[0]).decode()
    assert text == (REPO / "LICENSE").read_text()
    assert "BSD 3-Clause License" in text and "Copyright (c) 2026, celery-cluster-beat authors" in text
    assert "Neither the name of the copyright holder" in text, "the third clause"


@pytest.mark.timeout(180)
def test_one_version_the_package_s_own(wheel):
    assert _metadata(wheel)["Version"] == celery_cluster_beat.__version__
    assert wheel.filename.rsplit("/", 1)[-1].startswith(f"celery_cluster_beat-{celery_cluster_beat.__version__}-")
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert cfg["metadata"]["version"].strip() == "attr: celery_cluster_beat.__version__"


@pytest.mark.timeout(180)
def test_python_versions_agree_in_classifiers_requires_python_and_tox(wheel):
    meta = _metadata(wheel)
    versions = sorted((c.rsplit(":: ", 1)[-1] for c in meta.get_all("Classifier")
                       if c.startswith("Programming Language :: Python :: 3.")),
                      key=lambda v: tuple(map(int, v.split("."))))
    assert versions == PYTHONS
    assert meta["Requires-Python"] == ">=3.10"
    tox = configparser.ConfigParser()
    tox.read(REPO / "tox.ini")
    envs = [e.strip() for e in tox["tox"]["envlist"].split(",")]
    assert envs == ["py" + v.replace(".", "") for v in PYTHONS] + ["celery" + m.replace(".", "") for m in MINORS]


#: The Celery minors of the README's support table, oldest first.
MINORS = ["5.3", "5.4", "5.5", "5.6", "5.7"]


def test_the_declared_celery_range_is_the_tested_range():
    """setup.cfg's floor, the constraints CI installs per minor, tox, the range ``check`` reports
    and the README's table name the same minors."""
    from celery_cluster_beat.messages.support import TESTED

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    requires = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    assert f"celery[redis]>={MINORS[0]}" in requires
    assert TESTED["celery"] == (tuple(map(int, MINORS[0].split("."))), tuple(map(int, MINORS[-1].split("."))))
    tox = configparser.ConfigParser()
    tox.read(REPO / "tox.ini")
    readme = (REPO / "README.md").read_text()
    for minor in MINORS:
        pins = dict(line.split("==") for line in (REPO / ".ci" / "constraints" / f"celery-{minor}.txt")
                    .read_text().splitlines() if "==" in line)
        assert pins["celery"].startswith(minor + "."), pins
        assert f"| {pins['celery']} | {pins['kombu']} | {pins['amqp']} | {pins['redis']} |" in readme, minor
        env = "testenv:celery" + minor.replace(".", "")
        assert minor == MINORS[-1] or f"celery-{minor}.txt" in tox[env]["setenv"]
    matrix = (REPO / ".ci" / "matrix").read_text()
    assert "minors=(" + " ".join(MINORS[:-1]) + ")" in matrix
