"""The UL2 wing: what a packed row is made of, whichever pipeline builds it. The objectives (causal
LM, prefix LM, span corruption and their special tokens), the one row format and its packing, the
counter-based random streams every draw is addressed by, and the row logic both pipelines share
(rows.py: the objective mix, per-length example tables, placing examples' tokens in a row)."""
