"""pg2delta.lake.conflicts on real Delta tables written by delta-rs (no server, no engine): which
commits that landed meanwhile make a failed commit retried, refused or left to stand."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, write_deltalake

from pg2delta.errors import EXIT_LAKE_CHANGED, EXIT_RETRYABLE, CommitConflict, LakeChanged, LakeError
from pg2delta.lake import conflicts
from pg2delta.lake.conflicts import committing, delta_conflict, engine_error
from pg2delta.lake.foreign import MARK, commits_after, landed_between, own_commit
from pg2delta.lake.lake_files import Lake


def _table(tmp_path: Path) -> str:
    path = str(tmp_path / "t")
    for i in range(3):
        write_deltalake(path, pa.table({"id": pa.array([i], pa.int64())}), mode="append")
    return path


def _stale_conflict(path: str) -> LakeError:
    """A real conflict from delta-rs: a delete through a table object read before a compaction (a
    Z-order, which rewrites the files every time)."""
    stale = DeltaTable(path)
    DeltaTable(path).optimize.z_order(["id"])
    try:
        stale.delete("id = 0")
    except Exception as exc:
        failed = LakeError(f"MERGE into {path} failed: {exc}")
        failed.__cause__ = exc  # as the engine's parts raise theirs (raise ... from exc)
        return failed
    raise AssertionError("delta-rs committed over a compaction it did not read")


def test_what_counts_as_a_conflict(tmp_path: Path) -> None:
    path = _table(tmp_path)
    assert delta_conflict(_stale_conflict(path))
    for text in ("io.delta.exceptions.ConcurrentDeleteReadException: This transaction attempted to read ...",
                 "[DELTA_CONCURRENT_APPEND] ConcurrentAppendException: Files were added ...",
                 "MetadataChangedException: The metadata of the Delta table has been changed",
                 "Failed to commit transaction: 0"):
        assert delta_conflict(LakeError(text)), text
    assert not delta_conflict(LakeError("No space left on device"))
    # The engine's exception the retry's log line names: its class, and Delta's where its text names one.
    assert engine_error(_stale_conflict(path)) == "CommitFailedError"

    class Py4JJavaError(Exception):
        pass

    for engines, named in (
        (Py4JJavaError("An error occurred while calling o97.sql.\n: io.delta.exceptions.ConcurrentAppendException: "
                       "Files were added"), "Py4JJavaError: ConcurrentAppendException"),
        (Py4JJavaError("[DELTA_CONCURRENT_DELETE_READ] ConcurrentDeleteReadException: This transaction attempted"),
         "Py4JJavaError: ConcurrentDeleteReadException"),
        (RuntimeError("Failed to commit transaction: 0"), "RuntimeError"),
    ):
        wrapped = LakeError(f"MERGE into t failed: {engines}")
        wrapped.__cause__ = engines
        assert engine_error(wrapped) == named, (engine_error(wrapped), named)
    assert engine_error(LakeError("[DELTA_CONCURRENT_APPEND] Files were added")) == "DELTA_CONCURRENT_APPEND"


def test_retried_over_a_compaction_and_a_vacuum_refused_over_an_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(conflicts, "BACKOFF_SECONDS", 0.0)
    path = _table(tmp_path)
    lake = Lake(str(tmp_path))
    calls: list[int] = []

    def attempt() -> str:  # fails once, on a compaction and a VACUUM another writer committed meanwhile
        calls.append(1)
        if len(calls) == 1:
            failure = _stale_conflict(path)
            DeltaTable(path).vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False)
            raise failure
        return "done"

    with caplog.at_level(logging.WARNING, logger="pg2delta.lake.engine"):
        assert committing(lake, path, "MERGE into t", attempt) == "done"
    assert len(calls) == 2
    retried = [r.getMessage() for r in caplog.records if "met a concurrent commit that changes no row" in r.getMessage()]
    assert len(retried) == 1 and "VACUUM END" in retried[0] and "OPTIMIZE" in retried[0], retried
    assert "the engine raised CommitFailedError" in retried[0], retried
    kinds = [(c.what.operation, c.own, c.data) for c in commits_after(lake, path, 2)]
    assert kinds == [("VACUUM END", False, False), ("VACUUM START", False, False), ("OPTIMIZE", False, False)]

    def over_an_append() -> None:
        failure = _stale_conflict(path)
        write_deltalake(path, pa.table({"id": pa.array([9], pa.int64())}), mode="append")
        raise failure

    with pytest.raises(LakeChanged) as refused:
        committing(lake, path, "MERGE into t", over_an_append)
    assert refused.value.exit_code == EXIT_LAKE_CHANGED and "WRITE by delta-rs" in str(refused.value)
    assert refused.value.__context__ is None  # not taken for the object store's lost answer (cli)

    # verify's run remembers another writer's commits and writes over them (pg2delta.job): the commit
    # is made again over an append the hook remembers; one it does not (a changelog's) is refused.
    told: list[tuple[str, list[int]]] = []

    def remembering(uri: str, commits: Any) -> bool:
        told.append((uri, [c.version for c in commits]))
        return uri == path

    lake.remember_foreign = remembering
    tries: list[int] = []

    def once_over_an_append() -> str:
        tries.append(1)
        if len(tries) == 1:
            over_an_append()
        return "done"

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pg2delta.lake.engine"):
        assert committing(lake, path, "MERGE into t", once_over_an_append) == "done"
    latest = DeltaTable(path).version()
    assert len(tries) == 2 and told == [(path, [latest])], (tries, told, latest)
    assert any("another writer's commit that changes rows, remembered" in r.getMessage() for r in caplog.records)
    other = _table(tmp_path / "changelog")
    with pytest.raises(LakeChanged):
        committing(lake, other, "append to the changelog", lambda: (write_deltalake(
            other, pa.table({"id": pa.array([9], pa.int64())}), mode="append"), _raise(_stale_conflict(other))))


def _raise(exc: BaseException) -> None:
    raise exc


def test_an_own_commit_stands_and_endless_compactions_give_75(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conflicts, "BACKOFF_SECONDS", 0.0)
    path = _table(tmp_path)
    lake = Lake(str(tmp_path))

    def landed() -> None:  # the attempt's own commit landed and its answer was lost
        write_deltalake(path, pa.table({"id": pa.array([7], pa.int64())}), mode="append",
                        commit_properties=CommitProperties(custom_metadata={"userMetadata": MARK}))
        raise LakeError("append to t failed: Failed to commit transaction: 5")

    with pytest.raises(LakeError, match="Failed to commit transaction: 5") as stood:
        committing(lake, path, "append to t", landed)
    assert not isinstance(stood.value, (LakeChanged, CommitConflict))
    # The embedded engine's SQL commits carry no user metadata: an SCD2 history's MERGE is known by
    # its source's column, as pysail 0.7.2 writes its condition; only in the embedded engine's commits.
    history_merge = {"operation": "MERGE", "operationParameters": {"mergePredicate": "s . __pg2delta_action = 'close' "}}
    assert own_commit([{"commitInfo": history_merge | {"engineInfo": "sail-delta-lake:0.7.2"}}])
    assert not own_commit([{"commitInfo": history_merge | {"engineInfo": "Apache-Spark/3.5.3 Delta-Lake/3.3.0"}}])
    assert not own_commit([{"commitInfo": history_merge | {"engineInfo": "sail-delta-lake:0.7.2", "userMetadata": "a job"}}])
    assert own_commit([{"commitInfo": {"operation": "WRITE", "userMetadata": MARK}}])
    assert own_commit([{"commitInfo": {"operation": "MERGE"}}, {"txn": {"appId": "pg2delta/1/s", "version": 3}}])

    def compacting() -> None:
        raise _stale_conflict(path)

    with pytest.raises(CommitConflict) as gave_up:
        committing(lake, path, "MERGE into t", compacting)
    assert gave_up.value.exit_code == EXIT_RETRYABLE and f"{conflicts.ATTEMPTS} times" in str(gave_up.value)


def test_what_landed_under_a_window_own_commit(tmp_path: Path) -> None:
    """pg2delta.lake.foreign.landed_between, which a run asks after its commits: another writer's
    append between the run's look and its own commit counts, its own commits and a compaction do not."""
    path = _table(tmp_path)  # versions 0-2
    lake = Lake(str(tmp_path))
    write_deltalake(path, pa.table({"id": pa.array([5], pa.int64())}), mode="append")  # 3: someone's
    DeltaTable(path).optimize.z_order(["id"])  # 4: a compaction
    write_deltalake(path, pa.table({"id": pa.array([6], pa.int64())}), mode="append",
                    commit_properties=CommitProperties(custom_metadata={"userMetadata": MARK}))  # 5: the run's
    reads: list[str] = []
    lake.fs = _Counting(lake.fs, reads)
    assert [c.version for c in landed_between(lake, path, 2, 5)] == [3]
    assert landed_between(lake, path, 3, 5) == [] and landed_between(lake, path, 5, 5) == []
    assert [c.version for c in landed_between(lake, path, None, 5)] == [3, 2, 1, 0]  # a table the window created
    assert sorted(reads) == sorted(f"{v:020d}.json" for v in range(6)), reads  # each commit read once


class _Counting:
    """A filesystem that notes the name of every file opened for reading (read_commit's reads)."""

    def __init__(self, fs: Any, reads: list[str]) -> None:
        self.fs, self.reads = fs, reads

    def open_input_stream(self, path: str) -> Any:
        self.reads.append(path.rsplit("/", 1)[-1])
        return self.fs.open_input_stream(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)
