"""Metrics helpers: the peak memory logged per step is the stage's own (reset at each stage's start)."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from base.host import peak_rss_bytes
from training.metrics import reset_peak_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM reset through /proc/self/clear_refs")
def test_peak_memory_resets_at_a_stage_start():
    # anonymous pages of our own, touched then unmapped: their RSS goes back to the kernel at close, whatever the
    # allocator keeps (numpy's 300 MiB through malloc once stayed resident in a long-lived xdist worker, in CI)
    size = 300 * 2**20
    reset_peak_memory()
    before = peak_rss_bytes()
    m = mmap.mmap(-1, size)
    view = np.frombuffer(m, dtype=np.uint8)
    view[:] = 1
    during = peak_rss_bytes()
    assert during > before + 250 * 2**20
    del view
    m.close()
    assert peak_rss_bytes() > during - 10 * 2**20  # freed, still the peak
    reset_peak_memory()
    assert peak_rss_bytes() < during - 200 * 2**20
