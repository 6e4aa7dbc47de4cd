"""Column governance: ``[tables."s.t"] hash`` lands HMAC-SHA-256 of a column's values, ``exclude``
never lands a column.

The proof is a search: every file under the lake (tables, changelogs, histories, the Delta logs'
statistics, the staging and spill files a killed run or bootstrap left behind) and every line the
commands printed, for the raw values' bytes, Parquet files decoded too. The search is shown to work
by a column left in clear, whose values it must find. The lake is read back with delta-rs and
compared with PostgreSQL's rows hashed by the test itself (:mod:`hmac`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import signal
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import newest_server_only
from lake_read import read_delta
from pg2delta import config as config_module
from pg2delta.apply.history import HISTORY_SUFFIX
from pg2delta.decode.governance import ColumnRules, Governance, hash_values
from pg2delta.errors import ConfigError
from pg2delta.faults import FAULT_ENV
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import cli

KEY = "governance-test-key-0123456789abcdef"
KEY_ENV = "PG2DELTA_TEST_HASH_KEY"
RAW_MAIL, RAW_SSN, CLEAR = b"rawmail", b"rawssn", b"clearnote"


def h(value: str | None, key: str = KEY) -> str | None:
    """The hash the lake must hold: HMAC-SHA-256 of the value's UTF-8 bytes, in hex."""
    return None if value is None else hmac.new(key.encode(), value.encode(), hashlib.sha256).hexdigest()


# --- unit ------------------------------------------------------------------------------------------


def test_hash_values_is_hmac_sha256_and_keeps_nulls() -> None:
    key = KEY.encode()
    out = hash_values(pa.array(["a@x.org", None, "a@x.org", ""]), key).to_pylist()
    assert out == [h("a@x.org"), None, h("a@x.org"), h("")]
    assert hash_values(pa.array([7, None], pa.int64()), key).to_pylist() == [h("7"), None]  # PostgreSQL's text of an int
    assert hash_values(pa.array([b"\x00\xff"]), key).to_pylist() == [hmac.new(key, b"\x00\xff", hashlib.sha256).hexdigest()]
    assert hash_values(pa.array(["a"]), b"another key of 16+ bytes").to_pylist() != [h("a")]
    long_key = bytes(range(100))  # longer than SHA-256's block: hashed first, as HMAC says
    assert hash_values(pa.array(["a"]), long_key).to_pylist() == [hmac.new(long_key, b"a", hashlib.sha256).hexdigest()]


def test_governance_refuses_what_it_cannot_do() -> None:
    rules = ColumnRules(frozenset({"email"}), frozenset({"ssn"}), KEY.encode())
    names, types = ["id", "email", "ssn"], [pa.int32(), pa.string(), pa.string()]
    gov = Governance.resolve("s.t", names, types, ["id"], rules)
    assert [f.name for f in gov.fields([pa.field(n, t) for n, t in zip(names, types, strict=True)])] == ["id", "email"]
    with pytest.raises(ConfigError, match="key column"):
        Governance.resolve("s.t", names, types, ["ssn"], rules)  # an excluded key column
    with pytest.raises(ConfigError, match="misspelt"):
        Governance.resolve("s.t", names, types, ["id"], ColumnRules(frozenset({"emial"}), frozenset(), KEY.encode()))
    with pytest.raises(ConfigError, match="scalar"):
        Governance.resolve("s.t", ["id", "tags"], [pa.int32(), pa.list_(pa.string())], ["id"],
                           ColumnRules(frozenset({"tags"}), frozenset(), KEY.encode()))
    assert KEY not in repr(rules) and KEY not in repr(gov)


def _config(tmp_path: Path, lake_extra: str = "", table: str = 'hash = ["email"]') -> Path:
    path = tmp_path / "c.toml"
    path.write_text(f'[source]\ndsn = "host=x"\n[lake]\nroot = "{tmp_path}/lake"\n{lake_extra}\n[tables."s.t"]\n{table}\n')
    return path


def test_hash_key_from_the_environment_or_a_file_never_the_config(tmp_path: Path) -> None:
    path = _config(tmp_path, f'hash_key_env = "{KEY_ENV}"')
    cfg = config_module.load(path, env={KEY_ENV: KEY})
    assert cfg.hash_key == KEY.encode() and cfg.table("s", "t").hash == ("email",)
    assert KEY not in repr(cfg)
    with pytest.raises(ConfigError, match=f"none in the environment variable {KEY_ENV}"):
        config_module.load(path, env={})
    with pytest.raises(ConfigError, match="at least 16"):
        config_module.load(path, env={KEY_ENV: "short"})
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")  # as `echo` writes it: the newline is not part of the key
    assert config_module.load(_config(tmp_path, f'hash_key_file = "{key_file}"'), env={}).hash_key == KEY.encode()
    with pytest.raises(ConfigError, match="never belongs in the config file"):
        config_module.load(_config(tmp_path, f'hash_key = "{KEY}"'), env={})
    with pytest.raises(ConfigError, match="both hashed and excluded"):
        config_module.load(_config(tmp_path, table='hash = ["a"]\nexclude = ["a"]'), env={KEY_ENV: KEY})
    # No table hashes: no key needed.
    assert config_module.load(_config(tmp_path, table='exclude = ["ssn"]'), env={}).hash_key == b""


# --- end to end ------------------------------------------------------------------------------------

SCHEMA_DDL = """
CREATE SCHEMA gov;
CREATE TABLE gov.people (id int PRIMARY KEY, email text, ssn text, note text, born date);
CREATE TABLE gov.orders (id int PRIMARY KEY, email text, amount int, note text);
CREATE TABLE gov.by_email (email text PRIMARY KEY, name text);
"""


def _source(dsn: str) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"gov_{tag}", f"gov_{tag}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA_DDL)
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE gov.people, gov.orders, gov.by_email")
    return slot, pub


def _write_config(tmp_path: Path, dsn: str, slot: str, pub: str, *, memory_budget: int | None = None,
                  people: str = 'hash = ["email"]\nexclude = ["ssn"]') -> Path:
    lines = [
        "[source]", f"dsn = {json.dumps(dsn)}", f'slot = "{slot}"', f'publication = "{pub}"',
        "[lake]", f'root = "{tmp_path / "lake"}"', "changelog = true", f'hash_key_env = "{KEY_ENV}"',
        '[tables."gov.people"]', people,
        '[tables."gov.orders"]', 'hash = ["email"]',
        '[tables."gov.by_email"]', 'hash = ["email"]', 'history = "scd2"',
    ]
    if memory_budget is not None:
        lines[8:8] = ["[window]", f"memory_budget = {memory_budget}"]
    path = tmp_path / "gov.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _leaks(paths: list[Path], needles: tuple[bytes, ...]) -> dict[bytes, list[str]]:
    """Which of ``needles`` each file holds: its raw bytes, and for Parquet its decoded values."""
    found: dict[bytes, list[str]] = {n: [] for n in needles}
    for p in paths:
        data = p.read_bytes()
        texts = [data]
        if p.suffix == ".parquet" or data[:4] == b"PAR1":
            with contextlib.suppress(pa.ArrowInvalid):  # a file the kill cut short: its bytes only
                texts.append(repr(pq.read_table(p).to_pylist()).encode())
        for n in needles:
            if any(n in t for t in texts):
                found[n].append(str(p))
    return found


def _assert_no_raw(where: list[Path], outputs: list[str], what: str, *, control: bool = True) -> None:
    files = [p for root in where if root.exists() for p in root.rglob("*") if p.is_file()]
    found = _leaks(files, (RAW_MAIL, RAW_SSN, CLEAR))
    assert not found[RAW_MAIL] and not found[RAW_SSN], f"raw values in {what}: {found}"
    if control:  # the search does find values: the column left in clear is there
        assert found[CLEAR], f"the search found nothing at all in {what} ({len(files)} files)"
    for out in outputs:
        assert RAW_MAIL.decode() not in out and RAW_SSN.decode() not in out, f"raw values in the output of {what}"


def _lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


def _pg(dsn: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return list(conn.execute(query).fetchall())


def _assert_lake_equals_source(dsn: str, lake: Path) -> None:
    people = read_delta(lake / "gov" / "people")
    assert "ssn" not in people.column_names and people.schema.field("email").type == pa.string()
    got = sorted((r["id"], r["email"], r["note"], r["born"]) for r in people.to_pylist())
    want = sorted((i, h(e), n, b) for i, e, n, b in _pg(dsn, "SELECT id, email, note, born FROM gov.people"))
    assert got == want
    orders = sorted((r["id"], r["email"], r["amount"]) for r in read_delta(lake / "gov" / "orders").to_pylist())
    assert orders == sorted((i, h(e), a) for i, e, a in _pg(dsn, "SELECT id, email, amount FROM gov.orders"))
    by_email = sorted((r["email"], r["name"]) for r in read_delta(lake / "gov" / "by_email").to_pylist())
    assert by_email == sorted((h(e), n) for e, n in _pg(dsn, "SELECT email, name FROM gov.by_email"))


@pytest.mark.e2e
def test_hashed_and_excluded_columns_never_land_raw(pgdb: str, pg_server: ThrowawayPostgres, tmp_path: Path) -> None:
    newest_server_only(pg_server, "what lands in the lake does not depend on the server (the partition test covers both)")
    lake = tmp_path / "lake"
    slot, pub = _source(pgdb)
    env = {KEY_ENV: KEY}
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO gov.people SELECT g, 'rawmail' || g || '@example.org', 'rawssn-' || g, 'clearnote' || g, "
            "date '1980-01-01' + g FROM generate_series(1, 300) g"
        )
        conn.execute("INSERT INTO gov.people VALUES (301, NULL, NULL, 'clearnote301', NULL)")  # NULL stays NULL
        conn.execute("INSERT INTO gov.orders SELECT g, 'rawmail' || (g % 50) || '@example.org', g, 'clearnote-o' || g "
                     "FROM generate_series(1, 100) g")
        conn.execute("INSERT INTO gov.by_email SELECT 'rawmail' || g || '@example.org', 'n' || g FROM generate_series(1, 20) g")
    config = _write_config(tmp_path, pgdb, slot, pub)
    common = ["--config", str(config), "-v"]
    # The bootstrap killed once its first copy's files are in the table's folder, before its commit
    # (the embedded engine takes a new table's staged files as they are): they are hashed already.
    killed = cli("bootstrap", *common, "--parallel", "1", env={**env, FAULT_ENV: "copy_adopt_moved"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    _assert_no_raw([lake], [killed.stdout, killed.stderr], "a killed bootstrap's staged copy")
    outputs = [killed.stdout, killed.stderr]
    done = cli("bootstrap", *common, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    outputs += [done.stdout, done.stderr]
    _assert_lake_equals_source(pgdb, lake)

    # Changes: updates, deletes, a key change of the hashed key, a NULL, in windows that spill.
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO gov.people SELECT g, 'rawmail' || g || '@example.org', 'rawssn-' || g, "
                     "'clearnote' || g, NULL FROM generate_series(400, 460) g")
        conn.execute("UPDATE gov.people SET email = 'rawmail-new' || id || '@example.org' WHERE id % 7 = 0")
        conn.execute("UPDATE gov.people SET email = NULL WHERE id = 14")
        conn.execute("UPDATE gov.people SET note = 'clearnote-updated' || id WHERE id % 5 = 0")  # the hash stays
        conn.execute("DELETE FROM gov.people WHERE id % 11 = 0")
        conn.execute("UPDATE gov.by_email SET name = 'renamed' WHERE email = 'rawmail3@example.org'")
        conn.execute("UPDATE gov.by_email SET email = 'rawmail-moved@example.org' WHERE email = 'rawmail4@example.org'")
        conn.execute("DELETE FROM gov.by_email WHERE email = 'rawmail5@example.org'")
        conn.execute("INSERT INTO gov.orders VALUES (1000, 'rawmail7@example.org', 5, 'clearnote-o1000')")
    spilling = _write_config(tmp_path, pgdb, slot, pub, memory_budget=1)
    crashed = cli("run", "--config", str(spilling), "-v", env={**env, FAULT_ENV: "after_spill"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    staging = lake / "_pg2delta" / "staging"
    assert list(staging.rglob("*.parquet")), "the killed run left no spill files to search"
    _assert_no_raw([staging], [crashed.stdout, crashed.stderr], "a killed run's spill files")
    outputs += [crashed.stdout, crashed.stderr]
    run = cli("run", "--config", str(spilling), "-v", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    outputs += [run.stdout, run.stderr]
    _assert_lake_equals_source(pgdb, lake)

    # Equal values, equal hashes across tables: a join on the hash finds the pairs the raw join finds.
    people = {r["id"]: r["email"] for r in read_delta(lake / "gov" / "people").to_pylist()}
    orders = read_delta(lake / "gov" / "orders").to_pylist()
    joined = {(o["id"], p) for o in orders for p, e in people.items() if e is not None and e == o["email"]}
    want = set(_pg(pgdb, "SELECT o.id, p.id FROM gov.orders o JOIN gov.people p ON p.email = o.email"))
    assert joined == want and joined
    # The history (SCD2) of the hashed key: the moved key's old version closed, the new one open.
    history = read_delta(lake / "gov" / f"by_email{HISTORY_SUFFIX}").to_pylist()
    assert {r["email"] for r in history} >= {h("rawmail4@example.org"), h("rawmail-moved@example.org")}
    # The changelog holds the hashes too; and nothing raw anywhere, nor in any output.
    assert {r["email"] for r in read_delta(lake / "_pg2delta" / "changelog" / "gov" / "by_email").to_pylist()} >= {
        h("rawmail-moved@example.org")}
    _assert_no_raw([lake], outputs, "the lake and every command's output")
    # A backfill into a copy replays the changelog as landed: the copy equals the table, hashed.
    logged = [r for r in read_delta(lake / "_pg2delta" / "applied_log").to_pylist() if r["table_name"] == "people"]
    start = max(r["window_end"] for r in logged if r["kind"] == "bootstrap")
    copy = tmp_path / "copy"
    backfill = cli("backfill", "--config", str(config), "-v", "--table", "gov.people", "--from-lsn", _lsn(start),
                   "--to-lsn", _lsn(max(r["window_end"] for r in logged)), "--into", str(copy), env=env)
    assert backfill.returncode == 0, backfill.stderr[-3000:]
    assert sorted(map(str, read_delta(copy / "gov" / "people").to_pylist())) == sorted(
        map(str, read_delta(lake / "gov" / "people").to_pylist()))
    _assert_no_raw([copy], [backfill.stdout, backfill.stderr], "a backfill's copy")

    verified = cli("verify", "--config", str(config), "--json", env=env)
    assert verified.returncode == 0, verified.stderr[-3000:]
    report = json.loads(verified.stdout)
    assert report["equal"], report
    people_report = report["tables"]["gov.people"]
    assert not people_report["skipped"] and people_report["source_rows"] == people_report["lake_rows"] > 0
    assert people_report["columns_not_compared"] == ["ssn (excluded)"]
    assert not report["tables"]["gov.by_email"]["skipped"]
    # The hashes are compared: under another key every hashed value differs, keys included.
    wrong = cli("verify", "--config", str(config), "--json", "--table", "gov.orders",
                env={KEY_ENV: "not the key the lake was hashed with"})
    assert wrong.returncode == 20, wrong.stderr[-3000:]
    assert json.loads(wrong.stdout)["tables"]["gov.orders"]["differences"]
    _assert_no_raw([lake], [verified.stdout, verified.stderr, wrong.stdout, wrong.stderr], "verify")


@pytest.mark.e2e
def test_changed_settings_are_refused_until_a_resync(pgdb: str, pg_server: ThrowawayPostgres, tmp_path: Path) -> None:
    newest_server_only(pg_server, "the lake's record of its columns does not depend on the server")
    lake = tmp_path / "lake"
    slot, pub = _source(pgdb)
    env = {KEY_ENV: KEY}
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO gov.people VALUES (1, 'rawmail1@example.org', 'rawssn1', 'clearnote1', NULL)")
    plain = _write_config(tmp_path, pgdb, slot, pub, people="")
    done = cli("bootstrap", "--config", str(plain), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE gov.people SET note = 'clearnote2'")
    hashed = _write_config(tmp_path, pgdb, slot, pub)  # people: email hashed, ssn excluded now
    refused = cli("run", "--config", str(hashed), env=env)
    assert refused.returncode == 78, refused.stderr[-3000:]
    assert "pg2delta resync --table gov.people" in refused.stderr
    assert "email: in clear in the lake, hashed now" in refused.stderr and "ssn: in the lake, excluded now" in refused.stderr
    assert [r["email"] for r in read_delta(lake / "gov" / "people").to_pylist()] == ["rawmail1@example.org"]
    resynced = cli("resync", "--config", str(hashed), "--table", "gov.people", env=env)
    assert resynced.returncode == 0, resynced.stderr[-3000:]
    assert cli("run", "--config", str(hashed), env=env).returncode == 0
    rows = read_delta(lake / "gov" / "people").to_pylist()
    assert [(r["email"], r["note"]) for r in rows] == [(h("rawmail1@example.org"), "clearnote2")]
    assert "ssn" not in rows[0], "the resync's copy leaves the excluded column out of the table"
    # A column added with a default and hashed from its start: the rows before it hold the default's hash.
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("ALTER TABLE gov.people ADD COLUMN alt text DEFAULT 'rawmail-default@example.org'")
        conn.execute("INSERT INTO gov.people (id, email, alt) VALUES (2, 'rawmail2@example.org', 'rawmail-alt@example.org')")
    with_alt = _write_config(tmp_path, pgdb, slot, pub, people='hash = ["email", "alt"]\nexclude = ["ssn"]')
    added = cli("run", "--config", str(with_alt), env=env)
    assert added.returncode == 0, added.stderr[-3000:]
    rows = sorted(read_delta(lake / "gov" / "people").to_pylist(), key=lambda r: r["id"])
    assert [(r["id"], r["alt"]) for r in rows] == [(1, h("rawmail-default@example.org")), (2, h("rawmail-alt@example.org"))]
    # Another key is another form too.
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE gov.people SET note = 'clearnote3'")
    other = cli("run", "--config", str(with_alt), env={KEY_ENV: "a different key, 16 bytes or more"})
    assert other.returncode == 78 and "another hash key" in other.stderr, other.stderr[-3000:]


@pytest.mark.e2e
def test_an_excluded_key_column_is_refused(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _source(pgdb)
    config = _write_config(tmp_path, pgdb, slot, pub, people='exclude = ["id"]')
    refused = cli("bootstrap", "--config", str(config), env={KEY_ENV: KEY})
    assert refused.returncode == 78, refused.stderr[-3000:]
    assert "exclude names key column(s) ['id']" in refused.stderr


@pytest.mark.e2e
def test_a_partitioned_tables_settings_hold_for_its_partitions(pgdb: str, tmp_path: Path) -> None:
    """Set on the root, hashed in every leaf's Delta table (published without publish_via_partition_root,
    each partition lands as its own table), in the copy and in the changes."""
    lake = tmp_path / "lake"
    tag = uuid.uuid4().hex[:8]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA gov")
        conn.execute("CREATE TABLE gov.events (id int, part int, email text, note text, PRIMARY KEY (id, part)) PARTITION BY LIST (part)")
        conn.execute("CREATE TABLE gov.events_1 PARTITION OF gov.events FOR VALUES IN (1)")
        conn.execute("CREATE TABLE gov.events_2 PARTITION OF gov.events FOR VALUES IN (2)")
        conn.execute(f"CREATE PUBLICATION gov_{tag} FOR TABLE gov.events")
        conn.execute("INSERT INTO gov.events SELECT g, 1 + g % 2, 'rawmail' || g || '@example.org', 'clearnote' || g "
                     "FROM generate_series(1, 20) g")
    config = tmp_path / "p.toml"
    config.write_text("\n".join([
        "[source]", f"dsn = {json.dumps(pgdb)}", f'slot = "gov_{tag}"', f'publication = "gov_{tag}"',
        "[lake]", f'root = "{lake}"', f'hash_key_env = "{KEY_ENV}"',
        '[tables."gov.events"]', 'hash = ["email"]', 'exclude = ["note"]',
    ]) + "\n")
    env = {KEY_ENV: KEY}
    outputs = []
    for step in ("bootstrap", "run"):
        done = cli(step, "--config", str(config), "-v", env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs += [done.stdout, done.stderr]
        with psycopg.connect(pgdb, autocommit=True) as conn:
            conn.execute(f"UPDATE gov.events SET email = 'rawmail-{step}' || id || '@example.org' WHERE id % 3 = 0")
            conn.execute(f"INSERT INTO gov.events VALUES ({len(step)}00, 2, 'rawmail{step}@example.org', 'clearnote')")
    done = cli("run", "--config", str(config), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for leaf in ("events_1", "events_2"):
        got = sorted((r["id"], r["email"]) for r in read_delta(lake / "gov" / leaf).to_pylist())
        want = sorted((i, h(e)) for i, e in _pg(pgdb, f"SELECT id, email FROM gov.{leaf}"))
        assert got == want and got
        assert "note" not in read_delta(lake / "gov" / leaf).column_names
    _assert_no_raw([lake], [*outputs, done.stdout, done.stderr], "partitions", control=False)
