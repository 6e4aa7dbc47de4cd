"""The bootstrap copy maps every type exactly as the change path does.

The type matrix of ``test_type_fidelity`` (every type the decoder knows, edge values, types
without a decoder or without a binary send function, TOASTed values, PostgreSQL 18's stored
generated column) goes into one lake through the change path (slot, pgoutput, MERGE) and into
another through ``bootstrap`` (binary COPY at the exported snapshot). Both Delta tables, read with
delta-rs, must have the same schema and the same values. Then the same updates and deletes
(large values left unchanged: sent as unchanged TOAST and filled from the lake) go through
``run`` on both, and the tables must still be equal.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lake_read import read_delta
from pg2delta.bootstrap import run_bootstrap
from pg2delta.config import load
from pg2delta.job import run
from test_type_fidelity import GENERATED, SETUP, TOAST_COLUMNS, _literal_columns, _phases

pytestmark = pytest.mark.e2e


def _norm(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, list):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    return v


def _read(path: Path) -> tuple[list[tuple[str, str]], dict[str, list[Any]]]:
    table = read_delta(str(path)).sort_by("id")
    schema = [(f.name, str(f.type)) for f in table.schema]
    return schema, {n: _norm(table.column(n).to_pylist()) for n in table.column_names}


def _assert_same(a: Path, b: Path, when: str) -> None:
    schema_a, rows_a = _read(a)
    schema_b, rows_b = _read(b)
    assert schema_a == schema_b, f"{when}: schemas differ"
    assert len(schema_a) > 80 and len(rows_a["id"]) > 5, "the type matrix is not all there"
    assert rows_a["id"] == rows_b["id"], f"{when}: ids differ"
    differ = [n for n in rows_a if rows_a[n] != rows_b[n]]
    assert not differ, f"{when}: columns {differ} differ between the change path and the bootstrap copy"


def test_bootstrap_copy_equals_the_change_path(pgdb: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    pub, slot_a, slot_b = f"pub_{tag}", f"a_{tag}", f"b_{tag}"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        version = conn.info.server_version // 10000
        conn.execute(SETUP)
        try:
            conn.execute("SELECT '<a/>'::xml")
            xml = True
        except psycopg.errors.FeatureNotSupported:
            xml = False
        literal = _literal_columns(version, xml)
        cols = [f"{n} {t}" for n, t, _v, _k in literal] + [f"{n} {t}" for n, t, _e, _k in TOAST_COLUMNS]
        if version >= 18:
            cols.append(" ".join(GENERATED[:3]))
        conn.execute(f"CREATE TABLE matrix (id int PRIMARY KEY, {', '.join(cols)})")
        for n, _t, _e, _k in TOAST_COLUMNS:
            conn.execute(f"ALTER TABLE matrix ALTER {n} SET STORAGE EXTERNAL")
        with_gen = " WITH (publish_generated_columns = stored)" if version >= 18 else ""
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE matrix{with_gen}")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot_a,))
        lake_a, lake_b = tmp_path / "changes", tmp_path / "copy"
        cfg_a = load(None, env={}, dsn=pgdb, slot=slot_a, publication=pub, lake=str(lake_a))
        cfg_b = load(None, env={}, dsn=pgdb, slot=slot_b, publication=pub, lake=str(lake_b))
        phases = _phases(conn, literal)
        next(phases)  # inserts of every edge value and an all-NULL row
        run(cfg_a)
        report = run_bootstrap(cfg_b)
        assert [t.rows for t in report.copied] == [len(_read(lake_a / "public" / "matrix")[1]["id"])]
        _assert_same(lake_a / "public" / "matrix", lake_b / "public" / "matrix", "after the copy")
        next(phases)  # updates leaving the TOASTed columns unchanged, deletes
        run(cfg_a)
        run(cfg_b)
        _assert_same(lake_a / "public" / "matrix", lake_b / "public" / "matrix", "after updates on the copy")
