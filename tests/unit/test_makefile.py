"""The Makefile's demos give deepspeed a port free when make starts: they used deepspeed's 29500, and on a shared node
another run holding it ended the demo ("MASTER_PORT 29500 ... is taken: give this run its own with --master_port")
with no way to give one through make. `make -n` prints the commands without running them (the port's one-liner runs)."""

from __future__ import annotations

import re
import subprocess

from tests.distributed import ROOT

DEMOS = ["demo", "demo-machinery", "demo-long", "demo-sft"]


def launches(*args: str) -> list[str]:
    out = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    return [ln for ln in out.splitlines() if "bin/deepspeed " in ln]


def test_every_demo_takes_a_free_port_or_yours():
    lines = launches(*DEMOS)
    assert len(lines) == len(DEMOS), lines
    ports = [int(m[1]) for ln in lines if (m := re.search(r" --master_port (\d+) train\.py ", ln))]
    assert len(ports) == len(DEMOS) and all(1024 <= p < 65536 and p != 29500 for p in ports), lines
    assert all(" --master_port 12345 train.py " in ln for ln in launches(*DEMOS, "MASTER_PORT=12345")), lines
