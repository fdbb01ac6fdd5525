"""`ulysses.unregister` drops DeepSpeed's SP groups (`parallel_state_sp._release_sequence_parallel_groups`, 0.19.8+,
base/versions.py's floor) and the mpu `deepspeed.initialize` kept, so a later stage can register another SP degree.
Single process, no groups created (< 1 s)."""

from __future__ import annotations

from deepspeed.runtime.sequence_parallel import parallel_state_sp
from deepspeed.utils import groups

from model_utils import ulysses


def test_unregister_drops_the_sp_groups_and_the_kept_mpu(monkeypatch):
    # stand-ins for a stage's groups (no process group in this process, so destroy_groups skips them)
    monkeypatch.setattr(parallel_state_sp, "_SEQUENCE_PARALLEL_GROUP", object())
    monkeypatch.setattr(parallel_state_sp, "_SEQUENCE_DATA_PARALLEL_GROUP", object())
    monkeypatch.setattr(groups, "mpu", parallel_state_sp, raising=False)
    ulysses.unregister()
    assert parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None
    assert parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP is None
    assert groups.mpu is None
