"""The save benchmark (benchmarks/bench_save.py) in parts: common, state, measure, methods, runner, report."""
