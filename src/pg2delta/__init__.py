"""pg2delta: batch change-data-capture from a PostgreSQL logical replication slot into Delta Lake."""

import os as _os

__version__ = "0.1.0"

# pyarrow (its default memory pool) and pysail allocate with mimalloc, which by default gives the
# pages it frees back to the system only a second later: a run's resident set then keeps the peak
# of each step while the next one grows (the decoded window next to the reduce's and the MERGE's
# buffers). Give them back as they are freed. mimalloc reads this once, when the library loads,
# so it is set here, before pg2delta imports either; the environment can still set it. Arenas are
# also committed as they are used rather than whole: with them committed eagerly, the pages given
# back still counted in the resident set, and the MERGE of a 5,000,000-row window peaked 150-500 MB
# higher (measured, bench/README.md).
ALLOCATOR = {"MIMALLOC_PURGE_DELAY": "0", "MIMALLOC_ARENA_EAGER_COMMIT": "0"}

# A whole-table copy (bootstrap, resync) streams every row through a few buffers of the same sizes,
# freed and taken again many times a second: given back at once, each was faulted in again, which
# took about an eighth of the copy's CPU (mostly the engine's Delta writes). Kept 25 ms, they are reused;
# the copy's resident set stays bounded (measured, bench/README.md).
BULK_ALLOCATOR = {"MIMALLOC_PURGE_DELAY": "25"}

_DEFAULTED = frozenset(name for name in ALLOCATOR if name not in _os.environ)  # not the environment's own
for _name, _value in ALLOCATOR.items():
    _os.environ.setdefault(_name, _value)


def use_bulk_allocator() -> bool:
    """Switch what loads mimalloc from now on (the embedded engine, the copy's worker processes)
    to :data:`BULK_ALLOCATOR`, for a command that copies whole tables. Only settings pg2delta chose
    itself change, never the environment's own, and only while no engine is loaded and no other
    thread runs (the environment is not safe to change under another thread, and a loaded engine
    has read it already). Returns whether anything changed."""
    import sys
    import threading

    if "pysail" in sys.modules or threading.active_count() > 1:
        return False
    changed = False
    for name, value in BULK_ALLOCATOR.items():
        if name in _DEFAULTED and _os.environ.get(name) != value:
            _os.environ[name] = value
            changed = True
    return changed
