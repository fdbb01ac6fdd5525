"""What the launcher above a rank does to its stop: a plain `deepspeed --num_gpus N train.py` whose runner is killed
alone (`kill -TERM <runner pid>`: deepspeed/launcher/runner.py installs its handlers only for pdsh on several nodes)
left launch.py reparented and the ranks training on, unsaved, with nothing left to stop them; now the rank notes
launch.py and its parent at its first line and votes to stop once either is gone (training/launcher.py launcher_gone), with
the full save. torchrun's kill window is its own shutdown timeout (--shutdown-timeout, TORCH_ELASTIC_SHUTDOWN_TIMEOUT),
which the ranks were never told: they counted 30 s (training/preemption.py kill_window_s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.distributed import ROOT
from tests.unit.training.test_stop_window import simulate
from training import launcher, preemption
from training.checkpoint import tag_for
from training.preemption import KILL_WINDOW_S, PreemptionFlag


def fake_proc(root, procs: dict[int, tuple[int, list[str]]]) -> str:
    """A /proc of `procs` (pid -> (its parent, its command line)): the files watch_launcher and launcher_gone read."""
    for pid, (ppid, argv) in procs.items():
        d = root / str(pid)
        d.mkdir()
        (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
        (d / "stat").write_text(f"{pid} (python3 (x) y) S {ppid} {pid} {pid} 0 -1 4194560\n")  # a name with ") "
    return str(root)


PY = "/venv/bin/python3"
LAUNCH_PY = [PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=eyJsb2NhbGhvc3QiOiBbMCwgMV19",
             "--master_addr=127.0.0.1", "--master_port=29500", "--enable_each_rank_log=None", "train.py"]


def test_the_watch_is_taken_under_deepspeeds_launch_py_without_launch_sh(tmp_path, monkeypatch):
    proc = fake_proc(tmp_path, {100: (50, LAUNCH_PY), 50: (7, [PY, "/venv/bin/deepspeed", "--num_gpus", "2", "train.py"]),
                                200: (50, [PY, "/venv/bin/torchrun", "--nproc_per_node", "2", "train.py"])})
    assert launcher.watch_launcher({}, 100, proc) == (100, 50)
    assert launcher.watch_launcher({"LAUNCH_EXIT_DIR": "/tmp/x"}, 100, proc) is None  # launch.sh stops its ranks itself
    assert launcher.watch_launcher({}, 200, proc) is None  # torchrun: not deepspeed's launch.py
    assert launcher.watch_launcher({}, 300, proc) is None  # nothing readable


def test_a_runner_or_launch_py_gone_is_a_reason_to_stop(tmp_path, monkeypatch):
    (tmp_path / "alive").mkdir()
    (tmp_path / "orphan").mkdir()
    alive = fake_proc(tmp_path / "alive", {100: (50, LAUNCH_PY)})
    monkeypatch.setattr(launcher, "_WATCH", [(100, 50)])
    assert launcher.launcher_gone(100, alive) is None  # launch.py under its runner: train on
    orphaned = fake_proc(tmp_path / "orphan", {100: (1, LAUNCH_PY)})  # the runner died: launch.py reparented to init
    assert "the deepspeed runner (pid 50) that started launch.py ended" in launcher.launcher_gone(100, orphaned)
    assert "launch.py (pid 100) ended" in launcher.launcher_gone(1, orphaned)  # launch.py itself died: this rank reparented
    monkeypatch.setattr(launcher, "_WATCH", [])
    assert launcher.launcher_gone(1, orphaned) is None  # not watched (launch.sh, torchrun, python train.py)


RUNNER = """import subprocess, sys, time
launch = subprocess.Popen([sys.executable, "-c", sys.argv[1], "deepspeed.launcher.launch", sys.argv[2]])
print(launch.pid, flush=True)
time.sleep(60)
"""
LAUNCH = """import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[2]])
rank.wait()
"""
RANK = """import os, sys, time
from training import launcher
launcher._WATCH[:] = [w for w in [launcher.watch_launcher(os.environ, os.getppid())] if w]
print("watching" if launcher._WATCH else "not watching", flush=True)
for _ in range(400):
    why = launcher.launcher_gone()
    if why:
        print(why, flush=True)
        sys.exit(75)
    time.sleep(0.05)
sys.exit(1)
"""


def test_a_real_runner_killed_alone_is_seen_by_the_rank(tmp_path):
    """A process tree as `deepspeed --num_gpus 1 train.py` makes it (runner -> launch.py -> rank), the runner killed
    as `kill -TERM <runner pid>` kills it: the rank sees it within its next check."""
    env = {k: v for k, v in os.environ.items() if k != "LAUNCH_EXIT_DIR"}
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, LAUNCH, RANK], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert int(runner.stdout.readline()) > 0  # launch.py started
        assert runner.stdout.readline().strip() == "watching"
        runner.send_signal(signal.SIGTERM)  # no handler: the runner dies alone, as deepspeed's does on one node
        runner.wait(10)
        line = runner.stdout.readline()  # the rank still writes to the pipe it inherited
        assert "the deepspeed runner" in line and f"pid {runner.pid}" in line, line
    finally:
        try:
            os.killpg(runner.pid, signal.SIGKILL)  # launch.py and the rank stay in the runner's process group
        except ProcessLookupError:
            pass


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setattr(preemption.comm, "rank", lambda group=None: 0)
    monkeypatch.setattr(preemption.comm, "all_reduce", lambda values, op="sum", group=None: torch.tensor(values))


def test_the_runners_death_is_an_agreed_stop_without_a_kill_window(monkeypatch, one_rank):
    """launcher_gone's reason is this rank's vote, as a signal is (the all-reduce makes it every rank's), and no
    launcher is left to SIGKILL after it: no window."""
    monkeypatch.setattr(launcher, "_WATCH", [(os.getppid(), -1)])  # launch.py = this process' parent, its runner not -1
    flag = PreemptionFlag()
    assert flag.agreed() and flag.window_left_s is None and flag.term_at is None
    assert "the deepspeed runner (pid -1)" in preemption.said(flag.received)
    monkeypatch.setattr(launcher, "_WATCH", [])
    assert not PreemptionFlag().agreed()


def test_the_runners_death_keeps_the_full_save(monkeypatch):
    """training/stage.py's real loop on test_stop_window.py's clock (Llama-3-8B on 32 ranks, a 95 s save): the runner
    dies during step 7; the stop commits the write in flight and makes its own synchronous save of step 7, as a
    SIGUSR1 does (a SIGTERM's 30 s window would have skipped it)."""
    from training import stage as stage_mod

    monkeypatch.setattr(launcher, "launcher_gone", lambda: "the deepspeed runner (pid 9) ended" if stage_mod.time.t > 1400
                        else None)  # the clock starts at 1000, 60 s steps: step 7 ends at ~1421
    clock, ckpt, flag, state, _ = simulate(monkeypatch, save_every_s=600)
    assert flag.stopping and flag.window_left_s is None and state.step == 7
    assert [(s, kind) for s, _, kind in ckpt.started] == [(6, "background"), (7, "sync")]
    assert [c[0] for c in ckpt.commits] == [6, 7] and state.checkpoint.endswith(tag_for(7))


TORCHRUN = [PY, "/venv/bin/torchrun", "--nproc_per_node", "2"]


@pytest.mark.parametrize("env, agent, window", [
    ({"TORCHELASTIC_RUN_ID": "r"}, [*TORCHRUN, "--shutdown-timeout", "120", "train.py"], 120.0),
    ({"TORCHELASTIC_RUN_ID": "r"}, [*TORCHRUN, "--shutdown_timeout=90", "train.py"], 90.0),
    ({"TORCHELASTIC_RUN_ID": "r", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "75"}, [*TORCHRUN, "train.py"], 75.0),
    ({"TORCHELASTIC_RUN_ID": "r", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "75"},  # the flag wins (launcher/api.py)
     [*TORCHRUN, "--shutdown-timeout", "45", "train.py"], 45.0),
    ({"TORCHELASTIC_RUN_ID": "r", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "75"}, [PY, "/venv/bin/accelerate", "launch"], 75.0),
    ({"TORCHELASTIC_RUN_ID": "r", "KILL_WINDOW_S": "40"}, [*TORCHRUN, "--shutdown-timeout", "120", "train.py"], 40.0),
    ({"TORCHELASTIC_RUN_ID": "r"}, [*TORCHRUN, "train.py"], KILL_WINDOW_S),  # torchrun's default, 30 s
    ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "75"}, LAUNCH_PY, KILL_WINDOW_S),  # deepspeed's launch.py: 30 s hard-coded
])
def test_torchruns_shutdown_timeout_is_the_kill_window(monkeypatch, env, agent, window):
    """The agent SIGKILLs its workers its shutdown timeout after its SIGTERM (torch/distributed/launcher/api.py
    LaunchConfig.__post_init__), which the workers were never told: a longer one let a SIGTERM stop skip a save that
    would have fit, a shorter one was overrun."""
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT", raising=False)
    assert preemption.kill_window_s(env, agent) == window


def test_the_flag_takes_its_agents_window(monkeypatch):
    for k in ("KILL_WINDOW_S", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    monkeypatch.setattr(launcher, "_PARENT", [[*TORCHRUN, "--shutdown-timeout", "150", "train.py"]])
    assert PreemptionFlag().window_s == 150.0
