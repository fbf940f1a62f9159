# `make run` and `make test` set up .venv on a fresh machine and run.
# torch is pinned here (CPU build 2.13.0 from local disk); pyproject only asks torch>=2.4.
# The editable install resolves refpipe.* through setuptools' import hook; tools/link_tree.py adds a plain-path
# tree of the same folders for type checkers and IDEs, which never run that hook.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
CONFIG ?= configs/local.toml

.PHONY: run test bench clean

$(STAMP): pyproject.toml Makefile tools/link_tree.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,verifiers]' && $(PY) tools/link_tree.py
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/refpipe run --config $(CONFIG)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n 2

bench: $(STAMP)
	$(PY) bench/keep_fetch.py

clean:
	rm -rf $(VENV) runs
