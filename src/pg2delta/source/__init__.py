"""Source: what comes from PostgreSQL.

``slot`` (checks, the run's lock, bounded and streamed peeks of the replication slot, the advance),
``catalog`` (type look-ups for user-defined types), ``rewrites`` (leaf partitions' relfilenodes, and
a TRUNCATE of one alone found in the slot's backlog), ``publication`` (the published tables, from
the catalog), ``keys`` (which columns a relation is keyed on), ``snapshot`` (exported snapshots and
connections reading as of one), ``copy`` (a table's binary COPY decoded into Arrow), ``throwaway``
(a throwaway server with ``wal_level=logical`` for tests, the demo and benchmarks).
"""
