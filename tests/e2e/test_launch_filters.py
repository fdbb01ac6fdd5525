"""scripts/launch.sh's --include/--exclude/--num_nodes and --launcher, checked before anything starts (`--print-only`,
stand-ins; no rank is started). `deepspeed --include localhost:4,5,6,7` is how users pick GPUs on a shared box: on one
node launch.sh dropped the filter and ran on every GPU. A host or slot the hostfile lacks was the runner's traceback (or
with --no_ssh an AssertionError after 20 s). --launcher mpich lost every exit code (75, 1, 2 became 0) and impi/slurm
ranks never got a save request."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from base.host import usable_cpus
from tests.e2e.launchers import DS, LAUNCH, ROOT, STUBS, TRAIN, clean_env, launch, needs_2_cpus, wait_for
from training.launcher import launcher_refusal

CORES = len(usable_cpus())  # what launch.sh counts: the affinity within a CPU quota (base/host.py)


def eight_gpus(tmp_path) -> str:
    """PATH with an nvidia-smi that lists 8 GPUs (DS_ACCELERATOR left to launch.sh: cuda)."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: NVIDIA H100 (UUID: x)\"; done\n")
    smi.chmod(0o755)
    return f"{tmp_path / 'bin'}:{os.environ['PATH']}"


def one_port(out: str) -> str:
    """A one-node launch's port: free when launch.sh looked (scripts/launch_env.sh default_port), not 29500."""
    port = int(re.search(r"--master_port (\d+)", out).group(1))
    assert port != 29500, out
    return re.sub(r"--master_port \d+", "--master_port PORT", out)


def refused(p: subprocess.CompletedProcess, *words: str) -> bool:
    return p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1 and all(w in p.stderr for w in words)


@pytest.mark.parametrize("opts, ranks", [
    (["--include", "localhost:1"], 1), (["--include", "localhost:4,5,6,7"], 4), (["--exclude", "localhost:0"], 7)])
def test_one_node_runs_on_the_gpus_picked(tmp_path, opts, ranks):
    p = launch(["--print-only", *opts, "--", "--x"], tmp_path, PATH=eight_gpus(tmp_path), OMP_NUM_THREADS=None)
    assert p.returncode == 0, p.stderr
    assert one_port(p.stdout).endswith(f" {DS} {' '.join(opts)} --master_port PORT {TRAIN} --x\n"), p.stdout
    assert f" OMP_NUM_THREADS={max(1, CORES // ranks)} " in p.stdout, p.stdout  # this node's ranks: the GPUs picked


@pytest.mark.parametrize("opts, env, words", [
    (["--include", "localhost:8"], {}, ["localhost has no slot 8", "0-7"]),
    (["--include", "gpu1"], {}, ["gpu1 is not a host of this node", "localhost"]),
    (["--exclude", "localhost"], {}, ["nothing left to run on"]),
    (["--include", "localhost:1"], {"CUDA_VISIBLE_DEVICES": "4,5"}, ["CUDA_VISIBLE_DEVICES=4,5 and --include"]),
    (["--include", "localhost:1"], {"DS_ACCELERATOR": "cpu"}, ["on CPU a rank is a process: give --num_gpus N"]),
    # the runner drops the selection under --num_gpus: 0-1, another job's GPUs (scripts/launch_env.sh, more cases below)
    (["--num_gpus", "2"], {"CUDA_VISIBLE_DEVICES": "4,5"}, ["CUDA_VISIBLE_DEVICES=4,5 but --num_gpus", "devices 0-1"]),
    (["--torchrun", "--include", "localhost:1"], {}, ["torchrun takes no", "CUDA_VISIBLE_DEVICES"]),
    (["--no_ssh", "--include", "localhost:1"], {}, ["with --no_ssh name the hosts of your hostfile"]),
    (["--num_nodes", "2"], {}, ["--num_nodes 2 needs -H HOSTFILE"]),
])
def test_one_node_filters_it_cannot_honour_are_one_line(tmp_path, opts, env, words):
    p = launch(["--print-only", *opts, "--", "--x"], tmp_path, PATH=eight_gpus(tmp_path), **env)
    assert refused(p, *words), p.stdout + p.stderr


def test_num_nodes_1_on_one_node_is_what_it_runs_anyway(tmp_path):
    p = launch(["--print-only", "--num_nodes", "1", "--", "--x"], tmp_path, PATH=eight_gpus(tmp_path))
    assert p.returncode == 0 and one_port(p.stdout).endswith(f" {DS} --num_gpus 8 --master_port PORT {TRAIN} --x\n"), \
        p.stderr


@pytest.mark.parametrize("opts, words", [
    (["-H", "hf2", "--include", "hC"], ["--include hC: hC is not a host of hostfile hf2: its hosts are hA hB"]),
    (["-H", "hf2", "--include", "hA:3"], ["--include hA:3: hA has no slot 3 in hostfile hf2: its slots are 0-0"]),
    (["-H", "hf2", "--exclude", "hA@hB"], ["nothing left to run on"]),
    # forms deepspeed reads otherwise (hA@hA:0: hA:0 alone; hA:: a traceback) than a whole host (launch.sh's count)
    (["-H", "hf2", "--include", "hA@hA:0"], ["hA is named whole and again: name it once whole, or by its slots"]),
    (["-H", "hf2", "--include", "hA:"], ["hA has an empty slot list: name it once whole, or by its slots"]),
    (["-H", "hf2", "--num_nodes", "3"], ["--num_nodes 3 but hostfile hf2 has 2 hosts"]),
    (["--no_ssh", "-H", "hf2", "--include", "hA", "--node_rank", "1", "--master_addr", "a"],
     ["--node_rank 1 is not in [0, 1) (the nodes: hA)"]),  # deepspeed: an AssertionError after 20 s
    (["--no_ssh", "-H", "hf2", "--exclude", "hB", "--nnodes", "2", "--master_addr", "a"],
     ["--nnodes 2 but hostfile hf2 has 1 hosts after --exclude"]),
])
def test_a_host_or_slot_the_hostfile_lacks_is_one_line(tmp_path, opts, words):
    (tmp_path / "hf2").write_text("hA slots=1\nhB slots=1\n")
    p = launch(["--print-only", *opts, "--", "--x"], tmp_path, DS_ACCELERATOR="cpu")
    assert refused(p, *words), p.stdout + p.stderr


@needs_2_cpus
@pytest.mark.parametrize("opts", [["--include", "hB"], ["--no_ssh", "--exclude", "hA", "--node_rank", "0"]])
def test_this_nodes_ranks_are_counted_after_the_filter(tmp_path, opts):
    """OMP_NUM_THREADS = CPUs / the ranks here: hB's slots, not the hostfile's first line's."""
    (tmp_path / "hf").write_text(f"hA slots=1\nhB slots={2 * CORES}\n")
    p = launch(["--print-only", "-H", "hf", *opts, "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=None)
    assert p.returncode == 0 and " OMP_NUM_THREADS=1 " in p.stdout, p.stdout + p.stderr


FILTERS = [("", ""), ("w1", ""), ("w1:0,3@w0", ""), ("w0:1@w0:0", ""), ("", "w1"), ("", "w1:0,1,2,3"), ("", "w0:1@w2"),
           ("w2:0@w1:2", ""), ("w3", ""), ("w1:4", ""), ("", "w2:1"), ("", "w0@w1@w2")]


@pytest.mark.parametrize("include, exclude", FILTERS)
def test_the_hosts_and_ranks_are_deepspeeds(include, exclude):
    """launch.sh's reading of a filter (its `active`, scripts/launch_hosts.sh) against the runner's own
    (parse_inclusion_exclusion)."""
    import collections

    from deepspeed.launcher.runner import parse_inclusion_exclusion

    pool = collections.OrderedDict(w0=2, w1=4, w2=1)
    try:
        theirs = [f"{h} {len(s)}" for h, s in parse_inclusion_exclusion(pool, include, exclude).items()] or None
    except ValueError:
        theirs = None
    with open(os.path.join(ROOT, "scripts", "launch_hosts.sh")) as fh:
        text = fh.read()
    fn = text[text.index("\nactive() {") + 1:text.index("\n}\n", text.index("\nactive() {")) + 2]
    p = subprocess.run(["bash", "-c", f'{fn}\ninclude="$1" exclude="$2" num_nodes=""; printf "%s slots=%s\\n" w0 2 w1 4 '
                        f'w2 1 | active "hostfile X"', "-", include, exclude], capture_output=True, text=True)
    assert (p.stdout.splitlines() if p.returncode == 0 else None) == theirs, p.stdout


@pytest.mark.parametrize("launcher, why", [
    ("mpich", "drops each rank's exit code (75, 1, 2 all become 0)"),
    ("impi", "without --local_rank= on their command line, so a save request"),
    ("slurm", "without --local_rank= on their command line, so a save request"),
    ("openmpi", "without RANK"),
])
def test_deepspeed_launchers_that_lose_the_code_or_the_signal_are_refused(tmp_path, launcher, why):
    (tmp_path / "hosts").write_text("n0 slots=2\nn1 slots=2\n")
    p = launch(["--print-only", "-H", "hosts", "--launcher", launcher, "--", "--x"], tmp_path, DS_ACCELERATOR="cpu")
    assert refused(p, f"--launcher {launcher}", why, "use pdsh (the default)", "scripts/slurm.sbatch"), p.stderr
    assert "mpich" not in p.stderr.replace("--launcher mpich", "") and "impi" not in p.stderr.replace("launcher impi", "")
    assert "mpich" not in launcher_refusal({"PMI_SIZE": "4"})  # train.py's own refusal recommends none of them


def test_a_save_request_goes_over_pdsh_to_the_hosts_left_after_the_filter(tmp_path):
    """pdsh mode: launch.sh's first SIGTERM becomes `pdsh -w <the filter's hosts> <SIGUSR1 to this launch's ranks>`
    (a pdsh stand-in logs it; the deepspeed runner is tests/stubs/fake_launch); hB, whose one slot is excluded, runs
    nothing. The second SIGINT sends SIGTERM there the same way, the third SIGKILL (tests/e2e/test_launch_stop.py)."""
    (tmp_path / "hf").write_text("hA slots=2\nhB slots=1\nhC slots=1\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pdsh").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {tmp_path}/pdsh.log\n')
    (tmp_path / "bin" / "pdsh").chmod(0o755)
    log = tmp_path / "fake.log"
    # SIGINT at its default, as a terminal's shell starts it: a test run in the background (`make test &`, CI) has it
    # ignored, inherited, and bash cannot trap a signal ignored at its start (the run hung for the second SIGINT)
    p = subprocess.Popen([LAUNCH, "-H", "hf", "--exclude", "hB:0", "--", "--x"], cwd=tmp_path, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env=clean_env(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", DS_ACCELERATOR="cpu",
                                       DEEPSPEED=os.path.join(STUBS, "fake_launch"), FAKE_LOG=str(log),
                                       FAKE_EXIT="wait"))
    try:
        wait_for(lambda: log.exists() and "ready" in log.read_text(), 30, "the launcher stand-in")
        p.send_signal(signal.SIGTERM)
        wait_for(lambda: (tmp_path / "pdsh.log").exists(), 30, "the pdsh stand-in")
        for _ in range(10):  # the third SIGINT: SIGKILL to the launcher (two that come while a command runs are one
            p.send_signal(signal.SIGINT)  # pending signal: sent until it is gone, 1 s apart)
            time.sleep(1.0)
            if p.poll() is not None:
                break
        out = p.communicate(timeout=30)[0]
    finally:
        p.kill()
    sent = (tmp_path / "pdsh.log").read_text().splitlines()  # one a signal: the SIGTERM's, the SIGINTs'
    launch_id = re.search(r"grep -qxF 'ULYSSES_LAUNCH_ID=([^']+)'", sent[0]).group(1)  # this launch's, not another's
    assert [re.sub(r"kill -([A-Z0-9]+) ", "kill -SIG ", c) for c in sent] == [
        f"-w hA,hC for p in $(pgrep -f '{TRAIN} --local_rank=[0-9]'); do tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null | "
        f"grep -qxF 'ULYSSES_LAUNCH_ID={launch_id}' && kill -SIG $p; done; true"] * len(sent), out
    sigs = [re.search(r"kill -([A-Z0-9]+) ", c).group(1) for c in sent]  # a 4th SIGINT, sent as it ended: KILL again
    assert sigs[:4] == ["USR1", "USR1", "TERM", "KILL"] and set(sigs[4:]) <= {"KILL"}, out


def helper(call: str, **env: str) -> subprocess.CompletedProcess:
    """A function of scripts/launch_env.sh (sourced by launch.sh) in a bare bash, with `env`."""
    return subprocess.run(["bash", "-c", f'. "$0"; {call}', os.path.join(ROOT, "scripts", "launch_env.sh")],
                          env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True)


@pytest.mark.parametrize("cvd, fixed, ranks, words", [
    ("4,5", 1, 2, ["CUDA_VISIBLE_DEVICES=4,5 but --no_ssh runs this node's 2 ranks on devices 0-1", "--torchrun"]),
    ("1,0", 1, 2, ["CUDA_VISIBLE_DEVICES=1,0 but --no_ssh"]),
    ("0", 1, 2, ["CUDA_VISIBLE_DEVICES=0 but --no_ssh runs this node's 2 ranks"]),
    ("GPU-8932f937-d72c,GPU-1c2d", 0, 2, ["names a device by UUID (GPU-8932f937-d72c)", "--torchrun or srun"]),
    ("MIG-1a2b", 1, 1, ["names a device by UUID (MIG-1a2b)"]),
    ("0,1", 1, 2, []), ("0,1,2,3", 1, 2, []), ("4,5", 0, 2, []), ("", 1, 8, []),
    ("-1", 1, 2, []), ("-1", 0, 2, []),  # "no device": what unset is (it was refused as a UUID)
])
def test_visible_devices_a_deepspeed_launch_would_not_use_are_one_line(cvd, fixed, ranks, words):
    """--num_gpus and --no_ssh run on 0..N-1 whatever CUDA_VISIBLE_DEVICES selects (a --gres job given GPUs 4-7
    trained on another job's 0-3); UUIDs (Slurm's MIG devices) were the runner's traceback."""
    p = helper(f"visible_refusal {fixed} {ranks} --no_ssh", CUDA_VISIBLE_DEVICES=cvd)
    assert p.returncode == (1 if words else 0) and all(w in p.stdout for w in words), p.stdout + p.stderr
    assert len(p.stdout.splitlines()) == (1 if words else 0)


@pytest.mark.parametrize("cvd", ["-1", "4,5", "GPU-8932f937-d72c"])
def test_visible_devices_are_not_judged_on_cpu(cvd):
    """`CUDA_VISIBLE_DEVICES=-1 DS_ACCELERATOR=cpu launch.sh --num_gpus 2` (a CPU run hiding the GPUs) was refused as a
    UUID; on CPU (launch.sh's DS_ACCELERATOR: yours, or cpu when nvidia-smi lists none) no device is selected."""
    for fixed in (0, 1):
        p = helper(f"visible_refusal {fixed} 2 --num_gpus", CUDA_VISIBLE_DEVICES=cvd, DS_ACCELERATOR="cpu")
        assert p.returncode == 0 and p.stdout == "", p.stdout + p.stderr


def ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except OSError:
        return 32768


def test_default_port_is_free_on_one_node_and_agreed_on_several():
    """One node: a port free when launch.sh looked, not deepspeed's 29500 (two runs on one node joined one store), and
    below the ephemeral range (bind(("", 0)) gave one there: an outgoing connection could take it before rank 0's bind),
    the srun steps' ports and Kubernetes' NodePorts.
    Several nodes must agree without talking: the srun step's port (base/slurm_env.job_port) when one step is the whole
    launch, else the job's, else 29500."""
    from base.slurm_env import job_port

    python = os.path.join(ROOT, ".venv", "bin", "python")
    ports = {int(helper(f"default_port 1 {python}").stdout) for _ in range(3)}
    low = ephemeral_low()
    # below the srun steps' 20000-29999 and Kubernetes' NodePorts (30000-32767) too (a review)
    assert 29500 not in ports and all(10000 <= p < min(20000, low) for p in ports), (ports, low)
    step = dict(SLURM_JOB_ID="1234567", SLURM_STEP_ID="3", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2")
    assert helper(f"nnodes=2 default_port 0 {python}", **step).stdout.strip() == str(job_port(1234567, 3))
    assert helper(f"nnodes=2 default_port 0 {python}", SLURM_JOB_ID="1234567").stdout.strip() == str(job_port(1234567))
    assert helper(f"nnodes=2 default_port 0 {python}").stdout.strip() == "29500"  # outside Slurm, or over ssh


def per_node_steps(call: str) -> set[str]:
    """`call`'s output on each node of a 3-node launch started one srun step per node (`srun -N1 -w nodeK
    scripts/launch.sh --no_ssh --node_rank K ...`), plus node 0 started from the batch shell (Slurm's batch step: its
    SLURM_STEP_ID, no step counts) and a launch whose steps cover 2 nodes of 3."""
    runs = [dict(SLURM_STEP_ID=str(k), SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS="1", SLURM_NODEID="0")
            for k in range(3)]
    runs += [dict(SLURM_STEP_ID="-5"), dict(SLURM_STEP_ID="4294967291"),
             dict(SLURM_STEP_ID="4", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2", SLURM_NODEID="1")]
    return {helper(f"nnodes=3 master_port=29611 {call}", SLURM_JOB_ID="7", **e).stdout for e in runs}


def test_nodes_started_by_one_srun_each_agree():
    """The reviewer's case: each node its own srun step (or node 0 the batch shell) derived its own id ("3 nodes step
    7.0" / "7.1": every other node refused as "another run", exit 2) and its own default port (300 s, then 69)."""
    python = os.path.join(ROOT, ".venv", "bin", "python")
    ids, ports = per_node_steps("launch_id 1"), per_node_steps(f"default_port 0 {python}")
    assert len(ids) == 1 and ids != {""} and "step" not in ids.pop(), ids
    assert len(ports) == 1 and ports != {""}, ports


def test_launch_id_is_shared_by_the_nodes_of_one_launch_only():
    """--no_ssh / --torchrun nodes each derive it alike (base/run_identity.py compares it); one launcher makes its own."""
    step = dict(SLURM_JOB_ID="7", SLURM_STEP_ID="0", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2")
    one = helper("nnodes=2 launch_id 1", **step, SLURM_NODEID="1", SLURM_PROCID="1").stdout
    assert one == helper("nnodes=2 launch_id 1", **step).stdout != "" and "step 7.0" in one
    assert one != helper("nnodes=2 launch_id 1", **{**step, "SLURM_STEP_ID": "1"}).stdout
    assert helper("nnodes=3 launch_id 1", **step).stdout not in ("", one)
    # an interactive `srun -N2 --pty bash` (one task) is no launch's step: its shell's node 0 and an srun'd node 1 agree
    assert helper("nnodes=2 master_port=1 launch_id 1", **{**step, "SLURM_STEP_NUM_TASKS": "1"}).stdout == \
        helper("nnodes=2 master_port=1 launch_id 1", SLURM_JOB_ID="7").stdout
    assert helper("nnodes=2 master_port=1 launch_id 1").stdout != helper("nnodes=2 master_port=2 launch_id 1").stdout
    assert helper("nnodes=1 launch_id 0").stdout != helper("nnodes=1 launch_id 0").stdout


@pytest.mark.parametrize("cvd", ["-1", "", "NoDevFiles"])
def test_gpus_hidden_by_cuda_visible_devices_make_a_cpu_launch(tmp_path, cvd):
    """CUDA_VISIBLE_DEVICES=-1 (or empty, or Slurm's NoDevFiles) hides every GPU: launch.sh counted "-1" as one GPU
    and took cuda from nvidia-smi, which ignores the variable (a review)."""
    p = launch(["--print-only", "--", "--x"], tmp_path, PATH=eight_gpus(tmp_path), CUDA_VISIBLE_DEVICES=cvd)
    assert p.returncode == 0 and "DS_ACCELERATOR=cpu " in p.stdout and " --num_gpus 2 " in p.stdout, p.stdout + p.stderr
