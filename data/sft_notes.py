"""What an SFT stage's data says about long context, printed once at start-up (data/pipeline.open_run_data):

- `retention_note`: an SFT stage shorter than the model's positions (max_position_embeddings: the model was extended
  past what this stage trains) that mixes no long data, neither `tasks`, `replay`, nor a component whose tokens lie
  mostly in documents of at least a quarter of the stage's length: short SFT alone loses retrieval past its length
  (docs/sft.md#retention-after-sft), and nothing said so;
- `eval_reach_note`: an SFT stage of a model with more positions than the run's longest stage whose `eval.lengths`
  stop short of them (a standalone SFT of an already-extended model: `earlier` is the stage's own length), so what
  the SFT loses between its length and the model's positions is never scored (it was silent, tasks or not);
- `loss_share_note`: with more than one component, each component's expected share of the loss under the stage's
  weighting and the other, said under `loss_weighting: conversation` always and under `token` (the default) where a
  component's share is far below its share of the samples. By conversation every conversation weighs alike, and so
  does every piece of a long text document: a books component at 5% of the samples (one ~1-piece unit a 128k sample,
  against ~94 UltraChat-like chats in a chat sample) carries ~0.06% of the loss, not 5%; by token a long-QA component
  (long documents, 100-token answers) at 10% carries ~0.03% (docs/sft.md#loss-shares-by-component). Said, not
  changed: a resumed run would change its loss.

Cost: the counts of the component packs open_run_data builds anyway (documents and supervised tokens per sample: no
extra pass; packing
200k UltraChat-like conversations into 1M-token samples took 0.18 s here) and, for the retention note, one
O(documents) selection per component over the lengths already loaded (milliseconds at millions of documents).
"""

from __future__ import annotations

import numpy as np

from data.mixture import parse_mixture, select_documents
from data.replay import parse_replay
from data.tasks import eval_lengths, parse_tasks

LONG_DOC = 4  # a document of at least 1/LONG_DOC of the stage's length counts as long data for retention


def _reach(rope) -> int | None:
    """The positions a RoPE scaling reaches, factor x original_max_position_embeddings (the most over a per-layer-type
    setting's), None where it gives neither (ABF alone, no scaling)."""
    if not isinstance(rope, dict):
        return None
    parts = [v for v in rope.values() if isinstance(v, dict)] or [rope]
    got = [int(p["factor"] * p["original_max_position_embeddings"]) for p in parts
           if isinstance(p.get("factor"), (int, float)) and isinstance(p.get("original_max_position_embeddings"), int)]
    return max(got) if got else None


def model_positions(model_path: str | None) -> int | None:
    """The model's positions (its text config's for a composite one): max_position_embeddings or its RoPE scaling's
    reach (`rope_scaling` / `rope_parameters`: Qwen2.5-Instruct's YaRN x4 over 32768 reaches 131072), the larger, from
    a preset name or a model folder's config.json (the run resolves a hub id to its folder first); None where it
    cannot be read."""
    from planner.shapes import load_config

    if not model_path:
        return None
    try:
        config = load_config(model_path)
    except ValueError:
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n = text.get("max_position_embeddings", config.get("max_position_embeddings"))
    reach = _reach(text.get("rope_scaling") or text.get("rope_parameters"))
    n = n if isinstance(n, int) else None
    return max(n, reach) if n and reach else n or reach


def _long(lens: np.ndarray, length: int) -> bool:
    """Half or more of the tokens are in documents of at least length / LONG_DOC (a long-text or long-QA component)."""
    lens = np.asarray(lens, np.int64)
    return bool(len(lens)) and lens[lens >= length // LONG_DOC].sum() * 2 >= lens.sum()


def retention_note(stage, prepared, positions: int | None) -> str:
    """One line where an SFT stage of a model with more positions than its length mixes no long data; '' otherwise.
    `prepared`: the run's data/store.Prepared (its sources, documents' sources and lengths)."""
    L = stage.max_seq_length
    if getattr(stage, "kind", "text") != "sft" or not positions or positions <= L:
        return ""
    where = f"stage {stage.index} ({stage.name})"
    if parse_tasks(getattr(stage, "tasks", None), f"{where} tasks") or parse_replay(getattr(stage, "replay", None), L, f"{where} replay"):
        return ""
    comps = parse_mixture(getattr(stage, "data", None)) or []
    lens = [prepared.lens[select_documents(c, prepared.sources, prepared.source, prepared.lens)] for c in comps] \
        or [prepared.lens]  # no `data:`: the whole stream
    if any(_long(x, L) for x in lens):
        return ""
    return (f"note: {where}: SFT at {L} tokens mixes no long data (no tasks / replay / component with most tokens in "
            f"documents of {L // LONG_DOC}+) on a model of {positions} positions: short SFT alone loses retrieval past "
            f"{L} (docs/sft.md#retention-after-sft: add `tasks: {{passkey: 0.02}}`, a long component or `replay`)")


def eval_reach_note(stage, positions: int | None, stages=None) -> str:
    """One line where an SFT stage's model (`positions`; the stage's own RoPE scaling's reach where it sets one) has
    more positions than the run's longest stage and the stage's retrieval tasks are evaluated only short of them
    (training/evaluation.eval_lengths: `earlier` is the lengths up to the stage's); '' otherwise. `stages`: the run's
    (None: only what the stage decides alone, its explicit lengths or `earlier` as the first stage). The default
    lengths stay: a forward at the model's positions costs that length's memory (training/device_fit checks it)."""
    L, ev = stage.max_seq_length, getattr(stage, "eval", None) or {}
    if getattr(stage, "kind", "text") != "sft":
        return ""
    rope = getattr(stage, "rope", None)
    if rope:  # the stage sets the model's positions itself (a 1M model cut back to 128k: said at start-up)
        positions = _reach(rope)
    spec, trials = ev.get("tasks", ["passkey"]), ev.get("passkey_trials", 2)
    asks = any(v > 0 for v in spec.values()) if isinstance(spec, dict) else bool(spec) and trials > 0
    lengths = ev.get("lengths", "earlier")
    run = [s.max_seq_length for s in stages or [stage]]
    if not (stages or isinstance(lengths, list) or lengths == "earlier" and stage.index == 0):
        return ""  # the run's other stages unknown here
    reach = max(eval_lengths(stage, stages or [stage]), default=0)
    if not asks or not positions or positions <= max(run) or reach >= positions:
        return ""
    return (f"note: stage {stage.index} ({stage.name}): retrieval is evaluated up to {reach} (eval.lengths "
            f"{lengths}) on a model of {positions} positions, so what SFT at {L} loses past {reach} is never scored: "
            f"give the stage `eval: {{lengths: [{L}, {positions}]}}` (a forward at {positions}: its memory is checked "
            f"at start-up, training/device_fit.py) or run `scripts/evaluate.py CHECKPOINT --lengths {positions}` after "
            "the run (docs/sft.md#retention-after-sft)")


FAR = 4  # a component whose share of the loss is under 1/FAR of its share of the samples is said


def _shares(rows: list[tuple[str, float, float]]) -> dict[str, float]:
    total = sum(s * x for _, s, x in rows) or 1.0
    return {n: s * x / total for n, s, x in rows}


def loss_share_note(stage, mix) -> str:
    """Each component's (and task's) expected share of the loss under the stage's weighting and the other one, where
    the stage weighs by conversation (always, 2+ components) or by token and a component's share is under 1/FAR of
    its share of the samples; '' otherwise. Conversation: its share of the samples x its units (conversations, text
    pieces: documents with a target) per packed sample, normalised; token: x its supervised tokens per packed sample
    (ConvPack.n_targets; tasks' few answer tokens not counted). At 128k, 90% UltraChat-like chats (~72k supervised
    tokens, ~85 conversations a sample) and 10% long QA (30k-100k documents, 100-token answers: ~200, 2 a sample)
    give long QA 0.03% of the loss by token, 0.25% by conversation; books at 5% carry ~0.06% by conversation, ~7% by
    token: the advice names the weighting that raises the component's share, and its weight in `data:`. `mix`: the
    stage's data/mixture.MixtureDataset (None without `data:`); replay's shorter samples are left out (said)."""
    parts = getattr(mix, "parts", None) or []
    if len(parts) < 2 or not all(hasattr(p, "order") for p in parts):  # a text stage's DocPacks: nothing to weigh
        return ""
    conv = getattr(stage, "loss_weighting", "token") == "conversation"
    tokens = all(hasattr(p, "n_targets") for p in parts)
    if not conv and not tokens:
        return ""
    where = f"stage {stage.index} ({stage.name})"
    tasks = parse_tasks(getattr(stage, "tasks", None), f"{where} tasks")
    weights = [c.weight for c in parse_mixture(stage.data, f"{where} data")]
    rest = 1.0 - sum(tasks.values())
    comps = [(n, rest * w / sum(weights), p) for n, w, p in zip(mix.names, weights, parts)]
    units = [(n, s, len(p.order) / max(1, len(p))) for n, s, p in comps] + [(t, f, 1.0) for t, f in tasks.items()]
    sup = [(n, s, p.n_targets / max(1, len(p))) for n, s, p in comps] if tokens else []
    by_conv, by_tok = _shares(units), _shares(sup) if tokens else {}
    cur, other = (by_conv, by_tok) if conv else (by_tok, by_conv)
    far = [(n, s) for n, s, _ in comps if cur[n] * FAR < s]
    if not conv and not far:
        return ""
    if conv:
        head = ("every conversation and every piece of a text document weighs alike, so the expected share of the loss "
                "is " + ", ".join(f"{n} {by_conv[n]:.4f} ({s:.3f} of the samples x {u:.1f} a sample)" for n, s, u in units))
    else:
        head = ("every supervised token weighs alike, so the expected share of the loss is " + ", ".join(
            f"{n} {by_tok[n]:.4f} ({s:.3f} of the samples x {t:.0f} supervised tokens a sample)" for n, s, t in sup)
            + ("; tasks' few answer tokens not counted" if tasks else ""))
    name = "token" if conv else "conversation"
    said = f"; under `loss_weighting: {name}`: " + ", ".join(f"{n} {v:.4f}" for n, v in other.items()) if other else ""
    why = "long text: one unit a piece" if conv else "long documents, short answers: few supervised tokens each"
    advice = "; ".join(f"{n} trains {cur[n]:.4f} of the loss at {s:.3f} of the samples: "
                       + (f"`loss_weighting: {name}` gives it {other[n]:.4f} ({why}), or raise its weight in `data:`"
                          if other.get(n, 0) >= 2 * cur[n] else "raise its weight in `data:`") for n, s in far)
    return (f"note: {where} at {stage.max_seq_length}, loss_weighting {'conversation' if conv else 'token'}: {head}{said}"
            + ("; replay's shorter samples not counted" if getattr(stage, "replay", None) else "")
            + (f": {advice}" if advice else "") + " (docs/sft.md#loss-shares-by-component)")


def sft_notes(stage, mix, prepared, model_path: str | None, stages=None) -> list[str]:
    """The notes above for one stage (open_run_data prints them; `stages`: the run's, for eval_reach_note)."""
    positions = model_positions(model_path)
    return [n for n in (retention_note(stage, prepared, positions), eval_reach_note(stage, positions, stages),
                        loss_share_note(stage, mix)) if n]
