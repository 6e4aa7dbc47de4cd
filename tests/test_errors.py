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
