"""refpipe installs as one import namespace: nothing of ours under a bare generic name."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("storage", "pipeline", "trainer", "cli", "job", "integrations")


def _our_python_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / name for name in tracked.stdout.split()]


def _bare_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n.split(".")[0] in SUBPACKAGES]
    return found


def test_no_module_imports_a_bare_top_level_name():
    files = _our_python_files()
    assert len(files) > 100  # the scan really saw the tree
    assert [hit for path in files for hit in _bare_imports(path)] == []


def test_only_the_refpipe_namespace_is_importable_outside_the_checkout(tmp_path):
    probe = (
        "import importlib.util, json, refpipe.storage, refpipe.job.train_rank\n"
        f"print(json.dumps({{n: importlib.util.find_spec(n) is not None for n in {list(SUBPACKAGES)!r}}}))\n"
        "print(refpipe.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    found, version = out.stdout.splitlines()
    assert found == '{"storage": false, "pipeline": false, "trainer": false, "cli": false, "job": false, ' \
                    '"integrations": false}'
    assert version == "0.1.0"


def test_a_bare_folder_import_from_the_repository_root_is_refused():
    """With the repository root on sys.path (``python -c`` there), ``import storage.errors`` would be a second copy
    whose ``KeyNotFoundError`` no ``except refpipe.storage.errors.KeyNotFoundError`` catches: each folder refuses."""
    probe = (
        "import importlib, refpipe.storage.errors\n"
        f"for name in {['storage.errors', *SUBPACKAGES[1:]]!r}:\n"
        "    try:\n        importlib.import_module(name)\n    except ImportError as e:\n        print(e)\n"
        "print(refpipe.storage.errors.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        *(f"{p}: refpipe's {p}/ folder imported under a bare name (the repository root is on sys.path); "
          f"import refpipe.{p} instead" for p in SUBPACKAGES),
        "refpipe.storage.errors",
    ]


def test_the_package_resolves_through_plain_sys_path_entries(tmp_path):
    """What type checkers and IDEs do: find ``refpipe.<sub>`` from sys.path's directories alone, no import hook
    (``tools/link_tree.py`` on an editable install); ``py.typed`` sits beside ``refpipe/__init__.py``."""
    probe = (
        "import json, sys\nfrom importlib.machinery import PathFinder\nfrom pathlib import Path\n"
        "top = PathFinder.find_spec('refpipe', sys.path)\n"
        "subs = {n: PathFinder.find_spec(f'refpipe.{n}', top.submodule_search_locations) for n in sys.argv[1:]}\n"
        "print(json.dumps({n: str(Path(s.origin).resolve()) for n, s in subs.items()}))\n"
        "print((Path(top.origin).parent / 'py.typed').is_file())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, *SUBPACKAGES], cwd=tmp_path, capture_output=True, text=True,
                         check=True)
    found, typed = out.stdout.splitlines()
    assert json.loads(found) == {p: str(REPO / p / "__init__.py") for p in SUBPACKAGES}
    assert typed == "True"


@pytest.mark.timeout(300)
def test_wheel_holds_only_the_refpipe_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
                   cwd=tmp_path, check=True, capture_output=True)
    (wheel,) = tmp_path.glob("refpipe-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"refpipe", "refpipe-0.1.0.dist-info"}
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"refpipe/py.typed", "refpipe/job/workload/model.py", *(f"refpipe/{p}/__init__.py" for p in SUBPACKAGES)} \
        <= names


LAYERS = {"storage": set(), "pipeline": {"storage"}, "trainer": {"storage", "pipeline"},
          "job": {"storage", "pipeline", "trainer"}, "integrations": {"storage", "pipeline"},
          "cli": {"storage", "pipeline", "trainer", "job"}}
"""Which of our packages each package may import (README "Dive into the code": imports flow one way)."""


def _layer_violations(path: Path) -> list[str]:
    package = path.relative_to(REPO).parts[0]
    allowed = LAYERS.get(package)
    if allowed is None:
        return []
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "refpipe" and len(parts) > 1 and parts[1] in LAYERS and parts[1] != package \
                    and parts[1] not in allowed:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    return found


def test_imports_flow_one_way():
    """job/ never imports cli/ (it imported cli.text's markup_safe), storage/ nothing of ours, and so on."""
    assert [hit for path in _our_python_files() for hit in _layer_violations(path)] == []
