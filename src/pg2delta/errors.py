"""One exception family for the whole job, with kinds that map to exit codes.

Every error pg2delta raises on purpose is a :class:`Pg2DeltaError`. Its ``kind`` says
what went wrong in terms a scheduler can act on, and ``retryable`` says whether running
the same job again, unchanged, can succeed. The CLI turns the kind into a distinct exit
code (see :data:`EXIT_CODES`) and prints the message on one line.
"""

from __future__ import annotations

import enum
import re


class ErrorKind(enum.Enum):
    """What failed, in terms of who can fix it."""

    CONNECTION = "connection"  # server unreachable, connection lost, wrong password
    SOURCE_STATE = "source_state"  # slot or publication missing, slot invalidated, wrong plugin
    PROTOCOL = "protocol"  # bytes from the server that do not follow the pgoutput protocol
    SCHEMA = "schema"  # a table shape the lake cannot follow without a human
    DATA = "data"  # a value that cannot be stored as configured
    LAKE = "lake"  # the lake path cannot be read or written, a Delta commit failed
    CONFIG = "config"  # a broken or contradictory configuration
    BUSY = "busy"  # another run holds the slot
    LAKE_CHANGED = "lake_changed"  # a table of the lake has commits pg2delta did not make since its last one
    TERMINATED = "terminated"  # SIGTERM (a scheduler's timeout, a pod's shutdown): stopped, nothing half-applied
    STORAGE_FULL = "storage_full"  # no space left on the device of the staging area or the lake


# Exit codes for schedulers (Airflow, cron). 0 is not an error, and neither is a run with nothing to
# do: it exits 0 too, unless ``--idle-exit-code N`` asks for another code to branch on (3 is the
# conventional choice, pg2delta's own before it exited 0).
EXIT_OK = 0  # windows applied and the slot advanced, or nothing to do
EXIT_NOTHING_TO_DO = 3  # the usual --idle-exit-code: a run with nothing to do (the default before, now 0)
EXIT_RETRYABLE = 75  # EX_TEMPFAIL: try again later, unchanged
EXIT_NEEDS_HUMAN = 78  # EX_CONFIG: do not retry until someone looks
EXIT_BUSY = 73  # another run holds the slot; the next scheduled run will do the work
EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug in pg2delta
# Another writer changed a table of the lake since pg2delta's last commit: the run writes nothing
# over it (pg2delta verify shows the keys, pg2delta resync repairs; pg2delta.lake.foreign).
EXIT_LAKE_CHANGED = 21
# No space left on a device pg2delta writes (the staging area, a local lake): exit 74 (EX_IOERR)
# until someone frees space or moves the staging area; nothing was advanced past the lake.
EXIT_STORAGE_FULL = 74
# Codes an idle run may not take: they mean failures.
RESERVED_EXIT_CODES = frozenset(
    {EXIT_RETRYABLE, EXIT_NEEDS_HUMAN, EXIT_BUSY, EXIT_INTERNAL, EXIT_LAKE_CHANGED, EXIT_STORAGE_FULL, 130}
)

# ``pg2delta status``: what it found, worst first when several hold (docs/operations/monitoring.md).
EXIT_STATUS_MAINTENANCE = 9  # a table's log or small files past a [maintain] alert_* threshold: maintenance is not keeping up
EXIT_STATUS_LAG = 10  # lag over --max-lag-bytes or --max-lag-seconds
EXIT_STATUS_UNRESERVED = 11  # wal_status 'unreserved': the next checkpoint may remove WAL the slot needs
EXIT_STATUS_INVALIDATED = 12  # the slot is invalidated: its changes are gone, the lake needs a new bootstrap
EXIT_STATUS_LAKE_CHANGED = 13  # a table has commits pg2delta did not make since its last one (run refuses: 21)
EXIT_STATUS_FAILOVER = 14  # a promotion of the standby now would leave the runs without their slot (not a failover slot, not synchronized)

# ``pg2delta verify``: the lake does not hold the source's state at the verified LSN (the report
# names the keys); 0 when every table is equal.
EXIT_VERIFY_DIFFERS = 20

# For errors that retrying cannot fix; a retryable error of any kind exits EXIT_RETRYABLE.
EXIT_CODES: dict[ErrorKind, int] = {
    ErrorKind.CONNECTION: EXIT_NEEDS_HUMAN,  # e.g. a refused login
    ErrorKind.SOURCE_STATE: EXIT_NEEDS_HUMAN,
    ErrorKind.PROTOCOL: EXIT_NEEDS_HUMAN,
    ErrorKind.SCHEMA: EXIT_NEEDS_HUMAN,
    ErrorKind.DATA: EXIT_NEEDS_HUMAN,
    ErrorKind.LAKE: EXIT_NEEDS_HUMAN,
    ErrorKind.CONFIG: EXIT_NEEDS_HUMAN,
    ErrorKind.BUSY: EXIT_BUSY,
    ErrorKind.LAKE_CHANGED: EXIT_LAKE_CHANGED,
    ErrorKind.TERMINATED: EXIT_RETRYABLE,  # always retryable: the next run goes on
    ErrorKind.STORAGE_FULL: EXIT_STORAGE_FULL,
}


class Pg2DeltaError(Exception):
    """Base of every error pg2delta raises on purpose."""

    kind: ErrorKind = ErrorKind.DATA
    retryable: bool = False

    def __init__(self, message: str, *, kind: ErrorKind | None = None, retryable: bool | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind
        if retryable is not None:
            self.retryable = retryable

    @property
    def exit_code(self) -> int:
        if self.retryable:
            return EXIT_RETRYABLE
        return EXIT_CODES[self.kind]

    def one_line(self) -> str:
        """The message on a single line, prefixed with the kind."""
        text = " ".join(str(self).split())
        return f"pg2delta: {self.kind.value} error: {text}"


class ConnectionFailed(Pg2DeltaError):
    kind = ErrorKind.CONNECTION
    retryable = True


class SourceStateError(Pg2DeltaError):
    kind = ErrorKind.SOURCE_STATE


class DecodeError(Pg2DeltaError):
    """Bytes that do not follow the pgoutput protocol.

    Names the message tag, the byte offset inside the message and the LSN of the row
    the message came from, so a bad message can be found again with ``pg_logical_slot_peek_binary_changes``.
    """

    kind = ErrorKind.PROTOCOL

    def __init__(self, reason: str, *, tag: str | None = None, offset: int | None = None, lsn: int | None = None) -> None:
        self.reason = reason
        self.tag = tag
        self.offset = offset
        self.lsn = lsn
        where = []
        if tag is not None:
            where.append(f"tag {tag!r}")
        if offset is not None:
            where.append(f"offset {offset}")
        if lsn is not None:
            where.append(f"lsn {lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}")
        suffix = f" ({', '.join(where)})" if where else ""
        super().__init__(f"cannot decode pgoutput message: {reason}{suffix}")

    def with_lsn(self, lsn: int) -> DecodeError:
        """The same error, now naming the LSN of the row it came from."""
        if self.lsn is not None:
            return self
        err = DecodeError(self.reason, tag=self.tag, offset=self.offset, lsn=lsn)
        err.__cause__ = self.__cause__
        return err


class SchemaError(Pg2DeltaError):
    kind = ErrorKind.SCHEMA


class DataError(Pg2DeltaError):
    kind = ErrorKind.DATA


class LakeError(Pg2DeltaError):
    kind = ErrorKind.LAKE


class ConfigError(Pg2DeltaError):
    kind = ErrorKind.CONFIG


class SlotBusy(Pg2DeltaError):
    kind = ErrorKind.BUSY


class Terminated(Pg2DeltaError):
    """The process was asked to stop (SIGTERM) and stopped: exit 75, run again."""

    kind = ErrorKind.TERMINATED
    retryable = True


class StorageFull(Pg2DeltaError):
    """No space left on a device pg2delta writes; retrying unchanged fills it again."""

    kind = ErrorKind.STORAGE_FULL


def no_space_left(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it came from, is a device out of space (ENOSPC), as the OS,
    pyarrow or the engine (its message) says it."""
    import errno

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(cur) or "os error 28" in str(cur):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class StoreUnavailable(Pg2DeltaError):
    """The object store throttled or failed past its client's retries (S3 503 SlowDown, 500, a
    timeout): transient, so exit 75; the slot did not move past what the lake holds."""

    kind = ErrorKind.LAKE
    retryable = True


# What the object store's clients say of a store that throttles, fails or cannot be reached, past
# their own retries: pyarrow (the AWS SDK), delta-rs and pysail (object_store), Hadoop's s3a.
_STORE_TRANSIENT = (
    "SLOW_DOWN", "SlowDown", "Slow Down", "INTERNAL_FAILURE", "Service Unavailable", "ServiceUnavailable", "InternalError",
    "Internal Server Error", "NETWORK_CONNECTION", "Timeout was reached", "Status Code: 503",
    "Status Code: 500", "status: 503", "status: 500", "503 Service", "500 Internal",
)


# A Delta commit whose version its client found taken when it retried the commit's PUT: the store
# applied the commit and its answer was lost (a 500 or a cut connection after the PUT landed), or
# another writer took the version. pysail says "Failed to commit transaction: <version>", delta-rs
# "Tried committing existing table version". The run stops before the slot moves; the next run
# finds that commit in place, and the changelog, the history, the MERGE and the applied log are
# replay-safe (a foreign writer's commit is then found as such: exit 21).
_COMMIT_TAKEN = re.compile(r"Failed to commit transaction: \d+|Tried committing existing table version")


def store_unavailable(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it came from, is the object store throttling or failing for a
    while, or a commit whose answer it lost (not a refusal: a missing bucket or a denied key stays
    an error for a human)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if any(marker in str(cur) for marker in _STORE_TRANSIENT) or _COMMIT_TAKEN.search(str(cur)):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class EngineUnavailable(Pg2DeltaError):
    """The Spark Connect server stopped answering past its client's retries (killed, restarting,
    its host unreachable: ``[engine] connect_retry_seconds``), or restarted and lost the run's
    session: transient, exit 75; the slot did not move past the lake."""

    kind = ErrorKind.LAKE
    retryable = True


# What pyspark's Spark Connect client says of a server it lost: a call that found none past its
# retries (pyspark 3.5: the gRPC error's text; 4.x: RETRIES_EXCEEDED, caused by that error), or a
# server that no longer knows the run's session or operation (it restarted). A server that answers
# with a failure (a Delta commit's) says none of these.
_ENGINE_LOST = ("StatusCode.UNAVAILABLE", "[RETRIES_EXCEEDED]", "INVALID_HANDLE.SESSION_NOT_FOUND",
                "INVALID_HANDLE.SESSION_CHANGED", "INVALID_HANDLE.OPERATION_NOT_FOUND")


def engine_unavailable(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it came from, is the Spark Connect server lost (see :data:`_ENGINE_LOST`)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if any(marker in str(cur) for marker in _ENGINE_LOST):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class CommitConflict(Pg2DeltaError):
    """A Delta commit kept meeting other writers' commits that change no row (an ``OPTIMIZE`` or
    ``VACUUM`` of the user's own, running at the same time) past its retries: transient, exit 75;
    nothing of the window was committed there and the slot did not move (pg2delta.lake.conflicts)."""

    kind = ErrorKind.LAKE
    retryable = True


class LakeChanged(Pg2DeltaError):
    """A table of the lake was changed by another writer since pg2delta's last commit."""

    kind = ErrorKind.LAKE_CHANGED
