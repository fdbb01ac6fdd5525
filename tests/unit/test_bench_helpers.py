"""The benchmarks' own bookkeeping (bench/): what a failed launch's record says, the paired-ratio summary the
tokens/s claims against the HF integration (docs/results/peers.md) rest on, and the planner calibration's pass
line (bench/calibration.py)."""

from __future__ import annotations

import copy
import json
import math

from bench import calibration as cal
from bench import harness as h
from bench import peers as bp
from bench import peers_same_memory as sm

LAUNCHER_EXIT = ("[2026-11-23 15:34:27,800] [ERROR] [launch.py:259:sigkill_handler] ['/venv/bin/python3', '-u', "
                 "'x.py', '--local_rank=1'] exits with return code = {}\n")


def _error(tmp_path, text: str) -> str:
    log = tmp_path / "launch.log"
    log.write_text(text)
    return h.launch_failure(str(log))["error"]


def test_error_line_names_the_rank_exception_behind_torch_prefix(tmp_path):
    text = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 3, in <module>\n"
            "[rank1]: RuntimeError: Connection reset by peer\n" + LAUNCHER_EXIT.format(1))
    assert _error(tmp_path, text) == "RuntimeError: Connection reset by peer"


def test_error_line_prefers_train_py_one_line_error(tmp_path):
    text = "[0]: error: --max_seq_length 3 must be a multiple of 2\n" + LAUNCHER_EXIT.format(2)
    assert _error(tmp_path, text) == "error: --max_seq_length 3 must be a multiple of 2"


def test_error_line_without_exception_gives_exit_code_and_last_output(tmp_path):
    text = "step 1 tok/s 4000\n[2026-11-23] [INFO] [launch.py:253:sigkill_handler] Killing subprocess 7\n" + \
        LAUNCHER_EXIT.format(-9)
    assert _error(tmp_path, text) == "a rank exited with return code -9; its last output: step 1 tok/s 4000"


def test_log_tail_keeps_the_last_lines(tmp_path):
    log = tmp_path / "launch.log"
    log.write_text("".join(f"line {i}\n" for i in range(50)))
    assert h.launch_failure(str(log), tail=3)["log_tail"] == ["line 47", "line 48", "line 49"]


def test_ratio_summary_geomean_interval_and_count():
    r = bp.ratio_summary([2.0, 0.5, 1.0, 1.0])
    assert r["n"] == 4 and r["geomean_ratio"] == 1.0 and r["rounds_ours_at_least_as_fast"] == 3
    lo, hi = r["ci95"]
    assert 0.5 <= lo < 1.0 < hi <= 2.0
    same = bp.ratio_summary([1.02] * 5)  # no spread: the interval collapses onto the value
    assert same["ci95"] == [1.02, 1.02] and same["rounds_ours_at_least_as_fast"] == 5
    faster = bp.ratio_summary([1.03, 1.01, 1.05, 1.02, 1.04, 1.02])
    assert faster["ci95"][0] > 1.0 and math.isclose(faster["geomean_ratio"], 1.028, abs_tol=1e-3)


def test_neighbours_step_one_feature_or_one_checkpoint_count():
    # 4 layers: auto's checkpoint counts are 4, 2, 1, 0 layers (K = 1, 2, 4, none)
    assert sorted(sm.neighbours((False, True, 2, False, False), 4)) == sorted(
        [(True, True, 2, False, False), (False, False, 2, False, False), (False, True, 1, False, False),
         (False, True, 4, False, False), (False, True, 2, False, True)])  # + keep_attention toggled
    assert sorted(sm.neighbours((False, False, 0, False, False), 4)) == sorted(
        [(True, False, 0, False, False), (False, True, 0, False, False), (False, False, 4, False, False)])


def _fake_world(cap_by_cfg: dict, speed_by_cfg: dict, auto_pick):
    """Runners of a synthetic machine: peak = per-config GiB per 1k tokens x L/1000 (default 0.2), speed fixed
    per config (default 100)."""
    calls = []

    def rec(L, peak, tps, **kw):
        return {"ok": True, "seq_len": L, "peak_mem_gb": peak, "tokens_per_s": tps, "load_after": 0.0, **kw}

    def run_ours(L, key):
        calls.append(("ours", L, key))
        if key is None:
            k = auto_pick(L)
            if k is None:
                return {"ok": False, "seq_len": L, "error": "nothing fits", "load_after": 0.0}
            tl, tm, every, off, keep = k
            choice = {"tiled_logits": tl, "tiled_mlp": tm, "checkpoint_every": every, "offload_activations": off,
                      "keep_attention": keep}
            return rec(L, cap_by_cfg.get(k, 0.2) * L / 1000, speed_by_cfg.get(k, 100.0), memory_choice=choice)
        return rec(L, cap_by_cfg.get(key, 0.2) * L / 1000, speed_by_cfg.get(key, 100.0))

    def run_hf(L, gc):
        calls.append(("hf", L, gc))
        return rec(L, (0.05 if gc else 0.2) * L / 1000, 80.0 if gc else 100.0)

    return run_ours, run_hf, calls


def test_same_memory_picks_measures_and_stops():
    NONE, ALL = sm.NONE, sm.ALL
    TM = (False, True, 0, False, False)
    TM_C4 = (False, True, 4, False, False)  # checkpoint 1 layer in 4
    TL_TM_C4 = (True, True, 4, False, False)
    peak = {NONE: 0.2, TM: 0.11, TM_C4: 0.08, ALL: 0.04, (True, True, 0, False, False): 0.099, (False, True, 2, False, False): 0.06,
            TL_TM_C4: 0.079, (False, False, 4, False, False): 0.15}
    speed = {NONE: 120.0, TM: 110.0, TM_C4: 104.0, ALL: 60.0, (True, True, 0, False, False): 108.0,
             (False, True, 2, False, False): 90.0, TL_TM_C4: 112.0, (False, False, 4, False, False): 112.0}

    def auto(L):  # right at 4k and 8k; at 10k its neighbour with tiled logits too is measured 8% faster
        return {4000: NONE, 8000: TM, 10000: TM_C4, 30000: None}[L]

    run_ours, run_hf, calls = _fake_world(peak, speed, auto)
    saved = []  # what the run writes after each length (a ladder stopped by a time limit keeps those)
    res = sm.same_memory([4000, 8000, 10000, 30000], cap=1.0, layers=4, rounds=2, tol=0.05,
                         run_ours=run_ours, run_hf=run_hf, on_row=lambda x: saved.append(copy.deepcopy(x)))
    assert [[r["seq_len"] for r in x["rows"]] for x in saved] == [[4000], [4000, 8000], [4000, 8000, 10000],
                                                                  [4000, 8000, 10000, 30000]]
    assert saved[-1] == res
    rows = {r["seq_len"]: r for r in res["rows"]}
    assert rows[4000]["hf_pick"] == "none" and rows[8000]["hf_pick"] == "gradient_checkpointing"
    assert ("hf", 8000, False) in calls and ("hf", 10000, False) not in calls  # over the cap at 8k: not rerun
    assert ("ours", 4000, sm.HF_ALGO) in calls and "ckpt/1" in rows[4000]["ours"]  # HF's algorithm, run by ours
    assert rows[4000]["choice_is_fastest"] and rows[8000]["choice_is_fastest"]
    assert rows[10000]["fastest_measured"] == "tiled_logits+tiled_mlp+ckpt/4" and not rows[10000]["choice_is_fastest"]
    assert not rows[10000]["choice_is_fastest_with_headroom"]  # that one peaked 21% under the cap: a real miss
    assert rows[10000]["faster_under_cap"] == [{"setting": "tiled_logits+tiled_mlp+ckpt/4", "speed_vs_choice": 1.077,
                                                "peak_gb": 0.79, "below_cap": 0.21}]
    again = sm.summarize_same_memory(res["rows"], cap=1.0, tol=0.1)  # --resummarize: another tolerance, no rerun
    assert again["choice_fastest"]["fastest"] == 3 and again["rows"][2]["faster_under_cap"] == []
    assert res["choice_fastest"] == {"tolerance": 0.05, "lengths": 3, "fastest": 2, "share": 0.667}
    assert rows[8000]["paired"]["median_ratio"] == round(110 / 80, 3) and len(rows[8000]["paired"]["rounds"]) == 2
    assert res["ratio_where_hf_needs_checkpointing"] == {"8000": 1.375, "10000": 1.3}
    assert res["ratio_where_hf_fits_without"] == {"4000": 1.2}
    assert res["longest_under_cap"] == {"ours_auto": 10000, "ours_all_features": 10000, "hf_best": 10000}
    assert res["auto_over_cap"] == 0 and rows[30000]["auto_refused"] and res["rows"][-1]["seq_len"] == 30000
    assert "refused" in sm.same_memory_table(res, 1.0)


def test_same_memory_judges_with_and_without_auto_headroom():
    TM, TL_TM = (False, True, 0, False, False), (True, True, 0, False, False)
    # at 4k: none peaks at 0.96 GiB (under the 1.0 cap but inside auto's 10% headroom) and runs 1.1x faster than
    # the choice (tiled MLP, 0.8 GiB); tiled logits + MLP at 0.84 GiB is no faster than the choice
    run_ours, run_hf, _ = _fake_world({sm.NONE: 0.24, TM: 0.2, TL_TM: 0.21, (False, True, 4, False, False): 0.15},
                                      {sm.NONE: 110.0, TM: 100.0, TL_TM: 101.0}, lambda L: TM)
    res = sm.same_memory([4000], cap=1.0, layers=4, rounds=0, tol=0.05, run_ours=run_ours, run_hf=run_hf)
    row = res["rows"][0]
    assert row["fastest_measured"] == "none" and not row["choice_is_fastest"]  # strict: a miss
    assert row["choice_is_fastest_with_headroom"]  # none left no 10% free: auto refuses it on purpose
    assert res["choice_fastest"]["fastest"] == 0 and res["choice_fastest_with_headroom"]["fastest"] == 1
    assert "10% headroom free: 1 of 1" in sm.same_memory_table(res, 1.0)


def test_same_memory_counts_an_auto_run_over_the_cap():
    TM = (False, True, 0, False, False)
    run_ours, run_hf, _ = _fake_world({TM: 0.2, sm.NONE: 0.3, sm.ALL: 0.05, (True, True, 0, False, False): 0.2,
                                       (False, False, 0, False, False): 0.3, (False, True, 4, False, False): 0.1},
                                      {TM: 1.0, sm.NONE: 1.0, sm.ALL: 1.0, (True, True, 0, False, False): 1.0,
                                       (False, True, 4, False, False): 1.0}, lambda L: TM)
    res = sm.same_memory([6000], cap=1.0, layers=4, rounds=1, tol=0.05, run_ours=run_ours, run_hf=run_hf)
    assert res["auto_over_cap"] == 1 and res["longest_under_cap"]["ours_auto"] is None


def test_recheck_judges_a_single_launch_miss_on_paired_rounds():
    """A contender that one launch measured 8% faster is rerun against the choice AB/BA: here it is really 2%
    slower, so the paired judgement counts the choice as the fastest; a real miss stays a miss."""
    NONE, TM, TL_TM = sm.NONE, (False, True, 0, False, False), (True, True, 0, False, False)
    peak = {NONE: 0.2, TM: 0.11, TL_TM: 0.099}
    speed = {NONE: 120.0, TM: 110.0, TL_TM: 118.8}  # the single launches: tiled logits + MLP looks 8% faster
    run_ours, run_hf, calls = _fake_world(peak, speed, lambda L: TM)
    res = sm.same_memory([8000], cap=1.0, layers=4, rounds=0, tol=0.05, run_ours=run_ours, run_hf=run_hf)
    res["cap_gb"] = 1.0  # as the JSON of a run has it
    assert res["choice_fastest"]["fastest"] == 0 and res["choice_fastest_paired"]["fastest"] == 0
    speed[TL_TM] = 107.8  # what paired launches measure
    calls.clear()
    res = sm.recheck(res, rounds=3, tol=0.05, run_ours=run_ours)
    assert [c[2] for c in calls] == [TM, TL_TM, TL_TM, TM, TM, TL_TM]  # AB, BA, AB
    (rc,) = res["rows"][0]["recheck"]
    assert rc["contender"] == "tiled_logits+tiled_mlp" and rc["median_ratio"] == round(110 / 107.8, 3)
    assert res["choice_fastest"]["fastest"] == 0 and res["choice_fastest_paired"]["fastest"] == 1
    assert "recheck at 8000" in sm.same_memory_table(res, 1.0)
    speed[TL_TM] = 125.0  # really faster: still a miss
    assert sm.recheck(res, rounds=2, tol=0.05, run_ours=run_ours)["choice_fastest_paired"]["fastest"] == 0


def _cal_point(name: str, ratio: float | None, ok: bool = True) -> dict:
    p = {"name": name, "features": [], "seq_len": 8192, "ok": ok, "predicted_gb": 0.5}
    if ok:
        p |= {"peak_gb": 1.0, "measured_gb": 0.5 / ratio if ratio else -0.1, "ratio": ratio}
    else:
        p["error"] = "exit codes [1, 1]"
    return p


def test_calibration_pass_line_bounds_each_point_and_the_runtime():
    inside = [_cal_point("none", 0.95), _cal_point("ckpt", 0.8), _cal_point("alst", 1.2)]  # the bounds included
    assert cal.judge(0.43, inside) == []
    bad = cal.judge(0.43, [_cal_point("none", 0.79), _cal_point("ckpt", 1.21), _cal_point("alst", None),
                           _cal_point("x", None, ok=False)])
    assert [b.split(":")[0] for b in bad] == ["none", "ckpt", "alst", "x"]
    assert len(cal.judge(2.5, inside)) == 1 and len(cal.judge(None, inside)) == 1  # implausible or no baseline


def test_calibration_report_exits_nonzero_on_a_point_outside(tmp_path, capsys):
    res = {"runtime_gb": 0.43, "bound": [0.8, 1.2], "points": [_cal_point("none", 0.95), _cal_point("alst", 0.95)]}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(res))
    assert cal.main(["--report", str(path)]) == 0
    assert "calibration: PASS (2 points" in capsys.readouterr().out
    res["points"][1] = _cal_point("alst", 0.7)
    path.write_text(json.dumps(res))
    assert cal.main(["--report", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL alst: predicted/measured 0.7 outside 0.8-1.2" in out and "calibration: FAIL" in out


def test_the_ladders_pruner_never_takes_a_checkpoint_newer_than_latest(tmp_path):
    """bench/gpu_ladder._prune deletes the stages' older checkpoints while the launch runs. A checkpoint's manifest is
    written before LATEST moves to it: in that window the pruner used to delete every committed folder but LATEST's,
    the newest included (a loaded make test's dry ladder lost step_000004, which the next stage loads). Older
    complete folders go; a newer one and one still being written (no manifest) stay."""
    import threading

    from bench.gpu_ladder import _prune

    for step, manifest in ((2, True), (3, True), (4, True), (5, False)):
        d = tmp_path / f"step_{step:06d}"
        d.mkdir()
        if manifest:
            (d / "MANIFEST.json").write_text("{}")
    (tmp_path / "LATEST").write_text("step_000003\n")
    stop, gone = threading.Event(), []
    stop.set()  # one pass
    _prune(str(tmp_path), stop, gone)
    assert gone == ["step_000002"], gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_000003", "step_000004", "step_000005"]


def test_the_ladders_pruner_makes_a_last_pass_after_the_launch(tmp_path):
    """The launch's last stage moves LATEST just before it ends: the pruner's pass after its stop deletes the stage
    before it (it used to return from its wait at the stop without one, and the dry ladder kept one checkpoint too
    many now and then)."""
    import threading
    import time

    from bench.gpu_ladder import _prune

    for step in (2, 3):
        (tmp_path / f"step_{step:06d}").mkdir()
        (tmp_path / f"step_{step:06d}" / "MANIFEST.json").write_text("{}")
    (tmp_path / "LATEST").write_text("step_000002\n")
    stop, gone = threading.Event(), []
    t = threading.Thread(target=_prune, args=(str(tmp_path), stop, gone, 30.0))
    t.start()
    time.sleep(0.3)  # its first pass: nothing older than LATEST
    (tmp_path / "LATEST").write_text("step_000003\n")
    stop.set()
    t.join(10)
    assert gone == ["step_000002"] and not t.is_alive(), gone


def test_step_times_leave_out_a_skipped_step():
    """A step with no supervised token logs tokens_per_s null and 0 tokens (training/stage.py): bench/preempt.py's and
    bench/extend_seeds.py's step times divided by it (TypeError). It is left out; an fp16 overflow skip ran: kept."""
    from bench.extend_seeds import s_per_step_by_len
    from bench.preempt import step_seconds

    recs = [{"seq_len": 256, "tokens": 512, "tokens_per_s": 256.0},
            {"seq_len": 256, "tokens": 0, "tokens_per_s": None, "optimizer_skipped": True},
            {"seq_len": 256, "tokens": 512, "tokens_per_s": 128.0, "optimizer_skipped": "overflow"},
            {"seq_len": 512, "tokens": 1024, "tokens_per_s": 1024.0}]
    assert step_seconds(recs) == [2.0, 4.0, 1.0]
    assert s_per_step_by_len(recs) == {"256": 3.0, "512": 1.0}
    assert s_per_step_by_len(recs[1:2]) == {} and step_seconds(recs[1:2]) == []
