"""Data: vocabularies, the built-in corpus, document sources and seqio tasks."""
