"""Metrics helpers: the peak memory logged per step is the stage's own (reset at each stage's start)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from base.host import peak_rss_bytes
from training.metrics import reset_peak_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM reset through /proc/self/clear_refs")
def test_peak_memory_resets_at_a_stage_start():
    a = np.ones(300 * 2**20 // 8)  # 300 MiB touched, then freed: the whole-process peak keeps it
    a += 1
    during = peak_rss_bytes()
    del a
    assert peak_rss_bytes() > during - 10 * 2**20  # freed, still the peak
    reset_peak_memory()
    assert peak_rss_bytes() < during - 200 * 2**20
