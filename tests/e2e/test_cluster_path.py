"""What a cluster run relies on, checked on CPU: dropout resumes exactly (SIGTERM and SIGKILL), a stage with
`reset_optimizer` carries the weights and starts Adam afresh, `--resume PATH` starts a branch that `--resume auto`
continues, the time limit ends in a save, and a non-shared output folder stops the run in one line."""

from __future__ import annotations

import json
import os
import signal

import pytest
import yaml

from tests.conftest import save_tiny_model
from tests.distributed import ROOT, run, spawn, wait
from tests.runs import TRAIN, losses, preempt_after, train_args, wait_for
from training.config import parse_config
from training.preemption import MARGIN_S, SAVE_GUESS_S, Deadline, PreemptionFlag

pytestmark = pytest.mark.dist


def close(got: dict, ref: dict, tol: float, steps) -> None:
    for s in steps:
        assert abs(got[s] - ref[s]) <= tol * abs(ref[s]), (s, got[s], ref[s])


# --- dropout: the RNG restored at resume is the one that draws the next masks ---------------------------------

@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("dropout")
    return {"on": save_tiny_model(str(d / "on"), "tiny-llama", attention_dropout=0.2),
            "off": save_tiny_model(str(d / "off"), "tiny-llama")}


@pytest.fixture(scope="module")
def dropout_reference(assets, dropout_model, tmp_path_factory):
    ref = {}
    for key in ("on", "off"):
        d = tmp_path_factory.mktemp(f"dropout_ref_{key}")
        run(TRAIN, dropout_args(assets, dropout_model[key], d / "out"), 2, str(d / "logs"))
        ref[key] = losses(d / "out")
    # the masks matter: with dropout the losses are far from the dropout-free run's (same data, same weights)
    assert max(abs(ref["on"][s] - ref["off"][s]) for s in range(2, 9)) > 1e-3
    return ref["on"]


def dropout_args(assets, model, out, extra=()):
    args = train_args(assets, out, 2, extra=extra)
    args[args.index("--model_name_or_path") + 1] = model
    return args


@pytest.mark.slow  # make test's budget (~1-2 min each): run by make test-slow
def test_dropout_resumes_identically_after_sigterm(assets, dropout_model, dropout_reference, tmp_path):
    out = tmp_path / "out"
    args = dropout_args(assets, dropout_model["on"], out)
    k = preempt_after(args, 2, out, str(tmp_path / "l1"), 3)
    assert 3 <= k < 8
    run(TRAIN, args, 2, str(tmp_path / "l2"))
    close(losses(out), dropout_reference, 1e-6, range(1, 9))


@pytest.mark.slow  # make test's budget (~1-2 min each): run by make test-slow
def test_dropout_resumes_identically_after_sigkill(assets, dropout_model, dropout_reference, tmp_path):
    out = tmp_path / "out"
    args = dropout_args(assets, dropout_model["on"], out, extra=["--save_steps", "2"])
    procs = spawn(TRAIN, args, 2, str(tmp_path / "l1"))
    wait_for(lambda: len(losses(out)) >= 5)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    wait(procs, str(tmp_path / "l1"))
    run(TRAIN, args, 2, str(tmp_path / "l2"))
    assert "resuming from" in (tmp_path / "l2" / "rank0.log").read_text()
    close(losses(out), dropout_reference, 1e-6, range(1, 9))


# --- reset_optimizer at a stage transition ---------------------------------------------------------------------

STAGE_1 = {"name": "s64", "max_seq_length": 64, "sequence_parallel_size": 2, "max_steps": 3, "learning_rate": 1e-3}
STAGE_2 = {"name": "s128", "max_seq_length": 128, "sequence_parallel_size": 2, "max_steps": 3,
           "learning_rate": 3e-3, "warmup_steps": 1}


def recipe(path, model, data, stages, seed=0) -> str:
    path.write_text(yaml.safe_dump({"model_name_or_path": model, "dataset_path": data, "report_to": "none",
                                    "deepspeed": os.path.join(ROOT, "ds_configs/zero3_offload.json"), "seed": seed,
                                    "min_lr": 1e-5, "stages": stages}))
    return str(path)


@pytest.mark.slow  # make test's budget (~1-2 min each): run by make test-slow
def test_reset_optimizer_carries_weights_and_restarts_adam(assets, tmp_path):
    """Stage 2 with reset_optimizer == a fresh single-stage run from stage 1's final weights (same samples: seed + 1
    is what stage index 1 adds), within 1e-5 at every step; carrying the moments instead is measurably different."""
    from model_utils.export import export_hf

    runs = {}
    for name, reset in (("reset", True), ("carry", False)):
        r = recipe(tmp_path / f"{name}.yaml", assets["llama_gqa"], assets["data"],
                   [STAGE_1, {**STAGE_2, "reset_optimizer": reset}])
        run(TRAIN, ["--config", r, "--output_dir", str(tmp_path / name)], 2, str(tmp_path / f"l_{name}"))
        runs[name] = losses(tmp_path / name)
    stage1_end = (tmp_path / "reset" / "checkpoints" / "STAGE_0_s64").read_text().strip()
    weights = export_hf(str(tmp_path / "reset" / "checkpoints" / stage1_end), str(tmp_path / "w"))
    fresh = recipe(tmp_path / "fresh.yaml", weights, assets["data"], [{**STAGE_1, **STAGE_2, "name": "s128"}], seed=1)
    # same held-out documents as the 2-stage run: the largest evaluation is stage 2's in both
    run(TRAIN, ["--config", fresh, "--output_dir", str(tmp_path / "fresh")], 2, str(tmp_path / "l_fresh"))
    got, ref = runs["reset"], losses(tmp_path / "fresh")
    close({s - 3: got[s] for s in (4, 5, 6)}, ref, 1e-5, (1, 2, 3))
    assert runs["carry"][4] == pytest.approx(runs["reset"][4], rel=1e-6)  # same weights at the transition
    gap = max(abs(runs["carry"][s] - runs["reset"][s]) / runs["reset"][s] for s in (5, 6))
    assert gap > 100 * 1e-5, gap  # the moments do matter: carrying them is far outside the tolerance above


# --- --resume PATH starts a branch ----------------------------------------------------------------------------

@pytest.mark.slow  # make test's budget (~1-2 min each): run by make test-slow
def test_resume_path_starts_a_branch_that_auto_continues(assets, tmp_path):
    out = tmp_path / "out"
    args = train_args(assets, out, 2, extra=["--save_steps", "2", "--save_total_limit", "3"])
    run(TRAIN, args, 2, str(tmp_path / "l0"))
    ref = losses(out)
    ck = out / "checkpoints"
    assert {"step_000004", "step_000006", "step_000008"} <= set(os.listdir(ck))
    branch = [*args, "--resume", str(ck / "step_000004")]
    procs = spawn(TRAIN, branch, 2, str(tmp_path / "l1"))
    wait_for(lambda: "step 6 stage 0 loss" in (tmp_path / "l1" / "rank0.log").read_text())  # the branch's own step
    for p in procs:
        p.send_signal(signal.SIGTERM)
    assert wait(procs, str(tmp_path / "l1")) == [75, 75]
    k = max(losses(out))
    # moved aside, not deleted: the newer checkpoints, the stage-end pointer to one of them and the line's COMPLETE
    assert sorted(os.listdir(ck / "abandoned")) == ["COMPLETE", "STAGE_0_main", "step_000006", "step_000008"]
    assert not (out / "COMPLETE").exists()
    assert (ck / "LATEST").read_text().strip() == f"step_{k:06d}"
    run(TRAIN, [*args, "--resume", "auto"], 2, str(tmp_path / "l2"))  # what a SLURM requeue runs
    assert f"resuming from {ck}/step_{k:06d}" in (tmp_path / "l2" / "rank0.log").read_text()
    close(losses(out), ref, 1e-6, range(1, 9))  # the branch retrained steps 5-8 exactly


# --- the time limit -------------------------------------------------------------------------------------------

def test_deadline_needs_one_step_and_one_save():
    d = Deadline(time_limit_s=1000, now=0)
    assert d.end == 1000 and not d.near(now=0)
    d.record_step(40)
    assert d.needed_s() == 40 + SAVE_GUESS_S + MARGIN_S  # no save measured yet: the guess stands in
    d.record_save(100)
    d.record_step(20)  # the longest step counts
    assert d.needed_s() == 40 + 100 + MARGIN_S
    assert not d.near(now=1000 - 171) and d.near(now=1000 - 169)
    assert Deadline().end is None and not Deadline().near()


def test_deadline_counts_the_evaluation_and_the_next_build():
    """The work ahead of a check counts: the stage's evaluation after its last step (one step's time until one
    evaluation is measured), the next stage's engine build before it starts."""
    d = Deadline(time_limit_s=1000, now=0)
    d.record_step(40)
    d.record_save(100)
    assert d.evaluation_s() == 40  # not measured yet: one step
    d.record_eval(200)
    d.record_build(160)
    assert d.needed_s(ahead_s=d.evaluation_s()) == 40 + 100 + MARGIN_S + 200
    now = 1000 - (40 + 100 + MARGIN_S + 150)  # enough for a step and a save, not for the evaluation too
    assert not d.near(now=now) and d.near(now=now, ahead_s=d.evaluation_s())
    assert d.near(now=now, ahead_s=d.build_s)


def test_save_interval_is_rank0s_clock():
    import time

    flag = PreemptionFlag(None, save_every_s=0.05)
    assert not flag.agreed() and not flag.save_due
    time.sleep(0.06)
    assert not flag.agreed() and flag.save_due
    flag.saved()
    assert not flag.save_due
    flag.agreed()
    assert not flag.save_due
    with pytest.raises(ValueError, match="save_interval_minutes"):
        parse_config(["--save_interval_minutes", "-1"])


@pytest.mark.slow  # ~90 s; the deadline rule is test_deadline_* (fast), the requeue chain is test_launch_e2e
@pytest.mark.parametrize("how", ["time_limit_s", "SLURM_JOB_END_TIME"])
def test_time_limit_stops_with_a_save(assets, tmp_path, how):
    """30 s more than one (guessed) save needs: the run, whose step budget it could never finish, stops by itself
    about 30 s after its start, commits the step it reached and exits 75 (requeue); the next job continues. Only
    start-up slower than 30 s would make it stop before its first step (k = 0), still with exit 75."""
    import time

    out, steps, limit = tmp_path / "out", 100_000, SAVE_GUESS_S + MARGIN_S + 30
    args = train_args(assets, out, 2, steps=steps)
    env = {"SLURM_JOB_END_TIME": str(int(time.time() + limit))} if how == "SLURM_JOB_END_TIME" else None
    codes = run(TRAIN, [*args, "--time_limit_s", str(limit)] if env is None else args, 2, str(tmp_path / "l1"),
                expect=None, extra_env=env)
    assert codes == [75, 75]
    k = max(losses(out), default=0)
    # each rank votes from its own clock: the first to reach the limit logs the time limit, the other "on another
    # rank" (rank 1 once stopped first in CI); every rank's own log (OUTPUT_DIR/logs) says which
    logs = [(out / "logs" / f"rank{r:05d}.log").read_text() for r in range(2)]
    assert k < steps and any("preempted (time limit" in log for log in logs), logs
    if k:
        assert (out / "checkpoints" / "LATEST").read_text().strip() == f"step_{k:06d}"
        assert (out / "checkpoints" / f"step_{k:06d}" / "MANIFEST.json").exists()
    resumed = [*args[: args.index("--max_steps")], "--max_steps", str(k + 2), *args[args.index("--max_steps") + 2:]]
    run(TRAIN, resumed, 2, str(tmp_path / "l2"))  # the requeued job (no limit) continues where it stopped
    assert sorted(losses(out)) == list(range(1, k + 3))


# --- shared output folder --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [pytest.param("shared", marks=pytest.mark.slow), "blind",
                                  pytest.param("late", marks=pytest.mark.slow)])  # ~20-40 s each
def test_output_folder_must_be_shared(tmp_path, mode):
    """Rank 1 cannot see rank 0's files (simulated): every rank stops with one line naming the host; a shared
    folder passes and leaves no probe behind, also when rank 1 sees the others' files only 2 s late (a lagging
    NFS cache: looked for again, by name, within the settle time)."""
    out = tmp_path / "out"
    arg = {"shared": "0", "blind": "1", "late": "late"}[mode]
    run(os.path.join(ROOT, "tests/workers/shared_fs.py"), [str(out), arg], 2, str(tmp_path / "l"))
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2)]
    if mode == "blind":
        for r in results:
            assert "is not shared" in r["error"] and "ranks [0]" in r["error"], r
    else:
        assert results == [{"error": None}, {"error": None}]
        assert os.listdir(out) == []
