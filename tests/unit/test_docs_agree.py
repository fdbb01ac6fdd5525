"""README.md and docs/ agree with the code and with each other: anchors, the demo's commands, the metrics' keys.

Every `page.md#anchor` link names a heading of that page, slugged as GitHub does (lower case, punctuation but `-` and
`_` dropped, spaces to `-`, a repeated heading `-1`, `-2` ...): docs/memory.md's link to memory_model.md's
`memory_features: auto` section named `trainingauto_featurespy` after the module moved to planner/auto_features.py
(it opened the page's top). README's demo block said it printed the evaluation summary and did not list the command
that does (the Makefile's third line); its metrics list missed keys metrics.jsonl writes; it named
`huggingface-cli`, which the pinned huggingface_hub no longer installs (`hf`)."""

from __future__ import annotations

import glob
import os
import re

from tests.distributed import ROOT


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    out, seen, fence = set(), {}, False
    with open(path) as fh:
        for line in fh:
            if line.startswith("```"):
                fence = not fence
            m = None if fence else re.match(r"#{1,6} (.*)", line)
            if m:
                s = slug(m[1])
                out.add(f"{s}-{seen[s]}" if s in seen else s)
                seen[s] = seen.get(s, 0) + 1
    return out


def test_every_anchor_link_names_a_heading():
    pages = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)]
    bad = []
    for page in pages:
        with open(page) as fh:
            text = fh.read()
        for m in re.finditer(r"\]\(([^)\s#]*\.md)?#([^)\s]+)\)", text):
            target = os.path.normpath(os.path.join(os.path.dirname(page), m[1])) if m[1] else page
            if os.path.exists(target) and m[2] not in anchors(target):
                bad.append(f"{os.path.relpath(page, ROOT)}: {m[1] or ''}#{m[2]}")
    assert not bad, bad


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as fh:
        return fh.read()


def test_the_readme_demo_block_is_the_makefiles_demo():
    with open(os.path.join(ROOT, "Makefile")) as fh:
        make = fh.read()
    recipe = make.split("\ndemo:\n", 1)[1].split("\n\n", 1)[0]
    want = [ln.strip().lstrip("@").replace("$(PY)", ".venv/bin/python").replace(" --master_port $(MASTER_PORT)", "")
            for ln in recipe.splitlines()]  # make's free port (tests/unit/test_makefile.py); by hand, the README says
    text = _readme()
    block = text.split("## The main job: `make demo`", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    got = [ln.replace(" DS_ACCELERATOR=cpu", "") for ln in block.strip().splitlines()]  # the Makefile exports it
    assert got == want, (got, want)
    minutes = re.search(r"A run takes (\d+):\d\d wall on 2 idle cores", text)
    assert minutes and f"# The main job (~{minutes[1]} min on 2 idle cores" in make


def test_the_readme_names_every_key_of_a_step_record_and_the_hub_cli_there_is():
    from tests.unit.model_utils.test_sft_loss import log_steps

    logged, _, _ = log_steps([{"loss": 1.0, "label_tokens": 8, "step_time": 0.5}], sp=1, seq_len=8,
                             shares={"stream": 1.0})
    text = _readme()
    metrics = text.split("- **Metrics**:", 1)[1].split("\n- **", 1)[0]
    assert not [k for k in logged[0] if f"`{k}`" not in metrics], metrics
    assert "huggingface-cli" not in text and "`hf download <id>`" in text
