"""What the commands of the command line share: how a command is registered, its config, flag types."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pg2delta.config import Config, load
from pg2delta.errors import EXIT_OK, RESERVED_EXIT_CODES

JSON_SCHEMA_VERSION = 1  # of the --json reports of run, bootstrap, backfill and status


@dataclass(frozen=True, slots=True)
class Command:
    """One ``pg2delta <name>``: its flags beyond the common ones (``arguments``), the flags that override
    the config (``flags``), whether it needs a source, and what it does (``execute``, the exit code).
    A new command is a module of pg2delta.cli defining one, named in :data:`pg2delta.cli.COMMANDS`."""

    name: str
    help: str
    execute: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None
    flags: Callable[[argparse.Namespace], dict[str, Any]] = lambda args: {}
    needs_source: bool = True


def load_config(args: argparse.Namespace) -> Config:
    """The config of the command line ``args``: the file, the environment, then the flags; starts the
    command's lineage (pg2delta.lineage)."""
    command: Command = args.registered
    config = load(
        args.config, need_source=command.needs_source, dsn=args.dsn, slot=args.slot, publication=args.publication,
        lake=args.lake, engine=args.engine, remote=args.remote, **command.flags(args),
    )
    args.config_loaded = config
    from pg2delta.lineage import Lineage

    args.lineage = Lineage.start(args.command, config.source.slot)
    return config


def idle_code(text: str) -> int:
    try:
        code = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an exit code: {text!r}") from None
    if not 0 <= code <= 255 or code in RESERVED_EXIT_CODES:
        raise argparse.ArgumentTypeError(
            f"{code} is not allowed: choose 0..255 other than {', '.join(map(str, sorted(RESERVED_EXIT_CODES)))}"
        )
    return code


def non_negative(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
        return value

    return parse


def idle_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--idle-exit-code", type=idle_code, default=EXIT_OK, metavar="N",
        help="exit code of a run with nothing to do (default 0; e.g. 3 to branch on it)",
    )


def size_text(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n = n / 1024  # type: ignore[assignment]
    return str(n)
