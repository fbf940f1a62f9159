"""Put a plain-path tree of the ``refpipe`` package on the venv's ``sys.path``, for tools that only follow paths.

``pyproject.toml``'s ``package-dir`` installs the top-level folders (``storage/``, ``pipeline/``, ...) as
``refpipe.storage`` and so on. The editable install (``pip install -e .``) resolves them through setuptools'
import hook, which type checkers and IDEs (mypy, pyright, Pylance, ty) never run. This script writes
``<venv>/refpipe-tree/refpipe/``: a link to each file of ``refpipe/`` and one directory link per ``package-dir``
entry (``refpipe/storage -> <repository>/storage``), and ``refpipe-tree.pth`` in the venv's site-packages, which
puts the tree on ``sys.path``. The links are to folders, so a module added to a folder is seen at once, by the
interpreter and by every tool; a new subpackage is a new ``package-dir`` entry and a new run of this script
(the Makefile reruns it whenever ``pyproject.toml`` changes).

Run by the Makefile's install step, with the venv's interpreter: ``.venv/bin/python tools/link_tree.py``.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def link_tree(prefix: Path) -> Path:
    """(Re)write ``<prefix>/refpipe-tree`` and its ``.pth``; returns the tree's root (the ``sys.path`` entry).

    Raises:
        KeyError: ``pyproject.toml`` has no ``[tool.setuptools.package-dir]`` entry ``refpipe``.
    """
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = prefix / "refpipe-tree"
    shutil.rmtree(root, ignore_errors=True)
    package = root / "refpipe"
    package.mkdir(parents=True)
    for path in (REPO / package_dir["refpipe"]).iterdir():
        if path.name != "__pycache__":
            (package / path.name).symlink_to(path)
    for name, folder in package_dir.items():
        if name != "refpipe":
            (package / name.removeprefix("refpipe.")).symlink_to(REPO / folder, target_is_directory=True)
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(prefix)}))
    (site_packages / "refpipe-tree.pth").write_text(f"{root}\n")
    return root


if __name__ == "__main__":
    print(link_tree(Path(sys.prefix)))
