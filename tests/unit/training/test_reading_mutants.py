"""The figures users read, where mutation found the tests blind (stop 72: 91 one-line mutants of training/metrics.py,
metrics_starts.py, eval_report.py, evaluation.py, eval_tables.py, step.py, scripts/evaluate.py, eval_summary.py,
plot_metrics.py; 32 survived every test, none a bug of the code then). Each test has hand-computed expected values and
kills its mutants (named by the audit's ids): the sign of `--compare`'s difference, a mean over depths read as the
best depth, the stage's own length in summary.md, held-out loss per position bucket, `label_tokens` under conversation
weighting, per-token task loss, the plot's panels and lines, lengths sorted as numbers, the step line's figures, ETAs
over an hour, W&B's re-sent steps and run_end's totals, `--lengths` deduplicated. One process, ~5 s."""

from __future__ import annotations

import json
import types

import pytest

import training.evaluation as ev
from tests.unit.training.test_metrics_wandb import fake_wandb, wandb_env  # noqa: F401  (a fixture)
from training import metrics_starts
from training.metrics import MetricsLogger

STEP = {"loss": 1.0, "lr": 1e-3, "peak_mem_gb": 1.0}


# ---- r01 / r03: scripts/evaluate.py's difference is compare - model, its row the mean over depths --------------
def test_difference_is_compare_minus_model_and_its_row_the_mean_over_depths():
    from training.eval_report import difference, summary

    def res(model, a, b):
        return {"model": model, "kind": "hf", "rope": None, "trials": {"passkey": 2}, "chat": "plain",
                "tasks": {"passkey": {"256": {"0.1": a, "0.5": b}}}, "task_mean": {"passkey": {"256": (a + b) / 2}}}

    base, ext = res("base", 1.0, 0.5), res("ext", 0.5, 0.5)  # the compared model lost 0.5 at depth 0.1
    diff = difference(base, ext)
    assert diff == {"passkey": {"256": {"0.1": -0.5, "0.5": 0.0}}}
    md = "\n".join(summary([base, ext], diff))
    assert "| compare - model | -0.25 |" in md, md  # mean of -0.5 and 0.0


# ---- e05 / e08 / e13: task_mean is the mean over depths; passkey_accuracy / _mean at the stage's own length --------
FAKE = {64: {"0.1": 1.0, "0.5": 0.5, "0.9": 0.0}, 128: {"0.1": 0.5, "0.5": 0.0, "0.9": 0.0}}


def _fake_scores(engine, dims, mb, pad, tok, trials, depths, n, chat=None, hits=None):
    if hits is not None:
        hits["passkey"] = {d: "1" for d in FAKE[n]}
    return {"passkey": dict(FAKE[n])}, {"passkey": {d: 0.0 for d in FAKE[n]}}


def test_task_mean_is_the_mean_over_depths_and_passkey_is_at_the_stages_length(monkeypatch):
    monkeypatch.setattr(ev, "task_scores", _fake_scores)
    monkeypatch.setattr(ev, "eval_lengths", lambda stage, stages: [64, 128])
    stage = types.SimpleNamespace(index=1, name="b", max_seq_length=128, kind="text", eval={"tasks": {"passkey": 1}})
    metrics = types.SimpleNamespace(log_eval=lambda *a: None, log_table=lambda *a, **k: None)
    engine = types.SimpleNamespace(eval=lambda: None, train=lambda: None)
    first = types.SimpleNamespace(index=0, name="a", max_seq_length=64, kind="text", eval={})
    r = ev.evaluate_stage(engine, stage, None, [], object(), metrics, 10, 1, 0, stages=[first, stage])
    assert r["task_mean"] == {"passkey": {"64": pytest.approx(0.5), "128": pytest.approx(1 / 6)}}
    assert r["passkey_accuracy"] == FAKE[128] and r["passkey_mean"] == pytest.approx(1 / 6)


# ---- e04: task_loss is per answer token, not a mean of trial means -------------------------------------------------
def test_task_loss_is_per_answer_token(monkeypatch):
    import torch

    monkeypatch.setattr(ev, "trial", lambda *a, **k: {})
    # two trials at one depth: 3.0 over 1 answer token (right), 3.0 over 3 tokens (one wrong)
    monkeypatch.setattr(ev, "sample_stats", lambda *a, **k: torch.tensor([[3.0, 1, 0], [3.0, 3, 1]], dtype=torch.float64))
    acc, loss = ev.task_scores(None, None, 1, 0, None, {"passkey": 2}, [0.5], 64)
    assert acc == {"passkey": {"0.5": 0.5}} and loss == {"passkey": {"0.5": 1.5}}  # 6 / 4, not (3 + 1) / 2


# ---- e06: the held-out loss by position is each bucket's own mean --------------------------------------------------
def test_loss_by_position_is_each_buckets_mean(monkeypatch):
    import numpy as np
    import torch

    # one sample, 2 buckets: [sum CE, tokens, wrong, CE bucket 0, CE bucket 1, tokens 0, tokens 1]
    monkeypatch.setattr(ev, "sample_stats", lambda *a, **k: torch.tensor([[10.0, 4, 0, 2.0, 8.0, 1, 3]],
                                                                         dtype=torch.float64))
    stage = types.SimpleNamespace(index=0, name="a", max_seq_length=8, kind="text",
                                  eval={"position_buckets": 2, "tasks": []})
    metrics = types.SimpleNamespace(log_eval=lambda *a: None, log_table=lambda *a, **k: None)
    engine = types.SimpleNamespace(eval=lambda: None, train=lambda: None)
    held = [{"input_ids": np.arange(8), "shift_labels": np.arange(8), "position_ids": np.arange(8)}]
    r = ev.evaluate_stage(engine, stage, None, held, None, metrics, 5, 1, 0)
    assert r["heldout_loss"] == 2.5 and r["heldout_loss_by_position"] == [2.0, pytest.approx(8 / 3)]


# ---- b04: summary.md's task table lists lengths in numeric order ------------------------------------------------
def test_task_table_lengths_are_in_numeric_order():
    from training.eval_tables import eval_tables

    row = {"stage": 0, "stage_name": "a", "step": 5, "seq_len": 1024,
           "task_mean": {"passkey": {"256": 1.0, "1024": 0.5}}}
    md = eval_tables([row])
    assert "| stage | trained at | 256 | 1024 |" in md and "| 0 | 1024 | 1.00 | 0.50 |" in md, md


# ---- r04 / r06: scripts/evaluate.py's summary.md: lengths numeric, depths numeric ------------------------------
def test_evaluate_summary_orders_lengths_and_depths_numerically():
    from training.eval_report import summary

    r = {"model": "m", "kind": "hf", "rope": None, "trials": {"passkey": 1}, "chat": "plain",
         "tasks": {"passkey": {"256": {"0.1": 1.0, "0.05": 0.0}, "1024": {"0.1": 0.0, "0.05": 0.0}}},
         "task_mean": {"passkey": {"256": 0.5, "1024": 0.0}}}
    md = summary([r], None)
    assert "|  | 256 | 1024 |" in md and "| model | 0.50 | 0.00 |" in md, md
    cells = md[-2:]  # the depth x length cells, depth 0.05 before 0.1
    assert cells == ["| model | 0.05 | 0.00 | 0.00 |", "| model | 0.1 | 1.00 | 0.00 |"], cells


# ---- w01 / w03 / w04: eval_summary's headline --------------------------------------------------------------------
def test_headline_flags_a_fall_of_exactly_drop_over_the_shared_trials_and_a_new_loss():
    from tests.unit.training.test_eval_summary import eval_summary

    def rec(stage, seq, hits, loss=None):
        n = {d: h.count("1") / len(h) for d, h in hits.items()}
        return {"stage": stage, "stage_name": f"s{stage}", "step": stage, "seq_len": seq, "task_seeds": ev.TASK_SEEDS,
                "tasks": {"passkey": {"64": n}}, "task_hits": {"passkey": {"64": hits}},
                "task_mean": {"passkey": {"64": sum(n.values()) / len(n)}}, **({"heldout_loss": loss} if loss else {})}

    # 5 trials: 3 right -> 2 right at the 5 shared: 0.6 -> 0.4, a fall of exactly DROP (0.6 - 0.4 = 0.1999...)
    a, b = rec(0, 64, {"0.5": "11100"}), rec(1, 128, {"0.5": "11000"}, loss=3.25)
    line = eval_summary.headline([a, b])[0]
    assert "passkey at 64: 0.60 -> 0.40 DROPPED" in line, line
    assert "held-out loss at 128 (the last stage's length): 3.2500" in line, line
    # unequal trial counts: the first 2 (shared) trials of "1111" vs "10": 1.00 -> 0.50
    line = eval_summary.headline([rec(0, 64, {"0.5": "1111"}), rec(1, 64, {"0.5": "10"})])[0]
    assert "passkey at 64: 1.00 -> 0.50" in line, line


# ---- m11 / s12: an hour-long ETA and run time read h + mm, not the total minutes ----------------------------------
def test_hour_long_eta_and_run_end_line(tmp_path, monkeypatch, capsys):
    from training import metrics as metrics_mod

    clock = [100.0]
    monkeypatch.setattr(metrics_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0]), raising=False)
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10000, False, resume_step=500)
    for s in (501, 502):
        clock[0] += 2.0
        m.log({"step": s, "stage": 0, **STEP})
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.endswith(" eta 5h16m"), line  # (10000 - 502) x 2 s = 18996 s = 5h 16m 36s
    m.close()
    assert metrics_starts.end_line({"step": 9, "total_tokens": 5, "starts": 1, "train_s": 3725.0}).startswith(
        "run complete at step 9: 5 tokens, 1 start(s), 1h02m05s in its steps' own time")


# ---- m03: a start that resumes into a folder without metrics (a branch into a new folder) is on record ----------
def test_a_resume_into_a_new_folder_is_on_record(tmp_path):
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 100, False, resume_step=64)
    m.log({"step": 65, **STEP})
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first == {"event": "resume", "step": 64}


# ---- s02 / s04 / s05 / m16 / m23: the W&B re-send bookkeeping ----------------------------------------------------
def test_first_unsent_window_is_before_the_third_last_record():
    # third-last sent at t=40: the window is t >= 10, so step 2 (t=15) may be lost
    assert metrics_starts.first_unsent([(0.0, 1), (15.0, 2), (40.0, 3), (50.0, 4), (60.0, 5)], 6, 0) == 2


def test_a_note_keeps_its_earlier_step(tmp_path):
    metrics_starts.note_unsent(str(tmp_path), "r1", 8)
    metrics_starts.note_unsent(str(tmp_path), "r1", 12)  # the next start's W&B did not start either
    assert metrics_starts.read_unsent(str(tmp_path)) == {"run_id": "r1", "step": 8}


def test_a_note_at_the_resumed_step_is_owed(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)))
    metrics_starts.note_unsent(str(tmp_path), "r1", 5)
    first, recs = metrics_starts.owed(str(tmp_path), "r1", str(path), 5)
    assert first == 5 and [r["step"] for r in recs] == [5]


def test_the_sent_window_in_memory_keeps_what_first_unsent_reads(tmp_path, wandb_env):  # noqa: F811
    from training import metrics as metrics_mod

    monkeypatch = wandb_env
    monkeypatch.setenv("WANDB_MODE", "offline")
    fake_wandb(monkeypatch)
    clock = [0.0]
    monkeypatch.setattr(metrics_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0]), raising=False)
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 100, False)
    for s, t in zip(range(1, 5), (0.0, 10.0, 20.0, 40.0)):
        clock[0] = t
        m.log({"step": s, **STEP})
    # third-last went through at t=10: step 1 (t=0) is inside its window and must stay in memory
    assert metrics_starts.first_unsent(m._sent, None, 0) == 1
    m.close()


# ---- m23: the re-send line names the steps sent ------------------------------------------------------------------
def test_the_resend_line_names_the_steps(tmp_path, wandb_env, capsys):  # noqa: F811
    wandb_env.setenv("WANDB_MODE", "offline")
    fake_wandb(wandb_env)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **STEP}) + "\n" for s in range(1, 6)))
    metrics_starts.note_unsent(str(tmp_path), "r1", 3)
    MetricsLogger(str(tmp_path), True, "wandb", None, "r1", {}, 10, False, resume_step=5).close()
    assert "W&B: 3 record(s) of steps 3-5 sent again" in capsys.readouterr().out


# ---- p03: label_tokens under conversation weighting is the supervised-token count, not the conversations -------
def test_label_tokens_are_tokens_under_conversation_weighting():
    from tests.unit.model_utils.test_sft_loss import PACKED, PerToken, run_ranks

    got, _, _ = run_ranks(PerToken(), [[[PACKED]]], 2, 1, "conversation")
    assert got["label_tokens"] == 9 and got["label_weight"] == pytest.approx(3.0)  # spans 2 + 6 + 1; 3 conversations


# ---- t05: a step's record carries the LR that step trained with (read before its optimizer step) ---------------
def test_each_step_logs_the_lr_it_trained_with(tmp_path, monkeypatch):
    from tests.unit.training.test_run_health import _engine, train

    done = []

    class Losses(list):
        def __getitem__(self, i):
            done.append(i)  # train_step of step i + 1 ran (its optimizer step moved the schedule)
            return 1.0

    eng = _engine()
    eng.get_lr = lambda: [1e-4 * (len(done) + 1)]  # step s trains at s x 1e-4
    _, _, _, metrics, _ = train(tmp_path, monkeypatch, Losses(), steps=3, save_steps=0, engine=eng)
    assert [(r["step"], r["lr"]) for r in metrics.records if "loss" in r] == [
        (1, pytest.approx(1e-4)), (2, pytest.approx(2e-4)), (3, pytest.approx(3e-4))]


# ---- q02 / q03 / q04 / q05 / q06 / q08: what metrics.png and metrics_eval.png draw --------------------------------
def _figures(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.figure

    figs = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figs.append(self))
    return figs


def test_metrics_png_draws_tokens_per_s_its_smoothing_and_its_lines(tmp_path, monkeypatch):
    from tests.e2e.test_plot_metrics import load_plot_metrics

    mod, figs = load_plot_metrics(), _figures(monkeypatch)
    recs = [{"step": s, "stage": int(s > 40), "loss": float(s), "tokens": 64, "tokens_per_s": 100.0 + s,
             "seq_len": 64, "peak_mem_gb": 1.0} for s in range(1, 81)]
    recs.insert(20, {"step": 20, "stage": 0, "loss": 99.0, "tokens": 64, "tokens_per_s": 1.0, "peak_mem_gb": 1.0})
    steps = mod.read_steps(recs)  # step 20 logged twice: its latest record (loss 99) kept
    assert steps[19]["loss"] == 99.0
    mod.plot(steps, str(tmp_path / "m.png"), resumed=[30])
    loss_ax, rate_ax, _ = figs[0].axes
    assert list(rate_ax.lines[0].get_ydata())[:3] == [101.0, 102.0, 103.0]  # tokens/s, not tokens
    smooth = loss_ax.lines[1].get_ydata()  # 80 steps: a trailing mean of 2
    assert smooth[5] == 5.5 and loss_ax.lines[1].get_label() == "mean of 2 steps"
    xs = sorted(ln.get_xdata()[0] for ln in loss_ax.lines[2:])
    assert xs == [30.5, 40.5]  # the resume after step 30, the stage boundary before step 41


def test_metrics_eval_png_marks_lengths_beyond_the_stages_own(tmp_path, monkeypatch):
    from tests.e2e.test_plot_metrics import load_plot_metrics

    mod, figs = load_plot_metrics(), _figures(monkeypatch)
    ev_rec = {"event": "eval", "stage": 0, "seq_len": 128,
              "tasks": {"passkey": {"64": {"0.5": 1.0}, "128": {"0.5": 1.0}, "256": {"0.5": 0.0}}},
              "task_mean": {"passkey": {"64": 1.0, "128": 1.0, "256": 0.0}}}
    mod.plot_eval(mod.read_evals([ev_rec]), str(tmp_path / "e.png"))
    heat = figs[0].axes[0]
    assert [ln.get_xdata()[0] for ln in heat.lines] == [1.5]  # between 128 (trained) and 256 (beyond)


# ---- e09: the record names the first stage's length its retention loss was scored at --------------------------
def test_first_len_is_the_first_stages_length(monkeypatch):
    import numpy as np
    import torch

    monkeypatch.setattr(ev, "sample_stats", lambda *a, **k: torch.tensor([[8.0, 4, 0]], dtype=torch.float64))
    s0 = types.SimpleNamespace(index=0, name="a", max_seq_length=4, kind="text", eval={"position_buckets": 0})
    s1 = types.SimpleNamespace(index=1, name="b", max_seq_length=8, kind="text", eval={"position_buckets": 0})
    metrics = types.SimpleNamespace(log_eval=lambda *a: None, log_table=lambda *a, **k: None)
    engine = types.SimpleNamespace(eval=lambda: None, train=lambda: None)
    held = [{"input_ids": np.arange(8), "shift_labels": np.arange(8), "position_ids": np.arange(8)}]
    r = ev.evaluate_stage(engine, s1, None, held, None, metrics, 5, 1, 0, stages=[s0, s1],
                          heldout_at=lambda n, k, sft=False: held)
    assert r["first_len"] == 4 and r["heldout_loss_first_len"] == 2.0


# ---- m19: peak_mem_gb is GiB on CPU as on GPU ------------------------------------------------------------------
def test_peak_memory_is_gib_on_cpu(monkeypatch):
    from training import metrics as metrics_mod

    monkeypatch.setattr(metrics_mod.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(metrics_mod, "peak_rss_bytes", lambda: 3 * 2**30)
    assert metrics_mod.peak_memory_gb() == 3.0


# ---- s07 / s10: re-sent records in step order; run_end's tokens are the last total_tokens ------------------------
def test_records_from_are_in_file_order_and_totals_keep_the_last_total_tokens(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 1.0, "tokens": 100, "tokens_per_s": 50.0, "total_tokens": 0,
             "optimizer_skipped": "overflow"},  # DeepSpeed skipped its update: not in total_tokens
            {"step": 2, "loss": 1.0, "tokens": 100, "tokens_per_s": 50.0, "total_tokens": 100}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["step"] for r in metrics_starts.records_from(str(path), 1)] == [1, 2]
    assert metrics_starts.run_totals(str(path)) == {"step": 2, "total_tokens": 100, "starts": 1, "train_s": 4.0}


# ---- m24: the step line's figures are the record's ----------------------------------------------------------------
def test_the_step_line_says_the_records_figures(tmp_path, capsys):
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10, False)
    m.log({"step": 3, "stage": 1, "loss": 2.34567, "lr": 2.5e-4, "tokens": 640, "tokens_per_s": 320.4,
           "peak_mem_gb": 1.234})
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("step 3/10 stage 1 loss 2.3457 lr 2.50e-04 tok/s 320 mem 1.23GB"), line
    m.close()


# ---- v01: scripts/evaluate.py evaluates each length once, in order ----------------------------------------------
def test_evaluate_lengths_are_sorted_once_each(tmp_path):
    from scripts.evaluate import parse_args, settings

    model = tmp_path / "m"
    model.mkdir()
    a = parse_args([str(model), "--lengths", "512,256,256", "--output_dir", str(tmp_path / "out")])
    assert settings(a)["lengths"] == [256, 512]
