"""Checkpoint commit protocol without a process group: manifest written last, verification rejects missing,
truncated, corrupted or unlisted files, auto-resume falls back to the previous complete checkpoint, and
rotation never deletes the newest complete one."""

from __future__ import annotations

import json
import os

import pytest

from training.checkpoint import MANIFEST, POINTER, Checkpointer, tag_for


class FakeConfig:
    def to_json_string(self):
        return json.dumps({"model_type": "llama"})


class FakeEngine:
    """Writes files the way DeepSpeed's save_checkpoint does (one folder per tag)."""

    def save_checkpoint(self, root, tag, save_latest):
        assert save_latest is False  # DeepSpeed's own `latest` is never used
        with open(os.path.join(root, tag, "zero_pp_rank_0_mp_rank_00_model_states.pt"), "wb") as fh:
            fh.write(os.urandom(4096))


def save(ck, step):
    return ck.save(FakeEngine(), step, {"step": step}, {"sampler": {}}, FakeConfig())


def test_commit_writes_manifest_and_pointer(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=2)
    path = save(ck, 3)
    manifest = json.loads((tmp_path / "checkpoints" / tag_for(3) / MANIFEST).read_text())
    assert set(manifest["files"]) == {"zero_pp_rank_0_mp_rank_00_model_states.pt", "state/rank00000.pt",
                                      "trainer.json", "hf_config.json"}
    assert (tmp_path / "checkpoints" / POINTER).read_text().strip() == tag_for(3)
    assert ck.verify(path) is None and ck.find_resume("auto") == path


@pytest.mark.parametrize("damage, reason", [
    (lambda p: os.remove(p / "state" / "rank00000.pt"), "missing state/rank00000.pt"),
    (lambda p: os.truncate(p / "zero_pp_rank_0_mp_rank_00_model_states.pt", 100), "has 100 bytes"),
    (lambda p: _flip_byte(p / "zero_pp_rank_0_mp_rank_00_model_states.pt"), "checksum differs"),
    (lambda p: (p / "extra.pt").write_bytes(b"x"), "files not in the manifest"),
    (lambda p: os.remove(p / MANIFEST), "no readable manifest"),
    (lambda p: (p / MANIFEST).write_text("{not json"), "no readable manifest"),
])
def test_damaged_checkpoint_is_never_loaded(tmp_path, damage, reason, capsys):
    ck = Checkpointer(str(tmp_path), keep=3)
    good = save(ck, 1)
    bad = save(ck, 2)
    damage(tmp_path / "checkpoints" / tag_for(2))
    assert reason in ck.verify(bad)
    assert ck.find_resume("auto") == good
    assert f"skipping checkpoint {bad}" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ck.find_resume(bad)


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))


def test_rotation_keeps_newest_complete(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=2)
    for s in (1, 2, 3):
        save(ck, s)
    os.makedirs(tmp_path / "checkpoints" / tag_for(4))  # a partial write (killed before its manifest)
    assert ck.tags() == [tag_for(2), tag_for(3), tag_for(4)]
    assert ck.find_resume("auto").endswith(tag_for(3))
    save(ck, 5)  # commit, then rotate: 3 and 5 stay, the partial 4 is older than the new commit: removed
    assert ck.tags() == [tag_for(3), tag_for(5)]


def test_resume_none_and_empty(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=2)
    assert ck.find_resume("auto") is None
    save(ck, 1)
    assert ck.find_resume("none") is None


def test_stage_end_checkpoints_survive_rotation(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=2)
    ck.save(FakeEngine(), 1, {"step": 1}, {}, FakeConfig(), stage_end="STAGE_0_short")
    for s in (2, 3, 4):
        save(ck, s)
    assert ck.tags() == [tag_for(1), tag_for(3), tag_for(4)]
    assert (tmp_path / "checkpoints" / "STAGE_0_short").read_text().strip() == tag_for(1)


def test_verification_is_dealt_by_bytes():
    """Files to ranks by bytes, largest first to the least-loaded rank: the 32 large optimizer partitions of a
    32-rank save land one per rank (by count, rank r got files r, r + 32, ...: all large ones on half the ranks)."""
    from training.checkpoint import deal_by_bytes

    sizes = {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 3_000 for r in range(32)}
    sizes.update({f"zero_pp_rank_{r}_mp_rank_00_model_states.pt": 500 for r in range(32)})
    deal = deal_by_bytes(sizes, 32)
    assert sorted(f for part in deal for f in part) == sorted(sizes)
    assert {sum(sizes[f] for f in part) for part in deal} == {3_500}
    by_count = [sorted(sizes)[r::32] for r in range(32)]
    assert max(sum(sizes[f] for f in part) for part in by_count) == 6_000  # what counting files gave
    assert deal_by_bytes(sizes, 32) == deal  # the same deal on every rank


def test_side_folders_are_bounded(tmp_path):
    """universal/ keeps conversions of checkpoints still kept; abandoned/ keeps its newest `keep` and their
    stage pointers."""
    ck = Checkpointer(str(tmp_path), keep=2)
    root = tmp_path / "checkpoints"
    for t in (1, 2, 3, 4, 5):
        (root / "abandoned" / tag_for(10 + t)).mkdir(parents=True)
    (root / "abandoned" / "STAGE_0_a").write_text(tag_for(11) + "\n")
    (root / "abandoned" / "STAGE_1_b").write_text(tag_for(15) + "\n")
    (root / "universal" / tag_for(1)).mkdir(parents=True)
    for s in (1, 2, 3):
        save(ck, s)  # rotation drops step 1, and with it its universal conversion
        if s == 2:
            (root / "universal" / tag_for(2)).mkdir()
    assert sorted(os.listdir(root / "universal")) == [tag_for(2)]
    assert sorted(os.listdir(root / "abandoned")) == ["STAGE_1_b", tag_for(14), tag_for(15)]
