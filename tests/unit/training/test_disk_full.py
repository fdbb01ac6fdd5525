"""A full disk or quota is the user's to fix, said in one line: a write refused for room (ENOSPC, EDQUOT) anywhere in
an exception's chain ends the job with exit 2 naming the path (never exit 1 with torch's 'unexpected pos', a crash
record on the node that hit it, a requeue without a healthy node); a start checks the first save's room before any
engine (rotated to today's --save_total_limit first) and says what the curriculum will hold; a failed save's partial
folder counts as room; a universal conversion is refused when its output cannot fit; eval/summary.md is written whole
or not at all. One process, the writes made to fail (as an audit did)."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
from collections import namedtuple

import pytest
import torch

from training import checkpoint as ck
from training import checkpoint_files as cf
from training import job


@pytest.fixture(autouse=True)
def _no_run_folders(monkeypatch):
    """Each test starts with the run's folders unknown (another file's load_run_config in this worker set them)."""
    monkeypatch.setattr(job, "USER_DIRS", [])

Usage = namedtuple("Usage", "total used free")
H = type("H", (), {"to_json_string": lambda self: "{}"})()


class Engine:
    """DeepSpeed's save_checkpoint through its torch checkpoint engine: one 800 kB optimizer file."""

    def __init__(self):
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        self.module = torch.nn.Linear(300, 300)
        self.checkpoint_engine = TorchCheckpointEngine()

    def save_checkpoint(self, root, tag, save_latest):
        self.checkpoint_engine.save({"opt": torch.zeros(200_000)}, os.path.join(root, tag, "optim_states.pt"))


def budget_writes(monkeypatch, nbytes: int | None, err: int = errno.ENOSPC) -> None:
    """The checkpoint files' writes fail once `nbytes` more were written (None: no limit)."""
    monkeypatch.setattr(cf, "SYNC_EVERY", 1 << 16)  # torch's writes in pieces: the failure inside torch.save
    left = [nbytes]
    real = builtins.open

    class Limited(io.FileIO):
        def write(self, b):
            if left[0] is not None:
                if left[0] < len(b):
                    raise OSError(err, os.strerror(err))
                left[0] -= len(b)
            return super().write(b)

    def fopen(p, mode="r", *a, **k):
        return io.BufferedWriter(Limited(p, "w")) if "w" in mode and "b" in mode else real(p, mode, *a, **k)

    monkeypatch.setattr(cf, "open", fopen, raising=False)


def free(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**15, 0, nbytes))


def committed(root, step: int, size: int, stage_end: str | None = None) -> None:
    d = root / ck.tag_for(step)
    d.mkdir(parents=True)
    (d / "a").touch()
    os.truncate(d / "a", size)  # sparse: its size, no bytes written
    (d / ck.MANIFEST).write_text(json.dumps({"files": {"a": {"size": size}}, "stage_end": stage_end}))
    (root / ck.POINTER).write_text(ck.tag_for(step) + "\n")


# ---------------------------------------------------------------- item 1: exit 2, one line, the path named


@pytest.mark.parametrize("err, how", [(errno.ENOSPC, "df -h"), (errno.EDQUOT, "lfs quota -hu $USER")])
def test_a_save_the_disk_refuses_mid_write_ends_in_one_line_with_exit_2(tmp_path, monkeypatch, capsys, err, how):
    """It was exit 1, a traceback, and rank 0's crash record (LAUNCH_CRASH_FILE) when only rank 0 wrote the file."""
    c = ck.Checkpointer(str(tmp_path), keep=2, settle_s=0)
    budget_writes(monkeypatch, 100_000, err)
    with pytest.raises(OSError) as raised:
        c.save(Engine(), 1, {"step": 1}, {}, H)
    crash = tmp_path / "crash0"
    monkeypatch.setenv("LAUNCH_CRASH_FILE", str(crash))
    assert job._fail(raised.value) == job.EXIT_USAGE
    out = capsys.readouterr().err.strip().splitlines()
    assert len(out) == 1 and "Traceback" not in out[0], out
    assert os.path.join(c.root, "step_000001") in out[0] and how in out[0] and errno.errorcode[err] in out[0]
    assert not crash.exists()  # no node blamed: scripts/slurm_requeue.sh requeues none


def test_torchs_wrapper_of_a_short_write_is_seen_through(tmp_path, monkeypatch, capsys):
    """torch's zip writer turns the short write into `RuntimeError [enforce fail at inline_container.cc] unexpected
    pos` with the OSError only as its context: the summary line never named the disk."""
    budget_writes(monkeypatch, 100_000)
    with pytest.raises(RuntimeError, match="unexpected pos") as raised:
        cf.save_torch({"w": torch.zeros(200_000)}, str(tmp_path / "x.pt"))
    job.naming(raised.value, str(tmp_path / "x.pt"))
    assert job._fail(raised.value) == job.EXIT_USAGE
    assert capsys.readouterr().err.strip() == (
        f"error: no space left on device (ENOSPC) writing {tmp_path / 'x.pt'}: free space there (`df -h {tmp_path}`) "
        "or give --output_dir a larger file system, then start the run again (--resume auto continues from the "
        "newest complete checkpoint)")


def test_other_errors_stay_failures(capsys):
    try:
        raise OSError(errno.EIO, "Input/output error")
    except OSError as e:
        assert job.disk_full(e) is None and job._fail(e) == job.EXIT_FAILED
    assert "Traceback" in capsys.readouterr().err


def test_a_full_node_local_folder_or_an_unnamed_write_stays_a_crash(capsys):
    """A full /dev/shm (multiprocessing's semaphores, NCCL's segments) is the node's state, and a write that names no
    file cannot be told from one: a crash of this node (requeued without it), not a user's disk (exit 2, the job ended
    for good: a review of the day's change)."""
    for err in (OSError(errno.ENOSPC, "No space left on device", "/dev/shm/sem.mp-1234"),
                OSError(errno.ENOSPC, "No space left on device")):
        try:
            raise err
        except OSError as e:
            assert job.disk_full(e) is e and job.users_disk(e) is None and job._fail(e) == job.EXIT_FAILED
    named = OSError(errno.EDQUOT, "Disk quota exceeded", "/scratch/me/run/step_000010/model.pt")
    assert job.users_disk(named) is named
    # once the run's folders are known: full under them is the user's, elsewhere (a node's /tmp) the node's
    job.USER_DIRS[:] = ["/scratch/me/run", "/scratch/me/cache"]
    assert job.users_disk(named) is named
    assert job.users_disk(OSError(errno.ENOSPC, "No space", "/tmp/torchinductor_me/x.py")) is None
    assert job.users_disk(OSError(errno.ENOSPC, "No space", "/scratch/me/runs/other")) is None  # not a prefix
    capsys.readouterr()


def test_a_background_write_that_runs_out_of_room_is_one_line_on_every_rank(tmp_path, monkeypatch):
    """Every rank leaves through `_failed` after the same vote: the ranks whose own write succeeded raised 'another
    rank's background write failed' (exit 1, a crash record if first on record); now each raises the full disk's
    line of the rank that hit it, an input error (exit 2)."""
    import training.async_save as a

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(a, "write_durable", full)
    c = ck.Checkpointer(str(tmp_path), keep=2, settle_s=0)
    c.save(Engine(), 1, {"step": 1}, {}, H, background=True)
    with pytest.raises(ValueError, match=r"^checkpoint step_000001 not committed: rank 0: no space left on device "
                                         r"\(ENOSPC\) writing .*step_000001") as raised:
        c.finish()
    assert job._is_input_error(raised.value) and c.pending is None


# ---------------------------------------------------------------- item 4: a failed save's partial folder is room


def test_a_failed_saves_partial_folder_at_another_step_counts_as_room(tmp_path, monkeypatch):
    """The room was counted before the same-step leftover was moved, and a partial step_N at another step was never
    counted: after freeing what it lacked, the next job's save at another step was still refused."""
    root = tmp_path / "checkpoints"
    committed(root, 1, 100_000)
    partial = root / "step_000002"  # a save that died of the full disk: no manifest
    partial.mkdir()
    (partial / "optim_states.pt").write_bytes(b"x" * 60_000)

    class Stop(Engine):
        def save_checkpoint(self, root, tag, save_latest):
            raise RuntimeError("stop here: the save was started")

    free(monkeypatch, 50_000)  # 105 kB needed: 50 kB free + the partial's 60 kB
    c = ck.Checkpointer(str(tmp_path), keep=2, settle_s=0)
    with pytest.raises(RuntimeError, match="stop here"):
        c.save(Stop(), 3, {}, {}, H)
    c.trash.wait()
    assert not partial.exists() and (root / "step_000001" / ck.MANIFEST).exists()


# ---------------------------------------------------------------- items 2, 3: the start's room


def test_a_start_rotates_to_todays_limit_and_checks_the_first_saves_room(tmp_path, monkeypatch, capsys):
    """'lower --save_total_limit' could not work: a lower limit applied only after a commit, which needed the room
    first. A start rotates to it (never the resumed checkpoint nor a stage's final one) before any engine."""
    root = tmp_path / "checkpoints"
    committed(root, 1, 10**9, stage_end="STAGE_0_a")  # (sparse files: no bytes written)
    for s in (2, 3, 4):
        committed(root, s, 10**9)
    (root / "step_000005").mkdir()  # a failed save's partial folder
    (root / "step_000005" / "optim_states.pt").write_bytes(b"x" * 1000)
    free(monkeypatch, 10**8)  # 1.05 GB needed: 0.1 GB free + step 2 (rotated away)
    c = ck.Checkpointer(str(tmp_path), keep=2, settle_s=0)
    c.check_room(str(root / "step_000004"), 10, 3)
    c.trash.wait()
    assert sorted(os.listdir(root)) == [".trash", "LATEST", "step_000001", "step_000003", "step_000004"]
    assert capsys.readouterr().out.strip() == (
        "warning: checkpoint room: this curriculum keeps up to 3 rolling (--save_total_limit 2, +1 being written) + 2 "
        f"stage-end checkpoints of ~1.0 GB: ~5.0 GB; 1.1 GB free in {root} (its trash included) + 3.0 GB its "
        "checkpoints hold now: it may fill before the run ends (a quota is not seen here)")


def test_a_start_without_room_is_refused_naming_the_oldest_checkpoints(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    committed(root, 1, 2_000_000_000, stage_end="STAGE_0_a")
    committed(root, 2, 2_000_000_000)
    free(monkeypatch, 10**9)
    with pytest.raises(ValueError) as e:
        ck.Checkpointer(str(tmp_path), keep=2, settle_s=0).check_room(str(root / "step_000002"), 10, 2)
    line = str(e.value)
    assert len(line.splitlines()) == 1 and "save_total_limit" not in line, line  # 2 is the minimum
    assert line.startswith(f"the first checkpoint of this start needs ~2.0 GB in {root}, 1.0 GB free there: ")
    assert f"{root / 'step_000001'} 2.0 GB (STAGE_0_a)" in line and "step_000002 " not in line
    with pytest.raises(ValueError, match=r"lower --save_total_limit \(now 3"):
        ck.Checkpointer(str(tmp_path), keep=3, settle_s=0).check_room(str(root / "step_000002"), 10, 2)


def test_a_fresh_start_estimates_from_the_parameters(tmp_path, monkeypatch, capsys):
    free(monkeypatch, 1_000_000)
    c = ck.Checkpointer(str(tmp_path), keep=2, settle_s=0)
    c.check_room(None, 1000, 3)  # 14 kB
    assert "+ 2 stage-end checkpoints" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"^the first checkpoint of this start needs ~0\.1 GB"):
        c.check_room(None, 10**7, 3)  # 140 MB


# ---------------------------------------------------------------- item 5: a universal conversion's room


def test_a_universal_conversion_that_cannot_fit_is_refused_before_it_starts(tmp_path, monkeypatch):
    from training import universal

    src = tmp_path / "other" / "checkpoints" / "step_000010"
    src.mkdir(parents=True)
    (src / ck.MANIFEST).write_text(json.dumps({"files": {"a": {"size": 3 * 10**9}}, "world": 4}))
    monkeypatch.setattr(universal, "convert", lambda *a, **k: pytest.fail("started"))
    free(monkeypatch, 2 * 10**9)
    got = universal.prepare(str(src), 4, 2, str(tmp_path / "run"))
    assert "~7.1 GB under" in got["refuse"] and "2.0 GB free there" in got["refuse"]
    # ds_to_universal keeps every fragment (1x) until the merged tensors (1x) and rank 0's optimizer file (1/4) are
    # written: (2 + 1/4) x 3 GB x 1.05 at the peak. Room for the output alone (was the check: 3.15 GB) is refused
    free(monkeypatch, 5 * 10**9)
    got = universal.prepare(str(src), 4, 2, str(tmp_path / "run"))
    assert "~7.1 GB under" in got["refuse"] and "while it converts (~3.8 GB kept), 5.0 GB free" in got["refuse"]
    monkeypatch.setattr(universal, "convert", lambda *a, **k: {"files": {}})
    free(monkeypatch, 7 * 10**9 + 10**8)
    assert universal.prepare(str(src), 4, 2, str(tmp_path / "run"))["files"] == {}
    assert universal.conversion_peak_bytes(100, 2) == 250 and universal.conversion_peak_bytes(100, None) == 300


# ---------------------------------------------------------------- item 7: eval/summary.md whole or not at all


def test_a_failed_summary_write_keeps_the_old_table_and_a_start_rebuilds_it(tmp_path, monkeypatch):
    from training import metrics as M

    monkeypatch.setattr(M, "eval_tables", lambda rows: [f"| {len(rows)} rows |"])
    m = M.MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10, False)
    m.log_eval(0, {"step": 1, "stage": 0})
    summary = tmp_path / "eval" / "summary.md"
    assert summary.read_text() == "| 1 rows |\n"
    real = builtins.open

    def fopen(p, mode="r", *a, **k):
        f = real(p, mode, *a, **k)
        if "summary.md" in str(p) and "w" in mode:
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return f

    monkeypatch.setattr(builtins, "open", fopen)
    with pytest.raises(OSError):
        m.log_eval(1, {"step": 2, "stage": 1})
    monkeypatch.setattr(builtins, "open", real)
    assert summary.read_text() == "| 1 rows |\n"  # was empty
    os.utime(summary, (1, 1))  # older than stage1.json
    M.MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10, False, resume_step=2)
    assert summary.read_text() == "| 2 rows |\n"  # the resume skips stage 1's evaluation: rebuilt at the start

    # a record the table cannot read (another version's: no "stage") never stops a start: said, the table kept
    monkeypatch.undo()
    (tmp_path / "eval" / "stage2.json").write_text('{"step": 3}')
    M.MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10, False, resume_step=3)
    assert summary.read_text() == "| 2 rows |\n"


# ---------------------------------------------------------------- item 10: an export is durable before it replaces


def tiny_checkpoint(tmp_path, monkeypatch):
    """RUN/checkpoints/step_000001 of a one-layer Llama, its consolidation patched to hand back the state dict."""
    import deepspeed.utils.zero_to_fp32 as z
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "hf_config.json").write_text(cfg.to_json_string())
    state = LlamaForCausalLM(cfg).state_dict()
    monkeypatch.setattr(z, "get_fp32_state_dict_from_zero_checkpoint", lambda root, tag=None: dict(state))
    return ckpt


def test_the_export_is_fsynced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """Without it a node lost after the rename (and COMPLETE) could leave short shards under hf_model."""
    from model_utils import export

    ckpt = tiny_checkpoint(tmp_path, monkeypatch)
    events, real = [], os.replace
    monkeypatch.setattr(export, "fsync_path", lambda p: events.append(("fsync", os.path.basename(p))), raising=False)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.path.basename(b))), real(a, b)))
    out = tmp_path / "run" / "hf_model"
    export.export_hf(str(ckpt), str(out), owned=True)
    done = events.index(("replace", "hf_model"))
    synced = {name for kind, name in events[:done] if kind == "fsync"}
    assert set(os.listdir(out)) <= synced and "hf_model.export-tmp" in synced, events


def test_the_start_checks_with_the_models_parameter_count():
    """train.py's call (training/startup.check_room): the planner's count of the model's parameters."""
    from transformers import LlamaConfig

    from training.restore import TrainState
    from training.startup import Model, check_room

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, tie_word_embeddings=False)
    got = []
    ckpt = type("C", (), {"check_room": lambda self, *a: got.append(a)})()
    check_room(ckpt, TrainState(), [None, None], Model(cfg, "sdpa", False))
    from transformers import LlamaForCausalLM

    assert got == [(None, sum(p.numel() for p in LlamaForCausalLM(cfg).parameters()), 2)]


def test_a_metrics_line_the_disk_refuses_is_the_users_disk(tmp_path, monkeypatch):
    """metrics.jsonl is written through an open file, whose failed write names no file: a full output disk hit there
    first was node 0's crash (requeued without it), not the user's one line (a review)."""
    from training import metrics as M

    m = M.MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10, False)
    real = builtins.open

    class Full(io.StringIO):
        def write(self, _):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(builtins, "open", lambda p, mode="r", *a, **k: Full() if str(p) == m.path else real(p, mode, *a, **k))
    with pytest.raises(OSError) as e:
        m.log({"step": 1, "event": "x"})
    monkeypatch.setattr(builtins, "open", real)
    job.USER_DIRS[:] = [str(tmp_path)]
    assert job.users_disk(e.value) is e.value and job._fail(e.value) == job.EXIT_USAGE


def test_a_killed_conversions_fragments_in_the_trash_count_as_room(tmp_path, monkeypatch):
    """A timed-out conversion's fragments go to the trash (deleted in the background, counted 0 at the room checks:
    never walked at every save). The next start's conversion check saw the disk less them and refused it (exit 2,
    not requeued): where the room falls short, the fragments are walked and counted (a review)."""
    from training import universal

    src = tmp_path / "other" / "checkpoints" / "step_000010"
    src.mkdir(parents=True)
    (src / ck.MANIFEST).write_text(json.dumps({"files": {"a": {"size": 3 * 10**9}}, "world": 4}))
    part = tmp_path / "run" / "checkpoints" / ".trash" / (("ab" * 12) + ".tmp.nodeA.4242") / "zero" / "p"
    part.mkdir(parents=True)
    with open(part / "fp32.pt", "wb") as fh:
        fh.truncate(3 * 10**9)  # sparse: its size is what counts
    monkeypatch.setattr(universal, "convert", lambda *a, **k: {"files": {}})
    # 5 GB free + the 3 GB the fragments hold >= 7.1 GB; nothing else deletes them here (`python -m training.universal`
    # runs no trash thread: counted, the conversion ran out of disk): removed first (a review)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**15, 0, 5 * 10**9 + 3 * 10**9 * (not part.exists())))
    assert universal.prepare(str(src), 4, 2, str(tmp_path / "run"))["files"] == {}
    assert not part.exists()
