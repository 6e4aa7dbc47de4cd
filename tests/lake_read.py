"""Delta tables read back with delta-rs, deletion vectors included.

delta-rs's ``to_pyarrow_table`` refuses a table whose protocol names the ``deletionVectors`` reader
feature (deltalake 1.6), which the tables pg2delta creates on Apache Spark have. Its DataFusion
``scan`` reads them, but as view types (``string_view``) that pyarrow 15, the oldest pyarrow the
tests run on, cannot cast back. So a table with deletion vectors is read as delta-rs describes it:
its data files as of the version (``file_uris``), each less the rows its deletion vector removes
(``deletion_vectors``, decoded by delta-rs), in the table's Arrow schema. Tables without them are
read by ``to_pyarrow_table``, as before.
"""

from __future__ import annotations

from pathlib import Path
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
    if "deletionVectors" not in (table.protocol().reader_features or []):
        return table.to_pyarrow_table(columns=columns)
    schema = pa.schema(table.schema().to_arrow())
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    vectors = pa.table(table.deletion_vectors().read_all()).to_pylist()
    keep = {_local(str(r["filepath"])) if not str(path).startswith("s3://") else str(r["filepath"]).removeprefix("s3://"):
            r["selection_vector"] for r in vectors}
    fs = _s3(storage_options) if str(path).startswith("s3://") else None
    parts = []
    for uri in table.file_uris():
        local = _local(uri) if fs is None else uri.removeprefix("s3://")
        data = pq.read_table(local, filesystem=fs)
        part = pa.table(
            [data.column(f.name).cast(f.type) if f.name in data.column_names else pa.nulls(data.num_rows, f.type) for f in schema],
            schema=schema,
        )
        mask = keep.get(local)
        if mask is not None:  # True: the row is kept; rows past the vector's end are
            part = part.filter(pa.array(list(mask) + [True] * (part.num_rows - len(mask))))
        parts.append(part)
    return pa.concat_tables(parts) if parts else schema.empty_table()


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
