# The README's commands call these targets. Everything installs into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv install test test-here test-torch torch-venv example example-ddp example-lightning example-transformers bench bench-load bench-doors bench-lightning bench-incremental bench-memory-tier bench-transformers bench-scale bench-gpu bench-preemption lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,bench,msc]"
	# torchtitan for tests/test_torchtitan.py, without its dependencies: its CheckpointManager and
	# optimizer containers need only tyro and spmd_types (in the test extra); the rest (datasets,
	# wandb, tensorboard, pyarrow, ...) is ~440 MB that no test uses
	$(PY) -m pip install --quiet --no-deps torchtitan==0.3.0
	touch $(STAMP)

install: venv

# Two pytest processes: most tests wait on worker and rank start-up (an interpreter importing
# torch), so a second one keeps both cores busy. TEST_PROCESSES=0 runs the suite in one process.
TEST_PROCESSES ?= 2
test: venv
	$(PY) -m pytest -q -ra --durations=15 -n $(TEST_PROCESSES) $(PYTEST_ARGS)

# The suite against another torch, in a venv of its own (.venv-torch-X, beside .venv, which keeps its
# pinned torch): `make test-torch TORCH=2.15.0`. Torch comes from TORCH_INDEX (PyTorch's CPU wheels)
# when that answers; where it does not (only PyPI reachable), from the default index: PyPI's (CUDA)
# build, which runs the CPU suite too. TORCH_PIP_ENV: the torch asked for wins over a site-wide pip
# constraint that caps torch (`constraint =` in a pip.conf); empty it to keep that constraint.
TORCH ?= 2.15.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP_ENV ?= PIP_CONSTRAINT=/dev/null
TORCH_VENV := .venv-torch-$(TORCH)

torch-venv: $(TORCH_VENV)/.installed

.venv-torch-%/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/python -m pip install --quiet --upgrade pip
	if $(PYTHON) -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=10)' $(TORCH_INDEX) 2>/dev/null; \
	then $(TORCH_PIP_ENV) .venv-torch-$*/bin/python -m pip install --quiet --index-url $(TORCH_INDEX) torch==$*; \
	else echo "$(TORCH_INDEX) does not answer: torch $* from the default index"; \
		$(TORCH_PIP_ENV) .venv-torch-$*/bin/python -m pip install --quiet torch==$*; fi
	$(TORCH_PIP_ENV) .venv-torch-$*/bin/python -m pip install --quiet -e ".[test,bench,msc]"
	$(TORCH_PIP_ENV) .venv-torch-$*/bin/python -m pip install --quiet --no-deps torchtitan==0.3.0
	.venv-torch-$*/bin/python -c 'import torch; assert torch.__version__.split("+")[0] == "$*", torch.__version__'
	touch $@

test-torch: $(TORCH_VENV)/.installed
	$(TORCH_VENV)/bin/python -m pytest -q -ra -n $(TEST_PROCESSES) $(PYTEST_ARGS)

# The suite against this interpreter's own torch and packages, no venv built: how a machine with a
# preinstalled (CUDA) torch runs it, e.g. `PYTHON=python3 make test-here`. The project is used from
# this checkout (asyncckpt_worker through a link in .here/); extras that are missing (moto,
# multi-storage-client, torchtitan, ...) make their tests skip with the reason.
HERE_PROCESSES ?= auto
test-here:
	mkdir -p .here && ln -sfn ../worker .here/asyncckpt_worker
	PYTHONPATH="$(CURDIR)/.here:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m pytest -q -ra \
		$$($(PYTHON) -c 'import xdist' 2>/dev/null && echo "-n $(HERE_PROCESSES)") $(PYTEST_ARGS)

example: venv
	$(PY) examples/train_loop.py --root checkpoints/example --fresh
	$(PY) examples/train_loop.py --root checkpoints/example --steps 300

example-ddp: venv
	$(VENV)/bin/torchrun --nproc_per_node=2 examples/ddp_torchrun.py --root checkpoints/ddp --fresh
	$(VENV)/bin/torchrun --nproc_per_node=2 examples/ddp_torchrun.py --root checkpoints/ddp --steps 120

example-lightning: venv
	$(PY) examples/lightning_fit.py --dir checkpoints/lightning --fresh --steps 24
	$(PY) examples/lightning_fit.py --dir checkpoints/lightning --steps 48

example-transformers: venv
	$(PY) examples/transformers_trainer.py --dir checkpoints/transformers --fresh --steps 20
	$(PY) examples/transformers_trainer.py --dir checkpoints/transformers --steps 40

bench: venv
	$(PY) benchmarks/bench_save.py --out bench_out/bench.json --plot bench_out/bench.png

bench-load: venv
	$(PY) benchmarks/bench_load.py --size-mb 512 --out bench_out/bench_load.json

bench-doors: venv
	$(PY) benchmarks/bench_doors.py --out bench_out/bench_doors.json

bench-incremental: venv
	$(PY) benchmarks/bench_incremental.py --size-mib 1024 --out bench_out/bench_incremental.json

bench-memory-tier: venv
	$(PY) benchmarks/bench_memory_tier.py --size-mb 1024 --saves 25 --restarts 9 --out bench_out/bench_memory_tier.json
	$(PY) benchmarks/bench_memory_replicas.py --mb-per-rank 256 --saves 9 --restarts 5 --out bench_out/bench_memory_replicas.json

bench-transformers: venv
	$(PY) benchmarks/bench_transformers.py --out bench_out/bench_transformers.json

bench-preemption: venv
	$(PY) benchmarks/bench_preemption.py --size-mib 1024 --rounds 3 --out bench_out/bench_preemption.json

bench-lightning: venv
	$(PY) benchmarks/bench_lightning.py --out bench_out/bench_lightning.json

# the coordinator's cost of a save at many ranks, simulated in one process (docs/benchmark.md "Scale")
bench-scale: venv
	$(PY) benchmarks/bench_scale.py --out bench_out/bench_scale.json --plot bench_out/bench_scale.png

# GPU benchmark (docs/benchmark.md "GPU"): this interpreter's own CUDA torch, no venv; GIB=16 for the large state
GIB ?= 4
bench-gpu:
	mkdir -p .here bench_out && ln -sfn ../worker .here/asyncckpt_worker
	PYTHONPATH="$(CURDIR)/.here:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) benchmarks/bench_gpu.py \
		--size-gib $(GIB) --out bench_out/bench_gpu_$(GIB)gib.json

lint: venv
	$(PY) -m pyflakes asyncckpt worker tests examples benchmarks

clean:
	rm -rf $(VENV) .venv-torch-* .here checkpoints bench_out
