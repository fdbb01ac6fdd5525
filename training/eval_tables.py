"""eval/summary.md's tables from the stages' eval/stage{N}.json results (MetricsLogger writes it at each evaluation,
scripts/eval_summary.py prints it): held-out losses by stage, the tasks' accuracy by evaluated length, the held-out
loss by context position; and why two stages' held-out losses may not be comparable. Split out of
training/metrics.py."""

from __future__ import annotations


def table(head: list, rows: list[list]) -> list[str]:
    """A Markdown table: the header, its rule, a line per row (cells as str() writes them)."""
    return ["| " + " | ".join(str(h) for h in head) + " |", "|" + "---|" * len(head),
            *["| " + " | ".join(str(c) for c in r) + " |" for r in rows]]


# the held-out losses compared across stages, and the record key of the sample count each was scored on
# (training/evaluation.py retention_samples; records before it have none)
SAMPLE_COUNTS = {"heldout_loss_first_len": "heldout_first_len_samples", "heldout_chat_loss": "heldout_chat_samples"}


def counts_differ(rows: list[dict], key: str) -> str | None:
    """Why the `key` losses of `rows` (two stages or more) may not be over the same held-out samples, in words: scored
    on different sample counts, or a count not recorded (an evaluation from before counts were written); None when
    every row has the same count."""
    counts = [r.get(SAMPLE_COUNTS[key]) for r in rows if key in r]
    if len(counts) < 2 or len(set(counts)) == 1 and counts[0] is not None:
        return None
    if None in counts:
        return "sample counts not recorded, an evaluation from before they were: the same samples only where the " \
               "stages' heldout_samples were equal"
    return f"scored on {' / '.join(str(c) for c in counts)} held-out samples: other samples, not compared"


def _loss3(x) -> str:
    """A position bucket's loss; `-` for one no token reached: null in a record (strict JSON), NaN in one written
    before it was (a bare NaN, which json.load reads)."""
    return "-" if x is None or x != x else f"{x:.3f}"


def eval_tables(rows: list[dict]) -> list[str]:
    """The Markdown of eval/summary.md from the stages' eval/stage{N}.json results, in stage order."""
    def acc(x) -> str:  # a cell never evaluated (a depth or a length another stage tried): `-`, never `nan`
        return "-" if x is None else f"{x:.2f}"

    depths = sorted({d for r in rows for d in r.get("passkey_accuracy", {})}, key=float)
    first = next((r["first_len"] for r in rows if "first_len" in r), None)
    chat = next((r["heldout_chat_len"] for r in rows if "heldout_chat_len" in r  # a curriculum with SFT: the column
                 and any(q.get("heldout_chat_loss") != q.get("heldout_loss") for q in rows)), None)  # unless a copy
    head = ["stage", "name", "step", "seq_len", "heldout_loss", f"heldout_loss@{first}",
            *[f"chat_loss@{chat}"] * (chat is not None), *[f"passkey@{d}" for d in depths]]
    head_keys = ["heldout_loss_first_len", *["heldout_chat_loss"] * (chat is not None)]

    def loss(r: dict, key: str) -> str:  # none: nothing was held out (or scored) for it, never a 0.0
        return f"{r[key]:.4f}" if key in r else "none"

    out = table(head, [[r["stage"], r["stage_name"], r["step"], r["seq_len"], loss(r, "heldout_loss"),
                         loss(r, "heldout_loss_first_len"), *[loss(r, "heldout_chat_loss")] * (chat is not None),
                         *[acc(r.get('passkey_accuracy', {}).get(d)) for d in depths]] for r in rows])
    for key, col in (("heldout_loss_first_len", f"heldout_loss@{first}"), ("heldout_chat_loss", f"chat_loss@{chat}")):
        why = counts_differ(rows, key) if key in head_keys else None
        if why and any(SAMPLE_COUNTS[key] in r for r in rows):  # records all from before counts: eval_summary says it
            out += ["", f"{col}: {why}"]
    tasks = list(dict.fromkeys(t for r in rows for t in r.get("task_mean", {})))
    for task in tasks:
        lengths = sorted({int(n) for r in rows for n in r.get("task_mean", {}).get(task, {})})
        out += ["", f"**{task}** accuracy (mean over depths) by evaluated length, after each stage:", ""]
        out += table(["stage", "trained at", *lengths],
                      [[r["stage"], r["seq_len"], *[acc(r['task_mean'][task].get(str(n))) for n in lengths]]
                       for r in rows if task in r.get("task_mean", {})])
    with_pos = [r for r in rows if r.get("heldout_loss_by_position")]
    if with_pos:
        out += ["", "held-out loss by context position (a token's position in its document, in equal slices of the "
                "stage's length, first to last; * by offset in the sample: positions not restarted at documents "
                "(--reset_position_ids no), or a stage evaluated before 2026-11-29):"]
    for nb in sorted({len(r["heldout_loss_by_position"]) for r in with_pos}):  # a table per slice count: a 4-slice
        out += [""] + table(["stage", "seq_len", *[f"{i + 1}/{nb}" for i in range(nb)]],  # stage's quarters
                             [[f"{r['stage']}{'' if r.get('position_by') == 'document' else '*'}", r["seq_len"],
                               *[_loss3(x) for x in r["heldout_loss_by_position"]]]
                              for r in with_pos if len(r["heldout_loss_by_position"]) == nb])  # are not eighths
    return out
