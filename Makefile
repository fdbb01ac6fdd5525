# make setup | demo | demo-extend | demo-long | test | test-slow | lint
export DS_ACCELERATOR ?= cpu
PY := .venv/bin/python

setup:
	bash scripts/setup.sh

demo:
	.venv/bin/deepspeed --num_gpus 2 train.py --config recipes/tiny_cpu.yaml

# ~5 min on 2 cores: a base that retrieves at 256 tokens extended to 2048 with YaRN (docs/results/curriculum.md, bench/demo_extend/)
demo-extend:
	OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 train.py --config recipes/tiny_cpu_extend.yaml

# ~20 min on 2 cores: the tiny model learns passkey at 256 and keeps it to 2048 (docs/results/curriculum.md, bench/demo_long/)
demo-long:
	OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 train.py --config recipes/tiny_cpu_long.yaml

# The planner calibration measures the ranks' peak RSS against predictions: it runs in its own session, away from
# whatever earlier tests leave behind (in one long session its runtime baseline rose from 0.43 to 0.57-0.64 GiB).
test:
	.venv/bin/pytest -q -m "not slow" --deselect tests/test_planner_calibration.py
	.venv/bin/pytest -q -m "not slow" tests/test_planner_calibration.py

test-slow:
	.venv/bin/pytest -q -m slow

lint:
	.venv/bin/ruff check .

.PHONY: setup demo demo-extend demo-long test test-slow lint
