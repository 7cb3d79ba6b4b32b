"""`edgespec bench --suite` from a wheel install: the suites ship as package data.

Builds a wheel of this checkout (no dependencies, no build isolation), unpacks it into a temporary
directory and, in a fresh interpreter with only that directory ahead of site-packages and the
working directory elsewhere, loads every suite through the installed package's own loader. No
model; a few seconds, most of them compiling native/.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from edgespec.bench.prompts import SUITES, load_suite

pytestmark = pytest.mark.model_free
REPO = Path(__file__).resolve().parents[1]
# What the wheel is built from (pyproject.toml's package-dir and setup.py's ext_modules): a copy,
# so the build writes nothing into the checkout.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "edgespec", "cli", "models", "native")
# Loads each suite as `bench --suite` does, and says where the package and its files were found.
PROBE = """
import json, sys
import edgespec
from edgespec.bench.prompts import SUITES, load_suite
print(json.dumps({"package": edgespec.__file__,
                  "files": {name: str(path) for name, path in SUITES.items()},
                  "ids": {name: [p.id for p in load_suite(name)] for name in SUITES}}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A directory holding edgespec as a wheel of this checkout installs it."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
        else:
            shutil.copy2(REPO / name, src / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-cache-dir", "-q", "-w", str(root / "dist"), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (root / "dist").glob("edgespec-*.whl")
    site = root / "site"
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site)  # what `pip install --no-deps` puts in site-packages
    return site


def test_the_wheel_carries_the_suites_and_not_the_research_tools(installed):
    files = {p.relative_to(installed).as_posix() for p in installed.rglob("*") if p.is_file()}
    assert {f"edgespec/bench/suites/{name}.jsonl" for name in SUITES} <= files
    research = {f"edgespec/bench/{name}.py" for name in ("replay", "replay_trees", "ceiling")}
    assert not {f for f in files if f.startswith("benchmarks/")} and not research & files


def test_the_wheel_carries_every_package_of_the_checkout(installed):
    """A package missing from pyproject.toml's list imports from a checkout but not from a wheel
    (edgespec.load once did: `edgespec` failed at start-up on the GPU machine's install)."""
    packages = {p.relative_to(REPO).as_posix() for p in (REPO / "edgespec").rglob("__init__.py")}
    files = {p.relative_to(installed).as_posix() for p in installed.rglob("__init__.py")}
    assert packages <= files, sorted(packages - files)


def test_every_suite_loads_from_the_installed_package(installed, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(installed)}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.splitlines()[-1])
    assert Path(found["package"]).is_relative_to(installed)  # not this checkout's edgespec
    assert all(Path(f).is_relative_to(installed) for f in found["files"].values())
    assert found["ids"] == {name: [p.id for p in load_suite(name)] for name in SUITES}
    assert {name: len(ids) for name, ids in found["ids"].items()} == {
        "specbench": 480, "code-edit": 48, "code-edit-validation": 48, "code-edit-test": 42}
