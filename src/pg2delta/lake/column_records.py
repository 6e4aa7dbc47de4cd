"""What form each Delta table's columns were landed in: which are hashed, which left out, under
which hash key (a one-way fingerprint), so that a run under other ``hash``/``exclude`` settings or
another key is refused instead of landing a mix of raw and hashed values
(``docs/concepts/column-governance.md``).

One small JSON file per Delta table with such columns, under the lake root:
``_pg2delta/columns/<schema>/<table>.json`` holding :meth:`pg2delta.decode.governance.ColumnRules.record`.
No file: every column landed as it is. A copy (bootstrap, resync) writes the file of the form it
landed once its commit is done (or removes it); a run writes it before a window creates the table.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from pg2delta.errors import LakeError
from pg2delta.lake.lake_files import Lake

RECORDS = "_pg2delta/columns"  # under the lake root: <schema>/<table>.json

Record = dict[str, Any]


def _path(lake: Lake, schema: str, table: str) -> str:
    return f"{lake.path}/{RECORDS}/{schema}/{table}.json"


def read_records(lake: Lake) -> dict[tuple[str, str], Record]:
    """Every table's record, per (schema, table): one listing, then the few files there are."""
    out: dict[tuple[str, str], Record] = {}
    folder = f"{lake.path}/{RECORDS}"
    try:
        for info in lake.fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True)):
            if info.type != pafs.FileType.File or not info.base_name.endswith(".json"):
                continue
            schema = info.path.rsplit("/", 2)[-2]
            with lake.fs.open_input_stream(info.path) as f:
                out[(schema, info.base_name[: -len(".json")])] = json.loads(f.read().decode())
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise LakeError(f"cannot read the column records under {folder}: {exc}") from exc
    return out


def write_record(lake: Lake, schema: str, table: str, record: Record | None) -> None:
    """Record the form ``schema.table`` lands its columns in (None: as they are, the file removed)."""
    path = _path(lake, schema, table)
    try:
        if record is None:
            with contextlib.suppress(FileNotFoundError):
                lake.fs.delete_file(path)
            return
        lake.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with lake.fs.open_output_stream(path) as out:
            out.write(json.dumps(record, sort_keys=True).encode())
    except (OSError, pa.ArrowException) as exc:
        raise LakeError(f"cannot record the hashed and excluded columns of {schema}.{table} at {path}: {exc}") from exc


def describe(record: Record | None) -> str:
    """``hash [a, b], exclude [c]``, or ``every column as it is``; with the key's fingerprint."""
    if not record:
        return "every column as it is"
    parts = [f"{k} [{', '.join(record.get(k) or [])}]" for k in ("hash", "exclude") if record.get(k)]
    if record.get("key"):
        parts.append(f"key fingerprint {record['key']}")
    return ", ".join(parts)


__all__ = ["RECORDS", "Record", "describe", "read_records", "write_record"]
