"""Helpers for the changelog and backfill tests: an audit trail kept by PostgreSQL itself.

Row triggers (and a statement trigger for TRUNCATE) on every workload table write each change,
with its transaction id and the old and new rows as jsonb, into ``audit_log``, a table outside
the publication. That is the oracle the changelog is compared with: written by the server, in
the same transactions, independent of pgoutput and of pg2delta's decoder.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from lake_read import read_delta
from workload import TABLES, TableSpec, create_schema

AUDIT_DDL = """
CREATE TABLE audit_log (seq bigserial PRIMARY KEY, tbl text, xid bigint, op text, new jsonb, old jsonb);
CREATE FUNCTION audit_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO audit_log (tbl, xid, op, new, old) VALUES (
    TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, txid_current() % 4294967296, left(TG_OP, 1),
    CASE WHEN TG_OP <> 'DELETE' THEN to_jsonb(NEW) END, CASE WHEN TG_OP <> 'INSERT' THEN to_jsonb(OLD) END);
  RETURN NULL;
END $$;
CREATE FUNCTION audit_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO audit_log (tbl, xid, op) VALUES (TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, txid_current() % 4294967296, 'T');
  RETURN NULL;
END $$;
"""


def setup_source(dsn: str) -> tuple[str, str]:
    """The workload's tables with audit triggers, a publication and a slot; returns (slot, publication)."""
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(dsn, pub)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(AUDIT_DDL)
        for spec in TABLES:
            conn.execute(
                sql.SQL("CREATE TRIGGER audit AFTER INSERT OR UPDATE OR DELETE ON {} FOR EACH ROW EXECUTE FUNCTION audit_row()").format(spec.ident)
            )
            conn.execute(
                sql.SQL("CREATE TRIGGER audit_t AFTER TRUNCATE ON {} FOR EACH STATEMENT EXECUTE FUNCTION audit_truncate()").format(spec.ident)
            )
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    return slot, pub


def write_config(path: Path, dsn: str, slot: str, pub: str, lake: Path, *, changelog: dict[str, bool] | None = None,
                 default: bool = True, max_changes: int | None = None) -> Path:
    lines = [
        "[source]", f"dsn = {dsn!r}".replace("'", '"'), f'slot = "{slot}"', f'publication = "{pub}"',
        "[lake]", f'root = "{lake}"', f"changelog = {'true' if default else 'false'}",
    ]
    if max_changes is not None:
        lines += ["[window]", f"max_changes = {max_changes}"]
    for name, on in (changelog or {}).items():
        lines += [f'[tables."{name}"]', f"changelog = {'true' if on else 'false'}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def changelog_path(lake: Path, spec: TableSpec) -> Path:
    return lake / "_pg2delta" / "changelog" / spec.schema / spec.name


def changelog_rows(lake: Path, spec: TableSpec) -> list[dict[str, Any]]:
    path = changelog_path(lake, spec)
    if not (path / "_delta_log").is_dir():
        return []
    rows = read_delta(str(path)).to_pylist()
    return sorted(rows, key=lambda r: (r["_pg2delta_lsn"], r["_pg2delta_pos"]))


def _columns(conn: psycopg.Connection[Any], spec: TableSpec) -> list[tuple[str, str]]:
    rows = conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (spec.qualified,),
    ).fetchall()
    return [(str(n), str(t)) for n, t in rows]


def audit_entries(dsn: str, spec: TableSpec) -> list[dict[str, Any]]:
    """Every committed change of ``spec`` as PostgreSQL recorded it: xid, op, typed old and new rows."""
    with psycopg.connect(dsn) as conn:
        cols = _columns(conn, spec)
        names = [n for n, _ in cols]

        def typed(alias: str) -> sql.Composable:
            return sql.SQL(", ").join(
                sql.SQL("{}.{}::text").format(sql.Identifier(alias), sql.Identifier(n)) if t in ("json", "jsonb")
                else sql.SQL("{}.{}").format(sql.Identifier(alias), sql.Identifier(n))
                for n, t in cols
            )

        query = sql.SQL(
            "SELECT a.seq, a.xid, a.op, {n}, {o} FROM audit_log a "
            "LEFT JOIN LATERAL jsonb_populate_record(NULL::{t}, a.new) n ON a.new IS NOT NULL "
            "LEFT JOIN LATERAL jsonb_populate_record(NULL::{t}, a.old) o ON a.old IS NOT NULL "
            "WHERE a.tbl = %s ORDER BY a.seq"
        ).format(n=typed("n"), o=typed("o"), t=spec.ident)
        out = []
        k = len(names)
        for row in conn.execute(query, (spec.qualified,)).fetchall():
            out.append(
                {
                    "seq": row[0], "xid": row[1], "op": row[2],
                    "new": dict(zip(names, row[3 : 3 + k], strict=True)),
                    "old": dict(zip(names, row[3 + k :], strict=True)),
                }
            )
        return out


def expected_changelog(dsn: str, spec: TableSpec) -> list[tuple[int, str, dict[str, Any]]]:
    """What the changelog of ``spec`` must hold, in transaction order: (xid, op, values).

    An update that changes the key is a delete of the old key then the update; under REPLICA
    IDENTITY FULL (``fullid``) an update that keeps it is its old row (``B``) then the update; a
    delete carries the key (the whole old row under FULL); a truncate no values.
    """
    full = spec.name == "fullid"
    out: list[tuple[int, str, dict[str, Any]]] = []
    for e in audit_entries(dsn, spec):
        old = e["old"] if full else {k: (v if k in spec.key else None) for k, v in e["old"].items()}
        if e["op"] == "I":
            out.append((e["xid"], "I", e["new"]))
        elif e["op"] == "U":
            if any(e["old"][k] != e["new"][k] for k in spec.key):
                out.append((e["xid"], "D", old))
            elif full:
                out.append((e["xid"], "B", old))  # the old row, sent whole under REPLICA IDENTITY FULL
            out.append((e["xid"], "U", e["new"]))
        elif e["op"] == "D":
            out.append((e["xid"], "D", old))
        else:
            out.append((e["xid"], "T", {k: None for k in e["new"]}))
    return out


def assert_changelog_matches(dsn: str, lake: Path, spec: TableSpec) -> Counter[str]:
    """The changelog of ``spec`` equals the audit trail: same changes, same order per transaction,
    same values (columns sent as unchanged TOAST are null and named); returns the count by op."""
    got = changelog_rows(lake, spec)
    want = expected_changelog(dsn, spec)
    by_xid: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for xid, op, values in want:
        by_xid.setdefault(xid, []).append((op, values))
    got_by_xid: dict[int, list[dict[str, Any]]] = {}
    for r in got:
        got_by_xid.setdefault(r["_pg2delta_xid"], []).append(r)
    assert Counter(r["_pg2delta_op"] for r in got) == Counter(op for _, op, _ in want), spec.qualified
    assert set(got_by_xid) == set(by_xid), f"{spec.qualified}: transactions differ"
    keys = {(r["_pg2delta_lsn"], r["_pg2delta_pos"]) for r in got}
    assert len(keys) == len(got), f"{spec.qualified}: a change is in the changelog twice"
    for xid, rows in got_by_xid.items():
        expected = by_xid[xid]
        assert len({r["_pg2delta_lsn"] for r in rows}) == 1, f"{spec.qualified}: xid {xid} has several commit LSNs"
        assert [r["_pg2delta_op"] for r in rows] == [op for op, _ in expected], (spec.qualified, xid)
        for r, (op, values) in zip(rows, expected, strict=True):
            toast = set(r["_pg2delta_toast"] or [])
            assert r["_pg2delta_commit_ts"] is not None
            for name, value in values.items():
                if name in toast:
                    assert r[name] is None, (spec.qualified, xid, name)
                    continue
                assert r[name] == value, f"{spec.qualified} xid {xid} op {op}: {name} = {r[name]!r}, PostgreSQL {value!r}"
    return Counter(r["_pg2delta_op"] for r in got)
