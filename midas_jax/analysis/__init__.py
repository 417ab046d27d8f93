"""Compile-ahead analysis: what a program will do, read before it runs (its collectives and loops, its
matmuls' dtypes, the TPU compiler's price, the bytes it sends between slices, its activation memory),
and the slices it is compiled for."""
