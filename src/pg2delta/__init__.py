"""pg2delta: batch change-data-capture from a PostgreSQL logical replication slot into Delta Lake."""

__version__ = "0.1.0"
