"""One launch for the workers of several test modules (a launch costs ~15 s of start-up on 2 cores).

test_parity (world 2), test_doc_masking, test_model_zoo, test_context_parallel and test_rope each launched a worker
on 2 ranks: their fast cases now share one launch (tests/multiproc/joint_worker.py runs the workers one after the
other). A module `join`s at import with a builder (the session's `assets` and `tmp_path_factory`, a folder -> the
worker's JSON argument, with its output files inside that folder) and the names of its tests that read the
outputs; the first `launched(key)` runs every joined builder whose tests are selected in this session
(tests/multiproc/conftest.py records them), and returns the key's argument, from which the module reads its
outputs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from tests.distributed import ROOT, run

# the modules that join (tests/conftest.py's xdist scheduler sends them to one worker: the launch runs once for all;
# test_joint_launch checks the list against the modules that do join)
JOINED = ("test_parity", "test_doc_masking", "test_model_zoo", "test_context_parallel", "test_rope")
SELECTED: set[tuple[str, str]] = set()  # (module name, test function name) of this session's selected tests
# each joining module's assets (model folders, documents), made once: kept here, not in the module, because pytest
# imports a test file as `test_x` while another test file's import makes a second copy, `tests.multiproc.test_x`
ASSETS: dict[str, dict] = {}
WORKER = os.path.join(ROOT, "tests", "multiproc", "joint_worker.py")


class JointLaunch:
    def __init__(self, world: int):
        self.world = world
        self.builders: dict[str, tuple[str, str, Callable, tuple[str, ...], int]] = {}
        self.done: dict = {}

    def join(self, key: str, module: str, worker: str, build: Callable, uses: tuple[str, ...],
             order: int = 1) -> None:
        """`build(assets, tmp_path_factory, folder)` -> the JSON argument of `worker` (tests/workers/...);
        `uses`: the tests of `module` that read its outputs; workers run by `order` (a DeepSpeed engine at SP 1
        must come before any at SP 2 in a process: after one, DeepSpeed's groups still point at the SP 2 mpu).
        The module by its file's name: pytest imports a test file as `test_x`, another test file importing it as
        `tests.multiproc.test_x`."""
        name = module.rsplit(".", 1)[-1]
        assert name in JOINED, f"{name} joins the shared launch: add it to joint_launch.JOINED (one xdist worker)"
        self.builders[key] = (name, os.path.join(ROOT, worker), build, uses, order)

    def launched(self, key: str, assets: dict, tmp_path_factory):
        """The JSON argument `key`'s builder made, after one launch of every selected module's worker."""
        if key not in self.done:
            d = tmp_path_factory.mktemp(f"joint_world{self.world}")
            todo = sorted((b[4], k) for k, b in self.builders.items() if k not in self.done and (
                k == key or any((b[0], u) in SELECTED for u in b[3])))
            jobs = []
            for _, k in todo:
                _, worker, build, _, _ = self.builders[k]
                (d / k).mkdir()
                self.done[k] = build(assets, tmp_path_factory, d / k)
                jobs.append([worker, [json.dumps(self.done[k])]])
            try:
                run(WORKER, [json.dumps(jobs)], self.world, str(d / "logs"))
            except BaseException:
                for _, k in todo:
                    self.done.pop(k)
                raise
        return self.done[key]


WORLD2 = JointLaunch(2)


def by_name(cases: list[dict]) -> dict:
    """{case name: (the worker's record, case)} of a case list whose outputs are `<folder>/<name>.pt`."""
    import torch

    return {os.path.basename(c["out"]).removesuffix(".pt"): (torch.load(c["out"]), c) for c in cases}
