"""scripts/slurm.sbatch with the stand-ins of test_sbatch.py, two nodes: a crash on one node (exit 1: a GPU Xid,
an ECC error) is requeued without that node, bounded (the same failure twice, every node crashing, the cap); the
crash's origin is the node whose rank died, not the node that raised first."""

from __future__ import annotations

import time

import pytest

from tests.e2e.launchers import requeues
from tests.e2e.test_sbatch import TWO_NODES, node_lines, sbatch, updates

# --- a crash on one node (exit 1: a GPU Xid, an ECC error): requeued without it, bounded ---

def crash_run(tmp_path, checkpoint: int, last_step: int, earlier: list[str] = (), **env: str) -> tuple[int, str]:
    """Two nodes; node 1 crashes (its launch.sh's verdict `first`: the job's first failure on record began there) and
    node 0 exits 1 first, stopped by the abort channel, before srun ends node 1 (SIGTERM: 143), as a real job's
    nodes end (the failing rank waits for the others to read its reason). The run's newest checkpoint and last logged
    step as train.py leaves them; `earlier`: this job's crash requeues already recorded."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "LATEST").write_text(f"step_{checkpoint:06d}")
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, last_step + 1)))
    if earlier:
        (tmp_path / ".cache" / "slurm").mkdir(parents=True)
        (tmp_path / ".cache" / "slurm" / "4242.crashes").write_text("".join(f"{x}\n" for x in earlier))
    env = {**TWO_NODES, "FAKE_EXIT_1": "sleep:2:1", "FAKE_CRASH_1": "first", "FAKE_EXIT_0": "1", "FAKE_AFTER_READY": "1",
           "SLURM_RESTART_COUNT": str(len(earlier)), **env}
    job = sbatch(tmp_path, "0", ["--output_dir", str(out)], **env)
    text = job.communicate(timeout=60)[0]
    return job.returncode, text


@pytest.mark.parametrize("earlier", [[], ["0 0 gpu3 10 12"]])
def test_sbatch_requeues_a_crash_on_one_node_without_it(tmp_path, earlier):
    """Node 1's ranks crash, node 0 is stopped by it: requeue, ExcNodeList += node 1's host (as a lost node), the crash recorded with its checkpoint and last step. Also the second crash requeue of a job, when the
    first was another failure (another step). It used to end FAILED ("failed with 1: not requeueing")."""
    if earlier:
        (tmp_path / "scontrol.log.state").write_text("exc=gpu3\n")
    code, text = crash_run(tmp_path, 20, 25, earlier)
    assert code == 0, text
    assert requeues(tmp_path) == ["requeue 4242", f"update JobId=4242 ExcNodeList={'gpu3,' if earlier else ''}"
                                  "localhost"], text
    assert f"node 1 (localhost) crashed (exit 1), no other node on its own (checkpoint step 20, last step 25): crash " \
           f"requeue {len(earlier) + 1} of 2, without that node" in text, text
    assert (tmp_path / ".cache" / "slurm" / "4242.crashes").read_text().splitlines() == [
        *earlier, f"{len(earlier)} 1 localhost 20 25"]
    assert "got SIGTERM" in node_lines(tmp_path, 1), text  # srun ended it: node 0's 1 came first


def test_a_crash_after_a_gang_suspension_is_a_crash_not_a_preemption(tmp_path):
    """Gang scheduling suspended the job once (slurmctld set PreemptTime; nothing clears it before a requeue), then
    node 1's ranks crash and srun TERMs the other node (--kill-on-bad-exit): the batch shell read 'TERM records,
    PreemptTime set' as a GraceTime preemption and requeued without excluding the node (a bug crashing every node
    looped the same way). The crash records decide: a crash requeue without node 1."""
    (tmp_path / "scontrol.log.state").write_text("preempt_time=2026-11-29T10:00:00\n")
    code, text = crash_run(tmp_path, 20, 25, [])
    assert code == 0 and "a preemption (GraceTime)" not in text, text
    assert requeues(tmp_path) == ["requeue 4242", "update JobId=4242 ExcNodeList=localhost"], text


def test_a_node_whose_rank_died_silently_is_the_crashs_origin_not_the_node_that_raised(tmp_path):
    """Node 1's rank dies of SIGKILL (the host's OOM killer; a segfault the same), saying nothing: node 0's rank, its
    peer gone ("Connection reset by peer"), raises and posts the job's first failure (`first` on node 0), and node
    1's launch.sh finds rank 0's reason on record. Node 1's launch.sh now writes `died` (its deepspeed launcher's 247:
    256 - 9, no exit record of that rank), which the batch shell takes as the origin ahead of any `first`: the crash
    requeue excludes node 1. Before, node 0 (healthy) was excluded."""
    code, text = crash_run(tmp_path, 20, 25, FAKE_EXIT_1="247", FAKE_CRASH_1="died", FAKE_EXIT_0="sleep:2:1",
                           FAKE_CRASH_0="first", FAKE_AFTER_READY="0")
    assert code == 0, text
    assert requeues(tmp_path) == ["requeue 4242", "update JobId=4242 ExcNodeList=localhost"], text  # node 1's host
    assert "node 1 (localhost) crashed (exit 247), no other node on its own" in text, text
    assert "the failures of node(s) 0 followed it" in text, text


@pytest.mark.parametrize("case, line", [
    ("every node", "crashed on node(s) 1 0 (exit 1), each on its own, 2 node(s) in the job: not a node's fault"),
    ("same failure", "the same failure twice: a crash after step 25 again, now from the checkpoint of step 20 (node 0 "
                     "at restart 0, now node 1): a bug, not a node: not requeueing"),
    # the same step from a newer checkpoint (a timed save came between): still the same failure, not a node's (a
    # data-dependent exception, one long sample's OOM on one node, excluded a healthy node per requeue)
    ("same step", "the same failure twice: a crash after step 25 again, now from the checkpoint of step 20 (node 0 at "
                  "restart 0, now node 1): a bug, not a node: not requeueing"),
    ("cap", "node 1 (localhost) crashed (exit 1), but this job was already requeued 2 time(s) for a crash "
            "(ULYSSES_MAX_CRASH_REQUEUES=2): not requeueing"),
])
def test_sbatch_does_not_requeue_a_crash_that_is_not_one_nodes(tmp_path, case, line):
    """Not requeued (FAILED, 1, one line saying why): both nodes crashed on their own (node 0's ranks raised too);
    the same failure again after a crash requeue (the same checkpoint, the same last step: deterministic, a bug);
    ULYSSES_MAX_CRASH_REQUEUES (2) crash requeues already spent by this job."""
    earlier = {"every node": [], "same failure": ["0 0 gpu3 20 25"], "same step": ["0 0 gpu3 15 25"],
               "cap": ["0 0 gpu3 10 12", "1 0 gpu4 15 17"]}
    code, text = crash_run(tmp_path, 20, 25, earlier[case], **({"FAKE_CRASH_0": "own"} if case == "every node" else {}))
    assert code == 1 and requeues(tmp_path) == [], text
    assert line in text and "failed with 1: not requeueing" in text, text
    assert updates(tmp_path) == ["update JobId=4242 Requeue=0"], text  # nor a site's RequeueExit=1 (a loop)
    assert not (tmp_path / ".cache" / "slurm" / "4242.crashes").exists()  # the job ended: its bookkeeping with it


def test_every_node_crashing_after_a_suspend_is_requeued(tmp_path):
    """A suspend longer than --dist_timeout_s (`scontrol suspend`, PreemptMode=SUSPEND) fails every rank at the resume
    (NCCL's watchdog counts the stopped time): both nodes record a crash of their own, which was refused as no node's
    fault, Requeue=0, the job FAILED. Slurm's SuspendTime (the resume, in this allocation) just before the crash now
    requeues it (bounded by progress): nothing excluded, no crash counted."""
    start = int(time.time()) - 3600
    resumed = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 5))
    (tmp_path / "scontrol.log.state").write_text(f"suspend_time={resumed}\n")
    code, text = crash_run(tmp_path, 20, 25, FAKE_CRASH_0="own", SLURM_JOB_START_TIME=str(start))
    assert code == 0 and requeues(tmp_path) == ["requeue 4242"] and updates(tmp_path) == [], text
    assert f"crashed on node(s) 1 0 (exit 1) at the resume of a suspend (SuspendTime={resumed})" in text, text
    assert not (tmp_path / ".cache" / "slurm" / "4242.crashes").exists()


@pytest.mark.parametrize("resumed_s, earlier, line", [
    (36000, ["0 0 gpu3 20 25"], "s after: not at the resume, not the suspend's"),
    (36000, [], "s after: not at the resume, not the suspend's"),
    (5, ["0 0 gpu3 20 25"], "the same failure twice: a crash after step 25 again, now from the checkpoint of step 20 "
                            "(node 0 at restart 0, now node(s) 1 0): a bug, not a node: not requeueing"),
])
def test_every_node_crashing_long_after_a_suspend_or_again_is_a_bug(tmp_path, resumed_s, earlier, line):
    """A review: any SuspendTime in the allocation requeued a crash of every node, skipping the same-failure rule: a
    gang scheduler's one-minute suspend at minute 1 made a deterministic bug at hour 10 requeue (bounded only by the
    stalled requeues; never where the output dir is unknown). The crash must begin within minutes of the resume (the
    last SuspendTime), and not after a step a crash requeue already recorded: else FAILED, Requeue=0."""
    start = int(time.time()) - 36060
    resumed = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - resumed_s))
    (tmp_path / "scontrol.log.state").write_text(f"suspend_time={resumed}\n")
    code, text = crash_run(tmp_path, 20, 25, earlier, FAKE_CRASH_0="own", SLURM_JOB_START_TIME=str(start))
    assert code == 1 and requeues(tmp_path) == [] and updates(tmp_path) == ["update JobId=4242 Requeue=0"], text
    assert line in text and "failed with 1: not requeueing" in text, text
