"""Stopping a run started by scripts/launch.sh outside SLURM: a closed terminal (SIGHUP), Ctrl-C two and three times,
and pdsh's save request, with stand-ins that behave as deepspeed's processes do (no real launcher, no train.py):

- the runner (deepspeed's bin/deepspeed on one node or --no_ssh) starts launch.py and waits; it has no SIGTERM handler
  (runner.py installs one only for pdsh on several nodes): a SIGTERM ends it alone, its child gets nothing;
- launch.py starts the ranks; on SIGTERM it terminates each (SIGKILL 30 s later) and exits 1; the first rank that
  exits non-zero ends the others and is its exit code;
- a rank catches SIGUSR1 (a save: STANDIN_SAVE_S, then 75) and SIGTERM (a save that fits the window: 75 at once;
  the ranks in STANDIN_STUCK ignore it), records its code in LAUNCH_EXIT_DIR as train.py does, and logs what it got.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.launchers import LAUNCH, clean_env, wait_for

RANK = """import os, signal, sys, time
rank = os.environ.get("RANK", "0")
log = os.path.join(os.environ["STANDIN_DIR"], os.environ.get("STANDIN_NAME", "rank" + rank))
def say(m):
    with open(log, "a") as fh: fh.write(m + "\\n")
got = []
def on(s, f): got.append(s); say("got " + signal.Signals(s).name)
for s in (signal.SIGUSR1, signal.SIGTERM): signal.signal(s, on)
def leave(code):
    d = os.environ.get("LAUNCH_EXIT_DIR")
    if d and os.path.isdir(d):
        with open(os.path.join(d, "rank" + rank), "w") as fh: fh.write(f"{code}\\n")
    say(f"exit {code}"); sys.exit(code)
say(f"ready {os.getpid()}")
saving = None
for _ in range(1200):
    if signal.SIGTERM in got and rank not in os.environ.get("STANDIN_STUCK", "").split(): leave(75)
    if signal.SIGUSR1 in got and saving is None: saving = time.time() + float(os.environ.get("STANDIN_SAVE_S", "0"))
    if saving is not None and time.time() >= saving: leave(75)
    time.sleep(0.05)
leave(1)
"""

LAUNCH_PY = """import os, signal, subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, os.environ["TRAIN_SCRIPT"], f"--local_rank={i}"],
                          env={**os.environ, "RANK": str(i)}) for i in range(2)]
def stop(code):
    for r in ranks:
        r.terminate()
        try: r.wait(30)
        except subprocess.TimeoutExpired: r.kill()
    sys.exit(code)
signal.signal(signal.SIGTERM, lambda s, f: stop(1))
while any(r.poll() is None for r in ranks):
    bad = [r.returncode for r in ranks if r.returncode]
    if bad: stop(bad[0])
    time.sleep(0.1)
sys.exit(next((r.returncode for r in ranks if r.returncode), 0))
"""

RUNNER = """import subprocess, sys
child = subprocess.Popen([sys.executable, sys.argv[0].replace("runner.py", "launch.py")])
rc = child.wait()
sys.exit(rc if rc > 0 else 0)
"""


def standins(tmp_path, **env: str) -> dict:
    """The stand-ins in tmp_path and the environment that makes launch.sh run them."""
    for name, text in (("rank.py", RANK), ("launch.py", LAUNCH_PY), ("runner.py", RUNNER)):
        (tmp_path / name).write_text(f"#!{sys.executable}\n{text}")
        (tmp_path / name).chmod(0o755)
    (tmp_path / "logs").mkdir()
    return clean_env(DEEPSPEED=str(tmp_path / "runner.py"), TRAIN_SCRIPT=str(tmp_path / "rank.py"),
                     STANDIN_DIR=str(tmp_path / "logs"), DS_ACCELERATOR="cpu", **env)


def _as_a_terminal_starts_it() -> None:
    # SIGINT and SIGHUP at their defaults, as a terminal's shell starts it (bash cannot trap a signal ignored at its
    # start: a test run in the background or under nohup ignores them)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start(tmp_path, args: list[str], env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([LAUNCH, *args, "--", "--x"], cwd=tmp_path, env=env, text=True,
                            preexec_fn=_as_a_terminal_starts_it, **kw)


def log(tmp_path, name: str) -> str:
    f = tmp_path / "logs" / name
    return f.read_text() if f.exists() else ""


def both(tmp_path, line: str) -> bool:
    return all(line in log(tmp_path, f"rank{r}") for r in (0, 1))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def pids(tmp_path, *names: str) -> list[int]:
    return [int(ln.split()[1]) for n in names for ln in log(tmp_path, n).splitlines() if ln.startswith("ready ")]


def end(p: subprocess.Popen, tmp_path) -> None:
    """Whatever a failing test left: launch.sh and the ranks (the stand-in launchers end with them)."""
    p.kill()
    for pid in pids(tmp_path, "rank0", "rank1", "stranger"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(10)


def test_a_hang_up_is_a_save_request_and_launch_sh_outlives_its_console(tmp_path):
    """Closing the terminal or ssh session: SIGHUP reaches launch.sh (not the launcher: its own process group). It
    killed launch.sh alone: the ranks trained on unsupervised (on one node: until rank 0's next line to the dead
    terminal raised; with --no_ssh node 0's store died with it and the other nodes exited 69, no save). Now it is a
    save request like SIGTERM, and launch.sh lives on though its output (a `| tee` hung up with the session) is gone."""
    p = start(tmp_path, ["--num_gpus", "2"], standins(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: both(tmp_path, "ready"), 30, "the ranks")
        p.stdout.close()  # the console's reader gone: launch.sh's next line raises SIGPIPE
        p.send_signal(signal.SIGHUP)
        assert p.wait(30) == 75, (log(tmp_path, "rank0"), log(tmp_path, "rank1"))
        assert both(tmp_path, "got SIGUSR1") and both(tmp_path, "exit 75")
    finally:
        end(p, tmp_path)


@pytest.mark.parametrize("args", [["--num_gpus", "2"], ["-H", "hf"]])
def test_a_second_ctrl_c_terminates_every_rank_and_a_third_kills_them(tmp_path, args):
    """The deepspeed runner on one node dies of SIGTERM alone: the second Ctrl-C's `kill -TERM <runner>` reached no
    rank, and launch.sh then waited RANK_EXIT_WAIT_S (900 s) a rank; a third repeated the kill on the dead runner.
    Now: SIGTERM to the launcher's process group, ranks included; a third SIGKILLs them, and launch.sh ends at once.
    `-H hf` naming this host alone runs here, not over pdsh: the second Ctrl-C went to a pdsh that was not there."""
    (tmp_path / "hf").write_text("localhost slots=2\n")
    env = standins(tmp_path, STANDIN_SAVE_S="60", STANDIN_STUCK="1")  # the first Ctrl-C's save is long; rank 1 hangs
    p = start(tmp_path, args, env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: both(tmp_path, "ready"), 30, "the ranks")
        time.sleep(3)  # launch.sh notes its ranks once a second until the first signal (its wait for them below)
        p.send_signal(signal.SIGINT)
        wait_for(lambda: both(tmp_path, "got SIGUSR1"), 15, "the first Ctrl-C's save request")
        p.send_signal(signal.SIGINT)
        wait_for(lambda: both(tmp_path, "got SIGTERM"), 15, "the second Ctrl-C's SIGTERM at every rank")
        wait_for(lambda: "exit 75" in log(tmp_path, "rank0"), 15, "rank 0's exit")
        time.sleep(1)
        assert p.poll() is None  # rank 1 ignores SIGTERM: launch.py would SIGKILL it 30 s later
        t0 = time.time()
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=15)[1]
        assert time.time() - t0 < 10, err  # no wait for the ranks after a SIGKILL
        assert not any(alive(pid) for pid in pids(tmp_path, "rank0", "rank1")), err
        assert "SIGINT 2: SIGTERM to the launcher and every rank (SIGKILL after 30 s)" in err, err
        assert "SIGINT 3: SIGKILL to the launcher and every rank" in err, err
    finally:
        end(p, tmp_path)


def test_pdsh_save_request_reaches_this_launchs_ranks_only(tmp_path):
    """pdsh mode: the save request ran `pkill -USR1 -f '<train.py> --local_rank=[0-9]'` on every host, which also
    stopped any other run of the same checkout there. It now signals only the processes whose environment holds this
    launch's ULYSSES_LAUNCH_ID. The pdsh stand-in runs the remote command here (this host is every node); the runner
    is the launch.py stand-in, so the ranks are not launch.sh's grandchildren and only pdsh's command reaches them."""
    (tmp_path / "hf").write_text("hA slots=1\nhB slots=1\n")
    (tmp_path / "bin").mkdir()
    pdsh = tmp_path / "bin" / "pdsh"
    pdsh.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {tmp_path}/pdsh.log\nshift 2\nexec sh -c "$1"\n')
    pdsh.chmod(0o755)
    env = standins(tmp_path, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    env["DEEPSPEED"] = str(tmp_path / "launch.py")
    # another run's rank of the same checkout on these hosts: the same command line, another launch id
    stranger = subprocess.Popen([sys.executable, env["TRAIN_SCRIPT"], "--local_rank=0"],
                                env={**env, "ULYSSES_LAUNCH_ID": "another run", "STANDIN_NAME": "stranger"})
    p = start(tmp_path, ["-H", "hf"], env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: both(tmp_path, "ready") and "ready" in log(tmp_path, "stranger"), 30, "the ranks")
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=30)[1]
        assert p.returncode == 75, err
        assert both(tmp_path, "got SIGUSR1"), err
        assert stranger.poll() is None and "got" not in log(tmp_path, "stranger"), log(tmp_path, "stranger")
        sent = (tmp_path / "pdsh.log").read_text()
        assert sent.startswith("-w hA,hB ") and "grep -qxF 'ULYSSES_LAUNCH_ID=" in sent and "kill -USR1" in sent, sent
    finally:
        stranger.kill()
        stranger.wait(10)
        end(p, tmp_path)
