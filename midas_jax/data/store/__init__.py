"""The prepared token store: corpora tokenized once (by Apache Beam), read by index during training.

format.py      files, manifest, start-up checks          writer.py    shards, part records, manifest
reader.py      documents and tokens by token position    layout.py    windows of an epoch, per row
permutation.py the keyed bijection of an epoch's rows    pipeline.py  UL2 batches from a store
origins.py     what a prepare reads (text, parquet, TFDS, seqio, built-in)
prepare.py     the Beam pipeline and its in-process twin
"""
