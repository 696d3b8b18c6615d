"""The scale simulator (benchmarks/bench_scale.py): the real planning, plan cache and commit of a
save at thousands of ranks, driven in one process with what every other rank would send."""
