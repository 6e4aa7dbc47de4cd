"""The lake side every operation shares: its configuration, the lake, the engine, the history.

``run``, ``plan``, ``bootstrap``, ``resync``, ``backfill``, ``maintain`` and ``verify`` each
open one :class:`Lakeside`; the engine (Spark or the embedded one) starts on first use, so an
operation that only reads the source or the file system (a bootstrap's copy worker) never
starts one. :class:`pg2delta.job.Job` is the run's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pg2delta.apply.history import HISTORY_SUFFIX, HistoryWriter
from pg2delta.config import Config
from pg2delta.delta_features import NO_FEATURES, DeltaFeatures
from pg2delta.lake.engine import Engine, Lake

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LakeWriter:
    """What a table's commits are made with, and nothing else of the operation: the lake's files and
    its engine, started when first asked for (``start_engine``: it may still be starting)."""

    lake: Lake
    start_engine: Callable[[], Engine]

    @property
    def engine(self) -> Engine:
        return self.start_engine()


class Lakeside:
    """The configuration, the lake under its root, its engine (started on first use) and its history tables."""

    def __init__(self, config: Config, *, engine_factory: Callable[[Lake], Engine] | None = None) -> None:
        self.config = config
        self.lake = Lake(config.lake_root)
        self._engine_factory = engine_factory or (lambda lake: Engine.start(config.engine, lake))
        self._engine: Engine | None = None
        self._starting: Future[Engine] | None = None
        self._engine_lock = threading.Lock()
        self.history = HistoryWriter(config, self.lake)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            with self._engine_lock:  # the tables of a window may ask from several threads at once
                if self._engine is None:
                    starting, self._starting = self._starting, None
                    t0 = time.monotonic()
                    if starting is not None:
                        self._engine = starting.result()
                        self._engine.adopt()  # started in another thread: this one's now
                    else:
                        self._engine = self._engine_factory(self.lake)
                    self._engine.features_of = self.delta_features
                    # What an idle run must never log (it decides from the slot alone).
                    log.info("engine %s started (%.1f s)", self.config.engine.kind, time.monotonic() - t0)
        return self._engine

    @property
    def writer(self) -> LakeWriter:
        """The lake and the engine alone, for the stages that commit (pg2delta.apply.table)."""
        return LakeWriter(self.lake, lambda: self.engine)

    def delta_features(self, schema: str, table: str) -> DeltaFeatures:
        """The configured Delta features of the lake's table ``schema.table`` (none for a history table)."""
        return NO_FEATURES if table.endswith(HISTORY_SUFFIX) else self.config.delta_features(schema, table)

    @property
    def engine_started(self) -> bool:
        """Whether this operation started its engine (a run with nothing to do never does)."""
        return self._engine is not None or self._starting is not None

    @property
    def started_engine(self) -> Callable[[], Engine] | None:
        """What gives the engine (waiting for a start under way, only when called), if this
        operation started one; else None."""
        return (lambda: self.engine) if self.engine_started else None

    def start_engine_early(self, *, work_known: bool = False) -> None:
        """Start the engine in a background thread now, for a run that will need it: it then starts
        while the source is checked and the server prepares the first window (the peek sends its
        first row only once it has decoded the whole window). :attr:`engine` waits for it, and
        raises what the start raised. On Apache Spark, whose session takes seconds, only once the
        run knows it has something to write (``work_known``: a window with changes of a published
        table), so that a run with nothing to do starts no session; the session then starts while
        the window's tables are planned, reduced and staged."""
        if self._engine is not None or self._starting is not None:
            return
        if self.config.engine.kind == "spark" and not work_known:
            return
        future: Future[Engine] = Future()

        def start() -> None:
            try:
                future.set_result(self._engine_factory(self.lake))
            except BaseException as exc:  # handed to the thread that asks for the engine
                future.set_exception(exc)

        threading.Thread(target=start, name="pg2delta engine start", daemon=True).start()
        self._starting = future

    def close(self) -> None:
        starting, self._starting = self._starting, None
        if self._engine is None and starting is not None:  # a start under way finishes, then stops
            with contextlib.suppress(Exception):  # one that failed has nothing to stop
                self._engine = starting.result()
        if self._engine is not None:
            self._engine.stop()
            self._engine = None


__all__ = ["LakeWriter", "Lakeside"]
