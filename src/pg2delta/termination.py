"""SIGTERM: a scheduler's timeout (Airflow's ``execution_timeout``) or a pod's shutdown (Kubernetes'
termination grace period) ends the command promptly with exit 75, not after the scheduler gives
up and sends SIGKILL.

The first SIGTERM raises :class:`pg2delta.errors.Terminated` in the main thread wherever it is: the
window under way is abandoned (a table's MERGE already running in another thread finishes), the
``finally`` blocks close the connections, release the slot's lock and remove the run's staging
files. The slot moves only after every Delta commit of a window and its applied-log row
(:meth:`pg2delta.apply.window_log.WindowLog.log_and_advance`), so stopping anywhere leaves it at
most where the lake is: the next run applies the window again, which the applied log makes
harmless, exactly as after a crash. Where the main thread sits in a call that does not return to Python in time, the process
exits with 75 anyway after :data:`GRACE_ENV` seconds (default :data:`DEFAULT_GRACE`), as a kill
would; so does a second SIGTERM.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from pg2delta.errors import EXIT_RETRYABLE, Terminated

log = logging.getLogger(__name__)

GRACE_ENV = "PG2DELTA_TERM_GRACE_SECONDS"
DEFAULT_GRACE = 20.0  # under Kubernetes' default grace period of 30 s
_requested = threading.Event()


def requested() -> bool:
    """Whether a SIGTERM arrived: whatever error ends the command now, its exit code is 75."""
    return _requested.is_set()


def _grace() -> float:
    try:
        return max(0.0, float(os.environ.get(GRACE_ENV, DEFAULT_GRACE)))
    except ValueError:
        return DEFAULT_GRACE


_ended: list[int] = []  # the command's exit code, once it has ended (exit_on_sigterm)


def _exit_now(why: str) -> None:
    if _ended:  # the command has ended and said so; only the process's shutdown is slow
        os._exit(_ended[0])
    # os.write, not logging: the main thread may hold the logging lock.
    os.write(2, f"pg2delta: terminated error: {why}; exiting now, as a kill would (the slot did not move past the lake)\n".encode())
    faulthandler.dump_traceback(all_threads=True)  # where it hung, for whoever reads the log
    os._exit(EXIT_RETRYABLE)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _requested.is_set():
        _exit_now("a second SIGTERM")
    _requested.set()
    grace = _grace()
    timer = threading.Timer(grace, _exit_now, args=(f"still running {grace:g} s after SIGTERM",))
    timer.daemon = True
    timer.start()
    raise Terminated("SIGTERM received: the window under way was abandoned, the slot stays where the lake is; run again")


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """SIGTERM handled as described above while the block runs (in the main thread; elsewhere,
    nothing changes), the previous handler back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _requested.clear()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_on_sigterm(code: int) -> None:
    """The command has ended with ``code`` and the process is shutting down (the engine's threads,
    atexit): SIGTERM is ignored from now on, so the process still exits with that code (a Python
    handler would be reset to the default, killing, action by the interpreter's finalization); a
    forced exit pending from an earlier SIGTERM exits with it too."""
    _ended.append(code)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


__all__ = ["DEFAULT_GRACE", "GRACE_ENV", "exit_on_sigterm", "handled", "requested"]
