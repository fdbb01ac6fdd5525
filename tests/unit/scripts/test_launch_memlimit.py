"""A rank OOM-killed at its job's memory limit (`sbatch --mem`: Slurm's cgroup) against one killed by the host's OOM
killer: scripts/launch_crash.sh's verdict over stand-in cgroup trees, sourced in a bare bash as launch.sh sources it
(its baseline read before the launcher starts, its verdict once a rank is gone). The kernel counts `oom` in
memory.events at the cgroup whose limit was hit and (v2, hierarchical) above it, `oom_kill` at the victim's and above;
a host-wide OOM counts `oom_kill` alone. cgroup v1 counts the limit's hits in memory.failcnt of the limited level.
Before, every one of these was `died`: the node excluded and the job requeued into the same limit, twice, memory never
named. The whole chain through slurm.sbatch: tests/e2e/test_sbatch_died_race.py [memlimit]."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.distributed import ROOT

GIB = 1 << 30
V1_UNLIMITED = "9223372036854771712"  # v1's memory.limit_in_bytes without a limit (PAGE_COUNTER_MAX pages)

# launch.sh's state as died_verdict reads it: the launcher gone with 143 (srun's TERM to the deepspeed runner), no
# rank here recorded an exit, no signal to launch.sh before. AFTER: what the kernel wrote meanwhile.
SCRIPT = """set -uo pipefail  # launch.sh from the launch on (set +e: the exit code is the training's)
EXIT_USAGE=2 EXIT_PEER_LOST=69 EXIT_PREEMPTED=75
. "$0"
rc=143 death="" signalled=0 early=1 ranks_here=2 exit_dir=$EXIT_DIR node_rank=0
cg=$CG; read_ooms
eval "$AFTER"
died_verdict
"""


def events(oom: int = 0, kills: int = 0) -> str:
    return f"low 0\nhigh 0\nmax {oom}\noom {oom}\noom_kill {kills}\noom_group_kill 0\n"


def v2_tree(root, job: str, step: str = "max", site: str = "max") -> str:
    """/sys/fs/cgroup's stand-in: system.slice/slurmstepd.scope/job_7/step_0/user/task_0 (Slurm's v2 layout), the
    root without the memory files (the kernel's root cgroup has no memory.max nor memory.events). Slurm writes the
    step's limit at step_0/user (cgroup_v2.c cgroup_p_constrain_set: CG_LEVEL_STEP -> CG_LEVEL_STEP_USER); SITE: a
    site's own limit on slurmstepd.scope (the node's RAM less a reserve for the OS)."""
    path = root / "cg"
    task = path / "system.slice" / "slurmstepd.scope" / "job_7" / "step_0" / "user" / "task_0"
    task.mkdir(parents=True)
    d = task
    while d != path:
        limit = {"job_7": job, "user": step, "slurmstepd.scope": site}.get(d.name, "max")
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.events").write_text(events())
        d = d.parent
    return str(task)


def verdict(tmp_path, cg: str, after: str) -> tuple[str, str]:
    crash, exit_dir = tmp_path / "crash.0", tmp_path / "exit"
    exit_dir.mkdir()
    p = subprocess.run(["bash", "-c", SCRIPT, os.path.join(ROOT, "scripts", "launch_crash.sh")], capture_output=True,
                       text=True, timeout=30, env={**os.environ, "CG": cg, "AFTER": after, "SLURM_JOB_ID": "7",
                                                   "EXIT_DIR": str(exit_dir), "LAUNCH_CRASH_FILE": str(crash)})
    assert p.returncode == 0, p.stderr
    return (crash.read_text().strip() if crash.exists() else ""), p.stderr


def write(path: str, text: str) -> str:
    """The kernel's update of one file, as a line of AFTER."""
    return f"printf '%s' '{text}' > '{path}'\n"


@pytest.mark.parametrize("hit, level", [("job", "job_7"), ("step", "step_0/user")])
def test_a_kill_at_the_jobs_limit_is_memlimit_naming_the_level(tmp_path, hit, level):
    """`sbatch --mem=64G`: memory.max at the job's level (and, tighter, at the step's user processes'); the limit hit
    there counts `oom` there and above, the victim's task `oom_kill`: the level named is the innermost one that counted
    it."""
    task = v2_tree(tmp_path, job=str(64 * GIB), step=str(48 * GIB))
    job = os.path.dirname(os.path.dirname(os.path.dirname(task)))  # .../job_7
    step = os.path.join(job, "step_0", "user")
    counted = [job, os.path.dirname(step), step] if hit == "step" else [job]
    after = "".join(write(f"{d}/memory.events", events(oom=1, kills=1)) for d in counted)
    after += write(f"{task}/memory.events", events(kills=1))
    crash, err = verdict(tmp_path, task, after)
    gib = "48.0" if hit == "step" else "64.0"
    assert crash == f"memlimit {gib} {step if hit == 'step' else job}", err
    assert f"cgroup {job if hit == 'job' else step} (limit {gib} GiB)" in err and level in err, err
    assert "crash verdict is 'memlimit'" in err and "raise sbatch --mem" in err and "scripts/plan.py" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_host_wide_oom_stays_died(tmp_path):
    """The node itself out of memory: the task's `oom_kill` grows, no limited level's `oom` (the job at 64 GiB was not
    at its limit): that node may be short of memory, excluding it is right."""
    task = v2_tree(tmp_path, job=str(64 * GIB))
    crash, err = verdict(tmp_path, task, write(f"{task}/memory.events", events(kills=1)))
    assert crash == "died" and "memlimit" not in err, err


# launch.sh's poll with every rank here alive, N s after the launch (bash's SECONDS set: N s later on its clock)
def poll(at_s: int) -> str:
    return f"SECONDS={at_s}; read_ooms\n"


@pytest.mark.parametrize("before_s, word", [(31, "died"), (29, "memlimit 64.0")])
def test_an_oom_at_the_limit_a_rank_survived_is_this_deaths_only_within_30_s(tmp_path, before_s, word):
    """A compiler OOM-killed at the limit while every rank here lived (polls read it), then a rank gone to the host's
    OOM killer: 31 s before the last poll with every rank alive, not the limit's (`died`); within 30 s it is taken as
    this death's (the trade-off of read_ooms' window: a killed rank's teardown may outlast 26 s)."""
    task = v2_tree(tmp_path, job=str(64 * GIB))
    job = os.path.dirname(os.path.dirname(os.path.dirname(task)))
    after = poll(1) + write(f"{job}/memory.events", events(oom=1, kills=1)) + poll(2)
    after += "".join(poll(t) for t in range(3, 2 + before_s, 5)) + poll(1 + before_s)
    after += write(f"{task}/memory.events", events(kills=1))
    crash, err = verdict(tmp_path, task, after)
    assert crash.startswith(word), err


@pytest.mark.parametrize("at_limit", [True, False], ids=["at_the_limit", "host"])
def test_a_killed_rank_that_outlives_polls_still_gets_its_verdict(tmp_path, at_limit):
    """The kernel counts the kill (the job's `oom`, the task's `oom_kill`) when it picks the victim; a rank tearing
    down its CUDA context and pinned host memory (26 s for 243 GB, sglang PR #32829) is no zombie yet, so launch.sh's
    polls in that time see every rank alive. Before, the first of them took the kill into the baselines: no verdict
    at all (the crash file empty: the healthy node's `first` stood, and it was excluded). Review a73 r2 B1."""
    task = v2_tree(tmp_path, job=str(64 * GIB))
    job = os.path.dirname(os.path.dirname(os.path.dirname(task)))
    after = poll(5) + (write(f"{job}/memory.events", events(oom=1, kills=1)) if at_limit else "")
    after += write(f"{task}/memory.events", events(kills=1)) + "".join(poll(t) for t in range(6, 32))
    crash, err = verdict(tmp_path, task, after)
    assert crash.startswith("memlimit 64.0" if at_limit else "died"), (crash, err)


def v1_tree(root, limit: int | str, usage: int = 0, cache: int = 0, failcnt: int = 0) -> str:
    """cgroup v1's memory mount: slurm/uid_0/job_7/step_0/task_0 (Slurm's layout), LIMIT at the job's level, its
    usage (memory.usage_in_bytes) CACHE of it page cache (memory.stat's total_*_file: reclaimable)."""
    mount = root / "memory"
    task = mount / "slurm" / "uid_0" / "job_7" / "step_0" / "task_0"
    task.mkdir(parents=True)
    d = task
    while True:
        (d / "memory.limit_in_bytes").write_text((str(limit) if d.name == "job_7" else V1_UNLIMITED) + "\n")
        (d / "memory.failcnt").write_text(f"{failcnt}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"cache {cache}\nrss {usage - cache}\nhierarchical_memory_limit 1\n"
                                       f"total_cache {cache}\ntotal_inactive_file {cache // 2}\n"
                                       f"total_active_file {cache - cache // 2}\ntotal_unevictable 0\n")
        (d / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
        if d == mount:
            break
        d = d.parent
    return str(task)


def v1_kill(task: str, failcnt: int) -> str:
    """The job's failcnt grown to FAILCNT, the task's `oom_kill` +1 (v1 counts no OOM at a level above the victim)."""
    job = os.path.dirname(os.path.dirname(task))
    return (write(f"{job}/memory.failcnt", f"{failcnt}\n")
            + write(f"{task}/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"))


@pytest.mark.parametrize("limit, verdict_word", [(32 * GIB, "memlimit 32.0"), (V1_UNLIMITED, "died")])
def test_cgroup_v1_reads_the_limited_levels_failcnt(tmp_path, limit, verdict_word):
    """cgroup v1 (memory controller's mount): memory.limit_in_bytes at the job's level, its memory.failcnt counting
    the hits, the task's memory.oom_control its kills (no hierarchy of events under v1); the job's usage less its page
    cache at 31.9 of its 32 GiB. Unlimited: no level to name."""
    task = v1_tree(tmp_path, limit, usage=32 * GIB, cache=GIB // 10)
    crash, err = verdict(tmp_path, task, v1_kill(task, 3))
    assert crash.startswith(verdict_word), err


@pytest.mark.parametrize("cache_gib, word", [(30, "died"), (2, "memlimit 64.0")])
def test_v1_failcnt_is_evidence_only_where_the_job_was_full_of_other_than_page_cache(tmp_path, cache_gib, word):
    """v1 charges page cache to the job: one that read its data or wrote a checkpoint sits at its limit, and failcnt
    grows at every reclaim (1000 -> 1042 here, no OOM). A rank taken by the HOST's OOM killer then read as `memlimit`
    and the job stopped instead of requeuing (review a73 r2 B2; failed on the old code). The job's 64 GiB: 30 GiB of
    page cache leaves 34 GiB that reclaim cannot free (under 95%): `died`; 2 GiB leaves 62 (over): `memlimit`, read at
    the polls before the kill (the OOM reaper frees the victim's anonymous memory before it exits: 12 GiB at death)."""
    task = v1_tree(tmp_path, 64 * GIB, usage=64 * GIB, cache=cache_gib * GIB, failcnt=1000)
    job = os.path.dirname(os.path.dirname(task))
    crash, err = verdict(tmp_path, task, v1_kill(task, 1042) + write(f"{job}/memory.usage_in_bytes", f"{12 * GIB}\n"))
    assert crash.startswith(word), (crash, err)


def test_v1_without_the_usage_files_is_died(tmp_path):
    """No memory.stat (a stand-in or a kernel without it): failcnt's growth tells nothing, the node's `died` as before
    memlimit existed (requeued without it), never a stopped job."""
    task = v1_tree(tmp_path, 64 * GIB, usage=64 * GIB, failcnt=1000)
    os.remove(os.path.join(os.path.dirname(os.path.dirname(task)), "memory.stat"))
    crash, err = verdict(tmp_path, task, v1_kill(task, 1042))
    assert crash == "died", (crash, err)


def test_an_oom_at_a_limit_above_the_jobs_is_died(tmp_path):
    """A site's limit on slurmstepd.scope (the node's RAM less the OS's reserve) is the node's memory, shared with other
    jobs: an OOM counted there (and above) with the job at --mem=0 is a node-wide shortage, requeued without the node,
    not `memlimit` with "raise sbatch --mem" (review a73 r2 R2; memlimit 900.0 on the old code)."""
    task = v2_tree(tmp_path, job="max", site=str(900 * GIB))
    scope = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(task))))
    after = "".join(write(f"{d}/memory.events", events(oom=1, kills=1)) for d in (scope, os.path.dirname(scope)))
    crash, err = verdict(tmp_path, task, after + write(f"{task}/memory.events", events(kills=1)))
    assert crash == "died" and "memlimit" not in err, (crash, err)


def test_a_containers_own_limit_is_memlimit(tmp_path):
    """A container with its own cgroup namespace: /proc/self/cgroup says 0::/, no job_<id> in the path, the limit at
    the namespace's root (/sys/fs/cgroup itself, with memory.max): the walk goes to the mount's root, as before."""
    root = tmp_path / "container"
    root.mkdir()
    (root / "memory.max").write_text(f"{80 * GIB}\n")
    (root / "memory.events").write_text(events(oom=1, kills=0))
    after = write(f"{root}/memory.events", events(oom=2, kills=1))
    crash, err = verdict(tmp_path, str(root), after)
    assert crash == f"memlimit 80.0 {root}", (crash, err)


def test_a_window_that_is_no_number_is_refused_in_one_line(tmp_path):
    """LAUNCH_OOM_WINDOW_S (read_ooms' window) is read as launch.sh sources launch_crash.sh, before any rank starts."""
    p = subprocess.run(["bash", "-c", '. "$0"', os.path.join(ROOT, "scripts", "launch_crash.sh")], capture_output=True,
                       text=True, timeout=30, env={**os.environ, "LAUNCH_OOM_WINDOW_S": "30s"})
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "LAUNCH_OOM_WINDOW_S=30s" in p.stderr and "e.g. 60" in p.stderr, p.stderr
