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
import pyarrow.parquet as pq
from deltalake import DeltaTable


def read_delta(path: str | Path, version: int | None = None, *, columns: list[str] | None = None) -> pa.Table:
    """The rows of the Delta table at ``path`` (as of ``version``; only ``columns``)."""
    table = DeltaTable(str(path), version=version)
    if "deletionVectors" not in (table.protocol().reader_features or []):
        return table.to_pyarrow_table(columns=columns)
    schema = pa.schema(table.schema().to_arrow())
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    vectors = pa.table(table.deletion_vectors().read_all()).to_pylist()
    keep = {_local(str(r["filepath"])): r["selection_vector"] for r in vectors}
    parts = []
    for uri in table.file_uris():
        local = _local(uri)
        data = pq.read_table(local)
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
