"""Fault points: the test hook that kills the process for real at a named point of a run.

``PG2DELTA_CRASH_AT=<name>`` makes :func:`fault_point` of that name SIGKILL the process, so the
crash tests can stop a run, a bootstrap, a backfill or a maintenance between any two of its
durable steps and check that the next run recovers; ``PG2DELTA_SIGTERM_AT=<name>`` sends SIGTERM
there instead, as a scheduler's timeout would; ``PG2DELTA_STOP_AT=<name>`` stops the process
there (SIGSTOP) until the test lets it go on (SIGCONT), having meanwhile failed something under it
(a Spark Connect server killed mid-run). Nothing else reads the variables.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

FAULT_ENV = "PG2DELTA_CRASH_AT"  # test hook: SIGKILL this process at the named point
TERM_ENV = "PG2DELTA_SIGTERM_AT"  # test hook: SIGTERM this process at the named point (pg2delta.termination)
STOP_ENV = "PG2DELTA_STOP_AT"  # test hook: SIGSTOP this process at the named point (the test sends SIGCONT)


def fault_point(name: str) -> None:
    """Kill this process for real at ``name`` when the test hook asks for it (or send it SIGTERM)."""
    if os.environ.get(FAULT_ENV) == name:
        log.warning("fault injection: killing the process at %s", name)
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(TERM_ENV) == name:
        log.warning("fault injection: SIGTERM to the process at %s", name)
        os.kill(os.getpid(), signal.SIGTERM)
    if os.environ.get(STOP_ENV) == name:
        log.warning("fault injection: stopping the process at %s", name)
        os.kill(os.getpid(), signal.SIGSTOP)


__all__ = ["FAULT_ENV", "STOP_ENV", "TERM_ENV", "fault_point"]
