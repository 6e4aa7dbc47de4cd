"""Reads of Delta tables through the engine: schemas, rows, time travel, small aggregates.

Everything pg2delta asks a Delta table without changing it: its columns and types (as of a
version), whether it has rows, the rows of some keys (to fill unchanged TOAST), a version as a
DataFrame or temporary view, a bounded slice as Arrow, the high-water marks of the changelog
and the history. Where pysail 0.7.2 cannot time-travel (below the checkpoint ``_last_checkpoint``
names) the hint is removed (:meth:`pg2delta.lake.lake_files.Lake.drop_checkpoint_hint`) and the read
tried again; else an old version is read from the files its log lists
(:meth:`pg2delta.lake.lake_files.Lake.snapshot_at`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pg2delta.errors import LakeError
from pg2delta.lake.engine_session import EngineSession
from pg2delta.lake.lake_files import schema_at, without_float_bounds
from pg2delta.lake.sql import key_equal, quote

# The lake layer (engine.py and its parts) logs under one name, as when it was one module.
log = logging.getLogger("pg2delta.lake.engine")


class DeltaReads(EngineSession):
    """What the engine reads from Delta tables (no commit is made here)."""

    def table_types(self, uri: str, *, version: int | None = None) -> dict[str, str] | None:
        """The Delta table's columns and their Spark type names, in order (as of ``version``, default
        the latest); None if there is no table."""
        if self.lake.delta_version(uri) is None:
            return None
        logged = self.log_schema(uri, version)
        if logged is not None:
            return {f.name: f.dataType.simpleString() for f in logged.fields}
        try:
            reader = self.spark.read.format("delta")
            if version is not None:
                reader = reader.option("versionAsOf", version)
            schema = reader.load(uri).schema
        except Exception as exc:
            # The log could not tell (log_schema above), so neither can it here.
            at = "" if version is None else f" at version {version}"
            raise LakeError(f"cannot read the schema of {uri}{at}: {' '.join(str(exc).split())[:500]}") from exc
        return {f.name: f.dataType.simpleString() for f in schema.fields}

    def log_schema(self, uri: str, version: int | None = None) -> Any:
        """The Delta table's schema (a Spark ``StructType``) as of ``version`` (default the latest),
        from its log alone (:func:`pg2delta.lake.lake_files.schema_at`); None where the log cannot
        tell that way. No engine: loading a table costs Apache Spark jobs, and pysail a listing of
        the log and a read of its checkpoint, which grow with the log (tombstones, commits kept)."""
        from pyspark.sql.types import StructType

        text = schema_at(self.lake, uri, version)
        return None if text is None else StructType.fromJson(json.loads(text))

    def has_rows(self, uri: str, *, version: int | None = None) -> bool:
        """Whether the Delta table at ``uri`` (as of ``version``) holds any row; False if there is no table."""
        if self.lake.delta_version(uri) is None:
            return False
        try:
            return bool(self._read_version(uri, version).limit(1).count())
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot read {uri} at version {version}: {' '.join(str(exc).split())[:500]}") from exc

    def read_rows(
        self,
        uri: str,
        key_names: Sequence[str],
        keys: Sequence[tuple[object, ...]],
        columns: Sequence[str],
        *,
        version: int | None = None,
        nullable_keys: bool = False,
    ) -> list[dict[str, Any]]:
        """Rows of the Delta table whose key is one of ``keys`` (few: used to fill unchanged TOAST).

        With ``version``, the table as of that Delta version (time travel); columns the table
        did not have then come back as None. ``nullable_keys`` matches keys null-safely.
        """
        if not keys or self.lake.delta_version(uri) is None:
            return []
        keyset = pa.table({k: [key[i] for key in keys] for i, k in enumerate(key_names)})
        staged = self.lake.stage(keyset, f"lookup-{uuid.uuid4().hex}")
        key_view = f"pg2delta_keys_{uuid.uuid4().hex[:12]}"
        table_view = f"pg2delta_table_{uuid.uuid4().hex[:12]}"
        try:
            table = self._read_version(uri, version)
            present = set(table.columns)
            table.createOrReplaceTempView(table_view)
            self.spark.read.parquet(staged).createOrReplaceTempView(key_view)
        except Exception as exc:
            self.lake.unstage(staged)
            raise LakeError(f"cannot read {uri} at version {version}: {' '.join(str(exc).split())[:500]}") from exc
        try:
            nan_safe = self.nan_safe_keys(table.schema, key_names)
            on = " AND ".join(
                key_equal(f"t.{quote(k)}", f"k.{quote(k)}", nullable=nullable_keys, nan_safe=k in nan_safe)
                for k in key_names
            )
            cols = ", ".join(
                f"t.{quote(c)} AS {quote(c)}" if c == then else f"NULL AS {quote(c)}" if then is None
                else f"t.{quote(then)} AS {quote(c)}"
                for c, then in names_then(self, uri, version, present, [*key_names, *columns]).items()
            )
            rows = self._sql(f"SELECT {cols} FROM {table_view} AS t JOIN {key_view} AS k ON {on}", f"lookup in {uri}")
            return [r.asDict(recursive=True) for r in rows]
        finally:
            for view in (key_view, table_view):
                try:
                    self.spark.catalog.dropTempView(view)
                except Exception:
                    log.debug("could not drop temp view %s", view)
            self.lake.unstage(staged)

    def version_view(self, uri: str, version: int) -> AbstractContextManager[str]:
        """A temporary view of the Delta table at ``uri`` as of ``version``, dropped afterwards."""
        return self._temp_view(
            "pg2delta_version", lambda: self._read_version(uri, version), f"cannot read {uri} at version {version}"
        )

    def files_view(self, files: Sequence[str]) -> AbstractContextManager[str]:
        """A temporary view of the Parquet ``files`` (URIs of the lake's staging area), dropped afterwards."""
        return self._temp_view(
            "pg2delta_files", lambda: self.spark.read.parquet(*files), f"cannot read the staged files {files[0]}..."
        )

    @contextmanager
    def _temp_view(self, prefix: str, frame: Callable[[], Any], failure: str) -> Iterator[str]:
        """A temporary view of what ``frame`` reads, under a name of its own, dropped afterwards; a
        read that fails is a LakeError saying ``failure``."""
        view = f"{prefix}_{uuid.uuid4().hex[:12]}"
        try:
            frame().createOrReplaceTempView(view)
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"{failure}: {' '.join(str(exc).split())[:500]}") from exc
        try:
            yield view
        finally:
            try:
                self.spark.catalog.dropTempView(view)
            except Exception:
                log.debug("could not drop temp view %s", view)

    def renaming(self, uri: str, renames: Sequence[tuple[str, str]]) -> None:
        """The columns ``(old, new)`` of ``uri`` the window's plan renames: committed before its MERGE,
        after the reads of its unchanged TOAST, which find them under the old name (:func:`names_then`)."""
        self._renaming[uri] = list(renames)

    def read_version(self, uri: str, version: int | None) -> Any:
        """The Delta table at ``uri`` as of ``version`` (None: the latest) as a DataFrame."""
        return self._read_version(uri, version)

    def _read_version(self, uri: str, version: int | None) -> Any:
        """The Delta table at ``uri`` (as of ``version``) as a DataFrame."""
        if version is None:
            return self.spark.read.format("delta").load(uri)

        def as_of() -> Any:
            table = self.spark.read.format("delta").option("versionAsOf", version).load(uri)
            table.columns  # noqa: B018 -- resolves the snapshot now, so a failure is caught here
            return table

        try:
            return as_of()
        except Exception as exc:
            failed = exc
        # pysail 0.7.2 cannot time-travel below the checkpoint _last_checkpoint names (it writes one
        # every 10 commits, maintain too), and can once that hint is gone.
        if not self.classic and self.lake.drop_checkpoint_hint(uri):
            try:
                return as_of()
            except Exception as exc:
                failed = exc
        # Else the files the JSON commits list at that version, read as plain Parquet with that
        # version's schema.
        log.debug("time travel to version %d of %s failed (%s); reading its files", version, uri, failed)
        files, text = self.lake.snapshot_at(uri, version)
        if text is None:
            raise LakeError(f"cannot read {uri} at version {version}: no metadata") from failed
        from pyspark.sql.types import StructType

        schema = StructType.fromJson(json.loads(text))
        if not files:
            return self.spark.createDataFrame([], schema)
        if not self.classic:
            # pysail takes a footer's float statistics (its own Delta files have them, as delta-rs's
            # compacted ones do) as bounds of every value, NaN included (docs/engines/index.md, "Float NaN on
            # the embedded engine"): those files are read from copies without statistics, kept until
            # the engine stops.
            key = (uri, version)
            if key not in self._version_copies:
                folder = f"{self._copies_folder}/{len(self._version_copies)}"
                self._version_copies[key] = without_float_bounds(self.lake, files, folder)
            files = self._version_copies[key]
        return self.spark.read.schema(schema).parquet(*files)

    def read_table(self, uri: str) -> list[dict[str, Any]]:
        """All rows of a (small) Delta table, or [] if it does not exist."""
        if self.lake.delta_version(uri) is None:
            return []
        try:
            return [r.asDict(recursive=True) for r in self.spark.read.format("delta").load(uri).collect()]
        except Exception as exc:
            raise LakeError(f"cannot read {uri}: {' '.join(str(exc).split())[:500]}") from exc

    def max_of(self, uri: str, column: str) -> int | None:
        """The largest value of an integer column of the Delta table at ``uri`` (None: empty or missing)."""
        if self.lake.delta_version(uri) is None:
            return None
        rows = self._sql(f"SELECT max({quote(column)}) AS m FROM {self.target(uri)}", f"reading max({column}) of {uri}")
        value = rows[0]["m"] if rows else None
        return None if value is None else int(value)

    def history_high(self, uri: str, pairs: Sequence[tuple[str, str]]) -> int | None:
        """The largest of the ``(lsn, pos)`` column pairs' LSNs over rows whose position is not negative
        (an SCD2 history's window-written bounds, see history.py; None: empty or missing)."""
        if self.lake.delta_version(uri) is None:
            return None
        parts = ", ".join(
            f"max(CASE WHEN {quote(pos)} >= 0 THEN {quote(lsn)} END) AS m{i}" for i, (lsn, pos) in enumerate(pairs)
        )
        rows = self._sql(f"SELECT {parts} FROM {self.target(uri)}", f"reading the high-water LSN of {uri}")
        values = [int(v) for v in (rows[0] if rows else []) if v is not None]
        return max(values) if values else None

    def read_arrow(self, uri: str, where: str) -> pa.Table:
        """The rows of the Delta table at ``uri`` matching the SQL condition ``where``, as Arrow.

        They travel through a Parquet directory under the lake's staging area (Spark 3.5 has no
        Arrow collect); use it for bounded slices, not whole large tables.
        """
        rel = f"{self.lake.staging_rel}/export-{uuid.uuid4().hex}"
        local = f"{self.lake.path}/{rel}"
        try:
            self.spark.read.format("delta").load(uri).where(where).write.mode("overwrite").parquet(self.lake.table_uri(rel))
            infos = self.lake.fs.get_file_info(pafs.FileSelector(local, allow_not_found=True, recursive=True))
            files = sorted(i.path for i in infos if i.is_file and i.base_name.endswith(".parquet"))
            tables = [pq.read_table(f, filesystem=self.lake.fs) for f in files]
        except Exception as exc:
            raise LakeError(f"cannot read {uri} where {where}: {' '.join(str(exc).split())[:500]}") from exc
        finally:
            try:
                self.lake.fs.delete_dir(local)
            except (OSError, pa.ArrowException):
                log.debug("could not remove export directory %s", local)
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="permissive")

    def check_version(self, uri: str, version: int) -> None:
        """Raise :class:`LakeError` unless the Delta table at ``uri`` can be read as of ``version``."""
        try:
            _ = self._read_version(uri, version).columns
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(
                f"cannot read {uri} as of Delta version {version} (time travel): {' '.join(str(exc).split())[:300]}"
            ) from exc


def names_then(
    reads: DeltaReads, uri: str, version: int | None, present: set[str], columns: Sequence[str]
) -> dict[str, str | None]:
    """For each of ``columns`` (named as the table names them now), its name in the table ``uri`` as
    of ``version``, whose columns are ``present``; None for a column it did not have then.

    A table that maps columns by name (column mapping) renames a column in place: time travel to a
    version before the rename gives its values under the old name, which Delta's history of the
    ``RENAME COLUMN`` commits since ``version`` tells (Apache Spark only: the embedded engine does
    not write column-mapped tables), and before those the renames the window commits after its
    reads (:meth:`DeltaReads.renaming`). Used to fill unchanged TOAST from an older version."""
    out: dict[str, str | None] = {c: (c if c in present else None) for c in dict.fromkeys(columns)}
    absent = [c for c, then in out.items() if then is None]
    if not absent or not reads.classic:
        return out
    renames = list(reads._renaming.get(uri, ()))  # the window's, not committed yet
    latest = reads.lake.delta_version(uri)
    if version is not None and latest is not None and latest > version:
        try:
            history = reads.spark.sql(f"DESCRIBE HISTORY {reads.target(uri)} LIMIT {latest - version}").collect()
        except Exception as exc:  # pyspark raises many unrelated types
            raise LakeError(f"DESCRIBE HISTORY {uri} failed: {' '.join(str(exc).split())[:500]}") from exc
        committed = sorted(
            ((int(r["version"]), dict(r["operationParameters"] or {}))
             for r in history if r["operation"] == "RENAME COLUMN" and int(r["version"]) > version),
            key=lambda vp: vp[0],
        )
        renames = [(_unquoted(p.get("oldColumnPath", "")), _unquoted(p.get("newColumnPath", ""))) for _, p in committed] + renames
    for c in absent:
        name = c
        for old, new in reversed(renames):  # newest first: back to the name at ``version``
            if new == name:
                name = old
        out[c] = name if name != c and name in present else None
    return out


def _unquoted(path: str) -> str:
    """A top-level column's name from Delta's column path (backquoted when it holds a dot)."""
    return path[1:-1].replace("``", "`") if len(path) > 1 and path[0] == path[-1] == "`" else path
