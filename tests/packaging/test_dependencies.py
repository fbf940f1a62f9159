"""The library imports only what an install without the test extra has: no module of the package imports a
distribution that only the ``test`` extra of ``pyproject.toml`` brings."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("cli", "configs", "integrations", "job", "pipeline", "storage", "trainer")
TEST_ONLY = {"crc32c", "pytest", "moto", "hypothesis"}  # top-level module names of test-extra distributions


def test_extra_names_the_test_only_modules_checked_here():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    names = {re.split(r"[<>=\[ ]", spec)[0] for spec in extra}
    assert TEST_ONLY <= names


def test_no_library_module_imports_a_test_only_distribution():
    found = []
    for folder in PACKAGE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                found += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in TEST_ONLY]
    assert found == []
