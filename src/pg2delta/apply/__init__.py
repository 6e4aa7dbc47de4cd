"""Apply: a window's decoded changes turned into Delta commits, in commit order.

``targets`` (which Delta table each relation goes to), ``tableplan`` and ``schema`` (how each
table's shape must change, or why it cannot), ``keys`` (the columns a relation is merged on),
``merge`` (reduce to one final state per key, TOAST, the MERGE SQL), ``stage`` (reduce or stage a
table's changes), ``table`` (the MERGE of one target, its history), ``parallel`` (a window's tables at once),
``commits`` (every commit of a planned window), ``window_log`` (its applied-log entries, logged, and the slot's advance),
``changelog`` and ``history`` (the change log and SCD2 tables written next to a table);
``lakeside`` (the configuration, lake, engine and histories every operation shares).
"""
