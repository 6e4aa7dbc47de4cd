"""Exit codes a scheduler can act on: retryable or not decides first, then the kind."""

from __future__ import annotations

import pytest

from pg2delta.errors import (
    EXIT_BUSY,
    EXIT_LAKE_CHANGED,
    EXIT_NEEDS_HUMAN,
    EXIT_RETRYABLE,
    EXIT_STORAGE_FULL,
    ConfigError,
    ConnectionFailed,
    DecodeError,
    ErrorKind,
    LakeError,
    Pg2DeltaError,
    SlotBusy,
)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConnectionFailed("lost"), EXIT_RETRYABLE),
        (ConnectionFailed("refused login", retryable=False), EXIT_NEEDS_HUMAN),
        (LakeError("throttled", retryable=True), EXIT_RETRYABLE),
        (LakeError("unwritable"), EXIT_NEEDS_HUMAN),
        (ConfigError("broken"), EXIT_NEEDS_HUMAN),
        (SlotBusy("held"), EXIT_BUSY),
        (DecodeError("bad tuple kind", tag="I", offset=7, lsn=None), EXIT_NEEDS_HUMAN),
    ],
)
def test_exit_code(error: Pg2DeltaError, code: int) -> None:
    assert error.exit_code == code


def test_every_kind_has_an_exit_code() -> None:
    for kind in ErrorKind:
        assert Pg2DeltaError("x", kind=kind).exit_code in {
            EXIT_NEEDS_HUMAN, EXIT_BUSY, EXIT_LAKE_CHANGED, EXIT_RETRYABLE, EXIT_STORAGE_FULL}


def test_one_line() -> None:
    assert ConnectionFailed("cannot connect:\n  timeout\texpired").one_line() == (
        "pg2delta: connection error: cannot connect: timeout expired"
    )


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["run", "--max-changes", "many"], "argument --max-changes: invalid int value: 'many'"),
        ([], "the following arguments are required: command"),
        (["rerun"], "invalid choice: 'rerun'"),
        (["run", "--engine", "flink"], "argument --engine: invalid choice: 'flink'"),
    ],
)
def test_bad_command_line_is_one_line_and_needs_a_human(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pg2delta.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == EXIT_NEEDS_HUMAN
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pg2delta: config error: ")
    assert fragment in err and "--help" in err


def test_a_connection_cut_where_no_layer_named_it_is_retryable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """A psycopg connection error that reaches the command line unnamed (``pg_terminate_backend`` of a
    catalog connection, a restart: found by make soak, exit 70 before) exits 75 with one line."""
    import psycopg

    import pg2delta.job
    from pg2delta.cli import main

    def cut(*args: object, **kwargs: object) -> None:
        raise psycopg.errors.AdminShutdown("terminating connection due to administrator command")

    monkeypatch.setattr(pg2delta.job, "run", cut)
    code = main(["run", "--dsn", "host=127.0.0.1", "--slot", "s", "--publication", "p", "--lake", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_RETRYABLE, err
    assert err[-1].startswith("pg2delta: connection error: lost the connection to PostgreSQL: terminating connection"), err


_GRPC_REFUSED = ('<_MultiThreadedRendezvous of RPC that terminated with: status = StatusCode.UNAVAILABLE details = "failed '
                 'to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:47557: Failed to connect to remote host: '
                 'Connection refused" debug_error_string = "UNAVAILABLE:failed to connect to all addresses" >')


def _retries_exceeded() -> Exception:
    """pyspark 4's error past its Connect client's retries: RETRIES_EXCEEDED, caused by gRPC's."""
    try:
        raise RuntimeError(_GRPC_REFUSED)
    except RuntimeError as grpc_error:
        try:
            raise RuntimeError("[RETRIES_EXCEEDED] The maximum number of retries has been exceeded.") from grpc_error
        except RuntimeError as exc:
            return exc


@pytest.mark.parametrize(
    ("failure", "code", "said"),
    [  # the texts pyspark 3.5.9's client gave against a Spark 3.5 Connect server killed, then restarted
        (LakeError(f"MERGE INTO delta.`/lake/public/t` failed: {_GRPC_REFUSED}"), EXIT_RETRYABLE,
         "lake error: lost the Spark Connect server past [engine] connect_retry_seconds of retries, or it restarted "
         "(run again once it answers; the slot did not move past the lake): failed to connect to all addresses; last "
         "error: UNKNOWN: ipv4:127.0.0.1:47557: Failed to connect to remote host: Connection refused"),
        (_retries_exceeded(), EXIT_RETRYABLE, "Connection refused"),
        (LakeError("a query failed: (java.util.concurrent.ExecutionException) org.apache.spark.SparkSQLException: "
                   "[INVALID_HANDLE.SESSION_NOT_FOUND] The handle 11bd6d7a is invalid. Session not found."),
         EXIT_RETRYABLE, "Session not found"),
        # A server that answers with a Delta failure: a human's
        (LakeError("MERGE INTO delta.`/lake/public/t` failed: [DELTA_FAILED_TO_MERGE_FIELDS] Failed to merge fields "
                   "'v' and 'v'"), EXIT_NEEDS_HUMAN, "lake error: MERGE INTO"),
    ],
)
def test_a_spark_connect_server_lost_is_retryable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, capsys: pytest.CaptureFixture[str],
    failure: Exception, code: int, said: str,
) -> None:
    """The Spark Connect server gone past its client's retries, or restarted (its session lost),
    exits 75 with gRPC's own words on one line; a Delta failure it answers with stays 78. The
    client's retries add up to at most [engine] connect_retry_seconds."""
    import pg2delta.job
    from pg2delta.cli import main
    from pg2delta.lake.engine_session import connect_retries

    def fail(*args: object, **kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(pg2delta.job, "run", fail)
    got = main(["run", "--dsn", "host=127.0.0.1", "--slot", "s", "--publication", "p", "--lake", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert got == code and said in err[-1] and err[-1].startswith("pg2delta: "), err
    assert [connect_retries(s) for s in (0, 5, 30, 600)] == [0, 4, 9, 123]  # waits of 50 ms x4 up to 5 s: 4.25 s, 29.25 s
