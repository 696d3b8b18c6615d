"""The GPU benchmark (benchmarks/bench_gpu.py) in parts: state, limits, savers, saves, loop, loads, report."""
