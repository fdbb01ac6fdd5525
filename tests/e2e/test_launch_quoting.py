"""What reaches the nodes over pdsh (`scripts/launch.sh -H hostfile`): deepspeed's pdsh runner hands them ONE shell
command line, each train.py argument bare or in "..." (when it has a space), every .deepspeed_env value as
`export K="V"` without escaping, the working directory (`cd DIR;`), the python and TRAIN_SCRIPT bare; pdsh replaces
%h %u %n %% in it. An audit traced values through it: `/data/R&D/train.jsonl` put the ranks in the background with
`--dataset_path /data/R`, "$HOME/`id`" ran `id`, `cd /tmp/My Project` failed and every rank ran in $HOME, a WANDB_NAME
with quotes lost them. launch.sh now refuses in one line what would not arrive as written (scripts/launch_env.sh
pdsh_refusal, env_refusal) and lets through what does: the verdicts are checked here against DeepSpeed's own quoting
code (read from the installed multinode_runner.py), pdsh's substitution and a real shell, value by value. No rank is
started (`--print-only`, stand-ins)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests.e2e.launchers import ROOT, clean_env, launch, wait_for

LAUNCH_ENV = os.path.join(ROOT, "scripts", "launch_env.sh")
# a node's login shell runs the command line: a value arrives when it does under each (dash expands no {a,b}, bash does)
SHELLS = [s for s in ("bash", "sh", "dash", "zsh") if shutil.which(s)]


def deepspeed_quoting() -> dict:
    """PDSHRunner.parse_user_args and MultiNodeRunner.add_export as the installed deepspeed has them (its source,
    not a copy: importing the module would import torch)."""
    path = os.path.join(importlib.util.find_spec("deepspeed").submodule_search_locations[0], "launcher",
                        "multinode_runner.py")
    with open(path) as fh:
        tree = ast.parse(fh.read())
    ns: dict = {"re": re}
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name in ("MultiNodeRunner", "PDSHRunner"):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name in ("add_export", "parse_user_args"):
                    exec(compile(ast.Module([fn], []), path, "exec"), ns)  # noqa: S102 (deepspeed's own code)
    assert {"add_export", "parse_user_args"} <= set(ns), f"{path}: the quoting functions moved"
    return ns


DS = deepspeed_quoting()


class _Runner:  # what the two methods read of `self`
    def __init__(self, user_args=()):
        self.args = type("Args", (), {"user_args": list(user_args)})()
        self.exports: dict = {}


def pdsh_subst(line: str, host: str = "hA", user: str = "me", rank: int = 0) -> str:
    """pdsh's pipecmd_format_arg (src/common/pipecmd.c), applied to the remote command too: %h %u %n %%."""
    return re.sub(r"%(.)", lambda m: {"h": host, "u": user, "n": str(rank), "%": "%"}.get(m.group(1), m.group(0)),
                  line, flags=re.S)


def remote(line: str, shell: str, cwd) -> subprocess.CompletedProcess:
    """The node's shell reading the command line. HOME='~': a leading ~ the shell expands is the node's $HOME, the
    folder train.py's own expanduser gives (training/config.home_paths), so it shows here as itself."""
    return subprocess.run([shell, "-c", pdsh_subst(line)], cwd=cwd, capture_output=True, timeout=10,
                          env={"PATH": os.environ["PATH"], "HOME": "~"})


def arrives_as_argument(value: str, cwd) -> bool:
    line = "printf '%s\\0' START " + " ".join(DS["parse_user_args"](_Runner([value]))) + " END"
    return all(remote(line, shell, cwd).stdout.split(b"\0") == [b"START", value.encode(), b"END", b""]
               for shell in SHELLS)


def arrives_as_env(value: str, cwd) -> bool:
    """A .deepspeed_env line as the runner reads it (runner.py lines 604-611: readlines, split at the first =) and
    exports it; the blanks around a value are stripped there (said in docs/launch.md, not refused)."""
    (cwd / "envfile").write_text(f"V={value}\n")
    runner = _Runner()
    try:
        with open(cwd / "envfile") as fd:
            for var in fd.readlines():
                key, val = var.split("=", maxsplit=1)
                DS["add_export"](runner, key, val)
    except ValueError:  # a line without '=' (a carriage return splits the line): the runner's traceback
        return False
    line = "".join(f"export {k}={v}; " for k, v in runner.exports.items()) + "printf '%s' \"$V\""
    return all(remote(line, shell, cwd).stdout == pdsh_subst(value.strip()).encode() for shell in SHELLS)


def verdicts(function: str, values: list[str], *extra: str) -> list[str]:
    """launch_env.sh's FUNCTION for each value (its reason, '' when it arrives), in one bash."""
    loop = f'. "$0"; for v in "$@"; do printf "%s\\0" "$({function} "$v" {" ".join(extra)})"; done'
    p = subprocess.run(["bash", "-c", loop, LAUNCH_ENV, *values], capture_output=True, text=True,
                       env={"PATH": os.environ["PATH"]})
    assert p.returncode == 0, p.stderr
    return p.stdout.split("\0")[:-1]


ARGUMENTS = [  # value, whether it arrives as written
    # arrive: "..." holds quotes, blanks, braces, globs and ;&|<>() of an argument with a space; bare, UTF-8 and ! ^ ] }
    # and a # inside a word hold; a leading ~ is the node's home
    ("--max_steps=3", True), ("a b", True), ("it's a b", True), ('say "hi" there', True),
    ('{"rope_type": "yarn", "factor": 4}', True), ("/lustre/My Project/run 1", True), ("R&D (v2); x|y <z>", True),
    ("/data/*.jsonl b", True), ("a\tb c", True), ("a\nb c", True), ("C:\\dir x", True), ("Übung—日本", True),
    ("a!b", True), ("a^b", True), ("a#b", True), ("a]b", True), ("{a}", True), ("{a.b}", True), ("x,y=z", True),
    ("50%x", True), ("~/runs/x", True), ("x=~/y", True), ("--output_dir=~/runs/x", True), ("128k,256k", True),
    # do not: the audit's, and the shell's other readings
    ("", False), ("a\\b\\\\c", False), ("a\tb", False), ("a\nb", False), ("it's", False), ('a"b', False),
    ('{"rope_type":"yarn","factor":4}', False), ("{a,b}", False), ("{1..3}", False), ("/data/R&D/train.jsonl", False),
    ("a;b", False), ("a|b", False), ("a>out", False), ("(x)", False), ("*.jsonl", False), ("?.jsonl", False),
    ("[ab].jsonl", False), ("#x", False), ("$HOME", False), ("`echo hi`", False), ("/d/it's $HOME/`id`", False),
    ("a b $x", False), ("a b `echo z`", False), ("a b\\", False), ('a\\" b', False), ("a\\\\ b", False),
    ("a b\\$x", False), ("100%hot", False), ("a%%b", False), ("a b %n", False), ("x%u", False),
]

ENV_VALUES = [  # a .deepspeed_env value
    ("exp long", True), ("it's", True), ("a;b&c|d", True), ("(x) <y>", True), ("~/x", True), ("Übung", True),
    ("C:\\dir", True), ("{a,b}", True), ("*", True), ("a\tb", True), ("mlx5_0,mlx5_1", True), ("50%x", True),
    ('exp "long" $5', False), ('say "hi"', False), ("$5", False), ("`id`", False), ("a\\", False), ("a\\$b", False),
    ("a\\\\b", False), ("a\rb", False),
    # pdsh's %h %u %n %% in a value are meant (NCCL_DEBUG_FILE=/tmp/nccl.%h.%p.log: one file a host): they arrive as
    # pdsh writes them (refused for a day: a review)
    ("/tmp/nccl.%h.%p.log", True), ("x%hy", True), ("%%", True),
]


def test_an_argument_is_refused_exactly_when_the_nodes_would_not_get_it(tmp_path):
    """launch_env.sh's verdict (bare words: pdsh_bare; with a space: pdsh_quoted, the " escaped) against what the
    node's shell makes of DeepSpeed's quoting, value by value: no value that arrives is refused (a JSON rope with
    spaces, a quote in a spaced path), none that does not is let through. Globs meet matching files here, as a
    dataset folder on the node would."""
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("")
    bare = verdicts("pdsh_bare", [v for v, _ in ARGUMENTS if " " not in v])
    spaced = verdicts("pdsh_quoted", [v for v, _ in ARGUMENTS if " " in v], "1")
    said = dict(zip([v for v, _ in ARGUMENTS if " " not in v], bare)) | dict(
        zip([v for v, _ in ARGUMENTS if " " in v], spaced))
    wrong = [(v, said[v]) for v, ok in ARGUMENTS if (said[v] == "") != ok or arrives_as_argument(v, tmp_path) != ok]
    assert not wrong, wrong


def test_a_deepspeed_env_value_is_refused_exactly_when_the_nodes_would_not_get_it(tmp_path):
    said = dict(zip([v for v, _ in ENV_VALUES], verdicts("pdsh_quoted", [v for v, _ in ENV_VALUES], "0", "1")))
    wrong = [(v, said[v]) for v, ok in ENV_VALUES
             if (said[v] == "") != ok or arrives_as_env(v, tmp_path) != ok]
    assert not wrong, wrong


# --- launch.sh over pdsh (two hosts, neither this one), --print-only ---

def hosts(where) -> None:
    (where / "hf").write_text("hA slots=1\nhB slots=1\n")


def one_line(p: subprocess.CompletedProcess, *words: str) -> bool:
    return p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1 and all(w in p.stderr for w in words)


@pytest.mark.parametrize("arg, words", [
    ("/d/it's $HOME/`id`", ["train.py argument '/d/it'\\''s $HOME/`id`'", "expand inside the \"...\"",
                            "--config YAML", "--no_ssh on each node", "slurm.sbatch"]),
    ('{"rope_type":"yarn","factor":4}', ["the shell there reads its quote"]),
    ("/data/R&D/train.jsonl", ["'/data/R&D/train.jsonl'", "the shell there reads"]),
    ("a\\b\\\\c", ["the shell there reads"]), ("a\tb", ["$'a\\tb'", "splits it"]), ("", ["an empty argument vanishes"]),
    ("run%n", ["pdsh replaces %h, %u, %n and %%"]),
])
def test_an_argument_the_nodes_would_not_get_is_one_line(tmp_path, arg, words):
    hosts(tmp_path)
    p = launch(["--print-only", "-H", "hf", "--", "--output_dir", "out", "--x", arg], tmp_path, DS_ACCELERATOR="cpu")
    assert one_line(p, *words), p.stderr
    assert sorted(os.listdir(tmp_path)) == ["hf"], "nothing written (no .deepspeed_env.XXXXXX left)"


def test_what_arrives_is_not_refused_and_other_launches_take_anything(tmp_path):
    """Over pdsh a spaced JSON rope, a quote in a spaced path, UTF-8 and ~ pass; --no_ssh, and a hostfile whose one
    host is this machine (deepspeed runs it locally), take the arguments pdsh would change."""
    hosts(tmp_path)
    good = ["--rope", '{"rope_type": "yarn", "factor": 4}', "--output_dir", "/lustre/o'brien \"q\"/run 1",
            "--run_name", "Übung—日本", "--dataset_path", "~/data"]
    assert launch(["--print-only", "-H", "hf", "--", *good], tmp_path, DS_ACCELERATOR="cpu").returncode == 0
    bad = ["--dataset_path", "/data/R&D/x.jsonl", "--empty", ""]
    for opts in (["--no_ssh", "--nnodes", "2", "--node_rank", "0", "--master_addr", "10.0.0.1", "--num_gpus", "1"],
                 ["-H", "local"]):
        (tmp_path / "local").write_text("localhost slots=1\n")
        p = launch(["--print-only", *opts, "--", *bad], tmp_path, DS_ACCELERATOR="cpu")
        assert p.returncode == 0, p.stderr


def test_a_working_directory_or_train_script_the_nodes_cannot_cd_to_or_run_is_one_line(tmp_path):
    """`cd /tmp/My Project;` failed on the nodes and every rank ran in $HOME (a relative output_dir went to
    ~/checkpoints); TRAIN_SCRIPT is bare in the command line as well."""
    work = tmp_path / "My Project"
    work.mkdir()
    hosts(work)
    p = launch(["--print-only", "-H", "hf", "--", "--x", "1"], work, DS_ACCELERATOR="cpu")
    assert one_line(p, f"the working directory '{work}'", "splits it", "every rank ran in $HOME", "--no_ssh"), p.stderr
    hosts(tmp_path)
    p = launch(["--print-only", "-H", "hf", "--", "--x", "1"], tmp_path, DS_ACCELERATOR="cpu",
               TRAIN_SCRIPT="/opt/o'brien/train.py")
    assert one_line(p, "TRAIN_SCRIPT '/opt/o'\\''brien/train.py'", "the shell there reads its quote"), p.stderr


@pytest.mark.parametrize("env, name", [({"WANDB_NAME": 'exp "long" $5'}, "WANDB_NAME"),
                                       ({"MYVAR": "a`id`", "LAUNCH_EXPORT": "MYVAR"}, "MYVAR"),
                                       ({"HF_HOME": "/x/$h"}, "HF_HOME")])
def test_a_deepspeed_env_value_the_nodes_would_not_get_is_one_line(tmp_path, env, name):
    """add_export wraps a value in "..." without escaping: `WANDB_NAME='exp "long" $5'` arrived as `exp long `, a
    backtick ran. The value itself is not shown (WANDB_API_KEY goes there too)."""
    hosts(tmp_path)
    p = launch(["--print-only", "-H", "hf", "--", "--x", "1"], tmp_path, DS_ACCELERATOR="cpu", **env)
    assert one_line(p, f"{name} (this environment's, for .deepspeed_env) does not reach the nodes", "--no_ssh"), p.stderr
    assert env[name] not in p.stderr and sorted(os.listdir(tmp_path)) == ["hf"]
    (tmp_path / "local").write_text("localhost slots=1\n")  # not over pdsh: the ranks inherit it as it is
    assert launch(["--print-only", "-H", "local", "--", "--x", "1"], tmp_path, DS_ACCELERATOR="cpu",
                  **env).returncode == 0


def test_a_line_of_your_own_in_deepspeed_env_is_passed_as_written(tmp_path):
    """A $X in your own line expands on the node, as it may be meant (`LD_LIBRARY_PATH=/opt/lib:$LD_LIBRARY_PATH`):
    only the values launch.sh writes from this environment are judged."""
    hosts(tmp_path)
    (tmp_path / ".deepspeed_env").write_text("LD_LIBRARY_PATH=/opt/lib:$LD_LIBRARY_PATH\n")
    p = launch(["--print-only", "-H", "hf", "--", "--x", "1"], tmp_path, DS_ACCELERATOR="cpu")
    assert p.returncode == 0, p.stderr
    assert "LD_LIBRARY_PATH=/opt/lib:$LD_LIBRARY_PATH" in (tmp_path / ".deepspeed_env").read_text().splitlines()


@pytest.mark.parametrize("names, words", [("FOO=bar", ["LAUNCH_EXPORT 'FOO=bar': 'FOO=bar' is not a variable name"]),
                                          ("*", ["LAUNCH_EXPORT '*': '*' is not a variable name"]),
                                          ("A-B", ["'A-B' is not a variable name"])])
def test_launch_export_names_that_are_not_variables_are_one_line(tmp_path, names, words):
    """`A,B` or `FOO=bar` was bash's `invalid variable name` (exit 1) with a .deepspeed_env.XXXXXX left behind; `*`
    expanded to the files here."""
    p = launch(["--print-only", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", LAUNCH_EXPORT=names)
    assert one_line(p, *words), p.stderr
    assert os.listdir(tmp_path) == []


def test_launch_export_takes_blanks_and_commas_between_names(tmp_path):
    p = launch(["--print-only", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", LAUNCH_EXPORT=" A,B\tC ", A="1",
               B="2", C="3")
    assert p.returncode == 0, p.stderr
    lines = (tmp_path / ".deepspeed_env").read_text().splitlines()
    assert lines[-3:] == ["A=1", "B=2", "C=3"], lines


# --- a save request over pdsh reaches this launch's ranks whatever the script's path ---

RANK = """import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *a: (open(sys.argv[2], "w").write("USR1"), sys.exit(0)))
open(sys.argv[2] + ".up", "w").close()
time.sleep(60)
"""


@pytest.mark.parametrize("folder", ["c++", "o'brien (v2)", "a.b[1]$"])
def test_a_save_request_reaches_ranks_whose_script_path_has_regex_or_quote_characters(tmp_path, folder):
    """remote_signal's `pgrep -f '<TRAIN_SCRIPT> --local_rank=[0-9]'` read the path as a regex (c++/train.py matched
    no rank: SIGTERM, Ctrl-C and a hang-up reached none) and a ' in it broke the command. The command it builds, run
    by a shell as a node's would, against a stand-in rank started as deepspeed's launch.py starts one."""
    (tmp_path / folder).mkdir()
    script = tmp_path / folder / "train.py"
    script.write_text(RANK)
    got = tmp_path / "got"
    rank = subprocess.Popen([sys.executable, str(script), "--local_rank=0", str(got)],
                            env={**clean_env(), "ULYSSES_LAUNCH_ID": "me 1 2"})
    try:
        wait_for(lambda: os.path.exists(f"{got}.up"), 30, "the stand-in rank")
        cmd = subprocess.run(["bash", "-c", '. "$0"; remote_signal USR1', LAUNCH_ENV], capture_output=True, text=True,
                             env={"PATH": os.environ["PATH"], "TRAIN_SCRIPT": str(script),
                                  "ULYSSES_LAUNCH_ID": "me 1 2"}).stdout
        subprocess.run(["bash", "-c", cmd], timeout=30, check=True)
        rank.wait(timeout=30)
        assert got.read_text() == "USR1", cmd
    finally:
        if rank.poll() is None:
            rank.send_signal(signal.SIGKILL)
            rank.wait()


def test_nccls_per_host_log_file_goes_over_pdsh(tmp_path):
    """NCCL_DEBUG_FILE=/tmp/nccl.%h.%p.log (NCCL's own %h: the host), what one sets to debug a multi-node hang: pdsh
    writes the node's name for %h, one file a host as meant. It was refused for a day (a review)."""
    hosts(tmp_path)
    p = launch(["--print-only", "-H", "hf", "--", "--x", "1"], tmp_path, DS_ACCELERATOR="cpu",
               NCCL_DEBUG_FILE="/tmp/nccl.%h.%p.log")
    assert p.returncode == 0, p.stderr
