"""Lake: everything that touches Spark or Delta, and what the lake records about itself.

``engine`` (the Spark session, embedded pysail or Apache Spark with delta-spark, behind one class
made of ``engine_session`` (starting it, what differs between engines), ``engine_reads``,
``engine_writes`` (MERGE and the other commits), ``engine_staged`` (a spilled window reduced in the
engine) and ``engine_maintain``); ``lake_files`` (the lake's files and Delta logs through pyarrow
alone); ``applied_log`` (what each Delta table holds, read back to make a replayed window
harmless); ``sql`` and ``staged_sql`` (Spark SQL spelled once: identifiers, key equality, the
spilled reduce); ``types`` (Spark type names of Arrow types, and which widen which).
"""
