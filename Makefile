# pg2delta: `make demo` sets everything up and runs the job once; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The Spark 3.5 line (Databricks LTS, EMR 7), the oldest stack pg2delta supports, in a venv of its own:
# the full pyspark 3.5 with delta-spark 3.3 (Apache Spark + Delta, Scala 2.12 jars) and, with the same
# pyspark's Connect client, pysail; numpy 1.x, pyarrow 15 (our minimum), pandas 2.
SPARK35_VENV ?= .venv-spark35
SPARK35_PY := $(SPARK35_VENV)/bin/python
SPARK35_STAMP := $(SPARK35_VENV)/.installed-stamp
SPARK35_PINS := 'pyspark[connect]==3.5.*' 'delta-spark==3.3.*' 'numpy<2' 'pyarrow==15.*' 'pandas<3' 'pysail>=0.7.2'
# Delta's jars (from Maven Central, through Spark's own --packages resolution) and the Spark config
# dir that loads them: `SPARK_CONF_DIR=$(SPARK35_CONF) spark-submit ...` has Delta (tools/spark_setup.py).
SPARK35_CACHE := .cache/spark35
SPARK35_CONF := $(SPARK35_CACHE)/conf
# The classic engine's tests (marker `classic`): the job end to end, crashes between and after the
# tables' commits (concurrent tables, Delta's idempotent-write ids), the type matrix, schema changes
# and defaults (and crashes in them), resync, bootstrap killed and resumed, and spark-submit of
# bootstrap, run and backfill with a changelog, the SCD2 history (and a crash right after its
# commit); each reads the lake back with delta-rs. A classic
# MERGE costs about a second in a warm JVM and five in a new one (a CLI run in a child process), so
# this is a cut across every feature rather than the whole suite again.
SPARK_TESTS ?= -m "$(SPARK_MARKS)"
# The Spark 4 line: the full pyspark 4.0 with delta-spark 4.0 (Scala 2.13 jars), numpy 2, the newest pyarrow.
SPARK4_VENV ?= .venv-spark4
SPARK4_PY := $(SPARK4_VENV)/bin/python
SPARK4_STAMP := $(SPARK4_VENV)/.installed-stamp
SPARK4_PINS := 'pyspark==4.0.*' 'delta-spark==4.0.*'
SPARK4_CACHE := .cache/spark4
# Not the float keys with NaN there (171 s of the tier's 393 s at 0c80ead): what they prove on Apache
# Spark is the classic dialect's SQL (canonical.py, the same on 3.5 and 4.0) and the tables' statistics
# columns (the same Delta table property), on Spark 3.5 and on the embedded engine.
SPARK4_TESTS ?= -m classic tests/test_job_e2e.py tests/test_job_faults.py --deselect tests/test_job_e2e.py::test_float_keys_with_nan
SPARK4_XDIST ?= $(XDIST)
# Airflow 3 for the example DAGs (examples/airflow/) and their test (tests/test_airflow.py), in a
# venv of its own: Airflow pins its own versions of pyarrow, numpy, grpc... The constraints are the
# set resolved for this Python, committed under tools/ (AIRFLOW_CONSTRAINTS=<Airflow's official
# constraints file for AIRFLOW_VERSION and this Python> uses that instead; empty: none). uv installs
# it in seconds where pip takes minutes; the test's metadata database is SQLite in a temporary AIRFLOW_HOME.
AIRFLOW_VENV ?= .venv-airflow
AIRFLOW_PY := $(AIRFLOW_VENV)/bin/python
AIRFLOW_STAMP := $(AIRFLOW_VENV)/.installed-stamp
AIRFLOW_VERSION ?= 3.3.2
PY_MINOR := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
AIRFLOW_CONSTRAINTS ?= $(wildcard tools/airflow-constraints-py$(PY_MINOR).txt)
AIRFLOW_PINS := 'apache-airflow==$(AIRFLOW_VERSION)' apache-airflow-providers-apache-spark apache-airflow-providers-standard
# The S3-compatible server of the object-store tests (tests/s3server.py): S3Proxy's self-contained
# jar from Maven Central, run on the same Java 17 over a temporary folder.
S3PROXY_VERSION := 4.1.0
S3PROXY_JAR := .cache/s3proxy/s3proxy-$(S3PROXY_VERSION)-jar-with-dependencies.jar
# A Java 17 (Spark 3.5 and 4.x run on it), found or installed at run time: nobody sets JAVA_HOME.
WITH_JAVA = JAVA_HOME="$$(tools/java_home.sh)"
# The tests and the benchmarks start a driver JVM per CLI run for jobs of seconds, and start it fast
# (docs/engines/spark-submit.md, "Faster starts"): the class-data archive tools/spark_setup.py
# trained (it needs an empty SPARK_CONF_DIR, so the settings come as a properties file), the client
# compiler alone (with the full compiler's 240 MB code cache: its own 48 MB fill up within minutes
# of Spark's generated code, then it stops compiling) and the serial collector. Measured: a bare spark-submit of one small MERGE 19 s
# without any of it, 8.5 s with all of it. The tests' own long-lived session keeps the full
# compiler (tests/engines.py). $(call FAST_JVM,<cache dir>)
FAST_JVM = SPARK_CONF_DIR=$(CURDIR)/$(1)/empty-conf \
  PYSPARK_SUBMIT_ARGS="--properties-file $(CURDIR)/$(1)/conf/spark-defaults.conf pyspark-shell" \
  SPARK_SUBMIT_OPTS="-XX:SharedArchiveFile=$(CURDIR)/$(1)/spark.jsa -XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m -XX:+UseSerialGC -Xlog:disable -Xlog:all=warning:stderr"
XDIST ?= -n 2
# Which tests `make test` runs. all (the default, what .ci/run runs): everything. core: lint, the
# docs, the embedded tier and the Spark 3.5 tier without the tests marked `deploy`. deploy: those
# tests (Airflow, spark-submit of every command, the wheel, object storage on both engines, the
# Hive catalog, a standalone cluster, a failover), the Spark 4.0 and compat tiers and the
# dashboard. core and deploy are meant as two CI jobs side by side, each within the 25-minute
# budget (`.ci/run core`, `.ci/run deploy`; docs/development.md, "CI", has their times).
# SIDE_TESTS run beside the embedded tier once SIDE_INSTALLS are done (one process each: they share
# the cores with the embedded tier's two workers), LATER_TIERS after it, side by side: the Spark 4.0
# tier (five tests) in one test process (SPARK4_XDIST empty) beside the Spark 3.5 tier's two workers,
# whose cores wait now and then (a store's retries, a cluster's executors starting, servers).
TIER ?= all
ifeq ($(TIER),core)
EMBEDDED_MARKS := not monitoring and not deploy
SPARK_MARKS := classic and not deploy
LATER_TIERS := test-spark
SIDE_INSTALLS := docs $(SPARK35_STAMP)
SIDE_TESTS :=
else ifeq ($(TIER),deploy)
EMBEDDED_MARKS := deploy and not monitoring
SPARK_MARKS := classic and deploy
LATER_TIERS := test-spark test-spark4
SIDE_INSTALLS := install-spark monitoring
SIDE_TESTS := test-compat test-monitoring
else ifeq ($(TIER),all)
EMBEDDED_MARKS := not monitoring
SPARK_MARKS := classic
LATER_TIERS := test-spark test-spark4
SIDE_INSTALLS := docs install-spark monitoring
SIDE_TESTS := test-compat test-monitoring
else
$(error TIER must be all, core or deploy, not $(TIER))
endif
# Each tier ends with its slowest tests: what to look at when make test's time grows.
DURATIONS ?= --durations=15
# MkDocs for the docs site (make docs), in a venv of its own.
DOCS_VENV ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed-stamp

.PHONY: s3proxy dist install install-spark install-side side install-airflow test-airflow demo test java monitoring test-monitoring test-asan test-embedded test-spark test-spark4 test-compat test-unit test-integration lint typecheck bench bench-decode bench-bootstrap bench-spark bench-memory bench-maintain bench-year bench-verify bench-scale soak postgres clean docs docs-reference docs-serve

# uv (put in the venv by its pip) installs the packages of .venv, the docs' and Airflow's venvs: the
# same packages in less CPU, from warm caches 11-12 s against pip's 38.5 s for .venv (on make test's
# critical path), 7.9 against 15.7 s for the docs'. Not the Spark venvs: there uv took 33-35 s
# against pip's 29.5 s (pyspark's 400 MB of jars). $(call UV_INSTALL,<venv>) <what to install>
# --compile-bytecode: uv, unlike pip, writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE
# is set Python writes none either: every process then compiled pandas, pyspark
# and the rest from source, 2.5 s of CPU more per CLI process (importing the Connect client:
# 3.3 s without .pyc, 0.8 s with them).
UV_INSTALL = $(1)/bin/python -m pip install --quiet uv && $(1)/bin/uv pip install --quiet --compile-bytecode --python $(1)/bin/python

# setup.py and the C source too: an editable install does not rebuild the extension by itself.
$(STAMP): pyproject.toml setup.py src/pg2delta/decode/_tuples.c
	$(PYTHON) -m venv $(VENV)
	$(call UV_INSTALL,$(VENV)) -e '.[embedded,dev]'
	$(VENV)/bin/python -m compileall -q -j 0 src >/dev/null  # pg2delta's own .pyc too (0.3 s a process; a later edit is compiled again)
	touch $(STAMP)

install: $(STAMP)

# pyspark 3.5 (not pyspark-client 4.x) next to pysail: both provide the pyspark package.
$(SPARK35_STAMP): pyproject.toml setup.py src/pg2delta/decode/_tuples.c tools/spark_setup.py
	$(PYTHON) -m venv $(SPARK35_VENV)
	$(SPARK35_PY) -m pip install --quiet --upgrade pip
	$(SPARK35_PY) -m pip install --quiet -e '.[dev]' $(SPARK35_PINS)
	$(WITH_JAVA) $(SPARK35_PY) tools/spark_setup.py --s3a $(SPARK35_CACHE)
	touch $(SPARK35_STAMP)

$(SPARK4_STAMP): pyproject.toml setup.py src/pg2delta/decode/_tuples.c tools/spark_setup.py
	$(PYTHON) -m venv $(SPARK4_VENV)
	$(SPARK4_PY) -m pip install --quiet --upgrade pip
	$(SPARK4_PY) -m pip install --quiet -e '.[dev]' $(SPARK4_PINS)
	$(WITH_JAVA) $(SPARK4_PY) tools/spark_setup.py $(SPARK4_CACHE)
	touch $(SPARK4_STAMP)

install-spark: $(SPARK35_STAMP) $(SPARK4_STAMP)

# Ends with `airflow db migrate` on a throwaway SQLite database: the install works.
$(AIRFLOW_STAMP): $(wildcard tools/airflow-constraints-py*.txt)
	$(PYTHON) -m venv $(AIRFLOW_VENV)
	$(call UV_INSTALL,$(AIRFLOW_VENV)) $(if $(AIRFLOW_CONSTRAINTS),-c $(AIRFLOW_CONSTRAINTS)) $(AIRFLOW_PINS)
	home="$$(mktemp -d)" && AIRFLOW_HOME="$$home" AIRFLOW__CORE__LOAD_EXAMPLES=False \
	  $(AIRFLOW_VENV)/bin/airflow db migrate >/dev/null && rm -rf "$$home"
	touch $(AIRFLOW_STAMP)

install-airflow: $(AIRFLOW_STAMP)

# PostgreSQL 15 from Debian, if this machine does not have it yet (PostgreSQL 18 comes from PyPI).
postgres:
	@if [ ! -x /usr/lib/postgresql/15/bin/postgres ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-15 >/dev/null; \
	  else echo "PostgreSQL 15 is missing: install postgresql-15 (tests on 15 will be skipped)"; fi; \
	fi

demo: install postgres
	$(PY) tools/demo.py

# Everything: lint, the whole suite on the embedded engine (the docs site built beside it), the classic engine's tests on Apache
# Spark + Delta, the Spark 3.5 line's Connect client against pysail, and the example Airflow DAGs.
# The Airflow test runs inside the embedded tier's two workers (it mostly waits on Airflow and the
# CLI), which is shorter than a tier of its own. The Spark venvs are built (pip, Delta's jars)
# while the embedded tier runs: that mostly waits on downloads, not on the cores the tests use.
# Java and PostgreSQL 15 come first, so that no two package installs run at once.
# The Airflow venv is built beside lint (its venv and pip beside uv), not between lint and the
# embedded tier. The compat tier and the dashboard (light: the unit and integration tiers, a
# Prometheus) run beside the embedded tier too, each in one process, rather than after it.
test: postgres java s3proxy
	$(MAKE) -j2 --output-sync=line lint $(if $(filter core,$(TIER)),,$(AIRFLOW_STAMP))
	$(MAKE) -j2 --output-sync=line test-embedded side
	$(MAKE) -j2 --output-sync=line $(LATER_TIERS) SPARK4_XDIST=

# What the later tiers need, installed one after the other beside the embedded tier; first the docs
# site, built with --strict (seconds), so that a broken link fails early.
install-side: $(SIDE_INSTALLS)

# The side holds one job slot of `make -j2 test-embedded side`: its installs in a make of their own
# (-j1), then the side tests, one after the other, each in one test process (XDIST empty). With the
# installs as side's prerequisites, make ran two of them at once and the embedded tier waited for a
# slot until the Spark venvs were built: 1,367 s after the start in a clean-clone run at load 12,
# likely most of the set-up's 190 s at 0c80ead.
side:
	$(MAKE) -j1 install-side
	$(if $(SIDE_TESTS),$(MAKE) $(SIDE_TESTS) XDIST=)

# A Java 17, found or installed (tools/java_home.sh).
java:
	@tools/java_home.sh >/dev/null

$(S3PROXY_JAR):
	tools/s3proxy_fetch.sh $(S3PROXY_VERSION) .cache/s3proxy

s3proxy: $(S3PROXY_JAR)

test-embedded: install $(if $(filter core,$(TIER)),,$(AIRFLOW_STAMP)) postgres $(S3PROXY_JAR)
	$(PY) -m pytest -q $(XDIST) $(DURATIONS) -m "$(EMBEDDED_MARKS)"

# Prometheus from Debian, if this machine does not have it yet: the Grafana dashboard's test runs
# every query of examples/grafana/pg2delta.json against a real one (tests/test_grafana_dashboard.py).
monitoring:
	@if ! command -v prometheus >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends prometheus >/dev/null \
	    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; \
	  else echo "Prometheus is missing: install Debian's prometheus package (the dashboard test will be skipped)"; fi; \
	fi

# The Grafana dashboard against a real Prometheus scraping the metrics files of real runs.
test-monitoring: install monitoring postgres
	$(PY) -m pytest -q -p no:cacheprovider -m monitoring

# The example DAGs in Airflow (airflow dags test) against a throwaway PostgreSQL, on the embedded engine.
test-airflow: install $(AIRFLOW_STAMP) postgres
	$(PY) -m pytest -q -p no:cacheprovider tests/test_airflow.py

test-spark: $(SPARK35_STAMP) postgres $(S3PROXY_JAR)
	$(WITH_JAVA) $(call FAST_JVM,$(SPARK35_CACHE)) PG2DELTA_TEST_ENGINE=spark \
	  $(SPARK35_PY) -m pytest -q -p no:cacheprovider $(XDIST) $(DURATIONS) $(SPARK_TESTS)

# The job end to end and the crashes between and after the tables' commits on Spark 4.0 + Delta 4.0.
test-spark4: $(SPARK4_STAMP) postgres
	$(WITH_JAVA) $(call FAST_JVM,$(SPARK4_CACHE)) PG2DELTA_TEST_ENGINE=spark \
	  $(SPARK4_PY) -m pytest -q -p no:cacheprovider $(SPARK4_XDIST) $(DURATIONS) $(SPARK4_TESTS)

# The unit and integration tiers (decoding against real servers) and the engine-facing end-to-end
# tests again on the oldest supported stack: the pyspark 3.5 Spark Connect client against pysail,
# numpy 1.x, pyarrow 15, pandas 2. Against the newest server only: the libraries and the server are
# independent, and the embedded tier runs every test against every server. One pytest (the
# end-to-end ones marked `compat`): one start of its workers, no test twice.
test-compat: $(SPARK35_STAMP) postgres
	PG2DELTA_TEST_PG=18 $(SPARK35_PY) -m pytest -q -p no:cacheprovider $(XDIST) $(DURATIONS) -m "not monitoring and (not e2e or compat)"

# The C extension built with AddressSanitizer and UBSan (in a copy of src/ under .cache/asan),
# then the decoder's unit and hypothesis tests against it; any report stops the run. PostgreSQL
# does not start under the preloaded sanitizer, so only tests without a server run here.
test-asan: install
	rm -rf .cache/asan && mkdir -p .cache/asan && cp -r src/pg2delta .cache/asan/ && rm -f .cache/asan/pg2delta/decode/*.so
	gcc -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -Wall -Wextra -Werror -fPIC -shared \
	  -I"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" src/pg2delta/decode/_tuples.c \
	  -o .cache/asan/pg2delta/decode/_tuples$$($(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
	PG2DELTA_TEST_PG=15 PYTHONPATH=$(CURDIR)/.cache/asan \
	  LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  $(PY) -m pytest -q -p no:cacheprovider -m "not integration" \
	  tests/test_tuples_ext.py tests/test_pgoutput_properties.py tests/test_changes.py tests/test_typemap.py tests/test_pgoutput_golden.py

test-unit: install
	$(PY) -m pytest -q -m "not integration and not e2e"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-logo
	$(PY) tools/check_sizes.py --baseline tools/size_baseline.txt

# The docs site (docs/, mkdocs.yml) built with --strict into site/ (git-ignored): a broken link or
# anchor, or a page left out of the nav, fails (not with --quiet, which hides the warnings --strict
# counts). First checks that the reference pages' generated parts (configuration, exit codes, the
# command line) are what the code says now (with pg2delta's own venv); `make docs-reference`
# rewrites them. MkDocs and its theme (pyproject's `docs` extra) live in a small venv of their own,
# which `make test` builds and uses beside the embedded tier, off its critical path.
$(DOCS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DOCS_VENV)
	$(call UV_INSTALL,$(DOCS_VENV)) $$($(PYTHON) -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')
	touch $(DOCS_STAMP)

docs: install $(DOCS_STAMP)
	$(PY) tools/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

docs-reference: install
	$(PY) tools/gen_reference.py

# The site at http://127.0.0.1:8000, rebuilt on every change.
docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs serve

bench-decode: install postgres
	$(PY) bench/bench_decode.py

bench: install postgres
	$(PY) bench/bench_e2e.py

bench-bootstrap: install postgres
	$(PY) bench/bench_bootstrap.py

# Peak RSS of `pg2delta run` for 1 M changes in transactions of 10,000, and for one transaction of 1 M and 5 M rows.
bench-memory: install postgres
	$(PY) bench/bench_memory.py

# 1,000 small windows on one table, then `pg2delta maintain`: files before/after and read_speedup.
bench-maintain: install postgres
	$(PY) bench/bench_maintain.py

# A year of five-minute runs with the default config, each a new process: 2,000 on the embedded
# engine, 200 on Apache Spark (BENCH_YEAR_WINDOWS / BENCH_YEAR_SPARK_WINDOWS shrink them).
bench-year: install postgres $(SPARK35_STAMP)
	$(WITH_JAVA) SPARK_CONF_DIR=$(CURDIR)/$(SPARK35_CONF) $(PY) bench/bench_year.py --spark-submit $(SPARK35_VENV)/bin/spark-submit

# `pg2delta verify` of a 5 M-row table (PG2DELTA_BENCH_VERIFY_ROWS for another size): verify_rows_per_s.
bench-verify: install postgres
	$(PY) bench/bench_verify.py

# One scheduled run (1,000 scattered updates, 100 inserts, 100 deletes) into tables of 200 k, 2 M and
# 20 M rows on both engines, each command a new process (spark-submit for Apache Spark; spark_connect:
# a client of Apache Spark's Spark Connect server, started once): run_seconds_*, scale_growth_*,
# rewritten_fraction_*; PG2DELTA_BENCH_SCALE_MAX_ROWS=2000000 for a quick run.
bench-scale: install $(SPARK35_STAMP) postgres
	$(WITH_JAVA) $(PY) bench/bench_scale.py --spark-submit $(SPARK35_VENV)/bin/spark-submit --spark-cache $(SPARK35_CACHE)

# The soak (bench/soak.py): pgbench's TPC-B script, schema changes and truncates for SOAK_SECONDS
# (default 300), pg2delta run every few seconds as a new process with faults at random (SIGKILL,
# SIGTERM, pg_terminate_backend, a PostgreSQL restart, the object store cut or throttled), then
# runs until caught up and the lake compared with PostgreSQL: soak_lost=, soak_duplicated=, ...
# SOAK_SEED replays one (its seed is printed first). SOAK_ENGINE=spark: each run on Apache Spark 3.5 +
# Delta in a JVM of its own (fast start, with hadoop-aws for the store), from the Spark 3.5 venv.
SOAK_ENGINE ?= embedded
soak: install postgres $(S3PROXY_JAR) $(if $(filter spark,$(SOAK_ENGINE)),$(SPARK35_STAMP))
ifeq ($(SOAK_ENGINE),spark)
	$(WITH_JAVA) $(call FAST_JVM,$(SPARK35_CACHE)) SOAK_ENGINE=spark \
	  PYSPARK_SUBMIT_ARGS="--properties-file $(CURDIR)/$(SPARK35_CONF)/spark-s3a.conf pyspark-shell" $(SPARK35_PY) bench/soak.py
else
	$(WITH_JAVA) $(PY) bench/soak.py
endif

# The job on Apache Spark + Delta (spark_e2e_vs_server), one window of 50 tables on both engines, and a
# small run with the lake on the S3-compatible server in local[2] and on a standalone cluster.
bench-spark: $(SPARK35_STAMP) postgres $(S3PROXY_JAR)
	$(WITH_JAVA) $(SPARK35_PY) bench/bench_spark.py --spark-cache $(SPARK35_CACHE)

# The sdist and a wheel (with the C extension built for this Python) in dist/.
dist: install
	rm -rf dist
	$(PY) -m build --outdir dist .

clean:
	rm -rf $(VENV) $(SPARK35_VENV) $(SPARK4_VENV) $(AIRFLOW_VENV) $(DOCS_VENV) .cache var lake site dist build .pytest_cache .mypy_cache .ruff_cache
