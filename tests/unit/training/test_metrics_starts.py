"""A run's records across its starts (training/metrics_starts.py), on test_metrics_wandb.py's stand-in `wandb`: what
W&B lost when its service died is sent again at the next start; offline run folders without a record are moved
aside; a resume is on record and said where it drops steps; a preempted start's W&B run is marked so; a finished run
records its totals. An audit's 6-segment offline run found each of these. < 1 s."""

from __future__ import annotations

import json
import os
import types

from tests.unit.training.test_metrics_wandb import STEP, FakeRun, fake_wandb, wandb_env  # noqa: F401  (a fixture)
from training import metrics_starts
from training.metrics import MetricsLogger


def _dies_at(run, step: int) -> None:
    """The run's service gone from `step`'s log on: that log and every later call raise (a dead socket)."""
    live = run.log

    def log(data, step_=None, **kw):
        if data.get("step", 0) >= step or getattr(run, "dead", False):
            run.dead = True
            raise ConnectionResetError("Connection lost")
        live(data)

    run.log = log
    run.finish = lambda **kw: (_ for _ in ()).throw(ConnectionResetError("Connection lost"))


def test_the_steps_wandb_lost_when_its_service_died_are_sent_again_at_the_next_start(tmp_path, wandb_env, capsys):  # noqa: F811
    """deepspeed's launch.py teardown SIGTERMs every child of rank 0, wandb-core too: the log of step 5 raised, W&B went
    off, the agreed save came at step 5 and the requeue started after it, so steps up to 5 were in metrics.jsonl and
    never in W&B (wandb-core also loses what it had not flushed: its last ~15 s). The first step W&B may lack is
    noted; the next start sends metrics.jsonl's records from it through its resumed step, then drops the note."""
    fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 10, False)
    _dies_at(m.wandb, 5)
    for s in range(1, 6):
        m.log({"step": s, "stage": 0, **STEP})
    m.close(5.0)
    note = json.loads((tmp_path / metrics_starts.UNSENT).read_text())
    assert note["run_id"] == m.run_id and note["step"] <= 5  # the logs of the last 30 s: here all of them

    fake_wandb(wandb_env)  # the next start's W&B (a fresh service; its run continues by id)
    again = MetricsLogger(str(tmp_path), True, "wandb", None, m.run_id, {}, 10, False, resume_step=5)
    sent = {r["step"]: r for r in again.wandb.rows if "loss" in r}
    assert 5 in sent and sent[5]["loss"] == 1.0 and set(sent) == set(range(note["step"], 6))
    assert not (tmp_path / metrics_starts.UNSENT).exists()
    assert "sent again from metrics.jsonl" in capsys.readouterr().out
    again.close()


def test_only_the_records_of_the_last_seconds_before_the_death_are_owed(tmp_path, wandb_env):  # noqa: F811
    """What went through long before the death (flushed by wandb-core since) is not sent twice: steps 1-2 a minute
    before, 3-5 within the window, step 6's log raising."""
    assert metrics_starts.first_unsent([(0.0, 1), (1.0, 2), (60.0, 3), (61.0, 4), (62.0, 5)], 6, 0) == 3
    assert metrics_starts.first_unsent([], None, 7) == 7  # nothing went through at this start: all of it
    assert metrics_starts.first_unsent([(0.0, 4)], 5, 3) == 4
    fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    from training import metrics as metrics_mod

    clock = [0.0]
    wandb_env.setattr(metrics_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0]), raising=False)
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 1000, False)
    for s in range(1, 200):  # a long run keeps only the window's records in memory
        clock[0] += 1.0
        m.log({"step": s, **STEP})
    assert len(m._sent) <= metrics_starts.UNSENT_WINDOW_S + 4
    # another run's note (a branch that logs to a run of its own) is dropped, nothing sent
    (tmp_path / metrics_starts.UNSENT).write_text(json.dumps({"run_id": "other", "step": 3}))
    rows = len(m.wandb.rows)
    again = MetricsLogger(str(tmp_path), True, "wandb", None, m.run_id, {}, 1000, False, resume_step=199)
    assert not (tmp_path / metrics_starts.UNSENT).exists() and len(again.wandb.rows) == rows


def test_offline_run_folders_without_a_record_are_moved_aside(tmp_path, wandb_env, capsys):  # noqa: F811
    """A start stopped seconds after its W&B start left a .wandb of its 7-byte header alone, and the README's `wandb
    sync OUTPUT_DIR/wandb/offline-run-*` failed on it ("transactionlog: error getting next record: EOF"). Such folders
    of this run move to OUTPUT_DIR/wandb/empty/, said in one line; one with data, and another run's, are left."""
    fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    root = tmp_path / "wandb"
    folders = {"offline-run-20261201_014458-ab12": 7, "offline-run-20261201_014607-ab12": 40_000,
               "offline-run-20261201_014700-cd34": 7, "offline-run-20261201_014800-x-ab12": 7}  # run x-ab12's
    for name, size in folders.items():
        (root / name).mkdir(parents=True)
        (root / name / f"run-{name.rsplit('-', 1)[1]}.wandb").write_bytes(b":W&B\xe1\xbe\x00".ljust(size, b"\x01"))
    MetricsLogger(str(tmp_path), True, "wandb", None, "ab12", {}, 10, False, resume_step=3).close()
    assert (root / "empty" / "offline-run-20261201_014458-ab12" / "run-ab12.wandb").stat().st_size == 7
    assert (root / "offline-run-20261201_014607-ab12").is_dir() and (root / "offline-run-20261201_014700-cd34").is_dir()
    assert (root / "offline-run-20261201_014800-x-ab12").is_dir()  # a review: a run whose id ends -ab12 was moved
    said = [ln for ln in capsys.readouterr().out.splitlines() if "hold no record" in ln]
    assert len(said) == 1 and "offline-run-20261201_014458-ab12" in said[0] and f"{root}/empty/" in said[0], said


def test_a_resume_is_on_record_and_dropped_steps_are_said(tmp_path, capsys):
    """A SIGKILL at step 70, the last save at 64: the next start cut steps 65-70 from metrics.jsonl unsaid, and no
    record marked where one start ended and the next began. One line names the dropped steps; the start's first step
    record comes after `{"event": "resume", "step": 64, "dropped_through": 70}` (a resume without drops: no
    dropped_through), which the plots draw and step readers skip."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 71)))
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 100, False, resume_step=64)
    assert ("steps 65-70 logged by an earlier start that ended without a save are dropped and trained again"
            in capsys.readouterr().out)
    m.log({"event": "memory_choice", "step": 64})
    for s in (65, 66):
        m.log({"step": s, "stage": 0, **STEP})
    m.close()
    MetricsLogger(str(tmp_path), True, "none", None, None, {}, 100, False, resume_step=66).log({"step": 67, **STEP})
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert recs[64:] == [{"event": "memory_choice", "step": 64}, {"event": "resume", "step": 64, "dropped_through": 70},
                         {"step": 65, "stage": 0, **STEP}, {"step": 66, "stage": 0, **STEP},
                         {"event": "resume", "step": 66}, {"step": 67, **STEP}]
    assert "dropped" not in capsys.readouterr().out


def test_a_preempted_start_is_marked_and_a_finished_run_records_its_totals(tmp_path, wandb_env, capsys):  # noqa: F811
    """Every preempted segment read "finished" (exit 0) on W&B, and nothing gave the run's totals at its end. The
    preempted exit (no COMPLETE written during the start) marks the run preempting and finishes it with 75; the
    finished run's close records run_end (steps, tokens, starts, its steps' own time) and says it in one line."""
    fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    marked = []
    wandb_env.setattr(FakeRun, "mark_preempting", lambda self: marked.append(self.kw["id"]), raising=False)
    step = {**STEP, "tokens": 100, "tokens_per_s": 50.0}
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 4, False)
    for s in (1, 2):
        m.log({"step": s, **step, "total_tokens": 100 * s})
    run = m.wandb
    m.close()
    assert marked == [m.run_id] and run.exit_code == 75
    m = MetricsLogger(str(tmp_path), True, "wandb", None, m.run_id, {}, 4, False, resume_step=2)
    for s in (3, 4):
        m.log({"step": s, **step, "total_tokens": 100 * s})
    (tmp_path / "COMPLETE").write_text("4\n")  # train.py, right before its close
    run = m.wandb
    m.close()
    assert marked == [m.run_id] and run.exit_code is None  # finished: not marked again
    end = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert end == {"event": "run_end", "step": 4, "total_tokens": 400, "starts": 2, "train_s": 8.0}
    assert run.history[4]["run_end/starts"] == 2
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("run complete")]
    assert line == ["run complete at step 4: 400 tokens, 2 start(s), 0h00m08s in its steps' own time (saves, "
                    "evaluations and builds not counted; metrics.jsonl: run_end)"]
    # a finished run started again (nothing to train) records no second run_end
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 4, False, resume_step=4)
    os.utime(tmp_path / "COMPLETE", ns=(1, 1))
    m.close()
    assert sum('"run_end"' in ln for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
