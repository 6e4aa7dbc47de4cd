"""The lake side every operation shares: its configuration, the lake, the engine, the history.

``run``, ``plan``, ``bootstrap``, ``resync``, ``backfill``, ``maintain`` and ``verify`` each
open one :class:`Lakeside`; the engine (Spark or the embedded one) starts on first use, so an
operation that only reads the source or the file system (a bootstrap's copy worker) never
starts one. :class:`pg2delta.job.Job` is the run's.
"""

from __future__ import annotations

from collections.abc import Callable

from pg2delta.config import Config
from pg2delta.engine import Engine, Lake
from pg2delta.history import HistoryWriter


class Lakeside:
    """The configuration, the lake under its root, its engine (started on first use) and its history tables."""

    def __init__(self, config: Config, *, engine_factory: Callable[[Lake], Engine] | None = None) -> None:
        self.config = config
        self.lake = Lake(config.lake_root)
        self._engine_factory = engine_factory or (lambda lake: Engine.start(config.engine, lake))
        self._engine: Engine | None = None
        self.history = HistoryWriter(config, self.lake)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = self._engine_factory(self.lake)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.stop()
            self._engine = None


__all__ = ["Lakeside"]
