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
for _name, _value in ALLOCATOR.items():
    _os.environ.setdefault(_name, _value)
