"""Loading a checkpoint into an engine, once training/restore.py has chosen and verified it: every rank first looks up
the files it will read (a node's stale view of the shared file system: `_await_files`), a checkpoint of another world
size loads through its universal conversion (training/universal.py, `_universal`), DeepSpeed's load keeps today's peak
LR, decay, betas and eps, a stage with `reset_optimizer` zeroes Adam's moments, and each rank gets back its data
position and RNG. `Restorer` (training/restore.py), and so `Checkpointer` (training/checkpoint.py), is a `Loader`.

At Llama-3-8B on 32 ranks a checkpoint is ~100 GB (bf16 weights + fp32 master weights and Adam moments): each rank
re-reads ~3 GB at a load; a universal conversion takes rank 0 up to ~45 min.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import torch

from base import comm, progress
from base.log import print0, rank_log
from training import buffers, universal
from training.checkpoint_files import EVERY, MANIFEST, awaited, file_rank, not_visible, read_json, state_file
from training.job import Requeue
from training.preemption import Deadline


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def reset_adam_moments(optimizer) -> int:
    """Zero Adam's moments and step counts in place (a stage with `reset_optimizer`); the fp32 master weights
    are kept. Works on DeepSpeed's ZeRO wrappers (the torch optimizer is `.optimizer`). Returns the number of
    parameter states reset."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        for k, v in state.items():
            if torch.is_tensor(v):
                v.zero_()
            elif k == "step":
                state[k] = 0
    for group in inner.param_groups:
        if "step" in group:
            group["step"] = 0
    return len(inner.state)


class Loader:
    """Load checkpoints into an engine (Restorer's loading half: Checkpointer sets these fields)."""

    output_dir: str  # conversions go under OUTPUT_DIR/universal/
    settle_s: float  # how long a file this node cannot see yet is looked for again
    deadline: Deadline  # the job's end: bounds a universal conversion

    def _await_files(self, root: str, sizes: dict[str, int], mine: list[str], what: str) -> None:
        """Before loading: each rank looks up its files `mine` of those under `root` (`sizes`: name -> size; `awaited`:
        the ones it reads) by name until it sees them whole, for up to `settle_s` (a node's stale view, as verification
        does), then one gathered verdict: a file some rank still cannot see fails the load on every rank in one line
        (exit 1). Collective."""
        t0 = time.monotonic()
        late = not_visible(root, {f: sizes[f] for f in mine}, self.settle_s)
        if time.monotonic() - t0 >= 1.0:
            rank_log(f"waited {time.monotonic() - t0:.0f} s for files of {what} this node did not see yet"
                     + (f"; still not seen: {sorted(late)[:3]}" if late else ""))
        reports = comm.all_gather_object({f: late[f] for f in sorted(late)[:3]})
        for r, got in enumerate(reports):
            if got:
                f = next(iter(got))
                seen = "not found" if got[f] is None else f"{got[f]} of {sizes[f]} bytes"
                raise RuntimeError(f"{what}: rank {r} cannot see {os.path.join(root, f)} ({seen}) after looking for "
                                   f"it for {self.settle_s:.0f} s: that node's view of the shared file system is stale "
                                   "or the file was removed")

    def load(self, engine, path: str, load_optimizer: bool = True, load_scheduler: bool = True) -> dict:
        """Restore engine state into `engine`; returns this rank's saved state (data position, RNG).

        A new stage loads the previous stage's weights, optionally its Adam moments, never its LR schedule."""
        rank, world = comm.rank(), comm.world()
        t0 = time.perf_counter()
        load_dir, tag = os.path.split(path.rstrip("/"))
        manifest = comm.run_on_main(lambda: read_json(os.path.join(path, MANIFEST)))["json"]
        saved_world = manifest["world"]
        sizes = {f: int(e["size"]) for f, e in manifest["files"].items()}
        # the files each rank reads: its own; of another world, rank 0's data position (rank 0 converts from all)
        reader = file_rank if saved_world == world else lambda f: EVERY if f == state_file(0) else None
        self._await_files(path, sizes, awaited(sizes, rank, world, reader), f"checkpoint {path}")
        if saved_world != world:  # rank 0 converts for up to ~45 min at 8B (training/universal.py): never judged
            progress.mark(None, "build")
            load_dir, files = self._universal(path)
            # DeepSpeed's universal load: every rank reads zero/* (each parameter's slices) and rank 0's model states
            mine = awaited(files, rank, world, lambda f: EVERY if file_rank(f) in (None, 0) else None)
            self._await_files(os.path.join(load_dir, tag), files, mine, f"the universal conversion of {path}")
            progress.mark(None, "restore")  # the shards' reads, judged at RESTORE_S (base/progress.py)
        # universal exactly when converted: set for every load (a JSON's checkpoint.load_universal, now dropped by
        # training/ds_config.py, was in force for the first, which then crashed on a same-world checkpoint)
        engine._config.load_universal_checkpoint = saved_world != world
        # today's peak LR: the schedule's state brings the saved run's (LambdaLR's base_lrs) back
        sched = engine.lr_scheduler if load_scheduler else None
        today = list(sched.base_lrs) if hasattr(sched, "base_lrs") else None
        # today's decay, betas and eps: the optimizer's saved param_groups bring the saved run's back (DeepSpeed's
        # load_state_dict copies every key of them; a resume with --weight_decay 0.1 after 0.0 trained on at 0.0)
        hyper = [{k: g[k] for k in ("weight_decay", "betas", "eps") if k in g} for g in engine.optimizer.param_groups]
        # Always the whole ZeRO state: under ZeRO-3 the weights live in the optimizer's fp32 partitions
        # (`load_module_only` would restore them from the empty module placeholders); moments reset after.
        loaded, client = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=load_scheduler)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load {path}")
        if saved_world != world:  # DeepSpeed's universal load restores parameters only, not buffers
            buffers.restore_buffers(engine, loaded, (client or {}).get("buffer_names") or [])
        if not load_optimizer:
            reset_adam_moments(engine.optimizer)
        for group, h in zip(engine.optimizer.param_groups, hyper):
            group.update(h)
        if today is not None:
            keep_todays_peak(engine.optimizer, sched, today)
        if not load_scheduler and engine.lr_scheduler is not None:
            # the loaded optimizer state carries the old stage's LR; start the new schedule from its step 0
            for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
                group["lr"] = lr
        engine._config.load_universal_checkpoint = False
        print0(f"loaded {path} in {time.perf_counter() - t0:.1f}s")
        if saved_world != world:  # rank r of another world: take rank 0's data position, fresh RNG
            return {k: v for k, v in torch.load(os.path.join(path, state_file(0)), weights_only=False).items()
                    if k != "rng"}
        return torch.load(os.path.join(path, state_file(rank)), weights_only=False)

    def _universal(self, path: str) -> tuple[str, dict[str, int]] | None:
        """For a checkpoint written by another world size: its universal conversion (training/universal.py), made
        by rank 0 if none of exactly this content exists, and if it can finish before the job's end. Returns the
        folder to load from and the conversion's files (name -> size), the same on every rank; None for a checkpoint
        of this world size. Raises Requeue (exit 75) when the conversion cannot finish before the job's end,
        ValueError (exit 2) when it cannot fit a whole allocation. Collective: rank 0 decides and converts while
        the others wait on the host (comm.run_on_main)."""
        world = comm.world()

        def decide() -> dict | None:
            saved = read_json(os.path.join(path, MANIFEST))["json"]["world"]
            return None if saved == world else universal.prepare(path, saved, world, self.output_dir, self.deadline)

        got = comm.run_on_main(decide, long=True)  # a universal conversion: minutes to hours
        if got is None:
            return None
        if "requeue" in got:
            raise Requeue(got["requeue"])
        if "refuse" in got:
            raise ValueError(got["refuse"])
        return got["dir"], got["files"]


def keep_todays_peak(optimizer, sched, today: list[float]) -> None:
    """After a mid-stage load: the schedule at its saved step with today's peak LR (a resume with a lower
    --learning_rate, after a loss spike, kept the saved run's: LambdaLR's state carries its base_lrs). The step
    count is the checkpoint's; each group's LR is today's schedule there."""
    lams = getattr(sched, "lr_lambdas", None)
    if not lams or len(lams) != len(today):
        return
    sched.base_lrs = list(today)
    lrs = [base * lam(sched.last_epoch) for base, lam in zip(today, lams)]
    for group, lr, base in zip(getattr(sched, "optimizer", optimizer).param_groups, lrs, today):
        group["lr"], group["initial_lr"] = lr, base
    sched._last_lr = lrs
