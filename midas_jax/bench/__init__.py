"""Benchmarks: the machine's compute ceiling, throughput, MFU and data-pipeline speed."""
