"""base/progress.py: a hang found from progress on rank 0's clock. A rank whose marks stop for longer than its
phase's bound (2 x the longest that phase lasted, at least MIN_S; FIRST_S before it was measured) is named with its
host, the rank that is behind when the others wait for it in a collective; an evaluation is judged by its forwards'
layer ticks, a restore at its own large floor; an engine's build (a conversion) and a stop's teardown are never judged;
a suspended job's late poll restarts the clocks."""

from __future__ import annotations

from base.progress import Tracker

HOSTS = ["n0", "n0", "n1", "n1"]


def run(tracker: Tracker, until: float, values_at) -> tuple[float, str] | None:
    t = 0.0
    while t <= until:
        line = tracker.observe(t, values_at(t), HOSTS)
        if line:
            return t, line
        t += 10.0
    return None


def steps(t: float, hung: int | None = None, at: float = 1e9, step_s: float = 60.0) -> list[str]:
    """Four ranks marking forward, backward, optimizer each third of a step_s step; `hung` stops in its data phase of
    the step after `at` while the others go on into that step's forward (a collective that waits for it)."""
    out = []
    for r in range(4):
        now = min(t, at) if r == hung else t
        step, part = int(now // step_s) + 1, int((now % step_s) // (step_s / 3))
        count = 4 * (step - 1) + part + 1
        phase = ("forward", "backward", "optimizer")[part]
        if r == hung and t >= at:
            step, count, phase = step + 1, 4 * step, "data"
        elif hung is not None and t >= at:
            step, count, phase = int(at // step_s) + 2, 4 * int(at // step_s + 1) + 1, "forward"
        out.append(f"{count} {step} {phase}")
    return out


def test_a_rank_that_stops_is_named_within_its_bound():
    tracker = Tracker(4, min_s=60.0, first_s=600.0)
    got = run(tracker, 5000, lambda t: steps(t, hung=2, at=1200.0))
    assert got is not None
    t, line = got
    assert line.startswith("rank 2 (n1) hung: no progress for ") and "in data of step 22" in line, line
    assert "behind 3 other rank(s) stopped waiting for it" in line
    assert 1200 + 60 < t <= 1200 + 600 + 20, (t, line)  # the data phase never measured: FIRST_S


def test_a_measured_phase_is_judged_at_twice_its_longest():
    tracker = Tracker(4, min_s=30.0, first_s=600.0)
    frozen = ["9 3 forward"] * 4
    got = run(tracker, 4000, lambda t: steps(t) if t < 1200 else ["1000 99 backward"] + frozen[1:])
    t, line = got
    assert "bound 40 s passed after 50 s: 2 x the longest " in line, line  # each phase lasted 20 s: 40 s
    assert line.startswith("rank 1 (n0) hung: no progress for "), line


def test_the_rank_behind_is_named_when_its_mark_arrived_a_poll_after_the_waiting_ranks():
    """The race a clean-clone make test lost (tests/e2e/test_failure.py's hung rank): rank 1 hangs in the data phase
    of step 3, and its mark reaches the store a poll after rank 0's forward mark of step 3 (rank 0 waits for it in
    the collective). Both phases are unmeasured (one bound): rank 0 passes it first. The rank behind is rank 1, not
    the waiting rank 0 (the old rule kept only ranks that stopped no later than the stalled one)."""
    tracker = Tracker(2, min_s=5.0, first_s=20.0)

    def values(t: float) -> list[str]:
        if t < 100.0:
            return ["4 2 optimizer", "4 2 optimizer"] if int(t) % 2 else ["3 2 backward", "3 2 backward"]
        return ["6 3 forward", "5 3 data" if t >= 101.0 else "4 2 optimizer"]

    got = None
    t = 0.0
    while got is None and t < 300:
        got = tracker.observe(t, values(t), ["n0", "n1"])
        t += 1.0
    assert got is not None and got.startswith("rank 1 (n1) hung: no progress for "), got
    assert "in data of step 3, behind 1 other rank(s) stopped waiting for it" in got, got
    assert tracker.named == 1


def test_a_build_and_a_stops_teardown_are_never_judged():
    tracker = Tracker(4, min_s=10.0, first_s=20.0)
    assert run(tracker, 10000, lambda t: ["5 3 idle", "5 3 idle", "4 3 build", "4 3 build"]) is None


def test_a_rank_stuck_in_the_stages_evaluation_is_named_at_the_forwards_floor():
    """Steps trained (a forward's longest stretch 20 s), then the stage's evaluation: rank 1 stuck in a kernel, the
    others tick through their eval forwards' layers and block in its collective. Judged at 2 x the forward's longest,
    at least MIN_S (300 s), and rank 1 named; evaluation used to be `idle`, never judged: every rank waited for
    dist_timeout_s (1800 s), then NCCL raised on a waiting rank (as an unmeasured phase: FIRST_S, 1200 s)."""
    tracker = Tracker(4, min_s=300.0, first_s=1200.0)

    def values(t: float) -> list[str]:
        if t < 600:
            return steps(t, step_s=60.0)
        if t < 650:  # every rank enters the evaluation; the others tick their layers' forwards until t = 650
            return ["41 10 eval"] * 4
        return ["41 10 eval" if r == 1 else f"{41 + int(min(t, 700.0) - 640) // 10} 10 eval" for r in range(4)]

    got = run(tracker, 3000, values)
    assert got is not None, got
    t, line = got
    assert line.startswith("rank 1 (n0) hung: no progress for ") and "in eval of step 10" in line, line
    assert "eval's bound 300 s passed" in line and "at least 300 s" in line, line
    assert 600 + 300 < t <= 600 + 300 + 20, (t, line)


def test_an_evaluation_stuck_before_any_layer_ticks_is_judged_by_the_forwards_measure():
    """Every rank blocked in the evaluation's first collective (ZeRO-3's gather of the embedding, before any decoder
    layer ticks) while one is stuck: `eval` not measured yet, its forwards' ticks are the training forward's, so its
    bound is that one's (2 x 20 s, at least MIN_S), not FIRST_S; a hang none is behind in names no rank."""
    tracker = Tracker(4, min_s=300.0, first_s=1200.0)
    got = run(tracker, 3000, lambda t: steps(t, step_s=60.0) if t < 600 else ["41 10 eval"] * 4)
    assert got is not None and 600 + 300 < got[0] <= 600 + 300 + 20, got
    assert "hung together" in got[1] and "2 x the longest forward measured, 20 s, at least 300 s" in got[1], got
    assert tracker.named is None


def test_a_restore_is_judged_at_its_own_large_floor():
    """Every rank reads its part of the checkpoint at once, without a tick: a restore slower than MIN_S is no hang,
    one past RESTORE_S is (a rank stuck on a hung mount, the others in the restore's collective), before
    dist_timeout_s. It used to be `build`, never judged."""
    tracker = Tracker(2, min_s=300.0, first_s=1200.0, restore_s=1500.0)
    assert run(tracker, 1490, lambda t: ["1 0 restore", "1 0 restore"]) is None
    got = run(Tracker(2, min_s=300.0, first_s=1200.0, restore_s=1500.0), 3000, lambda t: ["1 0 restore", "2 0 restore"])
    assert got is not None and 1500 < got[0] <= 1520, got
    assert "restore's bound 1500 s passed" in got[1], got


def test_a_suspended_job_is_not_a_hang():
    tracker = Tracker(4, min_s=10.0, first_s=20.0)
    values = ["1 1 forward"] * 4
    assert tracker.observe(0.0, values, HOSTS) is None
    assert tracker.observe(10.0, values, HOSTS) is None
    assert tracker.observe(3600.0, values, HOSTS) is None  # an hour stopped (scontrol suspend): clocks restart
    assert tracker.observe(3610.0, ["2 1 backward"] * 4, HOSTS) is None


def test_the_hung_ranks_node_is_named_for_the_requeue(tmp_path):
    """slurm.sbatch reads the lost nodes from LAUNCH_LOST_FILE: rank 9 at 8 ranks per node is node 1; a hang every rank
    shares names none."""
    from base.progress import record_node

    tracker = Tracker(4, min_s=60.0, first_s=600.0)
    run(tracker, 5000, lambda t: steps(t, hung=2, at=1200.0))
    assert tracker.named == 2
    lost = tmp_path / "lost"
    assert record_node(9, 8, str(lost)) and lost.read_text() == "1\n"
    assert not record_node(9, 0, str(tmp_path / "unknown"))  # node size unknown: nothing named
    together = Tracker(2, min_s=10.0, first_s=20.0)
    assert run(together, 1000, lambda t: ["1 1 forward"] * 2).__getitem__(1).startswith("ranks 0-1 hung together")
    assert together.named is None


def test_the_main_threads_error_after_a_declared_hang_exits_with_the_hangs_code(monkeypatch, capsys):
    """The race a clean-clone make test lost: rank 0's monitor declares rank 1 hung and tells the others; rank 1 leaves,
    so rank 0's main thread, blocked in the collective, raises 'Connection closed by peer' and used to exit 1 before
    the monitor's own exit 69. The main thread's failure path now ends with the hang's code and names it."""
    from base import progress
    from training import job

    monkeypatch.setattr(progress, "DECLARED", "rank 1 (vm) hung: no progress for 60 s in data of step 3")
    waited = []  # it then waits for the monitor's own exit (a return raced it into the interpreter's shutdown: -6)
    monkeypatch.setattr(job, "_await_monitor_exit", lambda: waited.append(True))
    code = job._fail(RuntimeError("Connection closed by peer [127.0.0.1]:29384"))
    assert code == job.EXIT_PEER_LOST == 69 and waited == [True]
    assert "the first failure of the job: rank 1 (vm) hung" in capsys.readouterr().err


def _ticks(model, batch) -> list[int]:
    """The counter after the forward and after the backward of one step of `model`, marks on (a started publisher
    stood in by the module's state: nothing is published)."""
    import torch

    from base import progress

    progress._MINE.clear()
    progress._MINE.update(count=0, step=3, value="0 3 forward")
    try:
        loss = model(**batch).logits.float().pow(2).mean()
        after_forward = progress._MINE["count"]
        progress._MINE["value"] = f"{after_forward} 3 backward"
        loss.backward()
        assert progress._MINE["value"].endswith(" 3 backward"), progress._MINE  # the phase kept, only the counter moves
        return [after_forward, progress._MINE["count"] - after_forward]
    finally:
        progress._MINE.clear()
        torch.manual_seed(0)


def test_every_layer_ticks_in_the_forward_and_in_the_backward_with_or_without_checkpointing():
    """A phase at 1M tokens (a ~13-min backward) is judged by its longest layer: each decoder layer moves the counter
    at its forward and again in the backward (the gradient of its output, or its recompute under checkpointing)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from base import progress

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2)
    batch = {"input_ids": torch.randint(0, 64, (1, 16))}
    # one backward tick per layer: its output's gradient, or under checkpointing (reentrant, or model_utils/memory.py's
    # non-reentrant) its recompute
    for checkpointing in (None, {"use_reentrant": True}, {"use_reentrant": False}):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        assert progress.watch_layers(model.get_decoder().layers) == 6
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)  # as model_utils/memory
            model.train()
        fwd, bwd = _ticks(model, batch)
        assert fwd == 3, (checkpointing, fwd)
        assert bwd == 3, (checkpointing, bwd)
    progress._MINE.update(off=True)  # marks off (a world of one): a tick changes nothing
    try:
        progress.tick()
        assert "count" not in progress._MINE
    finally:
        progress._MINE.clear()
