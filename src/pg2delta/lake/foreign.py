"""Commits pg2delta did not write: a lake changed behind its back.

Readers read a Delta table's latest version. When another writer (a stray job, a hand fix with
delta-rs or Spark) deletes or updates rows after pg2delta's last commit, the lake no longer holds
the source's state, and a run that merged on top would hide the damage under its own commits.
So a run looks, before it writes a table, at the commits since pg2delta's last one
(:func:`foreign_commits`), ``pg2delta verify`` reports them with the keys they damaged, and
``pg2delta status`` flags the table.

How pg2delta's own commits are told apart, read from each commit's JSON in ``_delta_log``:

* the mark: every commit pg2delta makes carries ``commitInfo.userMetadata = "pg2delta"``
  (:data:`MARK`): its writers' ``userMetadata`` option on every engine, Apache Spark's session
  setting :data:`USER_METADATA` for its SQL commits, delta-rs's commit properties;
* a Delta ``txn`` action whose ``appId`` starts with ``pg2delta/`` (Apache Spark's idempotent
  writes, which older lakes' commits carry too);
* the embedded engine's SQL commits alone, which cannot carry a mark, by what they name (measured
  with pysail 0.7.2: its ``MERGE``, ``DELETE`` and ``UPDATE`` write no ``userMetadata`` whether
  :data:`USER_METADATA` is set or not, and no ``txn`` action for the ``txnAppId``/``txnVersion``
  options or settings; its writer's ``userMetadata`` option does land). Only in a commit whose
  ``engineInfo`` is pysail's (:data:`EMBEDDED_WRITER`) and that has no ``userMetadata``:
  pg2delta's ``MERGE`` names the source's ``_pg2delta_op`` column (an SCD2 history's ``MERGE`` its
  ``__pg2delta_action``) and its ``DELETE`` (or soft deletes' ``UPDATE``) of a truncate the
  predicate :data:`TRUNCATE_PREDICATE`, in ``commitInfo.operationParameters``;
* commits up to the version the applied log recorded for the table are pg2delta's by definition
  (a lake written before the mark keeps working: its commits are all logged).

A commit that changes no data (every ``add`` and ``remove`` with ``dataChange = false``, or none:
``OPTIMIZE``, ``VACUUM``, table properties) changes nothing readers read and is not counted, whoever
made it. Only the commits after pg2delta's newest one that changes rows are looked at (the log is
read backwards from the latest version, usually one file): the run never builds on a damaged table,
so commits before its own are its own or were seen when they were new. pg2delta's own commits that
change no row (``maintain``'s, a schema or property change: marked too) do not stop that look: a
compaction by ``maintain`` may come after another writer's commit to a table no window wrote.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pg2delta.errors import LakeChanged, LakeError
from pg2delta.lake.lake_files import Lake

log = logging.getLogger(__name__)

MARK = "pg2delta"  # commitInfo.userMetadata of pg2delta's commits
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"  # Delta's session setting for it
TRUNCATE_PREDICATE = "'_pg2delta_truncate' IS NOT NULL"  # the embedded engine's DELETE of a truncate
# What the embedded engine's SQL commits name (the last: pg2delta.apply.history.ACTION), and the
# start of its commits' engineInfo (pysail 0.7.2: "sail-delta-lake:0.7.2"): see the module docstring.
_FINGERPRINTS = ("_pg2delta_op", "_pg2delta_truncate", "__pg2delta_action")
EMBEDDED_WRITER = "sail"
_APP_PREFIX = "pg2delta/"


@dataclass(frozen=True, slots=True)
class ForeignCommit:
    """A commit of a Delta table that changed data and that pg2delta did not make."""

    version: int
    operation: str  # commitInfo.operation (DELETE, UPDATE, WRITE, MERGE...), or what happened instead
    engine: str  # commitInfo.engineInfo (or clientVersion): what made the commit
    timestamp_ms: int | None

    @property
    def when(self) -> str:
        if self.timestamp_ms is None:
            return "unknown time"
        return dt.datetime.fromtimestamp(self.timestamp_ms / 1000, tz=dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")

    def describe(self) -> str:
        return f"version {self.version}: {self.operation} by {self.engine} at {self.when}"

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "operation": self.operation, "engine": self.engine, "at": self.when}


@dataclass(frozen=True, slots=True)
class Damaged:
    """A Delta table of the lake with commits pg2delta did not make since its last one."""

    schema: str
    table: str
    logged_version: int | None  # the newest version the applied log records for it
    commits: tuple[ForeignCommit, ...]  # newest first

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    def describe(self) -> str:
        return f"{self.name} ({'; '.join(c.describe() for c in self.commits)})"


def own_commit(actions: Iterable[Mapping[str, Any]]) -> bool:
    """Whether one commit's actions carry pg2delta's marks (see the module docstring)."""
    fingerprinted = False
    for action in actions:
        if "txn" in action and str(action["txn"].get("appId") or "").startswith(_APP_PREFIX):
            return True
        info = action.get("commitInfo")
        if info is None:
            continue
        user = info.get("userMetadata")
        if str(user or "").startswith(MARK):
            return True
        writer = str(info.get("engineInfo") or info.get("clientVersion") or "")
        if user is None and writer.startswith(EMBEDDED_WRITER):
            params = json.dumps(info.get("operationParameters") or {})
            fingerprinted = any(f in params for f in _FINGERPRINTS)
    return fingerprinted


def changes_data(actions: Iterable[Mapping[str, Any]]) -> bool:
    """Whether one commit adds or removes rows (an ``add`` or ``remove`` with ``dataChange``)."""
    for action in actions:
        for kind in ("add", "remove"):
            if kind in action and action[kind].get("dataChange", True):
                return True
    return False


def _describe(version: int, actions: list[dict[str, Any]]) -> ForeignCommit:
    info: dict[str, Any] = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
    engine = str(info.get("engineInfo") or info.get("clientVersion") or "an unknown writer")
    ts = info.get("timestamp")
    return ForeignCommit(version, str(info.get("operation") or "unknown operation"), engine,
                         None if ts is None else int(ts))


@dataclass(frozen=True, slots=True)
class Commit:
    """One commit of a Delta table as the checks see it: what it was, whether it is pg2delta's own
    (:func:`own_commit`) and whether it changes rows (:func:`changes_data`)."""

    what: ForeignCommit
    own: bool
    data: bool


def read_commit(lake: Lake, uri: str, version: int) -> Commit | None:
    """Commit ``version`` of the Delta table at ``uri``, or None when its JSON is gone (log
    clean-up after a checkpoint). Each commit's JSON is read once per window
    (:attr:`Lake.commits_read`): a failed commit's look at what landed meanwhile
    (:mod:`pg2delta.lake.conflicts`) and the run's look after its commits (:func:`landed_between`)
    read the same versions."""
    key = (lake.fs_path(uri), version)
    known = lake.commits_read.get(key)
    if isinstance(known, Commit):
        return known
    name = f"{key[0]}/_delta_log/{version:020d}.json"
    try:
        with lake.fs.open_input_stream(name) as f:
            text = f.read().decode()
    except FileNotFoundError:
        return None
    except (OSError, pa.ArrowException) as exc:
        raise LakeError(f"cannot read commit {version} of {uri}: {exc}") from exc
    actions = [json.loads(line) for line in text.splitlines() if line.strip()]
    commit = Commit(_describe(version, actions), own_commit(actions), changes_data(actions))
    lake.commits_read[key] = commit
    return commit


def foreign_commits(lake: Lake, uri: str, logged_version: int | None) -> list[ForeignCommit]:
    """The commits of the Delta table at ``uri`` that changed data after pg2delta's newest one
    (newest first); ``logged_version``: the newest version the applied log records for it (None:
    none). A table gone, or whose latest version is below the logged one (replaced or deleted
    behind pg2delta's back), is one entry saying so."""
    return scan(lake, uri, logged_version, latest=lake.delta_version(uri))[0]


def scan(lake: Lake, uri: str, logged_version: int | None, *, latest: int | None) -> tuple[list[ForeignCommit], int | None]:
    """:func:`foreign_commits`, and the version of pg2delta's own newest commit when it is after
    ``logged_version`` (a commit the applied log does not record yet), else None. ``latest``: the
    table's latest version (None: there is no table), read by the caller."""
    if latest is None:
        if logged_version is None:
            return [], None
        return [ForeignCommit(logged_version, "the Delta table was deleted", "an unknown writer", None)], None
    if logged_version is not None and latest < logged_version:
        return [ForeignCommit(latest, f"the Delta table was replaced (latest version {latest}, "
                              f"pg2delta logged {logged_version})", "an unknown writer", None)], None
    found: list[ForeignCommit] = []
    floor = -1 if logged_version is None else logged_version
    for version in range(latest, floor, -1):
        commit = read_commit(lake, uri, version)
        if commit is None:
            break
        if commit.data:
            if commit.own:
                return found, version
            found.append(commit.what)
    return found, None


def commits_after(lake: Lake, uri: str, after: int | None, upto: int | None = None) -> list[Commit]:
    """Each commit of the Delta table at ``uri`` after version ``after`` (None: from the first) up
    to ``upto`` (default: the latest), newest first. A commit whose JSON is gone is left out."""
    latest = lake.delta_version(uri) if upto is None else upto
    first = 0 if after is None else after + 1
    found = (read_commit(lake, uri, v) for v in range(latest if latest is not None else first - 1, first - 1, -1))
    return [c for c in found if c is not None]


def landed_between(lake: Lake, uri: str, after: int | None, upto: int | None) -> list[ForeignCommit]:
    """The commits another writer made to the table at ``uri`` that change rows, after version
    ``after`` (None: the table did not exist) up to ``upto`` (the version after pg2delta's own
    commit of a window), newest first: what landed between a run's look at the table
    (:func:`scan`) and its commit, or on top of it before the run read its version, which the
    look before the next window would not see under pg2delta's own commit."""
    if upto is None or (after is not None and upto <= after):
        return []
    return [c.what for c in commits_after(lake, uri, after, upto) if c.data and not c.own]


def with_known(found: Iterable[ForeignCommit], known: Damaged | None) -> tuple[ForeignCommit, ...]:
    """``found`` and the commits remembered of the same table (:func:`remembered`), newest first."""
    commits = {c.version: c for c in (known.commits if known is not None else ())}
    commits.update((c.version, c) for c in found)
    return tuple(commits[v] for v in sorted(commits, reverse=True))


def last_logged_versions(rows: Iterable[Mapping[str, Any]], slot: str) -> dict[tuple[str, str], int]:
    """Per Delta table of ``slot`` (schema, table), the version of its newest applied-log row that has one."""
    newest: dict[tuple[str, str], tuple[int, int]] = {}
    for r in rows:
        if r.get("slot") != slot or not r.get("table_name") or r.get("delta_version") is None:
            continue
        name = (str(r.get("schema_name") or ""), str(r["table_name"]))
        point = (int(r["window_end"]), int(r["delta_version"]))
        if name not in newest or point > newest[name]:
            newest[name] = point
    return {name: version for name, (_, version) in newest.items()}


def damaged_tables(
    lake: Lake, logged: Mapping[tuple[str, str], int | None], known: Mapping[tuple[str, str], Damaged] | None = None,
    *, latest: Mapping[tuple[str, str], int | None] | None = None,
) -> list[Damaged]:
    """The tables of ``logged`` ((schema, table) -> last logged version) with foreign commits:
    found now after pg2delta's last commit, or ``known`` from before (:func:`remembered`).
    ``latest``: the tables' latest versions the caller read (the others are read here)."""
    out = []
    for (schema, table), version in sorted(logged.items()):
        uri = lake.table_uri(schema, table)
        now = latest[(schema, table)] if latest is not None and (schema, table) in latest else lake.delta_version(uri)
        found = scan(lake, uri, version, latest=now)[0]
        commits = with_known(found, known.get((schema, table)) if known else None)
        if commits:
            out.append(Damaged(schema, table, version, commits))
    return out


# --- damage pg2delta was told to build on (``pg2delta verify``), remembered until a resync ----------

REMEMBERED = "_pg2delta/foreign"  # under the lake root: slot-<slot>/<schema>/<table>.json


def _folder(lake: Lake, slot: str) -> str:
    return f"{lake.path}/{REMEMBERED}/slot-{slot}"


def remember(lake: Lake, slot: str, damaged: Iterable[Damaged]) -> None:
    """Keep what ``damaged`` found, for the runs, ``status`` and ``verify`` after a run that wrote
    over it (``pg2delta verify`` applies the slot up to its pinned LSN whatever the lake holds):
    pg2delta's own commits on top would otherwise hide the damage from :func:`foreign_commits`."""
    for d in damaged:
        path = f"{_folder(lake, slot)}/{d.schema}/{d.table}.json"
        body = json.dumps({"logged_version": d.logged_version, "commits": [c.to_json() | {"timestamp_ms": c.timestamp_ms}
                                                                           for c in d.commits]})
        try:
            lake.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            with lake.fs.open_output_stream(path) as out:
                out.write(body.encode())
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot record the foreign commits of {d.name} at {path}: {exc}") from exc
        log.warning("%s was changed behind pg2delta's back (%s); remembered until pg2delta resync copies it again",
                    d.name, "; ".join(c.describe() for c in d.commits))


def remembered(lake: Lake, slot: str) -> dict[tuple[str, str], Damaged]:
    """What :func:`remember` kept, per (schema, table)."""
    import pyarrow.fs as pafs

    out: dict[tuple[str, str], Damaged] = {}
    try:
        infos = lake.fs.get_file_info(pafs.FileSelector(_folder(lake, slot), recursive=True, allow_not_found=True))
        for info in infos:
            if info.type != pafs.FileType.File or not info.base_name.endswith(".json"):
                continue
            schema = info.path.rsplit("/", 2)[-2]
            table = info.base_name[: -len(".json")]
            with lake.fs.open_input_stream(info.path) as f:
                body = json.loads(f.read().decode())
            commits = tuple(ForeignCommit(int(c["version"]), str(c["operation"]), str(c["engine"]), c.get("timestamp_ms"))
                            for c in body["commits"])
            out[(schema, table)] = Damaged(schema, table, body.get("logged_version"), commits)
    except (OSError, pa.ArrowException, ValueError, KeyError) as exc:
        raise LakeError(f"cannot read {_folder(lake, slot)}: {exc}") from exc
    return out


def forget(lake: Lake, slot: str, tables: Iterable[tuple[str, str]]) -> None:
    """Drop what :func:`remember` kept of ``tables`` (copied again: ``pg2delta resync``)."""
    for schema, table in tables:
        path = f"{_folder(lake, slot)}/{schema}/{table}.json"
        try:
            lake.fs.delete_file(path)
        except FileNotFoundError:
            continue
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot remove {path}: {exc}") from exc
        log.info("%s.%s copied again: its foreign commits are forgotten", schema, table)


def refuse(damaged: Iterable[Damaged], *, during: bool = False) -> None:
    """Stop the run (exit :data:`pg2delta.errors.EXIT_LAKE_CHANGED`) before it writes over ``damaged``
    (``during``: the commits landed while it wrote them, under its own)."""
    found = list(damaged)
    if not found:
        return
    names = " ".join(d.name for d in found)
    said = ("another writer changed the lake while this run wrote it, under this run's commits, so the window "
            "is not logged, the slot did not move and the next runs write nothing over it: ") if during else (
            "the lake was changed behind pg2delta's back, so this run writes nothing over it: ")
    raise LakeChanged(
        said
        + "; ".join(d.describe() for d in found)
        + f". pg2delta verify shows the keys; pg2delta resync --table {names.replace(' ', ' --table ')} "
        "copies the table(s) again"
    )


__all__ = [
    "EMBEDDED_WRITER", "MARK", "REMEMBERED", "TRUNCATE_PREDICATE", "USER_METADATA", "Commit", "Damaged", "ForeignCommit",
    "changes_data",
    "commits_after", "damaged_tables", "foreign_commits", "forget", "landed_between", "last_logged_versions",
    "own_commit", "read_commit", "refuse", "remember",
    "remembered", "scan", "with_known",
]
