"""Progress of long operations: a bar on a terminal, plain log lines under a scheduler.

``run`` (through the LSN range of its windows), ``bootstrap`` and ``resync`` (rows copied against
the tables' ``pg_class.reltuples``) and ``backfill`` (through the LSN range replayed) report to a
:class:`Progress`. When stderr is a terminal it draws a bar with the rate and an ETA (tqdm), and
the log lines of the operation are written above the bar instead of through it; otherwise (cron,
Airflow, a pipe) it logs one line every few seconds, as before there were bars.

``PG2DELTA_PROGRESS=on`` forces the bar (a terminal multiplexer that hides its TTY), ``off`` the
log lines; the default ``auto`` looks at stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from typing import Any

from pg2delta.errors import ConfigError

PROGRESS_ENV = "PG2DELTA_PROGRESS"
LOG_SECONDS = 5.0  # between progress log lines when there is no bar


def bars_wanted() -> bool:
    """Whether progress is drawn as bars (see the module docstring)."""
    mode = os.environ.get(PROGRESS_ENV, "auto").strip().lower() or "auto"
    if mode in ("on", "1", "true", "yes"):
        return True
    if mode in ("off", "0", "false", "no"):
        return False
    if mode != "auto":
        raise ConfigError(f"{PROGRESS_ENV} must be auto, on or off, not {mode!r}")
    return sys.stderr.isatty()


class Progress:
    """One operation's progress towards ``total`` (None: unknown) in ``unit``s.

    ``advance(n)`` or ``move_to(position)`` count progress; ``rows`` (the rows seen, shown with
    their rate next to the bar) is separate from the position because a run's position is an
    LSN (bytes of WAL) while people think in rows. Without a bar, ``line(rows_per_s, eta)``
    builds the log line, every :data:`LOG_SECONDS`.
    """

    def __init__(
        self,
        desc: str,
        *,
        total: int | None,
        unit: str,
        logger: logging.Logger,
        line: Any = None,
        bytes_unit: bool = False,
        bar: bool | None = None,
    ) -> None:
        self.total = total if total and total > 0 else None
        self.logger = logger
        self._line = line
        self._rows_postfix = bytes_unit  # the bar counts bytes: show rows and rows/s beside it
        self.position = 0
        self.rows = 0
        self.t0 = time.monotonic()
        self._last_log = self.t0
        self._bar: Any = None
        self._redirect: contextlib.ExitStack | None = None
        if bars_wanted() if bar is None else bar:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = contextlib.ExitStack()
            # Log records go above the bar (tqdm.write) while it is drawn.
            self._redirect.enter_context(logging_redirect_tqdm(loggers=[logging.root]))
            self._bar = tqdm(
                total=self.total, desc=desc, unit="B" if bytes_unit else unit, unit_scale=True,
                unit_divisor=1024 if bytes_unit else 1000, file=sys.stderr, leave=True, mininterval=0.2,
                **_width(),
            )

    @property
    def drawn(self) -> bool:
        return self._bar is not None

    def rate(self) -> float:
        return self.rows / max(time.monotonic() - self.t0, 1e-9)

    def eta(self) -> float | None:
        """Seconds left, from the position's rate so far; None when the total is unknown."""
        elapsed = time.monotonic() - self.t0
        if self.total is None or self.position <= 0 or self.position >= self.total:
            return None
        return (self.total - self.position) * elapsed / self.position

    def advance(self, n: int, *, rows: int | None = None) -> None:
        self.move_to(self.position + n, rows=rows)

    def move_to(self, position: int, *, rows: int | None = None, note: str | None = None) -> None:
        if rows is not None:
            self.rows = rows
        if self.total is not None:
            position = min(position, self.total)
        delta = max(0, position - self.position)
        self.position = max(self.position, position)
        if self._bar is not None:
            if note is not None or rows is not None:
                extra = f"{self.rows:,} rows, {self.rate():,.0f} rows/s" if self._rows_postfix else ""
                self._bar.set_postfix_str(", ".join(p for p in (extra, note) if p), refresh=False)
            self._bar.update(delta)
            return
        now = time.monotonic()
        if now - self._last_log >= LOG_SECONDS and self._line is not None:
            self._last_log = now
            self.logger.info(self._line(self))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _width() -> dict[str, Any]:
    """Follow the terminal's size; a terminal that reports none (0 x 0: a fresh pseudo-terminal, a
    serial console) gets ``COLUMNS``/``LINES`` or 100 x 20 rather than no bar (tqdm hides bars
    below the last line, and with 0 lines that is every bar)."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
        if size.columns > 0 and size.lines > 0:
            return {"dynamic_ncols": True}
    except (OSError, ValueError):
        pass
    fallback = shutil.get_terminal_size((100, 20))
    return {"ncols": fallback.columns, "nrows": fallback.lines or 20}


def percent(done: int, total: int | None) -> str:
    return f"{min(100.0, 100.0 * done / total):.0f}%" if total else "?"
