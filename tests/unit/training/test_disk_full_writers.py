"""A full or over-quota file system as the real writers report it (an audit on a tmpfs, a73): numpy's short write
without errno, safetensors' error that is no OSError, an atomic write's unnamed OSError, a console file on the full
disk, a copy's error naming its source. Each is the user's one line and exit 2 (training/job.py), not a crash (exit
1: scripts/slurm.sbatch requeues without node 0). One process but one short subprocess (RLIMIT_FSIZE: no root)."""

from __future__ import annotations

import builtins
import errno
import io
import os
from collections import namedtuple

import pytest

from tests.unit.training.test_disk_full import tiny_checkpoint
from training import job


@pytest.fixture(autouse=True)
def _no_run_folders(monkeypatch):
    monkeypatch.setattr(job, "USER_DIRS", [])


def test_a_short_npy_write_keeps_the_oss_errno(tmp_path):
    """np.save into a real file wrote through ndarray.tofile, whose short write raises an OSError with errno None
    ('1000000 requested and 74968 written'): prepare_data's refusal re-raised it (a traceback, exit 1). RLIMIT_FSIZE
    makes the write short without root: the OS's EFBIG comes through now, the file named, no tmp left."""
    import subprocess
    import sys

    code = ("import errno, resource, signal, sys, numpy as np; from data import store\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (300_000,) * 2)\n"
            "try: store.save_npy_atomic(sys.argv[1], np.arange(10**6, dtype=np.int32))\n"
            "except OSError as e: print(e.errno, e.filename)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.npy")], capture_output=True, text=True,
                         cwd=job.ROOT, timeout=60)
    assert out.stdout.split() == [str(errno.EFBIG), str(tmp_path / "a.npy")], out
    assert os.listdir(tmp_path) == []


def test_an_errno_less_write_error_on_a_disk_with_no_block_left_is_a_full_disk(tmp_path, monkeypatch):
    """The fallback for a writer that still drops the errno (numpy's tofile, data/packing.py's cache)."""
    from base.atomic import atomic_write
    from data.prepare_checks import refusal

    def short(fh):
        raise OSError("54784 requested and 27120 written")

    blocks = namedtuple("V", "f_bavail")
    monkeypatch.setattr(os, "statvfs", lambda p: blocks(0))
    with pytest.raises(OSError) as e:
        atomic_write(str(tmp_path / "a.npy"), short)
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "a.npy"))
    later = OSError("54784 requested and 27120 written")  # one the write did not convert (another writer's)
    later.filename = str(tmp_path)
    assert job.disk_full(later) is later and later.errno == errno.ENOSPC
    assert refusal(OSError("x"), str(tmp_path)).startswith(f"no space left on device (ENOSPC) writing a file under "
                                                          f"--output {tmp_path}")
    monkeypatch.setattr(os, "statvfs", lambda p: blocks(5))
    with pytest.raises(OSError, match="requested"):
        refusal(OSError("54784 requested and 27120 written"), str(tmp_path))  # room left: another failure


@pytest.mark.parametrize("os_error, err", [(28, errno.ENOSPC), (122, errno.EDQUOT)])
def test_a_full_disk_in_the_safetensors_writer_is_the_users_disk(tmp_path, monkeypatch, capsys, os_error, err):
    """safetensors' SafetensorError '... I/O error: No space left on device (os error 28)' is no OSError: the final
    export's full disk was exit 1 and a traceback (train.py: node 0's crash, requeued, exported again, failed again)."""
    import huggingface_hub
    from safetensors import SafetensorError

    from model_utils import export

    def full(*a, **k):
        raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(err)} (os error {os_error})")

    monkeypatch.setattr(huggingface_hub, "save_torch_state_dict", full)
    with pytest.raises(OSError) as e:
        export.export_hf(str(tiny_checkpoint(tmp_path, monkeypatch)), str(tmp_path / "run" / "hf_model"), owned=True)
    job.USER_DIRS[:] = [str(tmp_path / "run")]
    capsys.readouterr()
    assert job._fail(e.value) == job.EXIT_USAGE
    assert f"{errno.errorcode[err]}) writing {tmp_path / 'run' / 'hf_model.export-tmp'}:" in capsys.readouterr().err
    # scripts/export_hf.py: the same error, one line and exit 2 (was a traceback: it caught ValueError alone)
    from tests.unit.training.test_latest_behind import ROOT, importlib, killed_in_commit

    spec = importlib.util.spec_from_file_location("export_hf", os.path.join(ROOT, "scripts", "export_hf.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    killed_in_commit(tmp_path / "r")
    monkeypatch.setattr(script, "export_hf", lambda *a, **k: (_ for _ in ()).throw(e.value))
    assert script.main([str(tmp_path / "r"), "--tokenizer", "none", "--source", "none"]) == job.EXIT_USAGE
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "hf_model.export-tmp" in line and line.endswith("then run this export again"), line


def test_an_atomic_writes_error_names_its_file_and_complete_is_written_whole(tmp_path, monkeypatch):
    """eval/stage0.json (and summary.md, PINNED, STAGE_ markers...) on a full disk: an OSError naming no file, a node
    crash (exit 1). And train.py's COMPLETE went through open/write: an empty COMPLETE beside a failed run."""
    import ast

    from training import metrics as M

    m = M.MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10, False)
    real = builtins.open

    def fopen(p, mode="r", *a, **k):
        if "stage0.json.tmp" in str(p):
            raise OSError(errno.ENOSPC, "No space left on device")  # as a write() into the open tmp: no name
        return real(p, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", fopen)
    with pytest.raises(OSError) as e:
        m.log_eval(0, {"step": 2, "stage": 0})
    monkeypatch.setattr(builtins, "open", real)
    job.USER_DIRS[:] = [str(tmp_path)]
    assert e.value.filename == str(tmp_path / "eval" / "stage0.json") and job.users_disk(e.value) is e.value
    assert job._fail(e.value) == job.EXIT_USAGE
    tree = ast.parse(open(os.path.join(job.ROOT, "train.py")).read())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and "COMPLETE" in ast.unparse(n.args[:1])]
    assert [ast.unparse(c.func) for c in calls] == ["atomic_write"], [ast.unparse(c) for c in calls]


def test_a_full_console_file_keeps_the_exit_code_and_its_record(tmp_path, monkeypatch):
    """`python train.py > out.log 2>&1` on the full disk: _fail's own print raised ENOSPC (exit 1, no rank record
    for scripts/launch.sh), and a step line's print0 raised it (a crash)."""
    from base import log

    class Full(io.StringIO):
        def write(self, _):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("sys.stderr", Full())
    monkeypatch.setattr("sys.stdout", Full())
    log.say("step 10 stage 0 loss 1.0")
    job.USER_DIRS[:] = [str(tmp_path)]
    assert job._fail(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "step_000010"))) == 2
    monkeypatch.setenv("LAUNCH_EXIT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")  # a world of one: run_job leaves the environment alone
    monkeypatch.setattr(job, "record_faults", lambda: None)  # no faulthandler file held by this test process
    assert job.run_job(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space", str(tmp_path / "x"))),
                       saves=False) == job.EXIT_USAGE
    assert (tmp_path / "rank0").read_text() == "2\n"


def test_a_copys_full_destination_under_the_run_is_the_users_disk(tmp_path, capsys):
    """DeepSpeed copies zero_to_fp32.py into checkpoints/ at every save (shutil.copyfile): its ENOSPC names the source
    (site-packages) as filename and the destination as filename2: it was a crash (exit 1), not the user's disk."""
    dst = str(tmp_path / "checkpoints" / "zero_to_fp32.py")
    e = OSError(errno.ENOSPC, "No space left on device", "/venv/site-packages/deepspeed/utils/zero_to_fp32.py", None,
                dst)
    job.USER_DIRS[:] = [str(tmp_path)]
    assert job.users_disk(e) is e and job._fail(e) == job.EXIT_USAGE
    assert f"writing {dst}: free space there (`df -h {tmp_path / 'checkpoints'}`)" in capsys.readouterr().err


def test_a_stages_ds_config_record_on_a_full_disk_is_named(tmp_path, monkeypatch):
    """OUTPUT_DIR/ds_config.stageN.json was written by a plain open: a full disk's error in its write names no file
    (a crash of node 0, exit 1). Through atomic_write it is named: the user's one line, exit 2."""
    import types

    from training import stage_records

    real_open = builtins.open

    class Full(io.BytesIO):
        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

    def opened(path, mode="r", *a, **kw):
        return Full() if "w" in mode and "ds_config.stage" in os.fspath(path) else real_open(path, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", opened)
    run = types.SimpleNamespace(dims=types.SimpleNamespace(is_main=True, world=1),
                                cfg=types.SimpleNamespace(output_dir=str(tmp_path)), metrics=None)
    with pytest.raises(OSError) as e:
        stage_records._record_ds_config(run, types.SimpleNamespace(index=0, name="s"),
                                        types.SimpleNamespace(ds_config_used={"a": 1}), 0)
    assert e.value.filename == str(tmp_path / "ds_config.stage0.json")
    monkeypatch.setattr(job, "USER_DIRS", [str(tmp_path)])
    assert job._fail(e.value) == 2


def test_the_token_stream_cache_on_a_full_disk_keeps_the_oss_errno(tmp_path):
    """`--dataset_path`'s token cache (data/packing.build_token_stream) saved through np.save into the open file: the
    same errno-less short write as prepare_data's (B1). Through data/store.save_npy the OS's error and the file come
    out (RLIMIT_FSIZE: EFBIG), no tmp left."""
    import json
    import subprocess
    import sys

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(1, 1001))}) + "\n" for _ in range(100)))
    code = ("import resource, signal, sys; from data.packing import build_token_stream\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (300_000,) * 2)\n"
            "try: build_token_stream(sys.argv[1], None, 2048, sys.argv[2])\n"
            "except OSError as e: print(e.errno, e.filename)")
    out = subprocess.run([sys.executable, "-c", code, str(data), str(tmp_path / "cache")], capture_output=True,
                         text=True, cwd=job.ROOT, timeout=60)
    got = out.stdout.split()
    assert got[:1] == [str(errno.EFBIG)] and got[1].endswith(".npy") and "/cache/tokens-" in got[1], out
    assert all(".tmp" not in f for f in os.listdir(tmp_path / "cache")), os.listdir(tmp_path / "cache")
