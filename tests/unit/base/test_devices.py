"""base/devices.py: two ranks on one GPU named through the job's store before any process group (`claim`: threads as
ranks over one in-process store, fake UUIDs), and the refusal of a rank that sees too few GPUs naming the fix for what
started it (a launcher's GPU count; srun's --gpu-bind=closest)."""

from __future__ import annotations

import re
import threading
import time

import pytest

from base import comm, devices
from base.watcher import key


def claims(readings, world=None, wait_s=5.0, late=()):
    """Every rank's `claim` over one store: rank r at readings[r] = (host, uuid), ranks in `late` 0.3 s after."""
    store = comm.dist.HashStore()
    out: dict = {}

    def run(r, host, uuid):
        if r in late:
            time.sleep(0.3)
        try:
            out[r] = devices.claim(lambda fn, timeout=None: fn(store), r, world or len(readings), host, uuid, wait_s,
                                   poll_s=0.05)
        except Exception as e:  # noqa: BLE001 -- handed to the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r, *x)) for r, x in enumerate(readings)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    return [out[r] for r in range(len(readings))]


def test_two_ranks_on_one_gpu_are_one_line_on_every_rank():
    """Node a's ranks 0 and 1 were given the same GPU; b's each their own (the same UUID on two hosts is two GPUs). A
    rank arriving late is waited for, so every rank takes the same decision."""
    got = claims([("a", "GPU-0"), ("a", "GPU-0"), ("b", "GPU-0"), ("b", "GPU-1")], late=(1,))
    assert len(set(got)) == 1, got
    assert got[0].startswith("gpus: ranks 0 and 1 on a would drive the same GPU (GPU-0), which NCCL refuses: one task "
                             "per GPU"), got
    assert claims([("a", "GPU-0"), ("a", "GPU-1"), ("b", "GPU-0")], late=(2,)) == [None, None, None]


def test_a_rank_that_never_comes_is_a_bounded_wait():
    got = claims([("a", "GPU-0"), ("a", "GPU-1")], world=3, wait_s=0.3)
    assert all(isinstance(e, TimeoutError) and str(e).startswith("only 2 of 3 ranks reached") for e in got), got


def test_init_refuses_a_duplicate_before_the_process_group(monkeypatch):
    """comm._claim_device over the abort channel's connection: the line raised (ValueError: one line, exit 2 on every
    rank); nothing without the channel or a CUDA UUID."""

    class W:
        rank, world, store = 1, 2, comm.dist.HashStore()

        def ask(self, fn, timeout=None):
            return fn(self.store)

    w = W()
    w.store.compare_set(key("gpu/h/GPU-3"), "", "0")  # rank 0 claimed GPU-3 on h
    w.store.add(key("gpu/in"), 1)
    monkeypatch.setattr(comm, "_WATCHER", w)
    monkeypatch.setattr(devices, "uuid_of", lambda index: f"GPU-{index}")
    monkeypatch.setattr(comm.socket, "gethostname", lambda: "h")
    with pytest.raises(ValueError, match=r"^gpus: ranks 0 and 1 on h would drive the same GPU \(GPU-3\)"):
        comm._claim_device(3, 5.0)
    monkeypatch.setattr(comm, "_WATCHER", None)
    comm._claim_device(3, 5.0)


def test_a_launchers_rank_past_the_nodes_gpus_names_its_gpu_count():
    """slurm.sbatch on a 4-GPU node with GPUS_PER_NODE unset and no SLURM_GPUS_ON_NODE: 8 ranks, LOCAL_RANK 4 sees 4
    GPUs. The line advised srun flags, which slurm.sbatch does not take."""
    env = {"LOCAL_SIZE": "8", "LAUNCH_EXIT_DIR": "/tmp/x", "SLURM_JOB_ID": "12"}
    with pytest.raises(ValueError) as e:
        devices.device_index(4, 4, env)
    line = str(e.value)
    assert line.startswith("LOCAL_RANK 4, but this process sees 4 GPU(s) (CUDA_VISIBLE_DEVICES=unset): the launcher "
                           "started 8 ranks on this node: give it the node's GPU count (scripts/slurm.sbatch: export "
                           "GPUS_PER_NODE=4"), line
    assert "--num_gpus 4" in line and "srun --ntasks-per-node" not in line and len(line.splitlines()) == 1
    # since slurm.sbatch passes no --num_gpus without GPUS_PER_NODE / SLURM_GPUS_ON_NODE, launch.sh counts (not 8)
    assert "else it takes SLURM_GPUS_ON_NODE, else each node's launch.sh counts its own GPUs; " in line, line
    outside = devices.fix_for({"LOCAL_WORLD_SIZE": "8"}, 4)  # torchrun on a machine of its own: no sbatch advice
    assert "GPUS_PER_NODE" not in outside and "--nproc_per_node 4" in outside


@pytest.mark.parametrize("env", [{"SLURMD_TRES_BIND": "gres/gpu:closest"}, {"SLURM_TRES_BIND": "gres/gpu:verbose,closest"},
                                 {"SLURM_GPU_BIND": "closest"}], ids=["step", "srun_env", "input"])
def test_srun_gpu_bind_closest_is_named(env):
    """srun --gpu-bind=closest shows a task only its socket's GPUs (Slurm's _get_closest_usable_gres): slurmstepd
    gives the task SLURMD_TRES_BIND=gres/gpu:closest (srun's own env SLURM_TRES_BIND; SLURM_GPU_BIND is its input)."""
    with pytest.raises(ValueError, match=r"srun --ntasks-per-node=G --gpus-per-node=G .*; --gpu-bind=closest shows a "
                                         r"task only its socket's GPUs: drop it \(or --gpu-bind=none\)$"):
        devices.device_index(5, 4, env)
    assert "closest" not in devices.fix_for({"SLURMD_TRES_BIND": "gres/gpu:single:1"}, 4)



def starts(monkeypatch, rows, gpu=True, first=None, wait_s=2.0):
    """comm._claim_device on threads as ranks over one store (the abort channel's connection, as in `init`): rows of
    (RANK, WORLD_SIZE, host); `first` (a row's position) starts 0.3 s before the others. Each rank's ValueError text,
    None, or other exception, and the longest any rank took."""
    store, me, out = comm.dist.HashStore(), threading.local(), {}

    class Channel:  # each thread sees its own rank and world
        rank = property(lambda self: me.rank)
        world = property(lambda self: me.world)

        def ask(self, fn, timeout=None):
            return fn(store)

    monkeypatch.setattr(comm, "_WATCHER", Channel())
    monkeypatch.setattr(comm.socket, "gethostname", lambda: me.host)
    monkeypatch.setattr(devices, "uuid_of", lambda index: f"GPU-{index}")
    monkeypatch.setattr(devices, "CLAIM_POLL_S", 0.05)

    def run(i, rank, world, host):
        me.rank, me.world, me.host = rank, world, host
        if first is not None and i != first:
            time.sleep(0.3)
        try:
            comm._claim_device(rank % 8 if gpu else None, wait_s)
            out[i] = None
        except ValueError as e:
            out[i] = str(e)
        except Exception as e:  # noqa: BLE001 -- handed to the test
            out[i] = e

    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(i, *r)) for i, r in enumerate(rows)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    return [out[i] for i in range(len(rows))], time.monotonic() - t0


# node A counted 2 GPUs (hostfile of 2 nodes x 2: world 4, its ranks 0 and 1); node B counted 1 (2 x 1: world 2, its
# rank 1 collides with A's): the ranks of world 4 timed out ("only 3 of 4 ranks reached"), B's returned at once
UNEVEN = [(0, 4, "nodeA"), (1, 4, "nodeA"), (1, 2, "nodeB")]


@pytest.mark.parametrize("first", [0, 2, None], ids=["world_4_first", "world_2_first", "together"])
def test_ranks_that_disagree_on_world_size_are_one_line_on_every_rank(monkeypatch, first):
    """slurm.sbatch without GPUS_PER_NODE: each node's launch.sh --no_ssh counted its own GPUs. Every rank stops at
    once with the same line naming both counts and the fix, whichever node's rank wrote the store's `world` first."""
    for k in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(k, raising=False)
    got, took = starts(monkeypatch, UNEVEN, first=first)
    assert took < 1.5 and all(isinstance(g, str) for g in got) and len(set(got)) == 1, (got, took)
    line = got[0]
    said = re.match(r"gpus: WORLD_SIZE (\d) on rank \d \((node[AB])\), but (\d) on rank \d \((node[AB])\): ", line)
    assert said and {said[1], said[3]} == {"4", "2"} and {said[2], said[4]} == {"nodeA", "nodeB"}, line
    assert "\n" not in line and line.endswith("export GPUS_PER_NODE=N (scripts/slurm.sbatch) or give every node the same --num_gpus")


def test_world_size_is_compared_where_no_gpu_is_claimed(monkeypatch):
    """On CPU (no CUDA UUID: no claim) the check still runs, one request a rank: the rank whose WORLD_SIZE differs
    from the first writer's refuses (its ValueError reaches the others on the abort channel); agreeing ranks go on."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    got, _ = starts(monkeypatch, UNEVEN, gpu=False, first=0)
    assert got[:2] == [None, None], got
    assert got[2] == ("gpus: WORLD_SIZE 2 on rank 1 (nodeB, 2 ranks on its node), but 4 on rank 0 (nodeA, 2 ranks on "
                      "its node): the nodes' launchers counted different GPUs (a node with fewer, or one fallen off "
                      "the bus); export GPUS_PER_NODE=N (scripts/slurm.sbatch) or give every node the same "
                      "--num_gpus"), got
    assert starts(monkeypatch, [(0, 2, "a"), (1, 2, "b")], gpu=False)[0] == [None, None]


class Channel:
    """The abort channel's side `refusal_or_end` uses, for one thread-rank over one store: `ask` (DistNetworkError once
    `broken`: the store's host gone), `post` (the first reason wins, as base/watcher.py's)."""

    stopped = False

    def __init__(self, store, rank: int, world: int):
        self.store, self.rank, self.world, self.broken = store, rank, world, False
        self.seen, self.clock = {}, time.monotonic

    def ask(self, fn, timeout=None):
        if self.broken:
            raise comm.dist.DistNetworkError("Broken pipe")
        return fn(self.store)

    def post(self, reason, code=1):
        try:
            return self.ask(lambda st: st.compare_set(key("abort"), "", f"{code} {reason}")).decode().partition(" ")[2]
        except Exception:  # noqa: BLE001 -- as the watcher's: the store gone, this reason
            return reason


@pytest.fixture
def ending(monkeypatch, tmp_path):
    """host_wait's exit as SystemExit, comm.abort recorded, LAUNCH_LOST_FILE under tmp_path, the claim's look 0.05 s."""
    from base import host_wait

    aborted: list = []
    monkeypatch.setattr(host_wait, "hard_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(devices, "CLAIM_POLL_S", 0.05)
    monkeypatch.setenv("LAUNCH_LOST_FILE", str(tmp_path / "lost"))
    return lambda reason, code=1: aborted.append((reason, code)) or reason, aborted


def test_a_rank_stuck_before_the_claim_is_named_not_the_waiting_ones(monkeypatch, capfd, tmp_path, ending):
    """One rank slow after train.py's first line (its watcher published `host/2`), one never at the store (no
    `host/3`): the waiting ranks raised TimeoutError "only 2 of 4 ranks reached ..." into _fail (a traceback, exit 1,
    a crash record on their healthy nodes; the stuck one wrote nothing). Now one line from the first rank to give up
    naming the missing ranks and hosts, the stuck rank's node (one rank a node here) named lost, exit 69 everywhere."""
    abort, aborted = ending
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    store, out = comm.dist.HashStore(), {}
    store.set(key("host/2"), "nodeC")

    def run(r):
        try:
            out[r] = devices.refusal_or_end(Channel(store, r, 4), f"node{'AB'[r]}", f"GPU-{r}", 1.0, abort)
        except BaseException as e:  # noqa: BLE001 -- handed to the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    assert all(isinstance(out[r], SystemExit) and out[r].code == 69 for r in range(2)), out
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and re.fullmatch(
        r"error: only 2 of 4 ranks reached the process group's start in 1 s \(--dist_timeout_s\): rank 2 \(nodeC\), "
        r"rank 3 \(host unknown\) stuck after train.py's first line \(a hung import, mount or GPU driver there\?\); "
        r"node\(s\) 2 named lost \(rank [01] waited\)", lines[0]), lines
    assert (tmp_path / "lost").read_text() == "2\n"
    assert sorted(c for _, c in aborted) == [69, 69] and store.get(key("abort")).decode() == f"69 {lines[0][7:]}"


def test_the_store_gone_during_the_claim_is_a_peer_loss_not_a_crash(monkeypatch, capfd, tmp_path, ending):
    """Rank 0, whose process hosts the store, killed while rank 1 waits in the claim (a preemption's SIGTERM before
    the handler): DistNetworkError "Broken pipe" raised into _fail (a traceback, exit 1, a crash record `first`). Now
    the watcher's verdict time is left to it (scaled here), then exit 69 in one line, no node named lost."""
    from base import host_wait, watcher

    abort, aborted = ending
    monkeypatch.setattr(watcher, "LOST_STORE_S", 0.2)
    monkeypatch.setattr(watcher, "STALL_S", 0.2)
    monkeypatch.setattr(host_wait, "VERDICT_TICK_S", 0.05)
    ch = Channel(comm.dist.HashStore(), 1, 2)
    threading.Timer(0.3, lambda: setattr(ch, "broken", True)).start()
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        devices.refusal_or_end(ch, "nodeB", "GPU-1", 30.0, abort)
    assert e.value.code == 69 and 0.7 <= time.monotonic() - t0 < 3, time.monotonic() - t0
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("error:")]
    assert lines == ["error: rank 0 (host unknown) went away while rank 1 waited for it in the GPU claim before the "
                     "process group (Broken pipe): killed, or its node lost; not a crash of this rank"], lines
    assert [c for _, c in aborted] == [69] and not (tmp_path / "lost").exists()
