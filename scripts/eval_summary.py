"""Print a run's evaluation summary: what `make demo` and `make demo-sft` end with, so a newcomer sees the result
without going to find it.

    python scripts/eval_summary.py checkpoints/tiny_cpu_sft

The tables are those of OUTPUT_DIR/eval/summary.md (training/eval_tables.py `eval_tables`), rebuilt from the stages'
records OUTPUT_DIR/eval/stage{N}.json (each stage's latest evaluation, the same record metrics.jsonl holds as an
`"event": "eval"` line), preceded by one line from the first evaluated stage to the last (the "before" and the
"after": the held-out loss at the first stage's length and at the last stage's own length; in a curriculum with an
SFT stage the held-out conversation loss on the assistant's tokens, `chat_loss` in the table; each task's accuracy
at each length the last stage tried, against the latest earlier stage that tried that length, a fall of 0.2 or more
flagged DROPPED). A before -> after of held-out losses is over the same samples only where both records
were scored on the same sample count (training/evaluation.py retention_samples): records that differ are printed
side by side and said not to compare; records from before the count was written are said to be unknown. Reads a few small JSON files
(one per stage): nothing at any scale. A folder without records, or a record that is not JSON, is refused in one
line naming it (exit 2), and so is a record missing its step or length; one without a stage name shows its number.
"""

from __future__ import annotations

import json
import os
import sys


def records(output_dir: str) -> list[dict]:
    """The stages' evaluation records, in stage order; ValueError (one line) when there are none."""
    folder = os.path.join(output_dir, "eval")
    names = sorted((n for n in (os.listdir(folder) if os.path.isdir(folder) else [])
                    if n.startswith("stage") and n.endswith(".json") and n[5:-5].isdigit()), key=lambda n: int(n[5:-5]))
    if not names:
        raise ValueError(f"{output_dir}: no evaluation records ({folder}/stage*.json): name a run's --output_dir "
                         "whose stages have ended")
    out = []
    for n in names:
        path = os.path.join(folder, n)
        try:
            with open(path) as fh:
                rec = json.load(fh)
        except (OSError, ValueError) as e:  # a torn or hand-edited record: name the file, not only the JSON error
            raise ValueError(f"{path}: not a readable evaluation record ({e}): restore it or remove it") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: not an evaluation record (a JSON object): restore it or remove it")
        out.append(_checked(rec, path, int(n[5:-5])))
    return out


LOSSES = ("heldout_loss", "heldout_loss_first_len", "heldout_chat_loss")  # printed as numbers where present


def _checked(rec: dict, path: str, stage: int) -> dict:
    """`rec` with its stage (from the file's name) and stage name (the stage number: a record without one) filled in;
    ValueError (one line naming the file) where a key the tables print is missing or of the wrong kind."""
    rec = {"stage": stage, **rec}
    rec.setdefault("stage_name", str(rec["stage"]))
    bad = [k for k in ("step", "seq_len") if k not in rec]
    bad += [k for k in LOSSES if k in rec and (isinstance(rec[k], bool) or not isinstance(rec[k], (int, float)))]
    tm = rec.get("task_mean", {})
    if not isinstance(tm, dict) or not all(isinstance(v, dict) for v in tm.values()):
        bad.append("task_mean")
    if bad:
        raise ValueError(f"{path}: not an evaluation record ({', '.join(bad)} missing or not what training writes): "
                         "restore it or remove it")
    return rec


def headline(rows: list[dict]) -> list[str]:
    """First evaluated stage -> last: the held-out loss and each task's accuracy (mean over depths) at each length
    both stages tried."""
    from training.eval_tables import counts_differ

    a, b = rows[0], rows[-1]

    def moved(key: str) -> str:  # before -> after where both scored the same samples, else both numbers and why not
        why = counts_differ([a, b], key)
        if why and "not recorded" not in why:
            return f"{a[key]:.4f} and {b[key]:.4f} {why}"
        return f"{a[key]:.4f} -> {b[key]:.4f}" + (f" ({why})" if why else "")

    where = f"stage {a['stage']} ({a['stage_name']}) -> stage {b['stage']} ({b['stage_name']})"
    out = []
    first = a.get("first_len")
    if first is not None and b.get("first_len") == first and "heldout_loss_first_len" in a and \
            "heldout_loss_first_len" in b:  # retention: the same samples where both counts agree
        out.append(f"held-out loss at {first}: {moved('heldout_loss_first_len')}")
    if "heldout_loss" in b and b["seq_len"] != first:
        out.append(f"held-out loss at {b['seq_len']} (the last stage's length): {b['heldout_loss']:.4f}")
    same = all(r.get("heldout_chat_loss") == r.get("heldout_loss_first_len") for r in (a, b))  # said just above
    if "heldout_chat_loss" in a and "heldout_chat_loss" in b and not same:  # the same conversations before and after
        out.append(f"held-out conversation loss (assistant tokens) at {b['heldout_chat_len']}: "
                   f"{moved('heldout_chat_loss')}")
    out += task_moves(rows)
    return [f"{where}: " + "; ".join(out)] if out and len(rows) > 1 else []


DROP = 0.2  # a fall of this much accuracy (mean over depths) at one length is flagged DROPPED


def task_moves(rows: list[dict]) -> list[str]:
    """Each task at each length the last record tried, against the latest earlier record that tried that length (not
    only the first stage's lengths: a curriculum 128k -> 1M -> SFT at 128k loses 1M in its last stage, which the first
    record never tried); a fall of DROP or more is flagged DROPPED. The "before" is named when it is not the first
    record."""
    b, out = rows[-1], []
    for task, lens in b.get("task_mean", {}).items():
        for n in sorted(lens, key=int):
            a = next((r for r in reversed(rows[:-1]) if n in r.get("task_mean", {}).get(task, {})), None)
            if a is None:
                continue
            before, after = a["task_mean"][task][n], lens[n]
            since = "" if a is rows[0] else f" (after stage {a['stage']} {a['stage_name']})"
            if a.get("task_seeds") != b.get("task_seeds"):  # trials seeded another way (before 2026-11-30)
                out.append(f"{task} at {n}: {before:.2f}{since} and {after:.2f} (other questions: one record's "
                           "trials were seeded another way, not compared)")
                continue
            shared = shared_cells(a, b, task, n)
            if shared is None:
                out.append(f"{task} at {n}: {before:.2f}{since} and {after:.2f} (no depth in common, not compared)")
                continue
            before, after, note = shared
            fell = before - after >= DROP - 1e-9
            out.append(f"{task} at {n}: {before:.2f}{since} -> {after:.2f}{note}" + (" DROPPED" if fell else ""))
    return out


def shared_cells(a: dict, b: dict, task: str, n: str) -> tuple[float, float, str] | None:
    """(before, after, what was compared) of `task` at length `n` over the questions both records asked: the same
    (depth, trial) cells (a trial is seeded by its task, length, depth and index: the first k trials of a depth are the
    same questions in every record), from each record's `task_hits`; a record without them (before 2026-11-30) by its
    accuracy at each depth both asked. Each record's own mean over depths compared a 3 depths x 4 trials stage with a
    5 x 10 one (tiny_cpu_extend): 1.00 -> 0.60 DROPPED where every shared cell was 1.00 -> 1.00. None: no depth in
    common."""
    acc_a, acc_b = (r.get("tasks", {}).get(task, {}).get(n) for r in (a, b))
    if not acc_a or not acc_b:  # no depths recorded: the means as they are
        return a["task_mean"][task][n], b["task_mean"][task][n], ""
    depths = sorted(set(acc_a) & set(acc_b), key=float)
    if not depths:
        return None
    hits_a, hits_b = (r.get("task_hits", {}).get(task, {}).get(n) for r in (a, b))
    if hits_a and hits_b and all(d in hits_a and d in hits_b for d in depths):
        k = min(min(len(hits_a[d]), len(hits_b[d])) for d in depths)  # the first k trials: the same questions
        cells = [(hits_a[d][:k], hits_b[d][:k]) for d in depths]
        before, after = (sum(c[j].count("1") for c in cells) / max(1, k * len(depths)) for j in (0, 1))
        asked = [f"{len(h)} x {len(next(iter(h.values())))}" for h in (hits_a, hits_b)]
        same = asked[0] == asked[1] == f"{len(depths)} x {k}"
        return before, after, "" if same else (f" (over the {len(depths)} x {k} depth x trial cells both asked; the "
                                               f"records asked {asked[0]} and {asked[1]})")
    before, after = (sum(acc[d] for d in depths) / len(depths) for acc in (acc_a, acc_b))
    same = len(depths) == len(acc_a) == len(acc_b)
    return before, after, "" if same else (f" (over the {len(depths)} depths both asked, of {len(acc_a)} and "
                                           f"{len(acc_b)}; trials per depth not recorded)")


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python scripts/eval_summary.py OUTPUT_DIR  (a run's evaluations: eval/*.json, as tables)",
              file=sys.stderr if len(argv) != 1 else sys.stdout)
        return 2 if len(argv) != 1 else 0
    try:
        rows = records(argv[0])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from training.eval_tables import eval_tables

    print(f"\nEvaluation of {argv[0]} ({os.path.join(argv[0], 'eval', 'summary.md')}):")
    print("\n".join(headline(rows) + [""] + eval_tables(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
