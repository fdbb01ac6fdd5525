"""LATEST through a stale view of the file system, whatever the world size: a 1-rank job requeued onto another
node waits for what the job before committed as a larger job does (tests/stubs/stale_view, run in-process), and a
first start, with no reason to expect a LATEST, does not wait."""

from __future__ import annotations

import os
import time

import pytest

from tests.unit.training.test_checkpoint import save
from tests.unit.training.test_universal import stale_view
from training.checkpoint import Checkpointer, tag_for


@pytest.mark.parametrize("unlisted, late, restarts", [
    (r"checkpoints/step_000004$", r"checkpoints/step_000004/MANIFEST\.json$", None),  # LATEST seen, its step not yet
    (r"checkpoints/step_000004$", r"checkpoints/(LATEST|step_000004/MANIFEST\.json)$", None),  # step 2 is committed
    (r"checkpoints/step_\d+$", r"checkpoints/(LATEST|step_000004/MANIFEST\.json)$", "1"),  # nothing listed: a requeue
], ids=["manifest-late", "latest-late-step-2-listed", "latest-late-on-a-requeue"])
def test_a_one_rank_requeue_resumes_the_latest_its_node_sees_late(tmp_path, monkeypatch, capsys, unlisted, late,
                                                                 restarts):
    """A 1-rank job requeued onto another node (tests/stubs/stale_view, in-process): its listing of checkpoints/
    lacks what the job before committed there and its cached negative lookups hide LATEST or the manifest LATEST
    names for 1 s more. With the default settle it resumes step 4. Before, one rank never waited (settle 0): it
    resumed step 2 with a warning, or, LATEST hidden on an empty listing, started over without a word."""
    ck = Checkpointer(str(tmp_path), keep=3)  # the default settle: FS_SETTLE_S, whatever the world size
    save(ck, 2)
    newest = save(ck, 4)
    if restarts:
        monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
    else:
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    stale_view(monkeypatch, UNLISTED=unlisted, LATE=late, LATE_S="1")
    t0 = time.monotonic()
    assert ck.find_resume("auto") == newest
    assert time.monotonic() - t0 < 30
    assert "warning" not in capsys.readouterr().out


def test_a_first_start_does_not_wait_for_a_latest(tmp_path, monkeypatch):
    """No reason to expect a LATEST (no requeue, nothing committed in checkpoints/, not even a killed first save's
    partial folder): a fresh start does not look for one, on one rank as on many."""
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    ck = Checkpointer(str(tmp_path), keep=3)
    t0 = time.monotonic()
    assert ck.find_resume("auto") is None
    os.makedirs(tmp_path / "checkpoints" / tag_for(1) / "state")  # killed before its first commit
    assert ck.find_resume("auto") is None
    assert time.monotonic() - t0 < 5
