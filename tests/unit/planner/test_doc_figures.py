"""The docs quote only current figures (issue 49): every block a command generates (scripts/doc_figures.py's
markers: plan.py --compare's tables in docs/results/memory.md, the measured headline run against the planner
now in docs/memory_model_checks.md) equals the command's output now, and no length is
claimed in bold prose that no generated block holds. A planner change that moves a figure fails here until
`python scripts/doc_figures.py` is run."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
_spec = importlib.util.spec_from_file_location("doc_figures", os.path.join(ROOT, "scripts", "doc_figures.py"))
doc_figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doc_figures)


def test_every_generated_block_is_current_and_no_bold_length_is_stale():
    assert doc_figures.refresh(check=True) == []
    assert doc_figures.stale_bold() == []
    blocks = {(os.path.relpath(p, ROOT), m.group(2).strip()): m.group(3) for p in doc_figures.pages()
              for m in doc_figures.BLOCK.finditer(open(p).read())}
    # the tables issue 49 made generated: plan.py --compare's, the ALST cross-check and the measured headline run
    # against the planner now (scripts/plan_vs_run.py), none of them empty
    assert {("docs/results/memory.md", "python scripts/plan.py --compare"),
            ("docs/memory_model_checks.md", "python scripts/plan.py --alst_check"),
            ("docs/memory_model_checks.md", "python scripts/plan_vs_run.py bench/results/gpu.json")} <= set(blocks)
    assert all("|---|" in out for out in blocks.values())


def test_a_stale_block_and_a_stale_bold_length_are_caught(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("Old: **1,198,361 tokens on one GPU**.\n\n<!-- generated: python scripts/plan.py --compare -->\n"
                    "| GPUs | old table |\n<!-- end generated -->\n")
    monkeypatch.setattr(doc_figures, "pages", lambda: [str(page)])
    assert doc_figures.refresh(check=True) == [f"{os.path.relpath(page, ROOT)}: python scripts/plan.py --compare"]
    assert doc_figures.stale_bold() == [f"{os.path.relpath(page, ROOT)}: 1,198,361"]
    assert doc_figures.refresh(check=False) and doc_figures.refresh(check=True) == []  # regenerated in place
    assert "| old table |" not in page.read_text()


def test_the_forms_a_stale_figure_took_are_caught(tmp_path, monkeypatch):
    """The check matched only `**N,NNN,NNN tokens on one GPU**`; stale figures sat in the docs in other forms: the
    bold ending before "on one GPU", an "N.NM" figure, a copied table row, a kernel rate in prose. Each is caught
    now; the current figures, a generated block's, a history paragraph's and a non-claim (a configuration in bold
    without a GPU count) are not."""
    page = tmp_path / "page.md"
    block = "<!-- generated: python scripts/plan.py --compare -->\n| 32 | 17,580,160 |\n<!-- end generated -->\n"
    page.write_text("Old: **1,198,361 tokens** on one GPU and **19.4M on 32**.\n\n| GPUs | longest |\n|---|---|\n"
                    "| 8 | 6,076,328 |\n\nSDPA's cuDNN ran 485 / 562 TFLOP/s forward / backward.\n\n"
                    "Now: **17,580,160 tokens** on 32, **17.6M on 32**, 500.5 / 577.7 TFLOP/s and 500 / 578 TFLOP/s.\n"
                    "\n| 32 | 17,580,160 |\n\n**173 MiB for 9.3M tokens**.\n\n"
                    "History: **16,987,072 on 32** and 304 / 326 TFLOP/s on an older planner.\n\n" + block)
    monkeypatch.setattr(doc_figures, "pages", lambda: [str(page)])
    name = os.path.relpath(page, ROOT)
    assert doc_figures.stale_bold() == [f"{name}: 1,198,361", f"{name}: 19.4M", f"{name}: 6,076,328",
                                        f"{name}: 485 / 562 TFLOP/s"]


def test_the_measured_run_against_the_planner_goes_stale_with_its_json(tmp_path, monkeypatch):
    """The out-of-sample table is a function of the run's JSON and the planner: a changed measurement (here the
    step's recompute, in a copy) makes the block stale until it is regenerated."""
    data = json.load(open(os.path.join(ROOT, "bench", "results", "gpu.json")))
    run = tmp_path / "gpu.json"
    run.write_text(json.dumps(data))
    page = tmp_path / "page.md"
    cmd = f"python scripts/plan_vs_run.py {run}"
    page.write_text(f"<!-- generated: {cmd} -->\n<!-- end generated -->\n")
    monkeypatch.setattr(doc_figures, "pages", lambda: [str(page)])
    assert doc_figures.refresh(check=False) and doc_figures.refresh(check=True) == []
    measured = next(r["measured_gib"] for r in data["headline"]["rows"] if r["phase"] == "recompute")
    assert f"| recomputed forward (L1, L0) | {measured:.2f} |" in page.read_text()
    for row in data["headline"]["rows"]:
        if row["phase"] == "recompute":
            row["measured_gib"] = 60.0
    run.write_text(json.dumps(data))
    assert doc_figures.refresh(check=True) == [f"{os.path.relpath(page, ROOT)}: {cmd}"]


def test_a_failing_command_is_one_line(tmp_path, monkeypatch, capsys):
    """A block whose command refuses (here plan_vs_run.py on a JSON that is not there) stops doc_figures with that
    refusal in one line (exit 2), not a traceback."""
    page = tmp_path / "page.md"
    page.write_text(f"<!-- generated: python scripts/plan_vs_run.py {tmp_path / 'none.json'} -->\n"
                    "<!-- end generated -->\n")
    monkeypatch.setattr(doc_figures, "pages", lambda: [str(page)])
    assert doc_figures.main(["--check"]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "not a readable JSON file" in out and "Traceback" not in out


def test_prose_the_check_cannot_see_quotes_the_measurements():
    """Figures written before a GPU measured them, which no pattern marks: the arena's registration cost per GiB
    (docs/memory_model.md said "~0.1-0.5 s ... not yet measured on a GPU node"), the GPU page's RSS note (it said
    plan.py "assumes" 2 GiB of runtime; it uses the 1.98 measured), plan.py's --ring_attention help (it said the ring
    ran "the sdpa backend so far"; on a GPU it runs FA2)."""
    import importlib.util as iu

    from bench.gpu_page import render
    from planner.cluster import RUNTIME_HOST_GIB

    data = json.load(open(os.path.join(ROOT, "bench", "results", "gpu.json")))
    text = " ".join(open(os.path.join(ROOT, "docs", "memory_model.md")).read().split())
    assert "not yet measured on a GPU node" not in text
    assert all(f"{r['register_s_per_gib']:.3f} s per GiB at {r['gib']:.0f} GiB" in text for r in data["arena"]["rows"])
    page = render(data)
    assert "plan.py assumes" not in page and f"the {RUNTIME_HOST_GIB} GiB this run measured" in page
    assert page == open(os.path.join(ROOT, "docs", "results", "gpu.md")).read()  # the page is the renderer's
    spec = iu.spec_from_file_location("plan_help", os.path.join(ROOT, "scripts", "plan.py"))
    plan = iu.module_from_spec(spec)
    spec.loader.exec_module(plan)
    helps = " ".join(plan.build_parser().format_help().split())
    assert "sdpa backend so far" not in helps and "on a GPU flash-attn's FA2" in helps


def test_help_and_a_typo_rewrite_nothing(monkeypatch, capsys):
    """`--help` (or any other word) ran the whole regeneration and rewrote stale blocks in the checkout."""
    import pytest

    monkeypatch.setattr(doc_figures, "refresh", lambda check: pytest.fail("regenerated on --help"))
    for argv, code in ((["--help"], 0), (["--chek"], 2)):
        with pytest.raises(SystemExit) as e:
            doc_figures.main(argv)
        assert e.value.code == code
    assert "--check" in capsys.readouterr().out


def test_a_gpu_peak_in_prose_must_be_one_a_block_holds(tmp_path, monkeypatch):
    """docs/context_parallel.md quoted the 32-GPU row "at 70.20 of 78 GiB" after the row had moved to another length
    and peak: a peak against the 78 GiB budget in prose is now checked against the generated blocks' peaks."""
    page = tmp_path / "page.md"
    block = "<!-- generated: python scripts/plan.py --compare -->\n| 1 | 70.20 / 78, 7.80 |\n<!-- end generated -->\n"
    page.write_text("The row at 67.09\nof 78 GiB, another at 70.20 / 78 (current).\n\nHistory: 65.09 / 78.\n\n" + block)
    monkeypatch.setattr(doc_figures, "pages", lambda: [str(page)])
    assert doc_figures.stale_bold() == [f"{os.path.relpath(page, ROOT)}: 67.09 / 78"]
