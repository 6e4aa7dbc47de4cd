"""Decode: pgoutput bytes in, ordered per-table Arrow batches out, on the driver.

``pgoutput`` (the pure protocol parser); ``changes`` (the window decoder) with ``transactions``
(where to cut, which rows each transaction holds, commit order and positions), ``relations`` (the
relation version each change was sent with), ``rowbatch`` (tuples to one Arrow batch per relation
version) and ``tuplewalk`` (the column-wise walk of ``_tuples.c``); ``typemap/`` (PostgreSQL values
to Arrow, one module per type family); ``_tuples.c`` (the byte loops in C) and ``_oids`` (built-in
types, generated). Nothing here reads a server or writes a file: reading a window of the slot is
:mod:`pg2delta.window`'s.
"""
