"""GPUs a node's ranks leave idle (base/devices.py idle_line): `srun --gpus-per-task=2 --ntasks-per-node=2` gives the
two tasks GPUs {a,b} and {c,d}; they drive a and d (their LOCAL_RANK among what each sees), b and c idle the whole run,
and nothing was said (each task saw 2 GPUs, 2 ranks on the node: the count alone looked right)."""

from __future__ import annotations

from base.devices import duplicates, idle_line, one_each_line


def test_ranks_that_see_different_gpus_leave_some_idle():
    r = [("n1", 2, "GPU-a", ("GPU-a", "GPU-b")), ("n1", 2, "GPU-d", ("GPU-c", "GPU-d"))]
    line = idle_line(r)
    assert line is not None and line.startswith("gpus: n1's 2 ranks each see other GPUs (2 at most, 4 in all; srun "
                                                "--gpus-per-task=2?): 2 idle;"), line
    assert duplicates(r) is None and one_each_line(r) is None


def test_ranks_that_see_the_same_gpus_or_one_each_are_quiet():
    same = ("GPU-a", "GPU-b")
    assert idle_line([("n1", 2, "GPU-a", same), ("n1", 2, "GPU-b", same)]) is None  # --gpus-per-node=2, 2 tasks
    assert idle_line([("n1", 1, "GPU-a", ()), ("n1", 1, "GPU-b", ())]) is None  # --gpus-per-task=1
    assert idle_line([("n1", 2, "GPU-a", ("GPU-a", "GPU-b")), ("n2", 2, "GPU-d", ("GPU-c", "GPU-d"))]) is not None \
        and idle_line([("n1", 2, "GPU-a", same), ("n1", 2, "GPU-b", same), ("n2", 1, "GPU-c", ())]) is None
    # without the sets (an accelerator that names no UUIDs) only the count rule speaks
    assert "1 rank(s), each seeing 8 GPUs: 7 idle" in idle_line([("n1", 8, None, ())])
