"""`ulysses.unregister` on DeepSpeed releases without `parallel_state_sp._release_sequence_parallel_groups`
(0.19.5-0.19.7 lack it; 0.19.8 added it): the SP groups are still dropped, so a later stage can register another
SP degree. Single process, no groups created (< 1 s)."""

from __future__ import annotations

import pytest
from deepspeed.runtime.sequence_parallel import parallel_state_sp

from model_utils import ulysses


@pytest.mark.parametrize("has_release", [True, False], ids=["deepspeed-0.19.8", "deepspeed-0.19.5"])
def test_unregister_drops_the_sp_groups_with_or_without_deepspeeds_release(monkeypatch, has_release):
    if not has_release:
        monkeypatch.delattr(parallel_state_sp, "_release_sequence_parallel_groups", raising=False)
    # stand-ins for a stage's groups (no process group in this process, so destroy_groups skips them)
    monkeypatch.setattr(parallel_state_sp, "_SEQUENCE_PARALLEL_GROUP", object())
    monkeypatch.setattr(parallel_state_sp, "_SEQUENCE_DATA_PARALLEL_GROUP", object())
    ulysses.unregister()
    assert parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None
    assert parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP is None
