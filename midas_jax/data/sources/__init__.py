"""The sources wing: where documents come from. The built-in corpus (corpus.py), text files and the
dispatch over DataConfig.source's in-memory kinds (text_files.py), seqio Tasks read into a token
cache (seqio_reader.py) and the seqio Tasks this package defines, C4 among them (seqio_tasks.py;
importing c4_en.py registers C4 for gin), and the splits every source provides (splits.py)."""
