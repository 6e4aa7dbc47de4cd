"""The lake's files, read and written with pyarrow alone: no Spark session.

What pg2delta needs from a lake without asking an engine: whether it is writable, a Delta
table's latest version and its files replayed from the log (the applied log is read this way,
and old versions where the engine cannot time-travel), and the staging area where changes wait
as Parquet for the engine to read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pg2delta.errors import LakeError, store_unavailable
from pg2delta.lake import digests
from pg2delta.lake.digests import Digest

# The lake layer (engine.py and its parts) logs under one name, as when it was one module.
log = logging.getLogger("pg2delta.lake.engine")


def s3_filesystem(env: Mapping[str, str] | None = None) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem, addressed as delta-rs and pysail address the store: by the standard
    variables (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
    ``AWS_VIRTUAL_HOSTED_STYLE_REQUEST``; ``pg2delta.config`` sets them from ``[lake]``), given
    explicitly because older pyarrow (15) reads no endpoint from the environment. Credentials
    come from the AWS SDK's own chain (environment, profile, instance role), never from here."""
    env = os.environ if env is None else env
    kwargs: dict[str, object] = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        scheme, _, rest = endpoint.partition("://")
        kwargs["endpoint_override"], kwargs["scheme"] = (rest, scheme) if rest else (endpoint, "https")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    if env.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "").lower() == "true":
        kwargs["force_virtual_addressing"] = True  # pyarrow 16+; path style is its default
    # As many retries as delta-rs's and pysail's object_store make (10, with backoff), in the AWS
    # SDK's default mode: its standard mode stops retrying once its retry quota is spent, and a
    # throttling store (503 SlowDown on one request in four) then failed the listings and staging
    # writes of a run whose commits, through object_store, rode it out (tests/test_object_store_faults.py).
    kwargs["retry_strategy"] = pafs.AwsDefaultS3RetryStrategy(max_attempts=10)
    try:
        return pafs.S3FileSystem(**kwargs)
    except TypeError as exc:
        raise LakeError(f"pyarrow {pa.__version__} cannot address this store as asked: {exc}") from exc


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for a lake URI (Hadoop's s3a:// is plain S3 to pyarrow)."""
    if uri.startswith("s3a://"):
        uri = "s3://" + uri[len("s3a://") :]
    if uri.startswith("s3://"):
        return s3_filesystem(), uri[len("s3://") :].rstrip("/")
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, ValueError):
        fs, path = pafs.LocalFileSystem(), uri
    return fs, path


STAGING_ROOT = "_pg2delta/staging"
STAGE_ATTEMPTS = 5  # writes of one staging file, 0.5, 1, 2 and 4 s apart, while the store throttles


def _float_bounds(metadata: pq.FileMetaData) -> bool:
    """Whether a Parquet footer holds the minimum and maximum of a float column in a row group."""
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for column in range(row_group.num_columns):
            chunk = row_group.column(column)
            if chunk.physical_type in ("FLOAT", "DOUBLE") and chunk.is_stats_set and chunk.statistics.has_min_max:
                return True
    return False


@dataclass
class _TableRead:
    """A small Delta table :meth:`Lake.read_delta` read: its data files by path as the log names
    them (in that order), the table made of them, and what :meth:`Lake.made_of` made of it."""

    pieces: dict[str, pa.Table]
    table: pa.Table
    made: dict[Callable[[pa.Table], Any], Any] = field(default_factory=dict)


def _read_key(uri: str, digest: Digest | None) -> str:
    """What :meth:`Lake.read_delta` keeps a table's read under: its digested read apart from its whole one."""
    return uri if digest is None else f"{uri}#{digest.name}"


class Lake:
    """Files under the lake root: Delta logs and staged Parquet, through pyarrow's filesystems."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        self.fs, self.path = _filesystem(self.root)
        # Where this process stages: the shared area, or once the process holds a slot's lock the
        # slot's own folder in it (:meth:`own_staging`), which nobody else writes.
        self.staging_rel = STAGING_ROOT
        # Commits of Delta tables already read, (table path, version) -> what pg2delta.lake.foreign
        # made of them: a commit's JSON is written once. The run empties it at each window's first
        # look at its tables (a table deleted and made again by another writer is read afresh).
        self.commits_read: dict[tuple[str, int], Any] = {}
        # Set by a run that writes over another writer's commits, remembered (verify's, pg2delta.job):
        # called with a table's URI and the ForeignCommits that landed while pg2delta committed to it;
        # True: remembered, the commit is made again over them (pg2delta.lake.conflicts). Else exit 21.
        self.remember_foreign: Callable[[str, Sequence[Any]], bool] | None = None
        # What :meth:`read_delta` read, by table URI: its data files (a Delta data file is written
        # once and never changed), the table made of them and what was made of it, so that a
        # run reading the applied log several times reads each file once and a file set it has
        # seen not at all.
        self._read: dict[str, _TableRead] = {}

    def own_staging(self, slot: str) -> int:
        """Stage under the slot's own folder of the staging area from now on, and empty it first:
        what is there was left by a killed process of this slot (a spilled window can be gigabytes),
        and the caller holds the slot's lock, so no other process writes there. Returns how many
        entries it removed."""
        self.staging_rel = f"{STAGING_ROOT}/slot-{slot}"
        folder = f"{self.path}/{self.staging_rel}"
        try:
            left = self.fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
            if left:
                self.fs.delete_dir_contents(folder, missing_dir_ok=True)
                log.info("removed %d staging entries a killed process of slot %s left", len(left), slot)
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot empty the staging folder {folder}: {exc}") from exc
        return len(left)

    def table_uri(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def fs_path(self, uri: str) -> str:
        """``uri`` (of this lake) as a path of :attr:`fs`."""
        for scheme in ("s3://", "s3a://"):
            if uri.startswith(scheme):
                return uri[len(scheme) :].rstrip("/")
        return _filesystem(uri)[1]

    def exists(self, uri: str) -> bool:
        """Whether a file or folder is at ``uri`` (a path of the lake's filesystem)."""
        return bool(self.fs.get_file_info(self.fs_path(uri)).type != pafs.FileType.NotFound)

    def check_writable(self) -> None:
        probe = f"{self.path}/_pg2delta/.write-probe-{uuid.uuid4().hex}"
        try:
            self.fs.create_dir(f"{self.path}/_pg2delta", recursive=True)
            with self.fs.open_output_stream(probe) as out:
                out.write(b"ok")
            self.fs.delete_file(probe)
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot write to the lake at {self.root}: {exc}") from exc

    def delta_version(self, uri: str) -> int | None:
        """The latest commit version of the Delta table at ``uri``, or None if there is none."""
        commits, _ = _log_listing(self.fs, f"{self.fs_path(uri)}/_delta_log")
        return max(commits) if commits else None

    def drop_checkpoint_hint(self, uri: str) -> bool:
        """Remove the Delta table's ``_delta_log/_last_checkpoint``; True when there was one.

        The file only points readers at the newest checkpoint, which they otherwise find by
        listing the log (Delta's protocol makes it optional). pysail 0.7.2 follows it and then
        cannot time-travel below that checkpoint; without it, it can (measured here).
        """
        hint = f"{self.fs_path(uri)}/_delta_log/_last_checkpoint"
        try:
            if self.fs.get_file_info(hint).type == pafs.FileType.NotFound:
                return False
            self.fs.delete_file(hint)
        except FileNotFoundError:
            return False
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot remove {hint}: {exc}") from exc
        return True

    def snapshot_at(self, uri: str, version: int) -> tuple[list[str], str | None]:
        """The data files and the schema (Spark's StructType JSON) of the Delta table at ``uri`` as
        of ``version``, replayed from its JSON commits.

        For reading an old version where the engine cannot time-travel (pysail 0.7.2 fails for any
        version below its latest checkpoint, though the commits are all there). Refuses what
        plain Parquet files cannot express: deletion vectors and column mapping.
        """
        local = self.fs_path(uri)
        files: dict[str, None] = {}
        schema: str | None = None
        for v in range(version + 1):
            name = f"{local}/_delta_log/{v:020d}.json"
            try:
                with self.fs.open_input_stream(name) as f:
                    lines = f.read().decode().splitlines()
            except (OSError, pa.ArrowException) as exc:
                raise LakeError(f"cannot read version {version} of {uri}: commit {v} is gone ({exc})") from exc
            for action in _replay_order(lines):
                if "remove" in action:
                    files.pop(unquote(action["remove"]["path"]), None)
                elif "add" in action:
                    if action["add"].get("deletionVector"):
                        raise LakeError(f"cannot read version {version} of {uri} from its files: it has deletion vectors")
                    files[unquote(action["add"]["path"])] = None
                elif "metaData" in action:
                    conf = action["metaData"].get("configuration") or {}
                    if conf.get("delta.columnMapping.mode", "none") != "none":
                        raise LakeError(f"cannot read version {version} of {uri} from its files: it uses column mapping")
                    schema = action["metaData"].get("schemaString")
        return [p if "://" in p or p.startswith("/") else f"{uri}/{p}" for p in files], schema

    def files_now(self, uri: str) -> tuple[int, dict[str, int]] | None:
        """The latest version of the Delta table at ``uri`` and its data files with their sizes in
        bytes (paths as the log names them), from its log alone: the newest classic checkpoint
        (single or multi-part Parquet) and the JSON commits after it. None when there is no table;
        a LakeError when the log cannot be read this way (a V2 checkpoint and no JSON commits
        before it)."""
        return self._replayed(uri, lambda add: int(add.get("size") or 0))

    def stats_now(self, uri: str) -> tuple[int, dict[str, dict[str, Any]]] | None:
        """As :meth:`files_now`, with each data file's statistics (``numRecords``, ``minValues``,
        ``maxValues``, ``nullCount``, by the columns' physical names) in place of its size; ``{}``
        for a file the log gives none."""
        return self._replayed(uri, _stats_of)

    def _replayed(self, uri: str, keep: Callable[[dict[str, Any]], Any]) -> tuple[int, dict[str, Any]] | None:
        """The latest version of the Delta table at ``uri`` and, by data file, what ``keep`` makes
        of its ``add`` action, replayed from the log as :meth:`files_now` says."""
        local = self.fs_path(uri)
        log_dir = f"{local}/_delta_log"
        commits, parts = _log_listing(self.fs, log_dir)
        if not commits:
            return None
        latest = max(commits)
        complete = [v for (v, n), names in parts.items() if len(names) == n and v <= latest]
        start = max(complete) if complete else -1
        files: dict[str, Any] = {}
        try:
            if start >= 0:
                n = next(n for (v, n) in parts if v == start and len(parts[(v, n)]) == n)
                for name in sorted(parts[(start, n)]):
                    with self.fs.open_input_file(name) as f:
                        table = pq.read_table(f, columns=["add"])
                    for add in table.column("add").to_pylist():
                        if add is not None:
                            files[unquote(add["path"])] = keep(add)
            for v in range(start + 1, latest + 1):
                with self.fs.open_input_stream(f"{log_dir}/{v:020d}.json") as f:
                    lines = f.read().decode().splitlines()
                for action in _replay_order(lines):
                    if "remove" in action:
                        files.pop(unquote(action["remove"]["path"]), None)
                    elif "add" in action:
                        files[unquote(action["add"]["path"])] = keep(action["add"])
        except (OSError, pa.ArrowException, KeyError, StopIteration, ValueError) as exc:
            raise LakeError(f"cannot read the Delta log of {uri}: {exc}") from exc
        return latest, files

    def read_delta(self, uri: str, digest: Digest | None = None) -> pa.Table | None:
        """A small, unpartitioned Delta table pg2delta wrote (its applied log), read with pyarrow from
        the files its log lists: no engine. Columns added later are null in older files. With
        ``digest``, what it keeps of each file of ``digest.min_bytes`` or more (pg2delta.lake.digests).

        The same table object again while the log lists the same files (the log is read each
        time); of a changed set, only the files not read before are read."""
        found = self.files_now(uri)
        key = _read_key(uri, digest)
        if found is None:
            self._read.pop(key, None)
            return None
        names = sorted(found[1])
        before = self._read.get(key)
        if before is not None and list(before.pieces) == names:
            return before.table
        seen = before.pieces if before is not None else {}
        pieces: dict[str, pa.Table] = {}
        try:
            for path in names:
                if path in seen:
                    pieces[path] = seen[path]
                    continue
                full = self.fs_path(path if "://" in path or path.startswith("/") else f"{self.fs_path(uri)}/{path}")
                if digest is not None and found[1][path] >= digest.min_bytes:
                    pieces[path] = digests.read_reduced(self.fs, self.path, digest, path, full, found[1][path])
                    continue
                with self.fs.open_input_file(full) as f:
                    pieces[path] = pq.read_table(f)
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot read {uri}: {exc}") from exc
        table = pa.concat_tables(list(pieces.values()), promote_options="permissive") if pieces else pa.table({})
        self._read[key] = _TableRead(pieces, table)
        return table

    def made_of(self, uri: str, make: Callable[[pa.Table], Any], digest: Digest | None = None) -> Any:
        """``make`` of :meth:`read_delta`'s table (None when there is no table), made once per table
        read: callers only read what it gives."""
        if self.read_delta(uri, digest) is None:
            return None
        read = self._read[_read_key(uri, digest)]
        if make not in read.made:
            read.made[make] = make(read.table)
        return read.made[make]

    def stage(self, table: pa.Table, name: str) -> str:
        """Write ``table`` as one Parquet file under the lake's staging area; returns its URI."""
        rel = f"{self.staging_rel}/{name}.parquet"
        local = f"{self.path}/{rel}"
        # A staging file is pg2delta's own and written whole: written again when the object store
        # throttled or failed it past the SDK's retries (pyarrow's multipart completion is not
        # retried by it), with backoff, before the run gives up with 75.
        for attempt in range(STAGE_ATTEMPTS):
            try:
                self.fs.create_dir(local.rsplit("/", 1)[0], recursive=True)
                with self.fs.open_output_stream(local) as out:
                    # Read once, whole, by the engine: no dictionaries and no statistics (they took
                    # about half of the write; zstd alone keeps the file as small).
                    pq.write_table(table, out, compression="zstd", use_dictionary=False, write_statistics=False)
                break
            except (OSError, pa.ArrowException) as exc:
                if attempt + 1 < STAGE_ATTEMPTS and store_unavailable(exc):
                    time.sleep(0.5 * 2**attempt)
                    continue
                raise LakeError(f"cannot write staging file {local}: {exc}") from exc
        return self.table_uri(rel)

    def staging_uri(self, name: str) -> str:
        """The URI of ``name`` (a file or directory) in the lake's staging area."""
        return self.table_uri(f"{self.staging_rel}/{name}")

    def unstage_dir(self, name: str) -> None:
        """Remove the directory ``name`` of the staging area, with everything in it."""
        try:
            self.fs.delete_dir(f"{self.path}/{self.staging_rel}/{name}")
        except FileNotFoundError:
            pass
        except (OSError, pa.ArrowException):
            log.warning("could not remove staging directory %s", name)

    def unstage(self, uri: str) -> None:
        try:
            self.fs.delete_file(self.fs_path(uri))
        except (OSError, pa.ArrowException):
            log.warning("could not remove staging file %s", uri)


def without_float_bounds(lake: Lake, files: Sequence[str], name: str) -> list[str]:
    """``files`` (Parquet files' URIs), each one whose footer holds a float column's minimum and
    maximum replaced by a copy without statistics, written under the staging folder ``name`` of ``lake``.

    Those statistics leave NaN out, and pysail 0.7.2 reading plain Parquet takes them as bounds
    of every value (a file holding ``[NaN, 2.5]`` reads back as ``[2.5, 2.5]``). pysail's Delta
    writes, delta-rs and pyarrow write them; pg2delta's staged files have none. Copied a row
    group at a time.
    """
    out: list[str] = []
    for i, uri in enumerate(files):
        path = lake.fs_path(uri)
        rel = f"{lake.staging_rel}/{name}/{i:06d}.parquet"
        try:
            with lake.fs.open_input_file(path) as f:
                source = pq.ParquetFile(f)
                if not _float_bounds(source.metadata):
                    out.append(uri)
                    continue
                lake.fs.create_dir(f"{lake.path}/{lake.staging_rel}/{name}", recursive=True)
                with (
                    lake.fs.open_output_stream(f"{lake.path}/{rel}") as sink,
                    pq.ParquetWriter(sink, source.schema_arrow, compression="zstd", write_statistics=False) as writer,
                ):
                    for group in range(source.num_row_groups):
                        writer.write_table(source.read_row_group(group))
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot copy {uri} without its float statistics: {exc}") from exc
        out.append(lake.table_uri(rel))
    return out


# JSON commits looked for by name at once past the checkpoint ``_last_checkpoint`` names (the
# engines write one every 10 commits).
_TAIL_PROBE = 12


def _log_listing(
    fs: pafs.FileSystem, log_dir: str, *, tail: bool = True
) -> tuple[set[int], dict[tuple[int, int], set[str]]]:
    """A Delta log's JSON commit versions and classic checkpoints, as :func:`_log_files` gives them:
    with ``tail``, where ``_last_checkpoint`` names a classic checkpoint that is there, only that
    checkpoint and the commits from its version on, looked for by name (:func:`_log_tail`); else
    from a listing of the whole log. A listing grows with every commit the log keeps (30 days of
    five-minute runs: 8,640 commits, with their checksums 17,000 files, 18 requests to an object
    store), and a window asks for a table's version and files about ten times."""
    if tail and (found := _log_tail(fs, log_dir)) is not None:
        return found
    try:
        infos = fs.get_file_info(pafs.FileSelector(log_dir, allow_not_found=True))
    except (OSError, pa.ArrowException) as exc:
        raise LakeError(f"cannot list {log_dir}: {exc}") from exc
    return _log_files(infos)


def _log_tail(fs: pafs.FileSystem, log_dir: str) -> tuple[set[int], dict[tuple[int, int], set[str]]] | None:
    """The newest checkpoint and the commits from its version on, found from ``_last_checkpoint``
    by name rather than by a listing; None where that hint is missing, unreadable, names a V2
    checkpoint, or names a checkpoint that is not there (then the caller lists the log). Commits
    follow each other without a gap (each is written only if absent, after the one before), so
    the first missing one ends the log."""
    try:
        with fs.open_input_stream(f"{log_dir}/_last_checkpoint") as f:
            hint = json.loads(f.read())
        version, parts = int(hint["version"]), int(hint.get("parts") or 0)
    except FileNotFoundError:
        return None
    except (OSError, pa.ArrowException, ValueError, KeyError, TypeError):
        log.debug("unreadable %s/_last_checkpoint: listing the log", log_dir)
        return None
    if "v2Checkpoint" in hint or version < 0 or parts < 0:
        return None
    if parts:
        names = [f"{log_dir}/{version:020d}.checkpoint.{i:010d}.{parts:010d}.parquet" for i in range(1, parts + 1)]
    else:
        names = [f"{log_dir}/{version:020d}.checkpoint.parquet"]
    commits = {version}  # the table is at least at its checkpoint's version (whose commit clean-up may remove)
    checks = names
    try:
        while True:
            batch = range(max(commits) + 1, max(commits) + 1 + _TAIL_PROBE)
            infos = fs.get_file_info([*checks, *(f"{log_dir}/{v:020d}.json" for v in batch)])
            if any(i.type == pafs.FileType.NotFound for i in infos[: len(checks)]):
                return None
            for v, info in zip(batch, infos[len(checks) :], strict=True):
                if info.type == pafs.FileType.NotFound:
                    return commits, {(version, max(parts, 1)): set(names)}
                commits.add(v)
            checks = []
    except (OSError, pa.ArrowException) as exc:
        raise LakeError(f"cannot read the Delta log {log_dir}: {exc}") from exc


def _log_files(infos: Sequence[pafs.FileInfo]) -> tuple[set[int], dict[tuple[int, int], set[str]]]:
    """A ``_delta_log`` listing's JSON commit versions, and its classic checkpoints' files by
    (version, parts): single-file and multi-part checkpoints alike."""
    commits: set[int] = set()
    parts: dict[tuple[int, int], set[str]] = defaultdict(set)
    for info in infos:
        if m := re.fullmatch(r"(\d{20})\.json", info.base_name):
            commits.add(int(m.group(1)))
        elif m := re.fullmatch(r"(\d{20})\.checkpoint\.parquet", info.base_name):
            parts[(int(m.group(1)), 1)].add(info.path)
        elif m := re.fullmatch(r"(\d{20})\.checkpoint\.\d{10}\.(\d{10})\.parquet", info.base_name):
            parts[(int(m.group(1)), int(m.group(2)))].add(info.path)
    return commits, parts


def _stats_of(add: dict[str, Any]) -> dict[str, Any]:
    """An ``add`` action's statistics: its ``stats`` (JSON text), or a checkpoint's
    ``stats_parsed`` where the writer kept them as a struct; ``{}`` without either."""
    stats = add.get("stats")
    if isinstance(stats, str) and stats:
        return dict(json.loads(stats))
    return dict(add.get("stats_parsed") or {})


def _replay_order(lines: Sequence[str]) -> list[dict[str, Any]]:
    """One JSON commit's actions, its removes first: a file given a deletion vector is removed and
    added again under its path in one commit (Apache Spark writes the add first), and is the table's."""
    actions = [json.loads(line) for line in lines if line.strip()]
    return [a for a in actions if "remove" in a] + [a for a in actions if "remove" not in a]


def schema_at(lake: Lake, uri: str, version: int | None = None) -> str | None:
    """The schema (Spark's StructType JSON) of ``lake``'s Delta table at ``uri`` as of ``version``
    (default: the latest), from its log alone (see :func:`metadata_at`)."""
    meta = metadata_at(lake, uri, version)
    return None if meta is None else str(meta["schemaString"])


def key_bounds(lake: Lake, uri: str, column: str) -> tuple[Any, Any, Any, int] | None:
    """The bounds of the integer ``column`` in each data file of ``lake``'s Delta table at ``uri``
    whose statistics have them (two int64 arrays), those files' rows (None unless each counts
    them), and how many data files the table has; None when no statistics bound ``column`` (a
    partition column, or one the writer keeps none of). A file without bounds holds NULLs only, or
    has no statistics. From the log's tail (:meth:`Lake.stats_now`), with no engine and no delta-rs
    load of the table (that lists the whole log and reads the removed files of its checkpoint too,
    which grow with every window); a LakeError where the log cannot tell this way: no table, a
    V2 checkpoint, column mapping (statistics by physical names)."""
    meta = metadata_at(lake, uri)
    found = lake.stats_now(uri) if meta is not None else None
    if meta is None or found is None or (meta.get("configuration") or {}).get("delta.columnMapping.mode", "none") != "none":
        raise LakeError(f"the log of {uri} does not give its files' statistics by column name")
    if column in (meta.get("partitionColumns") or ()):
        return None
    bounded = [s for s in found[1].values()
               if (s.get("minValues") or {}).get(column) is not None and (s.get("maxValues") or {}).get(column) is not None]
    if not bounded:
        return None
    rows = [s.get("numRecords") for s in bounded]
    return (np.array([s["minValues"][column] for s in bounded], dtype=np.int64),
            np.array([s["maxValues"][column] for s in bounded], dtype=np.int64),
            None if any(r is None for r in rows) else np.array(rows, dtype=np.int64), len(found[1]))


def property_on(meta: dict[str, Any] | None, name: str) -> bool:
    """Whether the ``metaData`` action ``meta`` (:func:`metadata_at`) sets the table property ``name`` to true."""
    return meta is not None and str((meta.get("configuration") or {}).get(name, "false")).lower() == "true"


def metadata_at(lake: Lake, uri: str, version: int | None = None) -> dict[str, Any] | None:
    """The ``metaData`` action (its ``schemaString``, ``configuration``, ``partitionColumns``) of
    ``lake``'s Delta table at ``uri`` as of ``version`` (default: the latest), from its log alone:
    the newest JSON commit up to it that changed the metadata, else the newest complete classic
    checkpoint up to it. None where the log cannot tell this way (a JSON commit cleaned up with no
    checkpoint past it; no table)."""
    return _action_at(lake, uri, version, "metaData")


def protocol_at(lake: Lake, uri: str, version: int | None = None) -> dict[str, Any] | None:
    """The ``protocol`` action (``minReaderVersion``, ``minWriterVersion``, ``readerFeatures``,
    ``writerFeatures``) of ``lake``'s Delta table at ``uri`` as :func:`metadata_at` finds the
    ``metaData``."""
    return _action_at(lake, uri, version, "protocol")


def _action_at(lake: Lake, uri: str, version: int | None, kind: str) -> dict[str, Any] | None:
    """The newest action of ``kind`` (``metaData`` or ``protocol``, which each replace the one
    before) of the Delta table at ``uri`` up to ``version``, as :func:`metadata_at` says."""
    log_dir = f"{lake.fs_path(uri)}/_delta_log"
    commits, parts = _log_listing(lake.fs, log_dir)
    if commits and version is not None and version < min(commits):  # older than the tail: the whole log
        commits, parts = _log_listing(lake.fs, log_dir, tail=False)
    if not commits:
        return None
    version = max(commits) if version is None else version
    complete = {v: n for (v, n), names in parts.items() if len(names) == n and v <= version}
    floor = max(complete) if complete else -1
    try:
        for v in range(version, floor, -1):
            if v not in commits:
                return None
            with lake.fs.open_input_stream(f"{log_dir}/{v:020d}.json") as f:
                lines = f.read().decode().splitlines()
            for line in lines:
                action = json.loads(line) if line.strip() else {}
                if kind in action:
                    return dict(action[kind])
        if floor < 0:
            return None
        for name in sorted(parts[(floor, complete[floor])]):
            with lake.fs.open_input_file(name) as f:
                table = pq.read_table(f, columns=[kind])
            for found in table.column(kind).to_pylist():
                if found is None or (kind == "metaData" and not found.get("schemaString")):
                    continue
                if kind == "metaData":
                    # A checkpoint's configuration is a map: pyarrow gives its pairs as a list.
                    conf = found.get("configuration")
                    return {**found, "configuration": dict(conf) if conf is not None else {}}
                if found.get("minReaderVersion") is not None:
                    return dict(found)
    except (OSError, pa.ArrowException, KeyError, ValueError) as exc:
        raise LakeError(f"cannot read the Delta log of {uri}: {exc}") from exc
    return None
