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
from our own pages). A length claimed in bold prose ("**1,109,646 tokens on one GPU**") must be one a block holds: `stale_bold`
lists the others (history is written plain, in docs/results/LOG.md).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
BLOCK = re.compile(r"(<!-- generated: (python scripts/[^>]*?) -->\n)(.*?)(<!-- end generated -->)", re.S)
# a length claimed in prose: "**1,109,646 tokens on one GPU**", "**6,075,872 on 8**"
BOLD_LENGTH = re.compile(r"\*\*(\d{1,3}(?:,\d{3}){2}) (?:tokens )?on (?:one GPU|\d+)[^*]*\*\*")


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


def stale_bold() -> list[str]:
    """Bold multi-million figures in the docs that no generated block holds ('page: figure')."""
    texts = {p: open(p).read() for p in pages()}
    current = {n for t in texts.values() for m in BLOCK.finditer(t) for n in re.findall(r"\d{1,3}(?:,\d{3}){2,}",
                                                                                          m.group(3))}
    return [f"{os.path.relpath(p, ROOT)}: {n}" for p, t in texts.items() for n in BOLD_LENGTH.findall(t)
            if n not in current]


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (argv if argv is not None else sys.argv[1:])
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
        print(f"a bold figure no generated block holds: {b}")
    return 1 if (check and stale) or bold else 0


if __name__ == "__main__":
    sys.exit(main())
