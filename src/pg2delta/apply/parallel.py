"""A window's tables, several at once (``window.parallel_tables``): each its own Delta table and
commit, so the engine runs their work as concurrent jobs. :func:`apply_tables` for the tables'
commits (the first failure stops the tables not yet started), :func:`map_tables` for work that
writes nothing, or that is idempotent table by table (the plans, the histories).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

from pg2delta.faults import fault_point

T = TypeVar("T")
R = TypeVar("R")


def apply_tables(workers: int, targets: Sequence[T], apply: Callable[[T], R]) -> list[R]:
    """``apply`` every target, up to ``workers`` (``window.parallel_tables``) at once; reports in ``targets``' order.

    The tables of one window are independent (each its own Delta table and commit), so Spark
    runs their MERGEs as concurrent jobs. The first failure stops tables not yet started and is
    raised once the running ones have finished: nothing is logged and the slot stays put, so
    the next run applies the window again (tables that did commit are recognised, see
    :meth:`pg2delta.apply.table.TableApplier.txn`).
    """
    workers = min(workers, len(targets))
    if workers <= 1:
        reports = []
        for n, tgt in enumerate(targets):
            if n > 0:
                fault_point("between_tables")
            reports.append(apply(tgt))
        return reports
    with ThreadPoolExecutor(workers, thread_name_prefix="pg2delta-apply") as pool:
        futures: list[Future[R]] = [pool.submit(apply, tgt) for tgt in targets]
        pending: set[Future[R]] = set(futures)
        first = True
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            if any(f.exception() is not None for f in done):
                for f in pending:
                    f.cancel()
                wait(pending)
                break
            if first and pending:
                first = False
                fault_point("between_tables")  # some tables committed, others not yet
        for f in futures:  # the first failure in the targets' order
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]


def map_tables(workers: int, targets: Sequence[T], fn: Callable[[T], R]) -> list[R]:
    """``fn`` of every target, up to ``workers`` at once, in ``targets``' order;
    the first failure in that order is raised once all have finished (the plans, which write
    nothing, and the histories, each idempotent on its own)."""
    workers = min(workers, len(targets))
    if workers <= 1:
        return [fn(t) for t in targets]
    with ThreadPoolExecutor(workers, thread_name_prefix="pg2delta-plan") as pool:
        futures = [pool.submit(fn, t) for t in targets]
        wait(futures)
    return [f.result() for f in futures]


__all__ = ["apply_tables", "map_tables"]
