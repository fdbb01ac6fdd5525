"""Checkpoint commit protocol without a process group: manifest written last, verification rejects missing,
truncated, corrupted or unlisted files, auto-resume falls back to the previous complete checkpoint, and
rotation never deletes the newest complete one; a universal conversion is keyed by its source's content and
bounded by the job's end; a file the loading rank cannot see yet is looked for again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import types

import pytest

from tests.conftest import ROOT
from training.checkpoint import MANIFEST, POINTER, Checkpointer, tag_for


class FakeConfig:
    def to_json_string(self):
        return json.dumps({"model_type": "llama"})


class FakeEngine:
    """Writes files the way DeepSpeed's save_checkpoint does (one folder per tag)."""

    def save_checkpoint(self, root, tag, save_latest):
        assert save_latest is False  # DeepSpeed's `latest` is written by the commit, after LATEST
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
    # DeepSpeed's own pointer, with its bytes (the tag, no newline), in step with LATEST: without it a user's
    # engine.load_checkpoint(checkpoints) returned (None, None) and zero_to_fp32 without a tag raised
    assert (tmp_path / "checkpoints" / "latest").read_text() == tag_for(3)
    assert ck.find_resume("auto") == path  # nothing of ours takes `latest` for a checkpoint
    save(ck, 5)
    assert (tmp_path / "checkpoints" / "latest").read_text() == tag_for(5) == (
        tmp_path / "checkpoints" / POINTER).read_text().strip()


@pytest.mark.parametrize("damage, reason", [
    (lambda p: os.remove(p / "state" / "rank00000.pt"), "missing state/rank00000.pt"),
    (lambda p: os.truncate(p / "zero_pp_rank_0_mp_rank_00_model_states.pt", 100), "has 100 bytes"),
    (lambda p: _flip_byte(p / "zero_pp_rank_0_mp_rank_00_model_states.pt"), "checksum differs"),
    (lambda p: (p / "extra.pt").write_bytes(b"x"), "files not in the manifest"),
    (lambda p: (p / "state" / "rank00001.pt").write_bytes(b"x"), "files not in the manifest"),
    (lambda p: os.remove(p / MANIFEST), "no readable manifest"),
    (lambda p: (p / MANIFEST).write_text("{not json"), "no readable manifest"),
])
def test_damaged_checkpoint_is_never_loaded(tmp_path, damage, reason, capsys):
    ck = Checkpointer(str(tmp_path), keep=3, settle_s=0)  # a local disk: a missing file is damage, not a late view
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


def test_side_folders_are_bounded(tmp_path, monkeypatch):
    """universal/ keeps finished conversions of the checkpoints still kept, of their content now (a branch's new
    step_N under an old name makes the old conversion stale: dropped); abandoned/ keeps its newest `keep` and their
    stage pointers."""
    from training import universal

    fake_converter(monkeypatch)
    ck = Checkpointer(str(tmp_path), keep=2)
    root = tmp_path / "checkpoints"

    def convert(step):
        p = str(root / tag_for(step))
        universal.convert(p, universal.folder(p, str(tmp_path)), universal.source_id(p), 0)

    for t in (1, 2, 3, 4, 5):
        (root / "abandoned" / tag_for(10 + t)).mkdir(parents=True)
    (root / "abandoned" / "STAGE_0_a").write_text(tag_for(11) + "\n")
    (root / "abandoned" / "STAGE_1_b").write_text(tag_for(15) + "\n")
    for s in (1, 2, 3):
        save(ck, s)  # rotation drops step 1, and with it its conversion
        if s < 3:
            convert(s)
    kept = sorted(["RATE.json", universal.source_id(str(root / tag_for(2)))])  # OUTPUT_DIR/universal/<its key>
    assert sorted(os.listdir(tmp_path / "universal")) == kept
    assert sorted(os.listdir(root / "abandoned")) == ["STAGE_1_b", tag_for(14), tag_for(15)]
    convert(3)
    save(ck, 3)  # a branch's own step 3: the conversion of the old one is stale
    assert sorted(os.listdir(tmp_path / "universal")) == kept


# --- loading: universal conversions (issue 32 item 3) and files a rank cannot see yet (item 8) ---

MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


class LoadEngine:
    """What Checkpointer.load uses of a DeepSpeed engine; records the bytes of the model file it loaded (from the
    checkpoint itself, or from the universal conversion it was pointed at)."""

    def __init__(self):
        self._config = types.SimpleNamespace(load_universal_checkpoint=False)
        self.optimizer = types.SimpleNamespace(state={}, param_groups=[])
        self.lr_scheduler = None
        self.loaded: list[tuple[bool, bytes]] = []

    def load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states):
        with open(os.path.join(load_dir, tag, MODEL_FILE), "rb") as fh:  # FileNotFoundError if not seen, as torch.load
            self.loaded.append((self._config.load_universal_checkpoint, fh.read()))
        return os.path.join(load_dir, tag), {}


def fake_converter(monkeypatch) -> list:
    """`python -m deepspeed.checkpoint.ds_to_universal` replaced by a copy of the model file (ds_to_universal copies
    the model-states files into its output too); returns the list of conversions started."""
    calls, real_run = [], subprocess.run

    def run(cmd, *args, **kwargs):
        if "deepspeed.checkpoint.ds_to_universal" not in cmd:
            return real_run(cmd, *args, **kwargs)
        src, out = cmd[cmd.index("--input_folder") + 1], cmd[cmd.index("--output_folder") + 1]
        calls.append(src)
        os.makedirs(out, exist_ok=True)
        shutil.copy2(os.path.join(src, MODEL_FILE), os.path.join(out, MODEL_FILE))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def save_from_world(ck, step: int, world: int) -> str:
    """A checkpoint as `world` ranks would have committed it (the manifest says who wrote it)."""
    path = save(ck, step)
    manifest = json.loads(open(os.path.join(path, MANIFEST)).read())
    manifest["world"] = world
    with open(os.path.join(path, MANIFEST), "w") as fh:
        json.dump(manifest, fh)
    return path


def model_bytes(path) -> bytes:
    with open(os.path.join(path, MODEL_FILE), "rb") as fh:
        return fh.read()


def test_universal_conversion_is_keyed_by_its_source(tmp_path, monkeypatch):
    """A branch writes a new step_4 under the old name: a resume at another world size converts the new one
    (the old conversion, of another step_4, must never be loaded); the same content is converted once."""
    calls = fake_converter(monkeypatch)
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save_from_world(ck, 4, world=2)
    engine = LoadEngine()
    ck.load(engine, path)
    ck.load(engine, path)
    assert len(calls) == 1 and engine.loaded == [(True, model_bytes(path))] * 2  # converted once, then reused
    save_from_world(ck, 2, world=2)
    branch = save_from_world(ck, 4, world=2)  # the branch's own step_4: other bytes, same name
    ck.load(engine, branch)
    assert len(calls) == 2, "the branch's step_4 was loaded through the old step_4's conversion"
    assert engine.loaded[-1] == (True, model_bytes(branch))


def test_offline_conversion_is_the_one_a_resume_uses(tmp_path, monkeypatch, capsys):
    """`python -m training.universal CHECKPOINT` (the fix a refusal names) converts it with no deadline; a resume at
    another world size then loads that conversion without converting again."""
    from training import universal

    calls = fake_converter(monkeypatch)
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save_from_world(ck, 4, world=2)
    assert universal.main([path]) == 0 and len(calls) == 1
    assert universal.main([path]) == 0 and "already holds" in capsys.readouterr().out
    engine = LoadEngine()
    ck.load(engine, path)
    assert len(calls) == 1 and engine.loaded == [(True, model_bytes(path))]
    assert universal.main([str(tmp_path)]) == 2  # not a checkpoint: usage, exit 2


def _exit_code(monkeypatch, fn) -> int:
    from training.job import run_job

    monkeypatch.setenv("RANK", "0")  # a world of one: run_job leaves the environment alone
    return run_job(lambda: fn() or 0)


def test_conversion_that_cannot_finish_before_the_job_ends_is_not_started(tmp_path, monkeypatch, capsys):
    """A job that starts 60 s before its end (SLURM_JOB_END_TIME) does not start a conversion it cannot finish
    (killed at the limit, it was redone from scratch on every requeue): exit 75 (requeue) in one line, before it."""
    calls = fake_converter(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_START_TIME", str(int(time.time() - 3600)))
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time() + 60)))
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save_from_world(ck, 4, world=2)
    code = _exit_code(monkeypatch, lambda: ck.load(LoadEngine(), path))
    assert calls == [], "the conversion was started 60 s before the job's end"
    assert code == 75
    assert "requeue" in capsys.readouterr().err


def test_conversion_longer_than_a_whole_allocation_is_refused(tmp_path, monkeypatch, capsys):
    """A job whose whole allocation (SLURM_JOB_END_TIME - SLURM_JOB_START_TIME) cannot hold the conversion would be
    requeued for ever: refused as bad input (exit 2), naming the offline conversion as the fix."""
    calls = fake_converter(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_START_TIME", str(int(time.time() - 5)))
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time() + 100)))
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save_from_world(ck, 4, world=2)
    code = _exit_code(monkeypatch, lambda: ck.load(LoadEngine(), path))
    assert calls == [] and code == 2
    assert "python -m training.universal" in capsys.readouterr().err


def test_conversion_that_overruns_its_estimate_is_stopped_before_the_job_ends(tmp_path, monkeypatch, capsys):
    """A conversion that fits by its estimate still runs under a timeout that leaves a step, a save and the margin
    before SLURM_JOB_END_TIME; stopped there, its time is recorded as unfinished and the job exits 75."""
    from training import universal

    seen = []

    def run(cmd, *args, timeout=None, **kwargs):
        seen.append(timeout)
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time() + 600)))
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save_from_world(ck, 4, world=2)
    assert _exit_code(monkeypatch, lambda: ck.load(LoadEngine(), path)) == 75
    assert len(seen) == 1 and 200 < seen[0] < 600 - 300  # ends before the job does, with a save's time to spare
    rate = json.loads((tmp_path / "universal" / universal.RATE).read_text())
    assert rate["finished"] is False and "was stopped after" in capsys.readouterr().err


@pytest.mark.parametrize("signals, code", [("USR1 USR2", 0), ("TERM", 75), ("KILL", 1)])
def test_a_step_wide_signal_does_not_crash_the_conversion(tmp_path, monkeypatch, capsys, signals, code):
    """Slurm signals every process of a step (`--signal=USR1@T` without B:, `scancel --signal=USR2`, the time limit's
    or a preemption's TERM): the converter, a child of the rank, died of a save request (a traceback, exit 1, a crash
    requeue). It now ignores USR1 / USR2 (the rank takes the request itself), and a TERM that kills it is a stop:
    exit 75, requeued; any other death (an OOM kill) stays the converter's failure. A real child process
    (tests/workers/fake_ds_to_universal.py signals itself)."""
    from training import universal

    monkeypatch.setattr(universal, "CONVERTER", "tests.workers.fake_ds_to_universal")
    monkeypatch.setenv("FAKE_SIGNALS", signals)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save_from_world(ck, 4, world=2)
    assert _exit_code(monkeypatch, lambda: ck.load(LoadEngine(), path) and 0) == code
    err = capsys.readouterr().err
    assert {0: "", 75: "was ended by SIGTERM", 1: "died with <Signals.SIGKILL: 9>"}[code] in err, err


def test_a_resume_says_which_of_the_runs_settings_changed(tmp_path, capsys):
    """A new run in an old run's folder (checkpoints/run is every run's default) resumed it without a word, with
    another dataset or curriculum: a finished one trained nothing. The resume now names the settings that differ."""
    ck = Checkpointer(str(tmp_path), keep=2)
    old = {"dataset_path": "old.jsonl", "max_seq_length": 1024, "learning_rate": 1e-5, "stages": []}
    ck.save(FakeEngine(), 150, {"step": 150, "tokens": 0, "stage": 0, "model_hash": "h", "config": old},
            {"sampler": {}}, FakeConfig())
    state = ck.resume("auto", "h", "m", {**old, "dataset_path": "new.jsonl", "max_seq_length": 4096})
    out = capsys.readouterr().out
    assert state.step == 150 and "whose dataset_path, max_seq_length differed" in out, out
    ck.resume("auto", "h", "m", dict(old))
    assert "differed" not in capsys.readouterr().out
    # another base model of the same shapes, another tokenizer path, a weight decay: noted too (they resumed
    # unsaid); another seed is the saved run's for its data order (data/sampler.py), said so
    ck.resume("auto", "h", "m", {**old, "model_name_or_path": "b", "tokenizer_name_or_path": "t2", "weight_decay": 0.1,
                                 "seed": 7})
    assert "differed" not in capsys.readouterr().out  # the old run's config lacks them: nothing to compare
    ck.save(FakeEngine(), 160, {"step": 160, "tokens": 0, "stage": 0, "model_hash": "h", "config": {
        **old, "model_name_or_path": "a", "tokenizer_name_or_path": "t1", "weight_decay": 0.0, "seed": 0}},
            {"sampler": {}}, FakeConfig())
    ck.resume("auto", "h", "m", {**old, "model_name_or_path": "b", "tokenizer_name_or_path": "t2", "weight_decay": 0.1,
                                 "seed": 7})
    out = capsys.readouterr().out
    assert "whose weight_decay, model_name_or_path, tokenizer_name_or_path differed" in out, out
    assert "written with seed 0: the stage it resumes in keeps it for its data order (today's 7" in out, out


def test_a_file_the_loading_rank_cannot_see_yet_is_looked_for_again(tmp_path):
    """The rank that loads a file looks it up again by name (a stale view of its node) as the verifying rank does:
    files that appear 1.5 s late are loaded; a file that never appears fails in one line naming it."""
    ck = Checkpointer(str(tmp_path), keep=2, settle_s=8)
    path = save(ck, 2)
    late = [os.path.join(path, "state", "rank00000.pt"), os.path.join(path, MODEL_FILE)]
    for f in late:
        os.rename(f, f + ".away")
    timers = [threading.Timer(1.5, os.rename, (f + ".away", f)) for f in late]
    for t in timers:
        t.start()
    engine = LoadEngine()
    assert ck.load(engine, path) == {"sampler": {}}
    assert engine.loaded == [(False, model_bytes(path))]

    os.remove(late[0])
    ck.settle_s = 1
    with pytest.raises(RuntimeError, match="state/rank00000.pt"):
        ck.load(LoadEngine(), path)



@pytest.mark.parametrize("given, why", [("no_such", "no such folder"), ("docs", "no readable manifest")])
def test_export_names_the_checkpoint_it_was_given(tmp_path, capsys, given, why):
    """scripts/export_hf.py RUN --checkpoint X, X not a checkpoint: one line naming X and why (before: 'no complete
    checkpoint under RUN/checkpoints', about a folder the user did not name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_hf", os.path.join(os.getcwd(), "scripts", "export_hf.py"))
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    path = given if given == "docs" else str(tmp_path / given)
    assert export.main([str(tmp_path), "--checkpoint", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --checkpoint {path}: not a complete checkpoint") and why in err[0]


def test_export_verifies_the_newest_checkpoint_once(tmp_path, monkeypatch):
    """scripts/export_hf.py RUN: find_resume("auto") verifies the newest checkpoint (every byte's CRC) and the export
    verified it again: 2 x 96 GB read at Llama-3-8B. Once now; a --checkpoint named is verified (once)."""
    import importlib.util

    from training.restore import Restorer

    spec = importlib.util.spec_from_file_location("export_hf", os.path.join(ROOT, "scripts", "export_hf.py"))
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save(ck, 2)
    seen, verify = [], Restorer.verify
    monkeypatch.setattr(Restorer, "verify", lambda self, p: seen.append(p) or verify(self, p))
    monkeypatch.setattr(export, "export_hf", lambda src, out, *a, **k: out)
    assert export.main([str(tmp_path), "--tokenizer", "none", "--source", "none"]) == 0
    assert seen == [path]
    seen.clear()
    assert export.main([str(tmp_path), "--checkpoint", path, "--tokenizer", "none", "--source", "none"]) == 0
    assert seen == [path]


def test_a_resume_with_a_new_learning_rate_takes_it(tmp_path):
    """train.py resumed with --learning_rate 1e-4 after a run at 1e-3 (lowering it after a loss spike): the saved
    schedule's state (LambdaLR's base_lrs) brought 1e-3 back, and the note said today's settings apply. Now the
    schedule goes on from its saved step with today's peak."""
    import torch

    from training.schedule import lambda_scheduler

    def engine_at(peak, decay=0.0):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=peak, weight_decay=decay)
        e = LoadEngine()
        e.optimizer, e.lr_scheduler = opt, lambda_scheduler(peak, 0.0, 2, 10, "cosine")(opt)
        return e

    old = engine_at(1e-3)
    for _ in range(5):
        old.optimizer.step()
        old.lr_scheduler.step()
    saved_sched, saved_opt = old.lr_scheduler.state_dict(), old.optimizer.state_dict()
    new = engine_at(1e-4, decay=0.1)  # and a weight decay now: the saved param_groups brought 0.0 back, unsaid

    def load_checkpoint(load_dir, tag, load_optimizer_states, load_lr_scheduler_states):  # as DeepSpeed's does
        new.optimizer.load_state_dict(saved_opt)
        if load_lr_scheduler_states:
            new.lr_scheduler.load_state_dict(saved_sched)
        return os.path.join(load_dir, tag), {}

    new.load_checkpoint = load_checkpoint
    ck = Checkpointer(str(tmp_path), keep=3)
    ck.load(new, save(ck, 5))
    from training.schedule import lr_at

    want = lr_at(5, 1e-4, 0.0, 2, 10, "cosine")
    assert new.lr_scheduler.last_epoch == 5 and new.optimizer.param_groups[0]["lr"] == pytest.approx(want)
    assert new.optimizer.param_groups[0]["weight_decay"] == 0.1
    new.optimizer.step()
    new.lr_scheduler.step()
    assert new.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(6, 1e-4, 0.0, 2, 10, "cosine"))


def test_a_resume_on_changed_data_says_so():
    """Documents appended to the same dataset path (or another packing): the saved position was taken over as a
    fraction of a new order without a word. data_moved names what changed, at any depth of the sampler's state."""
    from data.mixture import MixtureSampler
    from data.sampler import ResumableSampler
    from training.restore import data_moved

    assert data_moved(ResumableSampler(20, 1, 0, 1, 0).state_dict(), ResumableSampler(20, 1, 0, 1, 0).state_dict()) == []
    assert data_moved(ResumableSampler(20, 1, 0, 1, 0).state_dict(),
                      ResumableSampler(24, 1, 0, 1, 0).state_dict()) == ["num_samples 20 -> 24"]
    mix = [MixtureSampler([11, n], [0.7, 0.3], ["a", "b"], 1, 0, 1, 0).state_dict() for n in (5, 6)]
    assert data_moved({"main": mix[0]}, {"main": mix[1]}) == ["main.sizes [11, 5] -> [11, 6]"]


def test_a_file_the_run_did_not_write_beside_its_state_keeps_the_checkpoint(tmp_path, capsys):
    """A user's zero_to_fp32 output in the checkpoint folder (or NFS's .nfs* of a file deleted while open): the
    complete checkpoint was skipped as damaged, the run resumed from the one before and retrained its steps, and
    the rotation then deleted the folder with the user's file. Only a state file the loaders would read (a *.pt
    beside the manifest's) makes it incomplete; anything else is noted and left."""
    ck = Checkpointer(str(tmp_path), keep=3, settle_s=0)
    save(ck, 1)
    newest = save(ck, 2)
    folder = tmp_path / "checkpoints" / tag_for(2)
    (folder / "fp32").mkdir()
    (folder / "fp32" / "pytorch_model.bin").write_bytes(b"weights")
    (folder / ".nfs000000000123").write_bytes(b"")
    assert ck.verify(newest) is None and ck.find_resume("auto") == newest
    assert "holds files the run did not write" in capsys.readouterr().out
    assert (folder / "fp32" / "pytorch_model.bin").exists()
