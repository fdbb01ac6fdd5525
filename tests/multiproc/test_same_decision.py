"""Every rank takes the same decision: two ranks whose views of the shared file system differ (rank 1 lists an
older `checkpoints/`, misses a stage's evaluation record and the prepared data's manifest, still sees a removed
PREEMPT file), whose memory budgets differ and whose launchers report different node sizes (uneven hostfile slots
8/4/4: rank 0 on the 8-slot node, rank 1 on a 4-slot one) decide the same at every decision point, and decide what
rank 0's view (or the smallest budget, or the nodes' gcd) says. The contrast fields check the views really
differed, so the test can fail. In the same launch (no second process start), decisions one rank's own event must not
make alone: a stop asked on rank 1 only (and its SIGTERM's kill window), a background save held on rank 1 (committed
by no rank, then by every rank at one poll: mutC's M13), each rank's own state file at a same-world load (M35)."""

from __future__ import annotations

import json
import os

import pytest

from data.prepare import prepare_in_job
from tests.distributed import ROOT, run
from training.checkpoint import Checkpointer

pytestmark = pytest.mark.dist


class _Engine:
    def save_checkpoint(self, root, tag, save_latest):
        with open(os.path.join(root, tag, "zero_pp_rank_0_mp_rank_00_model_states.pt"), "wb") as fh:
            fh.write(os.urandom(4096))


class _HFConfig:
    def to_json_string(self):
        return "{}"


def test_ranks_with_different_views_decide_the_same(assets, tmp_path):
    out = tmp_path / "out"
    ck = Checkpointer(str(out), keep=3)
    for step in (2, 4):
        ck.save(_Engine(), step, {"step": step}, {}, _HFConfig())
    (out / "eval").mkdir()
    (out / "eval" / "stage0.json").write_text("{}")
    folder = prepare_in_job(assets["data"], None, 2048)[0]
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT}/tests/stubs/stale_view", "STALE_VIEW_RANK": "1",
           "STALE_VIEW_UNLISTED": r"checkpoints/step_000004$",
           "STALE_VIEW_MISSING": rf"eval/stage0\.json$|{folder}/manifest\.json$",
           "STALE_VIEW_GHOST": r"out/PREEMPT$", "DECISIONS_NODE_SIZES": "8,4"}
    run(os.path.join(ROOT, "tests/workers/decisions.py"), [str(out), folder], 2, str(tmp_path / "logs"), extra_env=env)
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2))

    # the views differed ...
    assert r0["own_tags"] == ["step_000002", "step_000004"] and r1["own_tags"] == ["step_000002"]
    assert (r0["own_evaluated"], r1["own_evaluated"]) == ([0], [])
    assert (r0["own_stop_file"], r1["own_stop_file"]) == (False, True)
    assert (r0["own_budget"], r1["own_budget"]) == (2**30, 2**31)
    assert (r0["own_prepared"], r1["own_prepared"]) == (True, False)
    assert (r0["own_node_size"], r1["own_node_size"]) == (8, 4)
    assert (r0["own_layout"], r1["own_layout"]) == ([[8, 2]], [[4, 4]])  # SP 16 split two ways: mismatched groups
    # ... the decisions did not, and they are rank 0's view (the smallest budget)
    for k in ("resume", "trainer_step", "evaluated", "stop", "budget", "data", "save_due_rank1_clock",
              "save_due_rank0_clock", "node_size", "layout"):
        assert r0[k] == r1[k], (k, r0[k], r1[k])
    assert (r0["resume"], r0["trainer_step"], r0["evaluated"], r0["stop"]) == ("step_000004", 4, [0], False)
    assert r0["budget"] == 2**30 and r0["data"] == folder
    assert (r0["node_size"], r0["layout"]) == (4, [[4, 4]])  # gcd(8, 4): no Ulysses group straddles a node
    assert (r0["save_due_rank1_clock"], r0["save_due_rank0_clock"]) == (False, True)
    # one rank's signal, write or file decides nothing alone (mutation audit mutC: M16, M17, M13, M35)
    for r, got in enumerate((r0, r1)):
        assert got["one_stop"] and got["one_term_stop"] and got["one_term_window"], (r, got)  # rank 0 had no signal
        assert got["one_held_poll"] is None and got["one_next_collective"] == [0, 1], (r, got)
        assert got["one_committed"] == "step_000002" and got["one_loaded_rank"] == r, (r, got)
