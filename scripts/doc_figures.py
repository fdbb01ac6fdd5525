"""Regenerate every figure block the docs quote from a command (issue 49: the docs quote only current figures).

A block in any docs/**/*.md page is

    <!-- generated: python scripts/plan.py --compare [options] -->
    ...the command's output...
    <!-- end generated -->

and this script reruns each command and writes its output between the markers:

    python scripts/doc_figures.py           # rewrite the stale blocks, print which
    python scripts/doc_figures.py --check   # exit 1 naming each stale block (tests/unit/planner/test_doc_figures.py)

(exit 2, one line, when a block's command fails: its own one-line refusal, e.g. plan_vs_run.py's for a JSON without
the section it names.)

Commands run in a subprocess from the repository root (only `python scripts/...` commands: the markers are read
from our own pages). Outside the blocks, a figure a page claims must be current (`stale_bold` lists the others):
- a multi-million length claimed for a GPU count: in bold with "on one GPU" / "on N" in or right after the bold
  ("**1,240,480 tokens on one GPU**", "**1,240,480 tokens** on one GPU", "**17.6M on 32**"), or in a table row whose
  first cell is a GPU count ("| 32 | ... | 17,580,160 | ..."), must be one a block holds (an "N.NM" one: to its
  digits);
- a kernel rate ("500.5 / 577.7 TFLOP/s", forward / backward) must be one the committed kernel probe measured
  (bench/results/gpu.json "kernels", to the digits written);
- a GPU peak against an 80 GB card's 78 GiB budget ("70.20 / 78", "70.20 of 78 GiB") must be one a block holds.
History is exempt: docs/results/LOG.md, and a paragraph that starts with "History".
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
BLOCK = re.compile(r"(<!-- generated: (python scripts/[^>]*?) -->\n)(.*?)(<!-- end generated -->)", re.S)
LENGTH = re.compile(r"\d{1,3}(?:,\d{3}){2,}|\b\d+(?:\.\d+)?M\b")  # 1,240,480 / 17,580,160 / 19.4M
# a length claimed for a GPU count: bold, with "on one GPU" / "on N" inside or right after it
BOLD = re.compile(r"\*\*([^*]+)\*\*([^*\n]{0,24})")
ON_GPUS = re.compile(r"\bon (?:one GPU|\d+)\b")
GPU_ROW = re.compile(r"^\| *\d+ *\|.*$", re.M)  # a table row whose first cell is a GPU count (plan.py --compare's)
RATE = re.compile(r"(\d+(?:\.\d+)?) / (\d+(?:\.\d+)?) TFLOP/s")  # a kernel's forward / backward rate
PEAK = re.compile(r"\b(\d+\.\d\d)\s+(?:/|of)\s+78\b")  # a GPU peak against the 78 GiB budget (plan.py's column)
HISTORY = ("LOG.md",)
KERNELS = os.path.join(ROOT, "bench", "results", "gpu.json")


def pages() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def run(command: str) -> str:
    argv = shlex.split(command)
    out = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out if out.endswith("\n") else out + "\n"


def refresh(check: bool) -> list[str]:
    """The stale blocks ('page: command'); rewritten unless `check`."""
    stale, cache = [], {}
    for page in pages():
        with open(page) as fh:
            text = fh.read()

        def sub(m: re.Match, page: str = page) -> str:
            cmd = m.group(2).strip()
            if cmd not in cache:
                cache[cmd] = run(cmd)
            out = cache[cmd]
            if out != m.group(3):
                stale.append(f"{os.path.relpath(page, ROOT)}: {cmd}")
            return m.group(1) + out + m.group(4)

        new = BLOCK.sub(sub, text)
        if new != text and not check:
            with open(page, "w") as fh:
                fh.write(new)
    return stale


def prose(text: str) -> str:
    """A page without its generated blocks and its history paragraphs (those starting "History")."""
    text = BLOCK.sub("", text)
    return "\n\n".join(p for p in re.split(r"\n\s*\n", text) if not re.match(r"[*_ ]*History", p))


def _near(written: str, value: float) -> bool:
    """Whether `value` shows as `written` at its digits ("19.4" for 19.38; "500" for 500.5)."""
    digits = len(written.partition(".")[2])
    return abs(float(written) - value) <= 0.5 * 10**-digits + 1e-9


def _claims(text: str) -> list[str]:
    """The lengths a page's prose claims for a GPU count (bold, or a GPU-count table row)."""
    found = [n for m in BOLD.finditer(text) if ON_GPUS.search(m.group(1) + m.group(2)) for n in LENGTH.findall(m.group(1))]
    return found + [n for row in GPU_ROW.findall(text) for n in LENGTH.findall(row)]


def kernel_rates() -> list[tuple[float, float]]:
    """(forward, backward) TFLOP/s of every kernel the committed probe timed."""
    try:
        with open(KERNELS) as fh:
            rows = json.load(fh).get("kernels") or []
    except (OSError, ValueError):
        return []
    return [(r["forward_tflops"], r["backward_tflops"]) for r in rows if r.get("ok")]


def stale_bold() -> list[str]:
    """Figures the docs' prose claims that are not current ('page: figure'): a length for a GPU count that no
    generated block holds, a kernel rate the committed probe did not measure (the module docstring's rules)."""
    texts = {p: open(p).read() for p in pages()}
    held = {int(n.replace(",", "")) for t in texts.values() for m in BLOCK.finditer(t)
            for n in re.findall(r"\d{1,3}(?:,\d{3}){2,}", m.group(3))}
    peaks = {f for t in texts.values() for m in BLOCK.finditer(t) for f in PEAK.findall(m.group(3))}
    rates = kernel_rates()
    out = []
    for p, t in texts.items():
        if os.path.basename(p) in HISTORY:
            continue
        body, page = prose(t), os.path.relpath(p, ROOT)
        for n in _claims(body):
            ok = (any(_near(n[:-1], h / 1e6) for h in held) if n.endswith("M")
                  else int(n.replace(",", "")) in held)
            if not ok:
                out.append(f"{page}: {n}")
        out += [f"{page}: {f} / {b} TFLOP/s" for f, b in RATE.findall(body)
                if not any(_near(f, rf) and _near(b, rb) for rf, rb in rates)]
        out += [f"{page}: {f} / 78" for f in PEAK.findall(body) if f not in peaks]
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Rerun the command of every generated block in docs/ and rewrite the "
                                 "blocks whose output changed (--check: list them, write nothing; exit 1 if any)")
    ap.add_argument("--check", action="store_true", help="only say which blocks are stale")
    check = ap.parse_args(argv if argv is not None else sys.argv[1:]).check
    try:
        stale = refresh(check)
    except subprocess.CalledProcessError as err:  # a block's command refused (its own one line) or failed
        why = (err.stderr or "").strip().splitlines()
        print(f"a block's command failed: {shlex.join(err.cmd[1:])}: {why[-1] if why else f'exit {err.returncode}'}")
        return 2
    for s in stale:
        print(f"{'stale' if check else 'regenerated'}: {s}")
    bold = stale_bold()
    for b in bold:
        print(f"a figure no generated block or measurement holds: {b}")
    return 1 if (check and stale) or bold else 0


if __name__ == "__main__":
    sys.exit(main())
