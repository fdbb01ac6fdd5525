"""What users read while a run trains, on a stand-in `wandb` module (W&B's one-step merge modelled): an online start
without network goes offline instead of ending the run; WANDB_PROJECT / WANDB_RUN_ID / WANDB_NAME / WANDB_DIR and
--run_name reach wandb.init; an event logged at a step keeps that step's stage/sp on the charts; the step's grad norm;
each stage's resolved layout in the W&B config; the progress bar and the log-file line after a resume; a W&B that stops
answering (its service process killed) turns W&B off and the run goes on. < 1 s."""

from __future__ import annotations

import io
import json
import sys
import types

import pytest

from training import metrics as metrics_mod
from training.metrics import MetricsLogger

WANDB_VARS = ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_NAME", "WANDB_DIR",
              "WANDB_INIT_TIMEOUT")
STEP = {"loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "peak_mem_gb": 0.1}


class CommError(Exception):
    pass


SERVER: dict[str, list[dict]] = {}  # run id -> its history rows, across starts (W&B's server)


class FakeRun:
    """W&B's history as wandb 0.31 keeps it (checked offline against the installed wandb, the rows of its .wandb file):
    a log without `step=` is a row of its own at the next internal _step; `step=` merges into the current row when
    equal, starts a row when higher, and is DROPPED when lower ("Tried to log to step 3 that is less than the current
    step 5"). A resumed run (the same id) continues its rows and its _step. `history`: per x of the charts (the
    define_metric("*", step_metric=...) key where defined, else _step), the merge of that x's rows, in order."""

    def __init__(self, kw: dict):
        self.kw, self.config, self.axis = kw, types.SimpleNamespace(values={}), "_step"
        self.config.update = lambda d, allow_val_change=False: self.config.values.update(d)
        self.rows = SERVER.setdefault(kw["id"], []) if kw.get("resume") else []
        self.cur = self.rows[-1]["_step"] if self.rows else None
        self.dropped: list[int] = []

    def define_metric(self, name: str, step_metric=None, **kw) -> None:
        if name == "*" and step_metric:
            self.axis = step_metric

    def log(self, data: dict, step=None) -> None:
        if step is not None and self.cur is not None and step < self.cur:
            self.dropped.append(step)  # W&B: "Steps must be monotonically increasing, so this data will be ignored"
        elif step is not None and step == self.cur:
            self.rows[-1].update(data)
        else:
            self.cur = step if step is not None else (-1 if self.cur is None else self.cur) + 1
            self.rows.append({**data, "_step": self.cur})

    @property
    def history(self) -> dict:
        out = {}
        for row in self.rows:
            if self.axis in row:
                out.setdefault(row[self.axis], {}).update(row)
        return out

    def finish(self, exit_code=None) -> None:
        self.exit_code = exit_code


@pytest.fixture
def wandb_env(monkeypatch):
    """No WANDB_* variable set (and whatever the code under test sets is undone after the test)."""
    for var in WANDB_VARS:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    return monkeypatch


def fake_wandb(monkeypatch, online_fails: bool = False) -> list[dict]:
    """A `wandb` module whose init records its arguments; `online_fails`: an online init raises CommError, as W&B
    does on a node without network after its timeout."""
    inits = []
    SERVER.clear()

    def init(**kw):
        inits.append(kw)
        if online_fails and kw.get("mode") != "offline":
            raise CommError("Failed to get resume status for run ab12: context deadline exceeded\nwhile retrying")
        return FakeRun(kw)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
        init=init, Settings=lambda **kw: kw, teardown=lambda: None, Table=lambda columns, data: None))
    return inits


def test_an_online_start_without_network_logs_offline(tmp_path, wandb_env, capsys):
    """WANDB_API_KEY exported in ~/.bashrc, a compute node without network: wandb.init retried ~2 min and raised
    CommError, a traceback and exit 1 at every requeue. It waits INIT_TIMEOUT_S at most and starts offline, said in
    one line naming WANDB_MODE=offline and `wandb sync`."""
    wandb_env.setenv("WANDB_API_KEY", "k" * 40)
    inits = fake_wandb(wandb_env, online_fails=True)
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 10, False)
    assert inits[0]["settings"].get("init_timeout", 90) <= 60  # W&B's default: 90 s, then retries
    assert inits[1]["mode"] == "offline" and inits[1]["id"] == inits[0]["id"] and m.wandb is not None
    out = [ln for ln in capsys.readouterr().out.splitlines() if "online start failed" in ln]
    assert len(out) == 1 and "CommError" in out[0] and "WANDB_MODE=offline" in out[0] and "`wandb sync`" in out[0]
    m.log({"step": 1, **STEP})
    assert m.wandb.history[1]["loss"] == 1.0
    m.close()


def test_the_environments_project_run_id_name_and_dir_reach_wandb(tmp_path, wandb_env, capsys):
    """WANDB_PROJECT, WANDB_RUN_ID and WANDB_DIR were overridden by our own arguments and no name was passed (W&B
    named the run at random). Now: the flag, else the environment, else ours; a checkpoint's run id wins over
    WANDB_RUN_ID (said); the name is --run_name, else WANDB_NAME, else the output dir's basename."""
    inits = fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    out = tmp_path / "my-run"
    MetricsLogger(str(out), True, "wandb", None, None, {}, 10, False).close()
    assert {k: inits[-1][k] for k in ("project", "name", "dir")} == {
        "project": "ulysses-longtrain", "name": "my-run", "dir": str(out)}
    for var, value in (("WANDB_PROJECT", "proj"), ("WANDB_RUN_ID", "envid"), ("WANDB_NAME", "nm"),
                       ("WANDB_DIR", str(tmp_path / "wb"))):
        wandb_env.setenv(var, value)
    m = MetricsLogger(str(out), True, "wandb", None, None, {}, 10, False)
    assert {k: inits[-1][k] for k in ("project", "id", "name", "dir")} == {
        "project": "proj", "id": "envid", "name": "nm", "dir": str(tmp_path / "wb")} and m.run_id == "envid"
    m.close()
    m = MetricsLogger(str(out), True, "wandb", "flagproj", "ck12", {"run_name": "flagname"}, 10, False)
    assert {k: inits[-1][k] for k in ("project", "id", "name")} == {"project": "flagproj", "id": "ck12",
                                                                      "name": "flagname"}
    said = capsys.readouterr().out
    assert "WANDB_RUN_ID=envid not used: this run's checkpoint logs to run ck12" in said
    assert "--wandb_project flagproj wins over WANDB_PROJECT=proj" in said and "--run_name flagname wins" in said
    m.close()


def test_a_copied_folder_or_a_branch_into_a_new_one_logs_to_a_run_of_its_own(tmp_path, wandb_env, capsys):
    """`cp -a runW runW2` resumed, and a branch into a new folder from runW's checkpoint, both logged into runW's W&B
    run (their steps drawn over its own) and refused WANDB_RUN_ID "since a new --output_dir starts a new run". The
    checkpoint names the folder whose run it is (wandb_home): another folder that still holds its run gets a run of
    its own (WANDB_RUN_ID where given), grouped with it; a plain move (the old folder gone) keeps the run."""
    inits = fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    orig, copy = tmp_path / "runW", tmp_path / "runW2"
    for d in (orig, copy):
        (d / "checkpoints").mkdir(parents=True)
    m = MetricsLogger(str(copy), True, "wandb", None, "a690", {}, 10, False, resume_step=3, home=str(orig))
    assert inits[-1]["id"] == m.run_id != "a690" and m.run_id.startswith("a690-") and inits[-1]["group"] == "a690"
    assert m.home == str(copy) and f"run a690 is {orig}'s (still there)" in capsys.readouterr().out
    m.close()
    again = MetricsLogger(str(copy), True, "wandb", None, m.run_id, {}, 10, False, resume_step=5, home=m.home)
    assert inits[-1]["id"] == m.run_id and inits[-1]["group"] is None  # its own checkpoints: its own run, kept
    again.close()
    wandb_env.setenv("WANDB_RUN_ID", "lr5e4copy")
    MetricsLogger(str(copy), True, "wandb", None, "a690", {}, 10, False, home=str(orig)).close()
    assert inits[-1]["id"] == "lr5e4copy" and inits[-1]["group"] == "a690"
    wandb_env.delenv("WANDB_RUN_ID")
    MetricsLogger(str(copy), True, "wandb", None, "a690", {}, 10, False, home=str(tmp_path / "gone")).close()
    assert inits[-1]["id"] == "a690"  # moved: the old folder is gone, the run is this one's
    (tmp_path / "alias").symlink_to(orig)  # one folder under another real path (a mount): the same run
    MetricsLogger(str(orig), True, "wandb", None, "a690", {}, 10, False, home=str(tmp_path / "alias")).close()
    assert inits[-1]["id"] == "a690"


def test_run_name_is_taken_and_the_project_is_left_to_the_environment():
    """--run_name (an HF Trainer argument) was refused, saying the run is named by --output_dir, which it was not."""
    from training.config import parse_config

    cfg = parse_config(["--run_name", "long 8k"])
    assert cfg.run_name == "long 8k" and cfg.wandb_project is None  # None: WANDB_PROJECT, else ulysses-longtrain
    assert parse_config(["--wandb_project", "p"]).wandb_project == "p"


def test_an_event_keeps_the_steps_own_stage_and_layout_on_wandb(tmp_path, wandb_env):
    """The next stage's memory choice is logged at the previous stage's last step: W&B merged it into that step and
    its stage/sp/dp replaced the step's own on the charts. Events go under their name; metrics.jsonl is unchanged."""
    fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 10, False)
    m.log({"step": 3, "stage": 0, "sp": 1, "dp": 2, **STEP})
    m.log({"event": "engine_released", "stage": 0, "step": 3, "alive": 0, "host_rss_gb": 1.5})
    m.log({"event": "memory_choice", "stage": 1, "step": 3, "sp": 2, "dp": 1, "predicted_gb": 3.0})
    got = m.wandb.history[3]
    assert (got["stage"], got["sp"], got["dp"]) == (0, 1, 2)
    assert (got["memory_choice/stage"], got["memory_choice/sp"], got["engine_released/alive"]) == (1, 2, 0)
    assert "memory_choice/step" not in got
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[2] == {"event": "memory_choice", "stage": 1, "step": 3, "sp": 2, "dp": 1, "predicted_gb": 3.0}
    m.close()


def test_a_resume_behind_the_logged_steps_keeps_its_records_on_wandb(tmp_path, wandb_env):
    """A plain resume re-logs the steps after its checkpoint (a SIGKILL, or an async save still behind the steps): with
    wandb.log(step=) into the same run, W&B dropped every step up to the dead attempt's last (wandb/wandb#4482): the
    charts kept the dead attempt's values, and the resumed start's events at the checkpoint's step were dropped. Every
    record is now logged on our own `step` axis (define_metric), none with step=: all kept."""
    fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 10, False)
    for s in range(1, 6):  # the checkpoint at 3, steps 4 and 5 logged, then SIGKILL
        m.log({"step": s, "stage": 0, **STEP})
    run_id = m.run_id
    m = MetricsLogger(str(tmp_path), True, "wandb", None, run_id, {}, 10, False, resume_step=3)
    assert m.run_id == run_id  # a requeue continues the run
    m.log({"event": "memory_choice", "stage": 0, "step": 3, "sp": 2, "predicted_gb": 3.0})
    for s in range(4, 7):
        m.log({"step": s, "stage": 0, **STEP, "loss": 2.0})
    m.log_eval(0, {"step": 6, "stage": 0, "stage_name": "s8", "seq_len": 8, "heldout_loss": 1.5,
                   "passkey_accuracy": {"0.5": 1.0}})
    assert m.wandb.dropped == []
    hist = m.wandb.history
    assert [hist[s]["loss"] for s in range(1, 7)] == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]  # the retrained ones last at 4, 5
    assert hist[3]["memory_choice/sp"] == 2 and hist[6]["eval/passkey_accuracy/0.5"] == 1.0
    assert [r["loss"] for r in m.wandb.rows if r.get("step") == 4 and "loss" in r] == [1.0, 2.0]  # both attempts'
    m.close()


def test_each_stages_resolved_layout_is_in_the_wandb_config(tmp_path, wandb_env):
    """The W&B config held the flags only: not what each stage ran with (auto SP, a stage's own lr and warmup)."""
    from training import stage_records

    fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 10, False)
    st = types.SimpleNamespace(index=1, name="s256", max_steps=5, max_seq_length=256, sp=2, cp=1, warmup_steps=2,
                               learning_rate=5e-4, memory_choice=None)
    run = types.SimpleNamespace(metrics=m, dims=types.SimpleNamespace(is_main=False, world=4))
    stage_records._record_ds_config(run, st, None, 3)
    assert m.wandb.config.values == {"world": 4, "stage1": {"name": "s256", "steps": 5, "seq_len": 256, "sp": 2,
                                                             "cp": 1, "dp": 2, "warmup": 2, "lr": 5e-4}}
    m.close()


class Engine:
    def __init__(self, norm):
        self.norm = norm

    def get_global_grad_norm(self):
        return self.norm


@pytest.mark.parametrize("norm, out, want", [
    (2.5, {}, 2.5),
    (__import__("torch").tensor(0.75), {}, 0.75),  # stage 3 keeps a tensor
    (float("inf"), {"overflow": True}, None),  # fp16 overflow: DeepSpeed's inf, the update skipped
    (1.0, {"skipped": True}, None),  # no supervised token: no step ran, the norm is the previous step's
    (None, {}, None),  # an engine that keeps none
])
def test_the_steps_grad_norm_is_logged(tmp_path, wandb_env, norm, out, want):
    """The pre-clip global grad norm was never logged; it is DeepSpeed's cached one (no collective of its own)."""
    from training import stage_records

    fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 10, False)
    run = types.SimpleNamespace(cfg=types.SimpleNamespace(gradient_accumulation_steps=1, per_device_train_batch_size=1),
                                preempt=types.SimpleNamespace(deadline=types.SimpleNamespace(record_step=lambda s: None)),
                                metrics=m)
    stage_records._log_step(run, types.SimpleNamespace(index=0, max_seq_length=8), types.SimpleNamespace(dp=1, sp=1, cp=1),
                            types.SimpleNamespace(step=3, tokens=0),
                            {"loss": 1.0, "label_tokens": 8, "step_time": 0.5, **out},
                            1e-3, types.SimpleNamespace(source_shares=lambda: {}), Engine(norm))
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["grad_norm"] == want and m.wandb.history[3].get("grad_norm") == want
    m.close()


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_after_a_resume_counts_this_starts_steps(tmp_path, monkeypatch):
    """The bar began at 0 and was set to the step: 500 resumed steps in this start's first second read as 500 it/s,
    and the ETA was off by as much."""
    monkeypatch.setattr(sys, "stderr", Tty())
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 1000, True, resume_step=500)
    for s in (501, 502):
        m.log({"step": s, **STEP})
    assert m.bar.n == 502 and m.bar.format_dict["initial"] == 500
    m.close()


def _bar_left(bar) -> float:
    """The remaining seconds the bar shows (tqdm's format_meter: the total's steps left at its rate)."""
    d = bar.format_dict
    rate = d["rate"] or (d["n"] - d["initial"]) / d["elapsed"]
    return (d["total"] - d["n"]) / rate


@pytest.mark.parametrize("resume_step, start", [(0, None), (0, 10), (14, 10), (14, None)])
def test_the_bars_eta_is_the_stages(tmp_path, monkeypatch, resume_step, start):
    """The bar's remaining time was the whole curriculum's steps at the current stage's rate (the log line's was made
    the stage's): after a fast stage it was 6.7x short. The bar starts again at each stage's first step: the stage's
    steps (from its start where given, else those left at this start), its rate from the stage's second step (the
    engine build before the first not timed); the run's position stays in the postfix."""
    monkeypatch.setattr(sys, "stderr", Tty())
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 20, True, resume_step=resume_step)
    clock = [m.bar.start_t]
    m.bar._time = lambda: clock[0]
    for end, last, secs in ((10, 10, 1.0), (20, 17, 8.0)):  # stage 0: 1 s a step; stage 1 (8x the length): 8 s
        if resume_step >= end:
            continue
        m.begin_stage(end) if start is None or end == 10 else m.begin_stage(end, start)  # train_stage's: (end, start)
        clock[0] += 100.0  # the stage's engine build
        for s in range(max(end - 9, resume_step + 1), last + 1):
            clock[0] += secs
            m.log({"step": s, "stage": int(end == 20), **STEP})
    assert _bar_left(m.bar) == pytest.approx(3 * 8.0)  # steps 18..20 at stage 1's 8 s
    assert m.bar.total == (10 if start == 10 or resume_step == 0 else 6) and "step 17/20 stage 1" in m.bar.postfix
    m.close()


def test_a_log_file_line_has_the_total_and_an_eta(tmp_path, monkeypatch, capsys):
    """Without a TTY (every SLURM log) the line was `step N stage S loss ...`: no total, no ETA."""
    clock = [100.0]
    monkeypatch.setattr(metrics_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0]), raising=False)
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 1000, False, resume_step=500)
    for s in range(501, 505):
        clock[0] += 2.0  # 2 s per step
        m.log({"step": s, "stage": 1, **STEP})
    m.log({"step": 505, "stage": 2, **STEP})  # a new stage: its own step time, from its second step on
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 501/1000 stage 1 loss") and " eta " not in lines[0]
    assert lines[3].startswith("step 504/1000 ") and lines[3].endswith(" eta 16m32s")  # 496 steps x 2 s
    assert " eta " not in lines[4]
    m.close()


def test_a_window_stops_wandb_finish_is_bounded(tmp_path, wandb_env, capsys):
    """A SIGTERM window's stop has EXIT_MARGIN_S from its last decision to the exit; exit_preempted waited for
    wandb.finish (an online run's last upload) without a bound, before the rank recorded its 75: the launcher's
    SIGKILL could come first. close(timeout_s) waits that long at most and says where the rest is."""
    import threading

    fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 10, False)
    release = threading.Event()
    m.wandb.finish = lambda **kw: release.wait(30)  # an upload that does not end
    import time

    t0 = time.monotonic()
    m.close(0.2)
    assert time.monotonic() - t0 < 5
    release.set()
    out = capsys.readouterr().out
    assert "did not end within" in out and f"{tmp_path}/wandb" in out and "`wandb sync`" in out


def test_a_curriculums_eta_is_the_stages(tmp_path, capsys):
    """The ETA was the whole curriculum's remaining steps at this stage's step time: during a 128k stage, the 1M
    stage's steps (several times longer) counted at 128k's rate. It is now to the stage's end, said so."""
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 1000, False)
    m.begin_stage(100)
    for s in range(1, 4):
        m.log({"step": s, "stage": 0, **STEP})
    line = capsys.readouterr().out.splitlines()[-1]
    assert " stage eta " in line and line.startswith("step 3/1000 "), line
    m.close()


def test_records_wandb_could_not_save_are_said_at_the_end(tmp_path, wandb_env, capsys):
    """W&B's writer drops what it cannot save (a full or quota-limited WANDB_DIR) and says so only in its
    debug-internal.log, while wandb.log returns as usual: the run ended with a curve cut short and nothing said (an
    audit, RLIMIT_FSIZE on wandb-core). Said in one line at close; nothing when the log has no such line."""
    fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    for lost in (False, True):
        m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 10, False)
        run = tmp_path / f"offline-run-{int(lost)}"
        (run / "logs").mkdir(parents=True)
        (run / "logs" / "debug-internal.log").write_text(
            "writer: ok\n" + "writer: failed to save record: write: file too large\n" * lost)
        m.wandb.dir = str(run / "files")
        m.wandb.finish = lambda **kw: None
        m.close()
        out = capsys.readouterr().out
        assert ("could not save some records" in out and "metrics.jsonl" in out) == lost, out


@pytest.mark.parametrize("job, wandb_dir, mode, said", [
    ("5", "tmpdir/wb", None, "$TMPDIR"),  # offline by default, under the job's $TMPDIR
    ("5", "/dev/shm/wb", "offline", "/dev/shm"),
    ("5", "/srv/wb", None, None),  # a shared folder
    ("5", "tmpdir/wb", "online", None),  # synced as it goes
    (None, "tmpdir/wb", None, None),  # no Slurm job: nothing removes it
])
def test_offline_runs_in_a_folder_the_job_loses_are_said(tmp_path, wandb_env, capsys, job, wandb_dir, mode, said):
    """WANDB_DIR under /tmp, /dev/shm or $TMPDIR inside a Slurm job (job_container/tmpfs, a per-job $TMPDIR): the
    offline runs vanished at the job's end, before any `wandb sync`, unsaid. Now one line names the loss and
    metrics.jsonl, which keeps every record."""
    fake_wandb(wandb_env)
    wandb_env.setenv("TMPDIR", str(tmp_path / "tmpdir"))
    wandb_env.setenv("WANDB_DIR", wandb_dir.replace("tmpdir", str(tmp_path / "tmpdir"), 1))
    if job:
        wandb_env.setenv("SLURM_JOB_ID", job)
    else:
        wandb_env.delenv("SLURM_JOB_ID", raising=False)
    if mode:
        wandb_env.setenv("WANDB_MODE", mode)
    MetricsLogger(str(tmp_path / "run"), True, "wandb", None, None, {}, 10, False).close()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "lost at the job's end" in ln]
    if said is None:
        assert lines == []
    else:
        assert len(lines) == 1 and f"a folder under {said}, this Slurm job's own" in lines[0], lines
        assert f"metrics.jsonl in {tmp_path}/run keeps every record" in lines[0] and "WANDB_DIR" in lines[0]


@pytest.mark.parametrize("dies_at, timeout_s", [("log", None), ("log", 5.0), ("define_metric", None), ("config", None),
                                                ("finish", None), ("finish", 5.0)])
def test_a_wandb_that_stops_answering_is_turned_off_and_the_run_goes_on(tmp_path, wandb_env, capsys, dies_at,
                                                                         timeout_s):
    """wandb-core (W&B's service process) dies on the SIGTERM/SIGINT that deepspeed launch.py's teardown
    (terminate_process_tree) or slurmstepd (SignalChildrenProcesses=yes, proctrack/linuxproc) sends a rank's children:
    rank 0's next wandb.log raised ConnectionResetError before the step boundary's agreed save, and the run exited 1
    with no checkpoint instead of saving and exiting 75. Now the first W&B error turns W&B off for the rest of the run in
    one warning line, nothing more is sent to it, metrics.jsonl keeps every record, and close (bounded or not) never
    raises."""
    fake_wandb(wandb_env)
    wandb_env.setenv("WANDB_MODE", "offline")
    calls, torn = [], []

    def dead(*args, **kw):
        calls.append(args)
        raise ConnectionResetError("Connection lost")

    def teardown():  # wandb.teardown on a broken socket: unhooks its exit teardown (a traceback at exit), then raises
        torn.append(1)
        raise ConnectionResetError("Connection lost")

    sys.modules["wandb"].teardown = teardown

    if dies_at == "define_metric":  # at the start itself
        wandb_env.setattr(FakeRun, "define_metric", dead)
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 10, False)
    run = m.wandb
    if dies_at == "log":  # two steps logged, then the service is gone: log and finish raise
        live = run.log
        run.log = lambda data, step=None: live(data) if len(run.rows) < 2 else dead(data)
        run.finish = dead
    elif dies_at == "config":
        run.config.update = dead
    elif dies_at == "finish":
        run.finish = dead
    m.record_stage(types.SimpleNamespace(index=0, name="s8", max_steps=5, max_seq_length=8, sp=1, cp=1,
                                         warmup_steps=1, learning_rate=1e-3), 1)
    for s in range(1, 6):
        m.log({"step": s, "stage": 0, **STEP})
    m.log_table("samples", ["a"], [[1]], step=5)
    m.log_eval(0, {"step": 5, "stage": 0, "stage_name": "s8", "seq_len": 8, "heldout_loss": 1.5,
                   "passkey_accuracy": {"0.5": 1.0}})
    m.close(timeout_s)
    out = capsys.readouterr()
    warned = [ln for ln in out.out.splitlines() if "W&B stopped answering" in ln]
    assert len(warned) == 1, out.out
    assert "(ConnectionResetError: Connection lost)" in warned[0] and "metrics.jsonl keeps every record" in warned[0]
    assert len(calls) == 1 and m.wandb is None and torn == [1]  # nothing more sent to the dead service
    assert "Traceback" not in out.err  # close(timeout_s)'s thread included
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 5] and lines[-1]["event"] == "eval"
    assert (tmp_path / "eval" / "stage0.json").exists()
