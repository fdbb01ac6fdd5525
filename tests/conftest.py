"""Shared fixtures: tiny models saved in Hugging Face format and a pre-tokenized JSONL dataset."""

from __future__ import annotations

import json
import os

import pytest

from base.env import configure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
configure()  # tests that build engines in this process load DeepSpeed's ops from the checkout's cache


def forwards_unlike_llama(classes: dict[str, str], llama_class: str) -> list[str]:
    """The model types in `classes` ({model_type: class name in its transformers module}) whose `forward` source
    differs from transformers' Llama class `llama_class`'s: the lean modules replace only identical ones."""
    import importlib
    import inspect
    import textwrap

    def body(model_type: str, cls_name: str) -> str:
        mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        return textwrap.dedent(inspect.getsource(getattr(mod, cls_name).forward))

    llama = body("llama", llama_class)
    return [t for t, cls_name in classes.items() if body(t, cls_name) != llama]


def save_tiny_model(path: str, preset: str, seed: int = 0, **overrides) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from model_utils.build import preset_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(preset_config(preset, **overrides), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def write_token_jsonl(path: str, n_docs: int = 40, vocab: int = 2048, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n_docs):
            n = rng.randint(30, 300)
            fh.write(json.dumps({"input_ids": [rng.randrange(4, vocab) for _ in range(n)]}) + "\n")
    return path


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """Model folders (MHA llama, GQA llama, Qwen2 with 1 KV head) and a token dataset."""
    d = tmp_path_factory.mktemp("assets")
    return {
        "llama_mha": save_tiny_model(str(d / "llama_mha"), "tiny-llama", num_key_value_heads=4),
        "llama_gqa": save_tiny_model(str(d / "llama_gqa"), "tiny-llama"),
        "qwen2_kv1": save_tiny_model(str(d / "qwen2_kv1"), "tiny-qwen2"),
        "data": write_token_jsonl(str(d / "tokens.jsonl")),
        "dir": str(d),
    }


def _worker_threads() -> int | None:
    """Under xdist: this worker's share of the CPUs (base/host.usable_cpus over the workers, at least 1), the share
    launch.sh gives each rank; None in a plain pytest process (its torch keeps a thread per CPU)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 1:
        return None
    from base.host import usable_cpus

    return max(1, len(usable_cpus()) // workers)


def pytest_configure(config):
    """Each xdist worker runs torch's in-process ops on its share of the CPUs (make test: two workers on 2 cores, one
    thread each). With torch's default of a thread per CPU, two busy workers ran four OpenMP threads on 2 cores and
    every parallel op waited at its barrier for a descheduled thread: an [8, 32] x [32, 32] addmm took 8 ms instead
    of 10 us (measured 2026-12-01 with another process busy), test_phase_bytes 27.5 -> 5.1 s and
    test_latent_shapes' 27 tiny models ~16 -> ~2 s (alone on a loaded box; 48 and 50 s in 4ec2f4f's clean clone,
    where the two ran side by side; side by side under `-n 2` on the loaded box 222 + 200 -> 24 + 22 s, 57 -> 9
    CPU-s; tests/unit's CPU-s 341 -> 211). The launches' processes are not touched (no OMP_NUM_THREADS is set: launch.sh
    and base/host.check_cpu_placement still choose theirs, as the e2e tests check)."""
    threads = _worker_threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        config._worker_threads = threads


def pytest_runtest_teardown(item):
    """A test that let product code set torch's threads (base/host.check_cpu_placement's share) hands the worker
    back its own share."""
    threads = getattr(item.config, "_worker_threads", None)
    if threads is not None:
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """make test runs on two pytest-xdist workers (`-n 2`): a launch waits on sleeps, polls and process start-ups a
    third of its time, which the other worker's tests fill. One worker runs a whole file (its module-scoped launches
    are paid once), and every module of tests/multiproc/joint_launch.py's shared launch goes to the same worker (the
    launch runs once, for them all). Files are handed out in collection order (`--no-loadscope-reorder`: the e2e
    launches first, the short unit files fill the end). (xdist's own `loadgroup` marks do not reach pytest 9.2's test
    ids, so the grouping is this scheduler's.)"""
    from xdist.scheduler import LoadScopeScheduling

    from tests.multiproc.joint_launch import JOINED

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "joint_launch" if os.path.splitext(os.path.basename(path))[0] in JOINED else path

    return ByFile(config, log)


def _cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (a launch's ranks and launchers, once waited for)."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With PYTEST_TIMES: each phase's CPU seconds (this worker and the processes it started and reaped) on its
    report, where the controller's line below reads it: on 2 busy cores the CPU a test burns, not its wall time, is
    what a second worker cannot hide."""
    outcome = yield
    if os.environ.get("PYTEST_TIMES"):
        now = _cpu_s()
        outcome.get_result().user_properties.append(("cpu_s", now - getattr(item, "_cpu_mark", now)))
        item._cpu_mark = now


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if os.environ.get("PYTEST_TIMES"):
        item._cpu_mark = _cpu_s()


def pytest_runtest_logreport(report):
    """PYTEST_TIMES=FILE: one line per test phase as it ends ("setup|call|teardown seconds outcome nodeid cpu=S"), so
    a long run's cost per test can be read while it runs (make test's budget: docs/testing.md). Under xdist the
    controller writes (a worker's reports reach it), the workers do not."""
    where = os.environ.get("PYTEST_TIMES")
    if where and not os.environ.get("PYTEST_XDIST_WORKER"):
        cpu = dict(report.user_properties).get("cpu_s")
        with open(where, "a") as fh:
            fh.write(f"{report.when} {report.duration:.1f} {report.outcome} {report.nodeid}"
                     f"{'' if cpu is None else f' cpu={cpu:.1f}'}\n")
