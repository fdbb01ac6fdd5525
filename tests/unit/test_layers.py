"""The house in layers (docs/architecture.md): each package imports only the layers below it, no module takes
part in an import cycle, and importing a library module changes nothing (no environment variable, no file).

    1 base        process-group communication, the parallel layout, rank-0 printing and logs, host readings
    2 planner     model shapes, memory features and their tile/chunk rules, memory and cost model, the chooser
    3 data, model_utils   siblings: neither imports the other
    4 training    config, DeepSpeed config, engine, step, checkpointer, curriculum, evaluation, metrics
    5 train.py, scripts   the story and the user tools
    6 bench       benchmarks
    7 tests
Imports inside functions count as much as those at the top: a lazy upward import is still an upward arrow.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

from tests.distributed import ROOT

LAYERS = {"base": 1, "planner": 2, "data": 3, "model_utils": 3, "training": 4, "train": 5, "scripts": 5,
          "bench": 6, "tests": 7}
LIBRARY = ("base", "planner", "data", "model_utils", "training")


def modules() -> dict[str, str]:
    """module name -> path, for every project .py file."""
    out = {}
    for top in LAYERS:
        if top == "train":
            out["train"] = os.path.join(ROOT, "train.py")
            continue
        for dp, dirs, fs in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "_")) and d != "stubs"]
            for f in fs:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dp, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(dp, f)
    return out


def imports(path: str, name: str, known: set[str]) -> set[str]:
    """The project modules `path` imports (top level or inside functions), resolved to known module names."""
    tree = ast.parse(open(path).read(), path)
    found = set()
    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            cands = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for c in cands:
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c and c != name:
                found.add(c)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, m, set(mods)) for m, p in mods.items()}


def layer(mod: str) -> int:
    return LAYERS[mod.split(".")[0]]


def test_no_upward_imports_and_siblings_apart():
    bad = []
    for m, deps in graph().items():
        for d in deps:
            top_m, top_d = m.split(".")[0], d.split(".")[0]
            if layer(d) > layer(m) or (layer(d) == layer(m) and top_m != top_d):
                bad.append(f"{m} -> {d}")
    assert not bad, "imports that go up (or across siblings):\n" + "\n".join(sorted(bad))


def sys_path_edits(path: str) -> list[int]:
    """Lines of `path` that change the import path: sys.path assigned, augmented or indexed into, any call of a
    sys.path method (insert, append, extend, remove, ...), site.addsitedir."""
    tree = ast.parse(open(path).read(), path)

    def is_sys_path(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
            and node.value.id == "sys"

    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if any(is_sys_path(t) or isinstance(t, ast.Subscript) and is_sys_path(t.value) for t in targets):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                is_sys_path(node.func.value) or node.func.attr == "addsitedir"):
            lines.append(node.lineno)
    return lines


def test_nothing_edits_sys_path_outside_tests():
    """The project is installed (`pip install -e .`, scripts/setup.sh; pyproject.toml's packages), so the library,
    train.py, scripts/ and bench/ import it as installed; only tests may put stand-ins on the path. (The upward-import
    rule above covers scripts/ too: LAYERS places them at 5, with train.py.) Failed on scripts/eval_summary.py's
    `sys.path.insert(0, ROOT)` before it was removed."""
    bad = [f"{os.path.relpath(p, ROOT)}:{line}" for m, p in modules().items() if not m.startswith("tests")
           for line in sys_path_edits(p)]
    assert not bad, "sys.path edited outside tests:\n" + "\n".join(bad)


def test_no_source_file_over_500_lines():
    """Issue 50: the house keeps its shape as it grows: no source file (library, scripts, bench, tests, shell) over
    500 lines; a file that grows past it is cut where its concern changes, not by line count."""
    files = subprocess.run(["git", "ls-files", "*.py", "*.sh", "*.sbatch", "Makefile"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    long = {f: n for f in files if os.path.isfile(os.path.join(ROOT, f))
            and (n := sum(1 for _ in open(os.path.join(ROOT, f), errors="replace"))) > 500}
    assert files and not long, long


def test_no_import_cycles():
    g = graph()
    seen, stack, cycles = set(), [], []

    def visit(m: str) -> None:
        if m in stack:
            cycles.append(" -> ".join([*stack[stack.index(m):], m]))
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in sorted(g.get(m, ())):
            visit(d)
        stack.pop()

    for m in sorted(g):
        visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_importing_the_library_has_no_side_effects(tmp_path):
    """Import every library module in a fresh process: the environment and the working folder stay as they were."""
    mods = sorted(m for m in modules() if m.split(".")[0] in LIBRARY)
    code = f"""
import importlib, json, os, sys
import deepspeed, torch, transformers  # their own import-time settings are not ours
before, files, out = dict(os.environ), set(os.listdir('.')), {{}}
for m in {mods!r}:
    importlib.import_module(m)
    env = {{k: v for k, v in os.environ.items() if before.get(k) != v}}
    new = sorted(set(os.listdir('.')) - files)
    if env or new:
        out[m] = {{"env": env, "files": new}}
        before, files = dict(os.environ), set(os.listdir('.'))
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "TORCH_CUDA_ARCH_LIST")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    effects = json.loads(proc.stdout.strip().splitlines()[-1])
    assert effects == {}, effects
