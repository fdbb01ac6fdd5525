"""The save defaults (issue 35): `async_save: auto` (on for a GPU run whose nodes' host memory fits the snapshot,
decided once by the start-up checks) and `save_interval_minutes: auto` (9 minutes, stretched to 100 x the last
save's blocked seconds so saves never block the steps more than 1%). Old configs (bools, minutes) keep working;
a bad value is one line naming it. Pure unit tests, single process."""

from __future__ import annotations

import time

import pytest

from base.parallel import ParallelDims
from planner.cluster import RUNTIME_HOST_GIB
from training import preflight
from training.config import parse_config
from training.curriculum import resolve_stages
from training.preemption import (
    AUTO_SAVE_EVERY_S,
    MARGIN_S,
    MAX_SAVE_OVERHEAD,
    SAVE_GUESS_S,
    Deadline,
    PreemptionFlag,
    auto_save_every_s,
)
from training.startup import save_every_s

GiB = 2**30
OUT = ["--output_dir", "/tmp/unused"]


def test_async_save_setting_old_and_new_forms():
    assert parse_config(OUT).async_save == "auto"
    assert parse_config([*OUT, "--async_save"]).async_save is True  # the bare flag of before
    assert parse_config([*OUT, "--no-async_save"]).async_save is False
    for text, want in (("true", True), ("False", False), ("auto", "auto"), ("on", True), ("0", False)):
        assert parse_config([*OUT, "--async_save", text]).async_save == want
    with pytest.raises(ValueError, match=r"^--async_save 'maybe': use auto \(on for a GPU run .*\), true or false$"):
        parse_config([*OUT, "--async_save", "maybe"])


def test_save_interval_setting_old_and_new_forms():
    assert parse_config(OUT).save_interval_minutes == "auto"
    assert parse_config([*OUT, "--save_interval_minutes", "AUTO"]).save_interval_minutes == "auto"
    assert parse_config([*OUT, "--save_interval_minutes", "9"]).save_interval_minutes == 9.0
    assert parse_config([*OUT, "--save_interval_minutes", "0"]).save_interval_minutes == 0.0  # off
    for bad in ("-1", "soon"):
        with pytest.raises(ValueError, match=f"^--save_interval_minutes '?{bad}(\\.0)?'?: use auto .* 0 \\(off\\)"):
            parse_config([*OUT, "--save_interval_minutes", bad])


def test_auto_interval_keeps_saves_under_one_percent():
    """9 minutes (lost work <= 10 minutes with a write <= 60 s) until a save is measured and while saves block
    <= 5.4 s; beyond, 100 x the blocked seconds."""
    assert auto_save_every_s(None) == AUTO_SAVE_EVERY_S == 540
    assert auto_save_every_s(0.8) == 540  # async, Llama-3-8B on 32 ranks (projected): 0.15% of the time
    assert auto_save_every_s(5.4) == pytest.approx(540)
    sync = 95.0  # synchronous save, same run (projected): every 9 minutes would block 18% of the time
    assert auto_save_every_s(sync) == sync / MAX_SAVE_OVERHEAD == 9500
    for blocked in (0.3, 6.0, 9.8, 95.0):
        assert blocked / auto_save_every_s(blocked) <= 0.01 + 1e-12 and auto_save_every_s(blocked) >= 540


def test_flag_interval_follows_the_last_measured_save():
    flag = PreemptionFlag(None, save_every_s=save_every_s(parse_config(OUT)))
    assert flag.auto_interval and flag.save_every_s == 540
    flag.saved(95.0)  # a synchronous save held the steps 95 s
    assert flag.save_every_s == 9500
    flag.saved(None)  # a save unlike the periodic ones (a stage's synchronous end under async): no new measurement
    assert flag.save_every_s == 9500
    flag.saved(0.8)
    assert flag.save_every_s == 540
    fixed = PreemptionFlag(None, save_every_s=save_every_s(parse_config([*OUT, "--save_interval_minutes", "0.001"])))
    fixed.saved(95.0)  # minutes given: they stay
    assert not fixed.auto_interval and fixed.save_every_s == pytest.approx(0.06)
    time.sleep(0.07)
    assert not fixed.agreed() and fixed.save_due  # ... and the due vote still runs on them


def reports(*mem: int) -> list[dict]:
    return [{"host": "node0", "mem_available": m, "memlock": None, "locks": []} for m in mem]


NEED = {"bytes": 10 * GiB, "pinned": 10 * GiB, "stage": "stage 0 (s128k)", "what": "offloaded optimizer, async save"}


def test_auto_async_decision():
    on, line = preflight.auto_async(reports(50 * GiB, 50 * GiB), NEED, cpu_run=False)
    assert on and line.startswith("async_save auto: on (stage 0 (s128k) holds 10.00 GiB")
    on, line = preflight.auto_async(reports(50 * GiB, 15 * GiB), NEED, cpu_run=False)  # 2 ranks x 10 > 15 GiB
    assert not on and "host memory: node0 has 15.0 GiB available" in line and line.endswith("--async_save true forces it")
    on, line = preflight.auto_async(reports(50 * GiB), None, cpu_run=False)
    assert not on and "cannot size the snapshot" in line
    on, line = preflight.auto_async(reports(50 * GiB), NEED, cpu_run=True)
    assert not on and "CPU run" in line
    for _, line in (preflight.auto_async(reports(m), n, c) for m, n, c in ((50 * GiB, NEED, False), (1, NEED, False))):
        assert "\n" not in line


def test_preflight_resolves_auto_into_the_config(monkeypatch, capsys):
    """The start-up checks replace `auto` with their decision (rank 0's, broadcast by run_on_main), on a GPU run:
    on where the node holds the snapshot too, off with one line where it holds only the training, refused as
    before where it holds neither; `true` is kept (and checked with the snapshot)."""
    from model_utils.build import load_hf_config

    cfg = parse_config([*OUT, "--max_seq_length", "256"])
    arch = load_hf_config(cfg.model_name_or_path).get_text_config()
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 1)
    configs = preflight.check_stage_configs(cfg, stages, 1, bf16=True, hidden_size=arch.hidden_size)
    without, with_ = (preflight.host_need(cfg, stages, 1, True, configs, arch, False, a)["bytes"] for a in (False, True))
    assert with_ > without
    monkeypatch.setattr(preflight, "no_gpu", lambda: False)
    monkeypatch.setattr(preflight, "build_locks", lambda ext_dir=None: [])
    monkeypatch.setattr(preflight, "check_stage_configs", lambda *a, **k: configs)  # built above (~0.5 s each)
    monkeypatch.setattr(preflight, "rss_bytes", lambda: int(RUNTIME_HOST_GIB * 2**30))  # the runtime held already: the snapshot decides
    dims = ParallelDims(world=1, sp=1, rank=0, local_rank=0)
    for setting, available, want in (("auto", with_, True), ("auto", (with_ + without) // 2, False),
                                     ("auto", without // 2, "refused"), (True, (with_ + without) // 2, "refused"),
                                     (False, (with_ + without) // 2, False)):
        monkeypatch.setattr(preflight, "mem_available_bytes", lambda path=None, a=available: a)
        cfg.async_save = setting
        capsys.readouterr()
        if want == "refused":
            with pytest.raises(ValueError, match="^host memory: "):
                preflight.preflight(cfg, stages, dims, arch, bf16=True)
            continue
        preflight.preflight(cfg, stages, dims, arch, bf16=True)
        assert cfg.async_save is want, (setting, available)
        said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("async_save auto")]
        assert len(said) == (setting == "auto") and (not said or said[0].startswith(f"async_save auto: {'on' if want else 'off'}"))


def test_time_limit_counts_a_background_write_in_flight():
    """A stop with a background write in flight saves after that write: the time-limit stop reserves one save more,
    the measured one (snapshot to commit), or SAVE_GUESS_S before the first background save commits (it was 0)."""
    d = Deadline(time_limit_s=2000, now=0)
    d.record_step(40)
    assert d.ahead_s(stage_ends=False, write_in_flight=False) == 0
    first = d.ahead_s(stage_ends=False, write_in_flight=True)
    assert first == SAVE_GUESS_S  # nothing measured yet: the write in flight is not free
    assert d.near(now=2000 - (40 + 2 * SAVE_GUESS_S + MARGIN_S) + 1, ahead_s=first)
    d.record_save(100)  # that write committed after 100 s
    d.record_eval(7)
    assert d.ahead_s(stage_ends=True, write_in_flight=True) == 7 + 100
    assert d.ahead_s(stage_ends=True, write_in_flight=False) == 7


def test_the_sigterm_window_is_agreed_not_a_ranks_own_clock(monkeypatch):
    """A rank with no SIGTERM of its own (or a later one) takes the window of the rank signalled first, and the save
    time to count is the largest any rank holds: both travel in the check's one all-reduce (MAX). A later SIGUSR1
    (launch.sh turns its own SIGTERM into one) does not undo the window; SIGUSR1 alone has none (a full save)."""
    import signal
    import types

    from training import preemption

    clock = {"t": 100.0}
    monkeypatch.setattr(preemption, "time", types.SimpleNamespace(monotonic=lambda: clock["t"], time=time.time))
    monkeypatch.delenv("KILL_WINDOW_S", raising=False)
    other = {"votes": [0.0, 0.0, preemption.NO_WINDOW, 0.0]}  # the other rank's, as it would contribute them
    real = preemption.comm.all_reduce
    monkeypatch.setattr(preemption.comm, "all_reduce",
                        lambda v, op="sum": real([max(a, b) for a, b in zip(v, other["votes"])], op=op))
    flag = PreemptionFlag(None)
    flag.deadline.record_save(12.0)
    assert not flag.agreed() and flag.window_left_s is None
    other["votes"] = [1.0, 0.0, (100.0 - 90.0) - 30.0, 40.0]  # SIGTERM there 10 s ago; its measured save 40 s
    assert flag.agreed() and flag.window_left_s == pytest.approx(20.0) and flag.save_need_s == 40.0
    flag._handler(signal.SIGTERM, None)  # ours now: the earlier one still decides
    clock["t"] = 105.0
    other["votes"][2] = (105.0 - 90.0) - 30.0
    flag._handler(signal.SIGUSR1, None)
    assert flag.agreed() and flag.window_left_s == pytest.approx(15.0) and flag.term_at == 100.0
    usr1 = PreemptionFlag(None)
    usr1._handler(signal.SIGUSR1, None)
    other["votes"] = [0.0, 0.0, preemption.NO_WINDOW, 0.0]
    assert usr1.agreed() and usr1.window_left_s is None
    monkeypatch.setenv("KILL_WINDOW_S", "120")  # torchrun --shutdown-timeout 120
    assert PreemptionFlag(None).window_s == 120.0
