"""A stage's engine leaves nothing behind in DeepSpeed's class-level caches, and the async save's staging buffers go
back at a stage's end (training/engine.release_engine, training/async_save.Staging.release). The whole path, engines
dead after gc at every stage change of a 3-stage launch, is asserted in tests/e2e/test_curriculum.py
(`engine_released` records). In-process, no engine: < 1 s."""

from __future__ import annotations

import functools
import gc
import weakref

import torch

from training.async_save import Staging, stage
from training.engine import _clear_method_caches, _coordinator_class


def nvtx_like(func):
    """A decorator that keeps no __wrapped__ (deepspeed.utils.nvtx.instrument_w_nvtx): the cache is in its closure."""

    def wrapped_fn(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapped_fn


class Coordinator:
    @nvtx_like
    @functools.lru_cache(maxsize=None)  # noqa: B019, UP033  (DeepSpeed's own pattern: the leak under test)
    def params_to_release(self, submodule, step_id: int) -> int:
        return step_id


def test_a_cached_method_behind_a_decorator_lets_its_arguments_go():
    c, module = Coordinator(), torch.nn.Linear(2, 2)
    c.params_to_release(module, 3)
    refs = [weakref.ref(c), weakref.ref(module)]
    del c, module
    gc.collect()
    assert all(r() is not None for r in refs)  # the class-level cache holds self and the module: the leak
    assert _clear_method_caches(Coordinator) == 1
    gc.collect()
    assert all(r() is None for r in refs)


def test_deepspeeds_coordinator_cache_is_found():
    """The cache release_engine clears is where this DeepSpeed keeps it (PartitionedParameterCoordinator.
    __params_to_release, an lru_cache inside instrument_w_nvtx): none found means DeepSpeed moved or dropped it, and
    the stage-change check in test_curriculum says whether engines are still freed."""
    assert _clear_method_caches(_coordinator_class()) >= 1


def test_staging_release_gives_its_buffers_back():
    staging = Staging()
    staged = stage({"m": torch.ones(1000), "v": torch.zeros(10)}, staging)
    assert staging.nbytes == 4040 and len(staging.buffers) == 2
    del staged
    assert staging.release() == 4040
    assert staging.buffers == [] and staging.nbytes == 0 and staging.used == 0
    again = stage({"m": torch.ones(3)}, staging)  # the next stage's first background save allocates afresh
    assert torch.equal(again["m"], torch.ones(3)) and staging.nbytes == 12


def test_the_checkpointer_releases_its_staging_only_with_no_save_in_flight(tmp_path):
    """training/stage.py gives the background saves' host copy back at a stage's end through Checkpointer.
    release_staging: never under a write still in flight (its snapshot is being read), and a no-op before any
    background save."""
    from training.checkpoint import Checkpointer

    ckpt = Checkpointer(str(tmp_path), keep=2)
    assert ckpt.release_staging() == 0  # no background save yet
    ckpt._staging = Staging()
    stage({"m": torch.ones(1000)}, ckpt._staging)
    ckpt.pending = object()  # a write in flight
    assert ckpt.release_staging() == 0 and ckpt._staging.nbytes == 4000
    ckpt.pending = None
    assert ckpt.release_staging() == 4000 and ckpt._staging.buffers == []
