"""Loading a checkpoint at scale (an audit of start-up at 512 ranks, Llama-3-8B), in one process with fake files and
a faked rank: a DeepSpeed JSON's elastic_checkpoint (every rank read every rank's optimizer partition) is dropped;
before a load each rank looks up only the files it reads (1,538 stats on every rank before: 1.57M a load); a
resume's verification gives each rank the files it will load (its node's page cache then serves the load)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from base import comm
from tests.unit.training.test_checkpoint import MODEL_FILE, LoadEngine
from tests.unit.training.test_ds_config_found import BASE, build
from training import checkpoint_load
from training.checkpoint import Checkpointer
from training.checkpoint_files import deal_by_bytes

W = 4


def names(w: int = W) -> list[str]:
    out = ["trainer.json", "hf_config.json"]
    for r in range(w):
        out += [f"state/rank{r:05d}.pt", f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
                f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"]
    return out


def own(r: int) -> list[str]:
    return sorted([f"state/rank{r:05d}.pt", f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
                   f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"])


def fake_checkpoint(where, saved_world: int = W) -> str:
    """A committed checkpoint as `saved_world` ranks wrote it: every file, its manifest (world, sizes)."""
    path = where / "checkpoints" / "step_000002"
    (path / "state").mkdir(parents=True)
    files = {}
    for f in names(saved_world):
        if f.startswith("state/"):
            torch.save({"sampler": {"at": f}}, path / f)
        else:
            (path / f).write_bytes(b"x" * (4_000 if "optim" in f else 100))
        files[f] = {"size": os.path.getsize(path / f), "crc32": "0"}
    (path / "MANIFEST.json").write_text(json.dumps({"world": saved_world, "files": files}))
    return str(path)


def as_rank(monkeypatch, rank: int, world: int = W, others: dict | None = None) -> list:
    """This process as `rank` of `world`; the gathered reports: the other ranks' from `others` (rank -> report).
    Returns the list of the file sets this rank looked up (not_visible)."""
    looked = []
    real = checkpoint_load.not_visible

    def record(root, sizes, settle_s, *a):
        looked.append(sorted(sizes))
        return real(root, sizes, settle_s, *a)

    monkeypatch.setattr(comm, "rank", lambda group=None: rank)
    monkeypatch.setattr(comm, "world", lambda group=None: world)
    monkeypatch.setattr(comm, "all_gather_object",
                        lambda obj: [obj if r == rank else (others or {}).get(r, {}) for r in range(world)])
    monkeypatch.setattr(checkpoint_load, "not_visible", record)
    return looked


# --- F1: zero_optimization.elastic_checkpoint ---

def test_elastic_checkpoint_key_is_dropped_with_one_note(tmp_path, capsys):
    """DeepSpeed 0.19.8 (engine._get_all_zero_checkpoint_state_dicts) then torch.loads every rank's optimizer
    partition on every rank at each load: 96 GB a rank at Llama-3-8B, a node out of memory at the first stage change.
    The JSON's key (deprecated, a warning only) is dropped with one note a run; `false` silently."""
    zero = {**BASE["zero_optimization"], "elastic_checkpoint": True}
    for _ in range(2):  # one note a run, not one per stage
        built = build(tmp_path, {**BASE, "zero_optimization": zero})
        assert "elastic_checkpoint" not in built["zero_optimization"]
    out = capsys.readouterr().out
    assert out.count("zero_optimization.elastic_checkpoint is dropped") == 1, out
    assert len([line for line in out.splitlines() if "elastic_checkpoint" in line]) == 1
    built = build(tmp_path, {**BASE, "zero_optimization": {**zero, "elastic_checkpoint": False}})
    assert "elastic_checkpoint" not in built["zero_optimization"]
    assert "elastic_checkpoint" not in capsys.readouterr().out
    built = build(tmp_path, BASE, overrides={"zero_optimization": {"elastic_checkpoint": True}})  # a stage's override
    assert "elastic_checkpoint" not in built["zero_optimization"]


@pytest.mark.parametrize("extra, named", [({"checkpoint": {"writer": {"type": "fast"}}}, "checkpoint.writer"),
                                          ({"datastates_ckpt": {"host_cache_size": 16}}, "datastates_ckpt")])
def test_another_checkpoint_engine_is_refused_in_one_line(tmp_path, extra, named):
    """DeepSpeed's Fast / Decoupled writers and DataStates replace its torch checkpoint engine: the files were then
    described from rank 0's own listing right after other nodes wrote them (a stale listing left a file out: a later
    resume skipped the checkpoint), and a decoupled write could still run at the commit."""
    with pytest.raises(ValueError, match=rf"{named} picks another DeepSpeed checkpoint engine .*drop it") as e:
        build(tmp_path, {**BASE, **extra})
    assert "\n" not in str(e.value)
    build(tmp_path, {**BASE, "datastates_ckpt": False})  # off: the torch engine


# --- F2: the files a rank looks up before a load ---

def test_a_rank_looks_up_only_the_files_it_loads(tmp_path, monkeypatch):
    """Same world: rank 2 looks up its own partition, model states and state file; rank 0 also trainer.json and
    hf_config.json (no rank loads them: each file is still looked up once). Before, every rank every file."""
    path = fake_checkpoint(tmp_path)
    ck = Checkpointer(str(tmp_path), keep=3, settle_s=0)
    looked = as_rank(monkeypatch, 2)
    assert ck.load(LoadEngine(), path) == {"sampler": {"at": "state/rank00002.pt"}}
    assert looked == [own(2)]
    looked = as_rank(monkeypatch, 0)
    ck.load(LoadEngine(), path)
    assert looked == [sorted(own(0) + ["hf_config.json", "trainer.json"])]


def test_a_rank_missing_its_own_file_fails_every_rank_alike(tmp_path, monkeypatch):
    """Rank 2 cannot see its own partition: its report, gathered, fails the load on rank 2 and on rank 0 (which did
    not look that file up) with the same one line, as when every rank looked up every file."""
    path = fake_checkpoint(tmp_path)
    os.remove(os.path.join(path, "zero_pp_rank_2_mp_rank_00_optim_states.pt"))
    ck = Checkpointer(str(tmp_path), keep=3, settle_s=0)
    reports = []
    as_rank(monkeypatch, 2)
    monkeypatch.setattr(comm, "all_gather_object",
                        lambda obj: reports.append(obj) or [{}, {}, obj, {}])
    with pytest.raises(RuntimeError) as on_2:
        ck.load(LoadEngine(), path)
    assert list(reports[0]) == ["zero_pp_rank_2_mp_rank_00_optim_states.pt"]
    as_rank(monkeypatch, 0, others={2: reports[0]})
    with pytest.raises(RuntimeError) as on_0:
        ck.load(LoadEngine(), path)
    assert str(on_0.value) == str(on_2.value)
    assert "rank 2 cannot see" in str(on_2.value) and "\n" not in str(on_2.value)


def test_another_world_size_looks_up_rank_0s_data_position_and_the_conversion(tmp_path, monkeypatch):
    """Saved by 4 ranks, loaded by 2: rank 1 looks up rank 0's state file of the source (the data position every rank
    reads) and of the universal conversion what DeepSpeed reads on every rank (zero/*, rank 0's model states); rank 0
    also every other file (it converts from the source)."""
    path = fake_checkpoint(tmp_path, saved_world=W)
    ck = Checkpointer(str(tmp_path), keep=3, settle_s=0)
    conv = tmp_path / "universal" / "k" / "step_000002"
    files = {f: 10 for f in ["zero/optimizer_state.pt", "zero/lm_head.weight/fp32.pt",
                             "zero/lm_head.weight/exp_avg.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
                                                                  for r in range(W)]}
    for f in files:
        (conv / f).parent.mkdir(parents=True, exist_ok=True)
        (conv / f).write_bytes(b"y" * 10)
    monkeypatch.setattr(ck, "_universal", lambda p: (str(conv.parent), files))
    looked = as_rank(monkeypatch, 1, world=2)
    assert ck.load(LoadEngine(), path) == {"sampler": {"at": "state/rank00000.pt"}}
    assert looked == [["state/rank00000.pt"], sorted(f for f in files if not f.startswith("zero_pp_rank_")
                                                     or f == MODEL_FILE)]
    looked = as_rank(monkeypatch, 0, world=2)
    ck.load(LoadEngine(), path)
    assert looked == [sorted(names(W)), sorted(files)]


# --- F3: verification deals each rank the files it will load ---

def llama_sizes(w: int) -> dict[str, int]:
    opt = int(8.03e9 * 12 / w)  # fp32 master weights + Adam m, v of Llama-3-8B over w ranks
    sizes = {"hf_config.json": 700, "trainer.json": 4_000}
    for r in range(w):
        sizes.update({f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": opt,
                      f"zero_pp_rank_{r}_mp_rank_00_model_states.pt": 200_000, f"state/rank{r:05d}.pt": 15_000})
    return sizes


def test_verification_deals_each_rank_its_own_files_first():
    """Dealt by name, rank r verified another rank's partition (1 of 512 on its own rank, 2 on its node): the shared
    file system served the 96 GB twice. Own files first, then the rest by bytes: the same balance."""
    for w in (32, 512):
        sizes = llama_sizes(w)
        deal = deal_by_bytes(sizes, w, own=True)
        assert all(set(own(r)) <= set(deal[r]) for r in range(w))
        assert sorted(f for part in deal for f in part) == sorted(sizes)
        peak = max(sum(sizes[f] for f in part) for part in deal)
        assert peak == max(sum(sizes[f] for f in part) for part in deal_by_bytes(sizes, w))
    bf16 = {"bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt": 9, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": 9}
    assert deal_by_bytes(bf16, 2, own=True) == [["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"],
                                                ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]]


@pytest.mark.parametrize("world", [W, 2])
def test_verify_checks_the_files_this_rank_loads(tmp_path, monkeypatch, world):
    """Rank 1 of the world that wrote the checkpoint verifies its own files; of another world size (it loads none of
    them: a universal conversion) the files are dealt by bytes alone."""
    path = fake_checkpoint(tmp_path)
    ck = Checkpointer(str(tmp_path), keep=3, settle_s=0)
    as_rank(monkeypatch, 1, world=world)
    checked = []
    monkeypatch.setattr(ck, "_check_files", lambda p, files: checked.append(sorted(files)))
    assert ck.verify(path) is None
    sizes = {f: os.path.getsize(os.path.join(path, f)) for f in names()}
    if world == W:
        assert checked == [sorted(deal_by_bytes(sizes, world, own=True)[1])] and set(own(1)) <= set(checked[0])
    else:
        assert checked == [sorted(deal_by_bytes(sizes, world)[1])]


def test_nvme_offload_swap_files_are_looked_up_by_every_rank():
    """NVMe optimizer offload saves each rank's swap files under offloaded_tensors/rankNN/ (DeepSpeed 0.19.8 engine
    ~4937) and each rank copies its folder at a load: no rank's own-files rule named them, so only rank 0 looked them
    up and the rank that reads them met a stale listing unwaited."""
    from training.checkpoint_files import EVERY, awaited, file_rank

    sizes = {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt": 1 for r in range(2)}
    sizes |= {f"offloaded_tensors/rank{r:0>2d}/0_param_{i}.tensor.swp": 1 for r in range(2) for i in range(2)}
    assert file_rank("offloaded_tensors/rank01/0_param_0.tensor.swp") == EVERY
    for r in range(2):
        mine = awaited(sizes, r, 2, file_rank)
        assert {f for f in mine if f.startswith("offloaded_tensors/")} == {f for f in sizes if "offloaded" in f}
