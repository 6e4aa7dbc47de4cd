"""Delta tables read back with delta-rs, deletion vectors and column mapping included.

delta-rs's ``to_pyarrow_table`` refuses a table whose protocol names the ``deletionVectors`` reader
feature (deltalake 1.6), which the tables pg2delta creates on Apache Spark have. Its DataFusion
``scan`` reads them, but as view types (``string_view``) that pyarrow 15, the oldest pyarrow the
tests run on, cannot cast back. So a table with deletion vectors is read as delta-rs describes it:
its data files as of the version (``file_uris``), each less the rows its deletion vector removes
(``deletion_vectors``, decoded by delta-rs), in the table's Arrow schema. Tables without them are
read by ``to_pyarrow_table``, as before. ``to_pyarrow_table`` refuses column mapping too: such a
table's files are read the same way, their columns renamed from their physical names, partition
values taken from the table's add actions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import DeltaTable


def read_delta(
    path: str | Path, version: int | None = None, *, columns: list[str] | None = None,
    storage_options: dict[str, str] | None = None,
) -> pa.Table:
    """The rows of the Delta table at ``path`` (as of ``version``; only ``columns``; on an S3 server
    with delta-rs's ``storage_options``)."""
    table = DeltaTable(str(path), version=version, storage_options=storage_options)
    readers = table.protocol().reader_features or []
    if not {"deletionVectors", "columnMapping"} & set(readers):
        return table.to_pyarrow_table(columns=columns)
    fields = [f for f in table.schema().fields if columns is None or f.name in columns]
    schema = pa.schema([pa.schema(table.schema().to_arrow()).field(f.name) for f in fields])
    physical = {f.name: str(f.metadata.get("delta.columnMapping.physicalName", f.name)) for f in fields}
    vectors = pa.table(table.deletion_vectors().read_all()).to_pylist() if "deletionVectors" in readers else []
    s3 = str(path).startswith("s3://")
    keep = {_local(str(r["filepath"])) if not s3 else str(r["filepath"]).removeprefix("s3://"): r["selection_vector"] for r in vectors}
    fs = _s3(storage_options) if s3 else None
    root = str(path).removeprefix("s3://").rstrip("/") if s3 else _local(str(path)).rstrip("/")
    parts = []
    for add in pa.table(table.get_add_actions(flatten=True)).to_pylist():
        rel = unquote(str(add["path"]))
        local = rel if rel.startswith("/") else f"{root}/{rel}"
        data = pq.read_table(local, filesystem=fs)
        cols = []
        for f in schema:
            name = physical[f.name]
            if name in data.column_names:
                cols.append(data.column(name).cast(f.type))
            elif f"partition.{f.name}" in add or f"partition.{name}" in add:
                value = add.get(f"partition.{f.name}", add.get(f"partition.{name}"))
                cols.append(pa.array([value] * data.num_rows).cast(f.type))
            else:
                cols.append(pa.nulls(data.num_rows, f.type))
        part = pa.table(cols, schema=schema)
        mask = keep.get(local)
        if mask is not None:  # True: the row is kept; rows past the vector's end are
            part = part.filter(pa.array(list(mask) + [True] * (part.num_rows - len(mask))))
        parts.append(part)
    return pa.concat_tables(parts) if parts else schema.empty_table()


def data_commits(path: str | Path) -> int:
    """How many commits of the Delta table at ``path`` are not a change of its properties alone (the
    embedded engine turns deletion vectors on for a bootstrap's adopted copy in a commit of its own)."""
    return sum(1 for h in DeltaTable(str(path)).history() if h.get("operation") != "SET TBLPROPERTIES")



def last_commit(table: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """The newest commit of the local Delta table at ``table``: its commitInfo, adds and removes."""
    newest = sorted((table / "_delta_log").glob("*.json"))[-1]
    actions = [json.loads(line) for line in newest.read_text().splitlines() if line.strip()]
    info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
    return info, [a["add"] for a in actions if "add" in a], [a["remove"] for a in actions if "remove" in a]


def key_ranges(table: Path, key: str = "id") -> dict[str, tuple[int, int]]:
    """The live data files of the Delta table at ``table`` and the range of ``key`` their statistics give."""
    rows = pa.table(DeltaTable(str(table)).get_add_actions(flatten=True)).to_pylist()
    return {str(r["path"]): (int(r[f"min.{key}"]), int(r[f"max.{key}"])) for r in rows}

def has_deletion_vectors(path: str | Path) -> bool:
    """Whether the Delta table at ``path`` uses deletion vectors (its protocol's reader feature)."""
    return "deletionVectors" in (DeltaTable(str(path)).protocol().reader_features or [])


def _local(uri: str) -> str:
    return unquote(urlparse(uri).path) if "://" in uri else uri


def _s3(options: dict[str, str] | None) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem for delta-rs's ``storage_options`` of an S3(-compatible) server."""
    o = options or {}
    endpoint = o.get("AWS_ENDPOINT_URL", "")
    return pafs.S3FileSystem(
        access_key=o.get("AWS_ACCESS_KEY_ID"), secret_key=o.get("AWS_SECRET_ACCESS_KEY"), region=o.get("AWS_REGION", "us-east-1"),
        endpoint_override=endpoint.split("://", 1)[-1] or None, scheme="http" if endpoint.startswith("http://") else "https",
    )
