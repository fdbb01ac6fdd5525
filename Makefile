# make setup | demo | demo-extend | demo-long | test | test-slow | calibrate | lint
export DS_ACCELERATOR ?= cpu
PY := .venv/bin/python

setup:
	bash scripts/setup.sh

demo:
	.venv/bin/deepspeed --num_gpus 2 train.py --config recipes/tiny_cpu.yaml

# ~5 min on 2 cores: a base that retrieves at 256 tokens extended to 2048 with YaRN (docs/results/curriculum.md, bench/results/demo_extend/)
demo-extend:
	OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 train.py --config recipes/tiny_cpu_extend.yaml

# ~20 min on 2 cores: the tiny model learns passkey at 256 and keeps it to 2048 (docs/results/curriculum.md, bench/results/demo_long/)
demo-long:
	OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 train.py --config recipes/tiny_cpu_long.yaml

test:
	.venv/bin/pytest -q -m "not slow"

# The planner's memory model against the peak RSS of real train.py runs (~2 min on 2 cores): a benchmark in a
# process of its own, exit 1 when a point is outside 20% (bench/calibration.py, bench/results/calibration.json)
calibrate:
	$(PY) -m bench.calibration

test-slow:
	.venv/bin/pytest -q -m slow

lint:
	.venv/bin/ruff check .

.PHONY: setup demo demo-extend demo-long test test-slow calibrate lint
