"""Helpers shared by the test suite and the benchmarks (not part of the checkpointing API).

Kept in the package so both import them the same way (`from asyncckpt.testing.s3_server import
MotoServer`) from a fresh clone, without editing sys.path. Nothing here is imported by the library.
"""
