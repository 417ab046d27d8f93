"""The splits of LM data: every source provides them, a store holds them, and the pipelines key
their random streams by a split's place in SPLITS (train 0, validation 1)."""

SPLITS = ("train", "validation")
