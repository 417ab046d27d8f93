"""Data: step-addressed batches of packed UL2 rows. At the top: the in-memory pipeline
(pipeline.py), the weighted mixture of sources (mixture.py), what a run config asks for
(factory.py), prefetch and samples. The wings: ul2/ (objectives, packing, streams, row logic),
vocab/ (vocabularies), sources/ (documents and seqio tasks), store/ (prepared token stores)."""
