"""Another writer's commit at the same time as pg2delta's: what is retried, and how.

Delta commits optimistically: a writer reads the table's latest version, writes its files, then
commits the next version if nobody took it. When somebody did, the engines differ:

* Apache Spark's Delta checks the winning commits against what its transaction read. What does
  not conflict it commits on top by itself (a ``MERGE`` next to a blind append, under the default
  ``WriteSerializable`` isolation, Delta's documentation says); the rest raises
  ``ConcurrentAppendException`` (a delta-rs compaction or append next to a ``MERGE`` that read the
  table's files, measured here), ``ConcurrentDeleteReadException``,
  ``ConcurrentDeleteDeleteException``, ``MetadataChangedException``, ``ProtocolChangedException``
  or ``ConcurrentTransactionException``;
* pysail 0.7.2 checks nothing: its commit fails (``Failed to commit transaction: 0``) whenever the
  table moved past the version it read, whatever the other commit did (measured here);
* delta-rs (pg2delta's compaction, vacuum and metadata commits) raises ``CommitFailedError``.

:func:`committing` then reads the commits that landed since the version it saw before the attempt
and decides by what they did (:mod:`pg2delta.lake.foreign` tells whose they are):

* only commits that change no row (an ``OPTIMIZE`` or compaction, ``VACUUM``, table properties):
  the statement runs again from a fresh snapshot, up to :data:`ATTEMPTS` times with a growing
  pause, each retry one line in the log naming the engine's exception (:func:`engine_error`). A window's final rows committed again give the same
  table (a ``MERGE`` of final states, a rewrite of their key range recomputed from the table as it
  is now), and the first attempt committed nothing; after the last attempt,
  :class:`pg2delta.errors.CommitConflict` (exit 75, run again);
* a commit by another writer that changes rows (someone's ``UPDATE``, ``DELETE``, append):
  nothing is retried over it: :class:`pg2delta.errors.LakeChanged` (exit 21), as for the commits
  a run finds before it writes; but for a run that writes over such commits and remembers them
  (``pg2delta verify``'s, :attr:`pg2delta.lake.lake_files.Lake.remember_foreign`), which
  retries as over a compaction once they are remembered;
* a commit of pg2delta's own that changes rows: the attempt landed and the store lost its answer
  (:data:`pg2delta.errors.store_unavailable`): the error stands (exit 75; the next run finds the
  commit in place and lands nothing twice);
* no new commit at all: not a conflict; the error stands.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable
from typing import TypeVar

from pg2delta.errors import CommitConflict, LakeChanged, Pg2DeltaError
from pg2delta.lake.foreign import ForeignCommit, commits_after
from pg2delta.lake.lake_files import Lake

log = logging.getLogger("pg2delta.lake.engine")

T = TypeVar("T")

# Attempts of one commit that keeps meeting another writer's commits, and the pause before the
# n-th retry: BACKOFF_SECONDS * 2**(n-1), between half and one and a half times that (two writers
# retrying at once do not meet again).
ATTEMPTS = 4
BACKOFF_SECONDS = 1.0

# What the engines say of a commit that met another writer's (see the module docstring): Delta's
# exception classes and their error classes (Delta 3+), pysail's and delta-rs's messages.
_CONFLICT = re.compile(
    r"Concurrent(Append|DeleteRead|DeleteDelete|Transaction|Write)Exception|MetadataChangedException"
    r"|ProtocolChangedException|DELTA_CONCURRENT_|DELTA_METADATA_CHANGED|DELTA_PROTOCOL_CHANGED"
    r"|Failed to commit transaction|CommitFailedError|Tried committing existing table version"
)


def delta_conflict(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it came from, is an engine's report of a commit that met another's."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if _CONFLICT.search(str(cur)) or _CONFLICT.search(type(cur).__name__):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


# Delta's exception classes and error classes as the engines' messages name them (a JVM's exception
# reaches Python as Py4JJavaError or a Spark Connect error with the Java class in its text).
_DELTA_CLASS = re.compile(
    r"Concurrent(?:Append|DeleteRead|DeleteDelete|Transaction|Write)Exception|MetadataChangedException"
    r"|ProtocolChangedException"
)
_DELTA_ERROR_CLASS = re.compile(r"\[(DELTA_[A-Z_]+)\]")


def engine_error(exc: BaseException) -> str:
    """The engine's exception behind ``exc`` (pg2delta's own errors wrap it): the class of the first
    error in the chain that is not pg2delta's, with Delta's exception class or error class when its
    message names one and it is not that class (``Py4JJavaError: ConcurrentAppendException``)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    first: BaseException | None = None
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if first is None and not isinstance(cur, Pg2DeltaError):
            first = cur
        cur = cur.__cause__ or cur.__context__
    text = str(first if first is not None else exc)
    found, error_class = _DELTA_CLASS.search(text), _DELTA_ERROR_CLASS.search(text)
    delta = found.group(0) if found else error_class.group(1) if error_class else None
    if first is None:
        return delta or type(exc).__name__
    name = type(first).__name__
    return f"{name}: {delta}" if delta and delta != name else name


def committing(lake: Lake, uri: str, what: str, attempt: Callable[[], T]) -> T:
    """``attempt()`` (one commit to the Delta table at ``uri``, described as ``what``), run again
    while it fails on commits another writer made meanwhile that change no row (see the module
    docstring); its result."""
    for n in range(1, ATTEMPTS + 1):
        floor = lake.delta_version(uri)
        try:
            return attempt()
        except Pg2DeltaError as exc:
            if floor is None or not delta_conflict(exc):
                raise
            failed = exc
        # Outside the except block: the errors raised below do not carry the engine's as their context.
        landed = commits_after(lake, uri, floor)  # read once: the run's look after its commits reads them again
        if not landed or any(c.own and c.data for c in landed):
            raise failed  # nothing new (another failure), or this attempt's own commit landed
        foreign = [c.what for c in landed if c.data and not c.own]
        if foreign and not (lake.remember_foreign is not None and lake.remember_foreign(uri, foreign)):
            rel = uri.removeprefix(f"{lake.root}/")
            name = rel.replace("/", ".") if rel.count("/") == 1 and not rel.startswith("_") else "<schema.table>"
            raise LakeChanged(
                f"{what}: another writer changed {uri} while this run committed to it "
                f"({'; '.join(c.describe() for c in foreign)}), so nothing of this window was committed over it "
                f"and the slot did not move. pg2delta verify shows the keys; pg2delta resync --table {name} "
                "copies the table again"
            )
        others = "; ".join(c.what.describe() for c in landed)
        if n == ATTEMPTS:
            raise CommitConflict(
                f"{what} met another writer's commits {ATTEMPTS} times in a row (the last: {others}); "
                "nothing of this window was committed and the slot did not move: run again"
            )
        pause = BACKOFF_SECONDS * 2 ** (n - 1) * random.uniform(0.5, 1.5)
        said = "another writer's commit that changes rows, remembered," if foreign else "a concurrent commit that changes no row"
        log.warning("%s met %s (%s; the engine raised %s): retrying from the new version in %.1f s (attempt %d of %d)",
                    what, said, others, engine_error(failed), pause, n + 1, ATTEMPTS)
        time.sleep(pause)
    raise AssertionError("unreachable")  # the loop returns or raises


__all__ = ["ATTEMPTS", "BACKOFF_SECONDS", "ForeignCommit", "committing", "delta_conflict", "engine_error"]
