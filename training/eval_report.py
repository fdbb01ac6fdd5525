"""What scripts/evaluate.py writes of its results, on rank 0: OUTPUT_DIR/eval.json (each model's result in the in-run
JSON's shape, then `difference` = compare - model; strict JSON: null, never NaN), summary.md (the models, per task the
mean over depths by length and the difference, then every depth x length cell; the held-out conversation loss with
--heldout) and heatmaps.png (per task each model's depth x length heat map and their difference), and the line a
model's result is printed in (`said`, rounded as summary.md rounds it). The in-run evaluation's tables are
training/eval_tables.py (its `table` writes these too). No torch; matplotlib only for the heat maps.
"""

from __future__ import annotations

import json
import os

from training.eval_tables import table

ASKED = {"plain": "plain text", "template": "chat (its template)", "chatml": "chat (ChatML default)",
         "trained": "chat (the template file its run was prepared with)"}


def asked(mode: str) -> str:
    """How a model's tasks were asked, in words (`chat` of its result: a named template's name beside ASKED's)."""
    return ASKED.get(mode) or f"chat (its `{mode}` template)"


def said(out: dict) -> str:
    """A result as its line says it: each task's mean over depths by length as summary.md rounds it (`passkey 256:
    0.16`, not 0.15999999999999998), and the held-out conversation loss only with --heldout (`none`: none scored)."""
    return ", ".join([f"{t} " + " ".join(f"{n}: {m:.2f}" for n, m in by.items()) for t, by in out["task_mean"].items()]
                     + [f"held-out conversation loss {_loss(out)}"] * ("heldout_chat_tokens" in out))


def write_results(folder: str, results: list[dict], diff: dict | None) -> None:
    """eval.json strict as eval/stage{N}.json (training/metrics.strict: null, not a NaN jq refuses), summary.md."""
    from training.metrics import strict

    with open(os.path.join(folder, "eval.json"), "w") as fh:
        json.dump(strict({"models": results, **({"difference": diff} if diff is not None else {})}), fh, indent=1)
    with open(os.path.join(folder, "summary.md"), "w") as fh:
        fh.write("\n".join(summary(results, diff)) + "\n")


def difference(a: dict, b: dict) -> dict:
    """{task: {length: {depth: b - a}}} where both have the cell."""
    return {t: {n: {d: b["tasks"][t][n][d] - acc for d, acc in by_d.items() if d in b["tasks"][t].get(n, {})}
                for n, by_d in lens.items() if n in b["tasks"][t]}
            for t, lens in a["tasks"].items() if t in b["tasks"]}


def _loss(r: dict) -> str:
    """A result's held-out conversation loss as printed: `none` where the set had no supervised token."""
    return f"{r['heldout_chat_loss']:.4f}" if "heldout_chat_loss" in r else "none"


def summary(results: list[dict], diff: dict | None) -> list[str]:
    """The Markdown of summary.md: the models, then per task the mean over depths by length (and the
    difference), then every depth x length cell."""
    names = ["model", "compare"][: len(results)]
    out = ["# Evaluation", ""]
    out += table(["", "path", "kind", "RoPE", "trials per depth", "asked as"],
                  [[n, r["model"], r["kind"] + (f" (step {r['step']})" if "step" in r else ""), json.dumps(r["rope"]),
                    json.dumps(r["trials"]), asked(r.get("chat", "plain"))] for n, r in zip(names, results)])
    if any("heldout_chat_tokens" in r for r in results):
        rows = [[n, _loss(r), r["heldout_chat_tokens"], r["heldout_chat_conversations"],
                 r["heldout_chat_length"]] for n, r in zip(names, results) if "heldout_chat_tokens" in r]
        if all("heldout_chat_loss" in r for r in results) and len(rows) == 2:
            rows.append(["compare - model", f"{results[1]['heldout_chat_loss'] - results[0]['heldout_chat_loss']:+.4f}",
                         "", "", ""])
        out += ["", "**held-out conversation loss** (mean cross-entropy over the assistant's tokens):", ""]
        out += table(["", "loss", "supervised tokens", "conversations", "packed at"], rows)
    for task in dict.fromkeys(t for r in results for t in r["tasks"]):
        lengths = sorted({int(n) for r in results for n in r["tasks"].get(task, {})})
        rows = [[n, *[f"{r['task_mean'][task][str(m)]:.2f}" if str(m) in r["task_mean"].get(task, {}) else "-"
                      for m in lengths]] for n, r in zip(names, results)]
        if diff and task in diff:
            rows.append(["compare - model", *[f"{sum(c.values()) / len(c):+.2f}" if c else "-"
                                              for c in (diff[task].get(str(m), {}) for m in lengths)]])
        out += ["", f"**{task}** accuracy (mean over depths) by length:", ""] + table(["", *lengths], rows)
        cells = []
        for n, r in zip(names, results):
            acc = r["tasks"].get(task, {})
            cells += [[n, d, *[f"{acc[str(m)][d]:.2f}" if d in acc.get(str(m), {}) else "-" for m in lengths]]
                      for d in sorted({d for a in acc.values() for d in a}, key=float)]
        out += ["", f"**{task}** by depth and length:", ""] + table(["", "depth", *lengths], cells)
    return out


def heatmaps(results: list[dict], diff: dict | None, out: str) -> None:
    """Per task a row: each model's depth x length accuracy heat map, then compare - model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(t for r in results for t in r["tasks"]))
    panels = [(f"model: {os.path.basename(r['model'].rstrip('/'))}" if i == 0 else
               f"compare: {os.path.basename(r['model'].rstrip('/'))}", r["tasks"], "RdYlGn", 0, 1)
              for i, r in enumerate(results)]
    if diff is not None:
        panels.append(("compare - model", diff, "RdBu", -1, 1))
    fig, axes = plt.subplots(len(tasks), len(panels), figsize=(3.6 * len(panels) + 0.5, 2.8 * len(tasks)),
                             squeeze=False)
    for row, task in enumerate(tasks):
        for col, (title, data, cmap, lo, hi) in enumerate(panels):
            ax, acc = axes[row][col], data.get(task, {})
            if not acc:
                ax.axis("off")
                continue
            lengths = sorted(acc, key=int)
            depths = sorted({d for a in acc.values() for d in a}, key=float)
            z = [[acc[n].get(d, float("nan")) for n in lengths] for d in depths]
            image = ax.imshow(z, cmap=cmap, vmin=lo, vmax=hi, aspect="auto")
            for i, zr in enumerate(z):
                for j, v in enumerate(zr):
                    ax.text(j, i, f"{v:+.2f}" if lo < 0 else f"{v:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [f"{int(n) // 1024}k" if int(n) % 1024 == 0 else n for n in lengths],
                          fontsize=7)
            ax.set_yticks(range(len(depths)), depths, fontsize=7)
            ax.set_title(f"{task}, {title}", fontsize=8)
            ax.set_xlabel("length", fontsize=8)
            if col == 0:
                ax.set_ylabel("depth", fontsize=8)
            fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
