"""base/comm.py is the one owner of process-group communication, and it is NCCL-correct by construction:
the device is set before the process group exists, every collective's tensor is on the accelerator's device,
and no other module calls torch.distributed collectives (gloo would forgive what NCCL rejects)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch

from base import comm
from tests.distributed import DIST_TIMEOUT_S, ROOT, run

COLLECTIVE = re.compile(r"\b(all_reduce|all_gather|all_gather_object|all_to_all|all_to_all_single|broadcast|"
                        r"broadcast_object_list|reduce|reduce_scatter|gather|gather_object|scatter|scatter_object_list|"
                        r"barrier|monitored_barrier|send|recv|isend|irecv|new_group|init_process_group)\(")
DIST_IMPORT = re.compile(r"^\s*(import torch\.distributed|from torch import distributed|from torch\.distributed import)",
                         re.M)


def project_sources() -> list[str]:
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in files.split() if not f.startswith("tests/") and f != "base/comm.py"]


def test_no_module_but_comm_touches_the_process_group():
    offenders = []
    for rel in project_sources():
        with open(os.path.join(ROOT, rel)) as fh:
            text = fh.read()
        if DIST_IMPORT.search(text):
            offenders.append(f"{rel}: imports torch.distributed")
        for n, line in enumerate(text.splitlines(), 1):
            if re.search(r"\b(dist|torch\.distributed)\.", line) and COLLECTIVE.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "collectives outside base/comm.py:\n" + "\n".join(offenders)


def test_the_scan_sees_a_direct_collective(tmp_path):
    """The scan above can fail: a line like the ones it must catch matches."""
    assert COLLECTIVE.search("dist.all_reduce(t, op=dist.ReduceOp.MAX)")
    assert DIST_IMPORT.search("import torch.distributed as dist\n")


class FakeAccelerator:
    """An accelerator whose current device is `meta` (a real torch device on any build, like cuda:N would be)."""

    def __init__(self, log: list, visible: int = 8):
        self.log, self.visible = log, visible

    def device_name(self, index=None):
        return "cuda"

    def device_count(self):
        return self.visible

    def current_device_name(self):
        return "meta"

    def set_device(self, index):
        self.log.append(("set_device", index))


@pytest.fixture
def fake_world(monkeypatch):
    log: list = []
    monkeypatch.setattr(comm, "_accelerator", lambda: FakeAccelerator(log))
    monkeypatch.setattr(comm, "initialized", lambda: True)
    monkeypatch.setattr(comm, "world", lambda: 4)

    def all_reduce(t, op=None, group=None):
        log.append(("all_reduce", t.device.type))

    monkeypatch.setattr(comm.dist, "all_reduce", all_reduce)
    return log


def test_host_values_are_reduced_on_the_accelerator_device(fake_world, monkeypatch):
    # the result comes back to the host: fake the device -> host copy of a meta tensor
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self: torch.zeros(self.shape, dtype=self.dtype))
    comm.all_reduce([1.0, 2.0])
    comm.all_reduce(torch.ones(3), op="max")
    assert fake_world == [("all_reduce", "meta"), ("all_reduce", "meta")]
    assert comm.device() == torch.device("meta")


def test_a_host_tensor_in_an_in_place_collective_is_refused(fake_world):
    with pytest.raises(AssertionError, match="collective on cpu, expected meta"):
        comm.all_reduce_(torch.ones(2))
    comm.all_reduce_(torch.ones(2, device="meta"))
    assert fake_world == [("all_reduce", "meta")]


@pytest.mark.parametrize("visible,device", [(8, 3), (1, 0), (2, None)], ids=["node", "srun_gpus_per_task", "too_few"])
def test_init_sets_the_device_before_the_process_group(monkeypatch, visible, device):
    """LOCAL_RANK of the node's GPUs (a launcher; srun --gpus-per-node); the one GPU an srun task sees
    (--gpus-per-task=1: it was set_device(3), `invalid device ordinal`), which DeepSpeed then reads from LOCAL_RANK
    too; fewer GPUs than the local rank needs: one line before anything starts. The duplicate-GPU claim comes before
    deepspeed.init_distributed: DeepSpeed passes device_id, so NCCL's "Duplicate GPU detected" fires inside it (the
    old check ran after it, unreachable)."""
    import deepspeed

    log: list = []
    monkeypatch.setattr(comm, "_accelerator", lambda: FakeAccelerator(log, visible))
    monkeypatch.setattr(comm, "_HOST_GROUP", None)
    monkeypatch.setattr(comm, "initialized", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("ULYSSES_LOCAL_RANK", "")  # recorded, so what init sets is undone after the test
    monkeypatch.delenv("ULYSSES_LOCAL_RANK")
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: log.append(("init", kw["timeout"].total_seconds())))
    monkeypatch.setattr(comm.dist, "new_group", lambda **kw: log.append(("host_group", kw["backend"])))
    monkeypatch.setattr(comm, "_check_devices", lambda index, n: log.append(("check", index, n)))
    monkeypatch.setattr(comm, "_claim_device", lambda index, timeout_s: log.append(("claim", index, timeout_s)))
    monkeypatch.setattr(comm.dist, "get_rank", lambda: 11)
    monkeypatch.setattr(comm.dist, "get_world_size", lambda: 32)
    if device is None:
        with pytest.raises(ValueError, match=r"^LOCAL_RANK 3, but this process sees 2 GPU\(s\) .*--gpus-per-node"):
            comm.init(timeout_s=90)
        assert log == []
        return
    assert comm.init(timeout_s=90) == (11, 32, 3)
    assert log == [("set_device", device), ("claim", device, 90), ("init", 90.0), ("host_group", "gloo"),
                   ("check", device, visible)]
    assert os.environ["LOCAL_RANK"] == str(device)  # the node-local rank kept for the once-a-node messages
    assert os.environ.get("ULYSSES_LOCAL_RANK") == ("3" if device == 0 else None)


def test_ranks_on_one_gpu_are_named_and_one_gpu_a_task_is_said():
    """base/devices.py over every rank's (host, GPUs it sees, its GPU's UUID): two ranks of a node on one GPU (NCCL's
    "Duplicate GPU detected" at the first collective) are one line naming them; tasks that each see one GPU work,
    with a line; the same UUID on two hosts is two GPUs."""
    from base import devices

    node = [("a", 8, f"GPU-{i}") for i in range(4)] + [("b", 8, f"GPU-{i}") for i in range(4)]
    assert devices.duplicates(node) is None and devices.one_each_line(node) is None
    shared = [("a", 1, "GPU-0"), ("a", 1, "GPU-0"), ("b", 1, "GPU-0")]
    assert devices.duplicates(shared).startswith("gpus: ranks 0 and 1 on a would drive the same GPU (GPU-0)")
    per_task = [("a", 1, "GPU-0"), ("a", 1, "GPU-1"), ("b", 1, "GPU-0"), ("b", 1, "GPU-1")]
    assert devices.duplicates(per_task) is None and "--gpus-per-task=1" in devices.one_each_line(per_task)
    assert devices.one_each_line([("a", 1, "GPU-0"), ("b", 1, "GPU-0")]) is None  # one rank a node: nothing to say
    assert devices.duplicates([("a", 1, None), ("a", 1, None)]) is None  # no UUID known: NCCL says it
    # fewer ranks on a node than the GPUs each sees (srun python train.py under --gpus-per-node=8 alone): said
    assert devices.idle_line(node) == ("gpus: a runs 4 rank(s), each seeing 8 GPUs: 4 idle; srun --ntasks-per-node=8 "
                                       "(or the launcher's --num_gpus) uses them all")
    assert devices.idle_line(per_task) is None and devices.idle_line([("a", 2, "x"), ("a", 2, "y")]) is None


def test_the_device_check_gathers_every_rank_on_the_host_group(monkeypatch, capsys):
    """comm._check_devices: the readings gathered on the host group, a duplicate refused on every rank alike, rank 0's
    line where each task sees one GPU."""
    import socket

    from base import devices

    other = [("h", 1, "GPU-0")]

    def gather(out, obj, group=None):
        assert group is comm._HOST_GROUP
        out[:] = [obj, other[0]]

    monkeypatch.setattr(comm.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(comm.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(comm.dist, "all_gather_object", gather)
    monkeypatch.setattr(devices, "uuid_of", lambda index: f"GPU-{index}")
    monkeypatch.setattr(socket, "gethostname", lambda: "h")
    with pytest.raises(ValueError, match=r"^gpus: ranks 0 and 1 on h would drive the same GPU \(GPU-0\)"):
        comm._check_devices(0, 1)
    other[0] = ("h", 1, "GPU-1")
    comm._check_devices(0, 1)
    assert capsys.readouterr().out.startswith("warning: gpus: each rank sees one GPU")


def test_k_v_gradients_are_summed_in_fp32(monkeypatch):
    """context parallelism's K/V gather: its backward reduce-scatter summed bf16 gradients (NCCL rounds at every hop of
    its ring: 1.55x the fp32 error at cp 4); now in fp32, as the ring path accumulates, the result back in bf16."""
    seen = []

    def gather(out, t, group=None):
        out.copy_(torch.cat([t, t]))

    def reduce_scatter(out, t, group=None):
        seen.append(t.dtype)
        out.copy_(t.view(2, *out.shape).sum(0))

    monkeypatch.setattr(comm.dist, "all_gather_into_tensor", gather)
    monkeypatch.setattr(comm.dist, "reduce_scatter_tensor", reduce_scatter)
    k = torch.full((3, 4), 1.0, dtype=torch.bfloat16, requires_grad=True)
    stacked = comm._GatherStack.apply(k, None, 2)  # [2, 3, 4]
    (stacked * torch.tensor([1.0, 2.0]).view(2, 1, 1)).sum().backward()
    assert seen == [torch.float32] and k.grad.dtype == torch.bfloat16
    assert torch.equal(k.grad, torch.full((3, 4), 3.0, dtype=torch.bfloat16))
    comm._GatherStack.apply(torch.ones(2, requires_grad=True), None, 2).sum().backward()
    assert seen == [torch.float32, torch.float32]


def test_single_process_needs_no_group():
    assert comm.all_reduce([3.0]).item() == 3.0
    assert comm.all_gather_object({"a": 1}) == [{"a": 1}]
    assert comm.run_on_main(lambda: 7) == 7
    with pytest.raises(ValueError, match="bad"):
        comm.run_on_main(lambda: (_ for _ in ()).throw(ValueError("bad")))


@pytest.mark.dist
def test_sp_groups_are_destroyed_between_stages(tmp_path):
    run(os.path.join(ROOT, "tests/workers/sp_groups.py"), [str(tmp_path)], 2, str(tmp_path / "logs"))
    for r in range(2):
        got = json.loads((tmp_path / f"result{r}.json").read_text())
        assert got["during"] > got["before"] and got["after"] == got["before"], got
        assert got["destroyed"] == 2 and got["ok"], got
        assert got["timeouts"] == [DIST_TIMEOUT_S] and got["sdp_size"] == 2, got  # the run's timeout; SP 1 after SP 2


@pytest.mark.parametrize("agent", [False, True], ids=["rank0_hosts", "launcher_hosts"])
def test_a_store_that_never_starts_ends_the_rank_within_its_bound(monkeypatch, capfd, agent):
    """Node 0 broken before its store starts (train.py or launch.sh's node_store on node 0), with or without SLURM:
    another rank's first connection is one wait of START_WAIT_S from its start, torch's own retry included, then
    one line naming the address that never answered and what it means. Before: torch's client waited its timeout,
    then retried after a random delay (3 s bound: 6-9 s here; 300 s: 600-900 s, 'still waiting after 381 s')."""
    import time

    from base import connect, watcher
    from base.exits import EXIT_PEER_LOST
    from tests.distributed import free_port

    port = free_port()  # nothing listens on it
    monkeypatch.setattr(watcher, "START_WAIT_S", 3.0)
    monkeypatch.setattr(connect, "rank_age_s", lambda: 0.0)  # this rank starts now
    monkeypatch.setattr(comm, "_WATCHER", None)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    if agent:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    else:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        comm.open_channel()
    took = time.monotonic() - t0
    assert stop.value.code == EXIT_PEER_LOST and 2.5 <= took <= 3.7, took  # the old code: 4-5 s here
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, lines
    who = "node 0's launcher" if agent else "rank 0"
    assert f"the job's store at 127.0.0.1:{port} did not answer in 3 s: {who}, which hosts it, never arrived: node 0 " \
           "or its store did not start" in lines[0], lines


def test_the_bound_counts_from_the_ranks_start(monkeypatch):
    """A rank that spent 2.5 s of its 3 s importing has 0.5 s left (at least MIN_CONNECT_S: one real try)."""
    import time

    from base import connect

    monkeypatch.setattr(connect, "rank_age_s", lambda: 2.5)
    assert connect.deadline(3.0) - time.monotonic() == pytest.approx(connect.MIN_CONNECT_S, abs=0.05)
    monkeypatch.setattr(connect, "rank_age_s", lambda: 1.0)
    assert connect.deadline(3.0) - time.monotonic() == pytest.approx(2.0, abs=0.05)


def test_a_store_that_starts_late_is_joined(monkeypatch):
    """The bounded wait still connects to a store that starts while it waits (the port probe then torch's client)."""
    import datetime
    import threading
    import time

    from base import connect
    from tests.distributed import free_port

    port = free_port()
    held = []
    timer = threading.Timer(1.0, lambda: held.append(comm.TCPStore("127.0.0.1", port, is_master=True,
                                                                   wait_for_workers=False,
                                                                   timeout=datetime.timedelta(seconds=10))))
    timer.start()
    store = comm._connect("127.0.0.1", port, time.monotonic() + 10)
    store.set("k", "v")
    timer.join(10)  # the store listens before its constructor returns: the client can be served before `held` is set
    assert held[0].get("k") == b"v" and connect.rank_age_s() > 0


def test_a_master_port_another_run_holds_is_one_line(monkeypatch):
    """Two runs on one node with the default --master_port: the second's rank 0 could not host the store (a
    DistNetworkError traceback, EADDRINUSE) while its other ranks joined the first run's store. One line now."""
    import socket

    from tests.distributed import free_port

    port = free_port()
    held = socket.socket()
    held.bind(("127.0.0.1", port))
    held.listen()
    monkeypatch.setattr(comm, "_WATCHER", None)
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    try:
        with pytest.raises(ValueError, match=rf"^MASTER_PORT {port} on 127.0.0.1 is taken .* --master_port"):
            comm.open_channel()
    finally:
        held.close()
