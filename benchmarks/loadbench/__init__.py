"""Helpers of bench_load.py."""
