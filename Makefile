# make setup | demo | demo-machinery | demo-long | demo-sft | test | test-slow | calibrate | gpu-check | gpu-wheels | lint
export DS_ACCELERATOR ?= cpu
PY := .venv/bin/python
# The demos' rendezvous port: one free when make starts (the kernel's pick for port 0), not deepspeed's 29500, which
# another run on a shared node may hold ("MASTER_PORT 29500 ... is taken"); `make demo MASTER_PORT=N` gives your own.
# Recursive (`?=`): only a target that names it starts Python
MASTER_PORT ?= $(shell $(PY) -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')

setup:
	bash scripts/setup.sh

# The main job (~5 min on 2 idle cores: 5:02, README): the shipped base, which retrieves a passkey at 256 tokens,
# extended to 2048 with YaRN and short-context replay; then its curves and heat maps (docs/results/curriculum.md,
# bench/results/demo_extend/); ends by printing its evaluation summary (before -> after, then eval/summary.md's
# tables: scripts/eval_summary.py)
demo:
	OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 --master_port $(MASTER_PORT) train.py --config recipes/tiny_cpu_extend.yaml
	$(PY) scripts/plot_metrics.py checkpoints/tiny_cpu_extend/metrics.jsonl -o checkpoints/tiny_cpu_extend/metrics.png
	@$(PY) scripts/eval_summary.py checkpoints/tiny_cpu_extend

demo-extend: demo

# ~6 min: the machinery on a model trained from scratch (1k -> 8k, code corpus, three tasks, export); it does not
# learn to retrieve in that time (0.00 everywhere): docs/results/curriculum.md
demo-machinery:
	.venv/bin/deepspeed --num_gpus 2 --master_port $(MASTER_PORT) train.py --config recipes/tiny_cpu.yaml
	$(PY) scripts/plot_metrics.py checkpoints/tiny_cpu/metrics.jsonl -o checkpoints/tiny_cpu/metrics.png

# ~20 min on 2 cores: the tiny model learns passkey at 256 and keeps it to 2048 (docs/results/curriculum.md, bench/results/demo_long/)
demo-long:
	OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 --master_port $(MASTER_PORT) train.py --config recipes/tiny_cpu_long.yaml

# ~1 min on 2 idle cores (45 s, 2026-11-29; ~3 min on shared ones): supervised fine-tuning of the same base on the demo's chat set (loss on the assistant's replies,
# conversations packed with document masking, 40% passkey steps and 30% replay at 256 to keep it); prints its evaluation summary (docs/sft.md)
demo-sft:
	$(PY) -m data.chat_demo .cache/demo/chat_demo.jsonl
	OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 --master_port $(MASTER_PORT) train.py --config recipes/tiny_cpu_sft.yaml
	@$(PY) scripts/eval_summary.py checkpoints/tiny_cpu_sft

test:
	.venv/bin/pytest -q -m "not slow" -n 2 --no-loadscope-reorder

# The planner's memory model against the peak RSS of real train.py runs (~2 min on 2 cores): a benchmark in a
# process of its own, exit 1 when a point is outside 20% (bench/calibration.py, bench/results/calibration.json)
calibrate:
	$(PY) -m bench.calibration

# On a GPU machine (<= 8 min on one H100/H200, docs/benchmarks.md): the 1-GPU headline's configuration at its planned
# longest, every phase against the planner; the attention-kernel probe, the host arena, document-masking parity; then
# as time allows auto's run at 1M, the gap near the cap, the smoke test, the length/speed ladder;
# bench/results/gpu.json and docs/results/gpu.md (bench/gpu.py)
gpu-check:
	DS_ACCELERATOR=cuda $(PY) -m bench.gpu

# the wheels the device tool's GPU machine lacks (docs/benchmarks.md)
gpu-wheels:
	bash bench/gpu_wheels.sh

test-slow:
	.venv/bin/pytest -q -m slow

lint:
	.venv/bin/ruff check .

.PHONY: setup demo demo-extend demo-machinery demo-long demo-sft test test-slow calibrate gpu-check gpu-wheels lint
