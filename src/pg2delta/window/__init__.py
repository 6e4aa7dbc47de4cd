"""Window: one window of the slot read, decoded and held (in memory or spilled), before anything of it is applied.

``read`` (peek the slot up to the run's bound, decode, gather per relation, cut before a shape
change); ``spill`` (a window past the memory budget, staged as Parquet in the lake's staging
area); ``shapes`` (a Relation message's columns and key, and where a window must end).
"""
