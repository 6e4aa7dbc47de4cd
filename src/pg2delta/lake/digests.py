"""Digests of a small Delta table's big data files: the rows of each that a reduction keeps, kept
in the lake so that a new process reads those instead of the file.

The applied log gains a row per window and table (about 105,000 a year for one table on a
five-minute schedule) and every run reduces it to the few rows its readers decide by
(``pg2delta.lake.applied_log.deciding_rows``). Maintenance compacts it into a few big files, which
then stay as they are for many runs: a Delta data file is written once and never changed. A run
that reads such a file without a digest reduces it and writes the digest; later runs read the
digest. That is only right for a reduction that makes the same of the digests, concatenated in
the log's order, as of the whole table: one that keeps the newest rows of groups, ties included,
or each group's first row, does (tests/test_applied_log_rows.py checks that of the applied log's).

A digest is named by the data file's path and size as the Delta log gives them, under a folder
named after the reduction and its version (``Digest.name``): a reduction that would keep rows an
older one dropped must come with a new name. A digest that cannot be read or written is not
there: the file is read and reduced again, which is what a process without digests does.
Maintenance removes the digests of files the table no longer has (:func:`clean`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

DIGESTS_ROOT = "_pg2delta/digests"

log = logging.getLogger("pg2delta.lake.engine")


@dataclass(frozen=True, slots=True)
class Digest:
    """A reduction of a table's data files that may be kept, one digest a file (see the module)."""

    name: str  # the folder under DIGESTS_ROOT: the reduction and its version
    reduce: Callable[[pa.Table], pa.Table]  # a data file's rows -> the rows it keeps (same schema)
    min_bytes: int = 256 * 1024  # smaller files are read whole: a digest would cost a request more


def folder(fs_root: str, digest: Digest) -> str:
    """Where ``digest``'s files are, for the lake whose root is ``fs_root`` on its filesystem."""
    return f"{fs_root}/{DIGESTS_ROOT}/{digest.name}"


def digest_name(path: str, size: int) -> str:
    """The digest's file name for the data file ``path`` (as the Delta log names it) of ``size`` bytes."""
    return hashlib.sha256(f"{path}\0{size}".encode()).hexdigest()[:40] + ".parquet"


def read_reduced(fs: pafs.FileSystem, fs_root: str, digest: Digest, path: str, full: str, size: int) -> pa.Table:
    """What ``digest`` keeps of the data file ``path`` (at ``full`` on ``fs``): its digest, or the
    file reduced, the digest then written. Errors reading the file itself are the caller's."""
    kept = f"{folder(fs_root, digest)}/{digest_name(path, size)}"
    try:
        with fs.open_input_file(kept) as f:
            return pq.read_table(f)
    except (OSError, pa.ArrowException):
        pass  # none yet, or one cut short: made again
    with fs.open_input_file(full) as f:
        reduced = digest.reduce(pq.read_table(f))
    _write(fs, kept, reduced)
    return reduced


def _write(fs: pafs.FileSystem, path: str, table: pa.Table) -> None:
    """Write ``table`` at ``path`` whole or not at all (a file beside it, then moved over): a
    reader never sees half of it. A failure leaves no digest, which only costs a later read."""
    part = f"{path}.{uuid.uuid4().hex}.part"
    try:
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(part) as out:
            pq.write_table(table, out, compression="zstd")
        fs.move(part, path)
    except (OSError, pa.ArrowException) as exc:
        log.debug("could not keep the digest %s: %s", path, exc)
        with contextlib.suppress(OSError, pa.ArrowException):
            fs.delete_file(part)


def clean(fs: pafs.FileSystem, fs_root: str, digest: Digest, files: Iterable[tuple[str, int]]) -> int:
    """Remove ``digest``'s files but those of ``files`` ((path, size): the table's data files now),
    and those of digests older versions kept; returns how many it removed."""
    keep = {digest_name(p, s) for p, s in files}
    removed = 0
    mine = folder(fs_root, digest)
    base = mine.rsplit("/", 1)[0]
    try:
        found = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=True))
    except (OSError, pa.ArrowException) as exc:
        log.warning("could not list the digests under %s: %s", base, exc)
        return 0
    own = digest.name.split("-", 1)[0]  # the reduction's folders, this version's and older ones
    for info in found:
        if info.type != pafs.FileType.File:
            continue
        parent, name = info.path.rsplit("/", 1)
        if parent == mine and name in keep:
            continue
        if parent != mine and parent.rsplit("/", 1)[-1].split("-", 1)[0] != own:
            continue  # another reduction's
        try:
            fs.delete_file(info.path)
            removed += 1
        except (OSError, pa.ArrowException) as exc:
            log.warning("could not remove the digest %s: %s", info.path, exc)
    return removed


__all__ = ["DIGESTS_ROOT", "Digest", "clean", "digest_name", "folder", "read_reduced"]
