"""Copy: published tables copied into the lake as of an exported snapshot.

``copier`` (the copy of a list of tables at one snapshot, committed and logged table by table;
the copies at a new snapshot that a resumed bootstrap, the run and resync make); ``again`` (the
tables a run copies again in the middle of a window); ``staging`` (one table's COPY staged as
Parquet, in this process or in worker processes).
"""
