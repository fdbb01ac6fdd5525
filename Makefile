# make setup | demo | test | test-slow | lint
export DS_ACCELERATOR ?= cpu
PY := .venv/bin/python

setup:
	bash scripts/setup.sh

demo:
	.venv/bin/deepspeed --num_gpus 2 train.py --config recipes/tiny_cpu.yaml

test:
	.venv/bin/pytest -q -m "not slow"

test-slow:
	.venv/bin/pytest -q -m slow

lint:
	.venv/bin/ruff check .

.PHONY: setup demo test test-slow lint
