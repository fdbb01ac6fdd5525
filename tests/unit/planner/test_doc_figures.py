"""The docs quote only current figures (issue 49): every block a command generates (scripts/doc_figures.py's
markers: plan.py --compare's tables in docs/results/memory.md) equals the command's output now, and no length is
claimed in bold prose that no generated block holds. A planner change that moves a figure fails here until
`python scripts/doc_figures.py` is run."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
_spec = importlib.util.spec_from_file_location("doc_figures", os.path.join(ROOT, "scripts", "doc_figures.py"))
doc_figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doc_figures)


def test_every_generated_block_is_current_and_no_bold_length_is_stale():
    assert doc_figures.refresh(check=True) == []
    assert doc_figures.stale_bold() == []
    blocks = [m for p in doc_figures.pages() for m in doc_figures.BLOCK.finditer(open(p).read())]
    assert len(blocks) >= 2 and all(m.group(3).startswith("| GPUs") for m in blocks)


def test_a_stale_block_and_a_stale_bold_length_are_caught(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("Old: **1,198,361 tokens on one GPU**.\n\n<!-- generated: python scripts/plan.py --compare -->\n"
                    "| GPUs | old table |\n<!-- end generated -->\n")
    monkeypatch.setattr(doc_figures, "pages", lambda: [str(page)])
    assert doc_figures.refresh(check=True) == [f"{os.path.relpath(page, ROOT)}: python scripts/plan.py --compare"]
    assert doc_figures.stale_bold() == [f"{os.path.relpath(page, ROOT)}: 1,198,361"]
    assert doc_figures.refresh(check=False) and doc_figures.refresh(check=True) == []  # regenerated in place
    assert "| old table |" not in page.read_text()
