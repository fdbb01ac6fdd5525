"""scripts/slurm.sbatch with stub sbatch, srun and scontrol from tests/stubs on PATH and a stand-in launch.sh
(tests/stubs/fake_launch): one launcher per node with its node rank and master, requeue on 75 only (a `COMPLETE`
older than the job does not count), SLURM's warning signal forwarded, the time-limit cut, the interface variables
and the node's CPUs carried to every node's task, the give-up limit. With the real launchers: test_launch_scripts.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.e2e.launchers import (
    INTERFACES,
    ROOT,
    SBATCH_SCRIPT,
    STUBS,
    clean_env,
    cpu_set,
    needs_2_cpus,
    requeues,
    wait_for,
)


def sbatch(tmp_path, fake_exit: str, args: list[str], opts: tuple[str, ...] = (), **env: str) -> subprocess.Popen:
    """The stub sbatch running slurm.sbatch in tmp_path (opts: sbatch's own, before the script); env's values win (PATH
    too: a wrapper of a stub before it)."""
    e = clean_env(**{"PATH": f"{STUBS}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path), "PYTHONPATH": ROOT,
                     "SCONTROL_LOG": str(tmp_path / "scontrol.log"), "FAKE_LOG": str(tmp_path / "fake.log"),
                     "FAKE_EXIT": fake_exit, "LAUNCH_CMD": os.path.join(STUBS, "fake_launch"), **env})
    return subprocess.Popen(["sbatch", *opts, SBATCH_SCRIPT, *args], cwd=tmp_path, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def updates(tmp_path) -> list[str]:
    """The stub scontrol's `update ... Requeue=N` calls (kept out of the requeues' log)."""
    log = tmp_path / "scontrol.log.updates"
    return log.read_text().splitlines() if log.exists() else []


def test_sbatch_runs_one_launcher_per_node_with_node_rank_and_master(tmp_path):
    job = sbatch(tmp_path, "75", ["--config", "recipes/x.yaml", "--output_dir", str(tmp_path / "out")],
                 GPUS_PER_NODE="4", SLURM_JOB_ID="7")
    out = job.communicate(timeout=60)[0]
    assert job.returncode == 0, out
    assert (tmp_path / "fake.log").read_text().splitlines()[0] == (
        "args: --no_ssh --nnodes 1 --node_rank 0 --master_addr 127.0.0.1 --master_port 20049 --num_gpus 4 -- "
        f"--resume auto --config recipes/x.yaml --output_dir {tmp_path}/out")
    assert requeues(tmp_path) == ["requeue 7"]


@pytest.mark.parametrize("code, complete, job_rc, requeued", [
    ("75", None, 0, True),        # preempted after a save: requeue
    ("75", "during", 0, False),   # finished anyway: nothing to resume
    ("75", "before", 0, True),    # a COMPLETE older than the job (the line before a branch, a run since extended)
    ("0", "during", 0, False),    # done
    ("0", None, 1, False),        # 0 without COMPLETE: a launcher died of a signal; fail, do not loop
    ("0", "before", 1, False),    # ... also when an older COMPLETE is there
    ("3", None, 3, False),        # failure: no requeue
])
def test_sbatch_requeues_only_after_a_preemption_save(tmp_path, code, complete, job_rc, requeued):
    out_dir = tmp_path / "out"
    if complete == "before":
        out_dir.mkdir()
        (out_dir / "COMPLETE").write_text("")
    env = {"FAKE_COMPLETE": str(out_dir / "COMPLETE")} if complete == "during" else {}
    job = sbatch(tmp_path, code, ["--output_dir", str(out_dir)], **env)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == job_rc, text
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else []), text
    assert f"training exited with {code}" in text
    # a failure not requeued tells Slurm so: a site's RequeueExit listing its code requeued it, the book wiped (a loop)
    assert updates(tmp_path) == (["update JobId=4242 Requeue=0"] if job_rc else []), text


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_sbatch_forwards_the_warning_signal_and_requeues(tmp_path, sig):
    out_dir = tmp_path / "out"
    job = sbatch(tmp_path, "wait", ["--output_dir", str(out_dir)])
    try:
        wait_for(lambda: "ready" in (tmp_path / "fake.log").read_text() if (tmp_path / "fake.log").exists()
                 else False, 30, "the stand-in launcher")
        job.send_signal(sig)  # what --signal=B:USR1@120 does before the time limit
        text = job.communicate(timeout=30)[0]
    finally:
        job.kill()
    assert job.returncode == 0, text
    assert "got SIGUSR1" in (tmp_path / "fake.log").read_text(), text  # passed on as SIGUSR1
    assert (out_dir / "PREEMPT").exists()  # train.py's stop file, for ranks a signal cannot reach
    assert requeues(tmp_path) == ["requeue 4242"], text


@pytest.mark.parametrize("sig, batch, requeued", [
    ("USR1", True, True), ("USR2", True, False), ("USR2", False, False), ("USR1", False, True),
    ("USR2", "early", False),     # without --batch, before launch.sh has set its traps
    ("USR2", "children", False),  # without --batch, where Slurm signals every process of the step too
    ("TERM", False, False),       # the steps only, no PreemptTime, the job RUNNING: a user's stop, not a preemption
    ("TERM", "warn", True),       # the same within 15 min of the end: `sbatch --signal=TERM@300`'s warning, requeued
])
def test_a_users_scancel_signal_saves_then_requeues_or_stops(tmp_path, sig, batch, requeued):
    """`scancel --batch --signal=USR1 JOB` is the time-limit warning asked by hand: save, requeue now. `--signal=USR2`:
    the same save, then the job ends, never requeued (resubmitting resumes). Before, the batch shell had no USR2 trap
    and died of it: no save, the job failed (140). Without --batch scancel signals the steps only, never the batch
    shell, and there (proctrack/cgroup's default, the stand-ins' too) each node's task alone: its bash records the USR2
    (stop.N: not requeued as a preemption) and passes USR1 / USR2 on to launch.sh, once launch.sh has set its traps
    ("early": the stand-in launcher starts 2 s late); it kept them (USR2 ignored until the job's end, USR1 lost).
    "children": cgroup.conf SignalChildrenProcesses=yes, every process gets it: launch.sh twice, one save.
    `--signal=TERM` without --batch: the nodes' tasks record it (term.N) and pass it on, the ranks save; no TERM to the
    batch shell, no PreemptTime (not a GraceTime preemption, nor the time limit): a stop. It was requeued as one."""
    env = {"STUB_SIGNAL_CHILDREN": "1" if batch == "children" else "0"}
    if batch == "warn":
        end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 300))
        (tmp_path / "scontrol.log.state").write_text(f"end_time={end}\n")
    if batch == "early":  # its traps set 2 s after the node's task started
        late = tmp_path / "late_launch"
        late.write_text(f'#!/usr/bin/env bash\nsleep 2\nexec {os.path.join(STUBS, "fake_launch")} "$@"\n')
        late.chmod(0o755)
        env["LAUNCH_CMD"] = str(late)
    job = sbatch(tmp_path, "wait", ["--output_dir", str(tmp_path / "out")], **env)
    log = tmp_path / "fake.log"
    try:
        if batch == "early":
            wait_for((tmp_path / ".cache/slurm/4242.0/start.0").exists, 30, "the node's task")
            assert not log.exists(), log.read_text()  # the launcher not up yet
        else:
            wait_for(lambda: "ready" in log.read_text() if log.exists() else False, 30, "the stand-in launcher")
        subprocess.run(["scancel", *(["--batch"] if batch is True else []), f"--signal={sig}", "4242"], check=True,
                       timeout=30, env=clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", **env,
                                                 SCONTROL_LOG=str(tmp_path / "scontrol.log")))
        text = job.communicate(timeout=30)[0]
    finally:
        job.kill()
    assert job.returncode == 0, text
    # the ranks asked to save: by the batch shell (SIGUSR1), or by the step's own signal (launch.sh takes USR2 as one)
    assert f"got SIG{'USR1' if batch is True else sig}" in log.read_text(), text
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else []), text
    stop = "no preemption nor time limit: saved and stopped, not requeueing" if sig == "TERM" else \
        "saved and stopped, as asked (SIGUSR2): not requeueing"
    assert (stop in text) == (not requeued), text


def warned(tmp_path, after: str, **env: str) -> tuple[subprocess.Popen, str]:
    """A job whose stand-in launcher waits, gets SLURM's warning (SIGUSR1 to the batch shell) and then exits
    `after`: the job and its output."""
    job = sbatch(tmp_path, "wait", ["--output_dir", str(tmp_path / "out")], FAKE_EXIT_AFTER=after, **env)
    try:
        wait_for(lambda: "ready" in (tmp_path / "fake.log").read_text() if (tmp_path / "fake.log").exists()
                 else False, 30, "the stand-in launcher")
        job.send_signal(signal.SIGUSR1)
        return job, job.communicate(timeout=30)[0]
    finally:
        job.kill()


@pytest.mark.parametrize("after, requeued", [("1", True), ("137", True), ("2", False), ("130", False)])
def test_sbatch_requeues_a_run_cut_by_the_time_limit(tmp_path, after, requeued):
    """After SLURM's warning, a run that ends without a preemption save and without COMPLETE (the time limit
    came first) is requeued to resume from its last save; bad input (2) never is, nor a user's Ctrl-C (130:
    training/job.py's stop at start-up, which was requeued as a time-limit cut)."""
    job, text = warned(tmp_path, after)
    assert f"training exited with {after}" in text, text
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else []), text
    assert job.returncode == (0 if requeued else int(after)), text


def test_the_warnings_save_is_requeued_with_the_records_off(tmp_path):
    """A review: with the records folder not writable (here .cache is a file) the nodes' 75 reached the batch shell as
    srun's 0, and a time-limit warning's save ended "exit 0 but no COMPLETE ... failing (not requeueing)"."""
    (tmp_path / ".cache").write_text("")
    job, text = warned(tmp_path, "75", STATE_SETTLE_S="1")
    assert "cannot write" in text and requeues(tmp_path) == ["requeue 4242"] and job.returncode == 0, text


@pytest.mark.parametrize("export", ["ALL", "NONE"])
def test_sbatch_carries_the_interface_variables_to_every_node(tmp_path, export):
    """Under `sbatch --export=NONE` (SLURM_EXPORT_ENV=NONE in the batch shell) srun starts its tasks without the
    batch environment unless told --export=ALL: the interface variables set in the job must still arrive."""
    env = {k: v for k, v in INTERFACES.items() if k != "TORCH_EXTENSIONS_DIR"}
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out"), "--dry_run"], SLURM_EXPORT_ENV=export,
                 **env)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0, text
    assert (tmp_path / "fake.log").read_text().splitlines()[1] == (
        "env: GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=eth1 FI_PROVIDER=efa UCX_TLS=rc,sm")


@pytest.mark.parametrize("env, gpus", [({}, None), ({"SLURM_GPUS_ON_NODE": "4"}, "4"),
                                       ({"GPUS_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "4"}, "2"),
                                       ({"SLURM_GPUS_ON_NODE": "4", "inherited": "1"}, None)])
def test_sbatch_leaves_the_gpu_count_to_launch_sh_without_gres(tmp_path, env, gpus):
    """A cluster without GPU GRES (#SBATCH --gpus-per-node deleted: sbatch refused it) sets no SLURM_GPUS_ON_NODE: the
    launcher was given --num_gpus 8 and never counted, so ranks 4-7 of a 4-GPU node refused. Now it gets none and
    counts its own (launch.sh: CUDA_VISIBLE_DEVICES, nvidia-smi; 2 CPU ranks on CPU). A job submitted from inside a
    GPU job inherits its SLURM_GPUS_ON_NODE (sbatch copies the environment): its record has no GPU, so none either."""
    env = dict(env)
    if env.pop("inherited", None):
        (tmp_path / "scontrol.log.state").write_text("own_env=0\n")  # the job's record: no gres/gpu
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out"), "--dry_run"], **env)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0, text
    args = (tmp_path / "fake.log").read_text().splitlines()[0]
    assert args.endswith(f"--master_port 29694{f' --num_gpus {gpus}' if gpus else ''} -- --resume auto --output_dir "
                         f"{tmp_path}/out --dry_run"), args


@pytest.mark.parametrize("how", ["flag", "recipe"])
def test_a_dry_run_in_any_spelling_is_done(tmp_path, how):
    """A dry run writes no COMPLETE: only the word ` --dry_run ` was taken for one, so `--dry_run=true`, or a recipe's
    `dry_run: true`, ended "exit 0 but no COMPLETE: a launcher was probably killed ... failing" (exit 1). Now train.py's
    parser decides (the same call that reads the recipe's output_dir). The recipe's job is submitted as the README
    writes it, `sbatch --nodes 1 ...`: the stand-in took the 1 for the script (real sbatch: a value, slurm_opt.c)."""
    out = tmp_path / "out"
    if how == "flag":
        job = sbatch(tmp_path, "0", ["--output_dir", str(out), "--dry_run=true"])
    else:
        (tmp_path / "r.yaml").write_text(f"dry_run: true\noutput_dir: {out}\n")
        job = sbatch(tmp_path, "0", ["--config", "r.yaml"], opts=("--nodes", "1", "-J", "dry", "--exclusive", "-t", "10"))
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and "slurm.sbatch[4242]: done" in text and "failing" not in text, text
    assert f"output dir {out}" in text, text


def test_launch_cmd_is_words_a_container_runtime_can_lead(tmp_path):
    """LAUNCH_CMD='apptainer exec --nv img.sif scripts/launch.sh' (a container per node) ran as one word: 'No such
    file or directory', every node. Now split into words (no quotes, no expansion): `env VAR=x LAUNCH` here stands in
    for the runtime, and the real launch.sh under it counts this node's ranks (CPU: 2) with no --num_gpus given."""
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out"), "--dry_run"],
                 LAUNCH_CMD=f"env  GLOO_SOCKET_IFNAME=wrapped {os.path.join(STUBS, 'fake_launch')}")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0, text
    log = (tmp_path / "fake.log").read_text().splitlines()
    assert log[0].startswith("args: --no_ssh --nnodes 1 --node_rank 0 ") and log[1].startswith(
        "env: GLOO_SOCKET_IFNAME=wrapped "), log
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out"), "--dry_run"], DS_ACCELERATOR="cpu",
                 TMPDIR=str(tmp_path), LAUNCH_CMD=f"{os.path.join(ROOT, 'scripts', 'launch.sh')} --print-only")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and f"/ulysses_hostfile.{os.getuid()}.1x2 --no_ssh --node_rank 0 --master_addr " \
        "127.0.0.1 --master_port 29694 " in text, text  # 1 node x 2 ranks




@needs_2_cpus
@pytest.mark.parametrize("env, cpus", [
    ({}, "all"),  # the node's CPUs (SLURM_CPUS_ON_NODE / SLURM_JOB_CPUS_PER_NODE from the allocation)
    ({"SLURM_JOB_CPUS_PER_NODE": "1,2(x3)"}, 1),  # uneven nodes: what the smallest can give
    ({"SLURM_CPUS_PER_TASK": "1"}, 1),  # sbatch -c 1: the user's number
])
def test_sbatch_gives_each_nodes_task_the_nodes_cpus(tmp_path, env, cpus):
    """The srun stand-in confines the step's task as Slurm does (one CPU unless --cpus-per-task): the launcher of
    each node (here its stand-in) must run on the CPUs the job has there, not on one core."""
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out"), "--dry_run"], SRUN_LOG=str(tmp_path / "srun"),
                 **env)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0, text
    mine = sorted(os.sched_getaffinity(0))
    want = mine if cpus == "all" else mine[:1]
    assert f" --cpus-per-task={len(want)} --cpu-bind=none " in (tmp_path / "srun").read_text(), text
    seen = (tmp_path / "fake.log").read_text().splitlines()[2]
    assert seen.startswith("cpus: ") and cpu_set(seen[6:]) == want, (seen, text)


# --- two nodes: the srun stand-in runs one task per node (SLURM_NODEID 0 and 1), honouring --kill-on-bad-exit ---

TWO_NODES = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "127.0.0.1,localhost", "SRUN_KILL_WAIT": "5",
             "STATE_SETTLE_S": "8", "SCONTROL_NODES": "gpu[1-8]"}  # the cluster's other nodes (the partition's)
# A node whose processes were all SIGKILLed never records its exit: slurm.sbatch looks for the record the whole
# STATE_SETTLE_S, so those cases take 2 s (8 s each before); the look itself is tested by a record that comes 3 s late
# (test_a_nodes_exit_record_seen_late_does_not_exclude_it, TWO_NODES' 8 s)


def node_lines(tmp_path, node: int) -> list[str]:
    return [x[len(f"node {node}: "):] for x in (tmp_path / "fake.log").read_text().splitlines()
            if x.startswith(f"node {node}: ")]


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_sbatch_requeues_a_lost_node_without_it(tmp_path, how):
    """A lost node is a requeue (69, base/exits.py), not a failure, and the next run excludes it. `killed`: every
    process of node 1 SIGKILLed (its task dies of a signal, no exit recorded): srun ends the step (node 0 gets
    SIGTERM). `stalled`: node 1's ranks stopped beating (hung, cut off): node 0's launcher exits 69 naming node 1 in
    LAUNCH_LOST_FILE, node 1 is ended by srun. Either way: requeue, then ExcNodeList += node 1's host (the job pending). (The
    job used to fail: "failed with 137" / "failed with 69: not requeueing".)"""
    env = dict(TWO_NODES, FAKE_EXIT_1="kill", FAKE_EXIT_0="wait", FAKE_EXIT_AFTER="143", FAKE_AFTER_READY="0",
               STATE_SETTLE_S="2") if how == "killed" else \
        dict(TWO_NODES, FAKE_EXIT_0="69", FAKE_LOST="1", FAKE_EXIT_1="wait", FAKE_EXIT_AFTER="69", FAKE_AFTER_READY="1")
    (tmp_path / "scontrol.log.state").write_text("exc=gpu7\n")  # excluded by an earlier requeue: kept
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], **env)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0, text
    assert requeues(tmp_path) == ["requeue 4242", "update JobId=4242 ExcNodeList=gpu7,localhost"], text
    assert "node(s) 1 lost (localhost)" in text and "training exited with 69" in text, text
    assert "got SIGTERM" in node_lines(tmp_path, 1 if how == "stalled" else 0), text  # srun ended the step


def test_an_array_task_requeues_itself_and_srun_starts_one_launcher_a_node(tmp_path):
    """Submitted as `sbatch --array=0-3 --ntasks-per-node=4 ...`, the last task: its SLURM_JOB_ID is the array's own
    id, which `scontrol requeue` reads as every task of the array (the running siblings killed unsaved, the finished
    ones run again): it now requeues 4242_3. The batch shell's SLURM_NTASKS=8 was srun's -n, which dropped the
    script's --ntasks-per-node=1: 4 launchers a node racing for one store; it is one a node."""
    job = sbatch(tmp_path, "75", ["--output_dir", str(tmp_path / "out")], SLURM_ARRAY_JOB_ID="4242",
                 SLURM_ARRAY_TASK_ID="3", SLURM_NTASKS="8", **TWO_NODES)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and requeues(tmp_path) == ["requeue 4242_3"], text
    starts = [ln for ln in (tmp_path / "fake.log").read_text().splitlines() if "args: " in ln]
    assert sorted(ln.split(":")[0] for ln in starts) == ["node 0", "node 1"], starts


def test_a_job_submitted_from_an_array_task_requeues_itself_not_the_task(tmp_path):
    """A plain job submitted from inside task 3 of array 4200 inherits SLURM_ARRAY_JOB_ID/TASK_ID (sbatch copies the
    environment): it requeued 4200_3, the parent task (killed unsaved or run again), and left itself to fail. Its own
    id is not the array's: it requeues 4242, as any array task but the last one may."""
    job = sbatch(tmp_path, "75", ["--output_dir", str(tmp_path / "out")], SLURM_ARRAY_JOB_ID="4200",
                 SLURM_ARRAY_TASK_ID="3")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and requeues(tmp_path) == ["requeue 4242"], text


@pytest.mark.parametrize("narrow", ["req_nodes=127.0.0.1,localhost", "features=gpu&hbm80g"])
def test_a_job_asking_for_its_nodes_is_requeued_without_an_exclusion(tmp_path, narrow):
    """A lost node of a job submitted with -w (ReqNodeList): the exclusion left it pending forever (ReqNodeNotAvail),
    unsaid. It is now requeued with its nodes, and says so. A constraint (-C: Features, mandatory on some sites) is
    no such job: its lost node is excluded as any other's (the partition's count decides)."""
    (tmp_path / "scontrol.log.state").write_text(narrow + "\n")
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")],
                 **dict(TWO_NODES, FAKE_EXIT_1="kill", FAKE_EXIT_0="wait", FAKE_EXIT_AFTER="143", FAKE_AFTER_READY="0",
                        STATE_SETTLE_S="2"))
    text = job.communicate(timeout=60)[0]
    if narrow.startswith("req_nodes"):
        assert job.returncode == 0 and requeues(tmp_path) == ["requeue 4242"], text
        assert "not excluding localhost: the job asks for its nodes" in text, text
    else:
        assert requeues(tmp_path) == ["requeue 4242", "update JobId=4242 ExcNodeList=localhost"], text


def test_the_jobs_bookkeeping_is_its_own_and_goes_at_its_end(tmp_path):
    """.cache/slurm/<job>.* (stalled-requeue and crash counts, start misses, a pending exclusion) were named by the job
    id alone and never removed: a later job given the same id (a cluster sharing the file system, MaxJobId wrapping)
    inherited them; here 3 stalled requeues refused a healthy one. Named by cluster and job now, gone at the end."""
    book = tmp_path / ".cache" / "slurm"
    book.mkdir(parents=True)
    (book / "4242.progress").write_text("3 -\n")  # another cluster's job 4242, three requeues without progress
    (tmp_path / "out").mkdir()  # train.py's (a folder not here after a save is a container's: unknown, no progress kept)
    job = sbatch(tmp_path, "75", ["--output_dir", str(tmp_path / "out")], SLURM_CLUSTER_NAME="c1")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and requeues(tmp_path) == ["requeue 4242"], text
    assert (book / "c1.4242.progress").exists()  # kept across the requeue
    (tmp_path / "scontrol.log.state").unlink()
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], SLURM_CLUSTER_NAME="c1",
                 FAKE_COMPLETE=str(tmp_path / "out" / "COMPLETE"))
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and "done" in text, text
    assert sorted(p.name for p in book.iterdir()) == ["4242.progress"], text  # the job's own gone at its end


def test_a_nodes_exit_record_seen_late_does_not_exclude_it(tmp_path):
    """Both nodes saved and exited 75, but node 1's record reaches the batch host's view of the shared file system 3 s
    late: slurm.sbatch looks for it again by name (STATE_SETTLE_S) and requeues plainly; it used to declare node 1
    lost at once and exclude a healthy node from every later requeue."""
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], FAKE_EXIT_0="75", FAKE_EXIT_1="late:75:3",
                 **TWO_NODES)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and requeues(tmp_path) == ["requeue 4242"], text
    assert "lost" not in text and "training exited with 75" in text, text


@pytest.mark.parametrize("start", ["late", "never"])
def test_a_node_slow_to_start_is_excluded_only_on_evidence(tmp_path, start):
    """Two attempts of a job (restart 0, then 1) in which node 1's ranks never reach the job's store within the start
    bound: node 0 exits 69 naming node 1 absent (LAUNCH_LOST_FILE `1 absent`, base/node_store.py). `late`: node 1's
    task starts 1 s late and its launcher runs (its ranks still importing from a cold file system): never excluded.
    `never`: node 1's task never begins (the srun stand-in holds it 60 s, an image pull; the step ends first): a
    first time is not excluded, the second attempt in a row is. Both used to exclude node 1 at the first attempt."""
    env = dict(TWO_NODES, FAKE_EXIT_0="69", FAKE_ABSENT="1", STATE_SETTLE_S="2")  # node 1's start looked for 2 s
    if start == "late":
        env.update(SRUN_DELAY_1="1", FAKE_EXIT_1="wait", FAKE_EXIT_AFTER="69", FAKE_AFTER_READY="1")
    else:
        env.update(SRUN_DELAY_1="60")
    texts = []
    for restart in (0, 1):
        (tmp_path / "fake.log").unlink(missing_ok=True)  # each attempt's own (node 0 waits for node 1's "ready" there)
        job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], SLURM_RESTART_COUNT=str(restart), **env)
        texts.append(job.communicate(timeout=60)[0])
        assert job.returncode == 0, texts[-1]
        assert requeues(tmp_path) == ["requeue 4242"] * (restart + 1) + (
            ["update JobId=4242 ExcNodeList=localhost"] if start == "never" and restart == 1 else []), texts
    starts = tmp_path / ".cache" / "slurm" / "4242.starts"
    if start == "late":
        assert "node 1 (localhost) started, but none of its ranks reached the job's store" in texts[0], texts[0]
        assert not starts.exists() and "got SIGTERM" in node_lines(tmp_path, 1), texts
    else:
        assert "not excluded for a first time" in texts[0] and "in 2 attempts in a row: excluded" in texts[1], texts
        assert starts.read_text() == "localhost 2\n" and node_lines(tmp_path, 1) == [], texts


def test_a_node_whose_container_fails_to_start_is_requeued_then_excluded(tmp_path):
    """Issue 48's residual: node 1's task never begins because slurmstepd cannot start it (the srun stand-in's
    SRUN_FAIL_1: pyxis' "couldn't start container", srun's "task 1: Exited with exit code 1", as NVIDIA/pyxis#61
    shows), so --kill-on-bad-exit ends node 0 (SIGTERM, 143) before node 0 could call node 1 absent. Two attempts in
    a row: the first is requeued as it is (a registry's hiccup passes), the second without node 1. Before, the job
    failed with 143 at the first attempt ("failed with 143: not requeueing"): neither a retry nor an exclusion."""
    # node 1's failure comes after its image's import time (SRUN_DELAY_1), as pyxis' does: at once, a loaded box's
    # node 0 was killed before it recorded its own start (no node started: "failed with 143", a clean clone's flake)
    env = dict(TWO_NODES, SRUN_FAIL_1="1", SRUN_DELAY_1="2", FAKE_EXIT_0="wait", FAKE_EXIT_AFTER="143",
               STATE_SETTLE_S="2")
    texts = []
    for restart in (0, 1):
        job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], SLURM_RESTART_COUNT=str(restart), **env)
        texts.append(job.communicate(timeout=60)[0])
        assert job.returncode == 0, texts[-1]
        assert requeues(tmp_path) == ["requeue 4242"] * (restart + 1) + (
            ["update JobId=4242 ExcNodeList=localhost"] if restart == 1 else []), texts
    assert "couldn't start container" in texts[0] and "task 1: Exited with exit code 1" in texts[0], texts[0]
    assert "node(s) 1 (localhost) never started" in texts[0] and "not excluded for a first time" in texts[0], texts[0]
    assert "in 2 attempts in a row: excluded" in texts[1], texts[1]
    assert "got SIGTERM" in node_lines(tmp_path, 0) and node_lines(tmp_path, 1) == [], texts


def test_a_start_clears_a_nodes_start_miss(tmp_path):
    """Misses count in a row: node 1 (localhost) missed the start once in an earlier attempt; this attempt it starts
    (both nodes save and exit 75): its miss is forgotten, so a later miss is a first one again, not an exclusion."""
    starts = tmp_path / ".cache" / "slurm" / "4242.starts"
    starts.parent.mkdir(parents=True)
    starts.write_text("localhost 1\ngpu3 1\n")  # gpu3: not in this attempt, its miss kept
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], FAKE_EXIT_0="75", FAKE_EXIT_1="75",
                 SLURM_RESTART_COUNT="1", **TWO_NODES)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and requeues(tmp_path) == ["requeue 4242"], text
    assert starts.read_text() == "gpu3 1\n", text


def test_sbatch_requeues_a_lost_node_that_cannot_be_named(tmp_path):
    """69 with no node named (a store lost, every node reporting it): requeued as it is."""
    job = sbatch(tmp_path, "69", ["--output_dir", str(tmp_path / "out")], **TWO_NODES)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and requeues(tmp_path) == ["requeue 4242"], text


def test_srun_ends_the_step_when_a_nodes_launcher_fails(tmp_path):
    """Node 1's launcher fails at once (node 0's store not starting is the same for srun): srun --kill-on-bad-exit
    ends node 0 (SIGTERM) within seconds; the job fails with node 1's code (the first failure, not node 0's 143).
    Before, --kill-on-bad-exit=0: node 0 waited (here 60 s; a real node waits for the store, START_WAIT_S)."""
    t0 = time.time()
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], FAKE_EXIT_1="3", FAKE_EXIT_0="wait",
                 FAKE_EXIT_AFTER="143", FAKE_AFTER_READY="0", **TWO_NODES)
    text = job.communicate(timeout=120)[0]
    assert time.time() - t0 < 30, text
    assert "got SIGTERM" in node_lines(tmp_path, 0), text
    assert job.returncode == 3 and "training exited with 3" in text and requeues(tmp_path) == [], text


def test_a_node_preempted_first_does_not_end_the_others(tmp_path):
    """Node 1 exits 75 (its save done) while node 0 still writes the same checkpoint: 75 is not a bad exit for srun
    (the node's bash reports it as 0), so node 0 is not killed; it exits 75 and the job is requeued."""
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], FAKE_EXIT_1="75", FAKE_EXIT_0="sleep:3:75",
                 **TWO_NODES)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and requeues(tmp_path) == ["requeue 4242"], text
    assert "got SIGTERM" not in node_lines(tmp_path, 0), text
    assert node_lines(tmp_path, 1)[0].startswith("args: --no_ssh --nnodes 2 --node_rank 1 --master_addr 127.0.0.1 ")


@pytest.mark.parametrize("code, job_rc, requeued", [("75", 0, True), ("3", 3, False)])
def test_a_job_spooled_before_a_pull_requeues_with_the_pulled_library(tmp_path, code, job_rc, requeued):
    """Slurm runs the copy of slurm.sbatch it spooled at submission, which sources scripts/slurm_requeue.sh from the
    checkout as it is now: a `git pull` between a submission and its requeue pairs the old script with the new
    library. tests/stubs/slurm.sbatch.spooled is the script as of e550b89~1 (before the library read `finished`,
    which that script never sets: under set -u a preemption ended 'finished: unbound variable', exit 1, never
    requeued)."""
    (tmp_path / "scripts").symlink_to(os.path.join(ROOT, "scripts"))  # the work dir holds the checkout's scripts/
    e = clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path), PYTHONPATH=ROOT,
                  SCONTROL_LOG=str(tmp_path / "scontrol.log"), FAKE_LOG=str(tmp_path / "fake.log"), FAKE_EXIT=code,
                  LAUNCH_CMD=os.path.join(STUBS, "fake_launch"))
    job = subprocess.run(["sbatch", os.path.join(STUBS, "slurm.sbatch.spooled"), "--output_dir", str(tmp_path / "o")],
                         cwd=tmp_path, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert "unbound variable" not in job.stdout and job.returncode == job_rc, job.stdout
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else []), job.stdout
